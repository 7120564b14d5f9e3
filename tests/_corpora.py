"""The vendored real corpora of ``tests/corpora/`` (files other projects made, see its README) and
the reference readers the differential tests compare feedpipe with."""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path

import numpy as np

CORPORA = Path(__file__).parent / "corpora"
PILLOW = CORPORA / "pillow"
WEBDATASET = CORPORA / "webdataset"


def vendored(corpus: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of a corpus, from its ``SHA256SUMS``."""
    out = {}
    for line in (corpus / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        out[name] = digest
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pillow_pixels(data: bytes) -> np.ndarray:
    """The reference decode: the HWC ``uint8`` RGB pixels Pillow gives for ``data``.

    ``Image.open(...).convert("RGB")``, as torchvision's ``ImageFolder`` loads images
    (``torchvision.datasets.folder.pil_loader``): no EXIF transpose (neither ``pil_loader`` nor
    ``torchvision.io.decode_image``, whose ``apply_exif_orientation`` defaults to False, applies
    it), alpha dropped, palettes expanded (the colour of a transparent palette index is kept).

    One departure, which follows feedpipe's documented rule instead: 16-bit grey (Pillow modes
    ``I;16*``) is scaled to 8 bits by its high byte (libpng's stripping, also what Pillow does
    to 16-bit RGB PNGs), where Pillow's ``convert("RGB")`` clips every value above 255 to white.

    Raises:
        Whatever Pillow raises for data it refuses (``OSError``, ``SyntaxError``, ...).
    """
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Pillow's advice to its own users
        with Image.open(io.BytesIO(data)) as im:
            if im.mode.startswith("I;16"):
                grey = (np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8)
                return np.repeat(grey[:, :, None], 3, axis=2)
            return np.asarray(im.convert("RGB"))


def centre_square(img: np.ndarray) -> np.ndarray:
    """The centred square of the shorter side: the window of an evaluation ``ImageSpec`` with
    ``crop_fraction=1`` (``ImageSpec.geometry``)."""
    h, w = img.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return img[top:top + side, left:left + side]
