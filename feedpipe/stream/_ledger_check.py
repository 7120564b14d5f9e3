"""``check_ledger(DIR)``: prove a whole training run exactly-once from its delivery ledger
(:mod:`feedpipe.stream._ledger`), or name what repeated, went missing or cannot be known.

The check follows the history the trained model has:

* **starts**: the runs (one per rank) that began together from one state: a fresh start, or a
  state saved with a ledger mark. The ranks of one start share its lineage; the same state
  started again (a job restarted from one checkpoint twice) is a new start of that lineage.
* **the history**: the newest start, its parent (the start that saved the state it resumed
  from), that one's parent, and so on back to a fresh start. What a start delivered after the
  state its successor in the history resumed from is **rolled back** (discarded with the model
  state of the killed run), and so is all a start off the history delivered: a start that was
  followed by a restart from an older state, or from nothing (a checkpoint whose save never
  completed). A restart from an older state than one saved since is named among the
  ``replays``: it is a rollback, not a fault, and fails nothing.
* **lockstep**: a state is saved by one rank (usually rank 0) and holds every rank's position:
  ranks deliver batch for batch (DDP's collectives keep them so). A state that was resumed from
  and that the ledger saw being saved therefore proves that every rank of its start delivered up
  to it, also a rank whose part was last flushed before (parts flush about once a second).
* **finished**: an epoch is finished when every rank of the history's start reached the end of
  its share, or when the history went on to a later epoch (a loop that left the epoch early, a
  resume followed by ``set_epoch`` of a later epoch): its undelivered samples are then lost.
  Only the last epoch of the newest start can be under way.

Then an id delivered more than once is a **repeat**; in a finished epoch an id neither
delivered, nor skipped by the transform, nor dropped by design is a **loss**. A
:class:`~feedpipe.Mixture`'s epoch holds each sample as many times as its plan draws it
(recomputed from what ``ledger.json`` records of the mixture): a delivery beyond that is a
repeat, one short of it a loss, each also named per source. A :class:`~feedpipe.Packed`'s ids
are its epoch's rows (recomputed from the documents' lengths ``ledger.json`` holds,
:mod:`feedpipe.stream._ledger_kinds`), each once: a lost or repeated row is named by its pieces
of documents, and its rows of padding only are padding. A :class:`~feedpipe.VideoClips`' ids are
its epoch's clips, each once, a lost or repeated one named ``[video, clip]``. With
``drop_last=False`` a rank pads its share by repeating at most ``world_size - 1`` samples; with
``drop_last=True`` samples are left out by design: neither counts. Samples the transform skipped
(:class:`~feedpipe.errors.SampleSkipped`) are counted and named apart from the delivered ones.
A part file that cannot be read, a rank of a start with no part for an epoch the start went
through, and a state resumed from a lineage with no part at all are named and fail the check:
what they held is unknown.
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
from ._ledger import PARTS, delivered, dropped_ids, padding_from, read_part
from ._ledger_history import (
    LedgerPart,
    LedgerStart,
    build_history,
    find_starts,
    group_runs,
    keep_parts,
    origin_mark,
    part_gaps,
    part_passed,
    parts_of,
)
from ._ledger_kinds import (
    check_info,
    check_plan,
    check_rows,
    clip_pairs,
    epoch_plan,
    expected,
    is_clips,
    is_mixture,
    is_packed,
    mixture_of,
    part_split,
    positions,
    row_pieces,
    samples,
)
from ._ledger_text import SHOW
from ._ledger_text import ledger_text as ledger_text  # what `feedpipe ledger` prints


def _read_info(root: str) -> dict[str, Any]:
    meta = os.path.join(root, "ledger.json")
    try:
        with open(meta, encoding="utf-8") as fh:
            info: dict[str, Any] = json.load(fh)
    except FileNotFoundError as e:
        raise StateError(f"{root} holds no ledger (no ledger.json): pass the directory given "
                         "as FeedLoader(ledger=DIR)") from e
    except ValueError as e:
        raise StateError(f"{meta} is damaged ({e}): the ledger cannot be checked") from e
    return info


def _read_parts(root: str, info: dict[str, Any]) -> tuple[list[LedgerPart], list[dict[str, str]]]:
    """Every readable part, and the unreadable ones named with the reason."""
    unreadable: list[dict[str, str]] = []
    read: list[tuple[str, dict[str, Any], np.ndarray | None]] = []
    checked: set[str] = set()  # runs whose plan gave the ids this feedpipe's plan gives
    for path in sorted(x for pattern in PARTS for x in glob.glob(os.path.join(root, pattern))):
        try:
            header, bits = read_part(path)
            if bits is None and "checked" in header:
                check_plan(info, header)
                checked.add(str(header["run"]))
            check_rows(info, header)
            part_split(info, header)  # its place in the plan is one the plan has
        except (OSError, ValueError, KeyError, TypeError, zlib.error) as err:
            unreadable.append({"part": os.path.relpath(path, root), "why": str(err)})
            continue
        read.append((path, header, bits))
    parts: list[LedgerPart] = []
    for path, header, bits in read:
        if bits is None and str(header["run"]) not in checked:
            unreadable.append({"part": os.path.relpath(path, root), "why": (
                "no readable part of its run holds the ids its plan gave, to check this "
                "feedpipe's plan against")})
            continue
        parts.append(LedgerPart(path, header, bits, part_split(info, header)))
    return parts, unreadable


def _ids(info: dict[str, Any], part: LedgerPart, k: int) -> np.ndarray:
    """The ids ``part`` delivered at its first ``k`` local positions (padding aside)."""
    plan = epoch_plan(info, part.epoch, part.header.get("layout"))
    ids = delivered(plan, part.split, k)
    if part.bits is not None and k >= part.reached:  # version 1: its own record
        have = np.unpackbits(part.bits, count=part.split.num_samples, bitorder="little")
        return np.flatnonzero(have)
    return ids


@dataclass
class _Tally:
    """One epoch's tally per sample id, each a count: a mixture's epoch may hold a sample more
    than once (``expected``: how many times it holds each)."""

    n: int
    expected: np.ndarray
    counts: np.ndarray = field(init=False)
    skipped: np.ndarray = field(init=False)
    dropped: np.ndarray = field(init=False)
    parts: list[tuple[LedgerPart, np.ndarray]] = field(default_factory=list)
    rolled: int = 0
    padding: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.n, dtype=np.int64)
        self.skipped = np.zeros(self.n, dtype=np.int64)
        self.dropped = np.zeros(self.n, dtype=np.int64)


def _tally_part(info: dict[str, Any], part: LedgerPart, t: _Tally) -> None:
    """Add what ``part`` kept (and rolled back) to its epoch's tally."""
    t.count += part_passed(part) or part.reached > 0  # a part that only put a state on record: none
    k = part.kept
    ids = _ids(info, part, max(k, part.reached))
    kept = _ids(info, part, k) if k < part.reached else ids
    t.rolled += max(0, len(ids) - len(kept))
    skip = np.asarray(part.header.get("skipped", []), dtype=np.int64)
    here = np.bincount(kept, minlength=t.n)
    if len(skip):  # each skip takes one of the deliveries of its id (a mixture's may be more)
        skip = skip[np.isin(skip, kept)]
        took = np.minimum(np.bincount(skip, minlength=t.n), here)
        t.skipped += took
        here -= took
        kept = kept[~np.isin(kept, skip)]
    t.counts += here
    t.padding += max(0, k - padding_from(part.split))
    t.parts.append((part, kept))
    if part.finished:
        plan = epoch_plan(info, part.epoch, part.header.get("layout"))
        np.add.at(t.dropped, dropped_ids(plan, part.split, k), 1)


