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
* ``num_workers=N``: each worker makes whole batches (:class:`RowSource`) in buffers in shared
  memory, which the DataLoader hands to this process without a copy; a worker reuses a buffer
  once this process has let go of the batch in it (:class:`WorkerRing`, :class:`RowBatches`).

The batches are those of the per-sample path, in the same order (same plan, same per-sample
seeding; ``tests/test_row_batches.py``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .collator import BatchCollator, _shared_empty, _storage_refs
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


# Rows written between two drops of the shard maps' pages (serial_batches' ``drop``): a batch's
# samples are all fetched before any is decoded, so the maps' own accounting (reader.DROP_EVERY)
# comes before the touches; without this, a batch of 256 kept ~110 MB of shard pages mapped.
DROP_ROWS = 16


def serial_batches(stream: Iterator[tuple[int, int, Any]], transform: Callable[[Any], Any],
                   batch_size: int, collator: BatchCollator | WorkerRing,
                   drop: Callable[[], None] | None = None) -> Iterator[Any]:
    """Batches of ``batch_size`` samples of ``stream`` (``(global id, shard, sample)``, from
    :meth:`FeedDataset._read <feedpipe.dataset.FeedDataset._read>`), made on the calling thread:
    each sample's image goes straight into its row of a :meth:`BatchCollator.buffer` (or a
    :meth:`WorkerRing.buffer`), its label
    into a NumPy view of the labels (a tensor item assignment costs more than the rest of the
    bookkeeping together). ``drop`` is called every :data:`DROP_ROWS` rows and after each
    batch, to unmap the shard pages read so far."""
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
                if drop is not None and j and not j % DROP_ROWS:
                    drop()
                label = into(x, rows[j])
                if paired is None:
                    paired = label is not None
                elif paired != (label is not None):
                    raise ValueError("the transform returned a label for some samples of a "
                                     "batch and none for others")
                if label is not None:
                    ys[j] = label
        del chunk, rows
        if drop is not None:
            drop()
        yield (images, labels) if paired else images


def in_place(dataset: FeedDataset, collator: Any) -> bool:
    """Whether ``dataset``'s batches are written in place into ``collator``'s rows: its transform
    :func:`writes_into` them, and no decoded store keeps each sample's output."""
    return dataset.decoded is None and writes_into(dataset.transform, collator)


def dataset_batches(dataset: FeedDataset, batch_size: int,
                    buffers: BatchCollator | WorkerRing, worker: int = 0,
                    workers: int = 1) -> Iterator[Any]:
    """:func:`serial_batches` of the samples ``worker`` of ``workers`` reads from ``dataset``."""
    stream = dataset._read(worker, workers, stored=False)
    try:
        yield from serial_batches(stream, dataset.transform,  # type: ignore[arg-type]
                                  batch_size, buffers, dataset._drop_pages)
    finally:
        stream.close()


def as_is(batch: Any) -> Any:
    """The DataLoader's ``collate_fn`` for :class:`RowSource` batches (``batch_size=None``):
    as they are (its default would turn an ``(images, labels)`` tuple into a list)."""
    return batch


class WorkerRing:
    """A worker's shared-memory batch buffers, each reused once the training process has let go
    of the batch last sent in it.

    A fresh 38.5 MB shared-memory batch (256 x 3x224x224 uint8) costs its worker the kernel's
    zero-fill and a page fault per 4 KB page, and the training process the freeing of those pages
    once the batch is dropped: 25 ms a batch, 0.1 ms an image, measured on 2 cores. A reused one
    costs neither.

    **Why reuse is safe.** The worker cannot see the training process's references, so that
    process says when a batch is gone. Each buffer has two 64-bit words in a small shared table,
    each with a single writer: ``issued`` (the worker writes a new token each time it fills the
    buffer) and ``released`` (the training process writes the token back once nothing there
    holds the batch, :class:`RowBatches`). The worker refills a buffer only while the two are
    equal. A release that comes late, for a batch of a buffer since replaced, names an old token
    and frees nothing; a batch that never reaches the loop (an epoch stopped early) leaves its
    buffer busy, and the worker allocates another in its place. Each worker process makes its
    own table, sent with its first batch of every epoch, so a release never reaches a later
    worker that took the same worker id. ``depth`` bounds the buffers a worker keeps (the
    DataLoader's ``prefetch_factor`` in flight, one the loop holds, one not yet seen released);
    with all busy, a batch gets a fresh buffer, as without a ring: speed, never correctness.
    """

    def __init__(self, collator: BatchCollator, depth: int) -> None:
        self.collator, self.depth = collator, max(1, int(depth))
        self.key = int.from_bytes(os.urandom(8), "little") >> 1
        self.table = _shared_empty((2, self.depth), torch.int64).zero_()
        self._issued, self._released = self.table[0].numpy(), self.table[1].numpy()
        self._slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.depth
        self._next = 0
        self._tokens = itertools.count(1)
        self._last: tuple[int, int, bool] | None = None
        self.send_table = True

    def buffer(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)`` views of the first ``n`` rows of a buffer the training process
        has released (else a new one), as :meth:`BatchCollator.buffer` gives them."""
        c = self.collator
        if not 0 < n <= c.batch_size:
            raise ValueError(f"a buffer of {n} rows from a BatchCollator of batch_size "
                             f"{c.batch_size}")
        slots, depth = self._slots, self.depth
        issued, released = self._issued, self._released
        pick, empty = None, None
        for k in range(depth):
            i = (self._next + k) % depth
            if slots[i] is None:
                if empty is None:
                    empty = i
            elif issued[i] == released[i]:
                pick = i
                break
        reused = pick is not None
        if pick is None:  # an empty slot, else the next one's buffer is left to its holder
            pick = empty if empty is not None else self._next
            slots[pick] = (_shared_empty((c.batch_size, *c.shape), c.dtype),
                           _shared_empty((c.batch_size,), c.label_dtype))
        self._next = (pick + 1) % depth
        token = next(self._tokens)
        issued[pick] = token  # busy from here until the training process writes it back
        self._last = (pick, token, reused)
        images, labels = slots[pick]  # type: ignore[misc]
        return images[:n], labels[:n]

    def ticket(self) -> Ticket:
        """The ticket of the last buffer handed out, to travel with its batch."""
        assert self._last is not None
        slot, token, reused = self._last
        table, self.send_table = (self.table if self.send_table else None), False
        return Ticket(self.key, slot, token, reused, table)


class Ticket:
    """Which worker buffer a batch is in (``key``: the worker process's ring, ``slot``,
    ``token``), whether it was a reused one, and the ring's table when this process may not have
    it yet. Not a tuple, so that the DataLoader's ``pin_memory`` leaves it (and the table in
    shared memory) as it is."""

    __slots__ = ("key", "slot", "token", "reused", "table")

    def __init__(self, key: int, slot: int, token: int, reused: bool,
                 table: torch.Tensor | None) -> None:
        self.key, self.slot, self.token, self.reused, self.table = key, slot, token, reused, table

    def __reduce__(self) -> Any:
        return Ticket, (self.key, self.slot, self.token, self.reused, self.table)


# A tensor that nothing else shares reads this storage use count (the query itself holds one).
_LONE = _storage_refs(torch.empty(1))


class RowBatches:
    """The training process's side of :class:`RowSource`: yields the workers' batches, and hands
    each worker buffer back (its ring's ``released`` word) once nothing in this process still
    shares the batch's storage: not the loop, not a view or storage object of it, not a
    prefetcher. Checked when the loop asks for the next batch and as it arrives, with torch's
    storage use count, against a
    hold taken here (so the count of a batch nobody else holds is known exactly). A batch that the DataLoader's
    ``pin_memory`` copied out of shared memory is handed back at once. Where torch does not
    give the use count, the workers allocate every batch afresh instead (``reuse=False``).

    ``stats()``: ``batches`` received, ``reused`` (made in a buffer a worker had back),
    ``released`` (handed back by this process)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor | None, int, int]] = []
        self._counts = {"batches": 0, "reused": 0, "released": 0}

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def __iter__(self) -> Iterator[Any]:
        tables: dict[int, Any] = {}  # each worker sends its table with its first batch
        try:
            for batch, ticket in self.loader:
                if type(batch) is list:  # pin_memory made the (images, labels) tuple a list
                    batch = tuple(batch)
                self._poll()
                if ticket is not None:
                    self._counts["batches"] += 1
                    self._counts["reused"] += bool(ticket.reused)
                    if ticket.table is not None:
                        tables[ticket.key] = ticket.table[1].numpy()
                    released = tables.get(ticket.key)
                    if released is not None:
                        self._hold(batch, released, ticket.slot, ticket.token)
                yield batch
                del batch
                # The loop has moved on from the batch before this one: hand it back now,
                # before the DataLoader gives its worker another task (on receiving the next
                # batch) and the worker looks for a free buffer. Polling only on receipt raced
                # the worker and lost often enough to keep a third buffer per worker.
                self._poll()
        finally:  # also when the loop stops early: let go of what it no longer holds
            self._poll()
            if not getattr(self.loader, "persistent_workers", False):
                # these workers are gone with the epoch: nothing to hand back to, and the holds
                # would keep the batches' shared memory mapped here (dropping one never frees
                # a buffer for reuse, so it is always safe)
                self._pending.clear()

    def _hold(self, batch: Any, released: Any, slot: int, token: int) -> None:
        images, labels = batch if isinstance(batch, tuple) else (batch, None)
        if not images.is_shared():  # pinned (copied) on the way: the buffer is not held here
            released[slot] = token
            self._counts["released"] += 1
            return
        self._pending.append((released, images.detach(),
                              None if labels is None else labels.detach(), slot, token))

    def _poll(self) -> None:
        keep = []
        for entry in self._pending:
            released, images, labels, slot, token = entry
            if _storage_refs(images) == _LONE and (labels is None
                                                   or _storage_refs(labels) == _LONE):
                released[slot] = token
                self._counts["released"] += 1
            else:
                keep.append(entry)
        self._pending = keep


