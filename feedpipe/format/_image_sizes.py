"""Each image's width and height, kept beside its shard so that planning by shape (aspect-ratio
buckets, :class:`~feedpipe.Bucketed`) never decodes an image.

``feedpipe shard`` (and :class:`~feedpipe.ShardWriter`) write ``<stem>.sizes.npy`` beside each
shard holding images: an ``int32`` array of shape ``(samples, 2)``, each sample's ``(width,
height)`` read from its first image field's header (:data:`IMAGE_FIELDS` order), ``(-1, -1)``
where the sample has no image or its header is not one this module reads. A dataset sharded
before the sizes were recorded gets them once from :func:`record_image_sizes`, which reads the
same headers from the shards.

The headers are parsed here (JPEG's start-of-frame marker, PNG's ``IHDR``, WebP's ``VP8``,
``VP8L`` and ``VP8X`` chunks, GIF, BMP), without Pillow, which is an optional extra; another
format is opened lazily by Pillow (its header only) where Pillow is installed. The headers of a
shard are read by the C extension ``feedpipe._native._stagefiles`` where it was built (the same
parse; a header it does not read is left to this module), else here.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._helpers.dependency import say_unbuilt
from .._helpers.storage import is_local, local_path
from .._redact import logger
from ..errors import InputError
from ._image_fields import IMAGE_FIELDS, image_extension
from ._manifest import join
from ._sidecars import (
    new_rows,
    read_sidecar,
    record_beside,
    sidecar_path,
    write_sidecar,
)

if TYPE_CHECKING:
    import numpy as np

log = logger("feedpipe.sizes")

try:  # optional C extension (setup.py): the per-image header parse of index_sizes
    from .._native import _stagefiles as _C
except ImportError:  # pragma: no cover - where it did not build, Python reads every header
    _C = None

# the JPEG start-of-frame markers (baseline, extended, progressive, lossless, arithmetic)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE,
                  0xCF})
NO_SIZE = (-1, -1)


def sizes_path(shard_path: str) -> str:
    """``.../data-000000.tar`` -> ``.../data-000000.sizes.npy``."""
    return sidecar_path(shard_path, ".sizes.npy")


def _jpeg(b: memoryview) -> tuple[int, int] | None:
    i, n = 2, len(b)
    while i + 9 < n:
        if b[i] != 0xFF:
            return None
        m = b[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
            continue
        if m in (0x01, 0xD8) or 0xD0 <= m <= 0xD7:  # markers without a length
            i += 2
            continue
        length = (b[i + 2] << 8) | b[i + 3]
        if m in _SOF:
            h, w = struct.unpack(">HH", b[i + 5:i + 9])
            return (w, h) if w and h else None
        i += 2 + length
    return None


def _webp(b: memoryview) -> tuple[int, int] | None:
    chunk = bytes(b[12:16])
    if chunk == b"VP8 " and len(b) >= 30:
        w, h = struct.unpack("<HH", b[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and len(b) >= 25:
        v = int.from_bytes(b[21:25], "little")
        return (v & 0x3FFF) + 1, ((v >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(b) >= 30:
        return (int.from_bytes(b[24:27], "little") + 1, int.from_bytes(b[27:30], "little") + 1)
    return None


def header_size(data: Any) -> tuple[int, int] | None:
    """``(width, height)`` of an encoded image from its header, without decoding it; ``None``
    where the header is not one this module reads (nor Pillow, where it is installed).

    Example:
        >>> import struct, zlib
        >>> ihdr = struct.pack(">IIBBBBB", 640, 480, 8, 2, 0, 0, 0)
        >>> png = b"\\x89PNG\\r\\n\\x1a\\n" + struct.pack(">I", 13) + b"IHDR" + ihdr
        >>> header_size(png)
        (640, 480)
    """
    b = memoryview(data).cast("B")
    head = bytes(b[:12])
    size: tuple[int, int] | None = None
    if head[:2] == b"\xff\xd8":
        size = _jpeg(b)
    elif head[:8] == b"\x89PNG\r\n\x1a\n" and len(b) >= 24:
        size = struct.unpack(">II", b[16:24])
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        size = _webp(b)
    elif head[:6] in (b"GIF87a", b"GIF89a"):
        size = struct.unpack("<HH", head[6:10])
    elif head[:2] == b"BM" and len(b) >= 26:
        w, h = struct.unpack("<ii", b[18:26])
        size = (w, abs(h))
    if size is None:
        size = _pillow_size(b)
    return None if size is None else (int(size[0]), int(size[1]))


def _pillow_size(b: memoryview) -> tuple[int, int] | None:
    try:
        from PIL import Image
    except ImportError:
        return None
    try:
        with Image.open(io.BytesIO(b)) as im:  # lazy: reads the header only
            return im.size
    except Exception:  # noqa: BLE001 (any format Pillow does not read: no size)
        return None


def image_member(exts: Sequence[str]) -> int | None:
    """Which of a sample's member extensions is its image (:data:`IMAGE_FIELDS` order, any
    case), or ``None``."""
    lowered = [e.lower() for e in exts]
    for f in IMAGE_FIELDS:
        if f in lowered:
            return lowered.index(f)
    for k, e in enumerate(exts):
        if image_extension(e) is not None:
            return k
    return None


def index_sizes(buffer: Any, idx: Any, members: list[int] | None = None) -> tuple[array, int]:
    """Each sample's ``(width, height)`` in a shard mapped as ``buffer`` whose index is
    ``idx`` (a :class:`~feedpipe.format._index.ShardIndex`), flat (``int32``, two values a
    sample), and how many samples with an image field have no size (a header not read); of the
    samples whose image members are ``members`` (:func:`image_members`; all, by default)."""
    members = image_members(idx) if members is None else members
    if _C is None:
        say_unbuilt(log, "_native._stagefiles", "image sizes are read from their headers by "
                    "Python", "the sizes are the same")
        return python_sizes(buffer, idx, members)
    pairs, fallback = _C.image_sizes(buffer, members, idx.offsets, idx.sizes)
    out = array("i")
    out.frombytes(pairs)
    # what the built-in parsers do not read (Pillow's formats): read here
    return out, _read_here(buffer, idx, members, fallback, out) if fallback else 0


def image_members(idx: Any) -> list[int]:
    """Each sample's image member in the shard indexed by ``idx`` (an index into its member
    lists), ``-1`` where it has none."""
    member: dict[tuple[str, ...], int | None] = {}  # a shard's samples mostly share their fields
    starts, exts = idx.starts, idx.exts
    out = []
    for i in range(len(idx)):
        a = starts[i]
        fields = tuple(exts[a:starts[i + 1]])
        k = member[fields] if fields in member else member.setdefault(fields,
                                                                       image_member(fields))
        out.append(-1 if k is None else a + k)
    return out


def python_sizes(buffer: Any, idx: Any, members: list[int]) -> tuple[array, int]:
    """:func:`index_sizes` read by Python alone (where ``feedpipe._native._stagefiles`` was not
    built), of the image ``members``."""
    out = new_rows("i", len(members), 2, -1)
    return out, _read_here(buffer, idx, members, [i for i, m in enumerate(members) if m >= 0],
                           out)


def _read_here(buffer: Any, idx: Any, members: list[int], samples: list[int],
               out: array) -> int:
    """Read the image headers of ``samples`` (positions in ``members``) by Python into
    ``out``'s rows; how many were not read."""
    buf = memoryview(buffer)
    unread = 0
    for i in samples:
        m = members[i]
        off = idx.offsets[m]
        got = header_size(buf[off:off + idx.sizes[m]])
        if got is None:
            unread += 1
        else:
            out[2 * i], out[2 * i + 1] = got
    return unread


