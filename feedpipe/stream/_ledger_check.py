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
repeat, one short of it a loss, each also named per source. With
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
import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import StateError
from ..plan._mixture import MixtureEpoch, MixturePlan
from ..plan._order import Plan, Split
from ._ledger import PARTS, Ordered, delivered, dropped_ids, finished_reach, padding_from, read_part

SHOW = 5  # ids the text shows per finding (the JSON document lists them all)

Mark = tuple[int, int]  # (epoch, position)


@dataclass
class _Part:
    path: str
    header: dict[str, Any]
    bits: np.ndarray | None  # a version-1 part's bitmap of delivered ids
    split: Split
    seq: int = 0  # the order of the run's passes
    kept: int = 0  # local positions that stay in the history (set by _keep)
    finished: bool = False  # in the history, this part reached the end of its share
    credited: bool = False  # a saved state proves more than its last flush recorded

    @property
    def run(self) -> str:
        return str(self.header["run"])

    @property
    def epoch(self) -> int:
        return int(self.header["epoch"])

    @property
    def rank(self) -> int:
        return int(self.header["rank"])

    @property
    def reached(self) -> int:
        return int(self.header["reached"])

    @property
    def created(self) -> float:
        return float(self.header["created"])

    def describe(self) -> str:
        h = self.header
        how = "from the start" if not h["start"] else f"from position {h['start']}"
        return f"run {h['run']} rank {h['rank']}/{h['world_size']} {how}"


@dataclass
class _Run:
    run: str
    rank: int
    world: int
    lineage: str
    origin: dict[str, Any] | None
    created: float
    host: str
    pid: int
    parts: list[_Part] = field(default_factory=list)

    def marks(self) -> list[tuple[Mark, _Proof]]:
        """The states this run saved, each with the part that recorded it and how far that
        part's pass had come (version 3; ``None`` before)."""
        return [((int(m[0]), int(m[1])), _Proof(p, int(m[2]) if len(m) > 2 else None,
                                                float(m[3]) if len(m) > 3 else None))
                for p in self.parts for m in p.header["marks"]]


@dataclass
class _Proof:
    """A saved state as its part recorded it: ``reached``, the local positions its pass had
    delivered then, and ``time``, when (version 3)."""

    part: _Part
    reached: int | None
    time: float | None


@dataclass
class _Start:
    lineage: str
    origin: dict[str, Any] | None
    runs: list[_Run]
    cut: Mark | None = None  # what it delivered from here on is rolled back
    proof: _Proof | None = None  # how the state at ``cut`` was recorded saved

    @property
    def created(self) -> float:
        return min(r.created for r in self.runs)

    @property
    def world(self) -> int:
        return self.runs[0].world

    def marks(self) -> list[tuple[Mark, _Proof]]:
        return [m for r in self.runs for m in r.marks()]


def _is_mixture(info: dict[str, Any]) -> bool:
    return info.get("kind") == "mixture"


@lru_cache(maxsize=4)
def _mixture_plan(key: str) -> tuple[MixturePlan, np.ndarray]:
    """The mixture's plan made from what ``ledger.json`` recorded (``key``: that, as JSON), and
    each source's first sample number."""
    info = json.loads(key)
    plan = MixturePlan(info["shards"], info["weights"], info["epoch_size"], info["seed"],
                       info["shuffle"])
    if plan.counts.tolist() != info["draws"]:
        raise StateError(
            f"this feedpipe's mixture plan draws {plan.counts.tolist()} samples of the sources "
            f"{info['sources']} an epoch, the ledger's writer drew {info['draws']}: check this "
            "ledger with the feedpipe version that wrote it")
    sizes = np.array([sum(c) for c in info["shards"]], dtype=np.int64)
    return plan, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def _mixture(info: dict[str, Any]) -> tuple[MixturePlan, np.ndarray]:
    keys = ("shards", "weights", "epoch_size", "seed", "shuffle", "draws", "sources")
    return _mixture_plan(json.dumps({k: info[k] for k in keys}))


