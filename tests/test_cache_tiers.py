"""One stats contract for the four cache tiers: the L1 ShardCache, the DecodedStore, the L2
FunctionIndex and the L3 DeviceCache (on ``device="cpu"``) report ``tier_stats()`` in one shape,
and count hits, misses, entries and bytes the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from _data import make_dataset

from feedpipe import FeedDataset
from feedpipe.caches._shards import ShardCache
from feedpipe.caches._stats import DECODED, DEVICE, FUNCTION_INDEX, SHARDS, TierStats
from feedpipe.caches.decoded._store import DecodedStore
from feedpipe.caches.l2._index import FunctionIndex
from feedpipe.device._cache import DeviceCache


class Tier(NamedTuple):
    """How to drive one tier through the contract with ``units`` lookups a pass."""

    name: str
    units: int
    make: Callable[[Path], Any]
    fill: Callable[[Any], None]  # put ``units`` entries in (counting no hits)
    serve: Callable[[Any], None]  # look the same ``units`` up again
    miss: Callable[[Any], None]  # look up ``units`` entries it does not hold


def drain(items: Any) -> None:
    for _ in items:
        pass


def check_tier(tier: Tier, tmp_path: Path) -> None:
    t = tier.make(tmp_path)
    fresh = t.tier_stats()
    assert isinstance(fresh, TierStats) and fresh.name == tier.name
    assert [f.name for f in dataclasses.fields(fresh)] == ["name", "hits", "misses", "bytes",
                                                           "entries"]
    assert (fresh.hits, fresh.misses, fresh.entries) == (0, 0, 0) and fresh.bytes >= 0
    tier.fill(t)
    filled = t.tier_stats()
    assert filled.entries == tier.units and filled.bytes > 0 and filled.hits == 0
    tier.serve(t)
    served = t.tier_stats()
    assert served.hits == tier.units and served.misses == filled.misses
    assert (served.entries, served.bytes) == (filled.entries, filled.bytes)
    assert served.hit_ratio == served.hits / (served.hits + served.misses)
    tier.miss(t)
    missed = t.tier_stats()
    assert missed.misses == served.misses + tier.units and missed.hits == served.hits
    for v in (missed.hits, missed.misses, missed.bytes, missed.entries):
        assert isinstance(v, int) and v >= 0


# -- the four tiers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two datasets of 4 shards each, with different shards (other images)."""
    a = make_dataset(str(tmp_path_factory.mktemp("a")))
    b = make_dataset(str(tmp_path_factory.mktemp("b")), classes=4, per_class=6)
    return a, b


def l1(datasets: tuple[str, str]) -> Tier:
    a, b = datasets

    def read(url: str) -> Callable[[ShardCache], None]:
        return lambda c: drain(FeedDataset(url, cache_dir=c))

    return Tier(SHARDS, 4, lambda p: ShardCache(p / "l1", prefetch=0), read(a), read(a), read(b))


def decoded() -> Tier:
    n = 5

    def fill(st: DecodedStore) -> None:
        for i in range(n):
            assert st.get(i) is None
            st.put(i, (np.arange(3, dtype=np.uint8) + i, i), key=f"k{i}", shard="s.tar")

    def get(ids: range) -> Callable[[DecodedStore], None]:
        return lambda st: drain(st.get(i) for i in ids)

    return Tier(DECODED, n, lambda p: DecodedStore(p / "dec", samples=2 * n), fill,
                get(range(n)), get(range(n, 2 * n)))


def l2() -> Tier:
    n = 5
    memo: dict[int, Any] = {}

    def make(p: Path) -> FunctionIndex:
        idx = FunctionIndex(str(p / "l2"))
        memo[id(idx)] = idx.wrap(bytes.upper)
        return idx

    def call(inputs: list[bytes]) -> Callable[[FunctionIndex], None]:
        return lambda idx: drain(memo[id(idx)](b) for b in inputs)

    first = [bytes([97 + i]) for i in range(n)]
    return Tier(FUNCTION_INDEX, n, make, call(first), call(first),
                call([b"z" + b for b in first]))


def l3() -> Tier:
    n = 6
    data = [(i, torch.full((4,), i, dtype=torch.uint8), i) for i in range(2 * n)]

    def fallback(ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([data[i][1] for i in ids]), torch.as_tensor(ids)

    def fill(c: DeviceCache) -> None:
        c.warmup(data, num_samples=2 * n)  # room for the first n

    def serve(ids: range) -> Callable[[DeviceCache], None]:
        return lambda c: drain(c.batches(list(ids), 4, fallback=fallback))

    per = 4 + 8  # a uint8[4] and an int64 label
    return Tier(DEVICE, n, lambda p: DeviceCache(n * per, device="cpu"), fill,
                serve(range(n)), serve(range(n, 2 * n)))


@pytest.mark.parametrize("which", ["L1", "decoded", "L2", "L3"])
def test_every_cache_tier_reports_one_stats_shape(which: str, datasets: tuple[str, str],
                                                  tmp_path: Path) -> None:
    tier = {"L1": lambda: l1(datasets), "decoded": decoded, "L2": l2, "L3": l3}[which]()
    check_tier(tier, tmp_path)
