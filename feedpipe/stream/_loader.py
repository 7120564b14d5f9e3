"""``FeedLoader``: batches from a :class:`FeedDataset` through one batch loop and a named route,
with a ``state_dict()`` that reflects what the training loop consumed, not what was prefetched.

The dataset deals batch ``t`` of a rank to worker ``t % num_workers``, which is the order in which
the DataLoader returns batches, so the batches the loop has received are always a prefix of the
rank's planned batches. Counting them is the whole bookkeeping: after ``c`` batches on every rank
(DDP ranks step in lockstep), the consumed samples are the global positions
``[start, start + c * batch_size * world_size)``, whatever the number of workers. One rank's state
therefore resumes every rank of a new job, of any size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory

from .._helpers.exit_close import closed_at_exit
from .._helpers.fork_safety import process_fork_unsafe
from .._redact import logger
from ..device._loader import DeviceLoader
from ..errors import StateError
from ._assembly import assemble
from ._batch_loop import EpochReader, PartTimes, Skips, time_figures
from ._collate import LeftOut, collate_samples, empty_epoch_error, left_out_error
from ._collator import BatchCollator
from ._epoch import EpochState
from ._io import ZERO, IoTally, add, io_figures
from ._ledger import Ledger
from ._loader_args import check_arguments
from ._refs import Columns, Resolver
from ._routes import Config, Route, choose
from ._source import Source
from ._worker_rows import RowRelease, sees_holders
from ._worker_source import (
    WorkerBatches,
    WorkerSource,
    as_is,
    check_start_method,
    ring_depth,
)

log = logger("feedpipe")

class FeedLoader:
    """Batches from a :class:`FeedDataset`, with exact mid-epoch and elastic resumption.

    Each loader owns its epoch state (epoch, position reached, batch size, whole batches) and
    hands it to its workers: any number of loaders (training and evaluation, two batch sizes)
    may share one dataset without changing each other's batches, length, position or epoch.

    Used as a ``DataLoader`` is: ``for batch in loader`` each epoch; ``len(loader)`` is the
    number of batches of a whole epoch (also after :meth:`load_state_dict`, after which the
    iteration yields only the rest); iterating again after a complete epoch starts the next
    one (``set_epoch(e)`` chooses one explicitly); ``state_dict()`` / ``load_state_dict()``
    have the standard signatures, so Lightning, accelerate and torch checkpoints save and
    restore it as they do a ``StatefulDataLoader``.

    How batches are made is a *route* (:class:`~feedpipe.Route`): the combination of fetch,
    compute, executor and sink that fits the configuration, chosen by one function from the
    configuration, forced with ``route=``, reported by :attr:`route` and
    :meth:`stats`. Every route gives the same batches.

    Args:
        dataset: the :class:`~feedpipe.Source` read: a :class:`FeedDataset`, a
            :class:`~feedpipe.Mixture` of them, a :class:`~feedpipe.Packed`, or a source of
            your own.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes (0: read in this process). They start by the
            process's start method, as the DataLoader's do (``multiprocessing_context=`` chooses
            another); they never touch CUDA. In a process that runs DALI's threads (a
            :class:`~feedpipe.DaliStage` fed by this loader has started), forking is unsafe: it
            is refused with a :class:`~feedpipe.StartMethodError` naming the fix.
        collate_fn: default: raw samples collated field by field (every field of the
            manifest in every batch, ``None`` where a sample lacks it). A
            :class:`~feedpipe.BatchCollator` collates into reused preallocated buffers.
        device: deliver batches on this device through a :class:`DeviceLoader` (background
            prefetch, pinned side-stream copies on CUDA; ``"cpu"`` prefetches only).
        depth: batches the DeviceLoader prefetches ahead of the loop.
        transform_threads: run the dataset's transform on this many threads in this process
            instead of in worker processes (``num_workers`` must be 0): for transforms that
            release the GIL while they work, as :class:`~feedpipe.ImagePipeline` does. The
            transform is called from several threads at once.
        drop_last: leave out each rank's short last batch, as the DataLoader does (every rank
            still gets the same number of batches).
        route: ``"auto"`` or a route's name (:attr:`Route.name`, e.g. ``"rows-workers"``); a
            route that cannot serve the configuration is refused with a sentence saying why.
        reuse_buffers: with ``rows-workers``, each worker reuses its shared-memory batch
            buffers once this process no longer holds the batch. This process sees its own
            references only: pass ``False`` if batches are handed on to another process
            without a copy. On that route ``prefetch_factor`` defaults to 1: a worker makes
            whole batches, one in flight keeps it busy, and one buffer fewer is held per worker.
        ledger: a directory where this loader records, per epoch and rank, which sample ids the
            training loop received, so that ``feedpipe ledger DIR``
            (:func:`~feedpipe.check_ledger`) can prove a whole run, with its stops, resumes and
            changes of world size, exactly-once. Every run of one job passes the same
            directory. Its ``state_dict()`` then carries a ``ledger`` mark. Over a
            :class:`Mixture`, an epoch must deliver each (source, id) as many times as the
            mixture's plan draws it; over a :class:`Packed`, each row of the epoch once (every
            token of its documents once), a loss or repeat named by its pieces of documents.
        **loader_kwargs: passed to ``torch.utils.data.DataLoader`` (``pin_memory``,
            ``persistent_workers``, ``prefetch_factor``, ``multiprocessing_context``, ...).

    Example:
        >>> from feedpipe import FeedDataset
        >>> ds = FeedDataset("shards/example", shuffle=True, decode={"cls": int})
        >>> loader = FeedLoader(ds, batch_size=5)
        >>> len(loader), loader.route.name
        (5, 'refs')
        >>> first = next(iter(loader))
        >>> first["cls"].dtype, loader.state_dict()["position"]
        (torch.int64, 5)
    """

    def __init__(
        self,
        dataset: Source,
        *,
        batch_size: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: str | torch.device | None = None,
        depth: int = 2,
        transform_threads: int = 0,
        drop_last: bool = False,
        route: str = "auto",
        reuse_buffers: bool = True,
        ledger: str | os.PathLike[str] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, Source):
            raise TypeError(f"FeedLoader needs a feedpipe.Source (a FeedDataset, a Mixture, a "
                            f"Packed, or a source of your own), not {type(dataset).__name__}")
        # what the ledger records of the source, asked first: a source that cannot say it is
        # refused before anything is made
        ledger_info = None if ledger is None else dataset.ledger_info()
        check_arguments(batch_size, num_workers, transform_threads, collate_fn, route,
                        loader_kwargs)
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        # this loader's own: shared with its worker processes, never with another loader
        self._state = EpochState(self.batch_size, self.drop_last)
        self._dataset_epoch = dataset.epoch  # the direct reader's, to say when it moves
        self.num_workers = int(num_workers)
        self.transform_threads = int(transform_threads)
        self.collate_fn = collate_fn if collate_fn is not None else collate_samples
        self.depth = depth
        self.reuse_buffers = reuse_buffers
        self._route_arg = route
        self._kwargs = loader_kwargs
        self._pin = bool(loader_kwargs.get("pin_memory", False)) and torch.cuda.is_available()
        self._device = device
        self._device_loader: DeviceLoader | None = None
        self._loaders: dict[str, DataLoader] = {}  # per workers route, kept across epochs
        self._releases: dict[str, RowRelease] = {}  # rows-workers: their buffer hand-back
        self._columns: Any = None  # refs: the index as columns, built once
        self._fork_unsafe: str | None = None
        self._noted: set[str] = set()
        self._last_left_out = ""  # the last left-out batch's reason, for an empty epoch
        self._last: Route | None = None
        self._stats: dict[str, Any] = {}
        self._split = self._state.split(dataset)
        self._batches = 0
        self._finished = False
        self._epoch_chosen = False
        self._ledger = (None if ledger is None or ledger_info is None
                        else Ledger(ledger, ledger_info))
        self._resumed_from: dict[str, Any] | None = None
        self._skipped_ids: list[int] = []  # this pass's, as the batch loop names them
        self._times = PartTimes()
        self._clock = [0.0, 0.0]  # this pass: seconds waited for batches, its wall time
        self._began = (0.0, 0.0)  # this pass's start: perf_counter(), time.time() (workers')
        # this pass's bytes and requests (_io.FIELDS): this process's tally while it runs, its
        # figures once it ended, and the sums the workers sent
        self._io: IoTally | None = None
        self._io_here: tuple[int, ...] = ZERO
        self._io_workers = list(ZERO)
        choose(self._config(), route)  # a forced route that cannot serve is refused here
        dataset.check_loader(dataset.transform is None and collate_fn is None)

    # -- the route -------------------------------------------------------------------------
    def _config(self) -> Config:
        collate = self.collate_fn
        return Config.of(self.dataset.capabilities(collate), num_workers=self.num_workers,
                         threads=self.transform_threads,
                         collator=isinstance(collate, BatchCollator),
                         default_collate=collate is collate_samples)

    @property
    def route(self) -> Route:
        """The route the next pass takes (the last pass's while one runs)."""
        if self._last is not None and not self._finished and self._batches:
            return self._last
        return choose(self._config(), self._route_arg)[0]

    def mark_fork_unsafe(self, reason: str) -> None:
        """Say that this loader will feed threads that make forking unsafe (``reason`` names
        them): its worker processes started by ``fork`` are refused with a sentence naming the
        fix. :class:`~feedpipe.DaliStage` calls this on the loader it is given; while its
        pipeline is alive, every loader of the process is refused the same way."""
        self._fork_unsafe = reason

    # -- epochs ----------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of this loader's current (or next) pass."""
        return self._state.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s order for the next pass. Keeps a resume point loaded for this
        same epoch."""
        if epoch != self._state.epoch or self._finished:
            self._state.set_epoch(epoch)
        if self._ledger is not None:
            self._ledger.leave()
        self._split = self._state.split(self.dataset)
        self._batches = 0
        self._finished = False
        self._epoch_chosen = True

    def __len__(self) -> int:
        """Batches of this rank in a whole epoch, the epoch the next pass reads (a resumed
        epoch yields only the rest)."""
        self.dataset.attach()
        epoch = self._state.epoch + int(self._done() and not self._epoch_chosen)
        return self.dataset.split_at(0, self.drop_last, epoch=epoch).batches(self.batch_size)

    def _done(self) -> bool:
        return self._finished or self._batches >= self._split.batches(self.batch_size) > 0

    def __iter__(self) -> Iterator[Any]:
        return closed_at_exit(self._pass())

    def _pass(self) -> Generator[Any, None, None]:
        clock = time.perf_counter
        t_start = clock()
        self._began = (t_start, time.time())
        self._times = PartTimes()
        timing = self._clock = [0.0, 0.0]  # waited, wall
        ds, state = self.dataset, self._state
        ds.attach()
        state.own()
        if ds.epoch != self._dataset_epoch:
            self._dataset_epoch = ds.epoch
            log.warning("feedpipe: the FeedDataset's epoch was set to %d (set_epoch or "
                        "load_state_dict on the dataset): that is the epoch of the dataset read "
                        "directly; this FeedLoader keeps its own (epoch %d next): call "
                        "loader.set_epoch(e) / loader.load_state_dict(state) instead",
                        ds.epoch, state.epoch + 1 if self._done() and not self._epoch_chosen
                        else state.epoch)
        io = self._io = IoTally(ds)
        self._io_here, self._io_workers = ZERO, list(ZERO)
        if self._done() and not self._epoch_chosen:  # a new pass after a complete epoch
            state.set_epoch(state.epoch + 1)
        self._epoch_chosen = False
        self._split = state.split(ds)
        self._batches = 0
        self._finished = False
        route, note = choose(self._config(), self._route_arg)
        if note is not None and note not in self._noted:
            self._noted.add(note)
            log.warning("feedpipe: %s", note)
        self._last = route
        self._stats = {"route": route.name, "batches": 0, "skipped": 0}
        source: Any = self._source(route)
        if self._device is not None:
            if self._device_loader is None:
                self._device_loader = DeviceLoader(source, self._device, self.depth)
            self._device_loader.iterable = source
            source = self._device_loader
        ledger = self._ledger
        skipped = self._skipped_ids = []
        if ledger is not None:
            ledger.begin(state.plan(ds), self._split, self.batch_size, self._resumed_from)
            self._resumed_from = None
        # counted as the loop receives a batch: with a DeviceLoader, after it hands the batch
        # over, never for the batches its thread prefetched
        it = iter(source)
        waited = clock() - t_start  # the route's setup is part of the wait for the first batch
        try:
            while True:
                t0 = clock()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                finally:
                    t1 = clock()
                    waited += t1 - t0
                    timing[0], timing[1] = waited, t1 - t_start
                self._batches += 1
                if ledger is not None:
                    if skipped:  # named as the batch loop met them (prefetched ones included)
                        ledger.skipped(skipped)
                        del skipped[:]
                    ledger.batch(self._batches - 1)
                if type(batch) is LeftOut:
                    self._left_out(batch)
                    continue
                self._stats["batches"] += 1
                yield batch
            self._finished = True
            if ledger is not None:
                ledger.finish()
            if not self._stats["batches"] and self._stats.get("left_out"):
                raise empty_epoch_error(self._stats, self._last_left_out)
        finally:
            if ledger is not None:
                ledger.end()
            if self._io is io:
                self._io_here, self._io = add(self._io_here, io.take()), None

    def _left_out(self, batch: LeftOut) -> None:
        """A batch of the plan whose every sample the transform left out: nothing to yield. With
        several ranks that is refused: this rank would yield fewer batches than the others and
        their collectives (DDP's gradient all-reduce) would wait forever."""
        self._stats["left_out"] = self._stats.get("left_out", 0) + 1
        self._last_left_out = batch.why
        world = self.dataset.world
        if world.world_size > 1:
            raise left_out_error(batch, world.rank, world.world_size, "through FeedLoader")
        if "left_out" not in self._noted:  # each sample has had its own warning
            self._noted.add("left_out")
            log.warning("feedpipe: a batch of %d samples was left out whole (the transform "
                        "skipped each of them); the loop goes on with the next batch, and "
                        "stats()['left_out'] counts such batches", batch.samples)

    def _source(self, route: Route) -> Iterator[Any]:
        if route.in_workers:
            return self._worker_batches(route)
        return self._local_batches(route)

    def _local_batches(self, route: Route) -> Iterator[Any]:
        """The inline and threads executors: the batch loop in this process."""
        ds, stats = self.dataset, self._stats
        skips = Skips(ds.skip_bases)
        skips.ids = self._skipped_ids
        with EpochReader(ds, self._state) as reader:
            if route.by_reference:
                if self._columns is None and ds.shards.open_all():
                    self._columns = Columns(ds.shards.open_readers())  # type: ignore[arg-type]
                stats["refs_plan"] = "columns" if self._columns is not None else "per-sample"
            parts = assemble(route, ds, reader.plan.epoch, self.collate_fn, skips=skips,
                             threads=self.transform_threads, fields=tuple(ds.manifest.fields),
                             default=self.collate_fn is collate_samples, columns=self._columns,
                             pin=self._pin, reader=reader)
            if self._io is not None and route.counts_reads:
                parts.fetch = self._io.counted(parts.fetch)
            # the start-up: everything before the loop's first fetch (the shards opened, the
            # prefetch started, the pool made)
            self._times.startup = time.perf_counter() - self._began[0]
            try:
                for batch in parts.run(reader, self._times):
                    stats["skipped"] = skips.count
                    if self._pin and not route.resolves:
                        batch = pin_memory(batch)
                    yield batch
            finally:
                stats["skipped"] = skips.count
                parts.close()

    def _worker_batches(self, route: Route) -> Iterator[Any]:
        """The workers executor: the batch loop in DataLoader worker processes."""
        check_start_method(self._fork_unsafe or process_fork_unsafe(),
                           self._kwargs.get("multiprocessing_context"), self.num_workers)
        loader = self._loaders.get(route.name)
        kwargs = dict(self._kwargs)
        if loader is None:
            depth = 0
            if route.rows_ring:
                kwargs = {"prefetch_factor": 1, **kwargs}  # see reuse_buffers
                depth = ring_depth(kwargs["prefetch_factor"]) if self.reuse_buffers else 0
            elif route.bytes_ring and self.reuse_buffers and sees_holders():
                depth = ring_depth(kwargs.get("prefetch_factor"))
            source = WorkerSource(self.dataset, self._state, route, self.collate_fn,
                                  fields=tuple(self.dataset.manifest.fields),
                                  default=self.collate_fn is collate_samples, depth=depth)
            loader = DataLoader(source, batch_size=None, num_workers=self.num_workers,
                                collate_fn=as_is, **kwargs)
            self._loaders[route.name] = loader
        loader.dataset.started_here()  # type: ignore[attr-defined]
        resolver = None
        if route.resolves:
            resolver = Resolver(self.dataset, pin_memory=self._pin)
        release = self._releases.get(route.name)
        if release is None and self.reuse_buffers and (
                route.rows_ring or loader.dataset.depth):  # type: ignore[attr-defined]
            release = self._releases[route.name] = RowRelease(
                bool(kwargs.get("persistent_workers", False)), keep_mapped=route.bytes_ring)
        yield from WorkerBatches(loader, route, self._stats, resolver=resolver,
                                 release=release, pin=self._pin, shards=self.dataset.shards,
                                 times=self._times, io=self._io_workers,
                                 began=self._began[1], skipped_ids=self._skipped_ids)

    # -- figures ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """This pass's figures: ``route`` (its name) and ``parts`` (fetch, compute, executor,
        sink), ``batches`` received, ``skipped`` samples (:class:`~feedpipe.errors.SampleSkipped`),
        ``left_out`` (when any: batches of the plan the transform left wholly out, yielded as
        nothing), ``worker_pids`` (the worker processes that made batches), ``start_method`` (how
        they were started), ``prefetch_factor`` (batches in flight per worker) and ``messages``
        (what the workers sent: a batch each, or on ``packed-workers`` a group of batches
        each) on a ``workers`` route, ``refs_plan`` on ``refs`` (``columns``: every shard fits
        in ``max_open_shards``, so batches are planned from the index columns; else
        ``per-sample``), ``buffers`` (worker batch buffers received, ``reused``, ``released``)
        on ``rows-workers`` and ``packed-workers``, and with ``device=`` the
        :class:`DeviceLoader`'s figures under ``device``.

        ``time``: seconds of the pass per part (``fetch``, ``compute``, ``sink``; in worker
        processes added up over them), ``startup`` (from the start of the pass until the batch
        loop began: in this process, opening the shards and making the route's parts; on a
        ``workers`` route, each worker process's start until its loop began, added up over
        them), the loop's ``wait`` for batches, its ``step`` between them and the ``wall``
        time, with ``parts_in`` saying where the parts ran; ``bound``: the part that bounds the
        pass (``startup``, ``fetch``, ``compute`` or ``sink``; ``step`` when the loop waited
        less than it worked).

        ``io``: the pass's bytes and requests per tier, summed over this process and its worker
        processes: ``local_bytes`` (read from local shards: the
        dataset's files or the L1 cache's copies), ``remote`` ``requests`` and ``bytes``,
        ``l1`` ``hits``, ``misses`` and ``fills`` (a shard this pass's prefetch fetched is a
        miss), and ``decoded`` and ``l2`` ``hits`` and ``misses`` (zeros where the tier is not
        used).

        ``sources`` (a :class:`~feedpipe.Mixture`): the samples of each source in the batches
        this pass received on this rank, by name (counted from the mixture's plan; samples a
        transform left out are in ``skipped``)."""
        # the pass that ran (the store it filled may send the next pass another way)
        route = self._last if self._stats and self._last is not None else self.route
        out: dict[str, Any] = dict(self._stats) if self._stats else {
            "route": route.name, "batches": 0, "skipped": 0}
        out["parts"] = {"fetch": route.fetch, "compute": route.compute,
                        "executor": route.executor, "sink": route.sink}
        if "worker_pids" in out:
            out["worker_pids"] = sorted(out["worker_pids"])
        release = self._releases.get(route.name)
        if release is not None:
            out["buffers"] = release.stats()
        if self._device_loader is not None:
            out["device"] = self._device_loader.stats()
        sources = self.dataset.delivered(self._state.epoch, self._split, self._batches,
                                         self.batch_size)
        if sources is not None:  # a Mixture: the samples of each source received
            out["sources"] = sources
        waited, wall = self._clock
        out["time"], out["bound"] = time_figures(self._times, waited, wall, route,
                                                 self.num_workers, self.transform_threads)
        here = self._io.take() if self._io is not None else ZERO
        self._io_here = add(self._io_here, here)
        out["io"] = io_figures(add(self._io_here, self._io_workers))
        return out

    # -- resumption ------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The global position the training loop has reached in this epoch."""
        if self._done():
            return self._split.num_samples
        return self._split.consumed(self._batches, self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """What the loop consumed: ``{"epoch", "position", "dataset", ...}`` (standard
        signature). After a complete epoch it is the start of the next one."""
        if self._done():
            state = self.dataset.state_at(self._state.epoch + 1, 0)
        else:
            state = self._state.stamp(self.dataset.state_at(self._state.epoch, self.position))
        ledger = self._ledger
        if ledger is not None:
            if not ledger.in_part:  # a state taken before a pass: it goes on record
                ledger.begin(self._state.plan(self.dataset), self._split,
                             self.batch_size, None, record=True)
            state["ledger"] = ledger.mark(state["epoch"], state["position"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> None:
        """Continue exactly after what the saved loop consumed, with any number of ranks or
        workers. A state of another dataset or shard layout is refused (:class:`StateError`)
        unless ``strict=False``, which starts the saved epoch afresh."""
        if not isinstance(state_dict, dict) or "position" not in state_dict:
            raise StateError("not a FeedLoader state (no 'position')")
        self._state.resume(*self.dataset.resume_point(state_dict, strict=strict))
        self._state.keep_layout(self.dataset, state_dict)  # the rest of its epoch: its layout
        mark = state_dict.get("ledger")
        self._resumed_from = dict(mark) if isinstance(mark, dict) else {
            "lineage": None, "epoch": self._state.epoch, "position": int(state_dict["position"])}
        self._split = self._state.split(self.dataset)
        self._batches = 0
        self._finished = False
        self._epoch_chosen = True
        if self._ledger is not None:  # the resume is on record before any pass begins
            self._ledger.begin(self._state.plan(self.dataset), self._split,
                               self.batch_size, self._resumed_from, record=True)
            self._resumed_from = None
