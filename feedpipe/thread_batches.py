"""Batches whose transform runs on a pool of threads in the training process
(``FeedLoader(transform_threads=N)``), instead of in DataLoader worker processes.

Why threads can do a process's job here: the transforms that cost anything (JPEG decoding in
simplejpeg, OpenCV's resize and split, torch's interpolation and copies) release the GIL while
they work, so N threads keep N cores busy on them; what holds the GIL per sample (drawing the
crop, a few calls) is a small share. What threads save is what a worker process costs: its own
copy of the interpreter, torch and the transform's libraries in memory (each DataLoader worker
counts them again in its RSS), its start-up, and a pickle, a pipe and an unpickle of every batch.

How a batch is made, in order:

1. this process reads the batch's samples (:meth:`FeedDataset._read`, the same ids in the same
   order as the per-sample path: shard maps, prefetching into the shard cache, hits in the decoded
   store);
2. the pool runs the dataset's transform on each sample that the store did not hold (several
   batches ahead of the one the loop is given, so the pool works while the training step runs);
3. with a :class:`~feedpipe.collator.BatchCollator` and no decoded store, the thread that made
   an output copies it into its row of the batch buffer and drops it; otherwise outputs come
   back in delivery order, are stored in the decoded store (from this thread only) and collated
   by the loader's ``collate_fn``.

Up to ``ahead`` (2) batches beyond the one delivered are in flight: with a ``BatchCollator``,
that is up to 4 batch buffers at once (the collator's default ring), as 2 DataLoader workers
with their default ``prefetch_factor=2`` keep 4 batches.

The batches equal those of ``num_workers=0`` (``tests/test_thread_batches.py``): each sample's
augmentation is seeded by its id (:func:`feedpipe.transforms.sample_rng`), not by which thread ran
it. A transform that raises stops the epoch with its exception, as in the per-sample path.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .collator import BatchCollator
from .image_ops import one_thread
from .row_batches import writes_into

if TYPE_CHECKING:
    from .dataset import FeedDataset


def thread_batches(dataset: FeedDataset, batch_size: int, collate_fn: Callable[[list[Any]], Any],
                   threads: int, *, ahead: int = 2) -> Iterator[Any]:
    """This rank's batches for the epoch, the transform run on ``threads`` threads, up to
    ``ahead`` batches beyond the one being delivered in flight."""
    transform = dataset.transform
    if transform is None:  # FeedLoader says so when it is given transform_threads=
        raise ValueError("no transform to run on threads")
    store = dataset.decoded
    stream = dataset._read(0, 1, stored=store is not None)
    pool = ThreadPoolExecutor(max(1, int(threads)), thread_name_prefix="feedpipe-transform")
    try:
        if store is None and isinstance(collate_fn, BatchCollator):
            yield from _in_place(stream, pool, transform, batch_size, collate_fn, ahead)
        else:
            yield from _collated(stream, pool, transform, batch_size, collate_fn, ahead,
                                 dataset)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        stream.close()


def _collated(stream: Iterator[tuple[int, int, Any]], pool: ThreadPoolExecutor,
              transform: Callable[[Any], Any], batch_size: int,
              collate_fn: Callable[[list[Any]], Any], ahead: int,
              dataset: FeedDataset) -> Iterator[Any]:
    """Any collation, and the decoded store: outputs come back to this thread, which stores
    them (the store is written from one thread) and collates the batch."""
    # each entry: (global id, shard, sample or stored output, future of the output or None)
    pending: deque[list[tuple[int, int, Any, Future[Any] | None]]] = deque()
    while True:
        while len(pending) <= ahead:
            chunk = list(itertools.islice(stream, batch_size))
            if not chunk:
                break
            pending.append([(g, s, x, None if s < 0 else pool.submit(transform, x))
                            for g, s, x in chunk])
        if not pending:
            return
        outs = []
        for g, s, x, future in pending.popleft():
            if future is None:
                outs.append(x)
                continue
            outs.append(dataset._stored(future.result(), g, s, x["__key__"]))
        batch = collate_fn(outs)
        del outs  # the store's record buffers recycle once nothing holds them
        yield batch


def _in_place(stream: Iterator[tuple[int, int, Any]], pool: ThreadPoolExecutor,
              transform: Callable[[Any], Any], batch_size: int, collator: BatchCollator,
              ahead: int) -> Iterator[Any]:
    """A BatchCollator and no store: each thread copies its output into its row of the batch
    buffer (:meth:`BatchCollator.buffer`) and drops it, so the copies run in parallel and no
    batch of per-sample tensors waits in memory."""
    pending: deque[tuple[torch.Tensor, torch.Tensor, list[Future[bool]]]] = deque()
    into = writes_into(transform, collator)  # decided once, not per sample
    while True:
        while len(pending) <= ahead:
            chunk = list(itertools.islice(stream, batch_size))
            if not chunk:
                break
            images, labels = collator.buffer(len(chunk))
            rows = images.unbind(0) if into else None
            pending.append((images, labels, [
                pool.submit(_into_row, transform, x, collator, images, labels, j, rows)
                for j, (_, _, x) in enumerate(chunk)]))
        if not pending:
            return
        images, labels, futures = pending.popleft()
        paired = {f.result() for f in futures}
        if len(paired) != 1:
            raise ValueError("the transform returned (image, label) pairs for some samples of a "
                             "batch and bare images for others")
        yield (images, labels) if paired.pop() else images


def _into_row(transform: Callable[[Any], Any], sample: Any, collator: BatchCollator,
              images: torch.Tensor, labels: torch.Tensor, j: int, rows: Any) -> bool:
    """Transform ``sample`` into row ``j`` of the batch (and its label); True for a pair.
    ``rows``: the batch's rows when the transform writes into them (:func:`writes_into`)."""
    if rows is not None:
        label = transform.into(sample, rows[j])  # type: ignore[attr-defined]
        if label is not None:
            labels[j] = label
        return label is not None
    out = transform(sample)
    paired = isinstance(out, (tuple, list))
    try:
        with one_thread():
            collator.fill(images, labels, j, out, paired)
    except ValueError as e:
        raise ValueError(f"sample {sample.get('__key__')!r} of {sample.get('__shard__')!r}: "
                         f"{e}") from e
    return paired
