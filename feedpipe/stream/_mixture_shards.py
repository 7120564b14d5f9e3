"""The shards of a :class:`~feedpipe.Mixture`'s sources as one numbered set.

The parts of a route that address samples and shards by number (the ``refs`` fetch and its
resolver, the I/O tally, the ``rows`` sink's page drops, a worker's check of a cut shard) read
a mixture through :class:`MixtureShards` as they read one dataset's
:class:`~feedpipe.ShardSet`; each shard is still read by its own source's set (its cache,
verification and open-shard limit).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..format._reader import ShardReader


def _union_manifest(sets: list[Any], samples: int) -> UnionManifest:
    """What a reader needs of a manifest for the shards of all ``sets``: their shard records,
    every field any of them has (in first-seen order), and ``samples``."""
    fields: dict[str, None] = {}
    for s in sets:
        fields.update(dict.fromkeys(s.manifest.fields))
    return UnionManifest([r for s in sets for r in s.manifest.shards], list(fields), samples)


def _cache_tally(sets: list[Any]) -> CacheTally | None:
    """The counters of the sets' shard caches summed (each cache once), ``None`` without one."""
    caches = {id(s.cache): s.cache for s in sets if s.cache is not None}
    return CacheTally(list(caches.values())) if caches else None


class MixtureShards:
    """The shards of every source of a mixture as one numbered set: shard ``k`` of source ``s``
    is shard ``offset[s] + k``, and a sample's number is its source's first number plus its id
    in the source. Reading is the sources' own :class:`~feedpipe.ShardSet`'s (their caches,
    verification and open-shard limits)."""

    def __init__(self, sets: Sequence[Any]) -> None:
        self.sets = list(sets)
        self.offsets = np.cumsum([0] + [len(s) for s in self.sets])  # per source: first shard
        self.bases = np.cumsum([0] + [s.num_samples for s in self.sets])  # first sample
        self.names = tuple(n for s in self.sets for n in s.names)
        self.counts = tuple(c for s in self.sets for c in s.counts)
        self.first = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.first[1:])
        #: per shard of the union: its source
        self.source_of = np.repeat(np.arange(len(self.sets)), [len(s) for s in self.sets])
        # per shard of the union: its source's set and its number there (looked up per batch
        # and shard by the refs route)
        self._at = [(s, k) for s in self.sets for k in range(len(s))]
        self._where_n = [(i, k) for i, s in enumerate(self.sets) for k in range(len(s))]
        # every shard's reader, once every set keeps all its shards open (open_all): none is
        # closed while they are, so a batch looks its shards up here, and holds none
        self._fixed: list[ShardReader] | None = None
        #: per shard of the union: its source's first sample number and its source's seed
        self.base_of = self.bases[self.source_of]
        self.manifest = _union_manifest(self.sets, int(self.first[-1]))
        # the sources' prefetchers are planned by one dataset's plan, not a mixture's: the
        # mixture's sources fetch into their caches as each shard is first read (begin() does
        # nothing); ``cache`` only sums their caches' counters for the I/O figures
        self.cache = _cache_tally(self.sets)
        remote = [s.root for s in self.sets if not _is_local(s.root)]
        self.root = remote[0] if remote else self.sets[0].root

    def __len__(self) -> int:
        return len(self.names)

    @property
    def num_samples(self) -> int:
        return int(self.first[-1])

    @property
    def local(self) -> bool:
        return all(s.local for s in self.sets)

    def _where(self, shard: int) -> tuple[Any, int]:
        return self._at[shard]

    def url(self, shard: int) -> str:
        ss, k = self._where(shard)
        return str(ss.url(k))

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.searchsorted(self.first, ids, side="right") - 1
        return s, ids - self.first[s]

    def reader(self, shard: int, *, index: bool = True) -> ShardReader:
        fixed = self._fixed
        if fixed is not None:
            return fixed[shard]
        ss, k = self._at[shard]
        return ss.reader(k, index=index)

    def hold(self, shards: Iterable[int]) -> AbstractContextManager[None]:
        """Keep these shards open while the block runs (each in its source's set)."""
        if self._fixed is not None:
            return _HELD
        return self._hold(shards)

    @contextmanager
    def _hold(self, shards: Iterable[int]) -> Iterator[None]:
        per: dict[int, list[int]] = {}
        where = self._where_n
        for sh in shards:
            src, k = where[sh]
            got = per.get(src)
            if got is None:
                per[src] = [k]
            else:
                got.append(k)
        with ExitStack() as stack:
            for src, ks in per.items():
                stack.enter_context(self.sets[src].hold(ks))
            yield

    def check(self, shards: Iterable[int]) -> None:
        for sh in shards:
            ss, k = self._where(int(sh))
            ss.check([k])

    def open_all(self) -> bool:
        if all([s.open_all() for s in self.sets]):
            self._fixed = self.open_readers()
        return self._fixed is not None

    def open_readers(self) -> list[ShardReader] | None:
        out: list[ShardReader] = []
        for s in self.sets:
            readers = s.open_readers()
            if readers is None:
                return None
            out.extend(readers)
        return out

    def is_open(self, shard: int) -> bool:
        ss, k = self._where(shard)
        return bool(ss.is_open(k))

    def changed(self) -> str | None:
        for s in self.sets:
            why = s.changed()
            if why is not None:
                return str(why)
        return None

    def drop_pages(self) -> None:
        for s in self.sets:
            s.drop_pages()

    def begin(self, *args: Any) -> None:  # no prefetch plan across sources (see cache)
        return None

    def begin_uncached(self) -> None:
        return None

    def end(self) -> None:
        """The end of a pass: a cached source's shards are closed, their leases in the cache
        released (a set closes them itself only at the end of a prefetch it ran, and a mixture
        runs none)."""
        for s in self.sets:
            if s.cache is not None:
                s.close()
            else:
                s.end()

    def close(self) -> None:
        self._fixed = None
        for s in self.sets:
            s.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fixed"] = None  # maps do not cross processes; each set reopens its own
        return state


_HELD = nullcontext()


class CacheTally:
    """The counters of the sources' shard caches, summed (what the I/O tally reads of a
    cache)."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    @property
    def stats(self) -> Any:
        from types import SimpleNamespace

        fields = ("hits", "misses", "fills")
        return SimpleNamespace(**{f: sum(getattr(c.stats, f) for c in self.caches)
                                  for f in fields})


@dataclass
class UnionManifest:
    """What the parts of a route read of a manifest, for the union of a mixture's sources: their
    shard records in union order, their fields in order of first appearance and the samples an
    epoch holds (the sources' total for the union; a mixture's ``epoch_size`` for it)."""

    shards: list[Any]
    fields: list[str]
    total_samples: int


def _is_local(root: str) -> bool:
    from .._helpers.storage import is_local

    return bool(is_local(root))
