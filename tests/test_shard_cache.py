"""The L1 shard cache with real processes against a counting HTTP server on 127.0.0.1: one
download per shard and node, damaged entries fetched again, a killed download recovered, eight
processes under a tight budget, a full disk; and the plan-derived schedule that drives prefetch
and eviction."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from _servers import python_server, wait_until
from torch.utils.data import DataLoader

import feedpipe
from feedpipe import FeedDataset
from feedpipe._helpers.remote_count import REMOTE
from feedpipe.caches._shards import ShardCache, default_cache_dir
from feedpipe.convert._synth import make_records
from feedpipe.plan._order import Plan, Split, iter_ids
from feedpipe.plan._schedule import INF, first_uses, node_timeline

CTX = mp.get_context("fork")  # the test process already imported torch: forking is fast
JOIN = 120  # seconds before a child counts as deadlocked


def entries(cache: Path, suffix: str) -> list[str]:
    if not cache.exists():
        return []
    return sorted(p.name for p in cache.iterdir() if p.name.endswith(suffix))


def disk_bytes(cache: Path) -> int:
    total = 0
    for p in cache.iterdir() if cache.exists() else ():
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ds``: 32 shards of 12 records (500 bytes); ``big``: one shard of 24 x 10 kB."""
    r = tmp_path_factory.mktemp("l1")
    make_records(str(r / "src"), count=384, size=500, per_dir=1000, seed=5)
    feedpipe.shard(str(r / "src"), str(r / "ds"), max_samples=12, workers=1, show_progress=False)
    make_records(str(r / "bigsrc"), count=24, size=10000, per_dir=1000, seed=6)
    feedpipe.shard(str(r / "bigsrc"), str(r / "big"), max_samples=24, workers=1,
                   show_progress=False)
    return r


@pytest.fixture(scope="module")
def server(data: Path):  # type: ignore[no-untyped-def]
    with python_server(data) as s:
        yield s


def truth(root: Path) -> dict[str, bytes]:
    return {s["__key__"]: bytes(s["bin"]) for s in FeedDataset(str(root))}


@pytest.fixture(scope="module")
def expected(data: Path) -> dict[str, bytes]:
    return truth(data / "ds")


def shard_sizes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.iterdir() if p.suffix in (".tar", ".idx")}


def served(server: Any, prefix: str) -> dict[str, int]:
    """Body bytes served per file name under ``/prefix/``."""
    return {path.rsplit("/", 1)[-1]: v["bytes"] for path, v in server.stats().items()
            if path.startswith(f"/{prefix}/") and path.endswith((".tar", ".idx"))}


def check(samples: Any, expected: dict[str, bytes]) -> tuple[int, int]:
    """(samples read, samples whose bytes differ from the source)."""
    n = bad = 0
    for s in samples:
        n += 1
        bad += bytes(s["bin"]) != expected[s["__key__"]]
    return n, bad


