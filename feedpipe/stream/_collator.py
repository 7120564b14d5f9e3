"""``BatchCollator``: collation into preallocated batch tensors, reused safely.

A ``collate_fn`` that allocates a fresh batch tensor each step pays an allocation and a
page-fault sweep per batch; a pinned allocation is slow (``cudaHostAlloc`` pins page by page).
``BatchCollator`` keeps a ring of up to ``depth`` ``(images, labels)`` buffers and fills a free
one each call. It allocates another only while every buffer it has is still held (a loop that
drops each batch runs on two).

**Why reuse is safe.** Overwriting a buffer would corrupt a batch the training loop still holds:
the loop variable still references batch ``i`` while batch ``i + 1`` is collated, and a
prefetcher may hold several. So every batch handed out is a *view* of its buffer. Before a
buffer is refilled, the collator checks that no tensor outside the ring still shares its storage
(torch's storage use count), nor a Python storage object of it (``x.untyped_storage()`` kept
after its tensors are gone: its reference count). A buffer still in use is never overwritten:
that slot gets a fresh allocation instead, counted in :meth:`stats` as ``replaced`` (raise
``depth`` if it grows). ``depth`` is a speed knob, not a correctness condition. Where torch
lacks the use count, every batch is a fresh allocation (correct, just slower).

What the check cannot see: an asynchronous copy *out* of a buffer (``.to("cuda",
non_blocking=True)``) whose source tensor was already dropped. A consumer that copies
asynchronously must keep the host batch referenced until its copy has completed (a CUDA event),
as :class:`feedpipe.DeviceLoader` does.

**Worker processes.** In a DataLoader worker, batches travel to the main process through shared
memory that the worker would overwrite on reuse, and the worker cannot see the main process's
references. So there the collator falls back to ``default_collate``: a fresh shared-memory batch
each time, no pinning (workers never touch CUDA). The DataLoader's own ``pin_memory=True`` path
pins in the main process. The ring, and pinning, apply with ``num_workers=0``. A transform that
writes in place, behind :class:`~feedpipe.FeedLoader`, gets a worker-side ring whose buffers the
main process hands back (:class:`feedpipe.stream._worker_rows.WorkerRing`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import default_collate, get_worker_info

from ..transforms._threads import one_thread

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (``None`` where torch does not say).

    The count has one more for every Python storage object of it that someone keeps
    (``x.untyped_storage()`` held without any tensor). Python counts those, not the storage's
    use count, so they are added here from the storage object's reference count."""
    if _use_count is None:
        return None
    storage = t.untyped_storage()
    before = int(_use_count(storage._cdata))
    # references to the storage object beyond those this very code takes (measured at import:
    # Python 3.14 passes a local to a call without a new reference)
    kept = sys.getrefcount(storage) - _PY_BASE
    after = int(_use_count(storage._cdata))
    # a count that moved between the two reads (another thread making or dropping a tensor or
    # storage object of it) is read as one more holder: never free on a moving count
    return max(before, after) + kept + (before != after)


def _py_base() -> int:
    # sys.getrefcount of a storage object that nothing but storage_refs's own local holds,
    # taken with the same code
    t = torch.empty(1)
    storage = t.untyped_storage()
    return sys.getrefcount(storage)


