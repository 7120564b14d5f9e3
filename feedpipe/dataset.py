"""``FeedDataset``: the streaming ``IterableDataset``. A thin facade: the plan decides what each
rank and worker reads (:mod:`feedpipe.plan`), the reader reads it (:mod:`feedpipe.reader`)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .errors import PlanError, StateError
from .decoded_store import open_decoded_store
from .file_lock import Lease
from .manifest import dataset_root, join, load_manifest
from .plan import Plan, Split, iter_id_chunks
from .reader import ShardReader
from .shard_cache import ShardCache, make_cache
from .world import resolve_world

STATE_VERSION = 1
_EPOCH, _START, _BATCH = 0, 1, 2


class FeedDataset(IterableDataset):
    """Stream a feedpipe (or ``feedpipe index``-ed WebDataset) shard dataset.

    Each epoch every sample is delivered exactly once over all ranks and workers, in an order that
    depends on ``(dataset, seed, epoch)`` only; every rank gets the same number of samples (see
    :mod:`feedpipe.plan`). Samples are dicts: ``__key__``, ``__shard__``, ``__index__`` (global
    sample id), ``__epoch__`` and ``__seed__`` (for reproducible per-sample augmentation), and one
    raw-bytes entry per field (zero-copy ``memoryview`` of a local shard in the process that reads
    it; ``bytes`` when a worker process must send a raw sample to the main process).

    Args:
        url: dataset root (local path or fsspec URL) holding ``manifest.json``.
        shuffle: permute samples each epoch (``set_epoch``); ``False``: manifest order.
        seed: the order's seed.
        drop_last: ``False`` pads ranks to equal length by repeating at most ``world_size - 1``
            samples per epoch; ``True`` leaves at most ``world_size - 1`` out.
        transform: a picklable callable applied to each sample dict in the worker.
        shuffle_window: shards mixed together (``None``: all). See :class:`feedpipe.plan.Plan`.
        rank, world_size: explicit world; detected from ``torch.distributed`` or the launcher's
            environment when not given.
        verify: hash every shard against the manifest when it is first opened.
        max_open_shards: shard maps a worker keeps open at once.
        cache_dir: the node-local L1 shard cache (:mod:`feedpipe.shard_cache`): a directory,
            ``True``/``"auto"`` for ``$XDG_CACHE_HOME/feedpipe/shards``, or a
            :class:`~feedpipe.shard_cache.ShardCache`. Shards are fetched there once per node
            (prefetched ahead of use, evicted by the plan) and read with mmap. ``None``: remote
            shards are read with range requests.
        cache_size: the cache's byte budget (``"20GB"``, ``"512MiB"`` or an int; ``None``: no
            limit).
        decoded_cache: keep ``transform``'s outputs in a node-local memmap store under this
            directory (``True``/``"auto"``: ``$XDG_CACHE_HOME/feedpipe/decoded``): the first epoch
            fills it, later ones read it without reading a shard or calling the transform. The
            transform must be deterministic with fixed-shape outputs (e.g. decode and resize);
            see :mod:`feedpipe.decoded_store`. Counters: ``ds.decoded.stats``.

    Example:
        >>> ds = FeedDataset("shards/example")
        >>> len(ds), sorted(k for k in next(iter(ds)) if not k.startswith('__'))
        (24, ['cls', 'jpg', 'json'])
    """

    def __init__(
        self,
        url: str,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        shuffle_window: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        verify: bool = False,
        max_open_shards: int = 64,
        cache_dir: str | os.PathLike[str] | bool | ShardCache | None = None,
        cache_size: int | str | None = None,
        decoded_cache: str | os.PathLike[str] | bool | None = None,
    ) -> None:
        super().__init__()
        self.url = dataset_root(url)
        self.manifest = ShardCache.manifest_of(url, cache_dir)
        if self.manifest.total_samples == 0:
            raise PlanError(f"{url}: the dataset holds no samples")
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.transform = transform
        self.shuffle_window = shuffle_window
        self.world = resolve_world(rank, world_size)
        self.verify = verify
        self.max_open_shards = max(1, max_open_shards)
        self._counts = tuple(s.samples for s in self.manifest.shards)
        if drop_last and self.manifest.total_samples < self.world.world_size:
            raise PlanError(
                f"{url}: {self.manifest.total_samples} samples cannot give each of "
                f"{self.world.world_size} ranks one with drop_last=True; use drop_last=False "
                "(pads by repeating samples) or fewer ranks"
            )
        # Epoch, resume position and batch size live in shared memory so that persistent
        # workers see set_epoch() and load_state_dict() made after they started.
        self._shared = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._shared[_BATCH] = 1
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self.cache = make_cache(cache_dir, cache_size)
        self.decoded = open_decoded_store(decoded_cache, transform, self.manifest)
        self._leases: dict[int, Lease] = {}  # cached shards held in use by open readers
        self._clock: Any = None  # the running iterator's Prefetcher: eviction's view of the plan
        self._pid = os.getpid()
        self._names = tuple(s.name for s in self.manifest.shards)
        self._first = Plan(self._counts, self.seed, 0, self.shuffle, self.shuffle_window).first_ids

    # -- the epoch and its plan -------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._shared[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on (clears a pending resume point)."""
        self._shared[_EPOCH] = int(epoch)
        self._shared[_START] = 0

    @property
    def batch_size(self) -> int:
        return int(self._shared[_BATCH])

    def set_batch_size(self, batch_size: int) -> None:
        """Align worker hand-over with a DataLoader of this batch size (FeedLoader does this)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self._shared[_BATCH] = int(batch_size)

    def plan(self, epoch: int | None = None) -> Plan:
        return Plan(self._counts, self.seed, self.epoch if epoch is None else epoch,
                    self.shuffle, self.shuffle_window)

    def split(self) -> Split:
        return Split(self.manifest.total_samples, self.world.world_size, self.world.rank,
                     int(self._shared[_START]), self.drop_last)

    def __len__(self) -> int:
        """Samples this rank delivers in the current (possibly resumed) epoch."""
        return self.split().length

    # -- resumption (used by FeedLoader, which knows what the loop consumed) ---------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The resumable state: epoch and the global position reached (``consumed``)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": int(self._shared[_START]) if consumed is None else int(consumed),
            "num_samples": self.manifest.total_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue ``state['epoch']`` at ``state['position']`` on the next iteration."""
        if state.get("version") != STATE_VERSION:
            raise StateError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        for k, mine in (("num_samples", self.manifest.total_samples), ("seed", self.seed),
                        ("shuffle", self.shuffle), ("shuffle_window", self.shuffle_window)):
            if state.get(k) != mine:
                raise StateError(
                    f"cannot resume: the saved state has {k}={state.get(k)!r} but this dataset "
                    f"has {k}={mine!r}; the order would differ and samples would repeat or be lost"
                )
        pos = int(state["position"])
        if not 0 <= pos <= self.manifest.total_samples:
            raise StateError(f"saved position {pos} is outside the epoch")
        self._shared[_EPOCH] = int(state["epoch"])
        self._shared[_START] = pos

    def compute(self, plan: Plan, index: int) -> Any:
        """Sample ``index``'s transform output in ``plan``'s epoch, read from its shard and
        stored in the decoded store: the store's miss path for :mod:`feedpipe.store_batches`,
        the same steps as a miss in :meth:`__iter__`."""
        shards, local = plan.shard_of(np.asarray([index], dtype=np.int64))
        s, i = int(shards[0]), int(local[0])
        sample = self._reader(s).sample(i)
        sample["__epoch__"] = plan.epoch
        sample["__seed__"] = self.seed
        return self._transformed(sample, index, s)

    def _transformed(self, sample: dict[str, Any], index: int, shard: int) -> Any:
        """The transform's output for ``sample`` (global id ``index``, in shard ``shard``),
        stored in the decoded store when there is one."""
        key = sample["__key__"]
        return self._stored(self.transform(sample), index, shard, key)  # type: ignore[misc]

    def _stored(self, out: Any, index: int, shard: int, key: str) -> Any:
        """``out`` stored in the decoded store as sample ``index`` (key ``key`` of shard
        ``shard``) and returned as a hit returns it; ``out`` itself without a store. Called from
        one thread: the threaded loader (:mod:`feedpipe.thread_batches`) stores here what its
        pool computed."""
        if self.decoded is None:
            return out
        return self.decoded.put(index, out, key=key, shard=self._names[shard])

    # -- reading -------------------------------------------------------------------------
    def _reader(self, shard: int) -> ShardReader:
        r = self._readers.get(shard)
        if r is not None:
            return r
        if len(self._readers) >= self.max_open_shards:
            # first opened, first closed: windows advance monotonically, and under a full
            # permutation every policy misses alike. Closed before the next opens, so that a
            # cached shard leaves use before another is fetched.
            old, reader = self._readers.popitem(last=False)
            reader.close()
            if old in self._leases:
                self._leases.pop(old).release()
        rec = self.manifest.shards[shard]
        path = url = join(self.url, rec.name)
        lease = None
        if self.cache is not None:
            clock = self._clock
            if clock is not None:
                clock.advance(shard)
                for done in clock.done_with(list(self._leases)):  # out of use: evictable
                    self._readers.pop(done).close()
                    self._leases.pop(done).release()
            lease = self.cache.acquire(url, rec, clock.rank if clock is not None else None)
            path = url if lease is None else lease.path  # None: cache full, read uncached
        try:
            r = ShardReader(path, name=rec.name, base=int(self._first[shard]),
                            expected_bytes=rec.bytes, sha256=rec.sha256, verify=self.verify)
            if len(r) != rec.samples:
                from .errors import ShardFormatError

                raise ShardFormatError(
                    f"{r.url}: the index lists {len(r)} samples, the manifest {rec.samples}"
                )
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self._readers[shard] = r
        if lease is not None:
            self._leases[shard] = lease
        return r

    def _open_all(self) -> bool:
        """Open every shard here (map it, parse its index) when they all fit in
        ``max_open_shards`` and nothing is cached, and keep them open: workers forked from this
        process inherit the parsed indexes instead of each parsing every index every epoch,
        later epochs reuse them, and no reader is closed under a borrower of its map. True when
        all are open."""
        n = len(self.manifest.shards)
        if n > self.max_open_shards or self.cache is not None:
            return False
        for s in range(n):
            if s not in self._readers:
                self._reader(s)
        return True

    def _start_prefetch(self, plan: Plan, split: Split, worker: int, workers: int) -> Any:
        """The Prefetcher of one iterator (None without a cache); starts its threads."""
        if self.cache is None:
            return None
        if self._pid != os.getpid():  # forked: the inherited leases are the parent's
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()
            self._readers.clear()
            self._pid = os.getpid()
        from .prefetch import Prefetcher

        shards = self.manifest.shards
        p = Prefetcher.for_reader(self.cache, [join(self.url, r.name) for r in shards], shards,
                                  plan, self.plan(plan.epoch + 1), split, self.world,
                                  self.batch_size, worker, workers)
        self._clock = p
        p.start()
        return p

    def _stop_prefetch(self, p: Any) -> None:
        if p is None:
            return
        p.close()
        if self._clock is p:
            self._clock = None
        for shard, lease in list(self._leases.items()):  # release what this epoch held in use
            self._readers.pop(shard).close()
            lease.release()
        self._leases.clear()
        self.cache.trim(p.rank)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        transform, decoded = self.transform, self.decoded
        to_bytes = info is not None
        for g, s, sample in self._read(worker, workers, stored=decoded is not None):
            if s < 0:  # the decoded store's output
                yield sample
                continue
            if transform is not None:
                sample = self._transformed(sample, g, s)
            if to_bytes and isinstance(sample, dict):
                for k, v in sample.items():
                    if type(v) is memoryview:
                        sample[k] = v.tobytes()
            yield sample

    def _read(self, worker: int = 0, workers: int = 1, *,
             stored: bool = True) -> Iterator[tuple[int, int, Any]]:
        """One worker's samples of this epoch before the transform: ``(global id, shard,
        sample dict)`` in delivery order, or ``(global id, -1, output)`` for a sample whose
        transform output the decoded store holds (with ``stored=True``). Prefetches shards
        into the cache while it runs; :meth:`__iter__` and the threaded loader
        (:mod:`feedpipe.thread_batches`) share it."""
        plan = self.plan()
        epoch, seed = plan.epoch, self.seed
        split = self.split()
        decoded = self.decoded if stored else None
        # a complete decoded store needs no shard this epoch: nothing to prefetch
        complete = decoded is not None and decoded.complete()
        prefetcher = None if complete else self._start_prefetch(plan, split, worker, workers)
        open_readers, get_reader = self._readers, self._reader
        try:
            for ids in iter_id_chunks(plan, split, self.batch_size, worker, workers):
                shards, local = plan.shard_of(ids)
                for g, s, i in zip(ids.tolist(), shards.tolist(), local.tolist()):
                    if decoded is not None:
                        out = decoded.get(g)
                        if out is not None:
                            yield g, -1, out
                            continue
                    reader = open_readers.get(s)
                    if reader is None:
                        reader = get_reader(s)
                    sample = reader.sample(i)
                    sample["__epoch__"] = epoch  # with __index__ and __seed__: per-sample
                    sample["__seed__"] = seed  # augmentation seeds, reproducible on resume
                    yield g, s, sample
        finally:
            self._stop_prefetch(prefetcher)
            if decoded is not None:
                decoded.record()

    def _drop_pages(self) -> None:
        """Unmap the touched pages of every open shard's map (``ShardReader.drop_pages``)."""
        for reader in self._readers.values():
            reader.drop_pages()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = OrderedDict()  # maps do not cross processes; reopened on demand
        state.pop("_columns", None)  # raw batches' index columns: rebuilt where needed
        state["_leases"] = {}  # nor do locks
        state["_clock"] = None
        return state


def sample_ids_of(ds: FeedDataset) -> np.ndarray:
    """The ids this rank delivers this epoch with ``num_workers=0`` (tools and tests)."""
    plan, split = ds.plan(), ds.split()
    return plan.sample_ids(split.positions(0, split.length))
