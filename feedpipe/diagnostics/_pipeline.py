"""The pipeline half of ``feedpipe probe``: each stage's samples/s, measured alone.

The stages, in the order a sample meets them:

- **read**: :class:`ShardReader` slices a sample out of its shard and copies its fields, as a
  worker does before handing it over;
- **decode**: the ``decode`` callable (by default JPEG fields with simplejpeg), on one core;
- **batch**: :func:`collate_samples` on decoded samples, stacking tensors. Images of different
  sizes are copied into slots of one shape, as a resize transform would give them;
- **host-to-device**: pinned and pageable copies (CUDA only);
- the whole :class:`FeedLoader` at several ``num_workers`` (scaling).

Each stage loops until its own deadline and always completes at least one unit of work. Worker
processes are started (fork) before anything touches CUDA; the host-to-device stage runs last.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..format._manifest import Manifest, join
from ..format._reader import ShardReader

JPEG = ("jpg", "jpeg")
Decode = Callable[[dict[str, Any]], Any]


class JpegDecode:
    """The default decoder: every JPEG field of a sample becomes an ``HxWx3`` uint8 array
    (simplejpeg); other fields pass through. Picklable, so worker processes can use it."""

    def __init__(self, fields: Sequence[str]) -> None:
        self.fields = sorted({f for f in fields if f.lower().rsplit(".", 1)[-1] in JPEG})

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        import simplejpeg

        out = dict(sample)
        for f in self.fields:
            v = out.get(f)
            if v is not None:
                out[f] = simplejpeg.decode_jpeg(v, colorspace="RGB")
        return out


def jpeg_fields(fields: Sequence[str]) -> list[str]:
    return JpegDecode(fields).fields


def _nbytes(obj: Any) -> int:
    """Bytes of a (decoded) sample: arrays, tensors, bytes; containers summed."""
    if isinstance(obj, dict):
        return sum(_nbytes(v) for k, v in obj.items() if not str(k).startswith("__"))
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    n = getattr(obj, "nbytes", None)
    return int(n) if isinstance(n, int) else 0


def _rate(n: int, seconds: float) -> float | None:
    return n / seconds if seconds > 0 and n else None


def read_stage(root: str, manifest: Manifest, seconds: float, *,
               keep: int = 256, keep_bytes: int = 64 << 20
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read samples in manifest order (one process), copying every field to ``bytes``. Returns
    the figures and up to ``keep`` samples (``keep_bytes`` at most) for the later stages."""
    kept: list[dict[str, Any]] = []
    kept_bytes = n = nbytes = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    done = False
    while not done:
        base = 0
        for rec in manifest.shards:
            with ShardReader(join(root, rec.name), name=rec.name, base=base) as r:
                for i in range(len(r)):
                    s = r.sample(i)
                    for k, v in s.items():
                        if type(v) is memoryview:
                            s[k] = v.tobytes()
                            nbytes += len(s[k])
                    n += 1
                    if len(kept) < keep and kept_bytes < keep_bytes:
                        kept.append(s)
                        kept_bytes += _nbytes(s)
                    if time.perf_counter() >= deadline:
                        done = True
                        break
            base += rec.samples
            if done:
                break
    elapsed = time.perf_counter() - t0
    return ({"samples": n, "bytes": nbytes, "seconds": round(elapsed, 6),
             "samples_per_s": _rate(n, elapsed), "mb_per_s": nbytes / 1e6 / elapsed}, kept)


def decode_stage(samples: Sequence[Any], decode: Decode,
                 seconds: float) -> tuple[dict[str, Any], list[Any]]:
    """``decode`` over ``samples`` (cycled) in this process: samples/s per core."""
    decoded: list[Any] = []
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        for s in samples:
            d = decode(s)
            if len(decoded) < len(samples):
                decoded.append(d)
            n += 1
            if time.perf_counter() >= deadline:
                break
        else:
            continue
        break
    elapsed = time.perf_counter() - t0
    raw = sum(_nbytes(s) for s in samples) / len(samples)
    out = sum(_nbytes(d) for d in decoded) / len(decoded)
    return ({"samples": n, "seconds": round(elapsed, 6), "samples_per_s": _rate(n, elapsed),
             "input_bytes_per_sample": raw, "output_bytes_per_sample": out}, decoded)