def _reached_epochs(history: list[LedgerStart]) -> set[int]:
    """The epochs the history went into: those it kept deliveries of, those a start of it
    resumed in, and those the newest start began a pass of."""
    out: set[int] = set()
    for i, s in enumerate(history):
        if s.origin is not None:
            out.add(origin_mark(s.origin)[0])
        newest = i == len(history) - 1
        out.update(p.epoch for p in parts_of(s) if p.kept or p.finished
                   or (newest and part_passed(p)))
    return out


def _missing_ranks(history: list[LedgerStart], epoch: int,
                   newest_epoch: int) -> list[dict[str, Any]]:
    """Ranks of a start in the history with no part for ``epoch`` although the start went
    through it. In the newest start's last epoch a rank may not have begun yet: it is missing
    only where another rank delivered something of it."""
    out: list[dict[str, Any]] = []
    for i, s in enumerate(history):
        begun = {p.epoch for p in parts_of(s) if part_passed(p)}
        lo = origin_mark(s.origin)[0] if s.origin is not None else min(begun, default=epoch + 1)
        if s.cut is not None:
            hi = s.cut[0] if s.cut[1] > 0 else s.cut[0] - 1
        else:
            hi = max(begun, default=-1)
        if not lo <= epoch <= hi:
            continue
        here = [p for p in parts_of(s) if p.epoch == epoch]
        if i == len(history) - 1 and epoch == newest_epoch and not any(p.reached for p in here):
            continue
        ranks = {p.rank for p in here}
        out.extend(_missing(s, rank, epoch) for rank in range(s.world) if rank not in ranks)
    return out