def _plan(info: dict[str, Any], epoch: int, layout: Any = None) -> Ordered:
    """The plan of ``epoch``; ``layout``: the node layout a part recorded (``None``: the global
    order)."""
    if _is_mixture(info):
        return MixtureEpoch(*_mixture(info)[:1], epoch, _mixture(info)[1])
    return Plan(tuple(info["counts"]), info["seed"], epoch, info["shuffle"], info["window"],
                None if not layout else (int(layout[0]), int(layout[1])))


def _positions(info: dict[str, Any]) -> int:
    """The positions of an epoch: a mixture's ``epoch_size``, a dataset's samples."""
    return _mixture(info)[0].epoch_size if _is_mixture(info) else int(sum(info["counts"]))


def _expected(info: dict[str, Any], epoch: int) -> np.ndarray:
    """How many times ``epoch`` holds each sample: once for a dataset; for a mixture what its
    plan draws (a source drawn more than its size repeats samples, one drawn less leaves some
    out)."""
    n = int(sum(info["counts"]))
    if not _is_mixture(info):
        return np.ones(n, dtype=np.int64)
    ids = _plan(info, epoch).sample_ids(np.arange(_positions(info), dtype=np.int64))
    return np.bincount(ids, minlength=n).astype(np.int64)


def _split(info: dict[str, Any], h: dict[str, Any]) -> Split:
    return Split(_positions(info), h["world_size"], h["rank"], h["start"],
                 info["drop_last"], h["whole_batches"], pad_own=bool(h.get("layout")))


def _check_plan(info: dict[str, Any], h: dict[str, Any]) -> None:
    """Refuse a run whose plan ordered the epoch otherwise than this feedpipe's: the first part
    of a run holds the ids its writer's plan gave at a few positions."""
    positions, ids = (np.asarray(x, dtype=np.int64) for x in h["checked"])
    plan = _plan(info, int(h["epoch"]), h.get("layout"))
    if not np.array_equal(plan.sample_ids(positions), ids):
        raise ValueError(
            "the plan that wrote it ordered epoch "
            f"{h['epoch']} otherwise than this feedpipe's does (ids {ids.tolist()} at positions "
            f"{positions.tolist()}): check this ledger with the feedpipe version that wrote it")


# -- reading -----------------------------------------------------------------------------------

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


def _read_parts(root: str, info: dict[str, Any]) -> tuple[list[_Part], list[dict[str, str]]]:
    """Every readable part, and the unreadable ones named with the reason."""
    unreadable: list[dict[str, str]] = []
    read: list[tuple[str, dict[str, Any], np.ndarray | None]] = []
    checked: set[str] = set()  # runs whose plan gave the ids this feedpipe's plan gives
    for path in sorted(x for pattern in PARTS for x in glob.glob(os.path.join(root, pattern))):
        try:
            header, bits = read_part(path)
            if bits is None and "checked" in header:
                _check_plan(info, header)
                checked.add(str(header["run"]))
            _split(info, header)  # its place in the plan is one the plan has
        except (OSError, ValueError, KeyError, TypeError, zlib.error) as err:
            unreadable.append({"part": os.path.relpath(path, root), "why": str(err)})
            continue
        read.append((path, header, bits))
    parts: list[_Part] = []
    for path, header, bits in read:
        if bits is None and str(header["run"]) not in checked:
            unreadable.append({"part": os.path.relpath(path, root), "why": (
                "no readable part of its run holds the ids its plan gave, to check this "
                "feedpipe's plan against")})
            continue
        parts.append(_Part(path, header, bits, _split(info, header)))
    return parts, unreadable


def _runs(parts: list[_Part]) -> list[_Run]:
    """The runs (one loader on one rank), oldest first, each with its passes in order."""
    runs: dict[str, _Run] = {}
    for p in parts:
        h = p.header
        r = runs.get(p.run)
        if r is None:
            r = runs[p.run] = _Run(p.run, p.rank, int(h["world_size"]), str(h["lineage"]),
                                   h["origin"], float(h["created"]), str(h["host"]),
                                   int(h["pid"]))
        r.created = min(r.created, float(h["created"]))
        r.parts.append(p)
    for r in runs.values():
        for p in r.parts:
            found = re.search(r"-(\d+)\.part$", p.path)
            p.seq = int(found.group(1)) if found else 0
        r.parts.sort(key=lambda p: (p.seq, float(p.header["created"])))
    return sorted(runs.values(), key=lambda r: r.created)