class RowSource(IterableDataset):
    """The DataLoader-facing side with workers: each worker yields its own batches, written in
    place (:func:`serial_batches`) into shared-memory buffers, as the DataLoader would batch
    that worker's samples (``batch_size`` at a time, a shorter last one), each with its
    :class:`Ticket` (see :class:`WorkerRing`; with ``reuse=False`` every batch is a fresh
    buffer and the ticket ``None``)."""

    def __init__(self, dataset: FeedDataset, batch_size: int, collator: BatchCollator, *,
                 depth: int = 5, reuse: bool = True) -> None:
        super().__init__()
        self.dataset, self.batch_size, self.collator = dataset, int(batch_size), collator
        self.depth, self.reuse = int(depth), bool(reuse) and _LONE is not None
        self._ring: WorkerRing | None = None
        self._ring_pid = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ring"], state["_ring_pid"] = None, 0  # a worker makes its own
        return state

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ring = None
        if self.reuse and info is not None:
            if self._ring is None or self._ring_pid != os.getpid():
                self._ring, self._ring_pid = WorkerRing(self.collator, self.depth), os.getpid()
            ring = self._ring
            ring.send_table = True  # a new epoch: the training process may have dropped it
        buffers = self.collator if ring is None else ring
        with closing(dataset_batches(self.dataset, self.batch_size, buffers, worker,
                                     workers)) as batches:
            for batch in batches:
                yield batch, None if ring is None else ring.ticket()
