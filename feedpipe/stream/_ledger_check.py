"""``check_ledger(DIR)``: prove a whole training run exactly-once from its delivery ledger
(:mod:`feedpipe.stream._ledger`), or name what repeated or went missing.

For every epoch the parts of every run and rank are added up, after two corrections that the
marks make exact:

* **rollback**: a run resumed from a state that run ``A`` saved at position ``p`` of epoch ``e``
  discards what ``A`` delivered after it (positions from ``p`` on in ``e``, every later epoch);
  the same holds for a run that resumed from that state before and saved none of its own since
  (it crashed before its first checkpoint). These deliveries are counted as rolled back.
* **padding and drops**: with ``drop_last=False`` a rank pads its share by repeating at most
  ``world_size - 1`` samples; with ``drop_last=True`` (the dataset's or the loader's) samples are
  left out by design. Each part records them; they are neither repeats nor losses.

Then an id delivered more than once is a **repeat**; in a finished epoch (every rank of one run
reached the end of its share), an id never delivered is a **loss**. A state resumed twice (a job
restarted from an older checkpoint than one saved since) is named as a **replay**. A part file
that cannot be read is named and makes the check fail: what it held is unknown.
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StateError
from ..plan._order import Plan, Split
from ._ledger import PARTS, delivered, read_part

SHOW = 5  # ids shown per finding


@dataclass
class _Part:
    path: str
    header: dict[str, Any]
    bits: np.ndarray
    rolled: np.ndarray | None = field(default=None)

    @property
    def run(self) -> str:
        return str(self.header["run"])

    def describe(self) -> str:
        h = self.header
        how = "from the start" if not h["start"] else f"from position {h['start']}"
        return f"run {h['run']} rank {h['rank']}/{h['world_size']} {how}"


def _plan(info: dict[str, Any], epoch: int) -> Plan:
    return Plan(tuple(info["counts"]), info["seed"], epoch, info["shuffle"], info["window"])


def _split(info: dict[str, Any], h: dict[str, Any]) -> Split:
    return Split(int(sum(info["counts"])), h["world_size"], h["rank"], h["start"],
                 info["drop_last"], h["whole_batches"])


def _after(info: dict[str, Any], part: _Part, position: int) -> np.ndarray:
    """Ids ``part`` delivered after every rank had reached global ``position`` of its epoch."""
    h = part.header
    split = _split(info, h)
    n = split.num_samples
    k = split.length if position >= n else max(0, -(-(position - h["start"]) // h["world_size"]))
    k = min(k, h["reached"])
    if k >= h["reached"]:
        return np.zeros(0, dtype=np.int64)
    return _plan(info, h["epoch"]).sample_ids(split.positions(k, h["reached"]))


def _check_plan(info: dict[str, Any], h: dict[str, Any]) -> None:
    """Refuse a run whose plan ordered the epoch otherwise than this feedpipe's: the first part
    of a run holds the ids its writer's plan gave at a few positions."""
    positions, ids = (np.asarray(x, dtype=np.int64) for x in h["checked"])
    if not np.array_equal(_plan(info, int(h["epoch"])).sample_ids(positions), ids):
        raise ValueError(
            "the plan that wrote it ordered epoch "
            f"{h['epoch']} otherwise than this feedpipe's does (ids {ids.tolist()} at positions "
            f"{positions.tolist()}): check this ledger with the feedpipe version that wrote it")


def _bits(info: dict[str, Any], h: dict[str, Any]) -> np.ndarray:
    """A version-2 part's delivered ids as a bitmap, from this feedpipe's plan."""
    have = np.zeros(int(sum(info["counts"])), dtype=bool)
    have[delivered(_plan(info, int(h["epoch"])), _split(info, h), int(h["reached"]))] = True
    return np.packbits(have, bitorder="little")


