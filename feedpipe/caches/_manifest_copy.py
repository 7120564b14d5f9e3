"""A dataset's manifest kept in its L1 shard cache directory, so that a warm cache starts while the
storage is unreachable.

``FeedDataset(url, cache_dir=...)`` loads its manifest through :func:`load_manifest_cached`: from
the storage as always, keeping a copy in the cache directory (``manifest-<hash of url>.json``,
replaced atomically when the storage's differs). When the storage cannot be reached
(:class:`~feedpipe.errors.RemoteError`: connection refused or reset, timeouts, 5xx, a host name
that does not resolve; after the bounded retries of :mod:`feedpipe._helpers.retry`), the copy is
used and one warning (a log record of the ``feedpipe.cache`` logger) says so. The shards then come
from the cache: a shard it does not hold fails with the storage's error. An answer from the
storage (no such object, access denied) is never overridden by the copy.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from .._helpers.storage import is_local, split_query
from .._redact import cause, logger, redact
from ..errors import ManifestError, RemoteError
from ..format._manifest import Manifest, dataset_root, load_manifest, parse_manifest

log = logger("feedpipe.cache")


def copy_path(cache_path: str, url: str) -> str:
    """Where the manifest of the dataset at ``url`` is kept in the cache directory (named after
    the URL without its query string and its password: a renewed token finds the same copy)."""
    ident = hashlib.sha256(redact(split_query(dataset_root(url))[0]).encode()).hexdigest()[:20]
    return os.path.join(cache_path, f"manifest-{ident}.json")


def load_manifest_cached(url: str, cache_dir: Any = None) -> Manifest:
    """The manifest of the dataset at ``url``; kept in ``cache_dir`` (a ``FeedDataset(cache_dir=)``
    value: a directory, ``True``/``"auto"``, a ``ShardCache``; ``None``: no cache) and read from
    there, with a warning, when the storage is unreachable.

    Args:
        url: the dataset root or its ``manifest.json`` (local path or fsspec URL).
        cache_dir: the L1 cache the dataset reads through. Local datasets are never copied.

    Example:
        >>> load_manifest_cached("shards/example").total_samples
        24
    """
    if cache_dir is None or cache_dir is False or is_local(url):
        return load_manifest(url)
    from ._shards import cache_dir_path

    copy = copy_path(cache_dir_path(cache_dir), url)
    try:
        manifest = load_manifest(url)
    except RemoteError as e:
        try:
            with open(copy, "rb") as f:
                raw = f.read()
            saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(copy)))
        except FileNotFoundError:
            raise e from None
        try:
            kept = parse_manifest(raw, copy)
        except ManifestError as bad:
            # never fetched again from an unreachable storage: removed, so that the next start
            # does not meet it again, and named with the storage's own error
            _remove(copy)
            raise RemoteError(
                f"{_first_line(e)}; and the copy of the manifest kept in the shard cache is "
                f"damaged ({bad}): it was removed. Start again once {dataset_root(url)} can be "
                "reached") from cause(e)
        log.warning("%s: the storage is unreachable (%s); starting from the copy of the "
                    "manifest kept in the shard cache (%s, saved %s): every shard comes from the "
                    "cache, and one it does not hold fails until the storage is back",
                    dataset_root(url), _first_line(e), copy, saved)
        return kept
    _keep(copy, manifest.to_json())
    return manifest


def _keep(copy: str, text: str) -> None:
    """Write ``text`` to ``copy`` atomically unless it holds it already (a failure is logged:
    the cache itself will name an unwritable directory)."""
    try:
        with open(copy, encoding="utf-8") as f:
            if f.read() == text:
                return
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    except OSError:
        return  # unreadable: the cache will say why when it writes its first shard
    from .l1._budget import Budget

    tmp = f"{copy}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        with Budget(os.path.dirname(copy)).admission():  # never renamed under a budget scan
            os.replace(tmp, copy)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        log.warning("%s: cannot keep a copy of the manifest in the shard cache (%s); a later "
                    "run cannot start from the cache while the storage is unreachable",
                    copy, e.strerror or e)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _first_line(e: BaseException) -> str:
    return str(e).split("\n", 1)[0]
