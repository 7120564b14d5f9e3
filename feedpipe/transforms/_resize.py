"""Resizing HWC ``uint8`` images, into CHW tensors or HWC arrays.

An RGB image into a CHW tensor is one call of the C extension ``feedpipe._native._jpegcrop``
(``resize_into``): an enlargement (the usual case for a random-resized crop of a small image)
with OpenCV's fixed-point bilinear, a reduction with torch's antialiased bilinear (the filter
class of torchvision's and DALI's random-resized crops: its pixels exactly), the flip and the
CHW write in the same pass. Without the extension, or for other channel counts, an enlargement
goes through OpenCV's ``cv2.resize`` (bilinear, fixed-point SIMD) and ``cv2.split`` straight into
CHW planes, within one grey level of torch's path (``benchmarks/bench_resize.py``), and a
reduction keeps ``torch.nn.functional.interpolate`` on ``uint8`` channels-last tensors with
``antialias=True`` (OpenCV's bilinear does not antialias, and its area filter is slower than
torch's); written into a batch row, OpenCV still does its flip and its CHW write, with torch's
pixels. Without OpenCV every resize takes the torch path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ._geometry import Size
from ._jpeg import say_no_extension
from ._opencv import opencv
from ._threads import one_thread

try:  # optional C extension (setup.py): the one-pass enlargement into CHW planes
    from .._native._jpegcrop import resize_into as _resize_into
except ImportError:  # pragma: no cover - where it did not build, OpenCV's three passes
    _resize_into = None

_SCRATCH = threading.local()  # each thread's reused HWC buffers (_enlarge_hwc's scratch=True)


def _scratch(shape: tuple[int, int, int], which: int) -> np.ndarray:
    """This thread's reused ``uint8`` array ``which`` (0 or 1) of ``shape``. An enlargement on its
    way into a CHW row passes through an HWC array; a fresh one per image costs an allocation
    and cold cache lines that a reused one does not (``benchmarks/bench_decode_parts.py``)."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    key = (shape, which)
    buf = bufs.get(key)
    if buf is None:
        if len(bufs) >= 8:  # a few output sizes at most in one process: never grow unbounded
            bufs.clear()
        buf = bufs[key] = np.empty(shape, np.uint8)
    return buf


def _enlarge_hwc(img: np.ndarray, size: Size, flip: bool,
                 scratch: bool = False) -> np.ndarray | None:
    """``img`` resized up to ``size`` (and flipped) by OpenCV, HWC ``uint8``; ``None`` when this
    is not an enlargement of a 1-4 channel ``uint8`` image or OpenCV is missing. With
    ``scratch``, the result lives in this thread's reused buffers (see :func:`_scratch`): valid
    until the thread's next call, for a caller that copies it out at once."""
    if (img.ndim != 3 or img.dtype != np.uint8 or not 1 <= img.shape[2] <= 4
            or img.shape[0] > size[0] or img.shape[1] > size[1] or 0 in img.shape):
        return None
    cv2 = opencv()
    if cv2 is None:
        return None
    c = img.shape[2]
    if img.strides[2] != 1 or img.strides[1] != c or img.strides[0] <= 0:
        img = np.ascontiguousarray(img)  # cv2 reads rows of packed pixels only
    if not scratch:
        out = cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
        if flip:
            out = cv2.flip(out, 1)
        return out.reshape(size[0], size[1], c)  # cv2 drops a single channel's axis
    shape = (size[0], size[1], c)
    first = _scratch(shape, 0)
    out = cv2.resize(img, (size[1], size[0]), dst=first.reshape(shape[:2]) if c == 1 else first,
                     interpolation=cv2.INTER_LINEAR)
    if flip:
        second = _scratch(shape, 1)
        out = cv2.flip(out, 1, dst=second.reshape(shape[:2]) if c == 1 else second)
    return out.reshape(shape)


