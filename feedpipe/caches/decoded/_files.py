"""The directory of one decoded store: its files, what they hold, and how they are opened.

A store is the directory ``ROOT/<fp>``, where ``fp`` is the fingerprint
(:mod:`feedpipe.caches._fingerprint`) of the transform's code and parameters and of the dataset
(its shards' names, sample counts and content hashes). Changing the transform's parameters or
the data selects another, empty store. Inside::

    meta.json          format, samples, the record layout (caches.decoded._layout), dataset
    data-<l>.bin       samples x record bytes (preallocated: a full disk shows at creation)
    state-<l>.bin      one uint64 per sample: 0 = empty, else the xxh3-64 of the record (never 0)
    stats.json         hits, misses, fills, damaged: recorded by each iterator when it ends
    use.lock           held shared by every process that has the store open (``clear`` skips it)
    create.lock        serialises creation, stats updates and clearing

``<l>`` hashes the layout, so stores of different layouts never share a file.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
from typing import Any, NamedTuple

import numpy as np

from ._layout import Layout

FORMAT = "feedpipe-decoded"
VERSION = 1
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the disk is full: store nothing, warn


class Mapped(NamedTuple):
    """A store open in this process: its layout, records and state words (shared mappings)."""

    layout: Layout
    records: np.ndarray  # samples x record bytes
    state: np.ndarray  # samples x uint64


def checksum(rec: np.ndarray, rest: np.ndarray | None = None) -> int:
    """A record's checksum (never 0: 0 marks "not stored"); ``rest``: the record continues
    there (the same value as for the two joined).

    Example:
        >>> a = np.arange(6, dtype=np.uint8)
        >>> checksum(a) == checksum(a[:2], a[2:]) != 0
        True
    """
    import xxhash

    if rest is None:
        return xxhash.xxh3_64_intdigest(rec.data) or 1
    h = xxhash.xxh3_64(rec.data)
    h.update(rest.data)
    return h.intdigest() or 1


def data_files(path: str, layout: Layout) -> tuple[str, str]:
    """The record file and the state file of ``layout`` in the store directory ``path``."""
    import xxhash

    tag = xxhash.xxh3_64_hexdigest(layout.ident().encode())[:12]
    return os.path.join(path, f"data-{tag}.bin"), os.path.join(path, f"state-{tag}.bin")


def read_meta(path: str, samples: int) -> Layout | None:
    """The layout ``meta.json`` records for a store of ``samples`` samples; ``None`` when there
    is none, or it is of another format, version or sample count, or unreadable."""
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            return None
        if doc.get("samples") != samples:
            return None
        return Layout.from_json(doc["layout"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def publish_meta(path: str, samples: int, layout: Layout, dataset: dict[str, Any]) -> None:
    """Write ``meta.json`` (synced, then renamed): the store exists from then on. The temp file
    is the caller's to remove when this raises."""
    meta = {"format": FORMAT, "version": VERSION, "samples": samples,
            "layout": layout.to_json(), "dataset": dataset}
    tmp = meta_tmp(path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, "meta.json"))


def meta_tmp(path: str) -> str:
    """This process's temp file for ``meta.json``."""
    return os.path.join(path, f"meta.json.{os.getpid()}")


def allocate(name: str, size: int) -> None:
    """Create ``name`` with ``size`` zeroed bytes whose blocks exist, so that writes into a
    mapping of it cannot fail on a full disk later."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, 0)  # a leftover of another layout attempt: start zeroed
        os.posix_fallocate(fd, 0, size)  # blocks exist now: mapped writes cannot fail
    finally:
        os.close(fd)


def map_shared(names: tuple[str, ...]) -> list[mmap.mmap]:
    """Shared read-write mappings of these files (``FileNotFoundError`` when one is gone)."""
    maps = []
    for name in names:
        fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
        try:
            maps.append(mmap.mmap(fd, 0, mmap.MAP_SHARED))
        finally:
            os.close(fd)
    return maps


def read_recorded(path: str) -> dict[str, int]:
    """The counters recorded in a store directory's ``stats.json`` (empty when none)."""
    try:
        with open(os.path.join(path, "stats.json"), encoding="utf-8") as f:
            doc = json.load(f)
        return {k: int(v) for k, v in doc.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def add_recorded(path: str, delta: dict[str, int]) -> None:
    """Add ``delta`` to the counters of ``stats.json`` (the caller holds ``create.lock``).
    Raises ``OSError``."""
    doc = read_recorded(path)
    for k, v in delta.items():
        doc[k] = doc.get(k, 0) + v
    tmp = os.path.join(path, f"stats.json.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(path, "stats.json"))
