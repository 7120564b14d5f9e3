"""One entry of the L2 function index: its key and the bytes it stores.

The key is ``fingerprint(function) + content_hash(input)``. :func:`content_hash` is xxh3-128:
it runs on every sample the memo sees, hits included, so it must cost little next to the
decoding it saves (benchmarks/bench_hash.py).

The stored bytes are a record: a magic, the xxh64 of the payload, the key of the sample that
stored it (its *origin*, to count inputs shared by several samples), then the payload in the safe
codec of :mod:`feedpipe.caches.l2._codec` (never pickle). A record whose checksum fails is refused,
and the value is computed again.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from ._codec import decode, encode

MAGIC = b"FPL2"
_HEAD = struct.Struct("<4sQH")  # magic, xxh64 of payload, length of origin key


def content_hash(data: Any, fields: Sequence[str] | None = None) -> bytes:
    """xxh3-128 of the input.

    Bytes are hashed as they are. For a sample dict, the named fields (default: every field not
    starting with ``__``) are hashed in sorted order, each with its name and length. Anything
    else goes through the codec.

    Args:
        data: bytes, a sample dict, or any value the codec stores.
        fields: for a sample dict, the fields to hash.

    Example:
        >>> content_hash({"jpg": b"x", "__key__": "a"}) == content_hash({"jpg": b"x"})
        True
    """
    import xxhash

    h = xxhash.xxh3_128()
    if isinstance(data, (bytes, bytearray, memoryview)):
        h.update(data)
    elif isinstance(data, dict):
        names = sorted(fields if fields is not None
                       else (k for k in data if not k.startswith("__")))
        for k in names:
            v = data[k]
            b = v if isinstance(v, (bytes, bytearray, memoryview)) else encode(v)
            h.update(f"{k}\0{len(b)}\0".encode())
            h.update(b)
    else:
        h.update(encode(data))
    return h.digest()


def pack(value: Any, origin: str | None) -> bytes:
    """The record of ``value``, stored first by the sample ``origin``.

    Example:
        >>> unpack(pack([1, "a"], "k1"))
        ([1, 'a'], 'k1')
    """
    import xxhash

    payload = encode(value)
    o = (origin or "").encode("utf-8")[:65535]
    return _HEAD.pack(MAGIC, xxhash.xxh64_intdigest(payload), len(o)) + o + payload


def unpack(raw: bytes) -> tuple[Any, str]:
    """``(value, origin)`` of a record; ``ValueError`` when it is damaged."""
    import xxhash

    if len(raw) < _HEAD.size:
        raise ValueError("short record")
    magic, check, olen = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError("bad magic")
    payload = raw[_HEAD.size + olen :]
    if xxhash.xxh64_intdigest(payload) != check:
        raise ValueError("checksum mismatch")
    return decode(payload), raw[_HEAD.size : _HEAD.size + olen].decode("utf-8", "replace")
