"""Image operations for the CPU pipeline: pure functions on HWC ``uint8`` numpy arrays and CHW
tensors, and the picklable op classes built on them.

Every op is a callable ``op(x, rng=None)``. Deterministic ops ignore ``rng``; random ops draw from
the ``numpy.random.Generator`` they are given (see :func:`feedpipe.transforms._pipeline.sample_rng`) and
refuse to run without one, so no augmentation ever depends on hidden global state. Random ops draw
only ``rng.random()`` doubles, whose stream numpy keeps stable across versions.

Why these libraries (``benchmarks/bench_decode.py`` measures them): simplejpeg (libjpeg-turbo) is
the fastest JPEG decoder that installs from the registry without a system library, and it decodes
at 1/2, 1/4 or 1/8 scale when the target is small, which saves IDCT and resize work. Where
feedpipe's optional C extension ``feedpipe._jpegcrop`` is built (it links the system's
libjpeg-turbo), :func:`decode_window` decodes only a crop's rows and iMCU columns, with the
same pixels: 1.46x faster than a whole decode on random-resized crops of 160-320 px images
(``benchmarks/bench_window_decode.py``); simplejpeg does the whole decode where it is not built.

Resizing: an enlargement (the usual case for a random-resized crop) goes through OpenCV's
``cv2.resize`` (bilinear, fixed-point SIMD) and ``cv2.split`` straight into CHW planes: half
the time of the torch path below (0.23 against 0.46 ms per 224 px image on one core of a busy
2-core VM), within one grey level of it (``benchmarks/bench_resize.py``). A reduction keeps
``torch.nn.functional.interpolate`` on ``uint8`` channels-last tensors with ``antialias=True``:
OpenCV's bilinear does not antialias and its area filter is slower than torch here. Without
OpenCV every resize takes the torch path.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F

from ..errors import DecodeError

try:  # optional C extension (setup.py): window-only JPEG decoding
    from .. import _jpegcrop
except ImportError:  # pragma: no cover - where it did not build, simplejpeg decodes whole images
    _jpegcrop = None



def window_decoder() -> str | None:
    """The window-only JPEG decoder's module name where the C extension was built, else None
    (simplejpeg then decodes whole images)."""
    return None if _jpegcrop is None else "feedpipe._jpegcrop"


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Size = tuple[int, int]


class Box(NamedTuple):
    """A crop window in pixels: rows ``top:top+height``, columns ``left:left+width``."""

    top: int
    left: int
    height: int
    width: int


# -- pure functions -----------------------------------------------------------------------------
def as_size(size: int | Sequence[int]) -> Size:
    """``224`` -> ``(224, 224)``; ``(h, w)`` stays; anything else is a ``ValueError``."""
    if isinstance(size, (int, np.integer)):
        h = w = int(size)
    else:
        if len(size) != 2:
            raise ValueError(f"size must be an int or (height, width), not {size!r}")
        h, w = (int(v) for v in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive, not {size!r}")
    return h, w


def jpeg_size(data: Any) -> Size:
    """``(height, width)`` from a JPEG header, without decoding (a few microseconds)."""
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as e:
        raise DecodeError(f"not a decodable JPEG ({len(data)} bytes): {e}") from e
    return int(h), int(w)


def decode_jpeg(data: Any, *, min_height: int = 0, min_width: int = 0, fastdct: bool = False,
                fastupsample: bool = False) -> np.ndarray:
    """Decode JPEG bytes to an HWC ``uint8`` RGB array, at reduced scale when allowed.

    With ``min_height``/``min_width``, libjpeg-turbo decodes at the smallest scale ``k/8`` that
    keeps the image at least that large, but only at factors of 2 or more (``min_factor=2``):
    factors between 1 and 2 decode slower than full size.
    """
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fastdct,
                                      fastupsample=fastupsample, min_height=int(min_height),
                                      min_width=int(min_width), min_factor=2)
    except ValueError as e:
        raise DecodeError(f"not a decodable JPEG ({len(data)} bytes): {e}") from e


def scaled_size(height: int, width: int, k: int) -> Size:
    """The size libjpeg decodes a ``height`` x ``width`` JPEG to at scale ``k/8`` (rounded up)."""
    return -(-height * k // 8), -(-width * k // 8)


def jpeg_scale_num(height: int, width: int, min_height: int = 0, min_width: int = 0) -> int:
    """The DCT scale ``k/8`` (returns ``k``) a decode at ``min_height``/``min_width`` uses: the
    smallest ``k`` in 1..4 that keeps the image at least that large (libjpeg rounds sizes up),
    else 8 (full size); 8 without minimums. The same choice as :func:`decode_jpeg`'s (simplejpeg,
    ``min_factor=2``)."""
    if min_height <= 0 and min_width <= 0:
        return 8
    for k in (1, 2, 3, 4):
        dh, dw = scaled_size(height, width, k)
        if dh >= min_height and dw >= min_width:
            return k
    return 8


def decode_window(data: Any, height: int, width: int, box: Box, *, min_height: int = 0,
                  min_width: int = 0) -> np.ndarray:
    """The pixels of window ``box`` of a ``height`` x ``width`` JPEG: an HWC ``uint8`` RGB view.

    Decoded at the scale :func:`jpeg_scale_num` picks for ``min_height``/``min_width`` (the box is
    scaled with it, :func:`scale_box`); the result is what :func:`decode_jpeg` with those minimums
    gives, sliced to the scaled box. With the C extension built, only the window's rows and
    iMCU columns are decoded (libjpeg-turbo's ``jpeg_skip_scanlines``/``jpeg_crop_scanline``).
    Otherwise, or when the extension refuses the data (a CMYK JPEG, say), simplejpeg decodes the
    whole image, and its error, if any, is the one raised (:class:`DecodeError`).

    Example:
        >>> import simplejpeg, numpy as np
        >>> jpg = simplejpeg.encode_jpeg(np.full((64, 48, 3), 200, np.uint8))
        >>> decode_window(jpg, 64, 48, Box(8, 4, 20, 30)).shape
        (20, 30, 3)
    """
    k = jpeg_scale_num(height, width, min_height, min_width)
    dh, dw = scaled_size(height, width, k)
    if k != 8:
        box = scale_box(box, dh / height, dw / width, dh, dw)
    if _jpegcrop is not None:
        try:
            pixels, row_width, x = _jpegcrop.decode_crop(data, box.top, box.left, box.height,
                                                         box.width, k)
        except (ValueError, TypeError, OverflowError):
            pass  # simplejpeg below: same image, or the error users get without the extension
        else:
            rows = np.frombuffer(pixels, np.uint8).reshape(box.height, row_width, 3)
            return rows[:, x:x + box.width]
    img = decode_jpeg(data, min_height=min_height, min_width=min_width)
    if img.shape[:2] != (dh, dw):
        raise DecodeError(f"the JPEG decoded to {img.shape[:2]}, not the {height}x{width} (at "
                          f"{k}/8) its header gave")
    return img[box.top:box.top + box.height, box.left:box.left + box.width]


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


_ONE_THREAD_LOCK = threading.Lock()
_one_thread_users = 0
_saved_threads = 0


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops on the calling thread only, for the duration.

    One image is too little work to split over torch's intra-op threads: with ``num_workers=0``
    they only add fork-join overhead, and on a busy machine (more runnable threads than cores)
    their barriers made the image pipeline 5-10x slower (``benchmarks/bench_peers.py``).
    DataLoader workers already run with one thread; this is a no-op there. The setting is
    process-wide, so nested and concurrent users (a DeviceLoader thread, probe threads) are
    counted: the first sets one thread, the last restores the count it found.
    """
    global _one_thread_users, _saved_threads
    if torch.get_num_threads() == 1 and _one_thread_users == 0:
        yield
        return
    with _ONE_THREAD_LOCK:
        if _one_thread_users == 0:
            _saved_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        _one_thread_users += 1
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            _one_thread_users -= 1
            if _one_thread_users == 0:
                torch.set_num_threads(_saved_threads)


_CV2: Any = None  # the cv2 module once looked up; False when it does not import


def opencv() -> Any:
    """The ``cv2`` module, or ``None`` where it does not import; imported on first use.

    OpenCV is switched to run on the calling thread (``cv2.setNumThreads(0)``, process-wide):
    one image is too little work to split, and a thread pool started in the parent is a known
    hazard for the DataLoader workers forked after it.
    """
    global _CV2
    if _CV2 is None:
        try:
            import cv2
        except ImportError:
            _CV2 = False
        else:
            cv2.setNumThreads(0)
            _CV2 = cv2
    return _CV2 or None


def _enlarge_hwc(img: np.ndarray, size: Size, flip: bool) -> np.ndarray | None:
    """``img`` resized up to ``size`` (and flipped) by OpenCV, HWC ``uint8``; ``None`` when this
    is not an enlargement of a 1-4 channel ``uint8`` image or OpenCV is missing."""
    if (img.ndim != 3 or img.dtype != np.uint8 or not 1 <= img.shape[2] <= 4
            or img.shape[0] > size[0] or img.shape[1] > size[1] or 0 in img.shape):
        return None
    cv2 = opencv()
    if cv2 is None:
        return None
    c = img.shape[2]
    if img.strides[2] != 1 or img.strides[1] != c or img.strides[0] <= 0:
        img = np.ascontiguousarray(img)  # cv2 reads rows of packed pixels only
    out = cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    if flip:
        out = cv2.flip(out, 1)
    return out.reshape(size[0], size[1], c)  # cv2 drops a single channel's axis


def resize_to_tensor(img: np.ndarray, size: Size, *, flip: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Resize an HWC ``uint8`` array (any strides) to a ``(C, H, W)`` ``uint8`` tensor, flipping
    left-right on the way; into ``out`` (a ``(C, H, W)`` ``uint8`` tensor, e.g. a row of a batch
    buffer) when given, which is returned.

    An enlargement is done by OpenCV and split into a contiguous CHW tensor (see the module
    docstring), straight into ``out`` when it is contiguous. Otherwise torch: the one copy it
    needs anyway (a dense channels-last input) also does the flip, and ``uint8`` channels-last is
    torch's vectorised interpolation path (no float round trip); the result is then in
    channels-last memory, or copied into ``out``.
    """
    if out is not None and (out.dtype != torch.uint8 or tuple(out.shape) != (
            img.shape[2] if img.ndim == 3 else 1, size[0], size[1])):
        raise ValueError(f"out= must be a uint8 tensor of shape {(img.shape[2], *size)}, not "
                         f"{out.dtype} {tuple(out.shape)}")
    up = _enlarge_hwc(img, size, flip)
    if up is not None:
        chw = out if out is not None and out.is_contiguous() else torch.empty(
            (up.shape[2], size[0], size[1]), dtype=torch.uint8)
        planes = chw.numpy()
        if up.shape[2] == 1:
            planes[0] = up[:, :, 0]
        else:
            opencv().split(up, list(planes))
        if out is not None and chw is not out:
            out.copy_(chw)
        return chw if out is None else out
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


def resize_hwc(img: np.ndarray, size: Size) -> np.ndarray:
    """Resize an HWC ``uint8`` array to ``size`` (bilinear, antialiased); HWC ``uint8`` out."""
    if img.shape[:2] == size:
        return img
    up = _enlarge_hwc(img, size, False)
    if up is not None:
        return up
    return resize_to_tensor(img, size).permute(1, 2, 0).numpy()


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
