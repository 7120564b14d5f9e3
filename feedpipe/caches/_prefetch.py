"""Prefetching shards into the L1 cache ahead of one reader, guided by the plan.

A :class:`Prefetcher` belongs to one iterator (one rank's worker, one epoch). It knows, from the
plan, the shards its reader will open and in which order
(:func:`feedpipe.plan._schedule.first_uses`). It keeps up to ``depth`` of them fetched ahead of the
reader in background threads: downloads are I/O-bound, so threads, not processes. It is also the
clock that eviction consults: the reader's position and the node's
:class:`~feedpipe.plan._schedule.ShardTimeline` give each cached entry's next use.

Threads start in :meth:`start` (called by ``FeedDataset.__iter__``, never at import or
construction) and stop in :meth:`close` (the iterator is exhausted or closed). Prefetching is best
effort: a failed or skipped prefetch leaves the shard to the reader, which fetches it on demand
and reports any error itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..format._manifest import ShardRecord
from ..plan._order import Plan, Split
from ..plan._schedule import INF, ShardTimeline, node_timeline, worker_uses
from ..plan._world import World
from ._shards import ShardCache
from .l1._entry import entry_key


class Prefetcher:
    """Background fills for one reader, and the eviction clock of its process.

    Args:
        cache: the :class:`ShardCache`.
        urls, records: every shard of the dataset (index = shard number).
        uses: yields ``(shards, first, last)`` per chunk of this reader's epoch
            (:func:`feedpipe.plan._schedule.worker_uses`).
        timeline: builds the node's timeline (called once, when eviction first needs it).
    """

    def __init__(self, cache: ShardCache, urls: Sequence[str], records: Sequence[ShardRecord],
                 uses: Callable[[], Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]],
                 timeline: Callable[[], ShardTimeline]) -> None:
        self.cache = cache
        self.urls, self.records = urls, records
        self._uses = uses
        self._make_timeline = timeline
        self._timeline: ShardTimeline | None = None
        self._tl_lock = threading.Lock()
        self._shard_of = {entry_key(r, u): i for i, (u, r) in enumerate(zip(urls, records))}
        self.now = 0
        self._seq: list[int] = []  # shards in order of first use
        self._pos: list[int] = []  # ... and the local position of that use
        self._index: dict[int, int] = {}
        self._last: dict[int, int] = {}  # shard -> local position of its last use
        self._listed = False
        self._consumer = -1  # index in _seq of the last shard the reader opened
        self._pending: int | None = None  # opened before the lister reached it
        self._next = 0  # next index in _seq to prefetch
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    @classmethod
    def for_reader(cls, cache: ShardCache, urls: Sequence[str], records: Sequence[ShardRecord],
                   plan: Plan, next_plan: Plan, split: Split, world: World, batch_size: int,
                   worker: int, num_workers: int) -> Prefetcher:
        """The prefetcher of one DataLoader worker of one rank, for ``plan``'s epoch (the node's
        timeline spans it and ``next_plan``'s; the node's ranks are this rank's local ones)."""
        first = world.rank - world.local_rank if world.local_world_size > 1 else world.rank
        ranks = range(max(0, first), min(world.world_size, first + world.local_world_size))
        n = split.num_samples

        def timeline() -> ShardTimeline:
            now = [Split(n, world.world_size, r, split.start, split.drop_last) for r in ranks]
            nxt = [Split(n, world.world_size, r, 0, split.drop_last) for r in ranks]
            return node_timeline([(plan, now), (next_plan, nxt)], len(records))

        return cls(cache, urls, records,
                   lambda: worker_uses(plan, split, batch_size, worker, num_workers), timeline)

    # -- the clock -----------------------------------------------------------------------
    def rank(self, key: str) -> float:
        """Next use of a cache entry by this node, from the reader's position (INF: none seen)."""
        shard = self._shard_of.get(key)
        if shard is None:
            return INF
        if self._timeline is None:
            with self._tl_lock:
                if self._timeline is None:
                    self._timeline = self._make_timeline()
        return self._timeline.next_use(shard, self.now)

    def busy_until(self, key: str) -> float:
        """Until when a cache entry's shard stays in use from its next use on: its last use by
        this reader this epoch (known as far as the plan is listed), and at least the end of its
        next use on the node's timeline. A fill of this shard must not evict an entry needed
        before then: that entry would be fetched again while this one is still being read."""
        shard = self._shard_of.get(key)
        nxt = self.rank(key)
        if shard is None or nxt == INF:
            return nxt
        assert self._timeline is not None  # made by rank()
        return max(nxt, self._last.get(shard, -1), self._timeline.use_end(shard, self.now))

    def done_with(self, shards: Iterable[int]) -> list[int]:
        """Those of ``shards`` the reader will not read again this epoch (known once the whole
        epoch is listed): their maps can close, so that they leave use."""
        if not self._listed:
            return []
        last, now = self._last, self.now
        return [s for s in shards if last.get(s, -1) < now]

    def advance(self, shard: int) -> None:
        """The reader is opening ``shard``: move the clock and the prefetch window."""
        with self._cond:
            j = self._index.get(shard)
            if j is None:
                self._pending = shard
            elif j > self._consumer:
                self._consumer = j
                self.now = self._pos[j]
                self._cond.notify_all()

    # -- threads -------------------------------------------------------------------------
    def start(self) -> None:
        if self._threads:
            return
        # the lister runs even without prefetching: it is what moves the eviction clock
        lister = threading.Thread(target=self._list, name="feedpipe-plan", daemon=True)
        self._threads.append(lister)
        threads, depth = self.shape()
        for i in range(threads if depth > 0 else 0):
            self._threads.append(threading.Thread(target=self._fetch, daemon=True,
                                                  name=f"feedpipe-prefetch-{i}"))
        for t in self._threads:
            t.start()

    def shape(self) -> tuple[int, int]:
        """``(download threads, shards fetched ahead)``: the cache's, where it names them; else
        enough shards at once to keep the process's concurrent ranges busy
        (:func:`~feedpipe._helpers.storage.streams` over a mean shard's ranges, 2 to 16)."""
        from .._helpers.storage import range_bytes, streams

        threads, depth = self.cache.threads, self.cache.prefetch
        if threads is None:
            mean = int(sum(r.bytes for r in self.records) / max(1, len(self.records)))
            ranges = -(-max(1, mean) // range_bytes(mean))  # a mean shard's ranges
            threads = min(16, max(2, -(-streams() // ranges)))
        threads = max(1, threads)
        return threads, threads if depth is None else depth

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads: downloads under way stop at their next chunk."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    def _list(self) -> None:
        try:
            for shards, first, last in self._uses():
                self._last.update(zip(shards.tolist(), last.tolist()))
                new = [(s, p) for s, p in zip(shards.tolist(), first.tolist())
                       if s not in self._index]
                with self._cond:
                    for s, p in new:
                        self._index[s] = len(self._seq)
                        self._seq.append(s)
                        self._pos.append(p)
                    if self._pending is not None and self._pending in self._index:
                        self._consumer = max(self._consumer, self._index[self._pending])
                        self.now = self._pos[self._consumer]
                        self._pending = None
                    self._cond.notify_all()
                if self._stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - best effort: the reader reports real errors
            self.errors.append(e)
        finally:
            with self._cond:
                self._listed = True
                self._cond.notify_all()

    def _fetch(self) -> None:
        depth = self.shape()[1]
        while True:
            with self._cond:
                while not self._stop.is_set():
                    self._next = max(self._next, self._consumer + 1)  # the reader has those
                    if self._next < len(self._seq) and self._next <= self._consumer + depth:
                        break
                    if self._listed and self._next >= len(self._seq):
                        return
                    self._cond.wait()
                if self._stop.is_set():
                    return
                j = self._next
                self._next += 1
                shard = self._seq[j]
            try:
                self.cache.prefetch_one(self.urls[shard], self.records[shard], self.rank,
                                        stop=self._stop, until=self.busy_until)
            except BaseException as e:  # noqa: BLE001 - the reader fetches it and reports
                self.errors.append(e)
