"""Where bytes come from: local paths directly, everything else through fsspec.

The one place that decides whether a URL is local. fsspec is imported lazily so that
``import feedpipe`` stays light.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import SourceNotFoundError


def is_local(url: str) -> bool:
    """Whether ``url`` is a plain path or a ``file://`` URL."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` for ``url``; a missing backend names its pip line."""
    import fsspec

    from .dependency import install_hint

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        proto = url.split("://", 1)[0]
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}.get(proto)
        from .errors import MissingDependencyError

        raise MissingDependencyError(
            f"{url}: the fsspec backend for {proto}:// is not installed ({e}). Install it with: "
            f"{install_hint(proto, extra)}"
        ) from e
    return fs, path


def read_bytes(url: str) -> bytes:
    """The whole content of ``url``."""
    if is_local(url):
        try:
            with open(local_path(url), "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise SourceNotFoundError(f"{url}: no such file") from e
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError as e:
        raise SourceNotFoundError(f"{url}: no such object") from e


def size_of(url: str) -> int:
    if is_local(url):
        return os.path.getsize(local_path(url))
    fs, path = filesystem(url)
    return int(fs.size(path))
