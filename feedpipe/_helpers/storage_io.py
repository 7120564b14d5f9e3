"""Storage calls beside the one-shot reads of :mod:`feedpipe._helpers.storage`: a remote object
held for many reads, and writing to a store.

- :class:`RemoteFile`: one remote object that a reader holds (the shard reader without a cache):
  its client resolved once, its size asked (retried), opened as a stream, and its byte ranges
  read and checked by :func:`~feedpipe._helpers.storage.read_range`;
- :func:`read_span`: one byte range of a remote object, asked alone (a sample read before its
  shard has arrived); :func:`read_spans`: several of one object at once (a first batch's
  samples of one shard);
- :func:`write_bytes` and :func:`remove_tree`: an object written, a tree removed (``feedpipe
  demo`` fills a ``memory://`` store that stands in for a remote one).

The probe's timed calls, which go to the storage without retries on purpose, are
:mod:`feedpipe._helpers.storage_probe`.
"""

from __future__ import annotations

from typing import Any

from .remote_count import REMOTE
from .storage import read_range
from .storage_clients import filesystem, object_store


class RemoteFile:
    """One remote object (an fsspec URL) read many times.

    Example:
        >>> write_bytes("memory://feedpipe-doc/a.bin", b"abcdef")
        >>> f = RemoteFile("memory://feedpipe-doc/a.bin")
        >>> f.size(), f.read(1, 4)
        (6, b'bcd')
        >>> with f.open() as stream:
        ...     stream.read()
        b'abcdef'
        >>> remove_tree("memory://feedpipe-doc")
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._fs, self._path = filesystem(url)

    def size(self) -> int:
        """The object's size in bytes, asked of the storage (retried on transient failures;
        a missing object is :class:`~feedpipe.errors.SourceNotFoundError`)."""
        from . import retry

        return retry.call(self.url, lambda: int(self._fs.size(self._path)))

    def open(self) -> Any:
        """The object opened for reading bytes as a stream (fsspec's file object, which reads
        ahead in blocks), for a scan or a hash of the whole object."""
        return self._fs.open(self._path, "rb")

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, retried and checked for length
        (:func:`~feedpipe._helpers.storage.read_range`)."""
        return read_range(self._fs, self._path, self.url, start, end)


def read_span(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the remote object ``url`` in one range request through the
    client the process reads ``url`` with (obstore where chosen for it, else fsspec), retried
    and checked for length (:func:`~feedpipe._helpers.storage.read_range`)."""
    if end <= start:
        return b""
    fs, path = (None, "") if object_store(url) is not None else filesystem(url)
    return read_range(fs, path, url, start, end)


def gathers(url: str) -> bool:
    """Whether :func:`read_spans` asks for ``url``'s ranges together (through fsspec: one
    hand-off to its event loop for all of them); through obstore each range is its own call,
    best made from threads of their own."""
    return object_store(url) is None


def read_spans(url: str, spans: list[tuple[int, int]]) -> list[bytes]:
    """Bytes ``[a, b)`` of the remote object ``url`` for each of ``spans``, each in its own
    range request, all under way at once. Through fsspec they go to its event loop in one
    hand-off (its ``cat_ranges``) rather than one a range, each from a thread waiting on it;
    a range that failed there or came back short or long is asked again alone, retried and
    checked (:func:`read_span`), which raises its error if it persists."""
    if not gathers(url) or len(spans) < 2:
        return [read_span(url, a, b) for a, b in spans]
    fs, path = filesystem(url)
    for _ in spans:  # counted as retry.call counts each request (stats()["io"])
        REMOTE.begin()
    got = fs.cat_ranges([path] * len(spans), [a for a, _ in spans], [b for _, b in spans],
                        on_error="return")
    for g in got:
        REMOTE.end(g if isinstance(g, bytes) else None)
    return [g if isinstance(g, bytes) and len(g) == b - a else _again(url, a, b, g)
            for g, (a, b) in zip(got, spans)]


def _again(url: str, start: int, end: int, first: object) -> bytes:
    """A range of :func:`read_spans` asked again alone (:func:`read_span`); after a failed
    request the new one is a retry, counted as such."""
    blob = read_span(url, start, end)
    if not isinstance(first, bytes):
        REMOTE.retried()
    return blob


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` as the object ``url`` (created, or replaced)."""
    fs, path = filesystem(url)
    fs.pipe_file(path, data)


def remove_tree(url: str) -> None:
    """Remove ``url`` and everything under it."""
    fs, path = filesystem(url)
    fs.rm(path, recursive=True)
