"""The picklable image op classes of the CPU pipeline, and the normalisation they share.

Every op is a callable ``op(x, rng=None)`` on HWC ``uint8`` numpy arrays or CHW tensors.
Deterministic ops ignore ``rng``. Random ops draw from the ``numpy.random.Generator`` they are
given (see :func:`feedpipe.transforms._seeding.sample_rng`) and refuse to run without one, so
no augmentation ever depends on hidden global state. The decoders, crop windows and resizes
they use live in :mod:`~feedpipe.transforms._jpeg`, :mod:`~feedpipe.transforms._geometry` and
:mod:`~feedpipe.transforms._resize`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ._geometry import (
    Box,
    Size,
    as_size,
    center_box,
    random_resized_crop_box,
    shorter_side_size,
)
from ._jpeg import decode_jpeg, jpeg_size
from ._resize import resize_hwc

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalize_tensor(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``(x / 255 - mean) / std`` for a ``uint8`` CHW tensor, ``(x - mean) / std`` for a float one;
    a new contiguous ``float32`` tensor, or ``out`` (a ``float32`` tensor of ``x``'s shape).
    ``mean``/``std`` are ``(C, 1, 1)`` float tensors."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != x.shape:
        raise ValueError(f"out= must be a float32 tensor of shape {tuple(x.shape)}, not "
                         f"{out.dtype} {tuple(out.shape)}")
    out.copy_(x)
    scale = 1.0 / std
    if x.dtype == torch.uint8:
        scale = scale / 255.0
    return out.mul_(scale).sub_(mean / std)


def _need_rng(rng: np.random.Generator | None, who: str) -> np.random.Generator:
    if rng is None:
        raise TypeError(
            f"{who} is random and needs rng=, a numpy Generator; "
            "feedpipe.transforms._pipeline.sample_rng(seed, epoch, index) gives the per-sample one"
        )
    return rng


# -- op classes (plain attributes only, so they pickle into workers) ---------------------------
class DecodeJPEG:
    """JPEG bytes -> HWC ``uint8`` RGB array.

    Args:
        min_size: decode at a reduced scale (1/2, 1/4, 1/8) while staying at least this large:
            an int bounds the shorter side, ``(h, w)`` each side. ``None``: full size.
        fastdct, fastupsample: libjpeg-turbo's faster, slightly less exact paths.

    Example:
        >>> import simplejpeg, numpy as np
        >>> jpg = simplejpeg.encode_jpeg(np.zeros((64, 48, 3), np.uint8))
        >>> DecodeJPEG()(jpg).shape, DecodeJPEG(min_size=20)(jpg).shape
        ((64, 48, 3), (32, 24, 3))
    """

    def __init__(self, min_size: int | Sequence[int] | None = None, *, fastdct: bool = False,
                 fastupsample: bool = False) -> None:
        self.min_size = None if min_size is None else (
            int(min_size) if isinstance(min_size, (int, np.integer)) else as_size(min_size))
        self.fastdct = fastdct
        self.fastupsample = fastupsample

    def __call__(self, data: Any, rng: np.random.Generator | None = None) -> np.ndarray:
        mh = mw = 0
        if isinstance(self.min_size, int):
            h, w = jpeg_size(data)
            mh, mw = shorter_side_size(h, w, self.min_size)
        elif self.min_size is not None:
            mh, mw = self.min_size
        return decode_jpeg(data, min_height=mh, min_width=mw, fastdct=self.fastdct,
                           fastupsample=self.fastupsample)

    def __repr__(self) -> str:
        return f"DecodeJPEG(min_size={self.min_size!r})"


class RandomResizedCrop:
    """A random window (``scale`` of the area, aspect in ``ratio``) resized to ``size``."""

    def __init__(self, size: int | Sequence[int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size = as_size(size)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, not {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, not {ratio!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def box(self, height: int, width: int, rng: np.random.Generator) -> Box:
        return random_resized_crop_box(height, width, rng, self.scale, self.ratio)

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        b = self.box(img.shape[0], img.shape[1], _need_rng(rng, "RandomResizedCrop"))
        return resize_hwc(img[b.top:b.top + b.height, b.left:b.left + b.width], self.size)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``. Always draws one number, whatever ``p``, so the
    draws of the ops after it do not depend on ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], not {p!r}")
        self.p = float(p)

    def draw(self, rng: np.random.Generator) -> bool:
        return bool(rng.random() < self.p)

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        if self.draw(_need_rng(rng, "RandomHorizontalFlip")):
            return np.ascontiguousarray(img[:, ::-1])
        return img

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class Resize:
    """Resize to ``size``: an int sets the shorter side (aspect kept), ``(h, w)`` is exact."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size: int | Size = int(size) if isinstance(size, (int, np.integer)) else as_size(size)
        if isinstance(self.size, int) and self.size < 1:
            raise ValueError(f"size must be positive, not {size!r}")

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        h, w = img.shape[:2]
        size = shorter_side_size(h, w, self.size) if isinstance(self.size, int) else self.size
        return resize_hwc(img, size)

    def __repr__(self) -> str:
        return f"Resize({self.size!r})"


