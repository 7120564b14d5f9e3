"""Readers killed (SIGKILL, with their DataLoader workers) while they share one L1 cache directory,
some in the middle of a download from a slow server: a new reader then completes the epoch with
the right bytes, no lock is left held, nothing half-written stays, and the budget holds."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import queue
import signal
from pathlib import Path
from typing import Any

import pytest
from _servers import python_server
from torch.utils.data import DataLoader

import feedpipe
from feedpipe import FeedDataset
from feedpipe.caches._shards import ShardCache
from feedpipe.caches.l1._budget import Budget
from feedpipe.convert._synth import make_records

CTX = mp.get_context("fork")
JOIN = 120  # seconds before a reader counts as deadlocked
READERS, WORKERS = 4, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ds``: 24 shards of 10 records of 600 bytes."""
    r = tmp_path_factory.mktemp("faults")
    make_records(str(r / "src"), count=240, size=600, per_dir=1000, seed=21)
    feedpipe.shard(str(r / "src"), str(r / "ds"), max_samples=10, workers=1, show_progress=False)
    return r


def _doomed(q: Any, url: str, cache: str, budget: int, after: int) -> None:
    """Read with 2 workers; report once ``after`` samples arrived, then read on until killed."""
    os.setpgrp()  # the test kills this process and its workers together
    ds = FeedDataset(url, cache_dir=ShardCache(cache, budget, prefetch=2), shuffle=True,
                     seed=os.getpid(), shuffle_window=3, max_open_shards=3)
    for epoch in range(1000):
        ds.set_epoch(epoch)
        for n, _ in enumerate(DataLoader(ds, batch_size=None, num_workers=WORKERS), 1):
            if epoch == 0 and n == after:
                q.put(os.getpid())


def _survivor(q: Any, url: str, cache: str, budget: int) -> None:
    try:
        ds = FeedDataset(url, cache_dir=ShardCache(cache, budget), shuffle=True, seed=1,
                         shuffle_window=3)
        got = {s["__key__"]: bytes(s["bin"])
               for s in DataLoader(ds, batch_size=None, num_workers=WORKERS)}
        q.put({"got": got})
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        q.put({"error": repr(e)})


def held(path: Path) -> list[str]:
    """Lock files in ``path`` that some process still holds (exclusively or shared)."""
    out = []
    for p in path.iterdir():
        if not (p.name.endswith(".lock") or p.name == ".budget" or p.name.startswith(".reader-")):
            continue
        fd = os.open(p, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.append(p.name)
        finally:
            os.close(fd)
    return out


def test_readers_killed_while_sharing_a_cache_leave_nothing_that_blocks_the_next(
        data: Path, tmp_path: Path) -> None:
    cache = tmp_path / "c"
    sizes = [p.stat().st_size for p in (data / "ds").iterdir() if p.suffix in (".tar", ".idx")]
    budget = 8 * 2 * max(sizes)
    want = {s["__key__"]: bytes(s["bin"]) for s in FeedDataset(str(data / "ds"))}
    q = CTX.Queue()
    with python_server(data, "--rate", "40000") as slow:  # a shard takes ~0.15 s to arrive
        procs = [CTX.Process(target=_doomed, args=(q, f"{slow.url}/ds", str(cache), budget,
                                                   after))
                 for after in (1, 5, 10, 20)[:READERS]]
        for p in procs:
            p.start()
        try:
            for _ in procs:  # every reader is reading (blocking waits, bounded)
                q.get(timeout=JOIN)
            parts = [p.name for p in cache.iterdir() if p.name.endswith(".part")]
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.join(JOIN)
        assert all(p.exitcode == -signal.SIGKILL for p in procs)
    print(f"downloads under way at the kill: {len(parts)}")
    q = CTX.Queue()  # a fresh one: the killed processes shared the first
    with python_server(data) as srv:
        survivor = CTX.Process(target=_survivor, args=(q, f"{srv.url}/ds", str(cache), budget))
        survivor.start()
        try:
            out = q.get(timeout=JOIN)
        except queue.Empty:
            survivor.kill()
            pytest.fail(f"a new reader did not finish the epoch in {JOIN}s: a stale lock?")
        survivor.join(JOIN)
    assert out.get("error") is None, out
    assert out["got"] == want
    assert held(cache) == []  # no lock of a dead process survives
    assert Budget(str(cache)).readers() == 0
    assert not [p for p in cache.iterdir() if p.name.startswith(".reader-")]
    assert ShardCache(cache, budget).trim() <= budget
    assert not [p.name for p in cache.iterdir() if p.name.endswith(".part") or ".tmp-" in p.name]
