"""What leaves an L1 cache directory: entries, the one needed furthest ahead first, and the files
that killed processes left behind.

The order is Belady's rule with the plan as the oracle: a *rank* function gives each entry's next
use (:meth:`feedpipe.caches._prefetch.Prefetcher.rank`), and the entry used furthest in the future
goes first. Entries the plan never uses (``INF``, e.g. of other datasets) go before all others.
Ties go by name, so every process evicts in the same order. Plan-aware eviction against LRU:
benchmarks/bench_eviction.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable

from ..._helpers.processes import pid_alive
from ._entry import PARTS

INF = float("inf")
_TMP = re.compile(r"\.tmp-(\d+)$")  # a temporary file of process <pid>

Rank = Callable[[str], float]  # entry key -> next use (INF when unknown)


def eviction_order(keys: Iterable[str], rank: Rank, keep: str | None = None) -> list[str]:
    """The entries in the order they are evicted: furthest next use first, then by name.

    Args:
        keys: the entry keys.
        rank: an entry's next use (``INF``: none known).
        keep: an entry that is never evicted (the one being filled).

    Example:
        >>> eviction_order(["a", "b", "c", "d"], {"a": 5, "b": INF, "c": 9, "d": 1}.get, keep="d")
        ['b', 'c', 'a']
    """
    return sorted((k for k in keys if k != keep), key=lambda k: (-rank(k), k))


def evict_until(budget: int, entries: dict[str, int], total: int, rank: Rank,
                evict: Callable[[str], int | None], *, keep: str | None = None,
                before: float | None = None) -> int | None:
    """Evict entries in :func:`eviction_order` until ``total <= budget``; the bytes left.

    Args:
        budget: the bytes the directory may hold afterwards.
        entries: entry key -> its bytes.
        total: the bytes the directory holds now.
        rank: an entry's next use.
        evict: removes an entry nobody uses, returning the bytes freed (``None``: in use, kept).
        keep: an entry that is never evicted.
        before: give up (``None``) rather than evict an entry needed no later than this: a
            prefetch never evicts a shard needed before the one it fetches.

    Example:
        >>> gone = []
        >>> evict_until(10, {"a": 8, "b": 8}, 16, {"a": 1, "b": 2}.get,
        ...             lambda k: gone.append(k) or 8), gone
        (8, ['b'])
    """
    for k in eviction_order(entries, rank, keep):
        if total <= budget:
            break
        if before is not None and rank(k) <= before:
            return None
        freed = evict(k)
        if freed is not None:
            total -= freed
    return total


def fill_limit(next_use: float, until: Rank | None, key: str, demand: bool) -> float | None:
    """The ``before`` of a fill of entry ``key`` (:func:`evict_until`; ``None``: no limit).

    A prefetch evicts nothing needed before its shard's ``next_use``. With the plan's ``until``
    (an entry's end of use from its next use on), no fill, a reader's neither, evicts an entry
    needed before its own shard's end of use: that entry would be fetched again while this one
    is still read (with a global shuffle, every shard is read all epoch long: the fill reads
    its shard uncached instead). Without ``until`` a reader's fill has no limit.

    Example:
        >>> fill_limit(5, None, "a", demand=False), fill_limit(5, None, "a", demand=True)
        (5, None)
        >>> fill_limit(5, {"a": 40}.get, "a", demand=True)
        40
    """
    end = until(key) if until is not None else INF
    if demand:
        return None if end == INF else end
    return next_use if end == INF else max(next_use, end)


def remove_leftovers(root: str, try_lock: Callable[[str], int | None]) -> None:
    """Remove the downloads and temporary files that killed processes left in ``root``.

    Args:
        root: the cache directory.
        try_lock: takes an entry's ``LOCK_EX`` without waiting: a descriptor to close, or
            ``None`` when a filler holds it (its download is under way, not left over).
    """
    for name in os.listdir(root) if os.path.isdir(root) else ():
        key = next((name[: -len(s)] for s in PARTS if name.endswith(s)), None)
        if key is not None:
            fd = try_lock(key)
            if fd is not None:  # nobody is filling it: a leftover
                for s in PARTS:
                    _unlink(os.path.join(root, key + s))
                os.close(fd)
        elif (m := _TMP.search(name)) and not pid_alive(int(m.group(1))):
            _unlink(os.path.join(root, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

