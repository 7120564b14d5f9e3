"""The ledger's mutation suite: a simulated training job on real FeedLoaders (ranks in lockstep
in one process) with injected faults, checked by the real ledger writer and checker, whose
verdict must equal the ground truth the simulation keeps itself.

The ground truth is the history the model has: the ids each epoch's training loop received,
as the loop received them (a batch's ``i`` field, not the plan), with each checkpoint keeping a
copy of it, so that a restart from a checkpoint (or from nothing) restores the history saved
with it. The faults: a batch dropped or repeated by the resume point (a state moved a step
forward or back), an epoch abandoned (``set_epoch`` of the next one before the end), an epoch
set again (its samples repeat), a rank's part file lost, a restart from an older checkpoint,
samples skipped by the transform, a kill
at each step of the checkpoint protocol (before the state is taken; after it is taken and
before its file is written; after the write), several ranks, changes of world size and resumes,
parts flushed at every batch or only at the writer's own moments. A kill is a SIGKILL in
process: the killed loaders write nothing more, their generators' ends included."""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from feedpipe import FeedDataset, FeedLoader, SampleSkipped, check_ledger
from feedpipe.stream import _ledger
from feedpipe.stream._ledger_check import ledger_text

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "shards", "example")
N = 24


@dataclass
class Truth:
    """The model's history: per epoch the ids received (counted), those the transform skipped,
    the epochs begun and those every rank finished."""

    got: dict[int, Counter[int]] = field(default_factory=dict)
    skipped: dict[int, set[int]] = field(default_factory=dict)
    begun: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)


@dataclass
class Start:
    """The loaders (one per rank) that began together from one checkpoint, or from nothing."""

    runs: list[str]
    world: int
    parent: Start | None
    at: tuple[int, int] | None  # the checkpoint's (epoch, position) as it was saved
    began: set[int] = field(default_factory=set)


@dataclass
class Checkpoint:
    state: dict[str, Any]
    truth: Truth
    start: Start


class Job:
    positions = N  # an epoch's positions (a moved resume point stays in them)

    def __init__(self, root: Path, batch: int, bad: frozenset[int]) -> None:
        self.root, self.batch, self.bad = root, batch, bad
        self.calls: list[int] = []  # the ids the transform was called with
        self.checkpoints: list[Checkpoint] = []
        self.truth = Truth()
        self.lds: list[FeedLoader] = []
        self.all: list[FeedLoader] = []  # every loader the job made, closed at its end
        self.its: list[Any] | None = None
        self.start: Start | None = None
        self.starts: list[Start] = []
        self.pass_ids: Counter[int] = Counter()

    def transform(self, x: dict[str, Any]) -> dict[str, Any]:
        i = int(x["__index__"])
        self.calls.append(i)
        if i in self.bad:
            raise SampleSkipped(f"sample {i} is one the test breaks")
        return {"i": i}

    # -- starts ------------------------------------------------------------------------------
    def close(self) -> None:
        for ld in self.all:
            ld.dataset.close()

    def loaders(self, world: int) -> list[FeedLoader]:
        """One loader per rank of ``world``, each writing the ledger."""
        return [FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=3, rank=r,
                                       world_size=world, transform=self.transform),
                           batch_size=self.batch, ledger=self.root) for r in range(world)]

    def begin(self, world: int, ckpt: Checkpoint | None, delta: int) -> None:
        """New loaders for ``world`` ranks, from ``ckpt`` (its resume point moved by ``delta``
        positions) or from nothing, with the history that checkpoint saved."""
        self.lds = self.loaders(world)
        self.all += self.lds
        self.its = None
        at = None
        if ckpt is not None:
            state = copy.deepcopy(ckpt.state)
            at = (int(state["epoch"]), int(state["position"]))
            if delta:  # the resume point moved: a batch dropped (+) or repeated (-)
                state["position"] = min(max(0, state["position"] + delta),
                                        self.positions - 1)
            for ld in self.lds:
                ld.load_state_dict(state)
            self.truth = copy.deepcopy(ckpt.truth)
            self.truth.begun.add(int(state["epoch"]))
        else:
            self.truth = Truth()
        assert all(ld._ledger is not None for ld in self.lds)
        self.start = Start([ld._ledger.run for ld in self.lds],  # type: ignore[union-attr]
                           world, None if ckpt is None else ckpt.start, at)
        if ckpt is not None:
            self.start.began.add(int(ckpt.state["epoch"]))
        self.starts.append(self.start)

    def restart(self, where: str, world: int, delta: int) -> None:
        ckpt = None
        if where == "latest" and self.checkpoints:
            ckpt = self.checkpoints[-1]
        elif where == "older" and len(self.checkpoints) > 1:
            ckpt = self.checkpoints[-2]
        elif where == "older" and self.checkpoints:
            ckpt = self.checkpoints[0]
        self.begin(world, ckpt, delta * self.batch if ckpt is not None else 0)
        if ckpt is None:  # a fresh start goes on record with its first pass
            self.step(1)

    def kill(self) -> None:
        for ld in self.lds:
            ld._ledger._flush = lambda *a, **k: None  # type: ignore[union-attr, method-assign]
        self.its = None

    def stop(self) -> None:
        for it in self.its or []:
            it.close()
        self.its = None

    # -- the training loop ---------------------------------------------------------------------
    def step(self, k: int) -> None:
        for _ in range(k):
            if self.its is None:
                self.its = [iter(ld) for ld in self.lds]
                self.pass_ids = Counter()
            got: list[list[int]] = []
            stopped = 0
            for it in self.its:
                before = len(self.calls)
                try:
                    b = next(it)
                except StopIteration:
                    stopped += 1
                    continue
                ids = b["i"].tolist()
                calls = self.calls[before:]
                # the inline route calls the transform for the batch the loop receives only
                assert set(ids) <= set(calls) and set(calls) - set(ids) <= self.bad
                e = self.lds[0].epoch
                self.truth.skipped.setdefault(e, set()).update(set(calls) - set(ids))
                got.append(ids)
            assert stopped in (0, len(self.its)), "ranks out of lockstep"
            if stopped:
                self.its = None
                continue
            e = self.lds[0].epoch
            self.truth.begun.add(e)
            assert self.start is not None
            self.start.began.add(e)
            step_ids = [i for ids in got for i in ids]
            if self.lds[0].position >= N:  # the pass's last step: its padding repeats
                for i in step_ids:  # ids this pass delivered at its start
                    if self.pass_ids[i]:
                        self.truth.got.setdefault(e, Counter())[i] -= 1
                self.truth.done.add(e)
            self.pass_ids.update(step_ids)
            self.truth.got.setdefault(e, Counter()).update(step_ids)

    def next_epoch(self) -> None:
        """The loop leaves the epoch (finished or not) and sets the next one."""
        self.stop()
        e = self.lds[0].epoch
        for ld in self.lds:
            ld.set_epoch(e + 1)

    def replay_epoch(self) -> None:
        """The loop sets the epoch it is in again (a fault: it repeats what it delivered)."""
        self.stop()
        e = self.lds[0].epoch
        for ld in self.lds:
            ld.set_epoch(e)

    def save(self, everyone: bool, outcome: str) -> None:
        """The checkpoint protocol: rank 0 (or every rank) takes its state; the file is written
        (``persist``) or the job dies first (``lost``)."""
        state = self.lds[0].state_dict()
        if everyone:
            for ld in self.lds[1:]:
                ld.state_dict()
        if outcome == "persist":
            assert self.start is not None
            self.checkpoints.append(Checkpoint(state, copy.deepcopy(self.truth), self.start))


