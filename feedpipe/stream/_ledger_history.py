"""The history a ledger's training run went through (:func:`~feedpipe.check_ledger`): its parts
grouped into runs and starts, the chain of starts from the newest back to a fresh one, and
what each part keeps in that history (what came after a state resumed from is rolled back; a
state seen saved proves every rank came as far). See :mod:`feedpipe.stream._ledger_check`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan._order import Split
from ._ledger import finished_reach

Mark = tuple[int, int]  # (epoch, position)


@dataclass
class LedgerPart:
    path: str
    header: dict[str, Any]
    bits: np.ndarray | None  # a version-1 part's bitmap of delivered ids
    split: Split
    seq: int = 0  # the order of the run's passes
    kept: int = 0  # local positions that stay in the history (set by keep_parts)
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
    parts: list[LedgerPart] = field(default_factory=list)

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

    part: LedgerPart
    reached: int | None
    time: float | None


@dataclass
class LedgerStart:
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


def group_runs(parts: list[LedgerPart]) -> list[_Run]:
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


def part_gaps(runs: list[_Run]) -> list[dict[str, Any]]:
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


def find_starts(runs: list[_Run]) -> list[LedgerStart]:
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
    starts = [LedgerStart(lin, g[0].origin, g) for lin, gs in lineages.items() for g in gs]
    return sorted(starts, key=lambda s: s.created)


def origin_mark(origin: dict[str, Any]) -> Mark:
    return int(origin.get("epoch") or 0), int(origin.get("position") or 0)


def _parent(start: LedgerStart, starts: list[LedgerStart], notes: list[str],
            missing: list[dict[str, Any]]) -> tuple[LedgerStart | None, _Proof | None]:
    """The start that saved the state ``start`` resumed from, and the part that recorded the
    saving (``None`` when no part did)."""
    origin = start.origin
    if origin is None:
        return None, None
    at = origin_mark(origin)
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


def _saver(start: LedgerStart, saver: list[LedgerStart], at: Mark,
           missing: list[dict[str, Any]]) -> tuple[LedgerStart | None, _Proof | None]:
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


def build_history(starts: list[LedgerStart], notes: list[str], missing: list[dict[str, Any]],
             replays: list[dict[str, Any]]) -> list[LedgerStart]:
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
        at = origin_mark(child.origin or {})
        parent.cut, parent.proof = at, proof
        _replayed(child, at, [s for s in starts if parent.created <= s.created < child.created],
                  replays)
        path.append(parent)
    if path[-1].origin is None:  # a fresh start: had an earlier one saved states?
        _replayed(path[-1], None, [s for s in starts if s.created < path[-1].created], replays)
    return path[::-1]


def _replayed(child: LedgerStart, at: Mark | None, between: list[LedgerStart],
              replays: list[dict[str, Any]]) -> None:
    """Name a restart of ``child`` from an older state than one saved since by the starts
    ``between`` its parent and it."""
    later = [(m, s) for s in between for m, _ in s.marks() if at is None or m > at]
    if later:
        m, s = max(later, key=lambda x: x[0])
        replays.append(_replay(child, s, at, m))


def _replay(child: LedgerStart, parent: LedgerStart, at: Mark | None,
            later: Mark) -> dict[str, Any]:
    runs = [parent.runs[0].run, child.runs[0].run]
    whence = "nothing" if at is None else f"epoch {at[0]} position {at[1]}"
    return {"origin": child.origin, "runs": runs, "why": (
        f"run {runs[1]} started from {whence}, although run {runs[0]} had saved a later state "
        f"since (epoch {later[0]} position {later[1]}): a restart from an older checkpoint, or "
        "from one whose save did not complete; what was delivered after it is rolled back")}


def _local(part: LedgerPart, position: int) -> int:
    """Local positions of ``part``'s share before global ``position`` of its epoch."""
    s = part.split
    if position >= s.num_samples:
        return s.length
    return min(s.length, max(0, -(-(position - s.start) // s.world_size)))


def keep_parts(start: LedgerStart, batch: dict[str, int]) -> None:
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


def _cut(p: LedgerPart, cut: Mark, batch: int) -> None:
    """``p`` was under way when the state at ``cut`` was saved: it keeps what came before."""
    if p.epoch < cut[0]:
        _whole(p, batch)
    elif p.epoch == cut[0]:
        p.kept = min(_local(p, cut[1]), p.reached)
        p.finished = cut[1] >= p.split.num_samples and p.reached >= finished_reach(p.split, batch)
    else:
        p.kept, p.finished = 0, False


def _around(start: LedgerStart, r: _Run,
            proof: _Proof) -> tuple[list[LedgerPart], list[LedgerPart], list[LedgerPart]]:
    """``r``'s parts before the saving of the state, the one under way then, and those after.
    Ranks go through the same passes (lockstep): as many passes of every rank came before as
    of the saving rank's."""
    rec = proof.part
    if r.run == rec.run:
        return ([p for p in r.parts if p.seq < rec.seq], [rec],
                [p for p in r.parts if p.seq > rec.seq])
    saver = next(x for x in start.runs if x.run == rec.run)
    done = sum(1 for p in saver.parts if part_passed(p) and p.seq < rec.seq)
    passes = [p for p in r.parts if part_passed(p)]
    records = [p for p in r.parts if not part_passed(p)]  # they hold no delivery
    if part_passed(rec):
        return records + passes[:done], passes[done:done + 1], passes[done + 1:]
    return records + passes[:done], [], passes[done:]


def _whole(p: LedgerPart, batch: int) -> None:
    p.kept = p.reached  # the loop received every batch of its share: finished
    p.finished = p.reached >= finished_reach(p.split, batch)


def _credit(start: LedgerStart, cut: Mark, proof: _Proof, batch: dict[str, int]) -> None:
    """Every rank's pass had received as many batches as the saving rank's when the state was
    saved (lockstep): credit a rank whose part was last flushed before."""
    rec = proof.part
    if not part_passed(rec):
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


def part_passed(p: LedgerPart) -> bool:
    """Whether a pass began in ``p`` (not a part that only put a loaded or saved state on
    record; version 2 wrote none such)."""
    return bool(p.header.get("pass", True))


def parts_of(s: LedgerStart) -> list[LedgerPart]:
    return [p for r in s.runs for p in r.parts]
