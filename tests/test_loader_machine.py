"""A Hypothesis state machine over loader operations, checked against a model of exactly-once.

The machine makes *jobs*: one :class:`~feedpipe.FeedLoader` per rank of a world, all ranks
stepping in lockstep as DDP ranks do. Several jobs live at once over the same datasets (one
:class:`~feedpipe.FeedDataset` per rank and world, shared by every job of that world), with
different batch sizes and executors. It iterates some batches, breaks a pass, calls
``set_epoch``, saves ``state_dict()`` and resumes it in a new job of another world size, batch size
or executor, and finishes epochs.

The model: each job's epoch, the samples delivered so far in it (a multiset over all ranks) and
the point a pass restarts from. Checked after every step: every rank's ``state_dict()`` names the
model's epoch and the number of samples delivered (so a resume skips and repeats nothing); every
rank gets the same number of batches; ``len(loader)`` is the whole epoch's batches. At the end of
each epoch: the union over ranks of the delivered ids is every sample, each once, with at most
``world_size - 1`` repeated as padding (the dataset's ``drop_last=False``, the documented way
ranks are made equal); with ``FeedLoader(drop_last=True)`` each rank's short last batch is left
out and the rest are distinct.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from _data import make_dataset
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from feedpipe import FeedDataset, FeedLoader

N = 25  # make_dataset's defaults: 25 samples in shards of 7


def tagged(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform (the threads executor runs one): the sample's id and key."""
    return {"__index__": sample["__index__"], "__key__": sample["__key__"]}


# executor -> (the dataset has a transform, loader arguments)
INLINE: dict[str, tuple[bool, dict[str, Any]]] = {
    "refs": (False, {}),
    "refs-asked-workers": (False, {"num_workers": 2}),  # refs runs here and says so
    "samples": (True, {"route": "samples"}),
    "threads": (True, {"transform_threads": 2}),
}
WORKERS: dict[str, tuple[bool, dict[str, Any]]] = {
    "workers": (True, {"num_workers": 2}),
    "one-worker": (False, {"route": "samples-workers", "num_workers": 1}),
    "persistent": (True, {"num_workers": 2, "persistent_workers": True}),
}