def expected(truth: Truth) -> dict[int, dict[str, Any]]:
    """Per epoch of the history: finished, the ids repeated, lost (finished epochs), skipped."""
    out: dict[int, dict[str, Any]] = {}
    epochs = truth.begun | set(truth.got)
    for e in epochs:
        got = truth.got.get(e, Counter())
        skipped = truth.skipped.get(e, set()) - {i for i, c in got.items() if c > 0}
        finished = e in truth.done or any(x > e for x in truth.begun)
        out[e] = {"finished": finished,
                  "repeats": sorted(i for i, c in got.items() if c > 1),
                  "losses": sorted(set(range(N)) - {i for i, c in got.items() if c > 0}
                                   - skipped) if finished else None,
                  "skipped": sorted(skipped)}
    return out


def relevant(job: Job, part: Path) -> bool | None:
    """Whether losing ``part`` loses something the verdict needs (``None``: the checker cannot
    tell a lost part of the newest start's newest epoch from a rank that has not begun it)."""
    header = _ledger.read_part(str(part))[0]
    run, epoch = header["run"], int(header["epoch"])
    owner = next(s for s in job.starts if run in s.runs)
    newest = job.starts[-1]
    if owner is newest and epoch == max(newest.began | {epoch}):
        return None
    siblings = [p for p in part.parent.glob("*.part") if p != part]
    if header.get("checked") and siblings:
        return True  # its run's plan check goes with it: the run's other parts are unreadable
    path, child = [], None
    s: Start | None = newest
    while s is not None:
        path.append((s, child))
        child, s = s, s.parent
    for s, c in path:
        if s is not owner:
            continue
        if c is None:
            return True
        assert c.at is not None
        hi = c.at[0] if c.at[1] > 0 else c.at[0] - 1
        return epoch <= hi
    return False


STEP = st.tuples(st.just("step"), st.integers(1, 12))
OPS = st.one_of(
    STEP, STEP, STEP,  # the loop trains more often than anything else happens
    st.tuples(st.just("next_epoch")),
    st.tuples(st.just("replay_epoch")),
    st.tuples(st.just("save"), st.booleans(), st.sampled_from(["persist", "lost"])),
    st.tuples(st.just("kill"), st.sampled_from(["latest", "older", "fresh"]),
              st.integers(1, 3), st.sampled_from([0, 0, 0, -1, 1])),
    st.tuples(st.just("stop_restart"), st.sampled_from(["latest", "older"]),
              st.integers(1, 3), st.sampled_from([0, 0, -1, 1])),
)


