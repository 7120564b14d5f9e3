"""The probe's calls to a remote store (``feedpipe probe URL``): listing, sizes, whole objects and
byte ranges, each one request as fsspec makes it.

Unlike the reads of :mod:`feedpipe._helpers.storage`, nothing here is retried, counted in the
process's remote account or checked for length: the probe times the storage itself, and a retry
or a wait inside a timed read would report a figure the storage did not give. The errors are
fsspec's own (``FileNotFoundError``, ``PermissionError``, a transport error), which the probe
words for the user.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .storage_clients import filesystem


class RawStore:
    """The storage under a remote URL, addressed by paths in it (fsspec's: no protocol).

    Example:
        >>> from feedpipe._helpers.storage_io import remove_tree, write_bytes
        >>> write_bytes("memory://feedpipe-probe-doc/d/a.bin", b"abcdef")
        >>> store, path = RawStore.of("memory://feedpipe-probe-doc/d")
        >>> list(store.listing(path)), store.read(path + "/a.bin", 2, 4)
        ([[('/feedpipe-probe-doc/d/a.bin', 6)]], b'cd')
        >>> remove_tree("memory://feedpipe-probe-doc")
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    @classmethod
    def of(cls, url: str) -> tuple[RawStore, str]:
        """The store under ``url`` and ``url``'s path in it."""
        fs, path = filesystem(url)
        return cls(fs), path

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes ``[start, end)`` (all of it by default), in one request."""
        # fsspec's bytes as they are: a copy would be timed as the storage's
        if start is None and end is None:
            return self._fs.cat_file(path)
        return self._fs.cat_file(path, start=start, end=end)

    def open(self, path: str) -> Any:
        """The object opened for reading bytes as a stream."""
        return self._fs.open(path, "rb")

    def size(self, path: str) -> int:
        return int(self._fs.size(path))

    def exists(self, path: str) -> bool:
        return bool(self._fs.exists(path))

    def info(self, path: str) -> dict[str, Any]:
        """What the storage says of ``path`` (``type``: ``file``/``directory``, ``size``)."""
        return dict(self._fs.info(path))

    def listing(self, root: str) -> Iterator[list[tuple[str, int]]]:
        """``(path, size)`` of the files below ``root``, one list per directory as the storage
        walks them (each in name order), so that a caller may stop between two directories."""
        for _, _, files in self._fs.walk(root, detail=True):
            yield [(info["name"], int(info.get("size") or 0))
                   for info in (files[name] for name in sorted(files))
                   if info.get("type", "file") == "file"]
