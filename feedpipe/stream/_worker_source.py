"""The ``workers`` executor: the batch loop run inside DataLoader worker processes.

Each worker runs :func:`~feedpipe.stream._batch_loop.batch_loop` over its share of the epoch:
batch ``t`` of a rank goes to worker ``t % num_workers``, the order in which the DataLoader hands
batches back. It yields whole batches, each with a :class:`WorkerMeta`. The DataLoader is built
with ``batch_size=None``, so it neither batches nor collates again. :class:`WorkerBatches`, in
the training process, finishes each batch as its route's sink says: references resolved into
bytes (``refs-workers``), worker buffers handed back once let go (``rows-workers``), integer
arrays made tensors (``samples-workers``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory

from .._helpers.fork_safety import default_start_method
from .._helpers.parent_watch import exit_with
from .._redact import logger
from ..errors import DecodeError, ShardFormatError, StartMethodError
from ._assembly import assemble
from ._batch_loop import EpochReader, PartTimes, Skips
from ._io import ZERO, IoTally
from ._worker_rows import ByteRing, RowRelease, WorkerRing

log = logger("feedpipe")

if TYPE_CHECKING:
    from ._epoch import EpochState
    from ._refs import Resolver
    from ._routes import Route
    from ._shard_set import ShardSet
    from ._source import Source


class WorkerMeta:
    """What travels with each batch from a worker: its process id, the samples its transform
    left out since the last batch (and the global ids of those it could name), the ticket of
    the ring buffer it was written in, the seconds its batch loop spent in fetch, compute and
    sink since the last batch, the bytes and requests its tiers counted since then
    (:data:`feedpipe.stream._io.FIELDS`), and, with its first batch of a pass, ``ready``: the
    wall-clock time (``time.time()``, one clock for every process of the machine) at which its
    batch loop began, from which the training process tells the worker's start-up."""

    __slots__ = ("pid", "skipped", "ticket", "times", "io", "ready", "skipped_ids")

    def __init__(self, pid: int, skipped: int, ticket: Any,
                 times: tuple[float, float, float] = (0.0, 0.0, 0.0),
                 io: tuple[int, ...] = ZERO, ready: float | None = None,
                 skipped_ids: tuple[int, ...] = ()) -> None:
        self.pid, self.skipped, self.ticket, self.times = pid, skipped, ticket, times
        self.io, self.ready, self.skipped_ids = io, ready, skipped_ids

    def __reduce__(self) -> Any:
        return WorkerMeta, (self.pid, self.skipped, self.ticket, self.times, self.io, self.ready,
                            self.skipped_ids)


