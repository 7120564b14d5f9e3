"""Conversion executors: who writes the shards of a plan, behind one small protocol.

An executor gets a :class:`Job`: the plan, the shards still to write, and where their parts go.
It writes every shard of ``job.todo`` and calls ``job.record`` as each one is committed. It
returns the data bytes it wrote. :func:`~feedpipe.convert._method.choose_method` picks one of:

- :class:`SerialExecutor`: this process.
- :class:`PoolExecutor`: a process pool on this machine.
- :class:`~feedpipe.convert._dask.DaskExecutor`: tasks on a Dask cluster.
- :class:`~feedpipe.convert._onepass.StagedExecutor`: shards cut from one-pass staging files.

All of them write the same bytes. Parts are written by :func:`~feedpipe.convert._writer.write_part`
and joined into shards by :func:`~feedpipe.convert._writer.finish_shard`, in the plan's order
whatever the timing.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from .._helpers.pool_context import die_with_parent, pool_context, sigint_deferred, sigint_held
from ..format._manifest import ShardRecord
from ._shard_plan import Plan
from ._sources import Source
from ._writer import PartResult, finish_shard, write_part

Record = Callable[[int, ShardRecord, list[tuple[str, str]], set[str]], None]


@dataclass
class Job:
    """The shards still to write.

    ``todo`` holds indices into ``plan``; ``names`` and ``part_paths[i, j]`` (a part's temp
    path) say where the shards and their parts go. ``bar`` is a progress bar counting files;
    ``record(i, rec, skipped, fields)`` is called for each commit."""

    source: Source
    plan: Plan
    todo: list[int]
    names: list[str]
    part_paths: dict[tuple[int, int], str]
    out: str
    on_error: str
    bar: Any
    record: Record

    def commit(self, i: int, parts: list[tuple[str, PartResult]]) -> None:
        """Join shard ``i`` from its written parts and record it."""
        rec, idx, skipped = finish_shard(self.out, self.names[i], parts)
        self.record(i, rec, skipped, idx.fields())


class Executor(Protocol):
    """Writes the shards of a :class:`Job` (see the module docstring)."""

    name: str

    def run(self, job: Job) -> int:
        """Write every shard of ``job.todo``; the data bytes written."""
        ...

    def describe(self) -> str:
        """What ran, for the summary (e.g. ``"process pool, 2 workers"``)."""
        ...


class SerialExecutor:
    """Every part in this process, shard after shard."""

    name = "serial"

    def __init__(self, why: str = "") -> None:
        self.why = why

    def run(self, job: Job) -> int:
        written = 0
        for i in job.todo:
            results = []
            for j, specs in enumerate(job.plan[i]):
                res = write_part(job.source, specs, job.part_paths[i, j], job.on_error)
                results.append((job.part_paths[i, j], res))
                job.bar.update(res.files)
                written += res.bytes
            job.commit(i, results)
        return written

    def describe(self) -> str:
        return "in this process" + (f", {self.why}" if self.why else "")


# Plans handed to forked pool workers by inheritance, by token. A worker forked while its plan is
# here reads its parts from its copy of the parent's memory, without unpickling them. Unpickling
# a sample costs more than writing a small file (benchmarks/bench_convert.py --profile).
_FORK_PLANS: dict[int, Plan] = {}
_fork_tokens = itertools.count()


def _write_inherited(token: int, i: int, j: int, source: Source, path: str,
                     on_error: str) -> PartResult:
    plan = _FORK_PLANS.get(token)
    if plan is None:  # not forked from the run that planned it: cannot happen; fail loudly
        raise RuntimeError(f"conversion worker {os.getpid()} has no plan {token}: it was not "
                           "forked from the process that planned the run")
    return write_part(source, plan[i][j], path, on_error)


class PoolExecutor:
    """Parts written by ``workers`` processes; each shard is joined in this process as soon as
    its parts are in. A plan of one part is written in this process, since a pool would only add
    its start-up; the summary says so."""

    name = "pool"

    def __init__(self, workers: int, start_method: str | None = None) -> None:
        self.workers = workers
        self.start_method = start_method
        self._ran_serially = False

    def run(self, job: Job) -> int:
        if len(job.part_paths) <= 1:
            self._ran_serially = True
            return SerialExecutor().run(job)
        import multiprocessing as mp

        ctx = pool_context() if self.start_method is None else mp.get_context(self.start_method)
        token = next(_fork_tokens) if ctx.get_start_method() == "fork" else None
        if token is not None:  # before the pool exists: its workers are forked with the plan
            _FORK_PLANS[token] = job.plan
        try:
            # a Ctrl-C is raised between parts, never inside the pool (sigint_deferred), and
            # the pool is shut down under the same deferral
            with sigint_deferred() as interrupted, \
                    ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx,
                                        initializer=die_with_parent,
                                        initargs=(os.getpid(),)) as pool:
                return _drive(pool, token, job, interrupted)
        finally:
            if token is not None:
                _FORK_PLANS.pop(token, None)

    def describe(self) -> str:
        if self._ran_serially:
            return "in this process, one part: no pool needed"
        return f"process pool, {self.workers} workers"


def _drive(pool: ProcessPoolExecutor, token: int | None, job: Job,
           interrupted: Callable[[], None]) -> int:
    """Submit every part (by reference to the inherited plan ``token``, or pickled), commit each
    shard once all its parts are written; the bytes written. ``interrupted()`` raises a Ctrl-C
    noted meanwhile: it is called after each batch of parts that came in, so a Ctrl-C stops the
    run when the next part is in (the parts under way finish either way)."""
    plan, paths = job.plan, job.part_paths
    written = 0
    futures: dict[Future[PartResult], tuple[int, int]] = {}
    results: dict[int, dict[int, PartResult]] = {i: {} for i in job.todo}
    pending: set[Future[PartResult]] = set()
    try:
        with sigint_held():  # the workers start as the first parts are submitted
            for i in job.todo:
                for j, part in enumerate(plan[i]):
                    if token is not None:
                        fut = pool.submit(_write_inherited, token, i, j, job.source,
                                          paths[i, j], job.on_error)
                    else:
                        fut = pool.submit(write_part, job.source, part, paths[i, j],
                                          job.on_error)
                    futures[fut] = (i, j)
                    pending.add(fut)
        interrupted()
        while pending:
            # each part as it comes: a shard is joined while the workers write the next ones
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i, j = futures[fut]
                res = fut.result()
                results[i][j] = res
                job.bar.update(res.files)
                written += res.bytes
                if len(results[i]) == len(plan[i]):
                    job.commit(i, [(paths[i, k], results[i][k]) for k in range(len(plan[i]))])
            interrupted()
    except BaseException:
        # the parts under way finish (each into its temp file); the others never start
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    return written