def check_ledger(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a ledger directory; returns the report (``ok``: every finished epoch exactly once,
    no replay, every part readable).

    Example:
        >>> import tempfile
        >>> from feedpipe import FeedDataset, FeedLoader
        >>> d = tempfile.mkdtemp()
        >>> loader = FeedLoader(FeedDataset("shards/example", shuffle=True), batch_size=5,
        ...                     ledger=d)
        >>> _ = [b for b in loader]
        >>> r = check_ledger(d)
        >>> r["ok"], r["epochs"][0]["delivered"], r["epochs"][0]["finished"]
        (True, 24, True)
    """
    root = os.fspath(root)
    meta = os.path.join(root, "ledger.json")
    try:
        with open(meta, encoding="utf-8") as fh:
            info = json.load(fh)
    except FileNotFoundError as e:
        raise StateError(f"{root} holds no ledger (no ledger.json): pass the directory given "
                         "as FeedLoader(ledger=DIR)") from e
    except ValueError as e:
        raise StateError(f"{meta} is damaged ({e}): the ledger cannot be checked") from e
    n = int(sum(info["counts"]))
    unreadable: list[dict[str, str]] = []
    parts: list[_Part] = []
    read: list[tuple[str, dict[str, Any], np.ndarray | None]] = []
    checked: set[str] = set()  # runs whose plan gave the ids this feedpipe's plan gives
    for path in sorted(x for pattern in PARTS for x in glob.glob(os.path.join(root, pattern))):
        try:
            header, bits = read_part(path)
            if bits is None and "checked" in header:
                _check_plan(info, header)
                checked.add(str(header["run"]))
        except (OSError, ValueError, KeyError, TypeError, zlib.error) as err:
            unreadable.append({"part": os.path.relpath(path, root), "why": str(err)})
            continue
        read.append((path, header, bits))
    for path, header, bits in read:
        if bits is None:
            if str(header["run"]) not in checked:
                unreadable.append({"part": os.path.relpath(path, root), "why": (
                    "no readable part of its run holds the ids its plan gave, to check this "
                    "feedpipe's plan against")})
                continue
            bits = _bits(info, header)
        parts.append(_Part(path, header, bits))
    # each run (one loader on one rank) and the lineage it belongs to
    runs: dict[str, dict[str, Any]] = {}
    for p in parts:
        h = p.header
        r = runs.setdefault(p.run, {"run": p.run, "created": h["created"], "host": h["host"],
                                    "pid": h["pid"], "rank": h["rank"],
                                    "lineage": h["lineage"], "resumed_from": h["origin"],
                                    "marks": []})
        r["created"] = min(r["created"], h["created"])
        r["marks"].extend(tuple(m) for m in h["marks"])
    order = sorted(runs.values(), key=lambda r: r["created"])

    # what is cut where. (1) A lineage resumed from a mark cuts the lineage that saved it at the
    # mark. (2) Where one lineage was started more than once on a rank (the same state loaded
    # again), an earlier start that saved nothing since is cut whole (it crashed before its
    # first checkpoint); one that saved a later state was replaced by an older one: a replay.
    cuts: dict[str, tuple[int, int]] = {}  # run -> (epoch, position) from which it is cut
    replays: list[dict[str, Any]] = []
    notes: list[str] = []
    lineages: dict[str, list[dict[str, Any]]] = {}
    for r in order:
        lineages.setdefault(r["lineage"], []).append(r)
    for lin, members in lineages.items():
        origin = members[0]["resumed_from"]
        if origin is not None:
            at = (int(origin.get("epoch") or 0), int(origin.get("position") or 0))
            parent = origin.get("lineage")
            if parent is None:
                notes.append(f"runs of lineage {lin} resumed from a state saved without a ledger "
                             f"mark (epoch {at[0]}, position {at[1]}): what was delivered after it "
                             "before the resume is counted, not rolled back")
            for v in lineages.get(parent, []) if parent is not None else []:
                prev = cuts.get(v["run"])
                cuts[v["run"]] = at if prev is None else min(prev, at)
        # the lineage's starts: its runs in order, a new start where a rank comes again
        starts: list[list[dict[str, Any]]] = [[]]
        for r in members:
            if any(x["rank"] == r["rank"] for x in starts[-1]):
                starts.append([])
            starts[-1].append(r)
        for earlier, later in zip(starts, starts[1:]):
            marks = sorted(m for x in earlier for m in x["marks"])
            if marks:
                m_epoch, pos = marks[-1]
                replays.append({
                    "origin": origin, "runs": [earlier[0]["run"], later[0]["run"]],
                    "why": f"run {later[0]['run']} started from the same state as run "
                           f"{earlier[0]['run']} (epoch {at_text(origin)}), although that start "
                           f"had saved a later one (epoch {m_epoch} position {pos}): a restart "
                           "from "
                           "an old checkpoint"})
            else:
                for x in earlier:
                    cuts[x["run"]] = (-1, 0)  # crashed before its first checkpoint: all of it

    epochs: list[dict[str, Any]] = []
    by_epoch: dict[int, list[_Part]] = {}
    for p in parts:
        by_epoch.setdefault(int(p.header["epoch"]), []).append(p)
    ok = not unreadable and not replays
    for ep in sorted(by_epoch):
        eparts = by_epoch[ep]
        counts = np.zeros(n, dtype=np.int32)
        rolled = padding = 0
        dropped = np.zeros(n, dtype=bool)
        finished_ranks: dict[tuple[str, int], set[int]] = {}
        for p in eparts:
            h = p.header
            have = np.unpackbits(p.bits, count=n, bitorder="little").astype(bool)
            cut = cuts.get(p.run)
            if cut is not None and ep >= cut[0]:
                ids = np.flatnonzero(have) if ep > cut[0] else _after(info, p, cut[1])
                ids = ids[have[ids]]
                rolled += len(ids)
                have[ids] = False
                if ep > cut[0]:
                    continue  # the whole part is rolled back (padding and drops with it)
            counts += have
            padding += len(h["padding"])
            if h["finished"] and (cut is None or ep < cut[0] or cut[1] >= n):
                finished_ranks.setdefault((h["lineage"], int(h["world_size"])),
                                          set()).add(int(h["rank"]))
                if h["dropped"]:
                    dropped[np.asarray(h["dropped"], dtype=np.int64)] = True
        dropped_n = int(dropped.sum())
        finished = any(len(ranks) == w for (_, w), ranks in finished_ranks.items())
        rep = np.flatnonzero(counts > 1)
        rec: dict[str, Any] = {
            "epoch": ep, "finished": finished, "parts": len(eparts),
            "delivered": int(counts.sum()), "distinct": int((counts > 0).sum()),
            "rolled_back": rolled, "padding": padding, "dropped": dropped_n,
            "repeats": _finding(rep, counts, eparts)}
        if finished:
            lost = np.flatnonzero((counts == 0) & ~dropped)
            rec["losses"] = _finding(lost, counts, eparts)
        else:
            rec["losses"] = None  # an epoch still under way loses nothing yet
        rec["exactly_once"] = rec["repeats"]["count"] == 0 and (
            rec["losses"] is None or rec["losses"]["count"] == 0)
        ok = ok and rec["exactly_once"]
        epochs.append(rec)
    return {"ledger": root, "samples": n, "ok": ok, "runs": [
        {k: r[k] for k in ("run", "host", "pid", "rank", "lineage", "resumed_from")} | {
            "marks": [list(m) for m in r["marks"]]} for r in order],
            "replays": replays, "unreadable": unreadable, "notes": notes, "epochs": epochs}


def at_text(mark: dict[str, Any] | None) -> str:
    if mark is None:
        return "0 from the start"
    return f"{mark.get('epoch')} position {mark.get('position')}"


def _finding(ids: np.ndarray, counts: np.ndarray, parts: list[_Part]) -> dict[str, Any]:
    shown = [int(i) for i in ids[:SHOW]]
    involved = []
    for p in parts:
        have = np.unpackbits(p.bits, count=len(counts), bitorder="little").astype(bool)
        if shown and have[np.asarray(shown)].any():
            involved.append(p.describe())
    return {"count": int(len(ids)), "ids": shown, "parts": involved}


def ledger_text(report: dict[str, Any]) -> str:
    """The report as the ``feedpipe ledger`` command prints it."""
    lines = [f"ledger {report['ledger']}: {report['samples']:,} samples, "
             f"{len(report['runs'])} run{'s' if len(report['runs']) != 1 else ''}"]
    for u in report["unreadable"]:
        lines.append(f"  UNREADABLE part {u['part']}: {u['why']} (what it recorded is unknown)")
    for rp in report["replays"]:
        lines.append(f"  REPLAY: {rp['why']}")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    for e in report["epochs"]:
        state = "finished" if e["finished"] else "not finished"
        extra = [f"{e[k]} {k.replace('_', ' ')}" for k in ("rolled_back", "padding", "dropped")
                 if e[k]]
        parts = f"{e['parts']} part{'s' if e['parts'] != 1 else ''}"
        head = (f"  epoch {e['epoch']} ({state}, {parts}): {e['distinct']:,} of "
                f"{report['samples']:,} delivered{'; ' + ', '.join(extra) if extra else ''}")
        if e["exactly_once"]:
            lines.append(head + (" - exactly once" if e["finished"] else " - no repeat so far"))
            continue
        lines.append(head)
        for what in ("repeats", "losses"):
            f = e[what]
            if f and f["count"]:
                lines.append(f"    {f['count']:,} {what[:-1] if f['count'] == 1 else what}, e.g. "
                             f"ids {f['ids']}; parts: {'; '.join(f['parts']) or '-'}")
    lines.append("OK: every finished epoch exactly once" if report["ok"] else
                 "NOT exactly once: see above")
    return "\n".join(lines)