class WorkerSource(IterableDataset):
    """The DataLoader-facing side: in each worker, the batch loop of ``route`` over the worker's
    share of the epoch its loader's state names.

    Args:
        dataset: the dataset.
        state: the loader's epoch state (epoch, resume point, batch size, read at each pass from
            shared memory, so persistent workers follow ``set_epoch``/``load_state_dict``).
        route: the route (a ``workers`` one).
        collate_fn: the sink of ``samples-workers``; the BatchCollator of ``rows-workers``.
        fields: the manifest's fields, for the default collation of raw samples.
        depth: ring buffers per worker (``rows-workers``); ``0``: a fresh buffer per batch.
    """

    def __init__(self, dataset: Source, state: EpochState, route: Route, collate_fn: Any,
                 *, fields: tuple[str, ...] = (), default: bool = True, depth: int = 0) -> None:
        super().__init__()
        self.dataset, self.state, self.route, self.collate_fn = dataset, state, route, collate_fn
        self.fields, self.default, self.depth = fields, default, depth
        self._ring: WorkerRing | ByteRing | None = None
        self._ring_pid = 0
        # the training process its workers serve: set where they are started (fork) or pickled
        # (spawn, forkserver); a worker slow to start may find its parent gone already, when
        # getppid() names init, and must still see the process it was started for go
        self._owner = os.getpid()

    def started_here(self) -> None:
        """Note that this process starts the workers (each pass of the training loop)."""
        self._owner = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ring"], state["_ring_pid"] = None, 0  # a worker makes its own
        state["_owner"] = os.getpid()  # pickled for the workers by the process they serve
        return state

    def __iter__(self) -> Iterator[tuple[Any, WorkerMeta]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ds, route, pid = self.dataset, self.route, os.getpid()
        if info is not None:  # a worker never outlives the training process
            exit_with(os.getppid(), self._owner)
        skips = Skips(ds.skip_bases)
        ring = None
        tally = IoTally(ds)  # before the reader starts prefetching
        with EpochReader(ds, self.state, worker, workers) as reader:
            buffers = self.collate_fn
            if (route.rows_ring or route.bytes_ring) and self.depth and info is not None:
                if self._ring is None or self._ring_pid != pid:
                    self._ring, self._ring_pid = (
                        WorkerRing(self.collate_fn, self.depth) if route.rows_ring
                        else ByteRing(self.depth)), pid
                ring = self._ring
                if route.rows_ring:
                    buffers = ring
                # a new epoch: the training process may have dropped the table it had (a pass
                # left early before it came); where it wrote to it, it has it
                ring.send_table = route.rows_ring or not ring.table_seen()  # type: ignore[union-attr]
            parts = assemble(route, ds, reader.plan.epoch, buffers, skips=skips, leaves=True,
                             fields=self.fields, default=self.default, reader=reader)
            if route.counts_reads:  # (a source making whole batches counts its own bytes)
                parts.fetch = tally.counted(parts.fetch)
            told = told_ids = 0
            times = PartTimes()
            ready: float | None = time.time()
            if route.source_batches:  # the source's messages (Packed: a group of batches each)
                made = parts.ship(reader, ring, times)  # type: ignore[attr-defined]
            else:
                made = parts.run(reader, times)
            for batch in made:
                meta = WorkerMeta(pid, skips.count - told, None if ring is None else ring.ticket(),
                                  times.as_tuple(), tally.take(), ready,
                                  tuple(skips.ids[told_ids:]))
                times.fetch = times.compute = times.sink = 0.0
                ready = None
                told, told_ids = skips.count, len(skips.ids)
                yield batch, meta


def check_start_method(unsafe: str | None, ctx: Any, num_workers: int) -> None:
    """Refuse to fork worker processes from a process whose threads make forking unsafe
    (``unsafe`` names them; ``ctx``: the ``multiprocessing_context=`` given, if any)."""
    if unsafe is None:
        return
    if ctx is None:
        method = default_start_method()
    else:
        method = ctx if isinstance(ctx, str) else ctx.get_start_method()
    if method != "fork":
        return
    raise StartMethodError(
        f"FeedLoader(num_workers={num_workers}) would fork its worker processes from "
        f"a process that runs {unsafe}, which can deadlock them. Pass "
        "multiprocessing_context='forkserver' (or 'spawn'): then the transform and "
        "collate_fn must be picklable (no lambdas or local functions) and the script must "
        "start under `if __name__ == \"__main__\":`; or use num_workers=0 / "
        "transform_threads=N.")


def as_is(batch: Any) -> Any:
    """The DataLoader's ``collate_fn`` with ``batch_size=None``: the worker's batch as it is
    (the default would turn tuples into lists)."""
    return batch


class WorkerBatches:
    """The training process's side: the DataLoader's ``(batch, meta)`` pairs finished as the
    route's sink says, with the workers' process ids and skipped samples counted in ``stats``."""

    def __init__(self, loader: Any, route: Route, stats: dict[str, Any], *,
                 resolver: Resolver | None = None, release: RowRelease | None = None,
                 pin: bool = False, shards: ShardSet | None = None,
                 times: PartTimes | None = None, io: list[int] | None = None,
                 began: float | None = None,
                 skipped_ids: list[int] | None = None) -> None:
        self.loader, self.route, self.stats = loader, route, stats
        self.skipped_ids = skipped_ids  # where the ids the workers' transforms left out go
        self.times = times  # the workers' part times, added up
        self.began = began  # the pass's start (time.time()), for the workers' start-up
        self.io = io  # the workers' bytes and requests (_io.FIELDS), added up
        self.resolver, self.release, self.pin = resolver, release, pin
        self.shards = shards  # to name a shard cut under a worker that died reading it

    def _next(self, it: Iterator[Any]) -> Any:
        """The workers' next message; a worker's death or decode error over a local shard cut
        since the epoch began is the :class:`ShardFormatError` naming the shard (a read past a
        cut's end is a ``SIGBUS``, or the zeros of its last page, which a decoder refuses). A
        worker that dies while this process takes a batch's shared memory from it is an
        ``EOFError`` or a ``ConnectionError`` here, not torch's ``RuntimeError``."""
        try:
            return next(it)
        except (RuntimeError, DecodeError, EOFError, ConnectionError) as e:
            why = self.shards.changed() if self.shards is not None else None
            if why is None:
                raise
            how = ("died reading it" if not isinstance(e, DecodeError)
                   else "'s decoder failed on what it read")
            raise ShardFormatError(f"{why} (a worker process {how}: {e})") from e

    def __iter__(self) -> Iterator[Any]:
        route, stats = self.route, self.stats
        pids: set[int] = stats.setdefault("worker_pids", set())
        ctx = self.loader.multiprocessing_context
        stats["start_method"] = (ctx.get_start_method() if ctx is not None
                                 else torch.multiprocessing.get_start_method())
        stats["prefetch_factor"] = self.loader.prefetch_factor
        release, resolver = self.release, self.resolver
        # packed: each worker's batches come a shipment at a time; batch t of the epoch is
        # worker t % num_workers's next one, held here until its turn
        held: list[deque[Any]] = [deque() for _ in range(max(1, self.loader.num_workers))]
        turn = 0
        stats["messages"] = 0
        it = iter(self.loader)
        try:
            while True:
                try:
                    batch, meta = self._next(it)
                except StopIteration:
                    break
                stats["messages"] += 1
                pids.add(meta.pid)
                stats["skipped"] = stats.get("skipped", 0) + meta.skipped
                if self.skipped_ids is not None and meta.skipped_ids:
                    self.skipped_ids.extend(meta.skipped_ids)
                if self.times is not None:
                    self.times.add(meta.times)
                    if meta.ready is not None and self.began is not None:
                        self.times.startup += max(0.0, meta.ready - self.began)
                if self.io is not None:
                    io = self.io
                    for k, v in enumerate(meta.io):
                        io[k] += v
                if route.resolves:
                    batch = resolver(batch)  # type: ignore[misc]
                elif route.source_batches:
                    shared = batch.buffer
                    if shared is None:  # a ring buffer kept mapped here: only its ticket came
                        shared = release.mapped(meta.ticket, batch.nbytes())  # type: ignore[union-attr]
                    group = batch.group(shared)
                    held[batch.worker].extend((group, b) for b in range(len(batch)))
                    if release is not None:  # the worker reuses it once the group has gone,
                        # with the shipment's last batch made (the batches are their own memory)
                        release.receive(shared, meta.ticket)
                    del batch, shared, group
                    while held[turn % len(held)]:
                        group, b = held[turn % len(held)].popleft()
                        made = group.make(b)  # written now, while its memory is in the cache
                        del group
                        yield pin_memory(made) if self.pin else made
                        del made
                        turn += 1
                    if release is not None:  # before the DataLoader gives the worker a task
                        release.poll()
                    continue
                elif route.writes_rows:
                    if type(batch) is list:  # pin_memory made the (images, labels) tuple a list
                        batch = tuple(batch)
                    if release is not None:
                        release.receive(batch, meta.ticket)
                else:
                    batch = _arrays_to_tensors(batch, self.pin)
                yield batch
                del batch
                if release is not None:
                    # the loop has moved on from the batch before this one: hand it back now,
                    # before the DataLoader gives its worker another task
                    release.poll()
            left = sum(len(h) for h in held)
            if left:  # a worker's batches the turns never reached: lost, not dropped silently
                raise RuntimeError(f"{left} packed batches of the workers were not delivered "
                                   f"(batch {turn} of the epoch never came): a feedpipe bug, "
                                   "please report it")
        except Exception:
            _shut_down(self.loader, it)
            raise
        finally:  # also when the loop stops early
            if release is not None:
                release.close()
            del it  # a DataLoader iterator shuts its (non-persistent) workers down when it goes


def _shut_down(loader: Any, it: Any) -> None:
    """Stop the workers of a DataLoader iterator that an error is leaving. The error's traceback
    keeps the iterator alive until the garbage collector breaks the cycle, and until then its
    workers live on and torch's SIGCHLD handler watches them: one that died (SIGBUS under a cut
    shard) would make the next child process to exit raise in whatever the program does then.
    Persistent workers are dropped too: the next epoch starts new ones instead of reusing an
    iterator in an unknown state."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is None:
        return
    try:
        shutdown()  # torch unregisters and ends the workers in its own finally block
    except RuntimeError as e:
        # another worker died meanwhile (SIGBUS under the same cut shard), and torch's SIGCHLD
        # handler says so while they are shut down: the error already leaving is the first cause
        log.warning("feedpipe: %s (while shutting the loader's workers down after an error)", e)
    if getattr(loader, "_iterator", None) is it:
        loader._iterator = None


def _arrays_to_tensors(batch: Any, pin: bool) -> Any:
    """The integer arrays the default collation makes in a worker, as tensors (zero-copy)."""
    if type(batch) is dict:
        for k, v in batch.items():
            if type(v) is np.ndarray:
                t = torch.from_numpy(v)
                batch[k] = t.pin_memory() if pin else t
            elif type(v) is dict:
                _arrays_to_tensors(v, pin)
    return batch


def ring_depth(prefetch_factor: int | None) -> int:
    """Buffers a worker keeps for ``rows-workers``: ``prefetch_factor`` batches in flight, one the
    loop holds, one not yet seen released, and one spare."""
    return (prefetch_factor or 2) + 3
