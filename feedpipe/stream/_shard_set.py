"""``ShardSet``: the one sample source every read path goes through.

A dataset's shards, opened on demand. It maps each shard once (:class:`ShardReader`) and
verifies it when asked. Where there is a node's L1 cache, it fetches the shard there first,
prefetches ahead of the plan, and holds a lease on the cached file while it is open. Once
``max_open`` are open, it closes the shard opened longest ago. Everything that reads samples
uses its public methods:
:class:`~feedpipe.FeedDataset`, every batch route of :class:`~feedpipe.FeedLoader` and
:class:`~feedpipe.DeviceCache`.

A gzip shard (``.tar.gz``, ``.tgz``) is always read through an L1 cache, which decompresses it
once (:mod:`feedpipe.caches.l1._entry`): the dataset's cache, else the default cache directory with
a budget of :data:`GZIP_CACHE_SIZE` bytes, said in a log record (once per dataset and process).
Plain shards of the same dataset are read where they are.

It is picklable: a copy sent to a worker process starts with no shard open and opens what that
process reads (maps and locks do not cross processes).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from .._helpers.file_lock import Lease
from .._redact import logger
from ..errors import OutputError
from ..format._compression import readable
from ..format._manifest import Manifest, join
from ..format._reader import ShardReader

if TYPE_CHECKING:
    from ..caches._shards import ShardCache
    from ..plan._order import Plan, Split
    from ..plan._world import World

log = logger("feedpipe.cache")

# The byte budget of the default shard cache that gzip shards are decompressed into when no
# cache_dir= is given (docs/converting.md): room for a working set of shards, not a home folder
# filled by one dataset. cache_dir=True, cache_size=... keeps that directory with another one.
GZIP_CACHE_SIZE = 10 * 10**9
_said: set[tuple[str, str]] = set()  # (dataset, directory) whose record this process gave


class ShardSet:
    """The shards of one dataset, read by global sample id.

    Args:
        root: the dataset's root (local path or fsspec URL).
        manifest: its manifest (shard names, sample counts, sizes, hashes).
        cache: the node-local L1 cache to read through (``None``: read the shards where they are).
        verify: check each shard's hash and its index against its tar headers when it is opened.
        max_open: shards kept open at once in this process.

    Example:
        >>> from feedpipe import load_manifest
        >>> shards = ShardSet("shards/example", load_manifest("shards/example"))
        >>> s = shards.sample(0)
        >>> s["__key__"], s["__index__"], sorted(k for k in s if not k.startswith("__"))
        ('cls_000/00000', 0, ['cls', 'jpg', 'json'])
        >>> shards.close()
    """

    def __init__(self, root: str, manifest: Manifest, *, cache: ShardCache | None = None,
                 verify: bool = False, max_open: int = 64) -> None:
        self.root = root
        self.manifest = manifest
        self.cache = cache
        self.verify = verify
        self.max_open = max(1, int(max_open))
        self.names = tuple(r.name for r in manifest.shards)
        self.counts = tuple(r.samples for r in manifest.shards)
        self.first = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.first[1:])
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._leases: dict[int, Lease] = {}  # cached shards held in use by open readers
        self._clock: Any = None  # the running epoch's Prefetcher: eviction's view of the plan
        self._held: frozenset[int] = frozenset()  # shards a batch is being copied from
        self._first = False  # the next batch is an epoch's first: see early()
        self._pid = os.getpid()
        self._packed = frozenset(i for i, r in enumerate(manifest.shards) if readable(r.name))
        self._unpack = cache if cache is not None or not self._packed else _default_cache(root)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def num_samples(self) -> int:
        """Samples over every shard."""
        return int(self.first[-1])

    @property
    def local(self) -> bool:
        """Whether every shard is read from a file this process can map (a local dataset, not
        read through a cache, whose files may be evicted once let go)."""
        from .._helpers.storage import is_local

        return self.cache is None and is_local(self.root) and not self._packed

    def url(self, shard: int) -> str:
        """Where shard number ``shard`` is read from."""
        return join(self.root, self.names[shard])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, index within the shard)`` of global sample ids."""
        s = np.searchsorted(self.first, ids, side="right") - 1
        return s, ids - self.first[s]

    # -- opening ---------------------------------------------------------------------------
    def reader(self, shard: int, *, index: bool = True) -> ShardReader:
        """The open reader of ``shard``, opened (fetched into the cache first) if needed.
        ``index=False``: its index is read when first needed, not now (for a caller that only
        copies byte ranges it was given)."""
        r = self._readers.get(shard)
        if r is not None:
            return r
        if self._pid != os.getpid():
            self._forked()
        if len(self._readers) >= self.max_open:
            # first opened, first closed: windows advance monotonically, and under a full
            # permutation every policy misses alike. Closed before the next opens, so that a
            # cached shard leaves use before another is fetched. A held shard stays open.
            old = next((s for s in self._readers if s not in self._held), None)
            if old is not None:
                self._close(old)
        rec = self.manifest.shards[shard]
        path = url = self.url(shard)
        lease = None
        packed = shard in self._packed
        cache = self.cache if not packed else self._unpack
        if cache is not None:
            clock = self._clock
            if clock is not None:
                clock.advance(shard)
                for done in clock.done_with(list(self._leases)):  # out of use: evictable
                    self._close(done)
            rank = clock.rank if clock is not None else None
            # (a gzip shard must be cached to be read: it keeps the over-budget allowance)
            until = clock.busy_until if clock is not None and not packed else None
            lease = cache.acquire(url, rec, rank, quiet=packed and bool(self._leases),
                                  until=until)
            if lease is None and packed and self._leases:
                # No room in the budget: the entries in use may be this process's own open
                # shards (up to max_open). Let go of those no batch holds, so that the cache can
                # evict them (it never evicts what a reader holds), and ask once more.
                for s in [s for s in self._leases if s not in self._held]:
                    self._close(s)
                lease = cache.acquire(url, rec, rank, until=until)
            path = url if lease is None else lease.path  # None: cache full, read uncached
            if lease is None and packed:
                raise OutputError(
                    f"{url}: a gzip shard is read from its plain tar, decompressed into the shard "
                    f"cache {cache.path}, which has no room for it now ({rec.tar_size} bytes; "
                    "see the warning above); free space there or raise cache_size")
        try:
            # (a gzip shard's hash is of its compressed bytes, checked as the cache fetched it)
            r = ShardReader(path, name=rec.name, base=int(self.first[shard]),
                            expected_bytes=rec.tar_size,
                            sha256=None if packed else rec.sha256, verify=self.verify,
                            samples=rec.samples, lazy=not index)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self._readers[shard] = r
        if lease is not None:
            self._leases[shard] = lease
        return r

    @contextmanager
    def hold(self, shards: Iterable[int]) -> Iterator[None]:
        """Keep these shards open while the block runs (a batch copied from more shards than
        ``max_open``): opening another closes only shards not held."""
        before = self._held
        self._held = before | frozenset(int(s) for s in shards)
        try:
            yield
        finally:
            self._held = before

    def open_all(self) -> bool:
        """Open every shard here and keep them open, when they all fit in ``max_open`` and none
        is read through a cache. Worker processes forked from this one inherit the parsed
        indexes, later epochs reuse them, and no reader is closed under a borrower of its map.
        True when all are open."""
        if len(self.names) > self.max_open or self.cache is not None or self._packed:
            return False
        for s in range(len(self.names)):
            self.reader(s)
        return True

    def is_open(self, shard: int) -> bool:
        """Whether this process has shard number ``shard`` open."""
        return shard in self._readers

    def open_readers(self) -> list[ShardReader] | None:
        """Every shard's reader in shard order when all are open (:meth:`open_all`), else None."""
        if len(self._readers) != len(self.names):
            return None
        return [self._readers[s] for s in range(len(self.names))]

    # -- reading ---------------------------------------------------------------------------
    def sample(self, g: int) -> dict[str, Any]:
        """Sample ``g`` (a global id): ``__key__``, ``__shard__``, ``__index__`` and one bytes
        entry per field (a ``memoryview`` of the shard's map when it is local)."""
        s = int(np.searchsorted(self.first, g, side="right")) - 1
        if not 0 <= g < self.num_samples:
            raise IndexError(f"sample id {g} is outside the dataset ({self.num_samples} samples)")
        return self.reader(s).sample(int(g - self.first[s]))

    def check(self, shards: Iterable[int]) -> None:
        """Raise :class:`ShardFormatError` naming the shard if one of these open shards changed
        size since it was opened (see :meth:`ShardReader.check`): called before a batch reads
        from the maps, so that a truncation is an error, not a ``SIGBUS``."""
        readers = self._readers
        for s in shards:
            r = readers.get(int(s))
            if r is not None:
                r.check()

    def changed(self) -> str | None:
        """The first local shard whose file no longer has the manifest's size, said as an error
        message, or ``None``. For a worker process that died reading (a read past the new end of
        a truncated map is a ``SIGBUS``): the training process names the shard instead.
        Remote and cached shards are not looked at (their files are not the user's to cut)."""
        if not self.local:
            return None
        from .._helpers.storage import local_path

        for s, rec in enumerate(self.manifest.shards):
            url = self.url(s)
            try:
                size = os.stat(local_path(url)).st_size
            except OSError as e:
                return f"{url}: the shard cannot be read any more ({e.strerror})"
            if size != rec.bytes:
                return (f"{url}: the shard changed while it was being read: {size} bytes now, "
                        f"{rec.bytes} in the manifest (truncated or rewritten in place); "
                        "restore it (or re-fetch the dataset) and resume from the last checkpoint")
        return None

    def drop_pages(self) -> None:
        """Unmap the touched pages of every open shard's map (:meth:`ShardReader.drop_pages`)."""
        for r in self._readers.values():
            r.drop_pages()

    # -- an epoch of one reader (rank, worker) ---------------------------------------------
    def begin(self, plan: Plan, next_plan: Plan, split: Split, world: World, batch_size: int,
              worker: int, workers: int) -> None:
        """Start prefetching this reader's shards of the epoch into the cache (no cache: nothing
        to do: see :meth:`begin_uncached`). :meth:`end` stops it; a cached shard stays leased
        while its reader is open."""
        if self.cache is None:
            return
        if self._pid != os.getpid():
            self._forked()
        from ..caches._prefetch import Prefetcher

        shards = self.manifest.shards
        p = Prefetcher.for_reader(self.cache, [self.url(s) for s in range(len(shards))], shards,
                                  plan, next_plan, split, world, batch_size, worker, workers)
        self._clock = p
        p.start()
        self._first = True

    def begin_uncached(self) -> None:
        """An epoch without a cache begins: its first batch is read by range (:meth:`early`)."""
        from .._helpers.storage import is_local

        self._first = not is_local(self.root)

    def early(self, ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """The first batch after :meth:`begin`: those of its samples (by global id) whose remote
        shards have not arrived in the cache yet, each read by its own range request while the
        prefetch keeps fetching the shards whole (why: docs/concepts.md, "Reading from object
        storage"); their dicts are as :meth:`sample` makes them, with ``bytes`` fields. Without
        a cache (``cache_dir=False``) those of its samples whose shards are not open yet, all
        at once, rather than one shard after another (each opened with a request for its size,
        then its index, then one sample after another). Empty for any other batch, a local
        dataset, ``verify=True`` (nothing is served before its shard's hash is checked), gzip
        shards (read from their plain tar only) and ``FEEDPIPE_FIRST_BATCH_RANGES=0``."""
        if not self._first:
            return {}
        self._first = False
        from .._helpers.storage import is_local
        from ..caches._early import GAP, Want, enabled, read_early

        cache = self.cache
        if self.verify or is_local(self.root) or not enabled():
            return {}
        s_of, i_of = self.locate(ids)
        pairs: dict[int, list[tuple[int, int]]] = {}
        for g, s, i in zip(ids.tolist(), s_of.tolist(), i_of.tolist()):
            if s not in self._readers and s not in self._packed:
                pairs.setdefault(s, []).append((g, i))
        recs = self.manifest.shards
        wants = [Want(self.url(s), recs[s], p) for s, p in pairs.items()
                 if cache is None or not cache.ready(self.url(s), recs[s])]
        got = read_early(wants, GAP if cache is None else -1)  # (why: caches._early.GAP)
        if cache is not None:
            cache.stats.early += len(got)
        return got

    def end(self) -> None:
        """Stop this epoch's prefetching and release what it held in use (cached shards)."""
        p, self._clock = self._clock, None
        self._first = False
        if p is None:
            if self.cache is None and self._unpack is not None:  # gzip shards read uncached
                for shard in list(self._leases):
                    self._close(shard)
                self._unpack.trim()
            return
        p.close()
        for shard in list(self._leases):
            self._close(shard)
        assert self.cache is not None
        self.cache.trim(p.rank)

    def close(self) -> None:
        """Close every open shard and release its lease."""
        self.end()
        for shard in list(self._readers):
            self._close(shard)

    def _close(self, shard: int) -> None:
        r = self._readers.pop(shard, None)
        if r is not None:
            r.close()
        lease = self._leases.pop(shard, None)
        if lease is not None:
            lease.release()

    def _forked(self) -> None:
        # A copy inherited by fork. Uncached readers are kept: their maps and parsed indexes
        # are valid here (what open_all is for). Cached ones are dropped with their leases,
        # which are the parent's locks and bookkeeping (closing the inherited descriptor
        # leaves the parent's lock in place).
        self._pid = os.getpid()
        self._clock = None
        if self.cache is None:  # only gzip shards were read through a cache: drop those
            for shard in list(self._leases):
                self._leases.pop(shard).release()
                self._readers.pop(shard, None)
            return
        for lease in self._leases.values():
            lease.release()
        self._leases.clear()
        self._readers.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = OrderedDict()  # maps do not cross processes; reopened on demand
        state["_leases"] = {}  # nor do locks
        state["_clock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()


def _default_cache(root: str) -> ShardCache:
    """The cache that decompresses the gzip shards of a dataset given no ``cache_dir``: the
    default directory, said in a log record (it takes disk space the user did not name)."""
    from .._helpers.sizes import format_size
    from ..caches._shards import ShardCache, default_cache_dir

    path = default_cache_dir()
    if (root, path) not in _said:
        _said.add((root, path))
        log.warning("%s: gzip shards (.tar.gz, .tgz) are read from their plain tar, decompressed "
                    "once into the shard cache; no cache_dir= was given, so the default one is "
                    "used (%s, at most %s: past it, the shards no reader holds are evicted): "
                    "pass cache_dir= (and cache_size=) to choose, or cache_dir=True, "
                    "cache_size=... for this directory with another bound", root, path,
                    format_size(GZIP_CACHE_SIZE))
    return ShardCache(path, GZIP_CACHE_SIZE)
