"""The one shape every cache tier reports its figures in (``tier.tier_stats()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SHARDS, FUNCTION_INDEX, DECODED = "L1 shards", "L2 function index", "decoded store"
DEVICE = "L3 device cache"


@dataclass(frozen=True)
class TierStats:
    """The figures every cache tier reports in one shape (``tier.tier_stats()``): the L1
    :class:`~feedpipe.caches._shards.ShardCache`, the
    :class:`~feedpipe.caches.decoded._store.DecodedStore`, the L2
    :class:`~feedpipe.caches.l2._index.FunctionIndex` and the L3
    :class:`~feedpipe.device._cache.DeviceCache`.

    Attributes:
        name: the tier (``"L1 shards"``, ``"decoded store"``, ``"L2 function index"``,
            ``"L3 device cache"``).
        hits: lookups this process served from the tier (an L1 shard, a decoded sample, a
            memoised value, a resident sample).
        misses: lookups it did not serve (fetched, computed or read elsewhere).
        bytes: bytes the tier holds (on disk for L1, the decoded store and L2; in device
            memory for L3).
        entries: what it holds, in its unit (shards, samples, values, samples).

    Example:
        >>> s = TierStats("L1 shards", hits=3, misses=1, bytes=4096, entries=4)
        >>> s.hit_ratio
        0.75
    """

    name: str
    hits: int
    misses: int
    bytes: int
    entries: int

    @property
    def hit_ratio(self) -> float:
        """``hits / (hits + misses)``; 0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