def _missing(s: LedgerStart, rank: int, epoch: int) -> dict[str, Any]:
    runs = [r.run for r in s.runs]
    return {"rank": rank, "world_size": s.world, "lineage": s.lineage, "runs": runs, "why": (
        f"rank {rank} of {s.world} has no part for epoch {epoch}, which its start (runs "
        f"{', '.join(runs)}) went through: its part is lost, what it delivered is unknown")}


def _finished(history: list[LedgerStart], epoch: int, reached: set[int]) -> str | None:
    """Why ``epoch`` is finished (``None``: under way, or never part of the history)."""
    if epoch not in reached:
        return None
    if epoch < max(reached):
        return f"the job went on to epoch {max(reached)}"
    for s in history:
        ranks = {p.rank for p in parts_of(s) if p.epoch == epoch and p.finished}
        if ranks and len(ranks) == s.world:
            return "every rank reached the end of its share"
    return None


def _repeated(per_id: np.ndarray) -> np.ndarray:
    """Each id as many times as ``per_id`` counts it."""
    ids = np.flatnonzero(per_id > 0)
    return np.repeat(ids, per_id[ids])


def _finding(per_id: np.ndarray, tally: _Tally, info: dict[str, Any],
             epoch: int) -> dict[str, Any]:
    """A finding (``per_id``: how many times each id is found): how many ids, every id, and
    the parts that delivered (or held) the first few; for a mixture also each source's ids
    within it, each as many times as it is found (a draw of it lost twice is listed twice); for
    a Packed (its ids are rows) the pieces of documents the rows hold, ``[document, start,
    length]``, each as many times as found, and their tokens; for a VideoClips the ``[video,
    clip]`` of each id, each as many times as found."""
    ids = np.flatnonzero(per_id > 0)
    shown = ids[:SHOW]
    involved = [p.describe() for p, kept in tally.parts
                if len(shown) and np.isin(shown, kept).any()]
    out: dict[str, Any] = {"count": int(len(ids)), "ids": [int(i) for i in ids],
                           "parts": involved}
    if is_mixture(info):
        bases = mixture_of(info)[1]
        ids = _repeated(per_id)
        src = np.searchsorted(bases, ids, side="right") - 1
        out["sources"] = {name: (ids[src == s] - bases[s]).tolist()
                          for s, name in enumerate(info["sources"]) if (src == s).any()}
    if is_packed(info):
        pieces = row_pieces(info, epoch, _repeated(per_id))
        out["pieces"] = pieces
        out["tokens"] = int(sum(k for _, _, k in pieces))
    if is_clips(info):
        out["clips"] = clip_pairs(info, _repeated(per_id))
    return out


