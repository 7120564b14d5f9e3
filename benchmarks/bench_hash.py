"""The content hash of the L2 function index, measured: xxh3-128 against blake3, blake2b, sha256.

Issue 4 asks for "a fast content hash of the input bytes (xxh3-128 or blake3, measured)". The
hash runs on every sample the memo sees, hits included: on a hit it is most of the cost, so it
must be small next to the decode it saves and next to reading the bytes.

Candidates, each hashing the same random bytes on one core:

    xxh3-128     xxhash.xxh3_128 (what feedpipe.caches.l2._index.content_hash uses)
    xxh3-64      xxhash.xxh3_64 (the decoded store's record checksum)
    blake3       the blake3 package, one thread (max_threads=1); cryptographic
    blake2b-128  hashlib.blake2b(digest_size=16); cryptographic
    sha256       hashlib.sha256 (the manifest's shard hash); cryptographic
    content_hash feedpipe's content_hash of a one-field sample dict: xxh3-128 plus the field
                 framing, as the memo calls it

Sizes: 1 KiB (a caption, a token row), 16 KiB (a thumbnail), 110 KiB (an ImageNet JPEG on
average), 1 MiB (a large photo). Each figure is the median over ``--rounds`` rounds (the order
of candidates alternating between rounds) of the time per hash, each round hashing enough times
to take about 20 ms. Reported: microseconds per sample, GB/s, and the ratio to xxh3-128.

Usage::

    python benchmarks/bench_hash.py [--quick] [--rounds 15]

Writes ``benchmarks/results/hash.json`` (``hash-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

SIZES = {"1KiB": 1 << 10, "16KiB": 16 << 10, "110KiB": 110 << 10, "1MiB": 1 << 20}


def candidates() -> dict[str, Callable[[bytes], Any]]:
    import xxhash

    from feedpipe.caches.l2._record import content_hash

    out: dict[str, Callable[[bytes], Any]] = {
        "xxh3-128": xxhash.xxh3_128_digest,
        "xxh3-64": xxhash.xxh3_64_intdigest,
        "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "content_hash": lambda b: content_hash({"jpg": b}),
    }
    try:
        import blake3

        out["blake3"] = lambda b: blake3.blake3(b, max_threads=1).digest(16)
    except ImportError:
        print("blake3 not installed (pip install blake3): left out", file=sys.stderr)
    return out


def time_one(fn: Callable[[bytes], Any], data: bytes, target: float = 0.02) -> float:
    """Seconds per call: repeat until ``target`` seconds have passed."""
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(8):
            fn(data)
        n += 8
        dt = time.perf_counter() - t0
        if dt >= target:
            return dt / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    rounds = 5 if a.quick else a.rounds
    fns = candidates()
    names = list(fns)
    data = {k: os.urandom(n) for k, n in SIZES.items()}
    times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in names} for s in SIZES}
    for name in names:  # warm-up (imports, first-call costs)
        for d in data.values():
            time_one(fns[name], d, 0.002)
    for r in range(rounds):
        for size, d in data.items():
            for name in common.alternating(names, r):
                times[size][name].append(time_one(fns[name], d))
    summary: dict[str, Any] = {}
    rows = []
    for size, per in times.items():
        base = common.median(per["xxh3-128"])
        summary[size] = {}
        for name, ts in per.items():
            med = common.median(ts)
            summary[size][name] = {"us": med * 1e6, "gb_per_s": SIZES[size] / med / 1e9,
                                   "spread_us": [t * 1e6 for t in common.spread(ts) or []],
                                   "ratio_to_xxh3_128": med / base}
            rows.append([size, name, common.fmt(med * 1e6, 2), common.fmt(SIZES[size] / med / 1e9,
                                                                           2),
                         common.fmt(med / base, 1) + "x"])
    doc = {"benchmark": "hash", "rounds": rounds, "sizes": SIZES,
           "versions": {m: common._version(m) for m in ("xxhash", "blake3")},
           "environment": common.environment(), "summary": summary, "times_s": times}
    path = common.write_results("hash-quick" if a.quick else "hash", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    print(common.table(rows, ["size", "hash", "us/sample", "GB/s", "vs xxh3-128"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
