"""Which client reads a remote URL, and how it is set up for the link: the fsspec filesystem
(:func:`filesystem`, with the connection pool, read timeout and shared botocore session feedpipe
gives each backend), obstore for ``s3://`` where it reads as s3fs would (:func:`object_store`),
and what survives a fork into a DataLoader worker. :mod:`feedpipe._helpers.storage` makes the
calls through them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .._redact import cause

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
    finalizers, and keep the parent's filesystems (fsspec's cached instances, and with them
    their sessions and connectors) referenced for the child's lifetime (worker processes end
    with ``os._exit``). They are found in fsspec's caches rather than by walking every object
    of the process (``gc.get_objects``), which with torch imported is some 200,000 objects: a
    fraction of a second of CPU in each worker before its first request.
    """
    import gc
    import weakref

    collecting = gc.isenabled()
    gc.disable()  # a collection here would run finalizers that change the registry we walk
    try:
        registry = getattr(weakref.finalize, "_registry", {})
        for f, info in list(registry.items()):
            if getattr(info.func, "__name__", "") == "close_session":
                f.detach()
        _INHERITED.extend(_forking)  # (fsspec's own hook has emptied its caches by now)
        _forking.clear()
    finally:
        if collecting:
            gc.enable()


_forking: list[Any] = []  # in the parent, during a fork: its filesystems (for the child)


def _note_parent_filesystems() -> None:
    _forking[:] = _fsspec_instances()


def _forked_parent() -> None:
    _forking.clear()


def _fsspec_instances() -> list[Any]:
    """Every filesystem instance in fsspec's caches (each filesystem class keeps its own)."""
    import sys

    spec = sys.modules.get("fsspec.spec")
    if spec is None:
        return []
    out: list[Any] = []
    todo: list[type] = [spec.AbstractFileSystem]
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        cache = cls.__dict__.get("_cache")
        if isinstance(cache, dict):
            out.extend(cache.values())
    return out


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
        # + 64: an epoch's first batch reads its samples by range beside the shards' ranges
        # (feedpipe.caches._early), and must not queue behind them for a connection
        given.setdefault("max_pool_connections", max(10, streams()) + 64)
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
        os.register_at_fork(before=_note_parent_filesystems, after_in_parent=_forked_parent,
                            after_in_child=_leave_parent_connections_alone)

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


def env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


def streams() -> int:
    """Range requests this process keeps in flight at most (``FEEDPIPE_REMOTE_STREAMS``, default
    32): the ceiling of :class:`~feedpipe._helpers.link_control.LinkController`, which keeps as
    many as the link needs."""
    return env_int("FEEDPIPE_REMOTE_STREAMS", 32)


def streams_floor() -> int:
    """Range requests the controller keeps in flight at least (``FEEDPIPE_REMOTE_STREAMS_MIN``,
    default 2, at most :func:`streams`; equal to it: a fixed number)."""
    return min(streams(), env_int("FEEDPIPE_REMOTE_STREAMS_MIN", 2))


_pool_lock = threading.Lock()  # sessions made once, by one thread

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


def ob_get(ob: tuple[Any, str], url: str, span: tuple[int, int] | None = None) -> bytes:
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
