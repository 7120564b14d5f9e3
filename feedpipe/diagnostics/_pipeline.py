"""The pipeline half of ``feedpipe probe``: each stage's samples/s, measured alone.

The stages, in the order a sample meets them:

- **read**: :class:`ShardReader` slices a sample out of its shard and copies its fields, as a
  worker does before handing it over;
- **decode**: the ``decode`` callable (by default every image field, decoded as ImagePipeline
  decodes it), on one core;
- **batch**: :func:`collate_samples` on decoded samples, stacking tensors. Images (of different
  sizes, or held in different fields: ``jpg`` in some samples, ``png`` in others) are copied
  into slots of one shape, as a resize transform would give them, also where the samples read
  show one size: the data further on may hold others;
- **host-to-device**: pinned and pageable copies (CUDA only);
- the whole :class:`FeedLoader` at several ``num_workers`` (scaling).

Each stage loops until its own deadline and always completes at least one unit of work. Worker
processes are started (fork) before anything touches CUDA; the host-to-device stage runs last.
"""

from __future__ import annotations

import gc
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..format._image_fields import IMAGE_EXTENSIONS, image_extension
from ..format._manifest import Manifest, join
from ..format._reader import ShardReader

# an image field's extension -> its format (the names image_decoders() answers for)
IMAGE_FORMATS = IMAGE_EXTENSIONS
Decode = Callable[[dict[str, Any]], Any]


def _ext(field: str) -> str:
    return field.lower().rsplit(".", 1)[-1]


def image_fields(fields: Sequence[str]) -> list[str]:
    """The image fields among ``fields``, in the order ImagePipeline looks for a sample's image
    (:data:`~feedpipe.format._image_fields.IMAGE_FIELDS`, in any case; a compound name such as
    ``left.png`` by its last extension)."""
    order = list(IMAGE_FORMATS)
    found = {f for f in fields if image_extension(f) is not None}
    return sorted(found, key=lambda f: (order.index(_ext(f)), f))


def jpeg_fields(fields: Sequence[str]) -> list[str]:
    return [f for f in image_fields(fields) if image_extension(f) == "jpeg"]


class ImageDecode:
    """The default decoder: every image field of a sample becomes an ``HxWx3`` uint8 RGB array,
    decoded as ImagePipeline decodes it (:func:`~feedpipe.transforms._decode.decode_image`: JPEG
    with simplejpeg, PNG and WebP with OpenCV); other fields pass through. An image field of a
    format that no library here decodes (AVIF, HEIC without the ``images`` extra) is left as
    bytes and named in ``skipped``. Picklable, so worker processes can use it."""

    def __init__(self, fields: Sequence[str]) -> None:
        from ..transforms._decode import image_decoders

        have = image_decoders()
        found = image_fields(fields)
        self.fields = [f for f in found if have.get(IMAGE_FORMATS[_ext(f)])]
        self.skipped = [f for f in found if f not in self.fields]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from ..transforms._decode import decode_image

        out = dict(sample)
        for f in self.fields:
            v = out.get(f)
            if v is not None:
                out[f] = decode_image(v)
        return out

    def __repr__(self) -> str:
        return f"ImageDecode({self.fields!r})"


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


def _is_image(v: Any) -> bool:
    import numpy as np

    return isinstance(v, np.ndarray) and v.ndim in (2, 3) and v.dtype == np.uint8


class SlotCollate:
    """Batches of decoded images as one ``uint8`` tensor per slot, whatever their sizes and
    whichever image field a sample holds.

    ``slots`` maps a batch field to ``(fields, shape)``: each sample's image is the first of
    ``fields`` it holds (as ImagePipeline takes a sample's image), copied into a slot of
    ``shape``, centre-cropped where larger and zero-padded where smaller (the fixed shape a
    resize transform gives a training pipeline's images); a sample with none of them decoded
    leaves its row zero. The other fields are collated as
    :func:`~feedpipe.stream._collate.collate_samples` does. Picklable, so it runs in workers."""

    def __init__(self, slots: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]) -> None:
        self.slots = slots

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        import numpy as np
        import torch

        from ..stream._collate import collate_samples

        taken = {f for fields, _ in self.slots.values() for f in fields}
        out = collate_samples([{k: v for k, v in s.items() if k not in taken} for s in samples])
        for name, (fields, shape) in self.slots.items():
            dst = np.zeros((len(samples), *shape), dtype=np.uint8)
            batch = torch.from_numpy(dst)
            for i, s in enumerate(samples):
                v = next((s[f] for f in fields if _is_image(s.get(f))), None)
                if v is None:
                    continue
                a = np.asarray(v)
                if a.ndim == len(shape) - 1:
                    a = a[..., None]  # greyscale into a colour slot
                h, w = min(a.shape[0], shape[0]), min(a.shape[1], shape[1])
                y, x = (a.shape[0] - h) // 2, (a.shape[1] - w) // 2
                dst[i, :h, :w] = a[y : y + h, x : x + w]
            out[name] = batch
        return out


