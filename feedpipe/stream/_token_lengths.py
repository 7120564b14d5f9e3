"""Where the documents of a token shard lie, from its ``.lengths.npy`` alone.

``feedpipe shard --tokenizer`` writes each document as one tar member ``<key>.tokens.npy`` of a
short name (one 512-byte header), holding a 128-byte ``.npy`` header and the tokens, padded to
512 bytes, and beside the shard ``<stem>.lengths.npy``, each document's token count (the format
is in ``shards/README.md``). From those counts and the dtype (the first member's ``.npy``
header) every document's offset follows by a prefix sum, so a reader plans packed rows without
parsing the shard's index or one header per document. The layout is taken only where it adds
up: the first member is the field asked for with the count its lengths entry gives, the shard
holds as many samples as the lengths, and the members' sizes sum to the shard's size exactly;
otherwise the caller reads the index and the headers as for any shard.
"""

from __future__ import annotations

import io
import os

import numpy as np

from .._helpers.storage import is_local, local_path

_BLOCK = 512
_NPY_HEADER = 128
_END = 2 * _BLOCK  # the tar's end-of-archive blocks


def lengths_path(shard_path: str) -> str:
    """``.../data-000000.tar`` -> ``.../data-000000.lengths.npy``."""
    stem = shard_path[:-4] if shard_path.endswith(".tar") else shard_path
    return f"{stem}.lengths.npy"


def layout(shard_path: str, buffer: object, size: int, count: int,
           field: str) -> tuple[np.ndarray, np.ndarray, np.dtype] | None:
    """Each document's token data offset and token count, and the dtype, of the local token
    shard ``shard_path`` (mapped as ``buffer``, ``size`` bytes, ``count`` samples), from its
    lengths file; ``None`` where there is none or the shard is not laid out as one says."""
    if not count or buffer is None or not is_local(shard_path):
        return None
    path = lengths_path(local_path(shard_path))
    if not os.path.exists(path):
        return None
    try:
        lengths = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if lengths.ndim != 1 or len(lengths) != count or not np.issubdtype(lengths.dtype, np.integer):
        return None
    buf = memoryview(buffer)  # type: ignore[arg-type]
    if size < _BLOCK + _NPY_HEADER:
        return None
    name = bytes(buf[:100]).split(b"\0", 1)[0]
    if not name.endswith(b"." + field.encode()) or bytes(buf[156:157]) not in (b"0", b"\0"):
        return None
    try:
        f = io.BytesIO(bytes(buf[_BLOCK:_BLOCK + _NPY_HEADER]))
        if np.lib.format.read_magic(f) != (1, 0):
            return None
        shape, fortran, dt = np.lib.format.read_array_header_1_0(f)
    except (ValueError, SyntaxError, OSError):
        return None
    if (f.tell() != _NPY_HEADER or fortran or len(shape) != 1 or shape[0] != lengths[0]
            or not np.issubdtype(dt, np.integer)):
        return None
    lengths = lengths.astype(np.int64, copy=False)
    data = _NPY_HEADER + lengths * dt.itemsize
    step = _BLOCK + (data + _BLOCK - 1) // _BLOCK * _BLOCK
    ends = np.cumsum(step)
    if int(ends[-1]) + _END != size:
        return None
    starts = ends - step + _BLOCK + _NPY_HEADER
    return starts, lengths, dt
