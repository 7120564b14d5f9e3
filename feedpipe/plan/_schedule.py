"""The shard schedule: when the plan will use each shard. Pure functions of the plan.

Two views feed the L1 cache (:mod:`feedpipe.caches._shards`):

- :func:`first_uses`: for one (rank, worker), the shards it will open, in the order of their first
  use this epoch, with the local position of that use. The prefetcher walks it ahead of the reader.
- :class:`ShardTimeline`: for a whole node (its local ranks, all their workers), when each shard is
  used next after a given moment. Eviction asks it which cached shard is needed furthest in the
  future (Belady's rule, with the plan as the oracle).

Time is a rank's *local position*: the ``L``-th sample a rank delivers in this epoch. DataLoader
workers hand batches back round-robin and DDP ranks step in lockstep, so all workers and all local
ranks of a node are near the same ``L`` at any moment: one clock for the node. The next epoch
(``epoch + 1``, from its start) continues the clock at ``L = length``, so the ends of an epoch see
what the next one needs first.

Memory stays bounded: a timeline keeps, per shard and per time bucket (about 256 per epoch), the
first and last use in that bucket; never a row per sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ._order import Plan, Split, batch_groups, distinct, worker_positions

INF = float("inf")


def worker_uses(
    plan: Plan, split: Split, batch_size: int, worker: int, num_workers: int, chunk: int = 16384
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(shards, first, last)`` per chunk of one worker's epoch: the shards the chunk reads
    (ordered by first use) with the local positions of their first and last use in it."""
    for ts in batch_groups(split, batch_size, worker, num_workers, chunk):
        pos, lens = worker_positions(split, batch_size, ts)
        heads = np.cumsum(lens) - lens  # where each batch starts in the concatenation
        within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(heads, lens)
        local = np.repeat(ts.astype(np.int64) * batch_size, lens) + within
        shards, _ = plan.shard_of(plan.sample_ids(pos))
        uniq, at = distinct(shards)
        _, rat = distinct(shards[::-1])
        order = np.argsort(at, kind="stable")
        yield uniq[order], local[at[order]], local[len(shards) - 1 - rat[order]]


def first_uses(
    plan: Plan, split: Split, batch_size: int, worker: int, num_workers: int, chunk: int = 16384
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(local positions, shards)`` of the shards one worker opens, each at its first use this
    epoch, in order, a chunk at a time.

    Example:
        >>> p = Plan((4, 4, 4), shuffle=False)
        >>> [s.tolist() for _, s in first_uses(p, Split(12, 1, 0), 2, 0, 1)]
        [[0, 1, 2]]
    """
    seen = np.zeros(len(plan.counts), dtype=bool)
    for shards, first, _ in worker_uses(plan, split, batch_size, worker, num_workers, chunk):
        keep = ~seen[shards]
        if keep.any():
            seen[shards[keep]] = True
            yield first[keep], shards[keep]


class ShardTimeline:
    """Per shard, the sorted ``(first, last)`` use of each time bucket that uses it.

    Build with :func:`node_timeline`; ask :meth:`next_use`.
    """

    def __init__(self, shard: np.ndarray, first: np.ndarray, last: np.ndarray, num_shards: int,
                 horizon: int) -> None:
        order = np.argsort(shard, kind="stable")  # rows arrive in time order: stable keeps it
        self._first = first[order]
        self._last = last[order]
        self._ptr = np.searchsorted(shard[order], np.arange(num_shards + 1))
        self.horizon = horizon

    def next_use(self, shard: int, now: float) -> float:
        """The first time ``>= now`` at which ``shard`` is used (``now`` if in use now), or
        infinity when the timeline does not use it again.

        Example:
            >>> t = node_timeline([(Plan((2, 2), shuffle=False), [Split(4, 1, 0)])], 2)
            >>> t.next_use(1, 0), t.next_use(0, 1), t.next_use(0, 2)
            (2, 1, inf)
        """
        lo, hi = int(self._ptr[shard]), int(self._ptr[shard + 1])
        if lo == hi:
            return INF
        j = lo + int(np.searchsorted(self._last[lo:hi], now, side="left"))
        if j == hi:
            return INF
        first = int(self._first[j])
        return first if first >= now else now

    def use_end(self, shard: int, now: float) -> float:
        """The last time of the bucket that :meth:`next_use` finds (``-1``: none): until then
        ``shard`` is in use.

        Example:
            >>> t = node_timeline([(Plan((2, 2), shuffle=False), [Split(4, 1, 0)])], 2)
            >>> t.use_end(0, 0), t.use_end(1, 0), t.use_end(0, 2)
            (1, 3, -1)
        """
        lo, hi = int(self._ptr[shard]), int(self._ptr[shard + 1])
        j = lo + int(np.searchsorted(self._last[lo:hi], now, side="left"))
        return -1 if j >= hi else int(self._last[j])


def node_timeline(
    segments: Sequence[tuple[Plan, Sequence[Split]]], num_shards: int, buckets: int = 256
) -> ShardTimeline:
    """The timeline of consecutive epochs (``segments``), each a plan and the splits of the
    node's local ranks (which share the clock: their local positions)."""
    rows_s: list[np.ndarray] = []
    rows_f: list[np.ndarray] = []
    rows_l: list[np.ndarray] = []
    offset = 0
    for plan, splits in segments:
        length = max((sp.length for sp in splits), default=0)
        step = max(1024, -(-length // buckets))
        for lo in range(0, length, step):
            hi = min(length, lo + step)
            ss, tt = [], []
            for sp in splits:
                n = min(hi, sp.length) - lo
                if n <= 0:
                    continue
                ss.append(plan.shard_of(plan.sample_ids(sp.positions(lo, lo + n)))[0])
                tt.append(np.arange(lo, lo + n, dtype=np.int64) + offset)
            if not ss:
                continue
            s, t = np.concatenate(ss), np.concatenate(tt)
            o = np.lexsort((t, s))
            s, t = s[o], t[o]
            brk = np.flatnonzero(np.diff(s)) + 1
            starts = np.concatenate(([0], brk))
            ends = np.concatenate((brk, [len(s)])) - 1
            rows_s.append(s[starts])
            rows_f.append(t[starts])
            rows_l.append(t[ends])
        offset += length
    if not rows_s:
        empty = np.zeros(0, dtype=np.int64)
        return ShardTimeline(empty, empty, empty, num_shards, offset)
    return ShardTimeline(np.concatenate(rows_s), np.concatenate(rows_f), np.concatenate(rows_l),
                         num_shards, offset)
