"""Raw read of tiny records against ``cat`` of the same shards (issue 31's tiny raw read bar).

The ``tiny`` dataset of ``datasets.py`` (200,000 records of 1 KiB; 20,000 with ``--quick``) is
sharded once by ``feedpipe.shard`` (64 MiB shards). Systems, each a fresh interpreter per pass,
passes alternating their order:

    cat        ``cat SHARDS > /dev/null``, the page cache warm: the floor a sequential reader
               of the same bytes meets. Its rate is in samples-equivalent: the dataset's
               samples over ``cat``'s seconds.
    fp-0       ``FeedLoader(FeedDataset(root), batch_size=256)``: the route a user gets by
               default (raw bytes, the ``refs`` route), one untimed epoch, then ``--epochs``
               timed ones on the same loader; every batch's keys counted.
    fp-2       the same with ``num_workers=2``.
    fp-0-new   ``fp-0`` with a new ``FeedLoader(FeedDataset(root))`` every epoch: what a script
               that builds its loader per epoch pays (indexes parsed, maps opened, columns built).

Per system: the median samples/s of its passes (each pass: the median of its epochs) and its
peak RSS (``peer_memory.PeakMemory``, summed over the process tree). Per pass the ratio of each
feedpipe system to ``cat`` of the same pass; the bar is on the median of those ratios: at least
0.5. ``os.getloadavg()`` is recorded beside every run: on a shared machine compare only within
one run.

Usage::

    python benchmarks/bench_tiny_read.py [--quick] [--passes 5] [--epochs 3] [--root DIR]
        [--systems cat,fp-0,fp-2,fp-0-new]

Writes ``benchmarks/results/bench_tiny_read.json`` (``-quick`` with ``--quick``), ``.md`` and
``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import render_results
from common import (
    alternating,
    emit,
    environment,
    fmt,
    load_spec,
    median,
    run_worker,
    spread,
    table,
    write_results,
)

SYSTEMS = ("cat", "fp-0", "fp-2", "fp-0-new")
BATCH = 256
BAR = 0.5


def _tars(root: str) -> list[str]:
    with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    return [os.path.join(root, s["name"] if isinstance(s, dict) else s) for s in m["shards"]]


def worker(spec: dict[str, Any]) -> None:
    from peer_memory import PeakMemory

    system, root, epochs = spec["system"], spec["shards"], spec["epochs"]
    rates: list[float] = []
    with PeakMemory() as mem:
        if system == "cat":
            tars = _tars(root)
            subprocess.run(["cat", *tars], stdout=subprocess.DEVNULL, check=True)  # warm
            for _ in range(epochs):
                t0 = time.perf_counter()
                subprocess.run(["cat", *tars], stdout=subprocess.DEVNULL, check=True)
                rates.append(spec["samples"] / (time.perf_counter() - t0))
        else:
            import feedpipe

            workers = 2 if system == "fp-2" else 0
            make = lambda: feedpipe.FeedLoader(feedpipe.FeedDataset(root),  # noqa: E731
                                               batch_size=BATCH, num_workers=workers)
            fl = make()
            for _ in fl:  # untimed: page cache, maps, indexes, columns
                pass
            for e in range(1, epochs + 1):
                if system == "fp-0-new":
                    fl = make()
                t0 = time.perf_counter()
                fl.set_epoch(e)
                n = 0
                for b in fl:
                    n += len(b["__key__"])
                rates.append(n / (time.perf_counter() - t0))
                if n != spec["samples"]:
                    raise SystemExit(f"{system}: epoch {e} gave {n} samples, not "
                                     f"{spec['samples']}")
    route = getattr(locals().get("fl"), "route", None)
    emit({"system": system, "rate": median(rates), "epoch_rates": rates,
          "route": None if route is None else route.name, "loadavg": list(os.getloadavg()),
          **mem.result()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "feedpipe-bench"))
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--quick", action="store_true", help="20,000 records, 2 passes")
    a = ap.parse_args(argv)
    if a.worker:
        worker(load_spec(a.worker))
        return 0
    import datasets

    import feedpipe

    info = datasets.ensure("tiny", root=a.root, quick=a.quick)
    shards = os.path.join(os.path.dirname(info["src"]), "feedpipe-tiny-read")
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        shutil.rmtree(shards, ignore_errors=True)
        feedpipe.shard(info["src"], shards, max_bytes=64 << 20, workers=2, show_progress=False)
    samples = feedpipe.FeedDataset(shards).manifest.total_samples
    systems = a.systems.split(",")
    passes = 2 if a.quick else a.passes
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    errors: list[str] = []
    t_start = time.perf_counter()
    env = environment(shards)
    for p in range(passes):
        for system in alternating(systems, p):
            r = run_worker(__file__, {"system": system, "shards": shards, "samples": samples,
                                      "epochs": a.epochs})
            if "error" in r:
                errors.append(f"{system}: {r['error']}\n{r.get('stderr_tail')}")
                print(errors[-1], file=sys.stderr)
                continue
            runs[system].append({**r, "pass": p})
            print(f"pass {p} {system:9s} {r['rate']:>12,.0f} samples/s  peak RSS "
                  f"{r['peak_rss_bytes'] / 1e6:,.0f} MB  load {r['loadavg'][0]:.2f}", flush=True)
    cat = {r["pass"]: r["rate"] for r in runs.get("cat", [])}
    summary: dict[str, Any] = {}
    rows = []
    for system in systems:
        rs = runs[system]
        ratios = [r["rate"] / cat[r["pass"]] for r in rs if r["pass"] in cat]
        ratio = median(ratios) if system != "cat" else None
        summary[system] = {"median_samples_per_s": median(r["rate"] for r in rs),
                           "median_peak_rss_bytes": median(r["peak_rss_bytes"] for r in rs),
                           "over_cat_ratio": ratio, "pass_ratios": ratios,
                           "met": None if ratio is None else ratio >= BAR,
                           "route": rs[0].get("route") if rs else None}
        lo_hi = spread(ratios) if system != "cat" else None
        rows.append([system, fmt(summary[system]["median_samples_per_s"]),
                     fmt(ratio, 3), "-" if not lo_hi else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}",
                     fmt((summary[system]["median_peak_rss_bytes"] or 0) / 1e6),
                     "-" if ratio is None else ("met" if ratio >= BAR else "NOT MET")])
    text = table(rows, ["system", "samples/s", "/cat", "per pass", "peak RSS MB", f">= {BAR}"])
    print(text)
    doc = {"benchmark": "bench_tiny_read", "command": "python benchmarks/bench_tiny_read.py "
           + " ".join(sys.argv[1:] if argv is None else argv), "passes": passes,
           "params": {"batch_size": BATCH, "epochs": a.epochs, "samples": samples,
                      "bar_over_cat": BAR},
           "environment": env, "summary": summary, "runs": runs, "errors": errors,
           "loadavg_at_end": list(os.getloadavg()), "summary_text": text,
           "elapsed_seconds": time.perf_counter() - t_start}
    path = write_results("bench_tiny_read" + ("-quick" if a.quick else ""), doc)
    render_results.render(path, force=True)
    print(f"results written to {path}")
    met = all(s["met"] for s in summary.values() if s["met"] is not None)
    return 1 if errors or not met else 0


if __name__ == "__main__":
    sys.exit(main())
