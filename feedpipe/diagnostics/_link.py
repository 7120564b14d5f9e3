"""The link to a remote store, measured as the loader uses it: the round trip of a request, what
one range read delivers, and what several range reads in flight at once deliver together (the
L1 shard cache fetches shards ahead of the plan, several at a time). From these, what the link
allows a cold epoch: ``latency + dataset bytes / aggregate bandwidth``.

Each measurement is bounded by its share of the phase's seconds; sizes grow only while there is
time, so a slow link costs no more than the deadline.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._helpers.storage_probe import RawStore
from ._storage import FileSet

STREAMS = 8  # range reads in flight for the aggregate figure
MIN_READ = 1 << 20
MAX_READ = 32 << 20


def _read(store: RawStore, path: str, start: int, end: int) -> int:
    return len(store.read(path, start, end))


def measure(files: FileSet, seconds: float, streams: int = STREAMS) -> dict[str, Any]:
    """``latency_s`` (median of small range reads, one at a time), ``one_stream_mb_per_s``
    (one range read) and ``aggregate_mb_per_s`` (``streams`` range reads at once), each with the
    latency left out, and the bytes read."""
    store = files.store
    pairs = [(p, s) for p, s in zip(files.paths, files.sizes, strict=True) if s > 0]
    if store is None or not pairs:
        raise ValueError("the link is measured on remote files")
    deadline = time.perf_counter() + seconds
    lat: list[float] = []
    for i in range(8):
        path, size = pairs[i % len(pairs)]
        t = time.perf_counter()
        _read(store, path, 0, min(size, 4096))
        lat.append(time.perf_counter() - t)
        if time.perf_counter() > deadline - seconds * 0.75 and len(lat) >= 2:
            break
    latency = statistics.median(lat)
    total = 0
    # one stream: a range as large as time allows (doubling from 1 MiB)
    one = None
    n = MIN_READ
    path, size = max(pairs, key=lambda x: x[1])
    while True:
        want = min(n, size)
        t = time.perf_counter()
        got = _read(store, path, 0, want)
        dt = time.perf_counter() - t
        total += got
        one = got / max(dt - latency, dt * 0.05) / 1e6
        left = deadline - time.perf_counter()
        if want >= size or n >= MAX_READ or dt * 2.5 > left - seconds * 0.4:
            break
        n *= 2
    # several streams: ranges of the same size on different files (or parts of one), no more
    # bytes than the time left carries at the one-stream rate
    left = max(0.0, deadline - time.perf_counter())
    per = int(min(n, MAX_READ, max(MIN_READ // 4, left * (one or 1.0) * 1e6 / streams)))
    jobs = []
    for i in range(streams):
        p, s = pairs[i % len(pairs)]
        k = i // len(pairs)
        start = min(k * per, max(0, s - per))
        jobs.append((p, start, min(s, start + per)))
    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as ex:
        got_all = sum(ex.map(lambda j: _read(store, *j), jobs))
    wall = time.perf_counter() - t
    total += got_all
    return {"latency_s": latency, "latency_samples": len(lat), "one_stream_mb_per_s": one,
            "one_stream_read_bytes": min(n, size), "streams": streams,
            "aggregate_mb_per_s": got_all / max(wall - latency, wall * 0.05) / 1e6,
            "aggregate_read_bytes": got_all, "aggregate_wall_s": wall, "bytes_read": total}


def cold_epoch_s(link: dict[str, Any], dataset_bytes: int) -> float | None:
    """What the link allows a cold epoch of ``dataset_bytes``: one round trip, then the bytes at
    the aggregate bandwidth (shards fetched several at a time, as the L1 cache does)."""
    agg = link.get("aggregate_mb_per_s")
    if not agg:
        return None
    return float(link["latency_s"]) + dataset_bytes / (agg * 1e6)
