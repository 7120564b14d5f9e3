"""``DeviceCache``: the L3 tier. Decoded fixed-shape samples held in preallocated device buffers,
served by on-device gather.

One buffer per field (``images: uint8 [slots, C, H, W]``, ``labels: int64 [slots]``) is allocated
when ``warmup`` sees the first sample; ``slots`` is what ``capacity_bytes`` holds, at most the
whole dataset. Warm-up fills the slots in the order its source gives samples (manifest order for a
:class:`~feedpipe.FeedDataset`) and keeps a host-side map ``global id -> slot`` (``-1``: not
resident): one integer per sample, no Python object per sample.

An epoch (``batches``) turns the plan's order of ids into one on-device index tensor (a single
host-to-device copy of 8 bytes per sample per epoch); each batch is then ``index_select`` on the
device: no sample data crosses the bus. Samples that are not resident come from a *fallback* (the
normal pipeline: by default the warm-up dataset read and transformed again) and are written into
their places in the batch, so every planned sample is still delivered once and in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._helpers.fork_safety import default_start_method, process_fork_unsafe
from .._helpers.progress import progress
from ..errors import DeviceCacheError, StartMethodError
from ._epoch_ids import epoch_ids
from ._fallback import DatasetFallback, WithId, is_dataset
from ._placement import resolve_device

Fallback = Callable[[np.ndarray], Any]

# Fields of at most this many bytes a sample (labels, ids, small vectors) are gathered once for a
# resident epoch and sliced per batch, instead of one small gather each per batch: the epoch's
# worth is at most this multiple of the epoch index's 8 bytes per sample, already on the device.
_EPOCH_FIELD_BYTES = 64


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``(len(t), sample numel)`` tensor (a view when ``t`` is contiguous)."""
    return t.reshape(len(t), int(np.prod(t.shape[1:], dtype=np.int64)))


def _wide_rows(t: torch.Tensor) -> torch.Tensor:
    """The rows of contiguous ``t`` reinterpreted as the widest integer type that divides a row.

    A gather then moves the same bytes as 8-byte elements instead of, for uint8 images, 1-byte
    ones: far fewer elements for the indexing kernel (``benchmarks/bench_device_cache.py``)."""
    rows = _rows(t)
    row_bytes = rows.shape[1] * t.element_size()
    for wide in (torch.int64, torch.int32, torch.int16):
        if wide.itemsize > t.element_size() and row_bytes % wide.itemsize == 0:
            return rows.view(wide)
    return rows


