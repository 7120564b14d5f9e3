"""A sample dict as the tar members that store it (:class:`SampleEncoder`): its key encoded by
the key rule, each field name checked (a str, valid UTF-8, a tar member extension, no two equal
but for case, which WebDataset readers take in lower case), ``cls`` checked against the class
names, and each value made bytes by :mod:`~feedpipe.convert._field_encoding`. Shared by
:class:`feedpipe.ShardWriter` and the table sources of ``feedpipe shard``
(:mod:`~feedpipe.convert._table_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

from ..errors import InputError
from ..format._keys import encode_key, valid_extension
from ._field_encoding import Encoder, encode_field
from ._sources import printable


def check_key(key: Any, where: str) -> str:
    """The encoded form of the sample key ``key`` (see the module docstring), or a refusal."""
    if not isinstance(key, str):
        raise InputError(f"{where}'__key__' must be a str, not {type(key).__name__}; e.g. "
                         "f'{index:08d}' or a relative path")
    _check_utf8(key, f"{where}key", "'__key__'")
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in key:
        raise InputError(f"{where}key {key!r} is not a relative path of non-empty names (no "
                         "leading '/', no '.' or '..', no '//', no NUL); give a key like "
                         "'train/00000012'")
    return encode_key(key)


def _check_utf8(text: str, what: str, fix: str) -> None:
    """Refuse ``text`` (a key or field name) that cannot be a UTF-8 tar member name: a lone
    surrogate, as ``os.fsdecode`` makes of a file name's bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"{what} '{printable(text)}' holds {text[e.start]!r} at position {e.start}, which "
            "is not valid UTF-8 (a file name's bytes that are not UTF-8, decoded by os.fsdecode?): "
            f"tar member names are UTF-8; give {fix} as valid text, e.g. "
            "name.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')"
        ) from None


class SampleEncoder:
    """A sample dict as the tar members that store it: its encoded key and ``(field, bytes)``
    pairs, every check of :meth:`ShardWriter.write` made (the key, each field name, ``cls``
    against ``classes``); shared by the writer and the table source of ``feedpipe shard``."""

    def __init__(self, classes: Sequence[str] | None = None,
                 encoders: Mapping[str, Encoder] | None = None) -> None:
        self.classes = None if classes is None else [str(c) for c in classes]
        self._class_index = {c: i for i, c in enumerate(self.classes or ())}
        self.encoders = dict(encoders or {})

    def encode(self, sample: Mapping[str, Any], n: int) -> tuple[str, list[tuple[str, bytes]]]:
        """The key and members of ``sample``, the ``n``-th (named so in errors)."""
        where = f"sample #{n} ({sample.get('__key__')!r}): "
        if "__key__" not in sample:
            raise InputError(f"sample #{n}: no '__key__'; every sample needs a unique key")
        key = check_key(sample["__key__"], where)
        blobs: list[tuple[str, bytes]] = []
        folded: dict[str, str] = {}  # field name in lower case -> the field
        for ext, value in sample.items():
            if not isinstance(ext, str):
                raise InputError(f"{where}field name {ext!r} is a {type(ext).__name__}, not a "
                                 "str; field names are extensions such as 'jpg' or 'cls'")
            if ext.startswith("__") and ext.endswith("__"):
                continue
            _check_utf8(ext, f"{where}field", "the field name")
            if not valid_extension(ext) or ext.startswith("."):
                raise InputError(f"{where}field {ext!r} cannot be a tar member extension (no "
                                 "spaces, '/', '%' or leading '.'); rename it")
            other = folded.setdefault(ext.lower(), ext)
            if other != ext:
                raise InputError(f"{where}fields {other!r} and {ext!r} differ only in case: "
                                 "WebDataset readers take extensions in lower case and cannot "
                                 "read a sample holding both; rename one of them")
            if ext == "cls":
                value = self._cls(value, where)
            data = encode_field(ext, value, self.encoders, where)
            if data is not None:
                blobs.append((ext, data))
        if not blobs:
            meta = [k for k in sample if isinstance(k, str) and k.startswith("__")
                    and k.endswith("__") and k != "__key__"]
            raise InputError(f"{where}no field to store (every value is None or there is none"
                             + (f"; {', '.join(map(repr, meta))}: a name between double "
                                "underscores is metadata, like '__key__', never stored: "
                                "rename it" if meta else "") + ")")
        return key, blobs

    def _cls(self, value: Any, where: str) -> Any:
        """The ``cls`` value to store (unless an encoder is given for ``cls``): a number of any
        form (``int``, a NumPy integer or float, ``7.0``) as its ``int``, a non-integral one
        refused; with ``classes`` given, a class name becomes its index, and an index must be
        one of the classes'."""
        if "cls" in self.encoders:
            return value
        if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
            value = value.item()  # (a 0-d array or NumPy scalar: its Python number)
        if isinstance(value, Real) and not isinstance(value, bool):
            if not isinstance(value, Integral):
                number = float(value)
                if not number.is_integer():
                    raise InputError(f"{where}cls {value!r} is not an integer: a class label is "
                                     "a class index (or, with classes=, a class name); fix "
                                     "the label")
            value = int(value)  # type: ignore[call-overload]  # (stored as 7, never 7.0)
        if self.classes is None:
            return value
        n = len(self.classes)
        if isinstance(value, str):
            if value not in self._class_index:
                shown = ", ".join(map(repr, self.classes[:8])) + (", ..." if n > 8 else "")
                raise InputError(f"{where}cls {value!r} is not one of the {n} classes [{shown}]; "
                                 "give a class name of the list, or its index")
            return self._class_index[value]
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < n:
            raise InputError(f"{where}cls {value} is not an index into the {n} classes given; "
                             "fix the label or the class list")
        return value
