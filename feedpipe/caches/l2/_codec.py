"""A safe binary codec for memoised values: no pickle, ever.

Encodes ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``-likes, numpy arrays, torch
tensors (CPU copies, via numpy), and ``tuple``/``list``/``dict`` (str keys) of those. Decoding
never executes code: a damaged or hostile record raises :class:`ValueError`, nothing else.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

(_NONE, _TRUE, _FALSE, _INT, _FLOAT, _STR, _BYTES, _ARRAY, _TENSOR, _TUPLE, _LIST, _DICT,
 _SCALAR) = range(13)
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


def _put_blob(out: list[bytes], b: bytes | memoryview) -> None:
    out.append(_U32.pack(len(b)))
    out.append(b if isinstance(b, bytes) else bytes(b))


def _enc(v: Any, out: list[bytes]) -> None:
    if v is None:
        out.append(bytes([_NONE]))
    elif v is True:
        out.append(bytes([_TRUE]))
    elif v is False:
        out.append(bytes([_FALSE]))
    elif isinstance(v, int):
        if -(2**63) <= v < 2**63:
            out.append(bytes([_INT]) + _I64.pack(v))
        else:
            raise TypeError(f"integer {v} does not fit in 64 bits")
    elif isinstance(v, float):
        out.append(bytes([_FLOAT]) + _F64.pack(v))
    elif isinstance(v, str):
        out.append(bytes([_STR]))
        _put_blob(out, v.encode("utf-8"))
    elif isinstance(v, (bytes, bytearray, memoryview)):
        out.append(bytes([_BYTES]))
        _put_blob(out, bytes(v))
    elif isinstance(v, np.ndarray):
        _enc_array(v, out, _ARRAY)
    elif isinstance(v, np.generic):
        _enc_array(np.asarray(v), out, _SCALAR)
    elif type(v).__module__.startswith("torch") and hasattr(v, "numpy"):
        _enc_array(v.detach().cpu().numpy(), out, _TENSOR)
    elif isinstance(v, (tuple, list)):
        out.append(bytes([_TUPLE if isinstance(v, tuple) else _LIST]) + _U32.pack(len(v)))
        for x in v:
            _enc(x, out)
    elif isinstance(v, dict):
        out.append(bytes([_DICT]) + _U32.pack(len(v)))
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(f"dict keys must be str to be stored, not {type(k).__name__}")
            _put_blob(out, k.encode("utf-8"))
            _enc(x, out)
    else:
        raise TypeError(
            f"cannot store a {type(v).__name__}: memoised functions may return None, bool, int, "
            "float, str, bytes, numpy arrays, torch tensors, and tuples/lists/dicts of those"
        )


def _enc_array(a: np.ndarray, out: list[bytes], tag: int) -> None:
    if a.dtype.hasobject:
        raise TypeError("object arrays cannot be stored")
    a = np.ascontiguousarray(a)
    out.append(bytes([tag]))
    _put_blob(out, a.dtype.str.encode("ascii"))
    out.append(_U32.pack(a.ndim) + b"".join(_I64.pack(d) for d in a.shape))
    _put_blob(out, a.tobytes())


def encode(value: Any) -> bytes:
    """Serialise ``value``.

    Example:
        >>> decode(encode({"x": (1, 2.5, "a", b"b", None)}))
        {'x': (1, 2.5, 'a', b'b', None)}
    """
    out: list[bytes] = []
    _enc(value, out)
    return b"".join(out)


class _Reader:
    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError("record truncated")
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def blob(self) -> memoryview:
        return self.take(self.u32())


def _dec(r: _Reader, depth: int = 0) -> Any:
    if depth > 64:
        raise ValueError("record nested too deeply")
    tag = r.take(1)[0]
    if tag == _NONE:
        return None
    if tag == _TRUE:
        return True
    if tag == _FALSE:
        return False
    if tag == _INT:
        return _I64.unpack(r.take(8))[0]
    if tag == _FLOAT:
        return _F64.unpack(r.take(8))[0]
    if tag == _STR:
        return bytes(r.blob()).decode("utf-8")
    if tag == _BYTES:
        return bytes(r.blob())
    if tag in (_ARRAY, _TENSOR, _SCALAR):
        dtype = np.dtype(bytes(r.blob()).decode("ascii"))
        if dtype.hasobject:
            raise ValueError("object dtype in record")
        ndim = r.u32()
        shape = tuple(_I64.unpack(r.take(8))[0] for _ in range(ndim))
        data = r.blob()
        a = np.frombuffer(bytes(data), dtype=dtype).reshape(shape)
        if tag == _SCALAR:
            return a[()]
        if tag == _TENSOR:
            import torch

            return torch.from_numpy(a.copy())
        return a
    if tag in (_TUPLE, _LIST):
        n = r.u32()
        items = [_dec(r, depth + 1) for _ in range(n)]
        return tuple(items) if tag == _TUPLE else items
    if tag == _DICT:
        n = r.u32()
        return {bytes(r.blob()).decode("utf-8"): _dec(r, depth + 1) for _ in range(n)}
    raise ValueError(f"unknown tag {tag}")


def decode(buf: bytes | memoryview) -> Any:
    """Inverse of :func:`encode`; raises ``ValueError`` on a damaged record."""
    r = _Reader(buf)
    try:
        v = _dec(r)
    except (struct.error, UnicodeDecodeError, TypeError) as e:
        raise ValueError(f"damaged record: {e}") from e
    if r.pos != len(r.buf):
        raise ValueError("trailing bytes in record")
    return v