class DeviceCache:
    """Device-resident preallocated buffers of decoded samples, served by on-device gather.

    Args:
        capacity_bytes: device memory the buffers may take.
        device: where they live. ``"cuda"`` falls back to the CPU where no CUDA device exists;
            ``"cpu"`` works everywhere (for tests and CPU training).

    Example:
        >>> import torch
        >>> cache = DeviceCache(10_000, device="cpu")
        >>> data = [(i, torch.full((2,), i, dtype=torch.uint8), i) for i in range(6)]
        >>> cache.warmup(data, num_samples=6)["resident"]
        6
        >>> [lbl.tolist() for img, lbl in cache.batches([5, 0, 3], batch_size=2)]
        [[5, 0], [3]]
    """

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda") -> None:
        if int(capacity_bytes) < 0:
            raise ValueError(f"capacity_bytes must be non-negative, not {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._requested = device
        self._device: torch.device | None = None
        self._names: tuple[str, ...] | None = None  # dict samples; None: tuple samples
        self._shapes: list[tuple[int, ...]] = []
        self._dtypes: list[torch.dtype] = []
        self._buffers: list[torch.Tensor] = []
        self._rows: list[torch.Tensor] = []  # 2-D (widened) views of the buffers, for the gather
        self._slot_of = np.zeros(0, dtype=np.int64)
        self.num_samples = 0
        self.resident = 0
        self.fallback: Fallback | None = None
        self.hits = 0
        self.misses = 0

    @property
    def device(self) -> torch.device:
        """The device holding the buffers, resolved on first use (``"cuda"`` becomes the
        current CUDA device)."""
        if self._device is None:
            self._device = resolve_device(self._requested)
        return self._device

    # -- layout ------------------------------------------------------------------------------
    def _fields(self, sample: Any, gid: int) -> list[torch.Tensor]:
        """The sample's fields as tensors, checked against the layout (set by the first one)."""
        if isinstance(sample, Mapping):
            names = tuple(sample)
            values = [sample[k] for k in names]
        else:
            names, values = None, list(sample)
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
        if not self._shapes:
            self._names = names
            self._shapes = [tuple(t.shape) for t in tensors]
            self._dtypes = [t.dtype for t in tensors]
            return tensors
        if names != self._names or len(tensors) != len(self._shapes):
            raise DeviceCacheError(f"sample {gid}: fields {names or len(tensors)} differ from the "
                                   f"first sample's {self._names or len(self._shapes)}")
        for k, (t, shape, dtype) in enumerate(zip(tensors, self._shapes, self._dtypes)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                field = names[k] if names else k
                raise DeviceCacheError(
                    f"sample {gid}, field {field!r}: {t.dtype} {tuple(t.shape)} where the cache "
                    f"holds {dtype} {shape}; DeviceCache needs fixed-shape samples (resize or "
                    "crop them in the transform)")
        return tensors

    @property
    def bytes_per_sample(self) -> int:
        """Device bytes one resident sample takes (every output of the transform)."""
        return sum(int(np.prod(s, dtype=np.int64)) * d.itemsize
                   for s, d in zip(self._shapes, self._dtypes))

    def _gather(self, index: torch.Tensor) -> list[torch.Tensor]:
        return [self._take(f, index) for f in range(len(self._rows))]

    def _structure(self, tensors: Sequence[torch.Tensor | None]) -> Any:
        return dict(zip(self._names, tensors)) if self._names is not None else tuple(tensors)

    # -- warm-up -----------------------------------------------------------------------------
    def warmup(self, source: Any, *, num_samples: int | None = None,
               transform: Callable[[dict[str, Any]], Any] | None = None, num_workers: int = 0,
               batch_size: int | None = None, warm: Callable[[Any], Any] | None = None,
               fallback: Fallback | None = None, show_progress: bool | None = None,
               chunk: int = 256) -> dict[str, Any]:
        """Allocate the buffers and fill them; returns :meth:`stats`.

        Args:
            source: a :class:`FeedDataset` (read in manifest order, ``transform`` applied) or an
                iterable of ``(global id, tensor, tensor, ...)`` / ``(global id, {name: tensor})``.
                Numbers become 0-d tensors. Filling stops when the cache is full.
            num_samples: ids lie in ``[0, num_samples)``; taken from the dataset or ``len()``.
            transform: with a dataset, sample dict -> tensors (fixed shapes), as above.
            num_workers: with a dataset, decode in this many DataLoader worker processes.
            batch_size: run one gather of this many samples, so that the allocator and the kernels
                are warm before the first step.
            warm: called once with that gathered batch (run a forward pass to warm cuDNN, ...).
            fallback: ``ids -> batch`` for ids that are not resident: the fields of those
                samples as tensors with a leading ``len(ids)`` dimension, in the warm-up's layout
                (a tuple, or a dict by name). With a dataset the default reads and transforms
                them again with the warm-up's transform.
            show_progress: a progress bar (default: when stderr is a terminal).
            chunk: samples staged on the host per copy to the device.
        """
        items, num_samples, fallback = _warmup_items(source, num_samples, transform,
                                                     num_workers, fallback)
        self._reset(int(num_samples), fallback)
        dev = self.device
        stage: list[torch.Tensor] = []
        staged: list[int] = []
        bar = progress(None, "warm-up L3 cache", unit="sample", enabled=show_progress)
        try:
            for item in items:
                gid, rest = int(item[0]), item[1:]
                sample = rest[0] if len(rest) == 1 and isinstance(rest[0], Mapping) else rest
                tensors = self._fields(sample, gid)
                if not self._buffers:
                    if not self._allocate(bar):
                        break
                    stage = [torch.empty((chunk, *s), dtype=d, pin_memory=dev.type == "cuda")
                             for s, d in zip(self._shapes, self._dtypes)]
                if not 0 <= gid < self.num_samples:
                    raise DeviceCacheError(f"sample id {gid} is outside [0, {self.num_samples})")
                if self._slot_of[gid] != -1:  # resident, or staged (-2): a repeated id
                    continue
                for buf, t in zip(stage, tensors):
                    buf[len(staged)].copy_(t)
                self._slot_of[gid] = -2
                staged.append(gid)
                if len(staged) == chunk or self.resident + len(staged) == len(self._buffers[0]):
                    self._flush(stage, staged)
                    bar.update(len(staged))
                    staged = []
                    if self.resident == len(self._buffers[0]):
                        break  # full: the rest comes through the fallback
            if staged:
                self._flush(stage, staged)
                bar.update(len(staged))
        finally:
            bar.close()
        if batch_size and self.resident:
            idx = torch.arange(min(batch_size, self.resident), device=dev)
            batch = self._structure(self._gather(idx))
            if warm is not None:
                warm(batch)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # warm-up, not the loop: finish before timing starts
        return self.stats()

    def _reset(self, num_samples: int, fallback: Fallback | None) -> None:
        self._names, self._shapes, self._dtypes, self._buffers, self._rows = None, [], [], [], []
        self._slot_of = np.full(num_samples, -1, dtype=np.int64)
        self.num_samples, self.resident, self.hits, self.misses = num_samples, 0, 0, 0
        self.fallback = fallback

    def _allocate(self, bar: Any) -> bool:
        per = max(1, self.bytes_per_sample)
        slots = min(self.capacity_bytes // per, self.num_samples)
        if slots == 0:
            return False
        self._buffers = [torch.empty((slots, *s), dtype=d, device=self.device)
                         for s, d in zip(self._shapes, self._dtypes)]
        self._rows = [_wide_rows(b) for b in self._buffers]
        bar.total = slots
        return True

    def _flush(self, stage: list[torch.Tensor], staged: list[int]) -> None:
        a, n = self.resident, len(staged)
        for buf, st in zip(self._buffers, stage):
            buf[a:a + n].copy_(st[:n])  # synchronous: the staging rows are refilled next
        self._slot_of[staged] = np.arange(a, a + n)
        self.resident += n

    # -- serving -----------------------------------------------------------------------------
    def epoch_ids(self, order: Any) -> np.ndarray:
        """The ids an epoch delivers, from a :class:`~feedpipe.FeedDataset` (its current epoch
        and this rank's share, resume point included), a ``Plan`` (one rank), a ``(Plan, Split)``
        pair, or a sequence of ids."""
        return epoch_ids(order, self.num_samples)

    def batches(self, order: Any, batch_size: int, *, fallback: Fallback | None = None
                ) -> Iterator[Any]:
        """Serve one epoch in ``order`` (see :meth:`epoch_ids`), ``batch_size`` samples a batch
        (the last may be smaller), fields on the device in the warm-up's layout."""
        if not self._shapes:
            raise DeviceCacheError("the cache is empty: call warmup() first")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        ids = self.epoch_ids(order)
        slots = self._slot_of[ids]
        hit = slots >= 0
        fb = fallback or self.fallback
        if fb is None and not hit.all():
            raise DeviceCacheError(
                f"{int((~hit).sum())} of the epoch's {len(ids)} samples are not resident "
                f"({self.resident} of {self.num_samples} fit in {self.capacity_bytes} bytes) and "
                "there is no fallback: pass fallback= (ids -> samples), or a larger capacity")
        # The epoch's on-device index: the only host-to-device copy of the epoch (8 bytes per id),
        # from pinned memory on CUDA so that it does not hold up the host.
        host = torch.from_numpy(np.where(hit, slots, 0))
        if self.device.type == "cuda":
            host = host.pin_memory()
        index = host.to(self.device, non_blocking=True)
        return self._serve(ids, hit, index, batch_size, fb)  # type: ignore[arg-type]

    def _serve(self, ids: np.ndarray, hit: np.ndarray, index: torch.Tensor, batch_size: int,
               fb: Fallback) -> Iterator[Any]:
        if hit.all():  # the usual case: one gather kernel per batch, no host work per batch
            yield from self._serve_resident(index, batch_size)
            return
        dev = self.device
        for a in range(0, len(ids), batch_size):
            b = min(a + batch_size, len(ids))
            miss = np.flatnonzero(~hit[a:b])
            if len(miss) == b - a:
                out = self._fetch(fb, ids[a:b])
            else:
                out = self._gather(index[a:b])
                if len(miss):
                    pos = torch.from_numpy(miss).to(dev)
                    for o, g in zip(out, self._fetch(fb, ids[a:b][miss])):
                        _rows(o).index_copy_(0, pos, _rows(g))  # o is contiguous: a view
            self.misses += len(miss)
            self.hits += b - a - len(miss)
            yield self._structure(out)

    def _serve_resident(self, index: torch.Tensor, batch_size: int) -> Iterator[Any]:
        """An epoch whose every sample is resident.

        A field of at most ``_EPOCH_FIELD_BYTES`` a sample (a label) is gathered for the whole
        epoch in one kernel, and each batch takes a slice of it (a view: no kernel). So a batch
        costs one gather per larger field: with images and labels, one kernel a batch. Each
        batch's fields are fresh tensors (index_select allocates them): the caller owns them, as
        it owned the per-sample copies."""
        if not len(index):
            return
        parts = index.split(batch_size)  # views of the epoch's on-device index
        whole = [self._take(f, index).split(batch_size)
                 if self._field_bytes(f) <= _EPOCH_FIELD_BYTES else None
                 for f in range(len(self._rows))]
        per_batch = [f for f, w in enumerate(whole) if w is None]
        for b, part in enumerate(parts):
            out = [w[b] if w is not None else None for w in whole]
            for f in per_batch:
                out[f] = self._take(f, part)
            self.hits += len(part)
            yield self._structure(out)

    def _field_bytes(self, f: int) -> int:
        return int(np.prod(self._shapes[f], dtype=np.int64)) * self._dtypes[f].itemsize

    def _take(self, f: int, index: torch.Tensor) -> torch.Tensor:
        """Field ``f`` of the slots in ``index``: one index_select over whole (widened) rows (on
        2-D views index_select copies whole rows; 4-D uint8 images gather far slower on the CPU
        than the same bytes as rows: ``benchmarks/bench_device_cache.py``)."""
        rows = self._rows[f].index_select(0, index)
        if rows.dtype != self._dtypes[f]:
            rows = rows.view(self._dtypes[f])
        return rows.view(len(index), *self._shapes[f])

    def _fetch(self, fb: Fallback, ids: np.ndarray) -> list[torch.Tensor]:
        """Non-resident samples from the fallback, as batched tensors on the device."""
        got = fb(ids)
        names = self._names if self._names is not None else range(len(self._shapes))
        if isinstance(got, Mapping) != (self._names is not None) or len(got) != len(names):
            raise DeviceCacheError(f"the fallback returned {type(got).__name__} of {len(got)} "
                                   f"fields; the cache holds {list(names)}")
        out = []
        for k, shape, dtype in zip(names, self._shapes, self._dtypes):
            t = torch.as_tensor(got[k])
            if tuple(t.shape) != (len(ids), *shape) or t.dtype != dtype:
                raise DeviceCacheError(
                    f"the fallback's field {k!r} is {t.dtype} {tuple(t.shape)} for {len(ids)} "
                    f"ids; the cache holds {dtype} {shape} per sample")
            out.append(t.to(self.device))
        return out

    def tier_stats(self) -> Any:
        """Hits and misses since warm-up, the resident samples and the buffers' bytes, in the
        shape every cache tier reports (the fields :func:`~feedpipe.cache_stats` lists)."""
        from ..caches._stats import DEVICE, TierStats

        used = sum(b.numel() * b.element_size() for b in self._buffers)
        return TierStats(DEVICE, self.hits, self.misses, used, self.resident)

    def stats(self) -> dict[str, Any]:
        """``hits``/``misses``/``hit_ratio`` over the samples served since warm-up; ``resident``
        samples of ``num_samples`` (``resident_fraction``: how much of the dataset fits);
        ``capacity_bytes``, ``bytes_used`` by the buffers, ``bytes_per_sample``, ``slots``."""
        served = self.hits + self.misses
        return {
            "device": str(self.device),
            "hits": self.hits,
            "misses": self.misses,
            "hit_ratio": self.hits / served if served else None,
            "resident": self.resident,
            "num_samples": self.num_samples,
            "resident_fraction": self.resident / self.num_samples if self.num_samples else 0.0,
            "slots": len(self._buffers[0]) if self._buffers else 0,
            "capacity_bytes": self.capacity_bytes,
            "bytes_used": sum(b.numel() * b.element_size() for b in self._buffers),
            "bytes_per_sample": self.bytes_per_sample,
            "fields": [{"name": (self._names[k] if self._names else k), "shape": list(s),
                        "dtype": str(d).replace("torch.", "")}
                       for k, (s, d) in enumerate(zip(self._shapes, self._dtypes))],
        }


def _warmup_items(source: Any, num_samples: int | None,
                  transform: Callable[[dict[str, Any]], Any] | None, num_workers: int,
                  fallback: Fallback | None) -> tuple[Iterable[Any], int, Fallback | None]:
    """What :meth:`DeviceCache.warmup` reads (a dataset in manifest order, transformed, in
    ``num_workers`` worker processes; or the iterable itself), how many ids there are, and the
    fallback for ids that are not resident."""
    items: Iterable[Any]
    if is_dataset(source):
        if transform is None:
            raise DeviceCacheError("warmup(dataset) needs transform=: a function from a sample "
                                   "dict to fixed-shape tensors")
        num_samples = source.manifest.total_samples
        view = source.in_order(WithId(transform))  # decode=, cache and verify kept
        if num_workers:
            from torch.utils.data import DataLoader

            unsafe = process_fork_unsafe()
            if unsafe is not None and default_start_method() == "fork":
                raise StartMethodError(
                    f"DeviceCache.warmup(num_workers={num_workers}) would fork its worker "
                    f"processes from a process that runs {unsafe}, which can deadlock "
                    "them: warm up with num_workers=0, or before the DaliStage starts.")

            items = DataLoader(view, batch_size=None, num_workers=num_workers)
        else:
            items = view
        fallback = fallback or DatasetFallback(source, transform)
    else:
        items = source
        if num_samples is None:
            if not hasattr(source, "__len__"):
                raise DeviceCacheError("warmup(iterable) needs num_samples= (ids lie in "
                                       "[0, num_samples)) when the iterable has no len()")
            num_samples = len(source)
    return items, int(num_samples), fallback
