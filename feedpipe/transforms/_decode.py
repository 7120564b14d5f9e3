"""Image decoding for every format a sample may hold: JPEG, PNG, WebP, AVIF, HEIC (and what else
OpenCV reads), always to an HWC ``uint8`` RGB array of three channels.

The format is read from the bytes (:func:`image_format`), not from the field's name: a PNG
stored as ``.jpg`` in a scraped dataset decodes as a PNG.

=========  ================================  =============================================
format     decoder                           why (``benchmarks/bench_image_formats.py``)
=========  ================================  =============================================
JPEG       feedpipe's window decoder, or     the fast path of :mod:`feedpipe.transforms._jpeg`
           simplejpeg (libjpeg-turbo)        (grey, CMYK and YCCK JPEGs too)
PNG        OpenCV (``cv2.imdecode``)         the fastest, or level with Pillow and pyvips
                                             (neither a core dependency), on every mode
WebP       OpenCV                            the fastest; Pillow and pyvips are slower
AVIF       Pillow where it has AVIF, else    Pillow's decoder is the faster where both
           OpenCV where built with libavif   exist
HEIC/HEIF  pillow-heif (libheif)             the one HEIC decoder that pip installs
GIF, TIFF  Pillow where installed, else      OpenCV paints a GIF's transparent pixels with
           OpenCV (with a warning)           the background colour and premultiplies a
                                             TIFF's unassociated alpha: not the stored
                                             colours (see below)
other      OpenCV, if it reads the bytes     BMP, PNM, JPEG 2000 come for free
=========  ================================  =============================================

The measured figures are in ``benchmarks/results/image_formats.md``.
:func:`image_decoders` says which library decodes each format on this machine. OpenCV is a
dependency; Pillow and pillow-heif are the ``images`` extra (``pip install 'feedpipe[images]'``),
imported on first use; a HEIC image without pillow-heif (or an AVIF image with neither decoder)
is a :class:`~feedpipe.errors.MissingDependencyError` with the pip line, not a decode error:
skipping it would drop every such image.

What every decoder is made to agree on:

- **Three channels, RGB.** Grey is replicated, palettes expanded.
- **Alpha is dropped**, not composited: the colour under a transparent pixel is kept as stored.
  That is what Pillow's ``convert("RGB")``, torchvision's ``ImageReadMode.RGB``, webdataset's
  ``"rgb8"`` and DALI's ``output_type=RGB`` do, so a model sees the same pixels on every path.
- **Any decoder output becomes three 8-bit channels**: a 2-D grey array (OpenCV's for a grey
  PFM), grey and alpha, RGBA and float samples (clipped to 0..255) are converted as Pillow's
  ``convert("RGB")`` does; another shape is a DecodeError.
- **A GIF or TIFF gives Pillow's pixels** (the first frame of an animated GIF; a transparent
  index keeps its palette colour), so Pillow decodes them where it is installed. Without it
  OpenCV does, and a warning says once that transparent GIF pixels and TIFF colours under an
  alpha channel may then differ.
- **An animated PNG (APNG) gives its default image**, as Pillow and torchvision
  do: it is decoded with Pillow (OpenCV would give the first animation frame).
- **16-bit channels are scaled to 8 bits** by keeping the high byte (``x >> 8``, libpng's
  stripping). DALI's decoder rounds instead: at most one grey level apart.
- **EXIF orientation is not applied**: pixels as stored, as torchvision's ``ImageFolder``
  (Pillow's ``open``) and webdataset give them, and as the JPEG window decoder must (its crop is
  chosen from the header's size). HEIC's rotation and mirror properties (``irot``/``imir``) are
  part of the coded image in that format, and libheif applies them.
- **A corrupt or truncated image is a** :class:`~feedpipe.errors.DecodeError` (OpenCV returns
  nothing for it, libjpeg's warnings are errors), never a grey or partial picture.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np

from .._helpers.dependency import require
from .._redact import logger
from ..errors import DecodeError, MissingDependencyError
from ..format._image_fields import IMAGE_FIELDS, image_field_of
from ._jpeg import decode_jpeg, jpeg_size, window_decoder
from ._opencv import opencv, quiet_stderr

__all__ = ["IMAGE_FIELDS", "DecodeImage", "decode_image", "image_decoders", "image_field_of",
           "image_format", "image_size"]

_NAMES = {"jpeg": "JPEG", "png": "PNG", "webp": "WebP", "avif": "AVIF", "heic": "HEIC/HEIF",
          "gif": "GIF", "tiff": "TIFF"}
_PNG = b"\x89PNG\r\n\x1a\n"
_AVIF_BRANDS = {b"avif", b"avis"}
_HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1",
                b"msf1"}
_PIL_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, SyntaxError, EOFError)


def image_format(data: Any) -> str:
    """The format of encoded image bytes from their first bytes: ``"jpeg"``, ``"png"``,
    ``"webp"``, ``"avif"``, ``"heic"`` (HEIF with HEVC or another non-AV1 brand), or
    ``"unknown"``.

    Example:
        >>> image_format(b"\\x89PNG\\r\\n\\x1a\\n..."), image_format(b"GIF89a")
        ('png', 'unknown')
    """
    head = bytes(data[:64])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == _PNG:
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[4:8] == b"ftyp":
        major = head[8:12]
        box = min(int.from_bytes(head[:4], "big"), len(head))
        compatible = {head[i:i + 4] for i in range(16, box - 3, 4)}
        if major in _AVIF_BRANDS:
            return "avif"
        if major in _HEIF_BRANDS:  # the generic brands (mif1, msf1) also start AVIF files
            generic = major in (b"mif1", b"msf1")
            return "avif" if generic and compatible & _AVIF_BRANDS else "heic"
        if compatible & _AVIF_BRANDS:
            return "avif"
        if compatible & _HEIF_BRANDS:
            return "heic"
    return "unknown"


def image_size(data: Any) -> tuple[int, int]:
    """``(height, width)`` of a JPEG, PNG or WebP from its header, without decoding; a
    :class:`~feedpipe.errors.DecodeError` for another format or a header too short to say."""
    fmt = image_format(data)
    if fmt == "jpeg":
        return jpeg_size(data)
    head = bytes(data[:32])
    if fmt == "png" and len(head) >= 24 and head[12:16] == b"IHDR":
        return int.from_bytes(head[20:24], "big"), int.from_bytes(head[16:20], "big")
    if fmt == "webp" and len(head) >= 30:
        chunk = head[12:16]
        if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
            return (int.from_bytes(head[28:30], "little") & 0x3FFF,
                    int.from_bytes(head[26:28], "little") & 0x3FFF)
        if chunk == b"VP8L" and head[20] == 0x2F:
            bits = int.from_bytes(head[21:25], "little")
            return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
        if chunk == b"VP8X":
            return (int.from_bytes(head[27:30], "little") + 1,
                    int.from_bytes(head[24:27], "little") + 1)
    what = _NAMES.get(fmt, "an image of unknown format")
    raise DecodeError(f"cannot read the size of {what} ({len(data)} bytes) from its header")


def decode_image(data: Any) -> np.ndarray:
    """Decode image bytes of any supported format to an HWC ``uint8`` RGB array (see the module
    docstring for the decoder of each format and the conventions they share).

    Raises:
        DecodeError: corrupt, truncated or unreadable bytes.
        MissingDependencyError: a HEIC (or AVIF) image and no library here that decodes it.

    Example:
        >>> import cv2, numpy as np
        >>> rgba = np.zeros((6, 8, 4), np.uint8); rgba[..., 0] = 255  # red, transparent
        >>> png = cv2.imencode(".png", rgba[..., [2, 1, 0, 3]])[1].tobytes()
        >>> img = decode_image(png)
        >>> img.shape, img.dtype, img[0, 0].tolist()
        ((6, 8, 3), dtype('uint8'), [255, 0, 0])
    """
    fmt = image_format(data)
    if fmt == "jpeg":
        return decode_jpeg(data)
    if fmt == "png" and animated_png(data):
        return _decode_apng(data)
    if fmt == "heic":
        return _decode_heif(data)
    if fmt == "unknown":
        fmt = _pillow_first(data)
        if fmt != "unknown" and _have_pillow(fmt):
            return _decode_pillow(data, fmt)
    if fmt == "avif":
        library = _avif_library()
        if library is None:
            raise MissingDependencyError(
                "decoding AVIF images needs Pillow >= 11.3 or an OpenCV built with libavif; "
                "neither is installed. Install it with: pip install 'feedpipe[images]'")
        if library == "pillow":
            return _decode_pillow(data, fmt)
    return _decode_opencv(data, fmt)


def image_decoders() -> dict[str, str | None]:
    """Which library decodes each format here (``None``: none installed), e.g. for a report.

    Returns:
        ``{format: library}`` for ``"jpeg"``, ``"png"``, ``"webp"``, ``"avif"``, ``"heic"``,
        ``"gif"``, ``"tiff"`` and ``"other"`` (what OpenCV reads besides).

    Example:
        >>> image_decoders()["png"]
        'opencv'
    """
    try:
        import pillow_heif  # noqa: F401
        heif: str | None = "pillow-heif"
    except ImportError:
        heif = None
    try:
        import PIL  # noqa: F401
        pillow = "pillow"
    except ImportError:
        pillow = "opencv"
    return {"jpeg": window_decoder() or "simplejpeg",
            "png": "opencv", "webp": "opencv", "avif": _avif_library(), "heic": heif,
            "gif": pillow, "tiff": pillow, "other": "opencv"}


# GIF and TIFF (BigTIFF too), by their first bytes: the formats Pillow decodes where installed
_PILLOW_FIRST = {b"GIF87a": "gif", b"GIF89a": "gif", b"II*\x00": "tiff", b"MM\x00*": "tiff",
                 b"II+\x00": "tiff", b"MM\x00+": "tiff"}
_PILLOW: list[bool] = []  # whether Pillow imports, once looked up
_log = logger("feedpipe")


def _pillow_first(data: Any) -> str:
    """``"gif"`` or ``"tiff"`` from the first bytes, else ``"unknown"``."""
    head = bytes(data[:6])
    return _PILLOW_FIRST.get(head) or _PILLOW_FIRST.get(head[:4]) or "unknown"


def _have_pillow(fmt: str) -> bool:
    """Whether Pillow imports; the first time it does not, a warning says what OpenCV, which
    decodes GIF and TIFF images instead, does differently."""
    if not _PILLOW:
        try:
            import PIL  # noqa: F401
        except ImportError:
            _PILLOW.append(False)
            _log.warning(
                "feedpipe: Pillow is not installed, so OpenCV decodes GIF and TIFF images (a "
                "%s here): it paints a GIF's transparent pixels with the background colour and "
                "premultiplies a TIFF's unassociated alpha into its colours, where Pillow and "
                "torchvision keep the stored colours. Install Pillow with: pip install "
                "'feedpipe[images]' (said once per process)", _NAMES[fmt])
        else:
            _PILLOW.append(True)
    return _PILLOW[0]


# -- the decoders -------------------------------------------------------------------------
_AVIF: list[str | None] = []  # the AVIF decoder once chosen


def _avif_library() -> str | None:
    """``"pillow"`` where Pillow has its AVIF plugin, else ``"opencv"`` where OpenCV was built
    with libavif, else ``None``; looked up once."""
    if not _AVIF:
        choice: str | None = None
        try:
            from PIL import features

            if features.check("avif"):
                choice = "pillow"
        except ImportError:
            pass
        if choice is None:
            cv2 = opencv()
            built = cv2.getBuildInformation() if cv2 is not None else ""
            if re.search(r"^\s*AVIF:\s*(?!NO\b)\S", built, re.MULTILINE):
                choice = "opencv"
        _AVIF.append(choice)
    return _AVIF[0]


def _undecodable(data: Any, fmt: str, why: object = "") -> DecodeError:
    if fmt not in _NAMES:
        return DecodeError(f"not a JPEG, PNG, WebP, AVIF or HEIC image, nor another format "
                           f"OpenCV reads ({len(data)} bytes, starting {bytes(data[:8])!r})")
    why = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(why))
    return DecodeError(f"cannot decode this {_NAMES[fmt]} image ({len(data)} bytes)"
                       + (f": {why}" if why else "") + "; it is corrupt or truncated")


def _decode_opencv(data: Any, fmt: str) -> np.ndarray:
    cv2 = opencv()
    if cv2 is None:
        raise MissingDependencyError("decoding PNG and WebP images needs OpenCV. Install it "
                                     "with: pip install opencv-python-headless")
    buf = np.frombuffer(data, np.uint8)
    rgb = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.11
    flags = (cv2.IMREAD_COLOR if rgb is None else rgb) | cv2.IMREAD_IGNORE_ORIENTATION
    try:
        # feedpipe reports a corrupt image itself: libpng's and OpenCV's own lines would only
        # repeat it, on stderr, once per bad file
        with quiet_stderr():
            img = cv2.imdecode(buf, flags) if len(buf) else None
    except cv2.error as e:
        raise _undecodable(data, fmt, str(e).strip().splitlines()[-1]) from e
    if img is None:
        raise _undecodable(data, fmt)
    if rgb is None and img.ndim == 3 and img.shape[2] in (3, 4):
        img = img[:, :, 2::-1]
    return _rgb8(img, data, fmt)


def _rgb8(img: np.ndarray, data: Any, fmt: str) -> np.ndarray:
    """A decoder's output as HWC ``uint8`` RGB, whatever it gave: a 2-D grey image (OpenCV's
    for a grey PFM), one, two (grey and alpha) or four channels, 16-bit or float samples; the
    conversion is Pillow's ``convert("RGB")`` (grey replicated, alpha dropped, floats clipped
    to 0..255) but for 16 bits, which keep their high byte as everywhere in feedpipe. Any other
    shape is a DecodeError, never a tensor error further on."""
    if img.ndim == 2:
        img = img[:, :, None]
    if img.ndim != 3 or img.shape[2] not in (1, 2, 3, 4) or not img.shape[0] or not img.shape[1]:
        raise _undecodable(data, fmt, f"the decoder gave an array of shape {img.shape}, not an "
                                      "image of 1 to 4 channels")
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        if img.dtype.kind not in "fiub":
            raise _undecodable(data, fmt, f"the decoder gave {img.dtype} samples")
        img = np.clip(img, 0, 255).astype(np.uint8)
    if img.shape[2] < 3:
        return np.repeat(img[:, :, :1], 3, axis=2)
    return img if img.shape[2] == 3 else np.ascontiguousarray(img[:, :, :3])


def animated_png(data: Any) -> bool:
    """Whether PNG bytes are an animated PNG (APNG): an ``acTL`` chunk before the image data.

    Example:
        >>> import cv2, numpy as np
        >>> animated_png(cv2.imencode(".png", np.zeros((2, 2), np.uint8))[1].tobytes())
        False
    """
    view = memoryview(data)
    pos = len(_PNG)
    while pos + 8 <= len(view):
        kind = bytes(view[pos + 4:pos + 8])
        if kind == b"acTL":
            return True
        if kind == b"IDAT":
            return False
        pos += 12 + int.from_bytes(view[pos:pos + 4], "big")
    return False


def _decode_apng(data: Any) -> np.ndarray:
    """An animated PNG's default image (what Pillow, torchvision and libpng give; OpenCV gives
    the first animation frame, which differs when the default image is not part of the
    animation, and refuses some that Pillow reads)."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "decoding an animated PNG (APNG) to its default image, as Pillow and torchvision "
            "do, needs Pillow. Install it with: pip install 'feedpipe[images]'") from None
    return _decode_pillow(data, "png")


