"""Real image files of every format and mode the decoders promise to read, written with OpenCV,
Pillow, simplejpeg and pillow-heif, with the 3-channel RGB pixels each must decode to."""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass

import cv2
import numpy as np
import simplejpeg

H, W = 45, 62  # odd sizes: no codec's block size divides them


@dataclass(frozen=True)
class Case:
    """One encoded image: its bytes, the pixels it must decode to (HWC RGB ``uint8``) and how far
    from them a decoder may be (0: exactly; lossy formats are compared with Pillow's decode of the
    same bytes, which differs by the IDCT or upsampling rounding only)."""

    name: str
    data: bytes
    expected: np.ndarray
    tolerance: int
    lossless_of_picture: bool = False  # decodes exactly to picture()


def picture() -> np.ndarray:
    """A smooth RGB picture with some structure (edges, gradients) in every channel."""
    yy, xx = np.mgrid[0:H, 0:W]
    r = 30 + xx * 3
    g = 40 + yy * 4
    b = np.where((xx // 8 + yy // 8) % 2 == 0, 200, 60) - yy
    return np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8)


def alpha() -> np.ndarray:
    """Transparency from 0 (the first columns: fully transparent) to 255."""
    return (np.mgrid[0:H, 0:W][1] * 255 // (W - 1)).astype(np.uint8)


def grey() -> np.ndarray:
    return picture()[:, :, 1].copy()


def picture16() -> np.ndarray:
    """16-bit channels whose high byte is picture(): the 8-bit image is exactly picture()."""
    low = (np.arange(H * W * 3).reshape(H, W, 3) * 37 % 256).astype(np.uint16)
    return (picture().astype(np.uint16) << 8) | low


def _pil(image: object, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)  # type: ignore[attr-defined]
    return buf.getvalue()


def _pil_rgb(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.array(im.convert("RGB"))


def _png16(arr16: np.ndarray) -> bytes:
    bgr = arr16[:, :, [2, 1, 0, 3][:arr16.shape[2]]] if arr16.ndim == 3 else arr16
    return cv2.imencode(".png", np.ascontiguousarray(bgr))[1].tobytes()


def _rep(grey_image: np.ndarray) -> np.ndarray:
    return np.repeat(grey_image[:, :, None], 3, axis=2)


def pillow_has_avif() -> bool:
    try:
        from PIL import features
    except ImportError:
        return False
    return bool(features.check("avif"))


def have_pillow_heif() -> bool:
    try:
        import pillow_heif  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def cases() -> dict[str, Case]:
    """Every case this machine can write (AVIF needs Pillow's AVIF plugin, HEIC pillow-heif).
    Made once: callers read it only."""
    from PIL import Image

    pic, a, g = picture(), alpha(), grey()
    rgba = np.dstack([pic, a])
    out: list[Case] = []

    def lossy(name: str, data: bytes, tolerance: int = 2) -> None:
        out.append(Case(name, data, _pil_rgb(data), tolerance))

    lossy("jpeg-rgb", _pil(Image.fromarray(pic), "JPEG", quality=95))
    lossy("jpeg-grey", _pil(Image.fromarray(g), "JPEG", quality=95))
    lossy("jpeg-cmyk", _pil(Image.fromarray(pic).convert("CMYK"), "JPEG", quality=95))
    # libjpeg-turbo writes CMYK as Adobe's inverted YCCK: inverted here, it decodes to picture()
    inverted = 255 - np.asarray(Image.fromarray(pic).convert("CMYK"))
    lossy("jpeg-ycck", simplejpeg.encode_jpeg(np.ascontiguousarray(inverted), quality=95,
                                              colorspace="CMYK"))
    out.append(Case("png-rgb", cv2.imencode(".png", pic[:, :, ::-1].copy())[1].tobytes(), pic, 0,
                    True))
    out.append(Case("png-rgba", _pil(Image.fromarray(rgba, "RGBA"), "PNG"), pic, 0, True))
    out.append(Case("png-grey", _pil(Image.fromarray(g), "PNG"), _rep(g), 0))
    out.append(Case("png-grey-alpha", _pil(Image.fromarray(np.dstack([g, a]), "LA"), "PNG"),
                    _rep(g), 0))
    palette = Image.fromarray(pic).quantize(32)
    out.append(Case("png-palette", _pil(palette, "PNG"), np.array(palette.convert("RGB")), 0))
    see_through = _pil(palette, "PNG", transparency=3)
    out.append(Case("png-palette-transparency", see_through, _pil_rgb(see_through), 0))
    out.append(Case("png-rgb16", _png16(picture16()), pic, 0, True))
    out.append(Case("png-grey16", _png16(picture16()[:, :, 1].copy()), _rep(g), 0))
    a16 = (a.astype(np.uint16) * 257)[:, :, None]
    out.append(Case("png-rgba16", _png16(np.dstack([picture16(), a16])), pic, 0, True))
    lossy("webp-lossy", _pil(Image.fromarray(pic), "WEBP", quality=95))
    lossy("webp-lossy-alpha", _pil(Image.fromarray(rgba, "RGBA"), "WEBP", quality=95))
    out.append(Case("webp-lossless", _pil(Image.fromarray(pic), "WEBP", lossless=True), pic, 0,
                    True))
    out.append(Case("webp-lossless-alpha", _pil(Image.fromarray(rgba, "RGBA"), "WEBP",
                                                lossless=True, exact=True), pic, 0, True))
    if pillow_has_avif():
        lossy("avif", _pil(Image.fromarray(pic), "AVIF", quality=95))
    if have_pillow_heif():
        import pillow_heif

        buf = io.BytesIO()
        pillow_heif.from_bytes("RGB", (W, H), pic.tobytes()).save(buf, format="HEIF", quality=95)
        heif = np.asarray(pillow_heif.open_heif(buf.getvalue()))
        out.append(Case("heic", buf.getvalue(), heif, 0))
    return {c.name: c for c in out}


def write_files(root: str, named: dict[str, Case]) -> dict[str, str]:
    """Each case as a file ``root/<name>.<ext>``; returns name -> path."""
    os.makedirs(root, exist_ok=True)
    paths = {}
    for name, case in named.items():
        ext = {"jpeg": "jpg", "png": "png", "webp": "webp", "avif": "avif",
               "heic": "heic"}[name.split("-")[0]]
        path = os.path.join(root, f"{name}.{ext}")
        with open(path, "wb") as f:
            f.write(case.data)
        paths[name] = path
    return paths