def has_images(idx: Any) -> bool:
    """Whether any member of the shard indexed by ``idx`` is an image."""
    return any(image_extension(e) is not None for e in idx.fields())


def write_sizes(path: str, sizes: array) -> None:
    """Write a sizes file (:func:`index_sizes`' rows) atomically (a reader never sees half of
    one)."""
    write_sidecar(path, sizes, 2)


def sizes_of_file(tar_path: str, idx: Any) -> tuple[array, int]:
    """:func:`index_sizes` of the local shard file ``tar_path``."""
    if not len(idx):
        return new_rows("i", 0, 2, -1), 0
    with open(tar_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return _sizes_let_go(m, idx)
        finally:
            del m


RELEASE_BYTES = 1 << 20  # about this much of the shard is read before its pages are let go


def _sizes_let_go(m: mmap.mmap, idx: Any) -> tuple[array, int]:
    """:func:`index_sizes` over the map ``m`` of a whole shard, each header faulted in without
    read-around, and the pages of each run of samples (about :data:`RELEASE_BYTES` of the shard)
    let go once read: a touch maps the whole large folio a page of a file just written sits in,
    so the headers alone would bring the shard into the converter's memory."""
    if hasattr(m, "madvise"):
        m.madvise(mmap.MADV_RANDOM)
    members = image_members(idx)
    every = max(1, RELEASE_BYTES * len(members) // max(1, len(m)))  # samples a run
    out, unread = array("i"), 0
    for lo in range(0, len(members), every):
        part = members[lo:lo + every]
        rows, bad = index_sizes(m, idx, part)
        out.extend(rows)
        unread += bad
        images = [k for k in part if k >= 0]
        if images and hasattr(m, "madvise"):
            start = idx.offsets[images[0]] // mmap.PAGESIZE * mmap.PAGESIZE
            end = min(len(m), idx.offsets[images[-1]] + idx.sizes[images[-1]])
            if end > start:
                m.madvise(mmap.MADV_DONTNEED, start, end - start)
    return out, unread


def record_shard_sizes(out_dir: str, name: str, tar_path: str, idx: Any) -> None:
    """At shard time: write ``name``'s sizes file in ``out_dir`` (the sealed shard still at
    ``tar_path``), where the shard holds images; a header not read is said in a log record
    (``INFO``: only a reader bucketing by shape needs the sizes, and it warns)."""
    if not has_images(idx):
        return
    sizes, unread = sizes_of_file(tar_path, idx)
    if unread:  # said where it matters too: a Bucketed over them warns it leaves them out
        log.info("%s: %d image(s) of an unread header format have no recorded size "
                 "(-1, -1 in %s); bucketing by shape leaves them out",
                 os.path.join(out_dir, name), unread, os.path.basename(sizes_path(name)))
    write_sizes(sizes_path(os.path.join(out_dir, name)), sizes)


def record_image_sizes(root: str, *, overwrite: bool = False) -> dict[str, int]:
    """Record each image's size beside the shards of the local dataset ``root`` that were
    sharded before ``feedpipe shard`` recorded them (a one-time scan of the image headers; no
    image is decoded). A shard whose sizes file exists is left as it is unless ``overwrite``.

    Returns ``{"shards": shards scanned, "images": sizes recorded, "unread": images whose header
    was not read}``; what it did is said in a log record.

    Raises:
        InputError: ``root`` is not a local directory (the sizes are written beside the shards).
    """
    if not is_local(root):
        raise InputError(f"{root}: image sizes are recorded beside the shards, in a local "
                         "directory; record them where the dataset is written, then copy it")
    root = local_path(root)
    scanned, images, unread = record_beside(root, ".sizes.npy", 2, sizes_of_file,
                                            overwrite=overwrite)
    log.info("%s: recorded the image sizes of %d shard(s) (%d images, %d unread headers) "
             "beside them as <shard>.sizes.npy", root, scanned, images, unread)
    return {"shards": scanned, "images": images, "unread": unread}


def load_sizes(root: str, manifest: Any) -> np.ndarray:
    """Every sample's ``(width, height)`` of a dataset (local or remote), in global id order
    (an ``int32`` array of shape ``(total_samples, 2)``, ``-1`` where unknown).

    Raises:
        InputError: a shard has no sizes file, or one of another length (the message says to
            run :func:`~feedpipe.record_image_sizes`).
    """
    import numpy as np

    parts = []
    for rec in manifest.shards:
        path = join(root, sizes_path(rec.name))
        try:
            a = read_sidecar(path)
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: no image sizes recorded for shard {rec.name} ({e}); "
                             "run feedpipe.record_image_sizes(dataset) once to record "
                             "them") from e
        if a.shape != (rec.samples, 2):
            raise InputError(f"{path}: {a.shape[0] if a.ndim else 0} sizes for the "
                             f"{rec.samples} samples of {rec.name}; run "
                             "feedpipe.record_image_sizes(dataset, overwrite=True)")
        parts.append(a.astype(np.int32, copy=False))
    if not parts:
        return np.zeros((0, 2), dtype=np.int32)
    return np.concatenate(parts)
