"""The optional DALI stage (``pip install 'feedpipe[dali]'``).

It decodes, crops, resizes and normalises feedpipe's own planned batches with NVIDIA DALI, on the
GPU or (``device_id=None``) the CPU. feedpipe stays in charge of *what* is read: the stage is fed
through ``fn.external_source`` with the batches of encoded bytes a :class:`~feedpipe.FeedLoader`
yields (plan order, resumption, caches unchanged). DALI only does the pixel work::

    FeedLoader batches of encoded images (JPEG, PNG, WebP)
      ──► host: crop window + flip per sample (ImageSpec, seeded as in the CPU ImagePipeline)
      ──► DALI: decoders.image_slice (nvJPEG "mixed" on GPU, ROI decode) ─► resize
                ─► crop_mirror_normalize
      ──► torch tensors

**Formats.** DALI's image decoder reads JPEG (grey and CMYK too), PNG (every mode, 16-bit
included) and WebP, and gives three RGB channels with the CPU pipeline's conventions
(:mod:`feedpipe.transforms._decode`): alpha dropped, EXIF orientation not applied
(``adjust_orientation=False``), 16-bit rounded to 8 bits (the CPU pipeline keeps the high byte:
one grey level apart at most). An animated PNG is decoded on the host with Pillow to its
default image, as on the CPU, and fed to DALI as a plain PNG: DALI's decoder gives the first
animation frame. It cannot read AVIF or HEIC: a batch holding one is refused on the
host with a :class:`~feedpipe.errors.DecodeError` naming the sample, before DALI sees it. Decode
those with the CPU :class:`~feedpipe.ImagePipeline`, or convert them. As on the CPU, a sample's
image is the first of the stage's ``image_field`` fields it has, so batches mixing ``jpg`` and
``png`` samples work.

The crop windows are computed on the host from the image header with the same
:meth:`ImageSpec.geometry` and :func:`~feedpipe.transforms._seeding.sample_rng` as the CPU
pipeline. So a sample gets the same crop and flip on either path, in any worker or rank, and
after a resume.
DALI's own random operators are not used: their draws follow DALI's batch order, not the plan.

Output: on the GPU, DALI's buffers are copied into torch tensors with ``feed_ndarray`` on torch's
current stream (a device-to-device copy ordered before the consumer's kernels, no host sync, no
host round trip). The copy is needed: DALI recycles its output buffers at the next ``run()``. With
``device_id=None`` everything is on the CPU and the tensors are CPU tensors.

DALI is imported when the stage first builds its pipeline, never at ``import feedpipe``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .._helpers.dependency import require
from .._helpers.fork_safety import mark_process_fork_unsafe
from .._redact import logger
from ..errors import DecodeError
from ..format._image_fields import fields_present
from ._dali_host import (
    BUILT,
    DALI_FAILED,
    Fed,
    HeaderSkipped,
    default_image_png,
    drop_row,
    host_bytes,
    int_column,
    keep_pipelines_in_forked_children,
)
from ._decode import IMAGE_FIELDS, animated_png, image_format, image_size
from ._pipeline import ImageSpec, no_label, parse_label
from ._seeding import scratch_rng

log = logger("feedpipe")
_DALI_FORMATS = ("jpeg", "png", "webp")  # what fn.decoders.image_slice reads of ours


class DaliBatch(NamedTuple):
    """One batch out of the DALI stage."""

    images: torch.Tensor
    """``(B, 3, size, size)``: ``float32`` normalised, or ``uint8`` with ``spec.mean=None``; on
    ``cuda:<device_id>``, or the CPU with ``device_id=None``."""
    labels: torch.Tensor
    """``(B,)`` ``int64``, on the same device as ``images``."""
    indices: torch.Tensor
    """``(B,)`` ``int64`` global sample ids (``__index__``) on the CPU; ``-1`` where unknown."""


class DaliStage:
    """Iterate :class:`DaliBatch` es made by DALI from an iterable of encoded batches.

    Args:
        batches: an iterable of batches, each a dict with a list of encoded images (JPEG, PNG
            or WebP bytes) under ``image_field``, labels under ``label_field`` and optionally
            ``__index__``, ``__seed__``, ``__epoch__`` (what :class:`~feedpipe.FeedLoader`
            yields), or an ``(images, labels)`` pair. Iterated once per pass over the stage.
        batch_size: the largest batch (default: ``batches.batch_size``).
        spec: what to do to each image (an :class:`~feedpipe.ImageSpec`).
        device_id: the CUDA device (nvJPEG "mixed" decoding); ``None``: DALI on the CPU only.
        num_threads: DALI's CPU threads.
        prefetch: batches DALI works ahead (its ``prefetch_queue_depth``).
        image_field: the batch field holding the images, or a sequence of fields of which each
            sample's first non-``None`` one is used, each matching a field in any case (default:
            ``"jpg", "jpeg", "png", "webp", "avif", "heic", "heif"``, then ``"bmp", "tif",
            "tiff", "ppm", "pgm"``).
        label_field: the batch field holding the labels.
        on_error: what to do with an image DALI cannot decode (corrupt or truncated):
            ``"raise"`` a :class:`~feedpipe.errors.DecodeError` naming the sample (its key and
            shard), or ``"skip"``: leave it out of its batch with a warning naming it, counted
            in :attr:`skipped` (as ``ImagePipeline(on_error="skip")``). DALI stops its
            pipeline on such an image; the stage builds a new one and feeds it again the
            batches DALI held, the failed one without that sample (a batch left with none is
            left out whole).

    ``state_dict()`` / ``load_state_dict()`` pass through to ``batches`` (a FeedLoader), but
    report the position after the last batch *this stage handed out*, not after the ones DALI
    prefetched, so a checkpoint resumes exactly.

    Example:
        >>> from feedpipe import FeedDataset, FeedLoader
        >>> loader = FeedLoader(FeedDataset("shards/example"), batch_size=8)
        >>> stage = DaliStage(loader, spec=ImageSpec(size=32, train=False), device_id=None)
        >>> b = next(iter(stage))                                  # doctest: +SKIP
        >>> tuple(b.images.shape), b.labels.tolist()[:3]           # doctest: +SKIP
        ((8, 3, 32, 32), [0, 0, 0])
    """

    def __init__(
        self,
        batches: Iterable[Any],
        *,
        batch_size: int | None = None,
        spec: ImageSpec | None = None,
        device_id: int | None = 0,
        num_threads: int = 2,
        prefetch: int = 2,
        image_field: str | Sequence[str] = IMAGE_FIELDS,
        label_field: str = "cls",
        on_error: str = "raise",
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        if batch_size is None:
            batch_size = getattr(batches, "batch_size", None)
            if batch_size is None:
                raise TypeError("DaliStage needs batch_size= (the iterable has no .batch_size)")
        if batch_size < 1 or num_threads < 1 or prefetch < 1:
            raise ValueError("batch_size, num_threads and prefetch must be at least 1")
        self.batches = batches
        mark = getattr(batches, "mark_fork_unsafe", None)
        if callable(mark):  # a FeedLoader: it refuses to fork workers beside DALI's threads
            mark("DALI's threads (a DaliStage fed by this loader)")
        self.batch_size = int(batch_size)
        self.spec = spec if spec is not None else ImageSpec()
        self.device_id = device_id
        self.num_threads = num_threads
        self.prefetch = prefetch
        self.image_field = (image_field,) if isinstance(image_field, str) else tuple(image_field)
        if not self.image_field:
            raise ValueError("image_field must name at least one field")
        self.label_field = label_field
        self.on_error = on_error
        self.skipped = 0
        """Samples left out (``on_error="skip"``) since the stage was made."""
        self._pipe: Any = None
        self._it: Iterator[Any] | None = None
        self._fed: deque[Fed] = deque()  # fed to DALI, not yet handed out
        self._replay: deque[Fed] = deque()  # to feed a new pipeline before the loader's next
        self._state: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        """The device the stage's batches are on, ``cuda:<device_id>`` (or ``cpu`` without a
        ``device_id``)."""
        if self.device_id is None:
            return torch.device("cpu")
        return torch.device("cuda", self.device_id)

    # -- the host side: what DALI is fed --------------------------------------------------
    def _split(self, batch: Any) -> tuple[list[Any], list[Any], Any]:
        if not isinstance(batch, dict):
            images, labels = batch
            return list(images), list(labels), None
        fields = fields_present(batch, self.image_field)
        if self.label_field not in batch:
            raise DecodeError("a batch fed to the DALI stage "
                              + no_label(self.label_field, batch,
                                         "on the CPU: ImagePipeline(label_field=None)"))
        if not fields:
            raise DecodeError(f"a batch fed to the DALI stage has none of the image fields "
                              f"{list(self.image_field)} (it has {sorted(batch)})")
        labels = list(batch[self.label_field])
        columns = [batch[f] for f in fields]
        images = []
        for i in range(len(labels)):
            image = next((c[i] for c in columns if c[i] is not None), None)
            if image is None:
                key = batch.get("__key__", [None] * len(labels))[i]
                raise DecodeError(f"sample {key!r} in a batch fed to the DALI stage has none of "
                                  f"the image fields {list(self.image_field)}")
            images.append(image)
        return images, labels, batch

    def encode_batch(self, batch: Any) -> tuple[Any, ...]:
        """The arrays one batch feeds to DALI: encoded images, crop anchors ``(x, y)``, crop
        shapes ``(w, h)``, mirror flags, labels, sample ids. Pure host work, no DALI needed."""
        jpegs, labels, meta = self._split(batch)
        n = len(jpegs)
        if not 0 < n <= self.batch_size:
            raise ValueError(f"a batch of {n} samples for a DaliStage of batch_size "
                             f"{self.batch_size}")
        index = int_column(meta, "__index__", n, -1)
        seed = int_column(meta, "__seed__", n, 0)
        epoch = int_column(meta, "__epoch__", n, 0)
        spec = self.spec
        data = [np.frombuffer(j, dtype=np.uint8) for j in jpegs]
        anchors = np.empty((n, 2), dtype=np.int32)
        shapes = np.empty((n, 2), dtype=np.int32)
        mirror = np.zeros(n, dtype=np.int32)
        for i, j in enumerate(jpegs):
            try:
                fmt = image_format(j)
                if fmt not in _DALI_FORMATS:
                    raise DecodeError(
                        "DALI's image decoder reads JPEG, PNG and WebP, not this "
                        + (f"{fmt.upper()} image" if fmt != "unknown" else
                           f"data (it starts with {bytes(j[:8])!r})")
                        + "; decode such images on the CPU with feedpipe.ImagePipeline, or "
                        "convert them to one of those formats")
                h, w = image_size(j)
                if fmt == "png" and animated_png(j):
                    data[i] = default_image_png(j)
            except DecodeError as e:
                key = meta.get("__key__", [None] * n)[i] if meta is not None else None
                shard = meta.get("__shard__", [None] * n)[i] if meta is not None else None
                where = f" of {shard!r}" if shard is not None else ""
                message = (f"sample {key!r}{where} (id {index[i]}) in a batch fed to the DALI "
                           f"stage (which crops from image headers): {e}")
                if self.on_error == "skip" and fmt in _DALI_FORMATS:
                    raise HeaderSkipped(i, message) from e
                raise DecodeError(message) from e
            rng = scratch_rng(seed[i], epoch[i], index[i]) if spec.train else None
            box, flip = spec.geometry(h, w, rng)
            anchors[i] = box.left, box.top
            shapes[i] = box.width, box.height
            mirror[i] = flip
        try:
            label = np.array([parse_label(v) for v in labels], dtype=np.int64)
        except ValueError as e:
            raise DecodeError(f"a label in a batch fed to the DALI stage is not an integer: "
                              f"{e}") from e
        return data, anchors, shapes, mirror, label, index

    def _source(self) -> tuple[Any, ...]:
        fed = self._replay.popleft() if self._replay else None
        while fed is None:
            if self._it is None:
                raise StopIteration
            batch = next(self._it)  # StopIteration ends DALI's epoch
            state = getattr(self.batches, "state_dict", None)
            fed = self._encode(batch, state() if state is not None else None)
        self._fed.append(fed)
        return fed.arrays

    def _encode(self, batch: Any, state: dict[str, Any] | None) -> Fed | None:
        """``batch`` as fed to DALI; with ``on_error="skip"``, without the samples whose image
        header does not read (``None``, and its place passed, when that is every one)."""
        meta = dict(batch) if isinstance(batch, dict) else None
        while True:
            try:
                arrays = self.encode_batch(meta if meta is not None else batch)
                break
            except HeaderSkipped as e:
                self.skipped += 1
                log.warning("feedpipe: a sample was left out of its batch: %s", e.message)
                if meta is None:
                    images, labels = batch
                    batch = ([*images[:e.i], *images[e.i + 1:]], [*labels[:e.i],
                                                                    *labels[e.i + 1:]])
                    left = len(batch[0])
                else:
                    meta = {k: drop_row(v, e.i) for k, v in meta.items()}
                    left = len(meta[self.label_field])
                if not left:  # (DALI may still hold earlier batches: the state stays theirs)
                    return None
        n = len(arrays[0])
        keys = list((meta or {}).get("__key__") or [None] * n)
        shards = list((meta or {}).get("__shard__") or [None] * n)
        return Fed(state, arrays, keys, shards)

    def _failed(self, e: RuntimeError) -> None:
        """DALI failed on the oldest batch it was fed (it names the sample, or not): find the
        sample, decoding the batch's images on the host where DALI did not say. A JPEG with
        stray bytes before a marker or ICC segments libjpeg cannot assemble (which the CPU
        pipeline decodes as libjpeg and Pillow do) is fed again repaired, once. Otherwise raise
        a DecodeError naming the sample, or (``on_error="skip"``) leave it out and make ready
        to feed a new pipeline the batches the old one held."""
        self._pipe = None  # DALI's pipeline is no longer valid after an error
        if not self._fed:
            raise e
        fed = self._fed[0]
        m = DALI_FAILED.search(str(e))
        named = int(m.group(1)) if m and int(m.group(1)) < len(fed.keys) else None
        dali_says = (m.group(0) if m else str(e).strip().splitlines()[-1]).strip(" :")
        fixed: dict[int, bytes] = {}
        found: tuple[int, str] | None = None
        for j in ([named] if named is not None else range(len(fed.keys))):
            try:
                better = host_bytes(fed.arrays[0][j])
            except DecodeError as bad:
                found = (j, str(bad))
                break
            if better is not None:
                fixed[j] = better
        if fixed and not fed.retried:  # fed again, the JPEGs without their stray bytes
            data = [np.frombuffer(fixed[j], np.uint8) if j in fixed else d
                    for j, d in enumerate(fed.arrays[0])]
            again = fed._replace(arrays=(data, *fed.arrays[1:]), retried=True)
            self._fed.popleft()
            self._replay = deque([again, *self._fed, *self._replay])
            self._fed.clear()
            return
        if found is None:
            if named is None:
                self._fed.clear()
                self._replay.clear()
                raise DecodeError(f"DALI failed on a batch of the samples {fed.keys} (of "
                                  f"{sorted(set(map(str, fed.shards)))}), each of which "
                                  f"decodes on the CPU: {dali_says}") from e
            found = (named, dali_says)
        i, why = found
        fed = self._fed.popleft()
        where = f" of {fed.shards[i]!r}" if fed.shards[i] is not None else ""
        name = (f"sample {fed.keys[i]!r}{where} (#{i} of its batch)"
                if fed.keys[i] is not None else f"sample #{i} of a batch")
        what = f"{name}: DALI cannot decode its image ({why})"
        if self.on_error == "raise":
            self._fed.clear()
            self._replay.clear()
            raise DecodeError(f"{what}; DaliStage(on_error='skip') leaves such samples out of "
                              "their batch") from e
        self.skipped += 1
        log.warning("feedpipe: a sample was left out of its batch: %s", what)
        rest = fed.without(i)
        first = [rest] if rest.keys else []
        if not rest.keys:  # nothing left of it: left out whole, its place in the plan passed
            self._state = fed.state
            log.warning("feedpipe: a batch fed to the DALI stage was left out whole (DALI "
                        "could decode none of its samples)")
        self._replay = deque([*first, *self._fed, *self._replay])
        self._fed.clear()

    # -- the DALI side -------------------------------------------------------------------
    def _build(self) -> Any:
        dali = require("nvidia.dali", purpose="the DALI stage (feedpipe.DaliStage)")
        from nvidia.dali import fn, types

        spec = self.spec
        gpu = self.device_id is not None
        keep_pipelines_in_forked_children()
        # from here DALI's threads run in this process, until its pipelines are gone: no loader
        # of it may fork workers meanwhile
        mark_process_fork_unsafe("DALI's threads (a DaliStage runs in this process)",
                                 lambda: len(BUILT) > 0)
        pipe = dali.Pipeline(batch_size=self.batch_size, num_threads=self.num_threads,
                             device_id=self.device_id, prefetch_queue_depth=self.prefetch)
        BUILT.add(pipe)
        with pipe:
            dt = types.DALIDataType
            jpegs, anchor, shape, mirror, labels, index = fn.external_source(
                source=self._source, num_outputs=6, batch=True,
                dtype=[dt.UINT8, dt.INT32, dt.INT32, dt.INT32, dt.INT64, dt.INT64])
            images: Any = fn.decoders.image_slice(jpegs, anchor, shape, axis_names="WH",
                                                  device="mixed" if gpu else "cpu",
                                                  output_type=types.DALIImageType.RGB,
                                                  adjust_orientation=False)
            images = fn.resize(images, size=[spec.size, spec.size], antialias=True)
            if spec.mean is None:
                images = fn.crop_mirror_normalize(images, mirror=mirror, dtype=dt.UINT8,
                                                  output_layout="CHW")
            else:
                images = fn.crop_mirror_normalize(
                    images, mirror=mirror, dtype=dt.FLOAT, output_layout="CHW",
                    mean=[255.0 * m for m in spec.mean],
                    std=[255.0 * s for s in spec.std])  # type: ignore[union-attr]
            if gpu:
                labels = labels.gpu()
            pipe.set_outputs(images, labels, index)
        pipe.build()
        return pipe

    def _to_torch(self, out: Any, device: torch.device) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        t = out.as_tensor()
        arr = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=device)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        # enqueued on torch's stream after DALI's work: ordered before the consumer's kernels
        feed_ndarray(t, arr, cuda_stream=stream)
        return arr

    def __iter__(self) -> Iterator[DaliBatch]:
        self._fed.clear()
        self._replay.clear()
        state = getattr(self.batches, "state_dict", None)
        self._state = state() if state is not None else None
        self._it = iter(self.batches)
        done = False
        pipe = None
        try:
            while True:
                if self._pipe is None:
                    self._pipe = self._build()
                pipe = self._pipe
                try:
                    images, labels, index = pipe.run()
                except StopIteration:
                    break
                except RuntimeError as e:
                    self._failed(e)  # raises, or leaves the sample out: a new pipeline
                    continue
                out = DaliBatch(self._to_torch(images, self.device),
                                self._to_torch(labels, self.device),
                                self._to_torch(index, torch.device("cpu")))
                self._state = self._fed.popleft().state
                yield out
            done = True
        finally:
            self._it = None
            if done and pipe is not None:
                pipe.reset()
            else:
                # left early (break, error): DALI still holds prefetched batches of this pass;
                # a new pipeline is simpler and safer than draining them
                self._pipe = None

    # -- the loader protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next pass on (the wrapped loader's ``set_epoch``)."""
        self.batches.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state after the last batch this stage handed out."""
        if self._state is not None:
            return self._state
        return self.batches.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the wrapped loader resumes there, and DALI's
        pipeline starts afresh (what it had prefetched was never handed out)."""
        self.batches.load_state_dict(state_dict)  # type: ignore[attr-defined]
        self._state = None
        self._pipe = None
