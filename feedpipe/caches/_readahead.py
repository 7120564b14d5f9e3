"""The shard cache a ``FeedDataset`` reads through (:func:`make_cache`), and the read-ahead of a
remote dataset read without ``cache_dir``: a temporary
:class:`~feedpipe.caches._shards.ShardCache` of this process."""

from __future__ import annotations

import os
from typing import Any

from .._redact import redact
from ._shards import ShardCache, cache_dir_path, default_cache_dir


def make_cache(cache_dir: Any, cache_size: Any, url: str | None = None) -> ShardCache | None:
    """The cache of ``FeedDataset(cache_dir=..., cache_size=...)``: ``None``: none, or for a
    remote ``url`` the process's read-ahead directory
    (:func:`readahead_cache`); ``False``: none at all; ``True`` or
    ``"auto"``: :func:`default_cache_dir`; a path; or a :class:`ShardCache`."""
    if cache_dir is None or cache_dir is False:
        if cache_size is not None:
            raise ValueError("cache_size= needs cache_dir= (a directory, or True for the default)")
        if cache_dir is None and url is not None and "://" in url \
                and not url.startswith("file://"):
            return readahead_cache(url)
        return None
    if isinstance(cache_dir, ShardCache):
        if cache_size is not None:
            raise ValueError("give the byte budget to the ShardCache, not cache_size=")
        return cache_dir
    return ShardCache(cache_dir_path(cache_dir), cache_size)



READAHEAD_BYTES = 2 * 10**9  # the read-ahead directory's budget, at most (and half its disk)
_readahead: list[ShardCache] = []  # this process's read-ahead cache, made on first use
_readahead_said: set[str] = set()  # the datasets whose record this process gave


def readahead_cache(url: str) -> ShardCache:
    """The read-ahead of a remote dataset read without ``cache_dir``: a temporary shard cache
    (under ``$TMPDIR``, removed when the process that made it exits) whose budget is
    ``FEEDPIPE_READAHEAD_BYTES`` (default 2 GB, at most half the free space there). Whole shards
    are fetched ahead of the reader in concurrent ranges, as with a ``cache_dir``, instead of one
    request per sample; nothing is kept across runs. Said in a log record."""
    import atexit
    import shutil
    import tempfile

    from .._helpers.sizes import format_size, parse_size
    from .._redact import logger

    if not _readahead:
        path = tempfile.mkdtemp(prefix="feedpipe-readahead-")
        free = shutil.disk_usage(path).free
        size = parse_size(os.environ.get("FEEDPIPE_READAHEAD_BYTES", str(READAHEAD_BYTES)))
        size = max(1, min(size, free // 2))
        _readahead.append(ShardCache(path, size))
        atexit.register(_remove_readahead, path, os.getpid())
    cache = _readahead[0]
    if url not in _readahead_said:  # once per dataset and process
        _readahead_said.add(url)
        logger("feedpipe.cache").warning(
            "%s: no cache_dir= was given: remote shards are read whole, in concurrent ranges, "
            "into a temporary read-ahead directory (%s, at most %s, removed at exit) rather than "
            "one request per sample; pass cache_dir= (a directory, or True for %s) to keep them "
            "across runs, or cache_dir=False to read each sample by its own range request",
            redact(url), cache.path, format_size(cache.size or 0), default_cache_dir())
    return cache


def _remove_readahead(path: str, pid: int) -> None:
    """At exit of the process that made the read-ahead directory (not of a forked child)."""
    import shutil

    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)
