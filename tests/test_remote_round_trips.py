"""The round trips a remote epoch's first batch waits for, one after another, counted at the
store (benchmarks/linkstore.py on 127.0.0.1 behind a 50 ms link, in its own process): the
manifest, then the indexes of the batch's shards, then the batch's samples by range; nothing
asked of the store first (no HEAD for a size the manifest gives, no LIST), and no request that
waits for another of its shard beyond those. Over http:// and s3://, with a cache_dir, with
the read-ahead (no cache_dir) and without any cache (cache_dir=False).

Counted by dependency, never by timing: from the store's log of the requests completed when
the first batch arrived, a request follows another where it started after that one ended and
could need it (everything needs the manifest; a shard's index and sample ranges need its
HEAD, its sample ranges need its index; two ranges of one shard need nothing of each other);
the longest such chain is the number of serial round trips."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _servers import forget_s3_clients
from test_remote_first_batch import Store

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe.convert._synth import make_records

BATCH = 16
# shards can never have arrived whole before the first batch: 4 MB at 2 MB/s
SLOW_LINK = {"rtt": 0.05, "node_rate": 2_000_000, "chunk": 16 << 10}
FAST_LINK = {"rtt": 0.0, "node_rate": 0}


def serial_round_trips(log: list[list[Any]]) -> int:
    """The longest chain of completed requests where each started after the one before ended
    and could depend on it (see the module docstring)."""
    done = sorted((e for e in log if e[4] is not None), key=lambda e: e[3])
    depth: list[int] = []
    for j, (_, path, _, start, _) in enumerate(done):
        best = 0
        for i in range(j):
            q = done[i]
            if q[4] > start:
                continue
            same = q[1].rsplit(".", 1)[0] == path.rsplit(".", 1)[0]
            needed = q[0] == "HEAD" or (q[1].endswith(".idx") and not path.endswith(".idx"))
            if q[1].endswith("manifest.json") or (same and needed):
                best = max(best, depth[i])
        depth.append(best + 1)
    return max(depth, default=0)


def test_the_chain_counts_dependent_requests_only() -> None:
    manifest = ["GET", "/b/ds/manifest.json", None, 0.0, 0.1]
    log = [manifest,
           ["HEAD", "/b/ds/a.tar", None, 0.1, 0.2], ["GET", "/b/ds/a.idx", None, 0.2, 0.3],
           ["GET", "/b/ds/b.idx", None, 0.2, 0.3], ["GET", "/b/ds/b.idx", None, 0.3, 0.4],
           ["GET", "/b/ds/a.tar", "bytes=0-9", 0.3, 0.4], ["GET", "/b/ds/b.tar", None, 0.9, None],
           ["GET", "/b/ds/a.tar", "bytes=10-19", 0.45, 0.5]]
    assert serial_round_trips(log) == 4  # manifest, HEAD a, index a, a range of a
    assert serial_round_trips([manifest, *log[3:5]]) == 2  # a second index fetch: not serial


def bucket(tmp_path: Path, seed: int) -> Path:
    """4 shards of 20 samples of 50 kB under ``bkt/ds`` (the bucket ``bkt``). The seed makes
    the content, and so the read-ahead's entries (named after it, kept by this process), this
    case's own."""
    make_records(str(tmp_path / "src"), count=80, size=50_000, per_dir=1000, seed=seed)
    feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "store" / "bkt" / "ds"),
                   max_samples=20, workers=1, show_progress=False)
    return tmp_path / "store"


# Each case starts a store and a loader over a 50 ms link (3-5 s): the default run keeps the
# case that was 17 round trips and one cached case; --slow (CI part 1b) runs all six.
_FAST = {("http", "no-cache"), ("s3", "cache_dir")}


@pytest.mark.parametrize("scheme,cache", [
    pytest.param(s, c, marks=() if (s, c) in _FAST else pytest.mark.slow)
    for c in ("cache_dir", "read-ahead", "no-cache") for s in ("http", "s3")])
def test_the_first_batch_waits_three_round_trips(scheme: str, cache: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """cache_dir=False used to open the first batch's shards one after another, each with a
    HEAD for its size, then its index, then one sample after another: 4 shards x (2 + 4)
    round trips before the first batch; the cached routes took 3."""
    monkeypatch.setenv("FEEDPIPE_RANGE_BYTES", str(256 << 10))
    seed = 480 + 3 * ["http", "s3"].index(scheme) + ["cache_dir", "read-ahead", "no-cache"].index(
        cache)
    store = Store(bucket(tmp_path, seed))
    try:
        if scheme == "s3":
            forget_s3_clients()
            for k, v in {"AWS_ENDPOINT_URL_S3": store.url, "AWS_ACCESS_KEY_ID": "k",
                         "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                         "AWS_ALLOW_HTTP": "true", "AWS_CONFIG_FILE": os.devnull,
                         "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
                monkeypatch.setenv(k, v)
        url = "s3://bkt/ds" if scheme == "s3" else f"{store.url}/bkt/ds"
        cache_dir: Any = {"cache_dir": tmp_path / "c", "read-ahead": None, "no-cache": False}
        want = sorted(s["__key__"] for s in FeedDataset(str(tmp_path / "store" / "bkt" / "ds")))
        store.post("/__link__", SLOW_LINK)
        store.post("/__reset__")
        loader = FeedLoader(FeedDataset(url, shuffle=True, seed=3, cache_dir=cache_dir[cache]),
                            batch_size=BATCH)
        it = iter(loader)
        first = next(it)
        log = store.stats()["log"]
        store.post("/__link__", FAST_LINK)
        rest = list(it)
    finally:
        store.close()
        forget_s3_clients()
    assert len(set(first["__shard__"])) == 4  # the batch draws from every shard
    before = [e for e in log if e[4] is not None]
    assert [e[0] for e in before if e[1].endswith("manifest.json")] == ["GET"]
    assert not [e for e in before if e[0] != "GET" or not e[1].startswith("/bkt/ds/")]
    assert serial_round_trips(log) == 3
    assert sorted(k for b in [first, *rest] for k in b["__key__"]) == want  # exactly once
