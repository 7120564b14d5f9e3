"""A cache of half a remote dataset under a global shuffle, read over benchmarks/linkstore.py (a
real store on 127.0.0.1, in its own process, whose counters count the bytes it sent): what the
store sends in an epoch, per shard and in all, the budget sampled in the cache directory, and
every sample exactly once. Counts only, never timings.

The bound on a shard's bytes (its .tar; indexes and the manifest are counted apart): a shard
the budget keeps is fetched whole once; a shard it cannot keep is read sample by sample, each
sample's bytes once; a refused fill sends nothing of its shard. The only bytes sent twice are
those of the epoch's first batch read by range before their shards arrive
(tests/test_remote_first_batch.py; a FeedDataset iterated alone reads batches of one sample).
So an epoch sends at most the dataset's tar bytes plus one sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

import feedpipe
from feedpipe import FeedDataset
from feedpipe.convert._synth import make_records

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "linkstore.py"
BATCH = 1  # FeedDataset yields samples: the early reads are those of one sample


class Store:
    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root), "--rtt", "0.005",
                                      "--node-rate", "200e6"], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def stats(self) -> dict:  # type: ignore[type-arg]
        with urllib.request.urlopen(self.url + "/__stats__", timeout=10) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(self.url + "/__reset__", data=b"{}", method="POST")
        urllib.request.urlopen(req, timeout=10).close()


@pytest.fixture
def remote(tmp_path: Path):  # type: ignore[no-untyped-def]
    make_records(str(tmp_path / "src"), count=96, size=50_000, per_dir=1000, seed=48)
    feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "root" / "bkt" / "fp"),
                   max_samples=12, workers=1, show_progress=False)
    store = Store(tmp_path / "root")
    yield store, tmp_path / "root" / "bkt" / "fp"
    store.proc.kill()
    store.proc.wait(10)


def _dir_bytes(path: Path) -> int:
    n = 0
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            n += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return n


def _epoch(ds: FeedDataset, cache: Path) -> tuple[list[str], int]:
    """The keys of one epoch, and the most bytes the cache directory held meanwhile."""
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _dir_bytes(cache))
            stop.wait(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        keys = [s["__key__"] for s in ds]
    finally:
        stop.set()
        t.join()
    return keys, peak[0]


def test_half_cache_global_shuffle_sends_each_byte_about_once(remote, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, local = remote
    man = feedpipe.load_manifest(str(local))
    sizes = {f"/bkt/fp/{r.name}": r.bytes for r in man.shards}
    total = sum(sizes.values())
    biggest = max(sizes.values())
    want = sorted(s["__key__"] for s in FeedDataset(str(local)))
    cache = tmp_path / "cache"
    budget = total // 2
    ds = FeedDataset(f"{store.url}/bkt/fp", shuffle=True, seed=1, cache_dir=cache,
                     cache_size=budget)
    sent = []
    with pytest.warns(RuntimeWarning, match="uncached"):
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            store.reset()
            keys, peak = _epoch(ds, cache)
            assert sorted(keys) == want  # every sample exactly once
            # the budget held at every moment sampled (a reader with a plan takes no over-budget
            # allowance: a shard with no room is read uncached)
            assert peak <= budget
            per = {p: v for p, v in store.stats()["per_object"].items() if p.endswith(".tar")}
            for p, v in per.items():
                # a shard is sent once: whole (cached) or sample by sample (uncached), plus at
                # most the first sample's early range read: never twice (a prefetch evicted
                # before use, a refused fill's ranges, a block per sample)
                assert v["bytes"] <= sizes[p] + biggest // 12 + 1, (epoch, p, v, sizes[p])
            sent.append(sum(v["bytes"] for v in per.values()))
            assert sent[-1] <= total + biggest // 12 + 1, (epoch, sent[-1], total)
    assert ds.cache.stats.evictions == 0  # nothing fetched was let go for a later shard
    # epoch 1 keeps what epoch 0 cached: about half the bytes are hits (at least a third here:
    # a budget of half the bytes holds at least half the shards less one)
    assert sent[1] <= total - (budget - biggest), (sent, total)


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7])
def test_a_plan_aware_cache_never_passes_its_budget(tmp_path: Path, fraction: float) -> None:
    """The ledger's peak (the largest directory size any admission produced) against budgets
    that are no whole number of shards, under a global shuffle read from ``memory://``."""
    import fsspec

    make_records(str(tmp_path / "src"), count=70, size=20_000, per_dir=1000, seed=7)
    feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "ds"), max_samples=10, workers=1,
                   show_progress=False)
    url = f"memory://half-cache-{int(fraction * 10)}/ds"
    fsspec.filesystem("memory").put(str(tmp_path / "ds"), url, recursive=True)
    try:
        total = sum(r.bytes for r in feedpipe.load_manifest(str(tmp_path / "ds")).shards)
        budget = int(total * fraction)
        ds = FeedDataset(url, shuffle=True, seed=3, cache_dir=tmp_path / "c", cache_size=budget)
        want = sorted(s["__key__"] for s in FeedDataset(str(tmp_path / "ds")))
        with pytest.warns(RuntimeWarning, match="uncached"):  # said once per process
            for epoch in (0, 1):
                ds.set_epoch(epoch)
                assert sorted(s["__key__"] for s in ds) == want
        assert 0 < ds.cache.usage()["peak_bytes"] <= budget
    finally:
        fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)
