"""Where bytes come from: local paths directly, everything else through fsspec.

The one place that decides whether a URL is local, and the one that makes remote calls: whole
objects (:func:`read_bytes`), sizes (:func:`size_of`), one byte range (:func:`read_range`) and
many byte ranges of one object fetched concurrently (:func:`read_ranges`), each retried
(:mod:`feedpipe._helpers.retry`) and counted (:mod:`feedpipe._helpers.remote_count`).

**Concurrency.** A remote link is used well when bandwidth x round trip worth of bytes is in
flight; an object store also caps what one response streams (tens of MB/s), so a shard is read as
several concurrent ranges rather than one long response. Every range of this process goes through
one pool of :func:`streams` threads (``FEEDPIPE_REMOTE_STREAMS``, default 16): with ranges of
about :data:`RANGE_BYTES` (4 MiB, ``FEEDPIPE_RANGE_BYTES``) that is 64 MiB in flight, the
bandwidth x round trip of 200 MB/s at 300 ms, or 16 capped responses at once (16 x 25 MB/s).
Each range costs a round trip before its first byte, so ranges are as large as keeps the
streams busy: fewer, larger ranges measured faster than many 1 MiB ones (docs/performance.md).
Raise the streams for a longer or faster link, or a lower cap per response.

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


_fork_hook = False
_INHERITED: list[Any] = []  # in a forked child: the parent's HTTP connection pools, never closed


def _leave_parent_connections_alone() -> None:
    """After a fork, in the child: never close the parent's HTTP connections.

    A fork shares the parent's epoll set. In a forked DataLoader worker, each of these
    unregisters the parent's sockets from that shared set:

    - fsspec's async filesystems (HTTP, s3) close their aiohttp session when collected (a
      ``weakref.finalize``);
    - fsspec drops its cached instances in a process with a new pid;
    - an aiohttp connector closes its pooled connections when collected.

    The parent's next request on a pooled connection would then wait forever. So: disarm those
    finalizers, and keep the inherited connectors and sessions referenced for the child's
    lifetime (worker processes end with ``os._exit``).
    """
    import gc
    import sys
    import weakref

    collecting = gc.isenabled()
    gc.disable()  # a collection here would run finalizers that change the registry we walk
    try:
        registry = getattr(weakref.finalize, "_registry", {})
        for f, info in list(registry.items()):
            if getattr(info.func, "__name__", "") == "close_session":
                f.detach()
        aiohttp = sys.modules.get("aiohttp")
        if aiohttp is not None:
            kinds = (aiohttp.BaseConnector, aiohttp.ClientSession)
            _INHERITED.extend(o for o in gc.get_objects() if issubclass(type(o), kinds))
    finally:
        if collecting:
            gc.enable()


def read_timeout() -> float:
    """Seconds a response may send nothing before it is given up and retried
    (``FEEDPIPE_READ_TIMEOUT``, default 30)."""
    try:
        return max(0.1, float(os.environ.get("FEEDPIPE_READ_TIMEOUT", "30")))
    except ValueError:
        return 30.0


def _link_options(url: str) -> dict[str, Any]:
    """Options feedpipe gives a backend. s3fs (botocore) keeps 10 connections per client by
    default, which would queue the rest of :func:`streams`: it gets as many. aiohttp (fsspec's
    ``http(s)://``) waits up to 5 minutes for a response that has stopped sending: it gets a
    :func:`read_timeout` between reads instead (and no cap on a whole long download), so that a
    stalled response is retried. What the user configured for fsspec (``FSSPEC_S3_CONFIG_KWARGS``,
    ``FSSPEC_HTTP_CLIENT_KWARGS``, fsspec's config files) is kept."""
    import fsspec.config

    proto = url.split("://", 1)[0].lower()
    conf = fsspec.config.conf
    if proto in ("s3", "s3a"):
        given = dict(conf.get(proto, {}).get("config_kwargs") or {})
        given.setdefault("max_pool_connections", max(10, streams()))
        options: dict[str, Any] = {"config_kwargs": given}
        if not {"session", "profile", "key", "secret", "token"} & set(conf.get(proto, {})):
            options["session"] = _s3_session()
        return options
    if proto in ("http", "https"):
        import aiohttp

        client = dict(conf.get(proto, {}).get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=30,
                                                           sock_read=read_timeout()))
        return {"client_kwargs": client}
    return {}


_s3_sessions: dict[tuple[tuple[str, str], ...], Any] = {}  # AWS_* environment -> AioSession
_s3_loader: list[Any] = []  # botocore's loader of its JSON models, shared by those sessions


def _s3_session() -> Any:
    """The botocore session s3fs clients of this process are made from, one per ``AWS_*``
    environment (credentials and profile are resolved as s3fs would: from the environment or
    ``~/.aws``, when a client is made).

    s3fs otherwise makes a session per filesystem, and a filesystem per process: each one decodes
    botocore's JSON models (the S3 service, its endpoint rules) before its first request, a
    fraction of a second of CPU, again in every DataLoader worker. Made here, before the workers
    fork, the session and its loaded models are inherited, so a worker's first request waits for
    the round trip only. A user who configures fsspec's s3 ``session``, ``profile`` or keys keeps
    s3fs's own session (see :func:`_link_options`)."""
    import aiobotocore.session

    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    with _pool_lock:
        session = _s3_sessions.get(key)
        if session is None:
            session = aiobotocore.session.AioSession()
            if not _s3_loader:
                _s3_loader.append(session.get_component("data_loader"))
            session.register_component("data_loader", _s3_loader[0])
            _s3_sessions[key] = session
        return session


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` for ``url``; a missing backend names its pip line."""
    import fsspec

    from .dependency import install_hint

    global _fork_hook
    if not _fork_hook:  # registered on first use, not at import
        _fork_hook = True
        os.register_at_fork(after_in_child=_leave_parent_connections_alone)

    try:
        fs, path = fsspec.core.url_to_fs(url, **_link_options(url))
    except ImportError as e:
        proto = url.split("://", 1)[0]
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}.get(proto)
        from ..errors import MissingDependencyError

        raise MissingDependencyError(
            f"{url}: the fsspec backend for {proto}:// is not installed ({e}). Install it with: "
            f"{install_hint(proto, extra)}"
        ) from cause(e)
    return fs, path


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
        return retry.call(url, lambda: _ob_get(ob, url), stop=stop)
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


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


def range_target() -> int:
    """The size a range request aims at (``FEEDPIPE_RANGE_BYTES``, default 4 MiB)."""
    return _env_int("FEEDPIPE_RANGE_BYTES", RANGE_BYTES)


def range_bytes(total: int) -> int:
    """The range size for an object of ``total`` bytes: the object cut into equal ranges of about
    :func:`range_target` (an 8 MB shard: two of 4 MB), so that no short tail costs a round
    trip of its own."""
    parts = max(1, -(-total // range_target()))
    return max(1, -(-total // parts))


def streams() -> int:
    """Requests this process keeps in flight at most (``FEEDPIPE_REMOTE_STREAMS``, default 16)."""
    return _env_int("FEEDPIPE_REMOTE_STREAMS", 16)


_pool_lock = threading.Lock()
_pool: list[Any] = []  # [ThreadPoolExecutor, pid]


def _executor() -> ThreadPoolExecutor:
    """This process's pool of range fetchers (a forked child makes its own: threads do not
    survive a fork)."""
    with _pool_lock:
        if not _pool or _pool[1] != os.getpid():
            _pool[:] = [ThreadPoolExecutor(streams(), thread_name_prefix="feedpipe-fetch"),
                        os.getpid()]
        return _pool[0]


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
        self.futures: list[Future[bytes] | None] = []
        self.pool = _executor() if ranges else None
        for _ in range(min(streams(), len(ranges))):
            self._submit()

    def _submit(self) -> None:
        assert self.pool is not None
        self.futures.append(self.pool.submit(self._get, len(self.futures)))

    def _get(self, i: int) -> bytes:
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

        running = [f for f in self.futures if f is not None and not f.cancel()]
        self.futures = [None] * len(self.futures)
        wait(running)


def _raw(fs: Any, path: str, url: str, start: int, end: int, *, whole: bool,
         stop: Any) -> bytes:
    from . import retry

    ob = object_store(url) if fs is None else None
    if ob is not None:
        return retry.call(url, lambda: _ob_get(ob, url, None if whole else (start, end)),
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


# -- s3:// through obstore ---------------------------------------------------------------------
_stores: dict[tuple[Any, ...], Any] = {}  # kept for the process's life, in forked children too
# The process whose obstore (tokio) runtime started: a child forked from it inherits a runtime
# without its threads, where a request crashes the process; it reads with s3fs instead.
_obstore_parent: list[int] = []
_said: set[str] = set()
_AWS_FILES = (("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
              ("AWS_CONFIG_FILE", "~/.aws/config"))


def s3_client() -> str:
    """Which client reads ``s3://`` objects: ``FEEDPIPE_S3_CLIENT`` (``auto``, the default;
    ``obstore``; ``s3fs``)."""
    return os.environ.get("FEEDPIPE_S3_CLIENT", "auto").strip().lower() or "auto"


def _obstore_refusal() -> str | None:
    """Why ``auto`` keeps s3fs for ``s3://`` (None: obstore reads it as s3fs would). obstore
    takes credentials, region and endpoint from ``AWS_*`` environment variables (or the
    instance's role) only: where ``~/.aws`` files, a profile or fsspec's s3 configuration may say
    something else, s3fs (botocore) reads them."""
    import fsspec.config

    if fsspec.config.conf.get("s3") or fsspec.config.conf.get("s3a"):
        return "fsspec's configuration has s3 options"
    if os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE"):
        return "AWS_PROFILE names a profile"
    for var, default in _AWS_FILES:
        path = os.path.expanduser(os.environ.get(var) or default)
        if path != os.devnull and os.path.isfile(path) and os.path.getsize(path) > 0:
            return f"{path} may hold credentials or settings"
    return None


def _say(choice: str, why: str) -> None:
    if choice in _said:
        return
    _said.add(choice)
    from .._redact import logger

    logger("feedpipe").info("feedpipe: s3:// objects are read with %s (%s); "
                            "FEEDPIPE_S3_CLIENT=s3fs|obstore chooses", choice, why)


def object_store(url: str) -> tuple[Any, str] | None:
    """``(obstore S3Store, key)`` where ``url`` is read through obstore, else None (s3fs).

    ``auto`` takes obstore for ``s3://`` when it is installed and the credentials come from the
    environment or nowhere (:func:`_obstore_refusal`): it starts in a round trip, where s3fs first
    imports and decodes botocore's models. The choice is said once per process in a log record."""
    proto, _, rest = url.partition("://")
    if proto.lower() not in ("s3", "s3a"):
        return None
    choice = s3_client()
    if choice == "s3fs":
        _say("s3fs", "FEEDPIPE_S3_CLIENT=s3fs")
        return None
    if choice == "auto":
        why = _obstore_refusal()
        if why is not None:
            _say("s3fs", why)
            return None
    try:
        from obstore.store import S3Store
    except ImportError as e:
        if choice == "obstore":
            from ..errors import MissingDependencyError
            from .dependency import install_hint

            raise MissingDependencyError(
                f"{url}: FEEDPIPE_S3_CLIENT=obstore, and obstore is not installed ({e}). "
                f"Install it with: {install_hint('obstore', 's3')}") from cause(e)
        _say("s3fs", "obstore is not installed")
        return None
    if _obstore_parent and _obstore_parent[0] != os.getpid():
        _say("s3fs", "obstore's runtime does not survive the fork of this worker process "
             "from one that used it")
        return None
    bucket, _, key = rest.partition("/")
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    ident = (bucket, env)
    with _pool_lock:
        if not _obstore_parent:
            _obstore_parent.append(os.getpid())
            os.register_at_fork(before=_ready_s3fs_for_children)
        store = _stores.get(ident)
        if store is None:
            store = _stores[ident] = S3Store(bucket, **_store_options())
    _say("obstore", "credentials from the environment" if "AWS_ACCESS_KEY_ID" in dict(env)
         else "no credentials configured")
    return store, key


def _ready_s3fs_for_children() -> None:
    """Before this process (which reads with obstore) forks: make the s3fs client of each bucket
    it read, so that the children (which read with s3fs, see :func:`object_store`) inherit its
    imports and botocore's decoded models instead of each making them again. Best effort: a
    child that finds none makes its own."""
    if not _obstore_parent or _obstore_parent[0] != os.getpid():
        return
    for bucket in sorted({ident[0] for ident in _stores}):
        try:
            fs, _ = filesystem(f"s3://{bucket}")
            fs.connect()
        except Exception:  # noqa: BLE001 - the child makes its client itself and reports
            pass


def _store_options() -> dict[str, Any]:
    """obstore's settings from the environment, as botocore reads them (the S3-specific
    endpoint first); retries are left to :mod:`feedpipe._helpers.retry`, which counts them."""
    from datetime import timedelta

    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    options: dict[str, Any] = {
        "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        "retry_config": {"max_retries": 0, "retry_timeout": timedelta(seconds=read_timeout()),
                         "backoff": {"init_backoff": timedelta(milliseconds=100),
                                     "max_backoff": timedelta(seconds=1), "base": 2.0}},
        # a response that sends nothing for read_timeout() is given up (and retried), as over
        # http(s)://; a long one that keeps sending is not cut short
        "client_options": {"timeout": timedelta(hours=1),
                           "read_timeout": f"{read_timeout()}s",
                           "connect_timeout": timedelta(seconds=30),
                           "pool_max_idle_per_host": str(streams())},
    }
    if endpoint:
        options["endpoint"] = endpoint
        if endpoint.lower().startswith("http://"):
            options["client_options"]["allow_http"] = True
    return options


class ObjectStoreError(OSError):
    """An obstore failure, with the HTTP status it names (for :func:`retry.classify`)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def _ob_get(ob: tuple[Any, str], url: str, span: tuple[int, int] | None = None) -> bytes:
    """The object (or bytes ``[a, b)`` of it) in one GET; obstore's errors as those of the
    other clients: a missing object a ``FileNotFoundError``, others with their status."""
    import re

    import obstore

    store, key = ob
    try:
        if span is None:
            return bytes(obstore.get(store, key).bytes())
        if span[1] <= span[0]:
            return b""
        return bytes(obstore.get_range(store, key, start=span[0], end=span[1]))
    except FileNotFoundError:
        raise
    except Exception as e:
        text = str(e)
        found = re.search(r"status code: (\d{3})", text)
        status = int(found.group(1)) if found else None
        if status is None and "416" in text:
            status = 416
        if status is None:
            raise ConnectionError(f"{url}: {text}") from e
        raise ObjectStoreError(f"{url}: {text}", status) from e