_PY_BASE = _py_base()


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory (no copy: ``share_memory_()`` of an empty
    tensor would allocate twice and copy)."""
    numel = 1
    for d in shape:
        numel *= d
    try:
        storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    except (AttributeError, RuntimeError):  # no private constructor: the public way
        return torch.empty(shape, dtype=dtype).share_memory_()
    # torch's stubs lack the (source, offset, size) overload that set_ has
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]


class _Slot:
    __slots__ = ("images", "labels", "base")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.base = (storage_refs(images), storage_refs(labels))

    def free(self) -> bool:
        now = (storage_refs(self.images), storage_refs(self.labels))
        return None not in now and now == self.base


class BatchCollator:
    """Collate ``(image, label)`` samples (or bare images) into reused preallocated tensors.

    Args:
        batch_size: the largest batch; a smaller (last) batch is a view of the first rows.
        shape: one image's shape, e.g. ``(3, 224, 224)``.
        dtype: the images' dtype (``torch.uint8`` or ``torch.float32``).
        pin_memory: allocate the ring in pinned host memory when CUDA is available and this is
            the main process (checked at the first batch, not here, so constructing one in a
            parent before forking workers touches no CUDA).
        depth: buffers in the ring (see the module docstring: a speed knob, never a hazard).
        label_dtype: the labels' dtype.

    Example:
        >>> c = BatchCollator(4, (3, 2, 2))
        >>> x, y = c([(torch.ones(3, 2, 2, dtype=torch.uint8), 7)] * 3)
        >>> tuple(x.shape), y.tolist()
        ((3, 3, 2, 2), [7, 7, 7])
    """

    def __init__(self, batch_size: int, shape: Sequence[int], dtype: torch.dtype = torch.uint8, *,
                 pin_memory: bool = False, depth: int = 4,
                 label_dtype: torch.dtype = torch.int64) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.batch_size = int(batch_size)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.depth = int(depth)
        self.label_dtype = label_dtype
        self._reset()

    def _reset(self) -> None:
        self._ring: list[_Slot | None] = [None] * self.depth
        self._next = 0
        self._pin: bool | None = None
        self._counts = {"batches": 0, "allocated": 0, "reused": 0, "replaced": 0, "fresh": 0}

    def __getstate__(self) -> dict[str, Any]:
        # buffers stay in the process that made them; a copy (a worker) starts with an empty ring
        state = self.__dict__.copy()
        for k in ("_ring", "_next", "_pin", "_counts"):
            state.pop(k)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def stats(self) -> dict[str, int]:
        """Batches collated and how their buffers came: ``reused`` from the ring, ``allocated``
        into an empty slot, ``replaced`` (slot still in use), ``fresh`` (worker / no use count)."""
        return dict(self._counts)

    def _alloc(self) -> _Slot:
        if self._pin is None:
            self._pin = bool(self.pin_memory and torch.cuda.is_available())
        images = torch.empty((self.batch_size, *self.shape), dtype=self.dtype, pin_memory=self._pin)
        labels = torch.empty((self.batch_size,), dtype=self.label_dtype, pin_memory=self._pin)
        return _Slot(images, labels)

    def _alloc_shared(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # In a DataLoader worker: allocated in shared memory, as default_collate allocates its
        # batches there, so that sending the batch to the training process moves a handle; a
        # private buffer would be copied into shared memory on the way (share_memory_()).
        return shared_empty((n, *self.shape), self.dtype), shared_empty((n,), self.label_dtype)

    def _slot(self) -> _Slot:
        # A free buffer first (from the one after the last used), then an empty slot, and only
        # then a replacement. A loop that drops each batch before the next runs on two buffers,
        # so the ring's memory is spent, and its pages first touched, only as far as the
        # consumer actually holds batches.
        ring, depth = self._ring, self.depth
        empty = None
        for k in range(depth):
            i = (self._next + k) % depth
            slot = ring[i]
            if slot is None:
                if empty is None:
                    empty = i
            elif slot.free():
                self._next = (i + 1) % depth
                self._counts["reused"] += 1
                return slot
        if empty is not None:
            i = empty
            self._counts["allocated"] += 1
        else:
            i = self._next
            self._counts["replaced"] += 1
        self._next = (i + 1) % depth
        slot = ring[i] = self._alloc()
        return slot

    def buffer(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)`` views of the first ``n`` rows of a free buffer, counted as a
        batch. For a caller that fills a batch in place (the ``gather`` route does): it
        returns them (or the images alone) as the batch, as :meth:`__call__` would."""
        if not 0 < n <= self.batch_size:
            raise ValueError(f"a buffer of {n} rows from a BatchCollator of batch_size "
                             f"{self.batch_size}")
        self._counts["batches"] += 1
        if get_worker_info() is not None:
            self._counts["fresh"] += 1
            return self._alloc_shared(n)
        if _use_count is None:
            self._counts["fresh"] += 1
            slot = self._alloc()
        else:
            slot = self._slot()
        return slot.images[:n], slot.labels[:n]

    def __call__(self, samples: Sequence[Any]) -> Any:
        """The batch of ``samples`` (each an ``(image, label)`` pair or an image alone), copied
        into a free buffer of the ring: ``(images, labels)``, or the images alone (in a
        DataLoader worker process, a fresh batch by ``default_collate``)."""
        n = len(samples)
        if not 0 < n <= self.batch_size:
            raise ValueError(f"got {n} samples for a BatchCollator of batch_size {self.batch_size}")
        paired = isinstance(samples[0], (tuple, list))
        self._counts["batches"] += 1
        if get_worker_info() is not None or _use_count is None:
            self._counts["fresh"] += 1
            out = default_collate(list(samples))
            return tuple(out) if paired else out
        slot = self._slot()
        images, labels = slot.images[:n], slot.labels[:n]
        # per-image copies are too small for torch's intra-op threads: on a busy machine their
        # barriers cost more than the copies (transforms._threads.one_thread says why)
        with one_thread():
            for j, s in enumerate(samples):
                self.fill(images, labels, j, s, paired)
        return (images, labels) if paired else images

    def fill(self, images: torch.Tensor, labels: torch.Tensor, j: int, sample: Any,
             paired: bool) -> None:
        """Copy ``sample`` (an ``(image, label)`` pair when ``paired``, else an image) into row
        ``j`` of ``images``/``labels`` (from :meth:`buffer`); a wrong shape is a ValueError."""
        img = sample[0] if paired else sample
        if tuple(img.shape) != self.shape:
            raise ValueError(f"sample {j} of the batch has shape {tuple(img.shape)}, "
                             f"the collator takes {self.shape}")
        images[j].copy_(img if isinstance(img, torch.Tensor) else torch.as_tensor(img))
        if paired:
            labels[j] = sample[1]