def _gaps(runs: list[_Run]) -> list[dict[str, Any]]:
    """Parts lost from a run that still has others: a run numbers its parts 0, 1, 2, ..."""
    out = []
    for r in runs:
        have = {p.seq for p in r.parts}
        lost = sorted(set(range(max(have) + 1)) - have)
        if lost:
            out.append({"lineage": r.lineage, "why": (
                f"run {r.run} (rank {r.rank} of {r.world}) lacks its part(s) number "
                f"{', '.join(map(str, lost))} of {max(have) + 1}: what they recorded is "
                "unknown")})
    return out


def _starts(runs: list[_Run]) -> list[_Start]:
    """The runs grouped into starts: one lineage's runs in order, a new start where a rank
    comes again (its state was started once more) or the world size changes; oldest first. A
    start whose runs of some ranks are lost whole may be grouped with the next: the check then
    names ranks missing."""
    lineages: dict[str, list[list[_Run]]] = {}
    for r in runs:
        groups = lineages.setdefault(r.lineage, [[]])
        if any(x.rank == r.rank or x.world != r.world for x in groups[-1]):
            groups.append([])
        groups[-1].append(r)
    starts = [_Start(lin, g[0].origin, g) for lin, gs in lineages.items() for g in gs]
    return sorted(starts, key=lambda s: s.created)


# -- the history -------------------------------------------------------------------------------

def _origin_mark(origin: dict[str, Any]) -> Mark:
    return int(origin.get("epoch") or 0), int(origin.get("position") or 0)


def _parent(start: _Start, starts: list[_Start], notes: list[str],
            missing: list[dict[str, Any]]) -> tuple[_Start | None, _Proof | None]:
    """The start that saved the state ``start`` resumed from, and the part that recorded the
    saving (``None`` when no part did)."""
    origin = start.origin
    if origin is None:
        return None, None
    at = _origin_mark(origin)
    before = [s for s in starts if s.created < start.created]
    lineage = origin.get("lineage")
    if lineage is None:
        notes.append(f"runs of lineage {start.lineage} resumed from a state saved without a "
                     f"ledger mark (epoch {at[0]}, position {at[1]}): it is taken to continue the "
                     "start before it")
        return (before[-1] if before else None), None
    if "run" in origin:  # the run that saved it is named (version 3)
        return _saver(start, [s for s in before if origin["run"] in {r.run for r in s.runs}],
                      at, missing)
    candidates = [s for s in before if s.lineage == lineage]
    if not candidates:
        missing.append({"lineage": lineage, "why": (
            f"runs {', '.join(r.run for r in start.runs)} resumed from a state of lineage "
            f"{lineage} (epoch {at[0]} position {at[1]}), and no part of that lineage is here: "
            "what it delivered is unknown")})
        return None, None
    for s in reversed(candidates):
        proof = [p for m, p in s.marks() if m == at]
        if proof:
            return s, proof[-1]
    missing.append({"lineage": lineage, "why": (
        f"runs {', '.join(r.run for r in start.runs)} resumed from epoch {at[0]} position "
        f"{at[1]} of lineage {lineage}, a state no part here recorded saving: the part that "
        "did is lost, or the state is not one this job saved; what was delivered before it "
        "cannot be told")})
    return candidates[-1], None


