"""``FeedLoader``: a ``torch.utils.data.DataLoader`` over a :class:`FeedDataset` whose
``state_dict()`` reflects what the training loop consumed, not what workers prefetched.

The dataset deals batch ``t`` of a rank to worker ``t % num_workers``, which is the order in which
the DataLoader returns batches, so the batches the loop has received are always a prefix of the
rank's planned batches. Counting them is the whole bookkeeping: after ``c`` batches on every rank
(DDP ranks step in lockstep), the consumed samples are the global positions
``[start, start + c * batch_size * world_size)``, whatever the number of workers. One rank's state
therefore resumes every rank of a new job, of any size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from . import raw_batches, row_batches
from .dataset import FeedDataset
from .device_loader import DeviceLoader
from .errors import StateError
from .store_batches import store_batches
from .row_batches import RowBatches, RowSource
from .thread_batches import thread_batches


def collate_samples(samples: list[Any]) -> Any:
    """Default collation: tensors and numbers are stacked as by torch's ``default_collate``; raw
    bytes fields (``bytes``/``memoryview``) become lists of ``bytes``; keys stay lists of str. A
    field that only some samples have becomes a list with ``None`` where it is missing.

    In a DataLoader worker, integer fields of sample dicts (``__index__``, ``__epoch__``,
    ``__seed__``, labels) become ``int64`` numpy arrays instead: a tensor leaves a worker as a
    shared-memory file descriptor with a socket handshake each, which for a few bytes costs more
    than pickling them. :class:`FeedLoader` turns them into tensors in the training process."""
    from torch.utils.data import default_collate

    first = samples[0]
    if isinstance(first, dict):
        out: dict[str, Any] = {}
        keys = dict.fromkeys(k for s in samples for k in s)
        in_worker = get_worker_info() is not None
        for k in keys:
            col = [s.get(k) for s in samples]
            v = col[0]
            if in_worker and type(v) is int and all(type(c) is int for c in col):
                out[k] = np.array(col, dtype=np.int64)
            elif any(c is None for c in col):
                out[k] = [bytes(c) if isinstance(c, memoryview) else c for c in col]
            elif isinstance(v, (bytes, bytearray, memoryview)):
                out[k] = [bytes(c) for c in col]
            elif isinstance(v, str):
                out[k] = col
            else:
                out[k] = collate_samples(col) if isinstance(v, dict) else default_collate(col)
        return out
    if isinstance(first, (bytes, bytearray, memoryview)):
        return [bytes(c) for c in samples]
    return default_collate(samples)


class FeedLoader:
    """Batches from a :class:`FeedDataset`, with exact mid-epoch and elastic resumption.

    Args:
        dataset: the :class:`FeedDataset`.
        batch_size: samples per batch (the last batch of a rank's epoch may be smaller).
        num_workers: worker processes (0: read in this process). Once this process has
            initialised CUDA, or once a :class:`~feedpipe.dali.DaliStage` it feeds has started
            DALI's threads, workers start from a ``forkserver`` rather than by ``fork`` (unsafe
            after either) unless ``multiprocessing_context=`` says otherwise. An epoch whose
            every sample is in the dataset's complete decoded store (``decoded_cache=``) is
            read in this process instead: the same batches, without a pickle and a pipe per
            sample.
        collate_fn: default :func:`collate_samples`. With it, a local dataset read without a
            transform or shard cache gets its batches built from the shard index
            (:mod:`feedpipe.raw_batches`) and copied out of this process's maps of the shards;
            the same batches as the general path. When the shards fit in the dataset's
            ``max_open_shards``, this process opens them once and plans every batch itself (a
            few array gathers per batch), whatever ``num_workers`` is: workers would add only
            their start-up and a pipe. Otherwise workers send where each batch's members lie.
        device: deliver batches on this device through a :class:`DeviceLoader` (background
            prefetch, pinned side-stream copies on CUDA; ``"cpu"`` prefetches only). ``None``:
            batches as the DataLoader makes them.
        depth: batches the DeviceLoader prefetches ahead of the loop.
        transform_threads: run the dataset's transform on this many threads in this process
            (:mod:`feedpipe.thread_batches`) instead of in worker processes (so ``num_workers``
            must be 0). For transforms that release the GIL while they work, as
            :class:`~feedpipe.transforms.ImagePipeline`'s JPEG decoding and resizing do: the
            same batches, on one process's memory, with no pickling between processes. The
            transform is called from several threads at once, so it must keep no state that
            calls share unguarded (``ImagePipeline`` keeps none).
        reuse_buffers: with worker processes writing batches in place (an ``ImagePipeline``
            and a matching ``BatchCollator``), each worker reuses its shared-memory batch
            buffers once this process no longer holds the batch (:mod:`feedpipe.row_batches`;
            2 workers on 2 cores: 3,100 -> 4,000 images/s). This process sees its own
            references only: pass ``False`` if batches are handed on to another process (a
            multiprocessing queue) without a copy, so that every batch is a fresh buffer.
            On this path ``prefetch_factor`` defaults to 1, not the DataLoader's 2: a worker
            there makes whole batches, so one in flight per worker keeps it busy while the
            loop waits for data (the same 3,850 images/s with 2 workers on 2 cores), and a
            worker that runs ahead keeps ``prefetch_factor + 1`` buffers (2 of 38.5 MB each
            at 256 x 3x224x224, against 3). Pass ``prefetch_factor=2`` for more slack against
            uneven batch times when the training step is the slower side.
        **loader_kwargs: passed to ``torch.utils.data.DataLoader`` (``pin_memory``,
            ``persistent_workers``, ``prefetch_factor``, ``multiprocessing_context``, ...).

    Example:
        >>> ds = FeedDataset("shards/example", shuffle=True)
        >>> loader = FeedLoader(ds, batch_size=5)
        >>> loader.set_epoch(0)
        >>> first = next(iter(loader))
        >>> state = loader.state_dict()
        >>> state["position"]
        5
    """

    def __init__(
        self,
        dataset: FeedDataset,
        *,
        batch_size: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: str | torch.device | None = None,
        depth: int = 2,
        transform_threads: int = 0,
        reuse_buffers: bool = True,
        **loader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, FeedDataset):
            raise TypeError(f"FeedLoader needs a FeedDataset, not {type(dataset).__name__}")
        for bad in ("shuffle", "sampler", "batch_sampler", "drop_last"):
            if bad in loader_kwargs:
                raise TypeError(
                    f"FeedLoader does not take {bad}=: the FeedDataset's plan decides order and "
                    "padding (pass shuffle=/drop_last= to FeedDataset)"
                )
        if isinstance(transform_threads, bool) or int(transform_threads) < 0:
            raise ValueError(f"transform_threads must be 0 or more, not {transform_threads!r}")
        self.transform_threads = int(transform_threads)
        if self.transform_threads and num_workers:
            raise ValueError(
                f"transform_threads={transform_threads} runs the transform on threads in this "
                f"process; it does not combine with num_workers={num_workers} worker processes "
                "(pass one or the other)")
        if self.transform_threads and dataset.transform is None:
            raise ValueError("transform_threads= runs the dataset's transform on threads, and "
                             "this FeedDataset has none (pass transform=, or drop "
                             "transform_threads=)")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        dataset.set_batch_size(self.batch_size)
        self.num_workers = num_workers
        # Raw samples with the default collation: batches are built from the shard index by
        # reference (raw_batches), workers plan and send where the bytes are, not the bytes.
        self._by_reference = (collate_fn in (None, collate_samples)
                              and raw_batches.eligible(dataset))
        self._pin = bool(loader_kwargs.get("pin_memory", False))
        self._collate = collate_fn or collate_samples
        self._rows: RowBatches | None = None  # the in-place worker path's batches (row_batches)
        if self._by_reference:
            self._loader = DataLoader(raw_batches.RefSource(dataset), batch_size=None,
                                      num_workers=num_workers, **loader_kwargs)
        elif num_workers > 0 and row_batches.in_place(dataset, collate_fn):
            # the workers write each image into its batch row, in shared memory, reusing a
            # buffer once this process lets go of its batch (row_batches)
            # (one whole batch in flight per worker by default: see reuse_buffers)
            loader_kwargs = {"prefetch_factor": 1, **loader_kwargs}
            in_flight = loader_kwargs["prefetch_factor"] or 2
            self._loader = DataLoader(RowSource(dataset, self.batch_size, collate_fn,
                                                depth=in_flight + 3, reuse=reuse_buffers),
                                      batch_size=None, num_workers=num_workers,
                                      collate_fn=row_batches.as_is, **loader_kwargs)
            self._rows = RowBatches(self._loader)
        else:
            self._loader = DataLoader(
                dataset,
                batch_size=self.batch_size,
                num_workers=num_workers,
                collate_fn=collate_fn or collate_samples,
                **loader_kwargs,
            )
        self._device_loader = None if device is None else DeviceLoader(self._loader, device, depth)
        self._context_given = "multiprocessing_context" in loader_kwargs
        # Set by a consumer (the DALI stage) whose threads make fork unsafe in this process.
        self._fork_unsafe = False
        self._split = dataset.split()
        self._batches = 0
        self._finished = False

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s order. Keeps a resume point loaded for this same epoch."""
        if epoch != self.dataset.epoch or self._finished:
            self.dataset.set_epoch(epoch)
        self._split = self.dataset.split()
        self._batches = 0
        self._finished = False

    def __len__(self) -> int:
        """Batches this rank yields in the current (possibly resumed) epoch."""
        return self.dataset.split().batches(self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self._finished:  # a new pass over the same epoch without set_epoch: start it over
            self.dataset.set_epoch(self.dataset.epoch)
        self._split = self.dataset.split()
        self._batches = 0
        self._finished = False
        source: Any = self._loader
        if self._by_reference:
            self._guard_fork()
            source = raw_batches.RefBatches(
                self.dataset, self._loader if self.num_workers > 0 else None, pin_memory=self._pin)
        elif self.transform_threads or self._store_is_complete() or self._writes_rows():
            # Transform threads run in this process (thread_batches). And when every sample's
            # output is in the decoded store, reading it here costs one record copy per sample;
            # a worker would add a pickle, a pipe and an unpickle of it. With a BatchCollator
            # and image records, whole batches are gathered (store_batches). And with no
            # workers, a transform that writes into a BatchCollator's rows does so here.
            source = _InProcessBatches(self.dataset, self.batch_size, self._collate,
                                       pin=self._pin, threads=self.transform_threads)
        else:
            self._guard_fork()
            if self._rows is not None:
                source = self._rows
            elif self.num_workers > 0 and self._collate is collate_samples:
                source = _WorkerBatches(self._loader)
        if self._device_loader is not None:
            self._device_loader.iterable = source
            source = self._device_loader
        # Counted as the loop receives a batch: with a DeviceLoader, after it hands the batch
        # over, never for the batches its thread prefetched.
        for batch in source:
            self._batches += 1
            yield batch
        self._finished = True

    def _writes_rows(self) -> bool:
        # num_workers=0, no store: the transform writes each image into its batch row
        # (ImagePipeline.into), no per-sample tensor and no collation copy
        return self.num_workers == 0 and row_batches.in_place(self.dataset, self._collate)

    def _store_is_complete(self) -> bool:
        store = self.dataset.decoded
        return store is not None and store.complete()

    def _guard_fork(self) -> None:
        # Forking workers from a process that holds a CUDA context, or whose other threads (a
        # DALI pipeline's) may hold locks, is unsafe: a child inherits objects whose destructors
        # call CUDA or DALI (a pipeline, the caching allocator's state) and aborts or deadlocks.
        # Workers need neither, so start them from a clean forkserver instead, unless the
        # caller chose a context.
        loader = self._loader
        if (self.num_workers > 0 and not self._context_given
                and loader.multiprocessing_context is None
                and (self._fork_unsafe or torch.cuda.is_initialized())
                and torch.multiprocessing.get_start_method(allow_none=True) in (None, "fork")):
            loader.multiprocessing_context = "forkserver"

    def stats(self) -> dict[str, Any] | None:
        """The DeviceLoader's figures for this pass (wait, starvation; see
        :meth:`DeviceLoader.stats`), or None without ``device=``."""
        return None if self._device_loader is None else self._device_loader.stats()

    @property
    def position(self) -> int:
        """The global position the training loop has reached in this epoch."""
        if self._finished:
            return self._split.num_samples
        return self._split.consumed(self._batches, self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """What the loop consumed: ``{"epoch", "position", ...}`` (standard signature)."""
        return self.dataset.state_dict(consumed=self.position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue exactly after what the saved loop consumed, with any number of ranks or
        workers. Call ``set_epoch(state_dict["epoch"])`` (or nothing) before iterating."""
        if not isinstance(state_dict, dict) or "position" not in state_dict:
            raise StateError("not a FeedLoader state (no 'position')")
        self.dataset.load_state_dict(state_dict)
        self._split = self.dataset.split()
        self._batches = 0
        self._finished = False


class _InProcessBatches:
    """A FeedDataset's stream for this rank, iterated in this process and collated into batches
    of ``batch_size``: the same batches, in the same order, as the DataLoader's workers make."""

    def __init__(self, dataset: FeedDataset, batch_size: int,
                 collate_fn: Callable[[list[Any]], Any], *, pin: bool = False,
                 threads: int = 0) -> None:
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.pin = pin  # pin_memory=True: pinned as the DataLoader would pin them
        self.threads = threads  # transform threads (thread_batches); 0: this thread

    def __iter__(self) -> Iterator[Any]:
        batches = self._batches()
        if not (self.pin and torch.cuda.is_available()):
            yield from batches
            return
        from torch.utils.data._utils.pin_memory import pin_memory

        for batch in batches:
            yield pin_memory(batch)

    def _batches(self) -> Iterator[Any]:
        gathered = store_batches(self.dataset, self.batch_size, self.collate_fn)
        if gathered is not None:  # whole batches of image records: see feedpipe.store_batches
            yield from gathered
            return
        if self.threads:
            yield from thread_batches(self.dataset, self.batch_size, self.collate_fn,
                                      self.threads)
            return
        if row_batches.in_place(self.dataset, self.collate_fn):
            yield from row_batches.dataset_batches(self.dataset, self.batch_size,
                                                   self.collate_fn)  # type: ignore[arg-type]
            return
        it = iter(self.dataset)
        while True:
            chunk = list(itertools.islice(it, self.batch_size))
            if not chunk:
                return
            batch = self.collate_fn(chunk)
            # let the samples go before the next batch is read: the decoded store recycles a
            # record buffer once nothing holds it, so the next batch reuses these
            del chunk
            yield batch


class _WorkerBatches:
    """The DataLoader's batches with the integer arrays :func:`collate_samples` made in the
    workers turned into tensors (zero-copy), as ``num_workers=0`` gives them."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield _arrays_to_tensors(batch)


def _arrays_to_tensors(batch: Any) -> Any:
    if type(batch) is dict:
        for k, v in batch.items():
            if type(v) is np.ndarray:
                batch[k] = torch.from_numpy(v)
            elif type(v) is dict:
                _arrays_to_tensors(v)
    return batch
