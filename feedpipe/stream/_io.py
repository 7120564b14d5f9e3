"""Bytes and requests per tier of one pass: what ``loader.stats()["io"]`` reports.

Each process that runs the batch loop (the training process; each DataLoader worker) keeps an
:class:`IoTally` of the dataset it reads. The tiers count for themselves, per process and
cumulatively: the remote requests (:mod:`feedpipe._helpers.remote_count`), the L1 shard cache
(:class:`~feedpipe.caches._shards.CacheStats`), the decoded store and the L2 function index
(when the transform is a :meth:`FunctionIndex.wrap <feedpipe.FunctionIndex.wrap>` function).
A tally reads them between batches and hands on the difference, so counting costs a few reads per
batch and nothing per sample. Workers send theirs with each batch
(:class:`~feedpipe.stream._worker_source.WorkerMeta`); the loader adds them up.

Bytes read from local shards (the dataset's own files, or the L1 cache's copies) are counted per
batch, from the manifest: each sample read from a shard counts that shard's size over its
sample count, so an epoch counts the shards' sizes, headers included. Samples the decoded store
served count nothing there.
A :class:`~feedpipe.Packed` dataset counts the token bytes it copied out of its documents
(``Packed.bytes_read``): rows take slices of the shards, not whole samples.

The remote count is the process's, not the dataset's: what another dataset of the same process
fetched during the pass is counted with it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._helpers.remote_count import REMOTE
from .._helpers.storage import is_local, link_figures
from ..format._compression import readable

if TYPE_CHECKING:
    from ._batch_loop import LoopDataset

# the order of the figures in a tally's tuples (what a worker sends with each batch)
FIELDS = ("local_bytes", "remote_requests", "remote_bytes", "l1_hits", "l1_misses", "l1_fills",
          "decoded_hits", "decoded_misses", "l2_hits", "l2_misses", "retries", "inflight_max",
          "busy_us", "inflight_us", "link_target", "link_bw", "link_rtt_us", "link_n")
ZERO = (0,) * len(FIELDS)
# the range controller's latest figures (gauges, not counts): a tally starts them at 0 and
# hands on their changes, so that each process's takes add up to its latest value
_GAUGES = slice(FIELDS.index("link_target"), len(FIELDS))
_MEMO = __name__.rsplit(".", 2)[0] + ".caches.l2._index"  # where Memoized is defined


def io_figures(counts: tuple[int, ...] | list[int]) -> dict[str, Any]:
    """``stats()["io"]`` from a tuple in :data:`FIELDS` order.

    ``"link"``: what the remote link gave: ``retries`` (attempts after a failed one),
    ``inflight_max`` (the most requests in flight at once in one process, added up over the
    worker processes), ``inflight_mean`` (the mean number in flight while any was),
    ``busy_s`` (seconds with a request in flight, added up over processes), ``bytes_per_s``
    (remote bytes over ``busy_s``: per process where workers fetch at once),
    ``requests_per_shard`` (remote requests per L1 fill; 0 without fills), and the range
    controller's (:mod:`feedpipe._helpers.link_control`) latest figures: ``target`` (the range
    requests it keeps in flight, added up over processes), ``bandwidth`` (bytes/s it measured
    the link to give, added up over processes) and ``rtt_s`` (the shortest range response, a
    bound on the round trip; the mean over processes); 0 where no range was fetched.

    Example:
        >>> io = io_figures((10, 2, 8, 1, 1, 1, 0, 0, 0, 0, 0, 2, 500000, 750000,
        ...                  6, 200, 30000, 1))
        >>> io["remote"], io["link"]["inflight_mean"], io["link"]["bytes_per_s"]
        ({'requests': 2, 'bytes': 8}, 1.5, 16.0)
        >>> io["link"]["target"], io["link"]["bandwidth"], io["link"]["rtt_s"]
        (6, 200, 0.03)
    """
    c = dict(zip(FIELDS, (int(x) for x in counts)))
    busy = c["busy_us"] / 1e6
    return {"local_bytes": c["local_bytes"],
            "remote": {"requests": c["remote_requests"], "bytes": c["remote_bytes"]},
            "link": {"retries": c["retries"], "inflight_max": c["inflight_max"],
                     "inflight_mean": round(c["inflight_us"] / c["busy_us"], 2)
                     if c["busy_us"] else 0.0,
                     "busy_s": round(busy, 3),
                     "bytes_per_s": round(c["remote_bytes"] / busy, 1) if busy else 0.0,
                     "requests_per_shard": round(c["remote_requests"] / c["l1_fills"], 2)
                     if c["l1_fills"] else 0.0,
                     "target": c["link_target"], "bandwidth": c["link_bw"],
                     "rtt_s": round(c["link_rtt_us"] / c["link_n"] / 1e6, 4)
                     if c["link_n"] > 0 else 0.0},
            "l1": {"hits": c["l1_hits"], "misses": c["l1_misses"], "fills": c["l1_fills"]},
            "decoded": {"hits": c["decoded_hits"], "misses": c["decoded_misses"]},
            "l2": {"hits": c["l2_hits"], "misses": c["l2_misses"]}}


def add(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b))


class IoTally:
    """The counters of one process reading ``dataset``, from the moment it is made.

    :meth:`counted` wraps a batch fetch so that it counts the local bytes it read; :meth:`take`
    gives what every tier counted since the last take (or since the tally was made).
    """

    def __init__(self, dataset: LoopDataset) -> None:
        self.dataset = dataset
        shards = dataset.shards
        cache = shards.cache
        remote = not is_local(shards.root)
        # bytes per sample read, per shard; 0 where a shard is read from the remote uncached
        # (those bytes are the remote figures)
        self._rate = np.array(
            [0.0 if remote and cache is None and not readable(rec.name)
             else rec.tar_size / max(1, rec.samples) for rec in shards.manifest.shards],
            dtype=np.float64)
        self._first = shards.first
        # a transform is a Memoized only once its module was imported: a loader without one
        # does not import it (with its LMDB wrapper) in its first batch
        memo = sys.modules.get(_MEMO)
        fn = dataset.transform
        self._index = fn.index if memo is not None and isinstance(fn, memo.Memoized) else None
        self.local_bytes = 0.0
        # a Packed counts the token bytes it slices out of the shards itself
        self._sliced = dataset.bytes_read is not None
        self._sliced_from = dataset.bytes_read or 0
        REMOTE.mark()  # the most in flight is this pass's (see take)
        last = list(self._read())
        last[_GAUGES] = ZERO[_GAUGES]
        self._last = tuple(last)

    def counted(self, fetch: Callable[[np.ndarray], Any]) -> Callable[[np.ndarray], Any]:
        """``fetch`` counting, per batch, the bytes it read from local shards."""
        rate, first, store = self._rate, self._first, self.dataset.decoded
        if not rate.any() or self._sliced:  # a source counting its own bytes (its ids are
            return fetch                     # not the shards' samples: clips, rows)

        def counted_fetch(ids: np.ndarray) -> Any:
            before = store.stats.hits if store is not None else 0
            out = fetch(ids)
            n = len(ids)
            if n:
                read = float(rate[np.searchsorted(first, ids, side="right") - 1].sum())
                if store is not None:  # samples the store served were not read from shards
                    served = min(n, max(0, store.stats.hits - before))
                    read *= (n - served) / n
                self.local_bytes += read
            return out

        return counted_fetch

    def _read(self) -> tuple[int, ...]:
        ds = self.dataset
        requests, fetched = REMOTE.read()
        cache = ds.shards.cache
        l1 = (cache.stats.hits, cache.stats.misses, cache.stats.fills) if cache else (0, 0, 0)
        store = ds.decoded
        dec = (store.stats.hits, store.stats.misses) if store is not None else (0, 0)
        l2 = self._index.counts() if self._index is not None else (0, 0)
        local = self.local_bytes
        if self._sliced:
            local += (ds.bytes_read or 0) - self._sliced_from
        retries, peak, busy, area = REMOTE.link()
        return (round(local), requests, fetched, *l1, *dec, *l2, retries, peak, busy // 1000,
                area // 1000, *link_figures())

    def take(self) -> tuple[int, ...]:
        """What was counted since the last take (the most in flight: its growth, so that a
        pass's takes add up to its peak; the controller's figures: their change, so that the takes
        add up to the latest). A tier whose counters went back (a store or
        index that started counting afresh in a new process) counts from zero."""
        now = self._read()
        last, self._last = self._last, now
        out = [n - b for n, b in zip(now, last)]
        for lo, hi in ((3, 6), (6, 8), (8, 10)):  # the tiers, each restarted as a whole
            if any(x < 0 for x in out[lo:hi]):
                out[lo:hi] = now[lo:hi]
        out[11] = max(0, out[11])  # another pass of this process marked the peak afresh
        return tuple(out)
