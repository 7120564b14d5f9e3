"""``feedpipe shard --dask ADDRESS``: write the shards as tasks on an existing Dask cluster.

The client lists and plans exactly as a local run does (:mod:`~feedpipe.convert._shard`). Then
:func:`plan_tasks` (pure) groups the plan's shard parts into coarse tasks. A task costs the
cluster a fixed amount of coordination whatever it does, about as much as writing one part
(``benchmarks/bench_dask.py``). So a task writes whole shards: as many consecutive ones as fit
in a budget of :data:`TASK_FILES` files and :data:`TASK_BYTES` bytes. It commits each shard as
soon as its parts are written. Only a shard larger than twice the budget is split: into batches
of parts, plus one task that joins them once they are done. So a few big shards still spread
over every worker. The budget shrinks to a quarter of an even share per worker
(:data:`TASKS_PER_SLOT`), so that a small job still keeps every worker busy to the end.

Parts and joins are the same functions on the same inputs as on one machine
(:func:`~feedpipe.convert._writer.write_part`, :func:`~feedpipe.convert._writer.finish_shard`).
So the shards, indexes and manifest are byte-identical to a local run's with the same options.

- **Where files go**: workers read ``src`` and write into ``out`` themselves. Both must be
  visible at the same paths on every worker (a shared filesystem, or an fsspec URL for ``src``).
  A worker that cannot see ``out`` fails its task with a message that says so.
- **Failures**: a failed task is retried ``retries`` times (``Client.submit(retries=...)``); Dask
  reschedules a task whose worker dies. Part files are hidden temp files named after the
  client's pid, so a retry overwrites its own partial output and never a shard. A retry of a
  task that had already committed a shard commits the same bytes again.
- **Atomicity and resume**: a shard exists under its final name only when complete (the join's
  rename). ``--resume`` reuses committed shards, whatever machine or task wrote them.
- **Progress**: the client's progress bar counts the files of finished tasks.

``dask`` is imported only here and only when asked for (extra ``feedpipe[dask]``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._redact import logger
from ..errors import OutputError
from ..format._manifest import ShardRecord
from ._shard_plan import sample_size
from ._sources import SampleSpec, Source
from ._writer import PartResult, finish_shard, write_part

log = logger("feedpipe.convert")
_PURPOSE = "feedpipe shard --dask"
CONNECT_TIMEOUT = "30s"
STOP_TIMEOUT = 120  # s: a task stops after its shard under way
TASK_FILES = 4096
TASK_BYTES = 64 << 20
TASKS_PER_SLOT = 4

Committed = tuple[ShardRecord, list[tuple[str, str]], set[str]]


@dataclass(frozen=True)
class Unit:
    """Parts ``first`` to ``end - 1`` of shard ``shard``; ``whole``: all of them, and the task
    that writes them also commits the shard."""

    shard: int
    first: int
    end: int
    whole: bool


@dataclass
class UnitResult:
    unit: Unit
    parts: list[PartResult] = field(default_factory=list)
    committed: Committed | None = None

    @property
    def files(self) -> int:
        return sum(p.files for p in self.parts)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)


def _part_cost(part: list[SampleSpec]) -> tuple[int, int]:
    return sum(len(s.files) for s in part), sum(sample_size(s) for s in part)


def plan_tasks(plan: Sequence[Sequence[list[SampleSpec]]], todo: Sequence[int], *, slots: int,
               max_files: int = TASK_FILES, max_bytes: int = TASK_BYTES) -> list[list[Unit]]:
    """Group the parts of shards ``todo`` into tasks of at most ``max_files`` files and
    ``max_bytes`` bytes (pure; at least one part each), for a cluster of ``slots`` worker threads.

    Consecutive whole shards share a task while they fit; a shard over twice the budget is cut
    into tasks of its parts (not ``whole``: someone must join them). Every part of every shard in
    ``todo`` is in exactly one task, in plan order.
    """
    if slots < 1:
        raise ValueError(f"slots must be at least 1, not {slots}")
    costs = {i: [_part_cost(p) for p in plan[i]] for i in todo}
    total_files = sum(f for c in costs.values() for f, _ in c)
    total_bytes = sum(b for c in costs.values() for _, b in c)
    share = TASKS_PER_SLOT * slots
    bf = max(1, min(max_files, -(-total_files // share)))
    bb = max(1, min(max_bytes, -(-total_bytes // share)))
    tasks: list[list[Unit]] = []
    cur: list[Unit] = []
    cf = cb = 0
    for i in todo:
        sf = sum(f for f, _ in costs[i])
        sb = sum(b for _, b in costs[i])
        if len(plan[i]) > 1 and (sf > 2 * bf or sb > 2 * bb):
            if cur:
                tasks.append(cur)
            cur, cf, cb = [], 0, 0
            tasks += _cut_shard(i, costs[i], bf, bb)
            continue
        if cur and (cf + sf > bf or cb + sb > bb):
            tasks.append(cur)
            cur, cf, cb = [], 0, 0
        cur.append(Unit(i, 0, len(plan[i]), True))
        cf, cb = cf + sf, cb + sb
    if cur:
        tasks.append(cur)
    return tasks


def _cut_shard(i: int, costs: list[tuple[int, int]], bf: int, bb: int) -> list[list[Unit]]:
    """Shard ``i`` over twice the budget, its parts (of ``costs``: files, bytes) cut into tasks
    of at most ``bf`` files and ``bb`` bytes (at least one part each), to be joined later."""
    tasks: list[list[Unit]] = []
    first = cf = cb = 0
    for j, (f, b) in enumerate(costs):
        if j > first and (cf + f > bf or cb + b > bb):
            tasks.append([Unit(i, first, j, False)])
            first, cf, cb = j, 0, 0
        cf, cb = cf + f, cb + b
    tasks.append([Unit(i, first, len(costs), False)])
    return tasks


def check_dask() -> Any:
    """Import ``distributed`` or fail with the exact pip line of the ``dask`` extra."""
    from .._helpers.dependency import require

    return require("distributed", extra="dask", purpose=_PURPOSE)


def _where() -> str:
    try:
        from distributed import get_worker

        return f"dask worker {get_worker().address}"
    except (ImportError, ValueError):
        return "this process"


def _check_out(out: str) -> None:
    if not os.path.isdir(out):
        raise OutputError(f"{out}: the output directory is not visible on {_where()}; "
                          "`feedpipe shard --dask` needs OUT on a filesystem shared by the "
                          "client and every worker, at the same path")


def write_task(source: Source, units: list[Unit], parts: list[list[list[SampleSpec]]],
               paths: list[list[str]], names: list[str], on_error: str, out: str,
               stop: str | None = None) -> list[UnitResult]:
    """Task: write the parts of ``units`` (``parts[k]``, ``paths[k]``: unit ``k``'s) as hidden
    temp files in ``out``; commit each whole shard as soon as its parts are written. Once the
    file ``stop`` exists (the client's run is ending) no other unit is started."""
    _check_out(out)
    results = []
    for unit, specs, upaths, name in zip(units, parts, paths, names):
        if stop is not None and os.path.exists(stop):
            break
        r = UnitResult(unit, [write_part(source, s, p, on_error) for s, p in zip(specs, upaths)])
        if unit.whole:
            rec, idx, skipped = finish_shard(out, name, list(zip(upaths, r.parts)))
            r.committed = (rec, skipped, idx.fields())
        results.append(r)
    return results


def join_task(out: str, name: str, shard: int, paths: list[str], *done: list[UnitResult],
              stop: str | None = None) -> Committed | None:
    """Task: join the parts of a split shard (written by the tasks ``done``) into ``out/name``
    atomically; its record, skips and fields (``None``: the file ``stop`` exists, the run is
    ending, or a writer stopped before its parts)."""
    _check_out(out)
    got = sorted((r for d in done for r in d if r.unit.shard == shard), key=lambda r: r.unit.first)
    if (stop is not None and os.path.exists(stop)) or \
            sum(r.unit.end - r.unit.first for r in got) != len(paths):
        return None
    results = [p for r in got for p in r.parts]
    rec, idx, skipped = finish_shard(out, name, list(zip(paths, results)))
    return rec, skipped, idx.fields()


def run_on_dask(
    cluster: Any,
    source: Source,
    plan: list[list[list[SampleSpec]]],
    todo: list[int],
    names: list[str],
    part_paths: dict[tuple[int, int], str],
    out: str,
    on_error: str,
    bar: Any,
    record: Callable[[int, ShardRecord, list[tuple[str, str]], set[str]], None],
    *,
    retries: int = 2,
) -> int:
    """Write shards ``todo`` of ``plan`` on the cluster at ``cluster`` (an address or a
    ``distributed.Client``); call ``record`` for each committed shard; return the bytes written.

    The first task that still fails after ``retries`` retries cancels the rest and its error is
    raised here (e.g. :class:`~feedpipe.errors.InputError` naming the bad file).
    """
    distributed = check_dask()
    if retries < 0:
        raise ValueError(f"retries must be at least 0, not {retries}")
    own = not isinstance(cluster, distributed.Client)
    try:
        client = distributed.Client(cluster, timeout=CONNECT_TIMEOUT) if own else cluster
    except OSError as e:
        raise OutputError(f"{cluster}: cannot connect to the dask scheduler ({e})") from e
    run = uuid.uuid4().hex[:8]
    stop = os.path.join(out, f".feedpipe-dask-stop-{run}")
    futures: list[Any] = []
    try:
        slots = max(1, sum(client.nthreads().values()))
        kind: dict[str, int | None] = {}  # a join's shard; None: a write task
        writers: dict[int, list[Any]] = {}  # split shard -> the tasks that write its parts
        for k, units in enumerate(plan_tasks(plan, todo, slots=slots)):
            fut = client.submit(
                write_task, source, units, [plan[u.shard][u.first:u.end] for u in units],
                [[part_paths[u.shard, j] for j in range(u.first, u.end)] for u in units],
                [names[u.shard] for u in units], on_error, out, stop,
                key=f"feedpipe-write-{k}-{run}", retries=retries, pure=False)
            kind[fut.key] = None
            futures.append(fut)
            for u in units:
                if not u.whole:
                    writers.setdefault(u.shard, []).append(fut)
        for i, deps in writers.items():
            paths = [part_paths[i, j] for j in range(len(plan[i]))]
            fut = client.submit(join_task, out, names[i], i, paths, *deps, stop=stop,
                                key=f"feedpipe-join-{names[i]}-{run}", retries=retries,
                                pure=False)
            kind[fut.key] = i
            futures.append(fut)
        written = 0
        for fut in distributed.as_completed(futures):
            result = fut.result()  # raises the task's own error once its retries are spent
            joined = kind[fut.key]
            if joined is not None:
                if result is not None:
                    record(joined, *result)
                continue
            for r in result:
                bar.update(r.files)
                written += r.bytes
                if r.committed is not None:
                    record(r.unit.shard, *r.committed)
        return written
    except BaseException:
        _stop_tasks(client, futures, stop, distributed)
        raise
    finally:
        if own:
            client.close()


def _stop_tasks(client: Any, futures: list[Any], stop: str, distributed: Any) -> None:
    """End the run's tasks before the run ends (a Ctrl-C, or a task's error): a task the
    cluster is running cannot be cancelled (its worker thread goes on), and would go on writing
    shards into OUT behind the back of a ``--resume``, or of a user told the run stopped. The
    file ``stop`` tells every task to start no other shard; this waits until each has ended
    (the shards under way finish, as in a local pool), then cancels what is left. A second
    Ctrl-C stops the wait."""
    try:
        try:
            with open(stop, "x"):
                pass
        except OSError as e:
            log.warning("feedpipe shard --dask: cannot tell the cluster's tasks to stop (%s): "
                        "those running go on to their end and may still commit shards into "
                        "%s", e, os.path.dirname(stop))
        else:
            distributed.wait(futures, timeout=STOP_TIMEOUT)
    except BaseException as e:  # (a second Ctrl-C, or the wait's timeout)
        log.warning("feedpipe shard --dask: stopped waiting for the cluster's tasks to end "
                    "(%s): those still running may commit shards into %s",
                    type(e).__name__, os.path.dirname(stop))
    finally:
        client.cancel(futures)
        try:
            os.unlink(stop)
        except OSError:
            pass


class DaskExecutor:
    """The conversion executor of ``--dask`` (see :mod:`feedpipe.convert._executors`)."""

    name = "dask"

    def __init__(self, cluster: Any, retries: int = 2) -> None:
        self.cluster = cluster
        self.retries = retries

    def run(self, job: Any) -> int:
        return run_on_dask(self.cluster, job.source, job.plan, job.todo, job.names,
                           job.part_paths, job.out, job.on_error, job.bar, job.record,
                           retries=self.retries)

    def describe(self) -> str:
        where = self.cluster if isinstance(self.cluster, str) else "a dask.distributed Client"
        return f"tasks on the Dask cluster at {where}"