def list_collate(samples: list[Any]) -> list[Any]:
    """The fallback batch: a plain list (what is left when samples cannot be stacked)."""
    return samples


class SlotCollate:
    """Batches of decoded images of different sizes as one ``uint8`` tensor per image field.

    Each image is copied into a slot of one shape, centre-cropped where larger and zero-padded
    where smaller: the fixed shape a resize transform gives a training pipeline's images. Other
    fields are collated as :func:`~feedpipe.stream._loader.collate_samples` does. Picklable, so
    it runs in workers."""

    def __init__(self, slots: dict[str, tuple[int, ...]]) -> None:
        self.slots = slots

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        import numpy as np
        import torch

        from ..stream._loader import collate_samples

        out = collate_samples([{k: v for k, v in s.items() if k not in self.slots}
                               for s in samples])
        for f, shape in self.slots.items():
            dst = np.zeros((len(samples), *shape), dtype=np.uint8)
            batch = torch.from_numpy(dst)
            for i, s in enumerate(samples):
                a = np.asarray(s[f])
                if a.ndim == len(shape) - 1:
                    a = a[..., None]  # greyscale into a colour slot
                h, w = min(a.shape[0], shape[0]), min(a.shape[1], shape[1])
                y, x = (a.shape[0] - h) // 2, (a.shape[1] - w) // 2
                dst[i, :h, :w] = a[y : y + h, x : x + w]
            out[f] = batch
        return out


def _slots(decoded: Sequence[Any]) -> dict[str, tuple[int, ...]]:
    """Image fields (2-D or 3-D uint8 arrays) of dict samples whose shapes differ -> the slot
    shape: the median height and width, the most channels."""
    import numpy as np

    if not decoded or not isinstance(decoded[0], dict):
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for f, v in decoded[0].items():
        if not (isinstance(v, np.ndarray) and v.ndim in (2, 3) and v.dtype == np.uint8):
            continue
        shapes = [s[f].shape for s in decoded if isinstance(s.get(f), np.ndarray)]
        if len(set(shapes)) < 2:
            continue
        h = int(np.median([x[0] for x in shapes]))
        w = int(np.median([x[1] for x in shapes]))
        c = max((x[2] if len(x) == 3 else 1) for x in shapes)
        out[f] = (h, w, c) if v.ndim == 3 or c > 1 else (h, w)
    return out


def choose_collate(decoded: Sequence[Any],
                   batch_size: int) -> tuple[Callable[[list[Any]], Any], str]:
    """:func:`collate_samples` when it can stack the decoded samples; a :class:`SlotCollate`
    when images of different sizes are what stops it; :func:`list_collate` (and a note) when
    nothing can stack them."""
    from ..stream._loader import collate_samples

    first = list(decoded[: max(2, batch_size)])
    try:
        collate_samples(first)
        return collate_samples, ""
    except Exception as e:  # noqa: BLE001 - any refusal means "cannot stack these as they are"
        refused = type(e).__name__
    slots = _slots(decoded)
    if slots:
        try:
            SlotCollate(slots)(first)
        except Exception as e:  # noqa: BLE001
            refused = type(e).__name__
        else:
            what = ", ".join(f"{f} {'x'.join(map(str, sh))}" for f, sh in slots.items())
            return SlotCollate(slots), (
                f"decoded images differ in size: batches stack them as uint8 tensors of one "
                f"shape ({what}: the median size, centre-cropped or zero-padded), as a resize "
                "transform would")
    return list_collate, (f"decoded samples cannot be stacked ({refused}); batches are lists, "
                          "so the batch figure leaves out the copy into tensors")


