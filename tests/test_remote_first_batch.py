"""A remote epoch's first batch, with a shuffle across shards, is read by byte range while its
shards still arrive whole (feedpipe.caches._early), over benchmarks/linkstore.py: a real store on
127.0.0.1 behind a slow link, in its own process. Asserted by what the store had sent when the
first batch arrived (less than the shards' bytes; a shard of that batch still coming), never by
timing; then the link is made fast and the epoch completes, each sample exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe.convert._synth import make_records

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "linkstore.py"
SLOW_LINK = {"rtt": 0.02, "node_rate": 1_000_000, "chunk": 16 << 10}  # 4 MB: about 4 s
FAST_LINK = {"rtt": 0.0, "node_rate": 0}
BATCH = 16


class Store:
    """benchmarks/linkstore.py serving ``root`` in a process of its own."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/__stats__", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def post(self, path: str, doc: dict[str, Any] | None = None) -> None:
        req = urllib.request.Request(self.url + path, data=json.dumps(doc or {}).encode(),
                                     method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    # ranges of 256 KiB: each 1 MB shard comes as 4 concurrent ranges
    monkeypatch.setenv("FEEDPIPE_RANGE_BYTES", str(256 << 10))
    s = Store(tmp_path)
    try:
        yield s
    finally:
        s.close()


def dataset(root: Path, seed: int, count: int = 80) -> Path:
    """4 shards of 20 samples of 50 kB. The seed makes the content, and so the cache entries
    (named after it, shared by the read-ahead directory of this process), this test's own."""
    make_records(str(root / "src"), count=count, size=50_000, per_dir=1000, seed=seed)
    feedpipe.shard(str(root / "src"), str(root / "ds"), max_samples=20, workers=1,
                   show_progress=False)
    return root / "ds"


def shard_sizes(ds: Path) -> dict[str, int]:
    return {f"/ds/{r.name}": r.bytes for r in feedpipe.load_manifest(str(ds)).shards}


def first_then_rest(loader: Any, store: Store) -> tuple[Any, dict[str, Any], list[Any]]:
    """The first batch, the store's counters when it arrived, and the epoch's other batches
    (read over a fast link)."""
    store.post("/__link__", SLOW_LINK)
    store.post("/__reset__")
    it = iter(loader)
    first = next(it)
    seen = store.stats()
    store.post("/__link__", FAST_LINK)
    return first, seen, list(it)


def keys(batches: list[Any]) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


def assert_before_the_shards(first: Any, seen: dict[str, Any], sizes: dict[str, int]) -> None:
    """The first batch drew from every shard, yet arrived before the store had sent them."""
    assert {f"/ds/{s}" for s in first["__shard__"]} == set(sizes)  # (so it needs all four)
    sent = {p: v["bytes"] for p, v in seen["per_object"].items() if p in sizes}
    assert seen["bytes"] < sum(sizes.values())
    assert any(sent.get(p, 0) < n for p, n in sizes.items())  # a shard was still coming


@pytest.mark.parametrize("cached", [True, False], ids=["cache_dir", "read-ahead"])
def test_the_first_batch_arrives_before_its_shards(tmp_path: Path, store: Store,
                                                   cached: bool) -> None:
    ds = dataset(tmp_path, seed=41 + cached)
    sizes = shard_sizes(ds)
    local = {s["__key__"]: bytes(s["bin"]) for s in FeedDataset(str(ds))}
    loader = FeedLoader(FeedDataset(f"{store.url}/ds", shuffle=True, seed=3,
                                    cache_dir=tmp_path / "c" if cached else None),
                        batch_size=BATCH)
    first, seen, rest = first_then_rest(loader, store)
    assert_before_the_shards(first, seen, sizes)
    assert sorted(keys([first, *rest])) == sorted(local)  # exactly once
    assert [bytes(b) for b in first["bin"]] == [local[k] for k in first["__key__"]]
    # each shard came whole once (4 ranges), and each sample of the first batch by its own
    # range besides (beside fills, never two in one: caches._early.GAP); each index at most
    # twice (the fill's and the first batch's, when they were not under way at the same moment)
    served = store.stats()["per_object"]
    extra = {p: 0 for p in sizes}
    for s in first["__shard__"]:
        extra[f"/ds/{s}"] += 1
    after_first = {p: v["requests"] for p, v in served.items() if p in sizes}
    assert after_first == {p: 4 + extra[p] for p in sizes}
    assert all(1 <= served[p[:-4] + ".idx"]["requests"] <= 2 for p in sizes)


@pytest.mark.slow
@pytest.mark.parametrize("cached", [True, False], ids=["cache_dir", "read-ahead"])
def test_two_workers_read_their_first_batches_before_the_shards(
        tmp_path: Path, store: Store, cached: bool) -> None:
    ds = dataset(tmp_path, seed=43 + cached)
    sizes = shard_sizes(ds)
    want = sorted(s["__key__"] for s in FeedDataset(str(ds)))
    loader = FeedLoader(FeedDataset(f"{store.url}/ds", shuffle=True, seed=3,
                                    cache_dir=tmp_path / "c" if cached else None),
                        batch_size=BATCH, num_workers=2)
    first, seen, rest = first_then_rest(loader, store)
    assert_before_the_shards(first, seen, sizes)
    assert sorted(keys([first, *rest])) == want  # exactly once
    pids = loader.stats()["worker_pids"]
    assert len(pids) == 2 and os.getpid() not in pids  # read in the two workers
    # both workers' first batches were read by range (up to 2 x 16 requests) beside the 4 x 4
    # ranges (each shard fetched whole once: the other worker waits for it or finds it cached)
    served = store.stats()["per_object"]
    assert 4 * 4 + BATCH < sum(served[p]["requests"] for p in sizes) <= 4 * 4 + 2 * BATCH


@pytest.mark.slow
def test_a_resumed_epoch_reads_its_first_batch_before_the_shards(tmp_path: Path,
                                                                 store: Store) -> None:
    """Three batches, a checkpoint, and the rest on a fresh node (an empty cache): the resumed
    epoch's first batch too arrives before its shards, and the two parts hold each sample
    once."""
    ds = dataset(tmp_path, seed=45)
    sizes = shard_sizes(ds)
    want = sorted(s["__key__"] for s in FeedDataset(str(ds)))

    def loader(cache: str) -> FeedLoader:
        return FeedLoader(FeedDataset(f"{store.url}/ds", shuffle=True, seed=5,
                                      cache_dir=tmp_path / cache), batch_size=BATCH)

    before = loader("a")
    it = iter(before)
    head = [next(it) for _ in range(3)]
    state = before.state_dict()
    del it
    after = loader("b")
    after.load_state_dict(state)
    first, seen, rest = first_then_rest(after, store)
    assert_before_the_shards(first, seen, sizes)
    assert sorted(keys([*head, first, *rest])) == want


def test_a_first_batch_of_more_samples_than_the_bound_waits_for_its_shards(
        tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Past MAX_SAMPLES (here 8 of the batch's 16) the first batch is not read by range: the
    store serves each shard's 4 ranges and nothing else, and a log record says why."""
    import logging

    from feedpipe.caches import _early

    monkeypatch.setattr(_early, "MAX_SAMPLES", 8)
    ds = dataset(tmp_path, seed=47)
    sizes = shard_sizes(ds)
    loader = FeedLoader(FeedDataset(f"{store.url}/ds", shuffle=True, seed=3,
                                    cache_dir=tmp_path / "c"), batch_size=BATCH)
    store.post("/__reset__")
    with caplog.at_level(logging.INFO, logger="feedpipe.cache"):
        got = keys(list(loader))
    assert sorted(got) == sorted(s["__key__"] for s in FeedDataset(str(ds)))
    served = store.stats()["per_object"]
    assert {p: served[p]["requests"] for p in sizes} == dict.fromkeys(sizes, 4)
    assert any("waits for its shards" in r.getMessage() for r in caplog.records)


def test_adjacent_samples_of_one_shard_come_in_one_range_request(
        tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # in order, without a cache: the first batch is samples 0-15 of the first shard, adjacent,
    # 0.8 MB; read by range, they used to cost 16 requests (one a sample), now one
    monkeypatch.setenv("FEEDPIPE_RANGE_BYTES", str(4 << 20))
    ds = dataset(tmp_path, seed=47)
    local = {s["__key__"]: bytes(s["bin"]) for s in FeedDataset(str(ds))}
    loader = FeedLoader(FeedDataset(f"{store.url}/ds", cache_dir=False), batch_size=BATCH)
    store.post("/__reset__")
    first = next(iter(loader))
    log = store.stats()["log"]
    assert set(first["__shard__"]) == {"data-000000.tar"}
    assert [bytes(b) for b in first["bin"]] == [local[k] for k in first["__key__"]]
    tar = [e for e in log if e[1] == "/ds/data-000000.tar"]
    assert [e[0] for e in tar] == ["GET"] and tar[0][2] is not None  # one ranged GET
