"""Where bytes come from: local paths directly, everything else through fsspec.

The one place that decides whether a URL is local, and the one that makes remote reads: whole
objects (:func:`read_bytes`), sizes (:func:`size_of`), one byte range (:func:`read_range`) and
many byte ranges of one object fetched concurrently (:func:`read_ranges`), each retried
(:mod:`feedpipe._helpers.retry`) and counted (:mod:`feedpipe._helpers.remote_count`). Which
client reads a URL, set up for the link, is :mod:`feedpipe._helpers.storage_clients`; listings
are :mod:`feedpipe._helpers.storage_listing`.

**Concurrency.** A remote link is used well when bandwidth x round trip worth of bytes is in
flight; an object store also caps what one response streams (tens of MB/s), so a shard is read as
several concurrent ranges rather than one long response. Every range of this process passes one
:class:`~feedpipe._helpers.link_control.Gate`, which holds the ranges in flight to what a
:class:`~feedpipe._helpers.link_control.LinkController` measures the link needs (its bandwidth
times the time a range takes, over the range's bytes: more streams where each response is
capped), between ``FEEDPIPE_REMOTE_STREAMS_MIN`` (default 2) and ``FEEDPIPE_REMOTE_STREAMS``
(default 32), the ceiling; equal values fix the number. Ranges are about :data:`RANGE_BYTES`
(``FEEDPIPE_RANGE_BYTES``): each costs a round trip before its first byte, so they are as large
as keeps the streams busy (the measurement behind the default: benchmarks/bench_remote.py,
docs/performance.md). What the controller chose and measured is in ``stats()["io"]["link"]``.

fsspec is imported lazily so that
``import feedpipe`` stays light. feedpipe passes no storage options: each backend reads its usual
configuration (for ``s3://``: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``~/.aws``, and
``AWS_ENDPOINT_URL_S3`` for an S3-compatible server; fsspec's own config files and
``FSSPEC_<PROTOCOL>_<OPTION>`` variables work too). Remote reads are retried on transient
failures (:mod:`feedpipe._helpers.retry`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._redact import cause, redact_query
from ..errors import InputError, SourceNotFoundError
from .link_control import Gate, LinkController
from .storage_clients import env_int, ob_get, object_store, streams, streams_floor
from .storage_clients import filesystem as filesystem  # where callers have always found it
from .storage_clients import read_timeout as read_timeout


def is_local(url: str) -> bool:
    """Whether ``url`` is a plain path or a ``file://`` URL."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url.removeprefix("file://")


def split_query(url: str) -> tuple[str, str]:
    """``(url, "")`` for a local path (``?`` and ``#`` are file name characters there); for a
    remote URL, the URL without its query string and fragment, and them (``"?token=1#x"``), so
    that a dataset's objects are named under the path and each carries the same query.

    Example:
        >>> split_query("https://h/data/manifest.json?token=1"), split_query("a?b/c")
        (('https://h/data/manifest.json', '?token=1'), ('a?b/c', ''))
    """
    if is_local(url):
        return url, ""
    start = url.index("://") + 3
    cuts = [i for i in (url.find("?", start), url.find("#", start)) if i >= 0]
    return (url, "") if not cuts else (url[: min(cuts)], url[min(cuts):])


# query parameters of a URL signed for one object (S3 SigV4, GCS V4): no other object's
_ONE_OBJECT = ("x-amz-signature", "x-goog-signature")


def check_query(url: str) -> None:
    """Refuse a query string that cannot be carried to every object of a dataset: on a
    protocol other than HTTP(S) (for fsspec's S3 or GCS it is part of the object's name, or
    one object's version), or a signature that authorises one object only.

    Raises:
        InputError: naming the URL, its query and what to give instead.
    """
    base, query = split_query(url)
    if not query:
        return
    proto = base.split("://", 1)[0].lower()
    if proto not in ("http", "https"):
        raise InputError(
            f"{url}: a query string ({redact_query(query)!r}) on a {proto}:// URL: feedpipe "
            "carries a query to every object of a dataset over http(s) only; give the dataset's "
            "URL without it (credentials and options come from the backend's own configuration)")
    params = {p.split("=", 1)[0].lower() for p in query.lstrip("?").split("#")[0].split("&")}
    signed = sorted(params & set(_ONE_OBJECT))
    if signed:
        raise InputError(
            f"{url}: a URL signed for one object ({signed[0]}): feedpipe reads many objects "
            "(manifest.json, every shard and its index) and gives each the same query, which "
            "this signature does not cover; give a query that authorises the whole dataset (a "
            "token, a container SAS, a signed-cookie or policy URL), or read it through the "
            "storage's own protocol (s3://, gs://) with credentials")


