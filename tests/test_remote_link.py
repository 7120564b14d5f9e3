"""The remote fetch engine over a link with a round trip (tests/_http_server.py ``--delay``: each
response waits before its first byte, as a distant object store's does): concurrent ranges of
one shard, whole shards read ahead without a ``cache_dir``, the link's figures in
``stats()["io"]["link"]``, and exactly-once delivery through 503s, an outage, two worker
processes and a resume. Counts and behaviour only, never timings."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
from _servers import python_server

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe._helpers import retry
from feedpipe.convert._synth import make_records
from feedpipe.errors import RemoteError

RTT = "0.03"  # seconds each response waits before its first byte
FAST = retry.RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges of 1 MiB (4 MiB by default), so that a few MB of shards make several each."""
    monkeypatch.setenv("FEEDPIPE_RANGE_BYTES", str(1 << 20))


def dataset(root: Path, seed: int, count: int = 48, per_shard: int = 24) -> Path:
    """Shards of ``per_shard`` samples of 100 kB (2.4 MB: three ranges of 0.8 MB each). The seed
    makes the content, and so the read-ahead's entries (named after it), this test's own."""
    make_records(str(root / "src"), count=count, size=100_000, per_dir=1000, seed=seed)
    feedpipe.shard(str(root / "src"), str(root / "ds"), max_samples=per_shard, workers=1,
                   show_progress=False)
    return root / "ds"


def keys_of(batches: list) -> list[str]:  # type: ignore[type-arg]
    return [k for b in batches for k in b["__key__"]]


def local_keys(ds: Path) -> list[str]:
    return sorted(s["__key__"] for s in FeedDataset(str(ds)))


def tar_requests(stats: dict) -> dict[str, int]:  # type: ignore[type-arg]
    return {p: v["requests"] for p, v in stats.items() if p.endswith(".tar")}


def test_a_cold_epoch_reads_each_shard_in_concurrent_ranges(tmp_path: Path) -> None:
    ds = dataset(tmp_path, seed=11)
    want = local_keys(ds)
    sizes = {f"/ds/{r.name}": r.bytes for r in feedpipe.load_manifest(str(ds)).shards}
    with python_server(tmp_path, "--delay", RTT) as srv:
        loader = FeedLoader(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c", shuffle=True),
                            batch_size=8)
        srv.reset()
        batches = list(loader)
        got = keys_of(batches)
        served, link = srv.stats(), srv.link()
        io = loader.stats()["io"]
        assert sorted(got) == want  # exactly once
        # each 2.4 MB shard: 3 ranges of 1 MiB, once each, and the first batch's samples of it
        # each by its own range (tests/test_remote_first_batch.py); its index once, or twice
        # where the first batch's reads did not find the fill's request under way
        early = Counter(f"/ds/{s}" for s in batches[0]["__shard__"])
        assert tar_requests(served) == {p: 3 + early[p] for p in sizes}
        assert all(v["requests"] in (1, 2) for p, v in served.items() if p.endswith(".idx"))
        first = batches[0]
        again = sum(len(b) for b in first["bin"])  # (each sample here: one member)
        assert sum(served[p]["bytes"] for p in sizes) == sum(sizes.values()) + again
        # more than the 2 responses of one-shard-at-a-time fetching were under way at once
        assert link["inflight_max"] >= 4
        assert io["link"]["inflight_max"] >= 4 and io["link"]["retries"] == 0
        asked = sum(v["requests"] for p, v in served.items() if p.endswith((".tar", ".idx")))
        assert io["link"]["requests_per_shard"] == asked / len(sizes)
        assert io["link"]["bytes_per_s"] > 0
        # warm: the next epoch asks the store nothing
        srv.reset()
        loader.set_epoch(1)
        assert sorted(keys_of(list(loader))) == want
        assert srv.stats() == {} and loader.stats()["io"]["remote"]["requests"] == 0