def _sample_after_fetches(peak: Any, cache: str) -> None:
    """In a reader process (and the DataLoader workers it forks): after every fetch a reader or
    its prefetcher makes, record the cache directory's size in ``peak`` (a shared value). The
    directory grows only by fetches, so its peaks are sampled where they happen, without
    sleeping or polling."""
    acquire, prefetch_one = ShardCache.acquire, ShardCache.prefetch_one

    def measure() -> None:
        size = disk_bytes(Path(cache))
        with peak.get_lock():
            peak.value = max(peak.value, size)

    def sampled(fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            finally:
                measure()
        return call

    ShardCache.acquire = sampled(acquire)  # type: ignore[method-assign]
    ShardCache.prefetch_one = sampled(prefetch_one)  # type: ignore[method-assign]


def _reader_process(q: Any, url: str, kwargs: dict[str, Any], epochs: int, workers: int,
                    expected: dict[str, bytes], peak: Any = None) -> None:
    try:
        if peak is not None:
            c = kwargs["cache_dir"]
            _sample_after_fetches(peak, c.path if isinstance(c, ShardCache) else str(c))
        ds = FeedDataset(url, **kwargs)
        n = bad = 0
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            src = ds if workers == 0 else DataLoader(ds, batch_size=None, num_workers=workers)
            a, b = check(src, expected)
            n, bad = n + a, bad + b
        q.put({"n": n, "bad": bad, "stats": vars(ds.cache.stats)})
    except BaseException as e:  # report, never hang the parent
        q.put({"error": repr(e)})


def run_processes(specs: list[tuple[Any, ...]]) -> list[dict]:
    """Run ``_reader_process`` for each spec; return their reports. Every wait is bounded: a
    hang fails the test."""
    q = CTX.Queue()
    procs = [CTX.Process(target=_reader_process, args=(q, *spec)) for spec in specs]
    for p in procs:
        p.start()
    reports: list[dict] = []
    try:
        for _ in procs:
            reports.append(q.get(timeout=JOIN))
    except Exception:  # queue.Empty
        for p in procs:
            p.kill()
        pytest.fail(f"readers still running after {JOIN}s: deadlock?")
    for p in procs:
        p.join(JOIN)
        assert not p.is_alive() and p.exitcode == 0
    return reports


# -- the schedule (pure) ------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle,window", [(False, None), (True, None), (True, 2)])
def test_first_uses_and_timeline_match_brute_force(shuffle: bool, window: int | None) -> None:
    counts = (5, 3, 7, 1, 6, 4)
    n, bs, workers = sum(counts), 3, 2
    plan, nxt = Plan(counts, 3, 0, shuffle, window), Plan(counts, 3, 1, shuffle, window)
    splits = [Split(n, 2, r) for r in range(2)]
    # first uses of worker 1 of rank 0
    seq = [int(s) for ids in iter_ids(plan, splits[0], bs, 1, workers)
           for s in plan.shard_of(ids)[0]]
    got = [s for _, sh in first_uses(plan, splits[0], bs, 1, workers) for s in sh.tolist()]
    assert got == list(dict.fromkeys(seq))
    # the node's (both ranks) next use of every shard at every moment, over two epochs
    uses: dict[int, list[int]] = {}
    for off, p in ((0, plan), (splits[0].length, nxt)):
        for sp in splits:
            sh = p.shard_of(p.sample_ids(sp.positions(0, sp.length)))[0]
            for t, s in enumerate(sh.tolist()):
                uses.setdefault(s, []).append(off + t)
    tl = node_timeline([(plan, splits), (nxt, splits)], len(counts))
    length = splits[0].length
    for s in range(len(counts)):
        for now in range(2 * length + 1):
            later = [t for t in uses.get(s, []) if t >= now]
            exact = min(later) if later else INF
            got = tl.next_use(s, now)
            # exact, except inside a time bucket (here: an epoch) that uses the shard both
            # before and after `now`: then "in use now", never later than the truth
            if got != exact:
                assert got == now < exact < (now // length + 1) * length, (s, now)
                assert any(now // length * length <= t < now for t in uses[s]), (s, now)


# -- filling and reading --------------------------------------------------------------------------
def test_cached_reads_equal_the_source_and_each_shard_is_fetched_once(
        data: Path, server: Any, expected: dict[str, bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the fills' bytes alone: the first batch's own ranges are tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    server.reset()
    ds = FeedDataset(f"{server.url}/ds", cache_dir=tmp_path / "c", shuffle=True, seed=2,
                     shuffle_window=4)
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert check(ds, expected) == (len(expected), 0)
    assert served(server, "ds") == shard_sizes(data / "ds")  # every byte once, no range reads
    assert ds.cache.stats.fills == 32 and ds.cache.stats.hits >= 32
    assert len(entries(tmp_path / "c", ".tar")) == 32 and not entries(tmp_path / "c", ".part")


def test_one_download_per_shard_for_two_processes_with_two_workers_each(
        data: Path, server: Any, expected: dict[str, bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the fills' bytes alone: each reader's first batch, read by range besides, is counted in
    # tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    server.reset()
    kw = {"cache_dir": str(tmp_path / "c"), "shuffle": True, "seed": 7, "shuffle_window": 4}
    reports = run_processes([(f"{server.url}/ds", kw, 1, 2, expected)] * 2)
    for r in reports:
        assert r.get("error") is None and r["n"] == len(expected) and r["bad"] == 0
    assert served(server, "ds") == shard_sizes(data / "ds")


def test_damaged_entries_are_detected_and_fetched_again(
        data: Path, server: Any, expected: dict[str, bytes], tmp_path: Path) -> None:
    cache = tmp_path / "c"
    ds = FeedDataset(f"{server.url}/ds", cache_dir=cache)
    assert check(ds, expected)[1] == 0
    tars = entries(cache, ".tar")
    with open(cache / tars[0], "r+b") as f:  # truncated
        f.truncate(1000)
    with open(cache / tars[1], "r+b") as f:  # same size, one record overwritten
        f.seek(600)
        f.write(b"X" * 100)
    with open(cache / tars[2], "r+b") as f:  # rewritten with identical bytes: kept after re-hash
        head = f.read(100)
        f.seek(0)
        f.write(head)
    server.reset()
    ds2 = FeedDataset(f"{server.url}/ds", cache_dir=cache)
    assert check(ds2, expected) == (len(expected), 0)
    refetched = {k for k, v in served(server, "ds").items() if k.endswith(".tar") and v}
    assert refetched == {tars[0].split("-", 1)[1], tars[1].split("-", 1)[1]}
    assert ds2.cache.stats.refetched == 2


def test_killed_download_leaves_nothing_that_blocks_the_next_run(
        data: Path, server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")  # the fill's bytes alone (as above)
    cache = tmp_path / "c"
    want = truth(data / "big")
    with python_server(data, "--rate", "50000") as slow:  # ~5 s for the 240 kB shard
        q = CTX.Queue()
        victim = CTX.Process(target=_reader_process,
                             args=(q, f"{slow.url}/big", {"cache_dir": str(cache)}, 1, 0, want))
        victim.start()
        wait_until(lambda: entries(cache, ".tar.part")
                   and served(slow, "big").get("data-000000.tar", 0) > 0, 60, "a download")
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(JOIN)
    assert entries(cache, ".lock") and not entries(cache, ".tar")  # a lock file, no entry
    server.reset()
    reports = run_processes([(f"{server.url}/big", {"cache_dir": str(cache)}, 1, 0, want)])
    assert reports[0].get("error") is None and (reports[0]["n"], reports[0]["bad"]) == (24, 0)
    size = (data / "big" / "data-000000.tar").stat().st_size
    assert served(server, "big")["data-000000.tar"] == size
    assert entries(cache, ".tar") and not entries(cache, ".part")


@pytest.mark.parametrize("procs,workers,max_open", [(8, 0, 1), (3, 2, 4)])
@pytest.mark.slow
def test_the_budget_holds_for_every_reader_on_the_node(
        data: Path, server: Any, expected: dict[str, bytes], tmp_path: Path, procs: int,
        workers: int, max_open: int) -> None:
    """Byte-identical samples, no deadlock, and the node-wide bound of feedpipe.caches._shards: the
    directory never holds more than budget + one entry per reader (a process, or a DataLoader
    worker) reading through it, however many shards each keeps open; and <= budget once nothing
    is in use."""
    cache = tmp_path / "c"
    sizes = shard_sizes(data / "ds")
    entry = {n[:-4]: 0 for n in sizes}
    for n, b in sizes.items():
        entry[n[:-4]] += b
    largest, working_set = max(entry.values()), sum(entry.values())
    budget = 2 * largest
    readers = procs * max(1, workers)
    peak = CTX.Value("q", 0)
    specs = []
    for i in range(procs):
        sc = ShardCache(cache, budget, prefetch=1, threads=1)
        specs.append((f"{server.url}/ds", {"cache_dir": sc, "shuffle": True, "seed": i,
                                           "shuffle_window": max_open,
                                           "max_open_shards": max_open},
                      2 if workers == 0 else 1, workers, expected, peak))
    reports = run_processes(specs)
    for r in reports:
        assert r.get("error") is None, r
        assert r["bad"] == 0 and r["n"] == (2 if workers == 0 else 1) * len(expected)
    bound = budget + readers * largest
    held = readers * (max_open + 1) * largest  # what readers hold in use and prefetch at most
    assert bound < min(working_set, budget + held)  # the rule says something
    print(f"budget {budget}, sampled peak {peak.value}, bound {bound}")
    assert 0 < peak.value <= bound
    recorded = ShardCache(cache, budget).usage()
    assert 0 < recorded["peak_bytes"] <= bound and recorded["peak_readers"] <= readers
    if workers == 0:  # (the workers' counters stay in the workers)
        assert sum(r["stats"]["evictions"] for r in reports) > 0
    assert ShardCache(cache, budget).trim() <= budget
    assert disk_bytes(cache) <= budget and not entries(cache, ".part")


def test_plan_aware_eviction_keeps_what_the_next_epoch_needs_first(
        data: Path, server: Any, expected: dict[str, bytes], tmp_path: Path) -> None:
    """Cyclic order, budget of 8 of 32 shards: LRU would miss every shard in epoch 2; evicting the
    shard needed furthest ahead keeps the first ones of the next epoch."""
    entry = (data / "ds" / "data-000000.tar").stat().st_size + \
        (data / "ds" / "data-000000.idx").stat().st_size
    sc = ShardCache(tmp_path / "c", 8 * entry + entry // 2, prefetch=0)
    ds = FeedDataset(f"{server.url}/ds", cache_dir=sc, max_open_shards=1)
    assert check(ds, expected)[1] == 0
    before = sc.stats.hits
    ds.set_epoch(1)
    assert check(ds, expected)[1] == 0
    assert sc.stats.hits - before >= 6


def test_prefetch_threads_start_with_iteration_and_stop_with_it(server: Any,
                                                                tmp_path: Path) -> None:
    def ours() -> list[str]:
        # the process's pool of range fetchers stays (as fsspec's IO thread does), idle: no
        # request in flight once the iterator is closed (asserted below)
        return [t.name for t in threading.enumerate()
                if t.name.startswith("feedpipe-") and not t.name.startswith("feedpipe-fetch")]

    ds = FeedDataset(f"{server.url}/ds", cache_dir=tmp_path / "c", shuffle=True, shuffle_window=2)
    assert ours() == []
    it = iter(ds)
    next(it)  # the reader holds its first shard; the next ones arrive without being asked for
    wait_until(lambda: ds.cache.stats.prefetched >= 2, 60, "prefetched shards")
    assert ours()
    it.close()  # closed early
    assert ours() == [] and REMOTE.inflight == 0
    assert len(list(ds)) == 384
    assert ours() == [] and REMOTE.inflight == 0


def _full_disk_reader(q: Any, url: str, cache: str) -> None:
    import resource
    import warnings

    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a dead process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # smaller than any shard
        ds = FeedDataset(url, cache_dir=cache, shuffle=True, shuffle_window=2)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = {s["__key__"]: bytes(s["bin"]) for s in ds}
        q.put({"got": got, "warnings": [str(x.message) for x in w],
               "degraded": ds.cache.stats.degraded})
    except BaseException as e:
        q.put({"error": repr(e)})


def test_disk_full_degrades_to_uncached_reads_with_a_warning(
        data: Path, server: Any, tmp_path: Path) -> None:
    """RLIMIT_FSIZE (in a child process) makes every cache write fail with EFBIG."""
    cache = tmp_path / "c"
    q = CTX.Queue()
    child = CTX.Process(target=_full_disk_reader, args=(q, f"{server.url}/big", str(cache)))
    child.start()
    out = q.get(timeout=JOIN)
    child.join(JOIN)
    assert out.get("error") is None, out
    assert out["got"] == truth(data / "big")
    assert out["degraded"] >= 1
    assert any("cache directory is full" in w and "uncached" in w for w in out["warnings"])
    assert not entries(cache, ".tar") and not entries(cache, ".part") and not entries(cache, ".idx")


def test_cache_dir_true_uses_the_user_cache_dir(server: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ds = FeedDataset(f"{server.url}/big", cache_dir=True, cache_size="1GB")
    assert ds.cache.path == default_cache_dir() == str(tmp_path / "xdg" / "feedpipe" / "shards")
    assert ds.cache.size == 10**9
    assert len(list(ds)) == 24
    assert len(entries(tmp_path / "xdg" / "feedpipe" / "shards", ".tar")) == 1
    with pytest.raises(ValueError, match="cache_dir"):
        FeedDataset(f"{server.url}/big", cache_size="1GB")
    with pytest.raises(ValueError, match="not a size"):
        FeedDataset(f"{server.url}/big", cache_dir=True, cache_size="lots")


def test_budget_smaller_than_a_shard_still_reads_correctly(
        data: Path, server: Any, tmp_path: Path) -> None:
    want = truth(data / "big")
    ds = FeedDataset(f"{server.url}/big", cache_dir=tmp_path / "c", cache_size=1000)
    assert check(ds, want) == (24, 0)
    assert disk_bytes(tmp_path / "c") <= 1000  # trimmed once the reader let go