def play(job: Job, ops: list[tuple[Any, ...]], world: int) -> None:
    job.begin(world, None, 0)
    for op in ops:
        event(f"op {op[0]}" + (f" {op[1]}" if op[0] in ("kill", "stop_restart") else "")
              + (" (moved resume point)" if op[0] in ("kill", "stop_restart") and op[3] else "")
              + (f" {op[2]}" if op[0] == "save" else ""))
        if op[0] == "step":
            job.step(op[1])
        elif op[0] == "next_epoch":
            job.next_epoch()
        elif op[0] == "replay_epoch":
            job.replay_epoch()
        elif op[0] == "save":
            job.save(op[1], op[2])
            if op[2] == "lost":  # killed between state_dict() and the end of the write
                job.kill()
                job.restart("latest", len(job.lds), 0)
        elif op[0] == "kill":
            job.kill()
            job.restart(op[1], op[2] if not job.bad else 1, op[3])
        else:
            job.stop()
            job.restart(op[1], op[2] if not job.bad else 1, op[3])


def run_job(root: Path, ops: list[tuple[Any, ...]], world: int, batch: int,
            bad: frozenset[int], lose: int | None) -> None:
    job = Job(root, batch, bad)
    try:
        play(job, ops, world)
    finally:
        job.stop()
        job.close()
    # a part whose run has others: a run lost whole can be told only by its rank's absence
    # from its start (tests/test_ledger.py::test_a_missing_rank_part_is_never_ok), which a
    # lost run of another start can hide
    parts = sorted((p for p in root.glob("r*/*.part") if len(list(p.parent.glob("*.part"))) > 1),
                   key=lambda p: (_ledger.read_part(str(p))[0]["created"], p.name))
    lost, matters = None, None
    if lose is not None and parts:
        lost = parts[lose % len(parts)]
        matters = relevant(job, lost)
        if matters is None:
            lost = None  # not a fault the ledger can see yet: inject none
        else:
            lost.unlink()
    report = check_ledger(root)
    ledger_text(report)  # the text is made from every report
    truth = expected(job.truth)
    if lost is not None:
        named = report["missing"] or report["unreadable"] or any(
            e["missing"] for e in report["epochs"])
        where = "needed" if matters else "off the history"
        if not report["ok"] and named:  # the damage is named: the verdict tells no lie
            event(f"lost part named ({where})")
            return
        # a lost part the checker did not need (or whose record another start repeats):
        # then its verdict is the truth
        event(f"lost part not needed ({where})")
    event("verdict: OK" if all(not w["repeats"] and not w["losses"] for w in truth.values())
          else "verdict: NOT exactly once")
    compare(report, truth)


def compare(report: dict[str, Any], truth: dict[int, dict[str, Any]]) -> None:
    by_epoch = {e["epoch"]: e for e in report["epochs"]}
    for e, want in truth.items():
        got = by_epoch.get(e)
        assert got is not None, (e, want, report)
        assert got["finished"] == want["finished"], (e, want, got)
        assert sorted(got["repeats"]["ids"]) == want["repeats"], (e, want, got)
        assert sorted(got["skipped"]["ids"]) == want["skipped"], (e, want, got)
        if want["losses"] is None:
            assert got["losses"] is None, (e, want, got)
        else:
            assert sorted(got["losses"]["ids"]) == want["losses"], (e, want, got)
        assert not got["missing"], (e, got)
    for e, got in by_epoch.items():
        if e not in truth:  # begun only by what was rolled back
            assert not got["finished"] and not got["delivered"], (e, got, truth)
    ok = all(not w["repeats"] and not w["losses"] for w in truth.values())
    assert report["ok"] == ok and not report["unreadable"] and not report["missing"], (
        ledger_text(report), truth)


SCENARIO = dict(
    ops=st.lists(OPS, min_size=1, max_size=10),
    world=st.integers(1, 3), batch=st.integers(2, 3),
    bad=st.frozensets(st.integers(0, N - 1), max_size=3),
    flush=st.sampled_from([0.0, float("inf")]),
    lose=st.none() | st.integers(0, 50))


def scenario(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
             ops: list[tuple[Any, ...]], world: int, batch: int, bad: frozenset[int],
             flush: float, lose: int | None) -> None:
    monkeypatch.setattr(_ledger, "FLUSH_SECONDS", flush)
    if bad:
        event("samples skipped by the transform")
    if world > 1 and not bad:
        event("several ranks")
    root = tmp_path_factory.mktemp("ledger")
    run_job(root, ops, 1 if bad else world, batch, bad, lose)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(**SCENARIO)
def test_the_ledgers_verdict_is_the_truth(tmp_path_factory: pytest.TempPathFactory,
                                          monkeypatch: pytest.MonkeyPatch, **kw: Any) -> None:
    scenario(tmp_path_factory, monkeypatch, **kw)


@pytest.mark.slow
@settings(max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(**SCENARIO)
def test_the_ledgers_verdict_is_the_truth_over_many_jobs(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        **kw: Any) -> None:
    scenario(tmp_path_factory, monkeypatch, **kw)