def _decode_pillow(data: Any, fmt: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.mode.startswith("I;16"):  # feedpipe's rule: the high byte (Pillow clips)
                return np.array(_rgb8(np.asarray(im).astype(np.uint16), data, fmt))
            rgb = im if im.mode == "RGB" else im.convert("RGB")
            return np.array(rgb)  # writable (np.asarray's view of Pillow's bytes is not)
    except (*_PIL_ERRORS, Image.DecompressionBombError) as e:  # type: ignore[misc]
        raise _undecodable(data, fmt, e) from e


def _decode_heif(data: Any) -> np.ndarray:
    heif = require("pillow_heif", extra="images", purpose="decoding HEIC/HEIF images")
    try:
        img = np.asarray(heif.open_heif(bytes(data), convert_hdr_to_8bit=True))
    except (*_PIL_ERRORS, RuntimeError) as e:  # type: ignore[misc]
        raise _undecodable(data, "heic", e) from e
    return np.array(_rgb8(img, data, "heic"))  # writable and contiguous


class DecodeImage:
    """Image bytes of any supported format to an HWC ``uint8`` RGB array (:func:`decode_image`):
    an op for :class:`~feedpipe.transforms._ops.Compose`, like
    :class:`~feedpipe.transforms._ops.DecodeJPEG`.

    Example:
        >>> import cv2, numpy as np
        >>> png = cv2.imencode(".png", np.zeros((5, 7), np.uint8))[1].tobytes()
        >>> DecodeImage()(png).shape
        (5, 7, 3)
    """

    def __call__(self, data: Any, rng: np.random.Generator | None = None) -> np.ndarray:
        return decode_image(data)

    def __repr__(self) -> str:
        return "DecodeImage()"
