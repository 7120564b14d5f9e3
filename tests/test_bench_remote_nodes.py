"""benchmarks/bench_remote_nodes.py's bookkeeping: each simulated node's bytes and requests come
from its own store, a sample read twice or never across the nodes is caught, and, run for real
(2 rank processes over 2 linkstore stores on a tiny dataset), each node's store sent exactly the
shards of that node's piece of the plan and nothing in the warm epoch."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = str(Path(__file__).parent.parent / "benchmarks")
# benchmarks/ on the path only for the import: left there, its datasets.py would stand in for
# Hugging Face's `datasets` in every test that runs later
sys.path.insert(0, BENCH)
try:
    import bench_remote_nodes as brn
    import linkstore  # noqa: F401  (imported inside its functions: kept in sys.modules)
finally:  # the benchmark scripts put their folder on the path as well: every entry goes
    sys.path[:] = [p for p in sys.path if os.path.realpath(p) != os.path.realpath(BENCH)]


def _store(per_object: dict[str, tuple[int, int]]) -> dict[str, Any]:
    return {"requests": {"get": sum(r for r, _ in per_object.values()), "head": 0, "list": 0,
                         "other": 0},
            "requests_total": sum(r for r, _ in per_object.values()),
            "bytes": sum(b for _, b in per_object.values()), "max_in_flight": 1,
            "per_object": {k: {"requests": r, "bytes": b} for k, (r, b) in per_object.items()}}


def _summary(keys0: list[str], keys1: list[str]) -> dict[str, Any]:
    data = {"n": 4, "tar_bytes": 4000, "shard_bytes": [2000, 2000], "idx_bytes": [10, 10]}
    stores = [brn._store_counts(_store({"/bkt/fp/manifest.json": (1, 50),
                                        "/bkt/fp/a.tar": (2, 2000), "/bkt/fp/a.idx": (1, 10)})),
              brn._store_counts(_store({"/bkt/fp/manifest.json": (1, 50),
                                        "/bkt/fp/a.tar": (1, 1000), "/bkt/fp/b.tar": (2, 2000),
                                        "/bkt/fp/a.idx": (1, 10), "/bkt/fp/b.idx": (1, 10)}))]
    ranks = [{"layout": [2, 1], "phases": {"cold": {
        "keys": k, "wall_s": 1.0, "corrupt": 0, "cache": {}, "peak_bytes": None,
        "piece_shards": 1 + r}}} for r, k in enumerate((keys0, keys1))]
    return brn.summarise(data, 2, [("cold", 0)], [{"store": stores, "dir_peak": [0, 0],
                                                   "dir_samples": 1}], ranks, None)


def test_each_nodes_bytes_and_requests_are_its_own_stores_split_by_object_kind() -> None:
    s = _summary(["s0000000", "s0000001"], ["s0000002", "s0000003"])["phases"]["cold"]
    n0, n1 = s["nodes"]
    assert s["exactly_once"] and s["samples_read"] == 4
    assert (n0["tar_bytes"], n0["bytes"], n0["requests"]) == (2000, 2060, 4)
    assert (n1["tar_bytes"], n1["bytes"], n1["requests"]) == (3000, 3070, 6)
    assert n0["shards_fetched"] == 1 and n1["shards_fetched"] == 2
    assert n0["share_bytes"] == 2000 and n0["tar_over_share"] == 1.0
    assert n1["tar_over_share"] == 1.5 and n1["excess_in_largest_shards"] == 0.5
    assert n1["requests_by_kind"] == {"other": 1, "tar": 3, "idx": 2}
    assert (s["store_bytes"], s["store_tar_bytes"], s["store_requests"]) == (5130, 5000, 10)


def test_a_sample_read_twice_or_never_across_nodes_is_not_exactly_once() -> None:
    twice = _summary(["s0000000", "s0000001"], ["s0000001", "s0000003"])["phases"]["cold"]
    assert not twice["exactly_once"]
    assert (twice["duplicates"], twice["missing"]) == (1, 1)


@pytest.mark.slow  # two rank processes import torch and feedpipe
def test_two_nodes_each_fetch_exactly_their_pieces_shards_and_nothing_when_warm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from feedpipe import FeedDataset

    # the whole-shard fills only: a first batch's early range reads (caches/_early.py) add up
    # to a batch's bytes a reader, counted in tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")

    data = brn.fp_dataset(str(tmp_path / "ds"), n=24, shard_bytes=300_000)
    assert len(data["shard_bytes"]) >= 6
    run = brn.run_nodes(data, 2, phases=[("cold", 0), ("warm", 0), ("next", 1)], rtt=0.0,
                        node_rate=0.0, timeout=120)
    assert "error" not in run, run
    assert run["layout"] == [2, 1]
    url = str(tmp_path / "ds" / brn.BUCKET / "fp")
    for phase, epoch in (("cold", 0), ("next", 1)):
        p = run["phases"][phase]
        assert p["exactly_once"], p
        plan = FeedDataset(url, shuffle=True, seed=1, rank=0, world_size=2, ranks_per_node=1,
                           node_local=True).plan(epoch)
        for r, node in enumerate(p["nodes"]):
            piece = [int(i) for i in plan.node_shards(r)]
            assert node["piece_shards"] == len(piece)
            if phase == "cold":  # every shard of its piece, whole, and no other
                assert node["tar_bytes"] == sum(data["shard_bytes"][i] for i in piece), r
                assert node["shards_fetched"] == len(piece)
            assert node["tar_over_share"] is not None
        assert p["store_tar_bytes"] == sum(x["tar_bytes"] for x in p["nodes"])
    warm = run["phases"]["warm"]
    assert warm["exactly_once"] and warm["store_requests"] == 0 and warm["store_bytes"] == 0
