"""The ready image transform: :class:`ImagePipeline` (a sample dict in, ``(CHW tensor, label)``
out) and the :class:`ImageSpec` it shares with the DALI stage.

Every random draw for a sample comes from its own generator, seeded from the plan
(:mod:`feedpipe.transforms._seeding`), so a sample gets the same crop and flip whichever rank or
worker reads it, and after a resume.

The op classes (:class:`DecodeJPEG`, :class:`RandomResizedCrop`, ...) live in
:mod:`feedpipe.transforms._ops`, :class:`DecodeImage` (any format) in
:mod:`feedpipe.transforms._decode`; all are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import DecodeError, SampleSkipped
from ._decode import (
    IMAGE_FIELDS,
    DecodeImage,
    decode_image,
    image_field_of,
    image_format,
)
from ._geometry import Box, as_size, random_resized_crop_draw
from ._jpeg import decode_window, decode_window_into, jpeg_size
from ._ops import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Compose,
    DecodeJPEG,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
    normalize_tensor,
)
from ._resize import resize_to_tensor
from ._seeding import rng_of, sample_rng, scratch_rng, seed_of
from ._threads import one_thread

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_FIELDS",
    "Box",
    "CenterCrop",
    "Compose",
    "DecodeImage",
    "DecodeJPEG",
    "ImagePipeline",
    "ImageSpec",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToTensor",
    "parse_label",
    "rng_of",
    "sample_rng",
]


class NoLabelError(DecodeError):
    """A sample has no label field: a fault of how the dataset was made, not of one sample."""


def no_label(field: str, fields: Any, instead: str) -> str:
    """The message for a sample or batch without the label ``field`` (its fields ``fields``):
    a class-folder tree gets its ``cls`` field from ``feedpipe shard --labels-from-dirs``, and
    leaving such samples out would leave every one out."""
    have = sorted(k for k in fields if not k.startswith("__"))
    return (f"has no {field!r} field (it has {have}): a dataset sharded from class folders "
            f"gets its 'cls' labels from `feedpipe shard SRC OUT --labels-from-dirs`, so "
            f"re-shard it with that option; or name the label field (label_field=), or read "
            f"images without labels ({instead})")


def parse_label(value: Any) -> int:
    """A class label field (``b"3"``, ``"3"``, ``3``) as an int."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, memoryview):
        value = value.tobytes()
    return int(value)


