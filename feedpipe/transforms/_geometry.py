"""Crop geometry: sizes and crop windows in pixels, as pure functions of their arguments.

Random windows draw only ``rng.random()`` doubles, whose stream numpy keeps stable across
versions, so a seeded sample gets the same window on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

Size = tuple[int, int]


class Box(NamedTuple):
    """A crop window in pixels: rows ``top:top+height``, columns ``left:left+width``."""

    top: int
    left: int
    height: int
    width: int


def as_size(size: int | Sequence[int]) -> Size:
    """``224`` gives ``(224, 224)``; ``(h, w)`` stays; anything else is a ``ValueError``.

    Example:
        >>> as_size(224), as_size((160, 120))
        ((224, 224), (160, 120))
    """
    if isinstance(size, (int, np.integer)):
        h = w = int(size)
    else:
        if len(size) != 2:
            raise ValueError(f"size must be an int or (height, width), not {size!r}")
        h, w = (int(v) for v in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive, not {size!r}")
    return h, w


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Box:
    """The Inception-style random crop (torchvision's algorithm): a window of ``scale`` of the
    area and log-uniform aspect ``ratio``; after 10 misses, a centred crop with clamped ratio."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        u_area, u_ratio, u_top, u_left = rng.random(4)
        target = area * (scale[0] + u_area * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u_ratio * (log_hi - log_lo))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return Box(int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        h, w = height, width
    return Box((height - h) // 2, (width - w) // 2, h, w)


def center_box(height: int, width: int, crop: Size) -> Box:
    """A centred window of ``crop`` (clamped to the image)."""
    h, w = min(crop[0], height), min(crop[1], width)
    return Box((height - h) // 2, (width - w) // 2, h, w)


def shorter_side_size(height: int, width: int, shorter: int) -> Size:
    """The size with the shorter side ``shorter`` and the aspect ratio kept."""
    if height <= width:
        return shorter, max(1, int(round(width * shorter / height)))
    return max(1, int(round(height * shorter / width))), shorter


def scale_box(box: Box, sy: float, sx: float, height: int, width: int) -> Box:
    """``box`` in a copy of the image scaled by ``(sy, sx)`` (and ``height``x``width`` large)."""
    top, left = int(box.top * sy), int(box.left * sx)
    bottom = min(height, max(top + 1, int(round((box.top + box.height) * sy))))
    right = min(width, max(left + 1, int(round((box.left + box.width) * sx))))
    return Box(top, left, bottom - top, right - left)