def test_without_cache_dir_whole_shards_are_read_ahead_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default (no ``cache_dir``) reads whole shards into a temporary read-ahead: a few
    requests per shard, not one per sample; the log record says so and how to keep them."""
    ds = dataset(tmp_path, seed=12)
    want = local_keys(ds)
    with python_server(tmp_path, "--delay", RTT) as srv, caplog.at_level(logging.WARNING):
        data = FeedDataset(f"{srv.url}/ds", shuffle=True)
        srv.reset()
        got = keys_of(list(FeedLoader(data, batch_size=8)))
        served = srv.stats()
    assert sorted(got) == want
    # 48 samples, 2 shards: 3 ranges and an index each (the index asked again at most, by the
    # first batch's reads by range), and each of the first batch's 8 samples by its own range
    assert 2 * (3 + 1) + 8 <= sum(v["requests"] for v in served.values()) <= 2 * (3 + 2) + 8
    said = [r.getMessage() for r in caplog.records if "read-ahead" in r.getMessage()]
    assert said and "cache_dir=" in said[0]
    assert data.cache is not None and data.cache.size is not None  # bounded


def test_one_sample_per_request_only_when_asked(tmp_path: Path) -> None:
    ds = dataset(tmp_path, seed=13)
    with python_server(tmp_path) as srv:
        srv.reset()
        got = sorted(s["__key__"] for s in FeedDataset(f"{srv.url}/ds", cache_dir=False))
        assert got == local_keys(ds)
        assert sum(tar_requests(srv.stats()).values()) == 48


def test_503_on_5_percent_of_responses_exactly_once_with_the_retries_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    ds = dataset(tmp_path, seed=14, count=96, per_shard=12)  # 8 shards, 1.2 MB each
    want = local_keys(ds)
    with python_server(tmp_path, "--fail-rate", "0.05") as srv:
        seen: list[str] = []
        retries = 0
        for epoch in range(3):  # cold each time: a cache of its own
            loader = FeedLoader(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / f"c{epoch}",
                                            shuffle=True, seed=epoch), batch_size=8)
            got = keys_of(list(loader))
            assert sorted(got) == want
            seen += got
            retries += loader.stats()["io"]["link"]["retries"]
        errors = sum(v["errors"] for v in srv.stats().values())
    assert errors > 0  # the faults happened...
    assert retries == errors  # ... and each was a counted retry (manifest reads had none)
    assert Counter(seen) == Counter(want * 3)


def test_a_store_gone_past_the_retry_bound_fails_naming_the_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    dataset(tmp_path, seed=15)
    with python_server(tmp_path, "--down-after", "2", "--down-for", "600") as srv:
        data = FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c")  # manifest: request 1
        with pytest.raises(RemoteError, match="still failing after 4 attempt") as e:
            list(data)
    assert f"{srv.url}/ds/data-" in str(e.value)


def test_a_store_gone_briefly_is_waited_out(tmp_path: Path) -> None:
    """Gone for less than the default policy's backoff (0.2 + 0.4 + 0.8 + 1.6 s): the epoch
    goes on, exactly once."""
    ds = dataset(tmp_path, seed=16)
    with python_server(tmp_path, "--down-after", "3", "--down-for", "0.5") as srv:
        loader = FeedLoader(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c"), batch_size=8)
        assert sorted(keys_of(list(loader))) == local_keys(ds)
        assert sum(v["errors"] for v in srv.stats().values()) > 0
        assert loader.stats()["io"]["link"]["retries"] > 0


@pytest.mark.slow
def test_two_workers_and_a_resume_over_the_link_exactly_once(tmp_path: Path) -> None:
    ds = dataset(tmp_path, seed=17, count=96, per_shard=12)
    want = local_keys(ds)
    with python_server(tmp_path, "--delay", RTT) as srv:
        url = f"{srv.url}/ds"
        loader = FeedLoader(FeedDataset(url, shuffle=True, seed=1), batch_size=8, num_workers=2)
        assert sorted(keys_of(list(loader))) == want
        assert loader.stats()["io"]["remote"]["requests"] > 0  # the workers fetched, and said
        # a resume with a half cache (half the dataset's bytes): the rest exactly once
        half = sum(r.bytes for r in feedpipe.load_manifest(str(ds)).shards) // 2
        first = FeedLoader(FeedDataset(url, shuffle=True, seed=2, cache_dir=tmp_path / "h",
                                       cache_size=half), batch_size=8, num_workers=2)
        it = iter(first)
        head = keys_of([next(it) for _ in range(5)])
        state = first.state_dict()
        del it
        again = FeedLoader(FeedDataset(url, shuffle=True, seed=2, cache_dir=tmp_path / "h",
                                       cache_size=half), batch_size=8, num_workers=2)
        again.load_state_dict(state)
        tail = keys_of(list(again))
        usage = again.dataset.cache.usage()  # type: ignore[attr-defined]
    assert sorted(head + tail) == want
    largest = max(r.bytes for r in feedpipe.load_manifest(str(ds)).shards) + 4096
    assert usage["peak_bytes"] <= half + usage["peak_readers"] * largest


def test_a_response_that_stalls_is_given_up_and_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first 2 responses send nothing for 10 minutes: each is given up after the read
    timeout (1 s here, FEEDPIPE_READ_TIMEOUT), retried, and the epoch completes exactly once
    instead of waiting."""
    monkeypatch.setenv("FEEDPIPE_READ_TIMEOUT", "1")
    ds = dataset(tmp_path, seed=18)
    with python_server(tmp_path, "--stall-first", "2", "--stall-s", "600") as srv:
        loader = FeedLoader(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c"), batch_size=8)
        assert sorted(keys_of(list(loader))) == local_keys(ds)
        assert sum(v["errors"] for v in srv.stats().values()) == 2
