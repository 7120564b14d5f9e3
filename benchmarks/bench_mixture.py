"""A mixture of three sources against one dataset of the same samples: raw batches read through
FeedLoader, samples/s.

Data (written once under ``--root``): three sources of ``--samples / 3`` samples each (a
``bin`` field of ``--size`` random bytes and a ``cls`` label) and one dataset holding the same
samples, with the same samples per shard. Read: ``FeedLoader(batch_size=--batch)`` over
``FeedDataset(one)`` and over ``Mixture({a, b, c})`` (default weights: each source once an
epoch, so both epochs hold the same samples), shuffled, raw batches with the default collation,
every byte of every sample touched (its length summed), ``--epochs`` epochs a pass, in this
process. Each pass reads both, in alternating order; the figure is the median of the per-pass
ratios (mixture / one), by wall time and by this process's CPU time (the reading is all in
this process: on a shared machine its CPU time is what other load disturbs least). Done for
the ``auto`` route (``refs`` for both) and the ``samples`` route (the general path:
``fetch=mixture`` against ``fetch=samples``). ``os.getloadavg()`` is recorded before and
after.

Usage::

    python benchmarks/bench_mixture.py [--samples 30000] [--passes 7]
                                       [--out benchmarks/results/bench_mixture.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import default_root, environment  # noqa: E402  (beside this script)

SOURCES = ("a", "b", "c")


def prepare(root: str, samples: int, size: int, per_shard: int) -> dict[str, str]:
    """The three sources and the one dataset of the same samples (written once)."""
    from feedpipe import write_samples

    base = os.path.join(root, f"{samples}-{size}-{per_shard}")
    paths = {n: os.path.join(base, n) for n in (*SOURCES, "one")}
    if all(os.path.exists(os.path.join(p, "manifest.json")) for p in paths.values()):
        return paths
    rng = np.random.default_rng(0)
    each = samples // len(SOURCES)
    data = {n: [{"__key__": f"{n}-{i:07d}", "bin": rng.bytes(size), "cls": i % 10}
                for i in range(each)] for n in SOURCES}
    for n in SOURCES:
        write_samples(data[n], paths[n], max_samples=per_shard)
    write_samples((x for n in SOURCES for x in data[n]), paths["one"], max_samples=per_shard)
    return paths


def read(ld: Any, epochs: int) -> tuple[int, float, float]:
    """Samples read, wall seconds and this process's CPU seconds."""
    n = touched = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        for b in ld:
            touched += sum(map(len, b["bin"]))
            n += len(b["bin"])
    return n, time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    from feedpipe import FeedDataset, FeedLoader, Mixture

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=30_000)
    ap.add_argument("--size", type=int, default=4096, help="bytes per sample")
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--routes", default="auto,samples")
    ap.add_argument("--root", default=default_root("mixture"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_mixture.json"))
    a = ap.parse_args(argv)
    paths = prepare(a.root, a.samples, a.size, a.per_shard)
    load_before = os.getloadavg()

    def loader(kind: str, route: str) -> Any:
        if kind == "one":
            ds: Any = FeedDataset(paths["one"], shuffle=True, seed=1)
        else:
            ds = Mixture({n: FeedDataset(paths[n], shuffle=True) for n in SOURCES}, seed=1)
        return FeedLoader(ds, batch_size=a.batch, route=route)

    results = []
    for route in a.routes.split(","):
        loaders = {k: loader(k, route) for k in ("one", "mixture")}
        for ld in loaders.values():  # warm: page cache, shard maps, index columns
            read(ld, 1)
        rates: dict[str, list[float]] = {"one": [], "mixture": []}
        cpu: dict[str, list[float]] = {"one": [], "mixture": []}
        for p in range(a.passes):
            for kind in (("one", "mixture") if p % 2 == 0 else ("mixture", "one")):
                n, dt, ct = read(loaders[kind], a.epochs)
                rates[kind].append(n / dt)
                cpu[kind].append(n / ct)
        ratios = [m / o for m, o in zip(rates["mixture"], rates["one"])]
        cpu_ratios = [m / o for m, o in zip(cpu["mixture"], cpu["one"])]
        results.append({
            "route": route,
            "routes_taken": {k: ld.route.name for k, ld in loaders.items()},
            "one_samples_per_s": statistics.median(rates["one"]),
            "mixture_samples_per_s": statistics.median(rates["mixture"]),
            "median_ratio": round(statistics.median(ratios), 4),
            "ratios": [round(r, 3) for r in ratios],
            "one_samples_per_cpu_s": statistics.median(cpu["one"]),
            "mixture_samples_per_cpu_s": statistics.median(cpu["mixture"]),
            "median_cpu_ratio": round(statistics.median(cpu_ratios), 4),
            "cpu_ratios": [round(r, 3) for r in cpu_ratios],
            "one_per_pass": [round(x) for x in rates["one"]],
            "mixture_per_pass": [round(x) for x in rates["mixture"]],
        })
        print(f"{route:8s} one {results[-1]['one_samples_per_s']:>10,.0f}/s  mixture "
              f"{results[-1]['mixture_samples_per_s']:>10,.0f}/s  median ratio "
              f"{results[-1]['median_ratio']:.3f}  per pass {results[-1]['ratios']}  by CPU time "
              f"{results[-1]['median_cpu_ratio']:.3f} {results[-1]['cpu_ratios']}")
    load_after = os.getloadavg()
    doc = {"benchmark": "mixture", "environment": environment(paths["one"]),
           "params": {"samples": a.samples, "bytes_per_sample": a.size,
                      "samples_per_shard": a.per_shard, "batch": a.batch, "epochs": a.epochs,
                      "passes": a.passes, "sources": len(SOURCES)},
           "loadavg_before": list(load_before), "loadavg_after": list(load_after),
           "results": results,
           "summary_text": "; ".join(f"{r['route']}: mixture / one dataset "
                                     f"{r['median_ratio']:.3f}x by wall time, "
                                     f"{r['median_cpu_ratio']:.3f}x by CPU time (medians of "
                                     "per-pass ratios)" for r in results)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    print(doc["summary_text"], "loadavg", load_before, load_after)
    from render_results import render

    render(a.out, force=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