def read_bytes(url: str, *, stop: Any = None) -> bytes:
    """The whole content of ``url`` (remote reads retried, see :mod:`feedpipe._helpers.retry`;
    ``stop`` cuts a retry's wait short)."""
    if is_local(url):
        try:
            with open(local_path(url), "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise SourceNotFoundError(f"{url}: no such file") from cause(e)
    from . import retry

    ob = object_store(url)
    if ob is not None:
        return retry.call(url, lambda: ob_get(ob, url), stop=stop)
    fs, path = filesystem(url)
    return bytes(retry.call(url, lambda: _whole(fs, path), stop=stop))


def size_of(url: str) -> int:
    if is_local(url):
        return os.path.getsize(local_path(url))
    from . import retry

    fs, path = filesystem(url)
    return retry.call(url, lambda: int(fs.size(path)))


def open_binary(url: str) -> Any:
    """``url`` opened for reading bytes as a stream (a local file, or fsspec's file object,
    whose opening is retried)."""
    if is_local(url):
        return open(local_path(url), "rb")
    from . import retry

    fs, path = filesystem(url)
    return retry.call(url, lambda: fs.open(path, "rb"))


def read_range(fs: Any, path: str, url: str, start: int, end: int, *, whole: bool = False,
               stop: Any = None) -> bytes:
    """Bytes ``[start, end)`` of a remote object, retried; a short or long answer is an error.

    A server that ignores ``Range`` answers with the whole object: that must never pass for the
    requested bytes. ``whole=True`` (the range is the entire object) asks with a plain request,
    which such a server serves correctly.
    """
    from ..errors import ShardFormatError

    blob = _raw(fs, path, url, start, end, whole=whole, stop=stop)
    if len(blob) > end - start:
        raise ShardFormatError(
            f"{url}: asked for bytes {start}-{end - 1}, the server sent {len(blob)} bytes: it "
            "ignores Range requests (as `python -m http.server` does), so shards cannot be read "
            "from it in pieces. Read them through the shard cache, which fetches each shard "
            "whole: FeedDataset(url, cache_dir=...) (cache_dir=True: ~/.cache/feedpipe/shards)"
        )
    if len(blob) < end - start:
        raise ShardFormatError(
            f"{url}: read at offset {start} returned {len(blob)} bytes instead of "
            f"{end - start}: the object is truncated (shorter than the manifest says)"
        )
    return blob


RANGE_BYTES = 4 << 20  # the size of one range request, about (FEEDPIPE_RANGE_BYTES)


def range_target() -> int:
    """The size a range request aims at (``FEEDPIPE_RANGE_BYTES``, default 4 MiB)."""
    return env_int("FEEDPIPE_RANGE_BYTES", RANGE_BYTES)


def range_bytes(total: int) -> int:
    """The range size for an object of ``total`` bytes: the object cut into equal ranges of about
    :func:`range_target` (an 8 MB shard: two of 4 MB), so that no short tail costs a round
    trip of its own."""
    parts = max(1, -(-total // range_target()))
    return max(1, -(-total // parts))


_pool_lock = threading.Lock()
_pool: list[Any] = []  # [ThreadPoolExecutor, Gate, pid]


def _executor() -> tuple[ThreadPoolExecutor, Gate]:
    """This process's pool of range fetchers (as many threads as the ceiling) and the gate that
    holds them to the controller's target (a forked child makes its own: threads do not survive
    a fork, and its link is measured afresh)."""
    with _pool_lock:
        if not _pool or _pool[2] != os.getpid():
            ceiling = streams()
            floor = streams_floor()
            control = LinkController(floor=floor, ceiling=ceiling, start=min(ceiling, 8))
            _pool[:] = [ThreadPoolExecutor(ceiling, thread_name_prefix="feedpipe-fetch"),
                        Gate(control), os.getpid()]
            _say_streams(control)
        return _pool[0], _pool[1]


_said: list[int] = []


def _say_streams(control: LinkController) -> None:
    if _said:
        return
    _said.append(1)
    from .._redact import logger

    if control.floor == control.ceiling:
        how = f"fixed at {control.ceiling} (FEEDPIPE_REMOTE_STREAMS_MIN = FEEDPIPE_REMOTE_STREAMS)"
    else:
        how = (f"follow the link between {control.floor} and {control.ceiling} "
               "(FEEDPIPE_REMOTE_STREAMS_MIN, FEEDPIPE_REMOTE_STREAMS; equal values fix it)")
    logger("feedpipe").info("feedpipe: remote range requests in flight %s", how)


def link_figures() -> tuple[int, int, int, int]:
    """``(target, bandwidth bytes/s, shortest response in microseconds, 1)`` from this
    process's range controller; zeros before it measured a range."""
    with _pool_lock:
        gate = _pool[1] if _pool and _pool[2] == os.getpid() else None
    if gate is None:
        return 0, 0, 0, 0
    with gate.cond:
        c = gate.control
        if not c.completions:
            return 0, 0, 0, 0
        f = c.figures()
        return int(f["target"]), int(f["bandwidth"]), int(f["rtt"] * 1e6), 1


def ranges_of(start: int, end: int, size: int = RANGE_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ranges of ``size`` bytes (the last one shorter).

    Example:
        >>> ranges_of(0, 5, 2)
        [(0, 2), (2, 4), (4, 5)]
    """
    return [(a, min(end, a + size)) for a in range(start, end, max(1, size))]


def read_ranges(url: str, ranges: list[tuple[int, int]], *, stop: Any = None,
                size: int | None = None) -> Ranges:
    """The byte ranges ``[a, b)`` of the remote object ``url``, fetched concurrently (up to
    :func:`streams` in flight for the whole process) and yielded in order, each retried and
    checked as :func:`read_range` checks it. The first ones are asked for at once, before the
    caller iterates (it may do other work meanwhile: fetch an index, reserve room). ``size``:
    the object's size, when the caller knows it: a first range answered with the whole object
    (a server that ignores ``Range``) is then yielded alone, as the object, and nothing else is.

    :meth:`Ranges.close` (or an error, or ``stop`` set) cancels the ranges not yet under way.
    """
    return Ranges(url, ranges, stop, size)


class Ranges:
    """The ranges of one object under way (:func:`read_ranges`): iterate for their bytes."""

    def __init__(self, url: str, ranges: list[tuple[int, int]], stop: Any,
                 size: int | None) -> None:
        self.url, self.ranges, self.stop, self.size = url, ranges, stop, size
        self.fs: Any = None
        self.path = ""
        if ranges and object_store(url) is None:
            self.fs, self.path = filesystem(url)
        self.tolerant = size is not None and bool(ranges) and ranges[0][0] == 0
        self.closed = False
        self.futures: list[Future[bytes] | None] = []
        self.pool: ThreadPoolExecutor | None = None
        self.gate: Gate | None = None
        if ranges:
            self.pool, self.gate = _executor()
        for _ in range(min(streams(), len(ranges))):
            self._submit()

    def _submit(self) -> None:
        assert self.pool is not None
        self.futures.append(self.pool.submit(self._get, len(self.futures)))

    def _get(self, i: int) -> bytes:
        """Range ``i``, once the gate gives it a place among the requests in flight."""
        assert self.gate is not None
        ticket = self.gate.enter()
        got = 0
        try:
            if self.closed:  # closed while this range waited for its place: nobody wants it
                return b""
            blob = self._fetch(i)
            got = len(blob)
            return blob
        finally:
            self.gate.leave(ticket, got)

    def _fetch(self, i: int) -> bytes:
        a, b = self.ranges[i]
        if i == 0 and self.tolerant:
            return _raw(self.fs, self.path, self.url, a, b, whole=b - a == self.size,
                        stop=self.stop)
        return read_range(self.fs, self.path, self.url, a, b, whole=(a, b) == (0, self.size),
                          stop=self.stop)

    def __iter__(self) -> Iterator[bytes]:
        ranges = self.ranges
        try:
            for i in range(len(ranges)):
                f = self.futures[i]
                assert f is not None
                blob = f.result()
                self.futures[i] = None  # its bytes go with the caller
                if i == 0 and self.tolerant and len(blob) != ranges[0][1] - ranges[0][0]:
                    if len(blob) == self.size:
                        yield blob
                        return
                    read_range(self.fs, self.path, self.url, *ranges[0], stop=self.stop)
                yield blob
                if len(self.futures) < len(ranges):
                    self._submit()
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the ranges not yet under way and wait for those under way (their bytes
        unread), so that nothing of this object is in flight once it returns."""
        from concurrent.futures import wait

        self.closed = True
        running = [f for f in self.futures if f is not None and not f.cancel()]
        self.futures = [None] * len(self.futures)
        wait(running)


def _raw(fs: Any, path: str, url: str, start: int, end: int, *, whole: bool,
         stop: Any) -> bytes:
    from . import retry

    ob = object_store(url) if fs is None else None
    if ob is not None:
        return retry.call(url, lambda: ob_get(ob, url, None if whole else (start, end)),
                          stop=stop)
    if fs is None:
        fs, path = filesystem(url)
    if whole:
        return retry.call(url, lambda: _whole(fs, path), stop=stop)
    return bytes(retry.call(url, lambda: fs.cat_file(path, start=start, end=end), stop=stop))


def _whole(fs: Any, path: str) -> bytes:
    """A whole object in one GET. s3fs first asks an object's size with a HEAD when it reads it
    whole (to split it): over a long round trip that doubles the time and the requests of every
    small object (an index, a manifest). An open-ended range (``bytes=0-``) is one GET; an empty
    object, which answers it with 416, is read plainly."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not {"s3", "s3a"} & set(protocols):
        return bytes(fs.cat_file(path))
    try:
        return bytes(fs.cat_file(path, start=0))
    except Exception as e:
        from .retry import error_chain, status_of

        if any(status_of(x) == 416 or "InvalidRange" in str(x) for x in error_chain(e)):
            return bytes(fs.cat_file(path))
        raise


def read_whole(url: str, size: int, *, stop: Any = None) -> bytes:
    """The whole remote object ``url`` of ``size`` bytes (the manifest's: no request asks for
    it), in concurrent ranges (:func:`read_ranges`)."""
    return b"".join(read_ranges(url, ranges_of(0, size, range_bytes(size)), stop=stop,
                                size=size))

