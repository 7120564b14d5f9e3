"""``BucketCrop``: an image resized to cover its aspect-ratio bucket's resolution and cropped to
it, the transform a :class:`~feedpipe.Bucketed` source applies by default.

A sample arrives with ``__bucket__``, its bucket's ``(width, height)`` (the source puts it
there). The image is decoded (:func:`~feedpipe.transforms._decode.decode_image`), the largest
window of the bucket's aspect ratio is taken (in the centre, or at a place drawn from the
sample's seed, epoch and id: the same on every resume), and that window is resized to the
bucket's resolution (:func:`~feedpipe.transforms._resize.resize_to_tensor`). The output also
gives the original size and the window's top-left corner, the two sizes SDXL's training
conditions on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..format._image_fields import IMAGE_FIELDS, image_field_of
from ._decode import decode_image
from ._geometry import Box
from ._resize import resize_to_tensor
from ._seeding import sample_rng, seed_of

CROPS = ("center", "random")


def bucket_window(height: int, width: int, bucket: tuple[int, int], crop: str,
                  sample: Mapping[str, Any]) -> Box:
    """The window of an image ``height`` x ``width`` with ``bucket``'s aspect ratio
    (``(width, height)``) that covers most of it: centred, or placed at random (``crop=
    "random"``, drawn from ``sample``'s seed, epoch and id).

    Example:
        >>> bucket_window(100, 300, (200, 100), "center", {})
        Box(top=0, left=50, height=100, width=200)
    """
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    h = min(height, max(1, round(bh / scale)))
    w = min(width, max(1, round(bw / scale)))
    if crop == "center":
        return Box((height - h) // 2, (width - w) // 2, h, w)
    rng = sample_rng(*seed_of(sample))
    return Box(int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w)


class BucketCrop:
    """Decode a sample's image, crop the window of its bucket's aspect ratio and resize it to
    the bucket's resolution (the sample's ``__bucket__``, ``(width, height)``).

    Args:
        crop: ``"center"`` or ``"random"`` (a window drawn from the sample's seed, epoch and
            id).
        image_field: the field(s) the image is looked for in, the first a sample has.
        label_field: a field copied to the output as an ``int`` (``None``: no label).

    Returns (for each sample) a dict: ``image``, a ``(3, height, width)`` ``uint8`` tensor;
    ``original_size``, the image's ``(height, width)``; ``crop_top_left``, the window's
    ``(top, left)`` (both ``int64`` tensors); and the label under ``label_field``'s name.

    Example:
        >>> import cv2, numpy as np
        >>> jpg = cv2.imencode(".jpg", np.zeros((60, 90, 3), np.uint8))[1].tobytes()
        >>> out = BucketCrop(label_field=None)({"jpg": jpg, "__bucket__": (64, 32)})
        >>> tuple(out["image"].shape), out["original_size"].tolist()
        ((3, 32, 64), [60, 90])
    """

    def __init__(self, crop: str = "center", *,
                 image_field: str | Sequence[str] = IMAGE_FIELDS,
                 label_field: str | None = "cls") -> None:
        if crop not in CROPS:
            raise ValueError(f"crop must be one of {CROPS}, not {crop!r}")
        self.crop = crop
        self.image_fields = (image_field,) if isinstance(image_field, str) else tuple(image_field)
        self.label_field = label_field

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        f = image_field_of(sample, self.image_fields)
        if f is None:
            raise KeyError(f"sample {sample.get('__key__')!r} has none of the image fields "
                           f"{self.image_fields}")
        bw, bh = (int(v) for v in sample["__bucket__"])
        img = decode_image(sample[f])
        height, width = img.shape[:2]
        box = bucket_window(height, width, (bw, bh), self.crop, sample)
        window = img[box.top:box.top + box.height, box.left:box.left + box.width]
        out: dict[str, Any] = {
            "image": resize_to_tensor(window, (bh, bw)),
            "original_size": torch.tensor([height, width]),
            "crop_top_left": torch.tensor([box.top, box.left])}
        if self.label_field is not None:
            value = sample.get(self.label_field)
            if value is None:
                raise KeyError(f"sample {sample.get('__key__')!r} has no {self.label_field!r} "
                               "field; give label_field=None for images without labels")
            out[self.label_field] = int(bytes(value)) if not isinstance(value, int) else value
        return out

    def __repr__(self) -> str:
        return (f"BucketCrop(crop={self.crop!r}, image_field={self.image_fields!r}, "
                f"label_field={self.label_field!r})")