def resize_to_tensor(img: np.ndarray, size: Size, *, flip: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Resize an HWC ``uint8`` array (any strides) to a ``(C, H, W)`` ``uint8`` tensor, flipping
    left-right on the way.

    With ``out`` (a ``(C, H, W)`` ``uint8`` tensor, e.g. a row of a batch buffer) the result is
    written there and ``out`` is returned. An RGB image is resized by the C extension, or
    enlarged by OpenCV without it, into a contiguous CHW tensor (see the module docstring),
    straight into ``out`` when it is contiguous. Otherwise torch: the one copy it needs anyway
    (a dense channels-last input) also does the flip, and ``uint8`` channels-last is torch's
    vectorised interpolation path (no float round trip). The result is then in channels-last
    memory, or written into ``out`` (by OpenCV's flip and split where it is installed and
    ``out`` is contiguous: the same pixels).

    Example:
        >>> import numpy as np
        >>> resize_to_tensor(np.zeros((10, 8, 3), np.uint8), (20, 16)).shape
        torch.Size([3, 20, 16])
    """
    if out is not None and (out.dtype != torch.uint8 or tuple(out.shape) != (
            img.shape[2] if img.ndim == 3 else 1, size[0], size[1])):
        raise ValueError(f"out= must be a uint8 tensor of shape {(img.shape[2], *size)}, not "
                         f"{out.dtype} {tuple(out.shape)}")
    if _resize_into is not None and _extension_takes(img):
        chw = _chw_target(out, 3, size)
        _resize_into(img, chw.numpy(), flip)
        return _written(chw, out)
    if _resize_into is None and img.ndim == 3 and img.shape[2] == 3:
        say_no_extension()
    up = _enlarge_hwc(img, size, flip, scratch=True)
    if up is not None:
        chw = _chw_target(out, up.shape[2], size)
        _split_into(up, chw)
        return _written(chw, out)
    cv2 = opencv()
    if cv2 is not None and out is not None and out.is_contiguous() and _packed(img):
        return _interpolate_split(cv2, img, size, flip, out)
    return _interpolate(img, size, flip, out)


def _extension_takes(img: np.ndarray) -> bool:
    """An RGB ``uint8`` image, not empty, of packed pixels in rows that may be padded: what the
    C extension's ``resize_into`` reads."""
    return (img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8 and img.shape[0] > 0
            and img.shape[1] > 0 and img.strides[2] == 1 and img.strides[1] == 3
            and img.strides[0] >= 3 * img.shape[1])


def _packed(img: np.ndarray) -> bool:
    """A 1-4 channel ``uint8`` image of packed pixels in rows going down: what OpenCV reads."""
    return (img.ndim == 3 and img.dtype == np.uint8 and img.strides[2] == 1
            and img.strides[1] == img.shape[2] and img.strides[0] > 0 and 1 <= img.shape[2] <= 4)


def _chw_target(out: torch.Tensor | None, channels: int, size: Size) -> torch.Tensor:
    """Where a CHW result is written: ``out`` when it is contiguous, else a new tensor."""
    if out is not None and out.is_contiguous():
        return out
    return torch.empty((channels, size[0], size[1]), dtype=torch.uint8)


def _written(chw: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The result ``chw``, copied into ``out`` where one was given and it is not ``chw``."""
    if out is None:
        return chw
    if chw is not out:
        out.copy_(chw)
    return out


def _interpolate_split(cv2: Any, img: np.ndarray, size: Size, flip: bool,
                       out: torch.Tensor) -> torch.Tensor:
    """torch's resize written into the contiguous ``out`` by OpenCV. OpenCV's flip (or a packed
    copy) makes the dense channels-last input torch's uint8 kernel wants, and its split writes
    the result's planes straight into ``out``: torch's own channels-last to CHW copy is the
    slower way to the same bytes (benchmarks/bench_decode_parts.py)."""
    dense = cv2.flip(img, 1) if flip else np.ascontiguousarray(img)
    dense = dense.reshape(img.shape)  # cv2 drops a single channel's axis
    with one_thread():
        x = torch.from_numpy(dense).unsqueeze(0).permute(0, 3, 1, 2)
        if (x.shape[2], x.shape[3]) != size:
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True,
                              align_corners=False)
        _split_into(x[0].permute(1, 2, 0).numpy(), out)
    return out


def _interpolate(img: np.ndarray, size: Size, flip: bool,
                 out: torch.Tensor | None) -> torch.Tensor:
    """torch alone: the one copy it needs (a dense channels-last input) also flips, and uint8
    channels-last is its vectorised interpolation path."""
    if min(img.strides) < 0:  # torch takes no negative strides (a channel-reversed view)
        img = np.ascontiguousarray(img)
    with one_thread():
        x = torch.from_numpy(img)
        x = x.flip(1) if flip else x.contiguous()
        x = x.unsqueeze(0).permute(0, 3, 1, 2)  # NCHW view of NHWC memory: channels-last
        if (x.shape[2], x.shape[3]) != size:
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        if out is not None:
            return out.copy_(x[0])
        return x[0]


def _split_into(hwc: np.ndarray, chw: torch.Tensor) -> None:
    """The planes of a dense HWC ``uint8`` array written into the contiguous CHW tensor ``chw``
    (OpenCV present)."""
    planes = chw.numpy()
    if hwc.shape[2] == 1:
        planes[0] = hwc[:, :, 0]
    else:
        opencv().split(hwc, list(planes))


def resize_hwc(img: np.ndarray, size: Size) -> np.ndarray:
    """Resize an HWC ``uint8`` array to ``size`` (bilinear, antialiased); HWC ``uint8`` out."""
    if img.shape[:2] == size:
        return img
    up = _enlarge_hwc(img, size, False)
    if up is not None:
        return up
    return resize_to_tensor(img, size).permute(1, 2, 0).numpy()