@dataclass(frozen=True)
class ImageSpec:
    """What an image pipeline does, shared by the CPU :class:`ImagePipeline` and the DALI stage
    (:class:`~feedpipe.DaliStage`), so both take the same crops and flips for the same sample.

    Training: a random-resized crop to ``size`` and a left-right flip. Evaluation: the centred
    square of ``crop_fraction`` of the shorter side, resized to ``size`` (a resize to ``size /
    crop_fraction`` then a centre crop of ``size``, in one step).

    Args:
        size: output side (square).
        train: random-resized crop and flip; ``False``: centre crop.
        scale: the training crop's share of the image area, ``(lo, hi)``.
        ratio: the training crop's aspect ratio range, ``(lo, hi)``, drawn log-uniformly.
        flip: the probability of a left-right flip when training.
        crop_fraction: the evaluation crop's side as a fraction of the shorter side.
        mean: per-channel mean on the ``[0, 1]`` scale: normalised ``float32`` output.
            ``None``: ``uint8`` output (normalise on the device: a quarter of the bytes to
            move), and ``std`` is ignored.
        std: per-channel standard deviation on the ``[0, 1]`` scale.

    Example:
        >>> spec = ImageSpec(size=32, train=False)
        >>> spec.geometry(100, 80, None)
        (Box(top=15, left=5, height=70, width=70), False)
    """

    size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    crop_fraction: float = 0.875
    mean: tuple[float, ...] | None = IMAGENET_MEAN
    std: tuple[float, ...] | None = IMAGENET_STD

    def __post_init__(self) -> None:
        as_size(self.size)
        RandomResizedCrop(self.size, self.scale, self.ratio)  # validates scale and ratio
        RandomHorizontalFlip(self.flip)
        if not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], not {self.crop_fraction!r}")
        if self.mean is None:
            object.__setattr__(self, "std", None)  # uint8 output: nothing to divide by
        elif self.std is None:
            raise ValueError("normalising needs std as well as mean (mean=None: uint8 output)")
        else:
            Normalize(self.mean, self.std)

    def geometry(self, height: int, width: int,
                 rng: np.random.Generator | None) -> tuple[Box, bool]:
        """The crop window (in the ``height`` x ``width`` image) and whether to flip it.

        Draws, in order: the crop (torchvision's ``RandomResizedCrop`` rule), then one number
        for the flip (torchvision's ``RandomHorizontalFlip`` rule); nothing when not training.
        """
        if not self.train:
            side = max(1, int(round(min(height, width) * self.crop_fraction)))
            return Box((height - side) // 2, (width - side) // 2, side, side), False
        if rng is None:
            raise TypeError("a training ImageSpec needs the sample's rng (see sample_rng)")
        box, (u_flip,) = random_resized_crop_draw(height, width, rng, self.scale, self.ratio, 1)
        return box, bool(u_flip < self.flip)


class ImagePipeline:
    """Sample dict -> ``(image, label)``: decode, crop, flip, resize, normalise, in one pass.

    **Formats.** JPEG (RGB, grey, CMYK, YCCK), PNG (RGB, RGBA, palette, grey, 16-bit), WebP,
    AVIF and HEIC (where their decoder is installed: ``pip install 'feedpipe[images]'``), and what
    else OpenCV reads; the format is read from the bytes. The output is always three RGB
    channels: alpha dropped (not composited), grey replicated, 16-bit scaled to 8, EXIF
    orientation not applied (:func:`~feedpipe.image_decoders` names the decoder of each format).
    The image is the first of the ``image_field`` fields the sample has, in any case (a field
    ``JPEG``, from an ILSVRC tree's ``.JPEG`` files, is a ``jpeg`` image), so a dataset mixing
    ``.jpg`` and ``.png`` files needs no option.

    **JPEG.** The header gives the image size, and the crop is chosen there
    (:meth:`ImageSpec.geometry`). The JPEG is decoded at the smallest scale (1/8 to 1/2) that still
    leaves the crop at least ``size`` pixels; where the C extension is built, only the crop's rows
    and columns are. The crop is resized to ``size`` (antialiased bilinear, ``uint8``) and flipped
    in the same copy, then normalised straight into a contiguous CHW ``float32`` tensor (``uint8``
    CHW with ``mean=None``). The geometry is that of ``Compose([DecodeJPEG(),
    RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), Normalize()])`` with the same rng;
    pixels differ only where the reduced decode kicks in. Other formats are decoded whole, then
    cropped, resized and normalised the same way.

    **Bad samples.** A corrupt or truncated image, a sample with no image field, or a label that
    is not an integer raises :class:`~feedpipe.errors.DecodeError` naming the sample's key and
    shard (``on_error="raise"``, the default). With ``on_error="skip"`` the same message comes as
    :class:`~feedpipe.errors.SampleSkipped` (a ``DecodeError``): the loader logs it as a
    warning, counts it in ``stats()["skipped"]`` and leaves the sample out of its batch (as
    webdataset's ``handler=warn_and_continue``). A batch that loses every sample is left out
    whole (``stats()["left_out"]``), except with several ranks, where it is an error: the ranks
    must yield as many batches each. An epoch left with no batch at all is an
    :class:`~feedpipe.errors.EmptyEpochError`: it would train nothing. A missing optional
    decoder (HEIC without pillow-heif) is never skipped: it is a
    :class:`~feedpipe.errors.MissingDependencyError` with the pip line.

    Picklable (plain attributes): give it to ``FeedDataset(transform=...)`` and it runs in the
    workers. Randomness: a generator seeded from the sample's ``__seed__``, ``__epoch__`` and
    ``__index__``, so the same sample gets the same crop on any rank or worker.

    Args:
        size: output side (square).
        train: random-resized crop and flip; ``False``: centre crop.
        scale: the training crop's share of the image area (see :class:`ImageSpec`).
        ratio: the training crop's aspect ratio range.
        flip: the probability of a left-right flip when training.
        mean: per-channel mean on the ``[0, 1]`` scale; ``None``: ``uint8`` output.
        std: per-channel standard deviation on the ``[0, 1]`` scale.
        image_field: the field holding the image bytes, or a sequence of fields of which the
            first the sample has is used; each matches a field in any case where none
            matches exactly. Default: ``"jpg", "jpeg", "png", "webp", "avif", "heic", "heif"``,
            then torchvision ``ImageFolder``'s others: ``"bmp", "tif", "tiff", "ppm", "pgm"``.
        label_field: the field holding an integer label; ``None``: return the image only.
        on_error: ``"raise"`` (a :class:`~feedpipe.errors.DecodeError`) or ``"skip"`` (a
            :class:`~feedpipe.errors.SampleSkipped`, see above) for a bad sample.

    Example:
        >>> from feedpipe import FeedDataset
        >>> ds = FeedDataset("shards/example", transform=ImagePipeline(32))
        >>> image, label = next(iter(ds))
        >>> tuple(image.shape), image.dtype, label
        ((3, 32, 32), torch.float32, 0)
    """

    def __init__(
        self,
        size: int = 224,
        train: bool = True,
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        mean: Sequence[float] | None = IMAGENET_MEAN,
        std: Sequence[float] | None = IMAGENET_STD,
        image_field: str | Sequence[str] = IMAGE_FIELDS,
        label_field: str | None = "cls",
        on_error: str = "raise",
    ) -> None:
        spec = ImageSpec(size=size, train=train, scale=(scale[0], scale[1]),
                         ratio=(ratio[0], ratio[1]), flip=flip,
                         mean=None if mean is None else tuple(mean),
                         std=None if std is None else tuple(std))
        self._init(spec, image_field, label_field, on_error)

    @classmethod
    def from_spec(cls, spec: ImageSpec, *, image_field: str | Sequence[str] = IMAGE_FIELDS,
                  label_field: str | None = "cls", on_error: str = "raise") -> ImagePipeline:
        """An ImagePipeline doing exactly ``spec`` (e.g. a DALI stage's)."""
        self = cls.__new__(cls)
        self._init(spec, image_field, label_field, on_error)
        return self

    def _init(self, spec: ImageSpec, image_field: str | Sequence[str], label_field: str | None,
              on_error: str) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        fields = (image_field,) if isinstance(image_field, str) else tuple(image_field)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(f"image_field must be a field name or a sequence of them, not "
                             f"{image_field!r}")
        self.spec = spec
        self.image_field = fields
        self.label_field = label_field
        self.on_error = on_error
        self._norm = None if spec.std is None else Normalize(spec.mean or (), spec.std)

    def image(self, data: Any, rng: np.random.Generator | None) -> torch.Tensor:
        """The transformed CHW image of image bytes ``data`` (``rng`` needed when training)."""
        with one_thread():
            return self._image(data, rng)

    def _image(self, data: Any, rng: np.random.Generator | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        size = as_size(spec.size)
        if image_format(data) == "jpeg":
            h, w = jpeg_size(data)
            box, flip = spec.geometry(h, w, rng)
            # decode just large enough that the crop keeps >= size pixels on both axes
            min_h = min(math.ceil(h * size[0] / box.height) if box.height > size[0] else h, h)
            min_w = min(math.ceil(w * size[1] / box.width) if box.width > size[1] else w, w)
            # decode, resize, flip and the CHW write in one call of the C extension, into the
            # batch row when it can take uint8
            row = out if self._norm is None and out is not None and out.is_contiguous() \
                else torch.empty((3, *size), dtype=torch.uint8)
            if decode_window_into(data, h, w, box, row.numpy(), flip, min_height=min_h,
                                  min_width=min_w):
                if self._norm is not None:
                    return normalize_tensor(row, self._norm.mean_tensor, self._norm.std_tensor,
                                            out=out)
                return out.copy_(row) if out is not None and row is not out else row
            window = decode_window(data, h, w, box, min_height=min_h, min_width=min_w)
        else:
            whole = decode_image(data)
            box, flip = spec.geometry(whole.shape[0], whole.shape[1], rng)
            window = whole[box.top:box.top + box.height, box.left:box.left + box.width]
        if self._norm is None:
            if out is None:  # contiguous CHW, written plane by plane (see resize_to_tensor)
                out = torch.empty((window.shape[2], *size), dtype=torch.uint8)
            return resize_to_tensor(window, size, flip=flip, out=out)
        x = resize_to_tensor(window, size, flip=flip)
        return normalize_tensor(x, self._norm.mean_tensor, self._norm.std_tensor, out=out)

    def __call__(self, sample: Mapping[str, Any]) -> Any:
        """The sample's image decoded, cropped, resized and normalised as a CHW tensor of
        :attr:`out_shape` and :attr:`out_dtype`, with its label as ``(image, label)`` (the image
        alone without a ``label_field``)."""
        image, label = self._apply(sample, None)
        return image if self.label_field is None else (image, label)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        """The shape of an output image, ``(3, H, W)``."""
        return (3, *as_size(self.spec.size))

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of an output image, ``uint8`` without ``mean`` (else ``float32``)."""
        return torch.uint8 if self._norm is None else torch.float32

    def into(self, sample: Mapping[str, Any], out: torch.Tensor) -> int | None:
        """Like :meth:`__call__`, but the image is written into ``out``; returns the label
        (``None`` without a ``label_field``).

        ``out`` is a tensor of :attr:`out_shape` and :attr:`out_dtype`, e.g. a row of a batch
        buffer: no new tensor, so an allocation and a copy per sample are saved. The pixels are
        :meth:`__call__`'s. :class:`~feedpipe.FeedLoader` calls it when its ``collate_fn`` is a
        :class:`~feedpipe.BatchCollator`.

        Example:
            >>> from feedpipe import FeedDataset
            >>> p = ImagePipeline(32, mean=None)
            >>> sample = next(iter(FeedDataset("shards/example")))
            >>> row = torch.empty(p.out_shape, dtype=p.out_dtype)
            >>> label = p.into(sample, row)
            >>> bool(torch.equal(row, p(sample)[0])), label
            (True, 0)
        """
        if out.dtype != self.out_dtype or out.shape != self.out_shape:
            raise ValueError(f"out= must be a {self.out_dtype} tensor of shape {self.out_shape}, "
                             f"not {out.dtype} {tuple(out.shape)}")
        return self._apply(sample, out)[1]

    def _apply(self, sample: Mapping[str, Any],
               out: torch.Tensor | None) -> tuple[torch.Tensor, int | None]:
        """``sample``'s image (into ``out`` when given) and label (``None`` without a
        ``label_field``). A bad sample raises the DecodeError of ``on_error`` naming it before
        anything is written into ``out``: the label is read first, and the image is decoded
        whole or as a window before the resize writes into ``out``."""
        rng = scratch_rng(*seed_of(sample)) if self.spec.train else None
        try:
            field = image_field_of(sample, self.image_field)
            if field is None:
                raise DecodeError(f"has no {self._fields_text()} (it has "
                                  f"{sorted(k for k in sample if not k.startswith('__'))})")
            label = None
            if self.label_field is not None:
                if self.label_field not in sample:
                    raise NoLabelError(no_label(self.label_field, sample, "label_field=None"))
                try:
                    label = parse_label(sample[self.label_field])
                except ValueError as e:
                    raise DecodeError(f"its {self.label_field!r} field is not an integer "
                                      f"label: {e}") from e
            with one_thread():
                image = self._image(sample[field], rng, out)
        except ValueError as e:  # DecodeError included: add which sample it was
            message = f"sample {sample.get('__key__')!r} of {sample.get('__shard__')!r}: {e}"
            if self.on_error == "skip":
                raise SampleSkipped(message) from e
            if isinstance(e, NoLabelError):  # the dataset's, not one sample's: skip none
                raise DecodeError(message) from e
            raise DecodeError(f"{message} (ImagePipeline(on_error='skip') leaves such samples "
                              f"out of their batch)") from e
        return image, label

    def _fields_text(self) -> str:
        fields = self.image_field
        if len(fields) == 1:
            return f"{fields[0]!r} field"
        return "image field (looked for " + ", ".join(map(repr, fields)) + ")"

    def __repr__(self) -> str:
        return (f"ImagePipeline.from_spec({self.spec!r}, image_field={self.image_field!r}, "
                f"label_field={self.label_field!r}, on_error={self.on_error!r})")
