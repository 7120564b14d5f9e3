"""Every cache tier found under a directory, described and cleared (``feedpipe cache``).

A directory is recognised by what only that tier writes there:

- **L1 shard cache** (:mod:`feedpipe.caches._shards`): entry files
  ``<20 hex>-<name>.tar/.idx/.lock`` or kept manifests ``manifest-<20 hex>.json``;
- **L2 function index** (:mod:`feedpipe.caches.l2._index`): LMDB's ``data.mdb`` and
  ``lock.mdb``;
- **decoded store** (:mod:`feedpipe.caches.decoded._store`): a ``meta.json`` of format
  ``feedpipe-decoded``.

Clearing never pulls data from under a running job:

- L1 evicts every entry no process holds (in-use shards stay) and drops its kept manifests;
- L2 removes its directory when no process has the LMDB environment open; else it drops every
  entry in a transaction (LMDB keeps the file and reuses its pages);
- a decoded store is removed when no process has it open; else it is emptied (every record marked
  unfilled: readers recompute, writers fill it again).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from ..errors import SourceNotFoundError
from ._stats import DECODED, FUNCTION_INDEX, SHARDS

_L1_ENTRY = re.compile(r"^[0-9a-f]{20}-.+\.(tar|idx|lock|tar\.part|idx\.part)$")
_MANIFEST_COPY = re.compile(r"^manifest-[0-9a-f]{20}\.json$")  # caches._manifest_copy


@dataclass
class TierReport:
    """One tier directory: ``entries`` (shards, memo entries, or filled samples), bytes on disk,
    ``hits``/``misses`` where the tier records them across processes (else ``None``)."""

    tier: str
    path: str
    entries: int
    bytes: int
    hits: int | None = None
    misses: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    action: str | None = None  # what clear did: removed, trimmed, emptied

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_tiers(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``[(tier, directory), ...]`` of every cache tier under ``path`` (sorted by directory)."""
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise SourceNotFoundError(f"{root}: no such directory; give the cache directory (e.g. "
                                  "~/.cache/feedpipe, or a FeedDataset's cache_dir=)")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        tier = _tier_of(dirpath, filenames)
        if tier is not None:
            found.append((tier, dirpath))
            dirnames[:] = []  # a tier's own subdirectories are its business
        dirnames.sort()
    return sorted(found, key=lambda t: t[1])


def _tier_of(dirpath: str, names: list[str]) -> str | None:
    if "data.mdb" in names and "lock.mdb" in names:
        return FUNCTION_INDEX
    if "meta.json" in names:
        try:
            with open(os.path.join(dirpath, "meta.json"), encoding="utf-8") as f:
                if json.load(f).get("format") == "feedpipe-decoded":
                    return DECODED
        except (OSError, ValueError, AttributeError):
            pass
    if any(_L1_ENTRY.match(n) or _MANIFEST_COPY.match(n) for n in names):
        return SHARDS
    return None