def _saver(start: _Start, saver: list[_Start], at: Mark,
           missing: list[dict[str, Any]]) -> tuple[_Start | None, _Proof | None]:
    """The start of the run named as the one that saved the state ``start`` resumed from."""
    runs = ", ".join(r.run for r in start.runs)
    origin = start.origin or {}
    if not saver:
        missing.append({"lineage": origin.get("lineage"), "why": (
            f"runs {runs} resumed from a state run {origin.get('run')} saved (epoch {at[0]} "
            f"position {at[1]}), and that run has no part here: what it delivered is unknown")})
        return None, None
    when = origin.get("time")  # a run can save the same place twice: the moment tells which
    proof = [p for m, p in saver[-1].marks() if m == at and (when is None or p.time == when)]
    if not proof:
        missing.append({"lineage": origin.get("lineage"), "why": (
            f"runs {runs} resumed from a state run {origin.get('run')} saved (epoch {at[0]} "
            f"position {at[1]}), and none of its parts here recorded saving it: the part that "
            "did is lost; what was delivered before it cannot be told")})
    return saver[-1], (proof[-1] if proof else None)


def _history(starts: list[_Start], notes: list[str], missing: list[dict[str, Any]],
             replays: list[dict[str, Any]]) -> list[_Start]:
    """The starts the model's history went through, oldest first; each but the newest gets the
    ``cut`` its successor resumed from."""
    if not starts:
        return []
    path = [starts[-1]]
    while True:
        child = path[-1]
        parent, proof = _parent(child, starts, notes, missing)
        if parent is None or parent in path:
            break
        at = _origin_mark(child.origin or {})
        parent.cut, parent.proof = at, proof
        _replayed(child, at, [s for s in starts if parent.created <= s.created < child.created],
                  replays)
        path.append(parent)
    if path[-1].origin is None:  # a fresh start: had an earlier one saved states?
        _replayed(path[-1], None, [s for s in starts if s.created < path[-1].created], replays)
    return path[::-1]


def _replayed(child: _Start, at: Mark | None, between: list[_Start],
              replays: list[dict[str, Any]]) -> None:
    """Name a restart of ``child`` from an older state than one saved since by the starts
    ``between`` its parent and it."""
    later = [(m, s) for s in between for m, _ in s.marks() if at is None or m > at]
    if later:
        m, s = max(later, key=lambda x: x[0])
        replays.append(_replay(child, s, at, m))


def _replay(child: _Start, parent: _Start, at: Mark | None, later: Mark) -> dict[str, Any]:
    runs = [parent.runs[0].run, child.runs[0].run]
    whence = "nothing" if at is None else f"epoch {at[0]} position {at[1]}"
    return {"origin": child.origin, "runs": runs, "why": (
        f"run {runs[1]} started from {whence}, although run {runs[0]} had saved a later state "
        f"since (epoch {later[0]} position {later[1]}): a restart from an older checkpoint, or "
        "from one whose save did not complete; what was delivered after it is rolled back")}


