"""The text ``feedpipe ledger`` prints of a ledger's report (:func:`~feedpipe.check_ledger`)."""

from __future__ import annotations

from typing import Any

SHOW = 5  # ids the text shows per finding (the JSON document lists them all)


def ledger_text(report: dict[str, Any]) -> str:
    """The report as the ``feedpipe ledger`` command prints it."""
    runs = f"{len(report['runs'])} run{'s' if len(report['runs']) != 1 else ''}"
    mix, packed, clips = report.get("mixture"), report.get("packed"), report.get("clips")
    if clips is not None:
        lines = [f"ledger {report['ledger']}: video clips, {clips['clips_per_video']} of "
                 f"{clips['frames']} frames from each of {clips['videos']:,} videos; {runs}"]
    elif packed is not None:
        lines = [f"ledger {report['ledger']}: Packed rows of {packed['seq_len']:,} tokens "
                 f"(packing {packed['packing']!r}) of {packed['documents']:,} documents, "
                 f"{packed['tokens']:,} tokens; {runs}"]
    elif mix is None:
        lines = [f"ledger {report['ledger']}: {report['samples']:,} samples, {runs}"]
    else:
        what = ", ".join(f"{name} ({size:,} samples, {draws:,} drawn an epoch)" for name, size,
                         draws in zip(mix["sources"], mix["sizes"], mix["draws"]))
        lines = [f"ledger {report['ledger']}: a mixture of {what}; {runs}"]
    for u in report["unreadable"]:
        lines.append(f"  UNREADABLE part {u['part']}: {u['why']} (what it recorded is unknown)")
    for m in report["missing"]:
        lines.append(f"  MISSING: {m['why']}")
    for rp in report["replays"]:
        lines.append(f"  restart: {rp['why']}")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    for e in report["epochs"]:
        lines.extend(_epoch_lines(e, report["samples"], "mixture" if mix is not None else
                                  "packed" if packed is not None else
                                  "clips" if clips is not None else "dataset"))
    skipped = sum(e["skipped"]["count"] for e in report["epochs"])
    also = f" ({skipped:,} samples skipped by the transform, named above)" if skipped else ""
    lines.append(f"OK: every finished epoch exactly once{also}" if report["ok"] else
                 "NOT exactly once: see above")
    return "\n".join(lines)


def _epoch_lines(e: dict[str, Any], samples: int, kind: str = "dataset") -> list[str]:
    state = f"finished: {e['why_finished']}" if e["finished"] else "not finished"
    extra = [f"{e[k]} {k.replace('_', ' ')}" for k in ("rolled_back", "padding", "dropped")
             if e[k]]
    if e["skipped"]["count"]:
        extra.insert(0, f"{e['skipped']['count']:,} skipped by the transform (ids "
                        f"{_ids_text(e['skipped']['ids'])})")
    parts = f"{e['parts']} part{'s' if e['parts'] != 1 else ''}"
    # a mixture's epoch holds some samples more than once: its deliveries against its draws
    got, of = {"mixture": (e["delivered"], e["expected"]),
               "packed": (e["distinct"], e["expected"]),
               "clips": (e["distinct"], e["expected"])}.get(kind, (e["distinct"], samples))
    unit = {"packed": " rows", "clips": " clips"}.get(kind, "")
    head = (f"  epoch {e['epoch']} ({state}, {parts}): {got:,} of {of:,}{unit} "
            f"delivered{'; ' + ', '.join(extra) if extra else ''}")
    if e["exactly_once"]:
        return [head + (" - exactly once" if e["finished"] else " - no repeat so far")]
    lines = [head]
    for m in e["missing"]:
        lines.append(f"    MISSING: {m['why']}")
    for what in ("repeats", "losses"):
        f = e[what]
        if f and f["count"]:
            lines.append(_finding_line(what, f))
    return lines


def _finding_line(what: str, f: dict[str, Any]) -> str:
    """One finding (``what``: repeats or losses): how many, which, and the parts involved."""
    # a mixture's: the draws found (an id of a source drawn twice may be lost twice)
    count = sum(map(len, f["sources"].values())) if "sources" in f else f["count"]
    name = what[:-1] if count == 1 else what
    ids = (", ".join(f"{s} ids {_ids_text(v)}" for s, v in f["sources"].items())
           if "sources" in f else f"ids {_ids_text(f['ids'])}")
    if "pieces" in f:  # a Packed's rows: the tokens of documents they hold
        name = ("repeated" if what == "repeats" else "lost") + (" row" if count == 1 else " rows")
        ids = f"rows {_ids_text(f['ids'])}, {f['tokens']:,} tokens: {_pieces(f)}"
    if "clips" in f:  # a VideoClips' ids: (video, clip)
        name = ("repeated" if what == "repeats" else "lost") + (" clip" if count == 1 else " clips")
        ids = f"clips (video, clip) {_ids_text([tuple(c) for c in f['clips']])}"
    return f"    {count:,} {name}, {ids}; parts: {'; '.join(f['parts']) or '-'}"


def _pieces(f: dict[str, Any]) -> str:
    """A Packed finding's pieces of documents, the first few."""
    ps = f["pieces"]
    text = ", ".join(f"document {d} tokens [{s:,}, {s + k:,})" for d, s, k in ps[:SHOW])
    more = f" and {len(ps) - SHOW:,} more pieces (--json lists them all)" if len(ps) > SHOW else ""
    return text + more


def _ids_text(ids: list[Any]) -> str:
    more = f" and {len(ids) - SHOW:,} more (--json lists them all)" if len(ids) > SHOW else ""
    return f"{ids[:SHOW]}{more}"
