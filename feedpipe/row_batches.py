"""Batches written in place: the transform puts each image straight into its row of the batch.

A transform that returns a tensor per sample costs, per sample, that tensor's allocation and a
copy of it into the batch (``BatchCollator`` or ``default_collate``); with DataLoader workers the
batch is then a fresh shared-memory tensor per batch as well. A transform with ``into(sample,
out) -> label | None`` (:meth:`ImagePipeline.into <feedpipe.transforms.ImagePipeline.into>`)
skips both: it writes its pixels into ``out``, a row of a :meth:`BatchCollator.buffer
<feedpipe.collator.BatchCollator.buffer>` (measured on 2 cores, decode + crop + resize to 224 and
batch of 256: 0.535 -> 0.480 ms an image at ``num_workers=0``; ``benchmarks/bench_peers.py``).

:class:`~feedpipe.FeedLoader` takes this path by itself when its ``collate_fn`` is a
``BatchCollator`` whose shape and dtype are the transform's (:func:`writes_into`) and there is
no decoded store (whose path keeps each output to store it):

* ``num_workers=0``: :func:`serial_batches` on the calling thread;
* ``transform_threads=N``: each pool thread writes its rows (:mod:`feedpipe.thread_batches`);
* ``num_workers=N``: each worker makes whole batches (:class:`RowSource`) in buffers allocated in
  shared memory, which the DataLoader hands to this process without a copy.

The batches are those of the per-sample path, in the same order (same plan, same per-sample
seeding; ``tests/test_row_batches.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset, get_worker_info

from .collator import BatchCollator
from .image_ops import one_thread

if TYPE_CHECKING:
    from .dataset import FeedDataset


def writes_into(transform: Any, collator: Any) -> bool:
    """Whether ``transform`` can write its outputs straight into ``collator``'s batch rows: it
    has ``into(sample, out) -> label | None`` and its ``out_shape``/``out_dtype`` are the
    collator's, so a row needs no per-sample tensor and no copy."""
    return (isinstance(collator, BatchCollator) and callable(getattr(transform, "into", None))
            and tuple(getattr(transform, "out_shape", ())) == collator.shape
            and getattr(transform, "out_dtype", None) == collator.dtype)


def serial_batches(stream: Iterator[tuple[int, int, Any]], transform: Callable[[Any], Any],
                   batch_size: int, collator: BatchCollator) -> Iterator[Any]:
    """Batches of ``batch_size`` samples of ``stream`` (``(global id, shard, sample)``, from
    :meth:`FeedDataset._read <feedpipe.dataset.FeedDataset._read>`), made on the calling thread:
    each sample's image goes straight into its row of a :meth:`BatchCollator.buffer`, its label
    into a NumPy view of the labels (a tensor item assignment costs more than the rest of the
    bookkeeping together)."""
    into = transform.into  # type: ignore[attr-defined]
    while True:
        chunk = list(itertools.islice(stream, batch_size))
        if not chunk:
            return
        images, labels = collator.buffer(len(chunk))
        rows = images.unbind(0)
        try:
            ys: Any = labels.numpy()
        except TypeError:  # a label dtype NumPy lacks (bfloat16): item assignment
            ys = labels
        paired = None
        with one_thread():  # once a batch, not twice a sample
            for j, (_, _, x) in enumerate(chunk):
                label = into(x, rows[j])
                if paired is None:
                    paired = label is not None
                elif paired != (label is not None):
                    raise ValueError("the transform returned a label for some samples of a "
                                     "batch and none for others")
                if label is not None:
                    ys[j] = label
        del chunk, rows
        yield (images, labels) if paired else images


def as_is(batch: Any) -> Any:
    """The DataLoader's ``collate_fn`` for :class:`RowSource` batches (``batch_size=None``):
    as they are (its default would turn an ``(images, labels)`` tuple into a list)."""
    return batch


class RowSource(IterableDataset):
    """The DataLoader-facing side with workers: each worker yields its own batches, written in
    place (:func:`serial_batches`) into shared-memory buffers, as the DataLoader would batch
    that worker's samples (``batch_size`` at a time, a shorter last one)."""

    def __init__(self, dataset: FeedDataset, batch_size: int, collator: BatchCollator) -> None:
        super().__init__()
        self.dataset, self.batch_size, self.collator = dataset, int(batch_size), collator

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stream = self.dataset._read(worker, workers, stored=False)
        try:
            yield from serial_batches(stream, self.dataset.transform,  # type: ignore[arg-type]
                                      self.batch_size, self.collator)
        finally:
            stream.close()
