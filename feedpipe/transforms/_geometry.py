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
    return random_resized_crop_draw(height, width, rng, scale, ratio, 0)[0]


def random_resized_crop_draw(height: int, width: int, rng: np.random.Generator,
                             scale: tuple[float, float], ratio: tuple[float, float],
                             after: int) -> tuple[Box, list[float]]:
    """:func:`random_resized_crop_box`, and the ``after`` numbers ``rng`` draws next (a flip's).

    The window and the numbers are those of drawing the window, then ``rng.random(after)``:
    ``rng.random(n)`` gives the next ``n`` numbers of the one stream, so the first try's four
    numbers and the ``after`` are drawn in one call, and a try that misses hands its surplus on
    to the next. The numbers come as Python floats: the same doubles, cheaper arithmetic."""
    area = height * width
    lo, span = scale[0], scale[1] - scale[0]
    log_lo = math.log(ratio[0])
    log_span = math.log(ratio[1]) - log_lo
    drawn = rng.random(4 + after).tolist()
    at = 0
    for _ in range(10):
        if at + 4 > len(drawn):  # a miss: this try's numbers start with the surplus
            drawn = drawn[at:] + rng.random(at + 4 - len(drawn)).tolist()
            at = 0
        u_area, u_ratio, u_top, u_left = drawn[at:at + 4]
        at += 4
        target = area * (lo + u_area * span)
        aspect = math.exp(log_lo + u_ratio * log_span)
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            box = Box(int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w)
            break
    else:
        in_ratio = width / height
        if in_ratio < ratio[0]:
            w, h = width, int(round(width / ratio[0]))
        elif in_ratio > ratio[1]:
            h, w = height, int(round(height * ratio[1]))
        else:
            h, w = height, width
        box = Box((height - h) // 2, (width - w) // 2, h, w)
    rest = drawn[at:]
    if len(rest) < after:
        rest += rng.random(after - len(rest)).tolist()
    return box, rest


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