def describe_batch(batch: Any) -> dict[str, Any]:
    """The tensors of one batch: ``{"tensors": {field: "uint8[64, 224, 224, 3]"},
    "tensor_bytes": ...}`` (a batch that is not a dict of fields counts as field ``""``)."""
    import torch

    fields = batch.items() if isinstance(batch, dict) else [("", batch)]
    tensors = {k: v for k, v in fields if isinstance(v, torch.Tensor)}
    return {"tensors": {k: f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                        for k, v in tensors.items()},
            "tensor_bytes": sum(v.numel() * v.element_size() for v in tensors.values())}


def batch_stage(decoded: Sequence[Any], collate: Callable[[list[Any]], Any], batch_size: int,
                seconds: float) -> dict[str, Any]:
    """Batches of ``batch_size`` (cycling through ``decoded``) until the deadline, on one core
    (torch's intra-op threads set to 1, as in a DataLoader worker)."""
    import torch

    pool = list(decoded)
    while len(pool) < batch_size:
        pool.extend(decoded)
    n = i = 0
    out = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while True:
            batch = pool[i : i + batch_size]
            if len(batch) < batch_size:
                i = 0
                continue
            out = collate(batch)
            i += batch_size
            n += batch_size
            if time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return {"batch_size": batch_size, "samples": n, "seconds": round(elapsed, 6),
            "samples_per_s": _rate(n, elapsed), **describe_batch(out)}


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        keys = batch.get("__key__")
        return len(keys) if keys is not None else len(next(iter(batch.values())))
    return len(batch)


def loader_stage(root: str, decode: Decode | None, collate: Callable[[list[Any]], Any],
                 batch_size: int, workers: int, seconds: float) -> dict[str, Any]:
    """The whole :class:`FeedLoader` (read, decode in workers, batch) with ``workers`` worker
    processes. Worker start-up (until the first batch) is reported apart; the rate is measured
    over the ``seconds`` after the first batch, epochs repeating with persistent workers."""
    from ..stream._dataset import FeedDataset
    from ..stream._loader import FeedLoader

    t0 = time.perf_counter()
    deadline = t0 + seconds
    first = last = None
    n = epoch = 0
    try:
        ds = FeedDataset(root, transform=decode, rank=0, world_size=1)
        loader = FeedLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=collate,
                            persistent_workers=workers > 0)
        try:
            while True:
                loader.set_epoch(epoch)
                for batch in loader:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        deadline = now + seconds
                    else:
                        n += _batch_len(batch)
                        last = now
                    if now >= deadline:
                        break
                else:
                    epoch += 1
                    if time.perf_counter() < deadline:
                        continue
                break
        finally:
            del loader
            gc.collect()
    except Exception as e:  # noqa: BLE001 - reported, the other worker counts still run
        return {"workers": workers, "error": f"{type(e).__name__}: {e}"}
    span = (last - first) if last is not None and first is not None else 0.0
    return {"workers": workers, "samples": n, "seconds": round(span, 6),
            "startup_s": round(first - t0, 6) if first is not None else None,
            "samples_per_s": _rate(n, span)}


def h2d_stage(bytes_per_batch: int, seconds: float) -> dict[str, Any] | None:
    """Host-to-device copy GB/s from pinned and from pageable memory (CUDA events, one buffer
    of ``bytes_per_batch`` copied repeatedly); ``None`` without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = max(1 << 20, min(int(bytes_per_batch), 256 << 20))
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes_per_copy": n, "device": torch.cuda.get_device_name()}
    for kind in ("pinned", "pageable"):
        src = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        dst.copy_(src, non_blocking=True)  # warm-up: first copy pays for lazy set-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copies, gpu_ms = 0, 0.0
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline or copies == 0:
            start.record()
            for _ in range(8):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()  # outside any training loop: the probe measures, it does not feed
            gpu_ms += start.elapsed_time(end)
            copies += 8
        out[f"{kind}_gb_per_s"] = copies * n / 1e9 / (gpu_ms / 1e3)
        del src
    del dst
    return out