class Job:
    """One loader per rank of a world, and the model of what they have delivered."""

    def __init__(self, loaders: list[FeedLoader], world: int, batch_size: int,
                 whole: bool) -> None:
        self.loaders, self.world, self.batch_size = loaders, world, batch_size
        self.whole = whole  # FeedLoader(drop_last=True): each rank's short last batch left out
        self.its: list[Any] | None = None  # the ranks' live passes
        self.epoch = 0  # the loaders' epoch
        self.finished = False  # the pass ran to the end of its epoch
        self.chosen = False  # set_epoch / load_state_dict since the last pass began
        self.base: Counter[int] = Counter()  # delivered before the pass's start point (resumed)
        self.delivered: Counter[int] = Counter()  # this epoch, all ranks
        self.batches = 0  # batches each rank received in this pass

    def stop(self) -> None:
        for it in self.its or []:
            it.close()
        self.its = None

    def __repr__(self) -> str:
        return f"Job(world={self.world}, batch={self.batch_size}, whole={self.whole})"

    def per_rank(self, samples: int) -> int:
        """Batches of each rank for ``samples`` positions of an epoch left (padded)."""
        length = -(-samples // self.world)
        return length // self.batch_size if self.whole else -(-length // self.batch_size)


class LoaderMachine(RuleBasedStateMachine):
    executors = INLINE
    worlds: tuple[int, ...] = (1, 2, 3)

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.datasets: dict[tuple[int, int, bool], FeedDataset] = {}
        self.live: list[Job] = []

    jobs = Bundle("jobs")

    def dataset(self, rank: int, world: int, transform: bool) -> FeedDataset:
        key = (rank, world, transform)
        if key not in self.datasets:  # shared by every job of this world
            self.datasets[key] = FeedDataset(self.path, shuffle=True, seed=7, rank=rank,
                                             world_size=world,
                                             transform=tagged if transform else None)
        return self.datasets[key]

    def job(self, world: int, batch_size: int, executor: str, whole: bool = False) -> Job:
        transform, kwargs = self.executors[executor]
        loaders = [FeedLoader(self.dataset(r, world, transform), batch_size=batch_size,
                              drop_last=whole, **kwargs) for r in range(world)]
        job = Job(loaders, world, batch_size, whole)
        self.live.append(job)
        return job

    def parts(self) -> st.SearchStrategy[tuple[int, int, str, bool]]:
        return st.tuples(st.sampled_from(self.worlds), st.integers(1, 9),
                         st.sampled_from(sorted(self.executors)), st.booleans())

    @initialize(target=jobs, world=st.sampled_from((1, 2, 3)), batch_size=st.integers(1, 9),
                executor=st.sampled_from(sorted(INLINE)))
    def first_job(self, world: int, batch_size: int, executor: str) -> Job:
        if executor not in self.executors:
            executor = sorted(self.executors)[0]
        return self.job(world, batch_size, executor)

    @rule(target=jobs, parts=st.data())
    def another_job(self, parts: st.DataObject) -> Job:
        return self.job(*parts.draw(self.parts()))

    # -- the model's moves -----------------------------------------------------------------
    def _begin(self, job: Job) -> None:
        """A new pass on every rank, as ``FeedLoader.__iter__`` starts one."""
        if job.finished and not job.chosen:  # the next epoch
            job.epoch += 1
            job.base = Counter()
        job.chosen = job.finished = False
        job.delivered = Counter(job.base)
        job.batches = 0
        job.its = [iter(ld) for ld in job.loaders]

    @rule(job=jobs, k=st.integers(1, 6))
    def step(self, job: Job, k: int) -> None:
        if job.its is None:
            self._begin(job)
        assert job.its is not None
        expected = job.per_rank(N - sum(job.base.values()))
        for _ in range(k):
            if job.batches == expected:
                break
            for it in job.its:
                batch = next(it)  # every rank has this batch: none may stop early
                got = batch["__index__"].tolist()
                assert 0 < len(got) <= job.batch_size
                job.delivered.update(got)
            job.batches += 1
        if job.batches == expected:  # the epoch's end: every rank stops here
            for it in job.its:
                with pytest.raises(StopIteration):
                    next(it)
            self._check_epoch(job)
            job.its = None
            job.finished = True

    def _check_epoch(self, job: Job) -> None:
        counts = job.delivered
        left = N - sum(job.base.values())  # positions this pass started with
        length = -(-left // job.world)
        if job.whole and length % job.batch_size:
            # the ranks' short last batches are left out: the full ones hold distinct samples
            assert all(c == 1 for c in counts.values()), counts.most_common(3)
            assert len(counts) == N - left + job.per_rank(left) * job.batch_size * job.world
            return
        assert set(counts) == set(range(N)), sorted(set(range(N)) - set(counts))
        extra = sum(counts.values()) - N
        assert 0 <= extra <= job.world - 1, counts.most_common(3)

    @rule(job=jobs)
    def break_pass(self, job: Job) -> None:
        """The loop stops mid-pass; a later pass of the same loaders restarts from the pass's
        start point (state_dict() still names what was reached)."""
        job.stop()

    @rule(job=jobs, epoch=st.integers(0, 3))
    def set_epoch(self, job: Job, epoch: int) -> None:
        job.stop()
        for ld in job.loaders:
            ld.set_epoch(epoch)
        if epoch != job.epoch or job.finished:
            job.epoch = epoch
            job.base = Counter()
        job.finished = False
        job.chosen = True
        job.delivered = Counter(job.base)
        job.batches = 0

    @rule(target=jobs, job=jobs, parts=st.data())
    def resume_elsewhere(self, job: Job, parts: st.DataObject) -> Any:
        """The job is saved and its pass stopped; a new job (any world, batch size, executor)
        loads the state and continues with exactly the rest."""
        states = [ld.state_dict() for ld in job.loaders]
        assert all(s == states[0] for s in states)  # one rank's state resumes every rank
        job.stop()
        new = self.job(*parts.draw(self.parts()))
        for ld in new.loaders:
            ld.load_state_dict(states[0])
        new.epoch = job.epoch + 1 if job.finished else job.epoch
        new.base = Counter() if job.finished else Counter(job.delivered)
        new.delivered = Counter(new.base)
        new.chosen = True
        return multiple(new)  # the saved job stays: its loaders may go on by themselves

    # -- what must hold after every step ---------------------------------------------------
    @invariant()
    def states_name_what_was_delivered(self) -> None:
        for job in self.live:
            epoch = job.epoch + 1 if job.finished else job.epoch
            position = 0 if job.finished else sum(job.delivered.values())
            for ld in job.loaders:
                state = ld.state_dict()
                assert (state["epoch"], state["position"]) == (epoch, position), job
                assert len(ld) == job.per_rank(N)
            if not job.finished:  # padding comes only with an epoch's last batch
                assert all(c == 1 for c in job.delivered.values())

    def teardown(self) -> None:
        for job in self.live:
            job.stop()


class WorkerMachine(LoaderMachine):
    """The same machine on worker processes (fewer, smaller examples: each pass starts them)."""

    executors = WORKERS
    worlds = (1, 2)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("machine")))


def test_loaders_deliver_every_sample_once_whatever_the_operations(path: str) -> None:
    run_state_machine_as_test(lambda: LoaderMachine(path), settings=settings(  # type: ignore[arg-type]
        max_examples=40, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.slow
def test_worker_loaders_deliver_every_sample_once_whatever_the_operations(path: str) -> None:
    run_state_machine_as_test(lambda: WorkerMachine(path), settings=settings(  # type: ignore[arg-type]
        max_examples=20, stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
