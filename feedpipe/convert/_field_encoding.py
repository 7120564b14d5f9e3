"""How a Python value becomes the bytes of a sample field (what :class:`feedpipe.ShardWriter`
stores), without pickle.

================================  ==============================================================
value                             stored as
================================  ==============================================================
``bytes``, ``bytearray``,         the bytes as they are
``memoryview``
``str``                           UTF-8
``int``, ``float``                their text, ``str(value)`` (as webdataset writes ``cls``)
NumPy integer or float scalar     the text of the Python number
NumPy array                       the ``.npy`` format (``numpy.save``, ``allow_pickle=False``:
                                  object arrays are refused)
``None``                          nothing: the sample has no such field
anything else                     refused, unless an encoder is given for the field
================================  ==============================================================

An encoder (``encoders={"json": lambda v: json.dumps(v).encode()}``) takes the field's value and
returns bytes; it is used for that field whatever the value's type.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import FieldTypeError

Encoder = Callable[[Any], Any]


def encode_field(ext: str, value: Any, encoders: Mapping[str, Encoder] | None = None,
                 where: str = "") -> bytes | None:
    """The bytes of field ``ext`` holding ``value`` (see the module docstring); ``None`` for a
    ``None`` value. ``where`` names the sample in errors.

    Example:
        >>> encode_field("cls", 3), encode_field("txt", "chat"), encode_field("x", b"\\x00")
        (b'3', b'chat', b'\\x00')
    """
    fn = encoders.get(ext) if encoders else None
    if fn is not None:
        data = fn(value)
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data)
        raise FieldTypeError(f"{where}field {ext!r}: its encoder returned "
                             f"{type(data).__name__}, not bytes; make it return bytes")
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool):
        raise FieldTypeError(f"{where}field {ext!r}: a bool is ambiguous as text (True or 1?); "
                             "store int(value) or str(value)")
    if isinstance(value, (int, float)):
        return str(value).encode("ascii")
    if type(value).__module__ == "numpy":
        return _numpy(ext, value, where)
    raise FieldTypeError(
        f"{where}field {ext!r}: cannot store a {type(value).__module__}.{type(value).__name__} "
        "without a codec (no pickle by default); pass bytes, str, a number or a NumPy array "
        f"(a torch tensor: .numpy()), or give an encoder: encoders={{{ext!r}: fn}} with fn "
        "returning bytes")


def _numpy(ext: str, value: Any, where: str) -> bytes:
    import numpy as np

    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        try:
            np.save(buf, value, allow_pickle=False)
        except ValueError as e:  # an object array
            raise FieldTypeError(f"{where}field {ext!r}: a NumPy array of dtype {value.dtype} "
                                 "needs pickle to be stored; convert it to a numeric dtype or "
                                 "give an encoder") from e
        return buf.getvalue()
    if isinstance(value, (np.integer, np.floating)):
        return str(value.item()).encode("ascii")
    if isinstance(value, np.bool_):
        return encode_field(ext, bool(value), None, where) or b""
    raise FieldTypeError(f"{where}field {ext!r}: cannot store a NumPy {type(value).__name__} "
                         "without a codec; give an encoder")
