"""The host's side of the DALI stage (:mod:`~feedpipe.transforms._dali`): the batch as fed to
DALI (:class:`Fed`, fed again without a sample DALI failed on), what the host makes of an image
DALI failed on or cannot read as fed (a JPEG repaired as libjpeg reads it, an animated PNG's
default image), the columns of a batch, and the guard that keeps DALI pipelines alive in forked
children.
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from .._redact import logger
from ..errors import DecodeError, MissingDependencyError
from ._decode import decode_image, image_format
from ._jpeg import repaired_jpeg
from ._opencv import opencv

log = logger("feedpipe")


class Fed(NamedTuple):
    """A batch fed to DALI: what it was fed, and what is needed to name a sample of it or to
    feed it again without one (after DALI failed to decode that sample)."""

    state: dict[str, Any] | None  # the loader's state after this batch
    arrays: tuple[Any, ...]  # encode_batch's
    keys: list[Any]
    shards: list[Any]
    retried: bool = False  # fed again once, its JPEGs repaired as libjpeg reads them

    def without(self, i: int) -> Fed:
        data, *columns = self.arrays
        arrays = (data[:i] + data[i + 1:], *(np.delete(c, i, axis=0) for c in columns))
        return Fed(self.state, arrays, self.keys[:i] + self.keys[i + 1:],
                    self.shards[:i] + self.shards[i + 1:], self.retried)


def host_bytes(data: Any) -> bytes | None:
    """What the host makes of an image DALI failed on: ``None`` where it decodes as it is,
    a JPEG repaired as libjpeg reads it (``repaired_jpeg``) where only that made it fail; a
    DecodeError where it does not decode on the host either."""
    raw = bytes(data)
    if image_format(raw) == "jpeg":
        return repaired_jpeg(raw)
    decode_image(raw)
    return None


_TOLD_APNG: list[bool] = []


def default_image_png(data: Any) -> np.ndarray:
    """An animated PNG's default image, decoded on the host as the CPU pipeline decodes it
    (with Pillow), as the bytes of a plain PNG for DALI. DALI's decoder gives an APNG's first
    animation frame, and refuses some APNGs that Pillow reads; Pillow and torchvision give the
    default image. Re-encoded losslessly, so DALI decodes exactly the CPU pipeline's pixels."""
    rgb = decode_image(data)
    cv2 = opencv()
    if cv2 is None:  # pragma: no cover - OpenCV is a dependency
        raise MissingDependencyError("re-encoding an animated PNG's default image for DALI "
                                     "needs OpenCV. Install it with: pip install "
                                     "opencv-python-headless")
    ok, png = cv2.imencode(".png", np.ascontiguousarray(rgb[:, :, ::-1]),
                           [cv2.IMWRITE_PNG_COMPRESSION, 1])
    if not ok:  # pragma: no cover - a decoded 8-bit RGB image always encodes
        raise DecodeError("OpenCV could not re-encode an animated PNG's default image")
    if not _TOLD_APNG:
        _TOLD_APNG.append(True)
        log.info("feedpipe: DaliStage decodes animated PNGs (APNG) on the host with Pillow, to "
                 "their default image as the CPU pipeline does, and feeds DALI that image "
                 "(DALI would give the first animation frame); said once per process")
    return np.asarray(png, np.uint8).reshape(-1)


class HeaderSkipped(Exception):
    """Sample ``i`` of a batch has an image header that does not read (on_error="skip")."""

    def __init__(self, i: int, message: str) -> None:
        super().__init__(message)
        self.i, self.message = i, message


def drop_row(column: Any, i: int) -> Any:
    """A batch column without its row ``i`` (a list or a tensor; other values as they are)."""
    if isinstance(column, torch.Tensor) and column.dim() > 0:
        return torch.cat([column[:i], column[i + 1:]])
    if isinstance(column, (list, tuple)):
        return [*column[:i], *column[i + 1:]]
    return column


DALI_FAILED = re.compile(r"Failed to decode sample #(\d+)[^\n]*")


def int_column(batch: Any, key: str, n: int, default: int) -> np.ndarray:
    v = batch.get(key) if isinstance(batch, dict) else None
    if v is None:
        return np.full(n, default, dtype=np.int64)
    if isinstance(v, torch.Tensor):
        return v.reshape(-1).numpy().astype(np.int64, copy=False)
    return np.asarray(v, dtype=np.int64).reshape(-1)


BUILT: weakref.WeakSet[Any] = weakref.WeakSet()  # the pipelines this module has built
_KEPT: list[Any] = []  # in a forked child: every pipeline alive at the fork, never finalised
_HOOKED = False


def keep_pipelines_in_forked_children() -> None:
    """Make every process forked from here keep the DALI pipelines it inherits alive.

    A forked child has none of DALI's threads, so a pipeline finalised there (by the garbage
    collector: ``Pipeline.__del__`` calls ``Shutdown``) crashes it. Any child forked later is
    at risk, a process pool's worker started long after the pipeline was dropped as much as a
    DataLoader's. So the guard is on fork itself: the child holds a reference to each pipeline
    (those built here and those DALI tracks) and exits without finalising them.
    """
    global _HOOKED
    if _HOOKED or not hasattr(os, "register_at_fork"):
        return

    def in_child() -> None:
        from nvidia.dali import Pipeline

        tracked = (ref() for ref in list(getattr(Pipeline, "_pipes", ())))
        _KEPT.extend({id(p): p for p in (*BUILT, *tracked) if p is not None}.values())

    os.register_at_fork(after_in_child=in_child)
    _HOOKED = True