def _disk_bytes(path: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for n in filenames:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# -- stats ---------------------------------------------------------------------------------------
def _shards_stats(path: str) -> TierReport:
    from ._shards import ShardCache

    u = ShardCache(path).usage()
    locks = sum(1 for n in os.listdir(path) if n.endswith(".lock"))
    return TierReport(SHARDS, path, u["entries"], _disk_bytes(path),
                      details={"apparent_bytes": u["bytes"], "part_bytes": u["part_bytes"],
                               "lock_files": locks, "peak_bytes": u["peak_bytes"],
                               "peak_readers": u["peak_readers"]})


def _index_stats(path: str) -> TierReport:
    import lmdb

    env = lmdb.open(path, readonly=True, lock=False, subdir=True)
    try:
        entries, info = env.stat()["entries"], env.info()
    finally:
        env.close()
    return TierReport(FUNCTION_INDEX, path, entries, _disk_bytes(path),
                      details={"map_size": info["map_size"], "in_use": _lmdb_in_use(path)})


def _decoded_stats(path: str) -> TierReport:
    import numpy as np

    from .decoded._files import read_recorded
    from .decoded._layout import Layout

    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    layout = Layout.from_json(meta["layout"])
    filled = 0
    for name in os.listdir(path):
        if name.startswith("state-") and name.endswith(".bin"):
            filled = max(filled, int(np.count_nonzero(np.fromfile(os.path.join(path, name),
                                                                  dtype=np.uint64))))
    rec = read_recorded(path)
    return TierReport(
        DECODED, path, filled, _disk_bytes(path), rec.get("hits"), rec.get("misses"),
        details={"samples": meta["samples"], "record_bytes": layout.record,
                 "leaves": [leaf.describe() for leaf in layout.leaves],
                 "recorded": rec, "dataset": meta.get("dataset", {})})


_STATS = {SHARDS: _shards_stats, FUNCTION_INDEX: _index_stats, DECODED: _decoded_stats}


def cache_stats(path: str | os.PathLike[str]) -> list[TierReport]:
    """Describe every cache tier under ``path``.

    Args:
        path: a directory holding cache tiers (e.g. ``~/.cache/feedpipe``, a ``cache_dir=``).

    Raises:
        SourceNotFoundError: ``path`` is not a directory.

    Example:
        >>> import tempfile
        >>> cache_stats(tempfile.mkdtemp())
        []
    """
    return [_STATS[tier](d) for tier, d in find_tiers(path)]


# -- clear ---------------------------------------------------------------------------------------
def _lmdb_in_use(path: str) -> bool:
    """Whether a process has the environment open: LMDB holds a shared ``fcntl`` lock on
    ``lock.mdb`` for as long as an environment is open (in this process too, by our table)."""
    from .l2._lmdb_env import open_here

    if open_here(path):
        return True
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock


def _clear_shards(path: str) -> str:
    from ._shards import ShardCache
    from .l1._budget import Budget

    ShardCache(path, size=0).trim()  # evicts every entry nobody holds, removes dead downloads
    for name in os.listdir(path):
        if _MANIFEST_COPY.match(name):
            os.unlink(os.path.join(path, name))
    Budget(path).discard()
    return "trimmed"


def _clear_index(path: str) -> str:
    if not _lmdb_in_use(path):
        shutil.rmtree(path)
        return "removed"
    from .l2._index import FunctionIndex

    idx = FunctionIndex(path)
    try:
        idx.clear()
    finally:
        idx.close()
    return "emptied"


def _clear_decoded(path: str) -> str:
    import numpy as np

    from .._helpers.file_lock import EXCLUSIVE, lock

    create = cast(int, lock(os.path.join(path, "create.lock"), EXCLUSIVE))
    try:
        use = lock(os.path.join(path, "use.lock"), EXCLUSIVE, block=False)
        if use is not None:
            os.close(use)
            shutil.rmtree(path)
            return "removed"
        for name in os.listdir(path):  # open elsewhere: mark every record unfilled
            if name.startswith("state-") and name.endswith(".bin"):
                state = np.memmap(os.path.join(path, name), dtype=np.uint64, mode="r+")
                state[:] = 0
                state.flush()
                del state
        return "emptied"
    finally:
        os.close(create)


_CLEAR = {SHARDS: _clear_shards, FUNCTION_INDEX: _clear_index, DECODED: _clear_decoded}


def cache_clear(path: str | os.PathLike[str]) -> list[TierReport]:
    """Clear every cache tier under ``path`` (see the module docstring for what stays); returns
    each tier's state afterwards, with ``action`` saying what was done.

    Args:
        path: a directory holding cache tiers (e.g. ``~/.cache/feedpipe``, a ``cache_dir=``).

    Raises:
        SourceNotFoundError: ``path`` is not a directory.

    Example:
        >>> import tempfile
        >>> cache_clear(tempfile.mkdtemp())
        []
    """
    out = []
    for tier, d in find_tiers(path):
        action = _CLEAR[tier](d)
        if os.path.isdir(d):
            report = _STATS[tier](d)
        else:
            report = TierReport(tier, d, 0, 0)
        report.action = action
        out.append(report)
    return out
