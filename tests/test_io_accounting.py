"""What a pass tells about its bytes and requests: ``loader.stats()["io"]`` counts bytes read
from local shards, remote requests and bytes, L1 hits, misses and fills, and the decoded store's
and the L2 function index's hits and misses, per pass, summed over worker processes. Checked
against what a local HTTP server says it served."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from _routes import (
    CLIPS,
    MIXED,
    ROUTES,
    bucketed,
    fill_store,
    make,
    mixed,
    route_of,
    token_docs,
    video,
    videos_path,
)
from _servers import python_server

from feedpipe import FeedDataset, FeedLoader, FunctionIndex

EXAMPLE = Path(__file__).resolve().parent.parent / "shards" / "example"
SHARDS = json.loads((EXAMPLE / "manifest.json").read_text())["shards"]
TAR_BYTES = sum(s["bytes"] for s in SHARDS)
IO_KEYS = {"local_bytes": int, "remote": {"requests", "bytes"},
           "link": {"retries", "inflight_max", "inflight_mean", "busy_s", "bytes_per_s",
                    "requests_per_shard", "target", "bandwidth", "rtt_s"},
           "l1": {"hits", "misses", "fills"}, "decoded": {"hits", "misses"},
           "l2": {"hits", "misses"}}


def keys(io: dict[str, Any]) -> dict[str, Any]:
    return {k: (type(v) if not isinstance(v, dict) else set(v)) for k, v in io.items()}


def ids_of(loader: FeedLoader) -> list[int]:
    return sorted(i for b in loader for i in b["__index__"].tolist())


def test_a_shard_the_prefetch_filled_is_a_miss_of_the_pass(tmp_path: Path) -> None:
    ds = FeedDataset(str(EXAMPLE), cache_dir=tmp_path / "cache")
    loader = FeedLoader(ds, batch_size=4)
    assert ids_of(loader) == list(range(24))
    cold = loader.stats()["io"]["l1"]
    assert cold == {"hits": 0, "misses": len(SHARDS), "fills": len(SHARDS)}
    assert ds.shards.cache is not None and ds.shards.cache.stats.hits == 0
    assert ids_of(loader) == list(range(24))
    assert loader.stats()["io"]["l1"] == {"hits": len(SHARDS), "misses": 0, "fills": 0}


@pytest.mark.parametrize("workers", [0, 2])
def test_cold_then_warm_epochs_over_http(workers: int, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # the fills' bytes: each reader's first batch read by range besides (a batch's bytes more)
    # is counted in tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    with python_server(EXAMPLE) as srv:
        ds = FeedDataset(srv.url, cache_dir=tmp_path / "cache", decode={"cls": int})
        loader = FeedLoader(ds, batch_size=4, num_workers=workers)
        srv.reset()  # the manifest was read when the dataset was made
        assert ids_of(loader) == list(range(24))
        cold, served = loader.stats()["io"], srv.stats()
        tars = {p: v for p, v in served.items() if p.endswith(".tar")}
        assert len(tars) == len(SHARDS)  # every shard fetched ...
        assert cold["remote"]["requests"] >= len(SHARDS)  # ... with at least a request each
        assert cold["remote"]["requests"] >= sum(v["requests"] for v in served.values())
        assert cold["remote"]["bytes"] == sum(v["bytes"] for v in served.values())
        assert TAR_BYTES <= cold["remote"]["bytes"] <= 1.1 * TAR_BYTES  # tars and indexes
        assert cold["l1"]["misses"] == cold["l1"]["fills"] == len(SHARDS)
        if not workers:  # (with two, one may find a shard the other fetched: a hit)
            assert cold["l1"]["hits"] == 0
        assert cold["local_bytes"] == pytest.approx(TAR_BYTES, abs=1)  # read from the cache

        srv.reset()
        assert ids_of(loader) == list(range(24))
        warm = loader.stats()["io"]
        assert srv.stats() == {}
        assert warm["remote"] == {"requests": 0, "bytes": 0}
        assert warm["l1"]["misses"] == warm["l1"]["fills"] == 0
        assert warm["l1"]["hits"] >= len(SHARDS)
        assert warm["local_bytes"] == pytest.approx(TAR_BYTES, abs=1)


def test_uncached_reads_over_http_are_remote_bytes() -> None:
    with python_server(EXAMPLE) as srv:
        loader = FeedLoader(FeedDataset(srv.url, decode={"cls": int}, cache_dir=False),
                            batch_size=4)
        srv.reset()
        assert ids_of(loader) == list(range(24))
        io, served = loader.stats()["io"], srv.stats()
    # a request per sample at least (one range each), and each shard's size asked once
    assert io["remote"]["requests"] >= sum(v["requests"] for v in served.values()) >= 24
    assert io["remote"]["bytes"] == sum(v["bytes"] for v in served.values())
    assert io["local_bytes"] == 0 and io["l1"] == {"hits": 0, "misses": 0, "fills": 0}


def video_bytes(root: Path) -> int:
    """The bytes of the video members in the shards under ``root``."""
    total = 0
    for tar in root.glob("*.tar"):
        with tarfile.open(tar) as tf:
            total += sum(m.size for m in tf if m.name.endswith(".mp4"))
    return total


@pytest.fixture(scope="module")
def store(sharded: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    s = str(tmp_path_factory.mktemp("store"))
    fill_store(str(sharded), s)
    return s


@pytest.mark.parametrize("case", list(ROUTES))
def test_every_route_reports_the_same_io_keys(case: str, sharded: Path, store: str) -> None:
    workers = 2 if ROUTES[case][1] == "workers" else 0
    loader = make(case, str(sharded), workers=workers, store=store)
    assert keys(loader.stats()["io"]) == IO_KEYS  # before any pass: zeros
    assert not loader.stats()["io"]["local_bytes"]
    for _ in loader:
        pass
    s = loader.stats()
    assert s["route"] == route_of(case) and keys(s["io"]) == IO_KEYS
    total = sum(r.stat().st_size for r in sharded.glob("*.tar"))
    if mixed(case):  # each source reads the same shards
        total *= len(MIXED)
    if ROUTES[case][0] == "tok":  # rows slice the documents' tokens out of the shards
        total = sum(d.nbytes for d in token_docs())
    if video(case):  # each clip reads its video's member, so each video once per clip
        total = CLIPS * video_bytes(Path(videos_path(str(sharded))))
    if route_of(case) == "gather":  # the batches come whole from the decoded store
        assert s["io"]["decoded"]["hits"] > 0 and s["io"]["local_bytes"] == 0
    elif bucketed(case):  # what its buckets leave over this epoch is counted, and never read
        left = s["sources"]
        assert left["remainders"] + left["unequal_ranks"] > 0
        assert 0 < s["io"]["local_bytes"] < total
    else:
        assert s["io"]["local_bytes"] == pytest.approx(total, abs=2)
    assert s["io"]["remote"] == {"requests": 0, "bytes": 0}


def test_decoded_store_hits_and_misses(tmp_path: Path) -> None:
    ds = FeedDataset(str(EXAMPLE), transform=Label(), decoded_cache=tmp_path / "dec")
    loader = FeedLoader(ds, batch_size=4)
    assert sorted(i for b in loader for i in b.tolist()) == list(range(24))
    cold = loader.stats()["io"]
    assert cold["decoded"] == {"hits": 0, "misses": 24}
    assert cold["local_bytes"] == pytest.approx(TAR_BYTES, abs=1)
    assert sorted(i for b in loader for i in b.tolist()) == list(range(24))
    warm = loader.stats()["io"]
    assert warm["decoded"] == {"hits": 24, "misses": 0}
    assert warm["local_bytes"] == 0  # nothing read from the shards


class Label:
    def __call__(self, x: dict[str, Any]) -> int:
        return int(x["__index__"])


@pytest.mark.parametrize("workers", [0, 2])
def test_function_index_hits_and_misses(workers: int, tmp_path: Path) -> None:
    idx = FunctionIndex(str(tmp_path / "l2"))
    ds = FeedDataset(str(EXAMPLE), transform=idx.wrap(Label()))
    loader = FeedLoader(ds, batch_size=4, num_workers=workers)
    assert sorted(i for b in loader for i in b.tolist()) == list(range(24))
    assert loader.stats()["io"]["l2"] == {"hits": 0, "misses": 24}
    assert sorted(i for b in loader for i in b.tolist()) == list(range(24))
    assert loader.stats()["io"]["l2"] == {"hits": 24, "misses": 0}