def _image_slot(decoded: Sequence[Any]
                ) -> tuple[dict[str, tuple[tuple[str, ...], tuple[int, ...]]], list[str]]:
    """The slot the decoded images of dict samples go into, and what the batch stage's note
    says about it. A slot also where the images read all have one shape: they are the first of
    the data only (over a slow link a handful), and the loader stage goes on to images of other
    sizes, which stacking them as they are would refuse.

    The slot's shape: the median height and width, the most channels. Its field: the image
    field's name, or ``image`` where samples hold their image in different fields (a tree
    mixing ``.jpg`` and ``.png``)."""
    dicts = [s for s in decoded if isinstance(s, dict)]
    if not dicts or len(dicts) < len(decoded):
        return {}, []
    names = image_fields([k for k in dict.fromkeys(k for s in dicts for k in s)
                          if any(_is_image(s.get(k)) for s in dicts)])
    if not names:
        return {}, []
    images = [next((s[f] for f in names if _is_image(s.get(f))), None) for s in dicts]
    arrays = [a for a in images if a is not None]
    shapes = {a.shape for a in arrays}
    shape = _slot_shape(arrays)
    name, notes = _slot_notes(names, dicts, arrays, len(shapes) > 1, shape)
    return {name: (tuple(names), shape)}, notes


def _slot_shape(arrays: list[Any]) -> tuple[int, ...]:
    """The median height and width of ``arrays``, the most channels (none for greyscale)."""
    import numpy as np

    h = int(np.median([a.shape[0] for a in arrays]))
    w = int(np.median([a.shape[1] for a in arrays]))
    c = max((a.shape[2] if a.ndim == 3 else 1) for a in arrays)
    return (h, w, c) if c > 1 or any(a.ndim == 3 for a in arrays) else (h, w)


def _slot_notes(names: list[str], dicts: list[dict[str, Any]], arrays: list[Any],
                sizes_differ: bool, shape: tuple[int, ...]) -> tuple[str, list[str]]:
    """The slot's field, and what the batch stage's note says about it."""
    name = names[0]
    notes = []
    if len(names) > 1:
        name = "image" if all("image" not in s for s in dicts) else "__image__"
        notes.append(f"samples hold their image in different fields ({', '.join(names)}): "
                     f"batches stack each sample's first of them, as ImagePipeline takes it, "
                     f"in one tensor named {name!r}")
    if sizes_differ:
        notes.append(f"decoded images differ in size: batches stack them as uint8 tensors of "
                     f"one shape ({name} {'x'.join(map(str, shape))}: the median size, "
                     "centre-cropped or zero-padded), as a resize transform would")
    if len(arrays) < len(dicts):
        notes.append(f"{len(dicts) - len(arrays)} of {len(dicts)} samples read hold no decoded "
                     "image: their rows of the image tensor stay zero")
    return name, notes


def _unstacked(samples: Sequence[Any], batch: Any) -> list[str]:
    """Fields holding arrays or tensors in some of ``samples`` that ``batch`` did not make one
    tensor of."""
    import numpy as np
    import torch

    if not isinstance(batch, dict):
        return []
    arrays = {k for s in samples if isinstance(s, dict) for k, v in s.items()
              if isinstance(v, (np.ndarray, torch.Tensor))}
    return sorted(k for k in arrays if not isinstance(batch.get(k), torch.Tensor))


def choose_collate(decoded: Sequence[Any],
                   batch_size: int) -> tuple[Callable[[list[Any]], Any], str]:
    """How the batch stage batches ``decoded`` samples, and a note saying what it does not
    plainly stack. :func:`collate_samples` when it stacks them as they are; a
    :class:`SlotCollate` when samples hold decoded images (see :func:`_image_slot`);
    :func:`list_collate` when nothing can stack them. Arrays that still stay out of a tensor
    are named in the note: the batch figure leaves out their copy."""
    from ..stream._collate import collate_samples

    first = list(decoded[: max(2, batch_size)])
    slots, notes = _image_slot(decoded)
    collate: Callable[[list[Any]], Any] = SlotCollate(slots) if slots else collate_samples
    try:
        batch = collate(first)
    except Exception as e:  # noqa: BLE001 - any refusal means "cannot stack these as they are"
        return list_collate, (f"decoded samples cannot be stacked ({type(e).__name__}); batches "
                              "are lists, so the batch figure leaves out the copy into tensors")
    taken = {f for fields, _ in slots.values() for f in fields}  # the slots stacked these
    left = [f for f in _unstacked(first, batch) if f not in taken]
    if left:
        notes.append(f"decoded {', '.join(left)} not stacked into tensors (missing in some "
                     "samples or of another type): batches hold them as lists, so the batch "
                     "figure leaves out their copy into tensors")
    return collate, "; ".join(notes)


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
    t0 = time.perf_counter()
    deadline = t0 + seconds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        result = _loader_rate(root, decode, collate, batch_size, workers, seconds, t0, deadline)
    for w in caught:  # passed on, but torch's worker-count warning once per process: it comes
        # from two places of one DataLoader and again for each count the probe measures, and
        # the user asked for those workers
        if _WORKER_WARNING.match(str(w.message)):
            if _said:
                continue
            _said.append(True)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


_WORKER_WARNING = re.compile(r"This DataLoader will create \d+ worker processes")
_said: list[bool] = []  # torch's worker-count warning was passed on in this process


def _loader_rate(root: str, decode: Decode | None, collate: Callable[[list[Any]], Any],
                 batch_size: int, workers: int, seconds: float, t0: float,
                 deadline: float) -> dict[str, Any]:
    from ..stream._dataset import FeedDataset
    from ..stream._loader import FeedLoader

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