def _epoch_record(epoch: int, tally: _Tally, finished: str | None,
                  missing: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    counts, expected = tally.counts, tally.expected
    # a draw skipped again in a replay is one draw skipped: at most the times the epoch holds it
    skipped = _repeated(np.minimum(tally.skipped, expected))
    rec: dict[str, Any] = {
        "epoch": epoch, "finished": finished is not None, "why_finished": finished,
        "parts": tally.count, "delivered": int(counts.sum()), "distinct": int((counts > 0).sum()),
        "expected": int(expected.sum()),
        "skipped": {"count": int(len(skipped)), "ids": [int(i) for i in skipped]},
        "rolled_back": tally.rolled, "padding": tally.padding,
        "dropped": int(tally.dropped.sum()),
        # a delivery of an id beyond the times the epoch holds it (once, in a dataset's)
        "repeats": _finding(counts - expected, tally, info, epoch), "missing": missing}
    if finished is not None:
        rec["losses"] = _finding(expected - counts - tally.dropped - tally.skipped, tally, info,
                                 epoch)
    else:
        rec["losses"] = None  # an epoch still under way loses nothing yet
    rec["exactly_once"] = rec["repeats"]["count"] == 0 and not missing and (
        rec["losses"] is None or rec["losses"]["count"] == 0)
    return rec


def _epochs(info: dict[str, Any], parts: list[LedgerPart],
            history: list[LedgerStart]) -> list[dict[str, Any]]:
    tallies: dict[int, _Tally] = {}
    for p in parts:  # parts off the history keep nothing: all they delivered is rolled back
        t = tallies.get(p.epoch)
        if t is None:
            want = expected(info, p.epoch)
            t = tallies[p.epoch] = _Tally(len(want), want)
        _tally_part(info, p, t)
    reached = _reached_epochs(history)
    newest = max((p.epoch for p in parts_of(history[-1])), default=-1) if history else -1
    return [_epoch_record(e, tallies[e], _finished(history, e, reached),
                          _missing_ranks(history, e, newest), info) for e in sorted(tallies)]


def check_ledger(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a ledger directory; returns the report (``ok``: every finished epoch exactly once,
    every part readable, no rank's part missing).

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
    info = _read_info(root)
    check_info(info)
    parts, unreadable = _read_parts(root, info)
    runs = group_runs(parts)
    notes: list[str] = []
    missing: list[dict[str, Any]] = []
    replays: list[dict[str, Any]] = []
    missing.extend(part_gaps(runs))
    starts = find_starts(runs)
    history = build_history(starts, notes, missing, replays)
    for p in parts:
        p.kept, p.finished = 0, False
    batch = {r.run: int(r.parts[0].header["batch_size"]) for r in runs}
    for s in history:
        keep_parts(s, batch)
    epochs = _epochs(info, parts, history)
    ok = not unreadable and not missing and all(e["exactly_once"] for e in epochs)
    report = {"ledger": root, "samples": samples(info), "ok": ok, "runs": [
        {"run": r.run, "host": r.host, "pid": r.pid, "rank": r.rank, "lineage": r.lineage,
         "resumed_from": r.origin, "marks": [list(m) for m, _ in r.marks()]} for r in runs],
              "replays": replays, "unreadable": unreadable, "missing": missing, "notes": notes,
              "epochs": epochs}
    if is_mixture(info):
        report["mixture"] = {"sources": list(info["sources"]),
                             "sizes": [int(sum(c)) for c in info["shards"]],
                             "draws": list(info["draws"]), "epoch_size": positions(info, 0)}
    if is_packed(info):
        report["packed"] = {"seq_len": int(info["seq_len"]), "packing": info["packing"],
                            "field": info["field"], "documents": info["lengths"]["documents"],
                            "tokens": info["lengths"]["tokens"]}
    if is_clips(info):
        report["clips"] = {"videos": samples(info), "clips_per_video": info["clips"],
                           "frames": int(info["frames"]), "stride": int(info["stride"]),
                           "fps": info["fps"]}
    return report
