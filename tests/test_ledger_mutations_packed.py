"""The ledger's mutation suite over a Packed loader (tests/test_ledger_mutations.py's simulated
job, its faults and its history, with rows of token documents for samples): the ground truth
is the tokens each epoch's loops received (every token of the corpus is unique), and the
checker's verdict, with its losses and repeats named as pieces of documents, must equal it
token for token. The faults: a batch dropped or repeated by a moved resume point, an epoch
abandoned or set again, a rank's part lost, a restart from an older checkpoint, a kill at each
step of the checkpoint protocol, several ranks, changes of world size and resumes, parts flushed
at every batch or only at the writer's own moments."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_ledger_mutations import OPS, Job, Truth, play, relevant

from feedpipe import FeedDataset, FeedLoader, Packed, check_ledger, write_samples
from feedpipe.stream import _ledger
from feedpipe.stream._ledger_check import ledger_text

SEQ = 8
LENGTHS = [int(n) for n in np.random.default_rng(11).integers(1, 25, size=20)]
TOKENS = Counter(i * 1000 + j for i, n in enumerate(LENGTHS) for j in range(n))
ROWS = -(-sum(LENGTHS) // SEQ)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("packed") / "tok")
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": np.arange(n) + i * 1000}
                   for i, n in enumerate(LENGTHS)], root, max_samples=6)
    return root


class PackedJob(Job):
    """Job's training loop over Packed rows: what a loop receives is the batch's tokens."""

    positions = ROWS

    def __init__(self, root: Path, batch: int, corpus: str, workers: int = 0) -> None:
        super().__init__(root, batch, frozenset())
        self.corpus, self.workers = corpus, workers

    def close(self) -> None:
        for ld in self.all:
            ld.dataset.dataset.close()

    def loaders(self, world: int) -> list[FeedLoader]:
        route = "packed-workers" if self.workers else "auto"
        return [FeedLoader(Packed(FeedDataset(self.corpus, shuffle=True, seed=3, rank=r,
                                              world_size=world), SEQ),
                           batch_size=self.batch, ledger=self.root,
                           num_workers=self.workers, route=route) for r in range(world)]

    def step(self, k: int) -> None:
        for _ in range(k):
            if self.its is None:
                self.its = [iter(ld) for ld in self.lds]
            got: list[int] = []
            stopped = 0
            for it in self.its:
                try:
                    b = next(it)
                except StopIteration:
                    stopped += 1
                    continue
                got += b["input_ids"][b["labels"] != -100].tolist()  # padding is no token
            if self.workers and got:  # the rows came from worker processes of its own
                pids = self.lds[0].stats()["worker_pids"]
                assert pids and len(set(pids)) <= self.workers and os.getpid() not in pids
            assert stopped in (0, len(self.its)), "ranks out of lockstep"
            if stopped:
                self.its = None
                continue
            e = self.lds[0].epoch
            self.truth.begun.add(e)
            assert self.start is not None
            self.start.began.add(e)
            if self.lds[0].position >= ROWS:  # the pass's last step
                self.truth.done.add(e)
            self.truth.got.setdefault(e, Counter()).update(got)


def named(finding: dict[str, Any] | None) -> Counter[int]:
    """The tokens a finding's pieces name, each as many times as named."""
    out: Counter[int] = Counter()
    for d, s, k in (finding or {}).get("pieces", []):
        out.update(range(d * 1000 + s, d * 1000 + s + k))
    return out


def compare(report: dict[str, Any], truth: Truth) -> None:
    by_epoch = {e["epoch"]: e for e in report["epochs"]}
    wrong = False
    for e in truth.begun | set(truth.got):
        got = truth.got.get(e, Counter())
        finished = e in truth.done or any(x > e for x in truth.begun)
        rec = by_epoch.get(e)
        assert rec is not None, (e, report)
        assert rec["finished"] == finished, (e, rec)
        repeats = got - TOKENS  # a token received c times: c - 1 repeats
        assert named(rec["repeats"]) == repeats, (e, rec, repeats)
        if finished:
            assert named(rec["losses"]) == TOKENS - got, (e, rec)
            wrong |= bool(TOKENS - got)
        else:
            assert rec["losses"] is None, (e, rec)
        wrong |= bool(repeats)
        assert not rec["missing"], (e, rec)
    for e, rec in by_epoch.items():
        if e not in truth.begun | set(truth.got):  # begun only by what was rolled back
            assert not rec["finished"] and not rec["delivered"], (e, rec)
    event("verdict: NOT exactly once" if wrong else "verdict: OK")
    assert report["ok"] == (not wrong) and not report["unreadable"] and not report["missing"], (
        ledger_text(report))


def run_job(root: Path, corpus: str, ops: list[tuple[Any, ...]], world: int, batch: int,
            lose: int | None, workers: int = 0) -> dict[str, Any]:
    job = PackedJob(root, batch, corpus, workers)
    try:
        play(job, ops, world)
    finally:
        job.stop()
        job.close()
    parts = sorted((p for p in root.glob("r*/*.part") if len(list(p.parent.glob("*.part"))) > 1),
                   key=lambda p: (_ledger.read_part(str(p))[0]["created"], p.name))
    lost = None
    if lose is not None and parts:
        lost = parts[lose % len(parts)]
        if relevant(job, lost) is None:
            lost = None  # not a fault the ledger can see yet: inject none
        else:
            lost.unlink()
    report = check_ledger(root)
    ledger_text(report)
    if lost is not None:
        named_ = report["missing"] or report["unreadable"] or any(
            e["missing"] for e in report["epochs"])
        if not report["ok"] and named_:  # the damage is named: the verdict tells no lie
            event("lost part named")
            return report
        event("lost part not needed")
    compare(report, job.truth)
    return report


