"""What FeedLoader(ledger=DIR) costs on the raw-read route: the same shards read through
FeedLoader (the refs route, batch 256) with and without a ledger, alternating, ``--passes``
passes of ``--epochs`` epochs each; prints the rates and the median of the per-pass ratios
(ledger / plain) as JSON.

Usage::

    python benchmarks/bench_ledger.py DATASET [--passes 7] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    from feedpipe import FeedDataset, FeedLoader

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", help="a feedpipe dataset (local shards)")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args(argv)
    rates: dict[str, list[float]] = {"plain": [], "ledger": []}
    route = ""
    for p in range(a.passes):
        for kind in (("plain", "ledger") if p % 2 == 0 else ("ledger", "plain")):
            d = tempfile.mkdtemp(prefix="feedpipe-ledger-")
            try:
                ld = FeedLoader(FeedDataset(a.dataset, shuffle=True, seed=p), batch_size=a.batch,
                                ledger=d if kind == "ledger" else None)
                n = 0
                t0 = time.perf_counter()
                for _ in range(a.epochs):
                    for b in ld:
                        n += len(b["__key__"])
                rates[kind].append(n / (time.perf_counter() - t0))
                route = ld.route.name
            finally:
                shutil.rmtree(d, ignore_errors=True)
    ratios = [x / y for x, y in zip(rates["ledger"], rates["plain"])]
    print(json.dumps({"route": route, "passes": a.passes, "epochs": a.epochs,
                      "plain": [round(x) for x in rates["plain"]],
                      "ledger": [round(x) for x in rates["ledger"]],
                      "ratios": [round(r, 3) for r in ratios],
                      "median_ratio": round(statistics.median(ratios), 4)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