def _local(part: _Part, position: int) -> int:
    """Local positions of ``part``'s share before global ``position`` of its epoch."""
    s = part.split
    if position >= s.num_samples:
        return s.length
    return min(s.length, max(0, -(-(position - s.start) // s.world_size)))


def _keep(start: _Start, batch: dict[str, int]) -> None:
    """Set what each part of ``start`` keeps in the history: all of it, or what came before its
    cut; a state the ledger saw saved proves every rank delivered up to it (lockstep)."""
    cut, proof = start.cut, start.proof
    for r in start.runs:
        if cut is None:
            before, current, after = list(r.parts), [], []
        elif proof is None or proof.time is None:  # no record of the saving: by epoch
            before = [p for p in r.parts if p.epoch < cut[0]]
            current = [p for p in r.parts if p.epoch == cut[0]]
            after = [p for p in r.parts if p.epoch > cut[0]]
        else:
            before, current, after = _around(start, r, proof)
        for p in before:
            _whole(p, batch[r.run])
        for p in after:
            p.kept, p.finished = 0, False
        for p in current:
            _cut(p, cut, batch[r.run])  # type: ignore[arg-type]
    if proof is not None and cut is not None and proof.reached is not None:
        _credit(start, cut, proof, batch)


def _cut(p: _Part, cut: Mark, batch: int) -> None:
    """``p`` was under way when the state at ``cut`` was saved: it keeps what came before."""
    if p.epoch < cut[0]:
        _whole(p, batch)
    elif p.epoch == cut[0]:
        p.kept = min(_local(p, cut[1]), p.reached)
        p.finished = cut[1] >= p.split.num_samples and p.reached >= finished_reach(p.split, batch)
    else:
        p.kept, p.finished = 0, False


def _around(start: _Start, r: _Run,
            proof: _Proof) -> tuple[list[_Part], list[_Part], list[_Part]]:
    """``r``'s parts before the saving of the state, the one under way then, and those after.
    Ranks go through the same passes (lockstep): as many passes of every rank came before as
    of the saving rank's."""
    rec = proof.part
    if r.run == rec.run:
        return ([p for p in r.parts if p.seq < rec.seq], [rec],
                [p for p in r.parts if p.seq > rec.seq])
    saver = next(x for x in start.runs if x.run == rec.run)
    done = sum(1 for p in saver.parts if _passed(p) and p.seq < rec.seq)
    passes = [p for p in r.parts if _passed(p)]
    records = [p for p in r.parts if not _passed(p)]  # they hold no delivery
    if _passed(rec):
        return records + passes[:done], passes[done:done + 1], passes[done + 1:]
    return records + passes[:done], [], passes[done:]


def _whole(p: _Part, batch: int) -> None:
    p.kept = p.reached  # the loop received every batch of its share: finished
    p.finished = p.reached >= finished_reach(p.split, batch)


def _credit(start: _Start, cut: Mark, proof: _Proof, batch: dict[str, int]) -> None:
    """Every rank's pass had received as many batches as the saving rank's when the state was
    saved (lockstep): credit a rank whose part was last flushed before."""
    rec = proof.part
    if not _passed(rec):
        return  # saved before its pass began: nothing of it to credit
    done = -(-int(proof.reached or 0) // batch[rec.run])
    for r in start.runs:
        if proof.time is not None:
            same = _around(start, r, proof)[1]
        else:
            same = [p for p in r.parts if p.epoch == rec.epoch][-1:]
        for p in same:
            want = min(p.split.length, done * batch[r.run])
            if rec.epoch == cut[0]:
                want = min(want, _local(p, cut[1]))
            elif want >= finished_reach(p.split, batch[r.run]):
                p.finished = True
            if want > p.kept:
                p.kept, p.credited = want, True


# -- the epochs --------------------------------------------------------------------------------

def _ids(info: dict[str, Any], part: _Part, k: int) -> np.ndarray:
    """The ids ``part`` delivered at its first ``k`` local positions (padding aside)."""
    plan = _plan(info, part.epoch, part.header.get("layout"))
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
    parts: list[tuple[_Part, np.ndarray]] = field(default_factory=list)
    rolled: int = 0
    padding: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.n, dtype=np.int64)
        self.skipped = np.zeros(self.n, dtype=np.int64)
        self.dropped = np.zeros(self.n, dtype=np.int64)


def _tally_part(info: dict[str, Any], part: _Part, t: _Tally) -> None:
    """Add what ``part`` kept (and rolled back) to its epoch's tally."""
    t.count += _passed(part) or part.reached > 0  # a part that only put a state on record: none
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
        plan = _plan(info, part.epoch, part.header.get("layout"))
        np.add.at(t.dropped, dropped_ids(plan, part.split, k), 1)


def _passed(p: _Part) -> bool:
    """Whether a pass began in ``p`` (not a part that only put a loaded or saved state on
    record; version 2 wrote none such)."""
    return bool(p.header.get("pass", True))


def _reached_epochs(history: list[_Start]) -> set[int]:
    """The epochs the history went into: those it kept deliveries of, those a start of it
    resumed in, and those the newest start began a pass of."""
    out: set[int] = set()
    for i, s in enumerate(history):
        if s.origin is not None:
            out.add(_origin_mark(s.origin)[0])
        newest = i == len(history) - 1
        out.update(p.epoch for p in _parts_of(s) if p.kept or p.finished
                   or (newest and _passed(p)))
    return out


def _missing_ranks(history: list[_Start], epoch: int, newest_epoch: int) -> list[dict[str, Any]]:
    """Ranks of a start in the history with no part for ``epoch`` although the start went
    through it. In the newest start's last epoch a rank may not have begun yet: it is missing
    only where another rank delivered something of it."""
    out: list[dict[str, Any]] = []
    for i, s in enumerate(history):
        begun = {p.epoch for p in _parts_of(s) if _passed(p)}
        lo = _origin_mark(s.origin)[0] if s.origin is not None else min(begun, default=epoch + 1)
        if s.cut is not None:
            hi = s.cut[0] if s.cut[1] > 0 else s.cut[0] - 1
        else:
            hi = max(begun, default=-1)
        if not lo <= epoch <= hi:
            continue
        here = [p for p in _parts_of(s) if p.epoch == epoch]
        if i == len(history) - 1 and epoch == newest_epoch and not any(p.reached for p in here):
            continue
        ranks = {p.rank for p in here}
        out.extend(_missing(s, rank, epoch) for rank in range(s.world) if rank not in ranks)
    return out


def _missing(s: _Start, rank: int, epoch: int) -> dict[str, Any]:
    runs = [r.run for r in s.runs]
    return {"rank": rank, "world_size": s.world, "lineage": s.lineage, "runs": runs, "why": (
        f"rank {rank} of {s.world} has no part for epoch {epoch}, which its start (runs "
        f"{', '.join(runs)}) went through: its part is lost, what it delivered is unknown")}


def _finished(history: list[_Start], epoch: int, reached: set[int]) -> str | None:
    """Why ``epoch`` is finished (``None``: under way, or never part of the history)."""
    if epoch not in reached:
        return None
    if epoch < max(reached):
        return f"the job went on to epoch {max(reached)}"
    for s in history:
        ranks = {p.rank for p in _parts_of(s) if p.epoch == epoch and p.finished}
        if ranks and len(ranks) == s.world:
            return "every rank reached the end of its share"
    return None


def _parts_of(s: _Start) -> list[_Part]:
    return [p for r in s.runs for p in r.parts]


def _repeated(per_id: np.ndarray) -> np.ndarray:
    """Each id as many times as ``per_id`` counts it."""
    ids = np.flatnonzero(per_id > 0)
    return np.repeat(ids, per_id[ids])


def _finding(per_id: np.ndarray, tally: _Tally, info: dict[str, Any]) -> dict[str, Any]:
    """A finding (``per_id``: how many times each id is found): how many ids, every id, and
    the parts that delivered (or held) the first few; for a mixture also each source's ids
    within it, each as many times as it is found (a draw of it lost twice is listed twice)."""
    ids = np.flatnonzero(per_id > 0)
    shown = ids[:SHOW]
    involved = [p.describe() for p, kept in tally.parts
                if len(shown) and np.isin(shown, kept).any()]
    out: dict[str, Any] = {"count": int(len(ids)), "ids": [int(i) for i in ids],
                           "parts": involved}
    if _is_mixture(info):
        bases = _mixture(info)[1]
        ids = _repeated(per_id)
        src = np.searchsorted(bases, ids, side="right") - 1
        out["sources"] = {name: (ids[src == s] - bases[s]).tolist()
                          for s, name in enumerate(info["sources"]) if (src == s).any()}
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
        "repeats": _finding(counts - expected, tally, info), "missing": missing}
    if finished is not None:
        rec["losses"] = _finding(expected - counts - tally.dropped - tally.skipped, tally, info)
    else:
        rec["losses"] = None  # an epoch still under way loses nothing yet
    rec["exactly_once"] = rec["repeats"]["count"] == 0 and not missing and (
        rec["losses"] is None or rec["losses"]["count"] == 0)
    return rec


def _epochs(info: dict[str, Any], parts: list[_Part],
            history: list[_Start]) -> list[dict[str, Any]]:
    n = int(sum(info["counts"]))
    tallies: dict[int, _Tally] = {}
    for p in parts:  # parts off the history keep nothing: all they delivered is rolled back
        t = tallies.get(p.epoch)
        if t is None:
            t = tallies[p.epoch] = _Tally(n, _expected(info, p.epoch))
        _tally_part(info, p, t)
    reached = _reached_epochs(history)
    newest = max((p.epoch for p in _parts_of(history[-1])), default=-1) if history else -1
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
    parts, unreadable = _read_parts(root, info)
    runs = _runs(parts)
    notes: list[str] = []
    missing: list[dict[str, Any]] = []
    replays: list[dict[str, Any]] = []
    missing.extend(_gaps(runs))
    starts = _starts(runs)
    history = _history(starts, notes, missing, replays)
    for p in parts:
        p.kept, p.finished = 0, False
    batch = {r.run: int(r.parts[0].header["batch_size"]) for r in runs}
    for s in history:
        _keep(s, batch)
    epochs = _epochs(info, parts, history)
    ok = not unreadable and not missing and all(e["exactly_once"] for e in epochs)
    report = {"ledger": root, "samples": int(sum(info["counts"])), "ok": ok, "runs": [
        {"run": r.run, "host": r.host, "pid": r.pid, "rank": r.rank, "lineage": r.lineage,
         "resumed_from": r.origin, "marks": [list(m) for m, _ in r.marks()]} for r in runs],
              "replays": replays, "unreadable": unreadable, "missing": missing, "notes": notes,
              "epochs": epochs}
    if _is_mixture(info):
        report["mixture"] = {"sources": list(info["sources"]),
                             "sizes": [int(sum(c)) for c in info["shards"]],
                             "draws": list(info["draws"]), "epoch_size": _positions(info)}
    return report


def ledger_text(report: dict[str, Any]) -> str:
    """The report as the ``feedpipe ledger`` command prints it."""
    runs = f"{len(report['runs'])} run{'s' if len(report['runs']) != 1 else ''}"
    mix = report.get("mixture")
    if mix is None:
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
        lines.extend(_epoch_lines(e, report["samples"], mix is not None))
    skipped = sum(e["skipped"]["count"] for e in report["epochs"])
    also = f" ({skipped:,} samples skipped by the transform, named above)" if skipped else ""
    lines.append(f"OK: every finished epoch exactly once{also}" if report["ok"] else
                 "NOT exactly once: see above")
    return "\n".join(lines)


def _epoch_lines(e: dict[str, Any], samples: int, mixture: bool = False) -> list[str]:
    state = f"finished: {e['why_finished']}" if e["finished"] else "not finished"
    extra = [f"{e[k]} {k.replace('_', ' ')}" for k in ("rolled_back", "padding", "dropped")
             if e[k]]
    if e["skipped"]["count"]:
        extra.insert(0, f"{e['skipped']['count']:,} skipped by the transform (ids "
                        f"{_ids_text(e['skipped']['ids'])})")
    parts = f"{e['parts']} part{'s' if e['parts'] != 1 else ''}"
    # a mixture's epoch holds some samples more than once: its deliveries against its draws
    got, of = (e["delivered"], e["expected"]) if mixture else (e["distinct"], samples)
    head = (f"  epoch {e['epoch']} ({state}, {parts}): {got:,} of {of:,} "
            f"delivered{'; ' + ', '.join(extra) if extra else ''}")
    if e["exactly_once"]:
        return [head + (" - exactly once" if e["finished"] else " - no repeat so far")]
    lines = [head]
    for m in e["missing"]:
        lines.append(f"    MISSING: {m['why']}")
    for what in ("repeats", "losses"):
        f = e[what]
        if f and f["count"]:
            # a mixture's: the draws found (an id of a source drawn twice may be lost twice)
            count = sum(map(len, f["sources"].values())) if "sources" in f else f["count"]
            name = what[:-1] if count == 1 else what
            ids = (", ".join(f"{s} ids {_ids_text(v)}" for s, v in f["sources"].items())
                   if "sources" in f else f"ids {_ids_text(f['ids'])}")
            lines.append(f"    {count:,} {name}, {ids}; parts: "
                         f"{'; '.join(f['parts']) or '-'}")
    return lines


def _ids_text(ids: list[int]) -> str:
    more = f" and {len(ids) - SHOW:,} more (--json lists them all)" if len(ids) > SHOW else ""
    return f"{ids[:SHOW]}{more}"