SCENARIO = dict(
    ops=st.lists(OPS, min_size=1, max_size=10),
    world=st.integers(1, 3), batch=st.integers(2, 3),
    flush=st.sampled_from([0.0, float("inf")]),
    lose=st.none() | st.integers(0, 50))


def scenario(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
             corpus: str, ops: list[tuple[Any, ...]], world: int, batch: int, flush: float,
             lose: int | None) -> None:
    monkeypatch.setattr(_ledger, "FLUSH_SECONDS", flush)
    if world > 1:
        event("several ranks")
    run_job(tmp_path_factory.mktemp("ledger"), corpus, ops, world, batch, lose)


FAULTS = {  # each fault on its own, with the verdict it must give (compared token for token)
    "a batch dropped": ([("step", 3), ("save", False, "persist"), ("kill", "latest", 1, 1),
                         ("step", 99)], 1, False),
    "a batch repeated": ([("step", 3), ("save", False, "persist"), ("kill", "latest", 1, -1),
                          ("step", 99)], 1, False),
    "an epoch abandoned": ([("step", 2), ("next_epoch",), ("step", 99)], 1, False),
    "an epoch set again": ([("step", 3), ("replay_epoch",), ("step", 99)], 2, False),
    "an older checkpoint": ([("step", 2), ("save", False, "persist"), ("step", 2),
                             ("save", False, "persist"), ("kill", "older", 1, 0),
                             ("step", 99)], 1, True),
    "killed before a state is taken": ([("step", 3), ("save", False, "persist"), ("step", 2),
                                        ("kill", "latest", 1, 0), ("step", 99)], 1, True),
    "killed between state_dict and its write": ([("step", 3), ("save", True, "lost"),
                                                 ("step", 99)], 2, True),
    "killed after the write": ([("step", 3), ("save", False, "persist"),
                                ("kill", "latest", 2, 0), ("step", 99)], 2, True),
    "several ranks, resumes on other worlds": ([("step", 2), ("save", False, "persist"),
                                                ("kill", "latest", 2, 0), ("step", 2),
                                                ("save", True, "persist"),
                                                ("stop_restart", "latest", 1, 0),
                                                ("step", 40)], 3, True),
}


@pytest.fixture
def no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation outside Hypothesis: its statistics events go nowhere."""
    import test_ledger_mutations

    quiet = lambda *a, **k: None  # noqa: E731
    monkeypatch.setattr(test_ledger_mutations, "event", quiet)
    monkeypatch.setitem(globals(), "event", quiet)


# with workers every fault costs a job of worker processes: one runs by default, all with --slow
_CASES = [pytest.param(f, w, marks=[pytest.mark.slow] if w and f != "a batch dropped" else [])
          for f in sorted(FAULTS) for w in (0, 2)]


@pytest.mark.usefixtures("no_events")
@pytest.mark.parametrize(("fault", "workers"), _CASES)
def test_each_fault_gives_its_verdict(tmp_path: Path, corpus: str, fault: str,
                                      workers: int) -> None:
    """Each fault on its own, in this process and with 2 worker processes per rank making the
    rows (route packed-workers): the verdict, and its findings token for token, are the
    truth's."""
    ops, world, ok = FAULTS[fault]
    report = run_job(tmp_path / "l", corpus, ops, world, 2, None, workers)
    assert report["ok"] is ok, ledger_text(report)


@pytest.mark.usefixtures("no_events")
@pytest.mark.parametrize("lose", range(4))
def test_a_lost_part_of_a_rank_is_never_ok(tmp_path: Path, corpus: str, lose: int) -> None:
    """Two ranks through three epochs with a resume between: each part a run has beside
    others, lost, is named and fails the check (or, off the history, changes nothing)."""
    ops = [("step", 99), ("next_epoch",), ("step", 3), ("save", False, "persist"),
           ("stop_restart", "latest", 2, 0), ("step", 99), ("next_epoch",), ("step", 99)]
    report = run_job(tmp_path / "l", corpus, ops, 2, 2, lose)
    assert not report["ok"] and (report["missing"] or any(e["missing"]
                                                          for e in report["epochs"]))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(**SCENARIO)
def test_the_packed_ledgers_verdict_is_the_truth(tmp_path_factory: pytest.TempPathFactory,
                                                 monkeypatch: pytest.MonkeyPatch, corpus: str,
                                                 **kw: Any) -> None:
    scenario(tmp_path_factory, monkeypatch, corpus, **kw)


@pytest.mark.slow
@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(**SCENARIO)
def test_the_packed_ledgers_verdict_is_the_truth_over_many_jobs(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, corpus: str,
        **kw: Any) -> None:
    scenario(tmp_path_factory, monkeypatch, corpus, **kw)
