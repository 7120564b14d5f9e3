"""JPEG decoding: whole images at reduced scale, and crop windows only.

Why these libraries (``benchmarks/bench_decode.py`` compares them): simplejpeg (libjpeg-turbo)
is the fastest JPEG decoder that installs from the registry without a system library. It
decodes at 1/2, 1/4 or 1/8 scale when the target is small, which saves IDCT and resize work.
Where the optional C extension ``feedpipe._native._jpegcrop`` is built (it links the system's
libjpeg-turbo), :func:`decode_window` decodes only a crop's rows and iMCU columns, with the same
pixels (``benchmarks/bench_window_decode.py``). Where it is not built, simplejpeg decodes the
whole image.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import simplejpeg

from .._helpers.dependency import say_unbuilt
from .._redact import logger
from ..errors import DecodeError
from ._geometry import Box, Size, scale_box

try:  # optional C extension (setup.py): window-only JPEG decoding
    from .._native import _jpegcrop
except ImportError:  # pragma: no cover - where it did not build, simplejpeg decodes whole images
    _jpegcrop = None


def window_decoder() -> str | None:
    """The window-only JPEG decoder's module name where the C extension was built, else None
    (simplejpeg then decodes whole images)."""
    return None if _jpegcrop is None else "feedpipe._native._jpegcrop"


def say_no_extension() -> None:
    """Log once a process that JPEG crops are decoded whole and resized another way, because
    ``feedpipe._native._jpegcrop`` was not built."""
    say_unbuilt(_log, "_native._jpegcrop", "JPEG crops are decoded whole by simplejpeg and "
                "resized by OpenCV or torch (the extension also needs libjpeg-turbo's headers: "
                "Debian libjpeg-dev)", "the same crops and flips, pixels within one grey level")


def jpeg_size(data: Any) -> Size:
    """``(height, width)`` from a JPEG header, without decoding."""
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as e:
        fixed = repaired_as_libjpeg(data, e, simplejpeg.decode_jpeg_header)
        if fixed is None:
            raise DecodeError(f"not a decodable JPEG ({len(data)} bytes): {e}") from e
        h, w, _, _ = simplejpeg.decode_jpeg_header(fixed)
    return int(h), int(w)


_STRAY = re.compile(r"(\d+) extraneous bytes before marker 0x([0-9a-fA-F]{2})")
_BAD_ICC = "bad ICC marker"
_log = logger("feedpipe")
_said: set[str] = set()
_REPAIRS = {
    "stray": "a JPEG with stray bytes before a marker (libjpeg's \"extraneous bytes\" warning) "
             "was decoded without them, as libjpeg and Pillow do",
    "icc": "a JPEG with ICC profile segments libjpeg cannot assemble (its \"bad ICC marker\" "
           "warning: a segment after the frame header, or a repeated or missing part) was "
           "decoded without them, to the pixels libjpeg and Pillow give (feedpipe applies no "
           "ICC profile)",
}


def repaired_as_libjpeg(data: Any, error: Exception, check: Callable[[bytes], Any],
                        *, rounds: int = 4) -> bytes | None:
    """``data`` repaired as libjpeg reads it, where only a libjpeg warning that does not change
    the picture made the strict decoder refuse it; else ``None``.

    Two such warnings are repaired: stray bytes before a marker ("N extraneous bytes before
    marker"), and ICC profile segments libjpeg cannot assemble ("bad ICC marker": Pillow reads
    the profile itself, and feedpipe applies none). libjpeg, Pillow and torchvision decode such
    a file, with a warning; strict decoding (feedpipe's, so that a truncated or corrupt image is
    an error, never a partial picture) refuses it. Removing exactly what libjpeg skips (the
    stray bytes) or reads apart from the pixels (the ICC segments) and decoding strictly again
    gives libjpeg's picture, and still refuses any other fault.

    Stray bytes are the ``N`` before an ``0xFF <marker>`` pair; of the places that fit, the
    first that ``check`` (a strict decode) accepts is taken. Up to ``rounds`` such spots are
    removed, one by one. Each repair is said once per process in a warning.
    """
    raw, done = bytes(data), set()
    if _BAD_ICC in str(error):
        raw = _without_icc(raw)
        done.add("icc")
        try:
            check(raw)
        except ValueError as refused:
            error = refused
        else:
            return _said_once(raw, done)
    if _STRAY.search(str(error)) is None:
        return None

    def strict_but_icc(candidate: bytes) -> None:
        """``check``, where bad ICC segments that come after the stray bytes are not a fault
        (they are removed below)."""
        try:
            check(candidate)
        except ValueError as refused:
            if _BAD_ICC not in str(refused):
                raise
            check(_without_icc(candidate))

    budget = [64]  # strict decodes tried, at most: a file can only be so ambiguous
    fixed = _remove_stray(raw, error, strict_but_icc, rounds, budget)
    if fixed is None:
        return None
    done.add("stray")
    try:
        check(fixed)
    except ValueError:  # only the ICC segments are left (strict_but_icc accepted it)
        fixed = _without_icc(fixed)
        done.add("icc")
    return _said_once(fixed, done)


def _said_once(fixed: bytes, repairs: set[str]) -> bytes:
    for repair in sorted(repairs - _said):
        _said.add(repair)
        _log.warning("feedpipe: %s (said once per process)", _REPAIRS[repair])
    return fixed


def _without_icc(raw: bytes) -> bytes:
    """JPEG bytes without their APP2 ``ICC_PROFILE`` segments (those before the first scan);
    every other byte as it was. The segments are walked by their lengths; where the bytes stop
    making sense the rest is kept as it is, for the strict decoder to judge."""
    out, pos = [raw[:2]], 2
    while pos + 4 <= len(raw) and raw[pos] == 0xFF:
        marker = raw[pos + 1]
        if marker == 0xFF:  # a fill byte
            out.append(raw[pos:pos + 1])
            pos += 1
            continue
        if marker in (0xDA, 0xD9) or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            break  # the first scan (or no segment length): the pixels follow
        end = pos + 2 + int.from_bytes(raw[pos + 2:pos + 4], "big")
        if end > len(raw):
            break
        if not (marker == 0xE2 and raw[pos + 4:pos + 16] == b"ICC_PROFILE\x00"):
            out.append(raw[pos:end])
        pos = end
    out.append(raw[pos:])
    return b"".join(out)


def _remove_stray(raw: bytes, error: Exception, check: Callable[[bytes], Any], rounds: int,
                  budget: list[int]) -> bytes | None:
    m = _STRAY.search(str(error))
    if m is None or rounds <= 0:
        return None
    n, marker = int(m.group(1)), bytes([0xFF, int(m.group(2), 16)])
    start = raw.find(marker)
    second: list[tuple[bytes, ValueError]] = []  # fixed here, refused for another spot
    while start >= 0 and budget[0] > 0:
        ff = start
        while ff > 0 and raw[ff - 1] == 0xFF:  # fill bytes before a marker are not counted
            ff -= 1
        if ff >= n + 2 and 0xFF not in raw[ff - n:ff]:
            budget[0] -= 1
            candidate = raw[:ff - n] + raw[ff:]
            try:
                check(candidate)
            except ValueError as refused:  # the wrong place, or the right one and another
                if _STRAY.search(str(refused)):
                    second.append((candidate, refused))
            else:
                return candidate
        start = raw.find(marker, start + 2)
    for candidate, why in second:  # each place here first, then two places
        deeper = _remove_stray(candidate, why, check, rounds - 1, budget)
        if deeper is not None:
            return deeper
    return None


def repaired_jpeg(data: Any) -> bytes | None:
    """``None`` where JPEG bytes decode strictly as they are; the bytes repaired as libjpeg
    reads them (:func:`repaired_as_libjpeg`: without stray bytes before a marker or unreadable
    ICC segments) where only those make strict decoding refuse them; else a
    :class:`DecodeError`. For a decoder that is not as lenient as libjpeg
    (DALI's)."""
    try:
        simplejpeg.decode_jpeg(data)
    except ValueError as e:
        fixed = repaired_as_libjpeg(data, e, simplejpeg.decode_jpeg)
        if fixed is None:
            raise DecodeError(f"not a decodable JPEG ({len(data)} bytes): {e}") from e
        return fixed
    return None


def decode_jpeg(data: Any, *, min_height: int = 0, min_width: int = 0, fastdct: bool = False,
                fastupsample: bool = False) -> np.ndarray:
    """Decode JPEG bytes to an HWC ``uint8`` RGB array, at reduced scale when allowed.

    With ``min_height``/``min_width``, libjpeg-turbo decodes at the smallest scale ``k/8`` that
    keeps the image at least that large. It does so only at factors of 2 or more
    (``min_factor=2``): factors between 1 and 2 decode slower than full size.
    """
    def decode(jpeg: Any) -> np.ndarray:
        return simplejpeg.decode_jpeg(jpeg, colorspace="RGB", fastdct=fastdct,
                                      fastupsample=fastupsample, min_height=int(min_height),
                                      min_width=int(min_width), min_factor=2)

    try:
        return decode(data)
    except ValueError as e:
        fixed = repaired_as_libjpeg(data, e, decode)
        if fixed is None:
            raise DecodeError(f"not a decodable JPEG ({len(data)} bytes): {e}") from e
        return decode(fixed)


def scaled_size(height: int, width: int, k: int) -> Size:
    """The size libjpeg decodes a ``height`` x ``width`` JPEG to at scale ``k/8`` (rounded up)."""
    return -(-height * k // 8), -(-width * k // 8)


def jpeg_scale_num(height: int, width: int, min_height: int = 0, min_width: int = 0) -> int:
    """The DCT scale ``k/8`` (returns ``k``) a decode at ``min_height``/``min_width`` uses.

    That is the smallest ``k`` in 1..4 that keeps the image at least that large (libjpeg rounds
    sizes up), else 8 (full size); 8 without minimums. It is the same choice as
    :func:`decode_jpeg`'s (simplejpeg, ``min_factor=2``)."""
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

    Decoded at the scale :func:`jpeg_scale_num` picks for ``min_height``/``min_width``; the box
    is scaled with it (:func:`~feedpipe.transforms._geometry.scale_box`). The result is what
    :func:`decode_jpeg` with those minimums gives, sliced to the scaled box. With the C
    extension built, only the window's rows and iMCU columns are decoded (libjpeg-turbo's
    ``jpeg_skip_scanlines``/``jpeg_crop_scanline``); the other rows are entropy-decoded only, so
    that a truncated or corrupt file is an error whatever the window. Otherwise, or when the
    extension refuses the data (a CMYK JPEG, say), simplejpeg decodes the whole image, and its
    error, if any, is the one raised (:class:`DecodeError`).

    Example:
        >>> import simplejpeg, numpy as np
        >>> jpg = simplejpeg.encode_jpeg(np.full((64, 48, 3), 200, np.uint8))
        >>> decode_window(jpg, 64, 48, Box(8, 4, 20, 30)).shape
        (20, 30, 3)
    """
    k, dh, dw, box = _scaled_window(height, width, box, min_height, min_width)
    if _jpegcrop is not None:
        try:
            pixels, row_width, x = _jpegcrop.decode_crop(data, box.top, box.left, box.height,
                                                         box.width, k)
        except (ValueError, TypeError, OverflowError):
            pass  # simplejpeg below: same image, or the error users get without the extension
        else:
            rows = np.frombuffer(pixels, np.uint8).reshape(box.height, row_width, 3)
            return rows[:, x:x + box.width]
    if _jpegcrop is None:
        say_no_extension()
    img = decode_jpeg(data, min_height=min_height, min_width=min_width)
    if img.shape[:2] != (dh, dw):
        raise DecodeError(f"the JPEG decoded to {img.shape[:2]}, not the {height}x{width} (at "
                          f"{k}/8) its header gave")
    return img[box.top:box.top + box.height, box.left:box.left + box.width]


def _scaled_window(height: int, width: int, box: Box, min_height: int,
                   min_width: int) -> tuple[int, int, int, Box]:
    """The DCT scale ``k`` for ``min_height``/``min_width``, the decoded size at it and ``box``
    in the decoded image's coordinates."""
    k = jpeg_scale_num(height, width, min_height, min_width)
    dh, dw = scaled_size(height, width, k)
    if k != 8:
        box = scale_box(box, dh / height, dw / width, dh, dw)
    return k, dh, dw, box


def decode_window_into(data: Any, height: int, width: int, box: Box, out: np.ndarray,
                       flip: bool, *, min_height: int = 0, min_width: int = 0) -> bool:
    """Decode window ``box`` as :func:`decode_window` does and resize it into ``out`` (a
    C-contiguous ``(3, H, W)`` ``uint8`` array) flipped left-right when ``flip``, in one call of
    the C extension: the pixels of :func:`~feedpipe.transforms._resize.resize_to_tensor` of the
    window.

    Returns False, with nothing written, where that one call cannot do it: the extension is
    not built, or it refuses the bytes (:func:`decode_window` then repairs them, decodes them
    another way or raises the :class:`DecodeError`)."""
    if _jpegcrop is None:
        return False
    k, _, _, box = _scaled_window(height, width, box, min_height, min_width)
    try:
        _jpegcrop.decode_crop_into(data, box.top, box.left, box.height, box.width, out,
                                   out.shape[1], out.shape[2], flip, k)
    except (ValueError, TypeError, OverflowError):
        return False
    return True
