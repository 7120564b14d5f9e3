"""What the converters and the manifest loader ask of a storage beside its bytes: listings of
directories and trees, and whether a path is there, a directory or a file; and the parquet
reader's streams. The other half of :mod:`feedpipe._helpers.storage` (which reads the bytes):
each call takes a URL (or a local path), reaches the storage through
:func:`~feedpipe._helpers.storage.filesystem`, and is retried and counted where the URL is
remote, as the reads are, so that no other module calls fsspec's methods itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .storage import filesystem, is_local, local_path


def _call(url: str, fn: Any) -> Any:
    """``fn()``: retried (:func:`feedpipe._helpers.retry.call`) where ``url`` is remote."""
    if is_local(url):
        return fn()
    from . import retry

    return retry.call(url, fn)


def path_info(url: str) -> dict[str, Any]:
    """What the storage says of ``url`` (fsspec's ``info``: ``type``, ``size``, ``name``)."""
    fs, path = filesystem(url)
    return dict(_call(url, lambda: fs.info(path)))


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(_call(url, lambda: fs.exists(path)))


def is_dir(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(_call(url, lambda: fs.isdir(path)))


def is_file(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(_call(url, lambda: fs.isfile(path)))


def _sized(url: str, fs: Any, full: str, rel: str, size: Any) -> int:
    """A listed file's size: the listing's, else asked (HTTP directory listings carry none: a
    HEAD per file); -1 where the storage does not know."""
    if size is None:
        size = _call(f"{url.rstrip('/')}/{rel}", lambda: fs.size(full))
    return int(size if size is not None else -1)


def list_dir(url: str) -> tuple[list[tuple[str, int]], list[str]]:
    """The directory ``url``'s files ``(name, size)`` and subdirectories, each sorted by name
    (names relative to ``url``; a size the listing lacks is asked, see :func:`_sized`)."""
    fs, path = filesystem(url)
    base = path.rstrip("/") + "/"
    files: list[tuple[str, int]] = []
    dirs: list[str] = []
    for info in sorted(_call(url, lambda: fs.ls(path, detail=True)), key=lambda i: i["name"]):
        name = info["name"].rstrip("/")
        rel = name[len(base):] if name.startswith(base) else name.rsplit("/", 1)[-1]
        if not rel:
            continue
        if info.get("type") == "directory":
            dirs.append(rel)
        else:
            files.append((rel, _sized(url, fs, name, rel, info.get("size"))))
    return files, dirs


def list_names(url: str) -> list[tuple[str, bool]]:
    """The names in the directory ``url`` (the last part of each), each with whether it is a
    directory, in the storage's order."""
    fs, path = filesystem(url)
    return [(x["name"].rstrip("/").rsplit("/", 1)[-1], x.get("type") == "directory")
            for x in _call(url, lambda: fs.ls(path, detail=True))]


def find_files(url: str) -> Iterator[tuple[str, int]]:
    """Every file under the directory ``url``, recursively: ``(path relative to url, size)``
    in path order (a size the listing lacks is asked, see :func:`_sized`)."""
    fs, path = filesystem(url)
    found = _call(url, lambda: fs.find(path, detail=True))
    base = path.rstrip("/") + "/"
    for full in sorted(found):
        info = found[full]
        if info.get("type", "file") != "file":
            continue
        rel = full[len(base):] if full.startswith(base) else full
        yield rel, _sized(url, fs, full, rel, info.get("size"))


def find_paths(url: str) -> list[str]:
    """Every file under the directory ``url``, recursively, relative to it (unsorted)."""
    fs, path = filesystem(url)
    base = path.rstrip("/") + "/"
    return [x[len(base):] for x in _call(url, lambda: fs.find(path)) if x.startswith(base)]


def walker(url: str) -> tuple[str, Any]:
    """``(path, walk)``: ``url``'s path in its storage and that storage's ``os.walk``-like
    walk, which takes such paths (``os.walk`` itself for a local path; the directories a
    remote walk lists are not retried one by one)."""
    if is_local(url):
        return local_path(url), os.walk
    fs, path = filesystem(url)
    return path, fs.walk


def path_in(url: str) -> str:
    """``url``'s path in its storage (fsspec's: a local path made absolute, a remote URL
    without its protocol), as :func:`open_path` takes it."""
    return str(filesystem(url)[1])


def open_path(url: str, path: str) -> Any:
    """``path``, a path in ``url``'s storage (:func:`path_in`, :func:`walker`), opened for
    reading bytes as a stream (its opening retried where the storage is remote)."""
    fs = filesystem(url)[0]
    return _call(fs.unstrip_protocol(path), lambda: fs.open(path, "rb"))
