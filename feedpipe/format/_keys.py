"""Sample keys and member names: the WebDataset rule and feedpipe's reversible key encoding.

WebDataset splits a tar member path into ``key`` (everything up to the first ``.`` of the last
path component) and ``extension`` (the rest). Source files such as ``a/cat.v2.jpg`` would be
split in the wrong place. So feedpipe encodes the stem of a source path into a key with no ``.``
in its last component and no whitespace (the DALI index is space-separated):

- ``%`` -> ``%25``;
- ``.`` (last component only) -> ``%2E``;
- whitespace, control characters and ``\\`` -> ``%XX`` (a backslash is an ordinary file-name
  character on POSIX; folding it into ``/`` would merge ``a\\b.jpg`` with ``a/b.jpg``).

The encoding is injective, so two different source stems never clash. :func:`source_path` turns
a key and an extension back into the source's relative path.

All functions here are pure.
"""

from __future__ import annotations

import re

_NEEDS_ESCAPE = re.compile(r"[%\\\s\x00-\x1f\x7f]")
# a path that matches nothing of it is its own key (but for dots in its last component)
NEEDS_ESCAPE = _NEEDS_ESCAPE


def _escape(text: str, *, dots: bool) -> str:
    def sub(m: re.Match[str]) -> str:
        return "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8"))

    out = _NEEDS_ESCAPE.sub(sub, text)
    if dots:
        out = out.replace(".", "%2E")
    return out


def encode_key(stem: str) -> str:
    """Encode a relative source stem (``dir/name`` without extension) into a sample key.

    Example:
        >>> encode_key("a/cat.v2")
        'a/cat%2Ev2'
        >>> encode_key("my dir/100% done")
        'my%20dir/100%25%20done'
    """
    head, sep, last = stem.rpartition("/")
    if _NEEDS_ESCAPE.search(stem) is None:  # the common case, without two substitutions
        return head + sep + last.replace(".", "%2E") if "." in last else stem
    return (_escape(head, dots=False) + sep if sep else "") + _escape(last, dots=True)


_PCT = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def decode_key(key: str) -> str:
    """Invert :func:`encode_key`.

    Example:
        >>> decode_key("a/cat%2Ev2")
        'a/cat.v2'
    """
    return _PCT.sub(lambda m: bytes.fromhex(m.group(0).replace("%", "")).decode("utf-8"), key)


def source_path(key: str, ext: str) -> str:
    """The relative source path a ``(key, ext)`` pair was made from.

    Args:
        key: a sample key (``__key__``), as ``feedpipe shard`` encoded it.
        ext: a field name (the member's extension).

    Example:
        >>> source_path("a/cat%2Ev2", "jpg")
        'a/cat.v2.jpg'
    """
    return f"{decode_key(key)}.{ext}"


def split_member(name: str) -> tuple[str, str]:
    """Split a tar member name by the WebDataset rule into ``(key, extension)``.

    Example:
        >>> split_member("a.b/c.d.e")
        ('a.b/c', 'd.e')
    """
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def split_source(relpath: str) -> tuple[str, str]:
    """Split a source file's relative path into ``(stem, extension)`` at its *last* dot.

    ``cls/0001.jpg`` and ``cls/0001.json`` share the stem ``cls/0001``; ``a/cat.v2.jpg`` has stem
    ``a/cat.v2`` and extension ``jpg``. A name without a dot (or only a leading one) has no
    extension and returns ``""``.

    Example:
        >>> split_source("a/cat.v2.jpg")
        ('a/cat.v2', 'jpg')
    """
    slash = relpath.rfind("/")
    dot = relpath.rfind(".")
    if dot <= slash + 1:
        return relpath, ""
    return relpath[:dot], relpath[dot + 1 :]


def valid_extension(ext: str) -> bool:
    """Whether ``ext`` can be a field name: non-empty, no whitespace, no slash, no ``%``."""
    return bool(ext) and not _NEEDS_ESCAPE.search(ext) and "/" not in ext