class CenterCrop:
    """The centred ``size`` window (clamped to the image: no padding)."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = as_size(size)

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        b = center_box(img.shape[0], img.shape[1], self.size)
        return img[b.top:b.top + b.height, b.left:b.left + b.width]

    def __repr__(self) -> str:
        return f"CenterCrop({self.size})"


class ToTensor:
    """HWC ``uint8`` array -> contiguous CHW tensor: ``uint8`` as is, a float dtype scaled to
    ``[0, 1]`` (torchvision's convention)."""

    def __init__(self, dtype: torch.dtype = torch.uint8) -> None:
        self.dtype = dtype

    def __call__(self, img: np.ndarray | torch.Tensor,
                 rng: np.random.Generator | None = None) -> torch.Tensor:
        x = img if isinstance(img, torch.Tensor) else torch.from_numpy(img).permute(2, 0, 1)
        if self.dtype == torch.uint8:
            return x.contiguous()
        out = torch.empty(x.shape, dtype=self.dtype)
        out.copy_(x)
        return out.div_(255.0) if x.dtype == torch.uint8 else out

    def __repr__(self) -> str:
        return f"ToTensor(dtype={self.dtype})"


class Normalize:
    """CHW tensor -> ``float32`` ``(x - mean) / std`` per channel, with ``mean``/``std`` on the
    ``[0, 1]`` scale; a ``uint8`` input is read as ``x / 255`` first."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD) -> None:
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise ValueError(f"mean and std need one entry per channel, std > 0: {mean}, {std}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self._tensors()

    def _tensors(self) -> None:
        self.mean_tensor = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
        self.std_tensor = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor | np.ndarray,
                 rng: np.random.Generator | None = None) -> torch.Tensor:
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x).permute(2, 0, 1)
        return normalize_tensor(x, self.mean_tensor, self.std_tensor)

    def __getstate__(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.mean, self.std = state["mean"], state["std"]
        self._tensors()

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"


class Compose:
    """Apply ops in order, handing each the same ``rng`` (so their draws are one sequence).

    Example:
        >>> import numpy as np
        >>> ops = Compose([CenterCrop(4), RandomHorizontalFlip(), ToTensor()])
        >>> ops(np.zeros((8, 8, 3), np.uint8), np.random.default_rng(0)).shape
        torch.Size([3, 4, 4])
    """

    def __init__(self, ops: Sequence[Callable[..., Any]]) -> None:
        self.ops = list(ops)

    def __call__(self, x: Any, rng: np.random.Generator | None = None) -> Any:
        for op in self.ops:
            x = op(x, rng)
        return x

    def __repr__(self) -> str:
        return "Compose([" + ", ".join(map(repr, self.ops)) + "])"
