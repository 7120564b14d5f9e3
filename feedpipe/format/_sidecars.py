"""Per-shard sidecar arrays: a ``.npy`` file beside each shard with one row per sample (image
sizes, video frame counts), written atomically at shard time or by a one-time scan of a dataset
sharded before, and read back by a planner that must not open the samples themselves.

What each sidecar holds, and how a row is computed, is its own module's business
(:mod:`._image_sizes`, :mod:`._video_frames`); the file handling they share is here.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._helpers.storage import is_local, local_path, open_binary
from ._index import index_from_tar, index_path, parse_index
from ._manifest import load_manifest, write_manifest
from ._sidecar_list import sidecar_name

if TYPE_CHECKING:
    import numpy as np

# The rows are written from an array.array, without numpy: a conversion that writes sidecars
# (every shard of images) then loads no numpy, whose import costs more than a small shard's
# writing (benchmarks/bench_versions.py, its convert phases).
_DESCR = {"i": "<i4", "d": "<f8"}


def sidecar_path(shard_path: str, suffix: str) -> str:
    """``.../data-000000.tar`` -> ``.../data-000000<suffix>`` (``suffix`` like ``.sizes.npy``)."""
    return sidecar_name(shard_path, suffix)


def new_rows(typecode: str, samples: int, width: int, fill: float) -> array:
    """``samples`` rows of ``width`` values ``fill``, flat, for :func:`write_sidecar`
    (``typecode`` ``"i"``: int32, ``"d"``: float64)."""
    return array(typecode, [fill]) * (samples * width)


def npy_bytes(rows: array, width: int) -> bytes:
    """The ``.npy`` file (format 1.0, C order) of ``rows`` read as shape ``(len // width,
    width)``, as ``np.load`` reads it.

    Example:
        >>> import io, numpy as np
        >>> np.load(io.BytesIO(npy_bytes(array("i", [1, 2, 3, 4, 5, 6]), 2))).tolist()
        [[1, 2], [3, 4], [5, 6]]
    """
    descr = _DESCR[rows.typecode]
    if rows.itemsize != int(descr[2:]):
        raise TypeError(f"array typecode {rows.typecode!r} is {rows.itemsize} bytes here")
    shape = (len(rows) // width, width)
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    pad = -(10 + len(header) + 1) % 64  # the data starts at a multiple of 64, as np.save's
    head = (header + " " * pad + "\n").encode("latin1")
    if sys.byteorder != "little":
        rows = array(rows.typecode, rows)
        rows.byteswap()
    return b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + rows.tobytes()


def write_sidecar(path: str, rows: array, width: int) -> None:
    """Write a sidecar file of ``rows`` (flat, ``width`` values a row) atomically (a reader
    never sees half of one)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(npy_bytes(rows, width))
    os.replace(tmp, path)


def read_sidecar(path: str) -> np.ndarray:
    """The array in the sidecar file at ``path`` (local or remote).

    Raises:
        OSError: it cannot be read (missing included).
        ValueError: it is not a ``.npy`` array without pickles.
    """
    import numpy as np

    if is_local(path):
        return np.load(local_path(path), allow_pickle=False)
    with open_binary(path) as f:
        return np.load(io.BytesIO(f.read()), allow_pickle=False)


def read_mapped(tar_path: str, rows_of: Callable[[Any, Any], Any], idx: Any) -> Any:
    """``rows_of(map, idx)`` over the local shard file ``tar_path`` mapped read-only; no view of
    the map outlives the call."""
    with open(tar_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return rows_of(m, idx)
        finally:
            del m


def local_index(tar_path: str) -> Any:
    """The index of the local shard ``tar_path``: its ``.idx`` file, else a scan of the tar."""
    ipath = index_path(tar_path)
    if os.path.exists(ipath):
        with open(ipath, "rb") as f:
            return parse_index(f.read(), ipath)
    with open(tar_path, "rb") as f:
        return index_from_tar(f, os.path.getsize(tar_path), tar_path)


def record_beside(root: str, suffix: str, width: int,
                  rows_of_file: Callable[[str, Any], tuple[array, int]], *,
                  overwrite: bool) -> tuple[int, int, int]:
    """Write each shard's sidecar (``suffix``) of the local dataset ``root``, computed by
    ``rows_of_file(tar_path, index) -> (rows, unread)`` (rows flat, ``width`` values each); a
    shard whose sidecar exists is left as it is unless ``overwrite``. Returns ``(shards
    scanned, rows recorded, rows unread)``, a row counting as recorded where its first column is
    not negative. The manifest is written again to list the new files (:mod:`._sidecar_list`)."""
    scanned = recorded = unread = 0
    manifest = load_manifest(root)
    for rec in manifest.shards:
        tar = os.path.join(root, rec.name)
        out = sidecar_path(tar, suffix)
        if os.path.exists(out) and not overwrite:
            continue
        rows, bad = rows_of_file(tar, local_index(tar))
        write_sidecar(out, rows, width)
        scanned += 1
        recorded += sum(1 for v in rows[::width] if v >= 0)
        unread += bad
    if scanned:  # the manifest lists the files beside the shards, these too
        write_manifest(root, manifest)
    return scanned, recorded, unread
