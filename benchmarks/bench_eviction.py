"""L1 cache eviction: plan-aware (the shard needed furthest ahead goes first) against LRU.

Issue 4: on a multi-epoch run with the cache budget at 50% of the dataset, report hit ratios of
both policies (LRU thrashes on cyclic orders).

Two parts:

simulation   The node's shard accesses, from the plan itself: every (local rank, worker) opens
             each shard it reads at its first use in an epoch (``first_uses`` of
             ``feedpipe/plan/_schedule.py``), merged on the node clock (local position; the next
             epoch continues it). A cache of ``budget`` bytes (equal shards: half of them) is
             replayed over ``--epochs`` epochs under three policies:
               lru      evict the least recently opened shard;
               plan     what ``feedpipe.ShardCache`` does: evict the shard with the largest
                        ``ShardTimeline.next_use`` (timeline of the current and the next epoch,
                        rebuilt every epoch, as each iterator does);
               optimal  Belady with the whole future of the run (an upper bound).
             Hit ratio = 1 - downloads / opens, over all epochs and over the warm ones (2+);
             with several workers a shard is opened by each of them, so shared opens count as
             hits: the refetch fraction (downloads in a warm epoch / distinct shards it reads)
             is the node's network cost.
             Orders: no shuffle (cyclic), shuffled with windows of 1, 4 and 16 shards.
             World shapes: 1 rank x 1 worker, 1 x 4, 2 ranks x 2 workers on one node, and the
             first node (2 ranks x 2 workers) of a 4-rank world. Locks (entries in use) are not
             modelled: at first-use granularity an open shard's next use is "now", so the plan
             policy never picks it anyway.
real run     ``FeedDataset(url, cache_dir=..., cache_size=50%)`` over ``tests/_http_server.py``
             (which counts bytes served) for ``--epochs`` epochs, one process, prefetch on:
             downloads counted by the server, opens by the cache's own counters; compared with
             the simulated ``plan`` and ``lru`` figures of the same configuration.

Usage::

    python benchmarks/bench_eviction.py [--quick] [--epochs 5]

Writes ``benchmarks/results/eviction.json`` (``eviction-quick.json`` with ``--quick``) and prints
a table. Hit ratios are counts, not timings: they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections import OrderedDict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

from feedpipe.plan._order import Plan, Split  # noqa: E402
from feedpipe.plan._schedule import first_uses, node_timeline  # noqa: E402

BATCH = 16
SEED = 0
SHAPES = [  # (name, world_size, local ranks, workers)
    ("1 rank x 1 worker", 1, (0,), 1),
    ("1 rank x 4 workers", 1, (0,), 4),
    ("2 ranks x 2 workers", 2, (0, 1), 2),
    ("node 0 of 4 ranks, 2x2", 4, (0, 1), 2),
]
ORDERS = [("cyclic", False, None), ("window 1", True, 1), ("window 4", True, 4),
          ("window 16", True, 16)]


def accesses(counts: tuple[int, ...], shuffle: bool, window: int | None, world: int,
             ranks: tuple[int, ...], workers: int, epochs: int) -> list[tuple[int, int, int]]:
    """``(epoch, node time, shard)`` of every shard open on the node, in time order."""
    n = sum(counts)
    out: list[tuple[int, int, int, int, int]] = []
    for e in range(epochs):
        plan = Plan(counts, SEED, e, shuffle, window)
        for r in ranks:
            split = Split(n, world, r)
            for w in range(workers):
                for pos, shards in first_uses(plan, split, BATCH, w, workers):
                    out.extend((e, int(p), r, w, int(s)) for p, s in zip(pos, shards))
    out.sort()
    return [(e, t, s) for e, t, _, _, s in out]


def simulate(events: list[tuple[int, int, int]], counts: tuple[int, ...], capacity: int,
             policy: str, shuffle: bool, window: int | None, world: int,
             ranks: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Per epoch ``(opens, downloads, distinct shards read)`` of a cache of ``capacity``
    shards."""
    n = sum(counts)
    per: dict[int, list[int]] = {}
    distinct: dict[int, set[int]] = {}
    cache: OrderedDict[int, None] = OrderedDict()
    nxt_occ: list[int] = []
    if policy == "optimal":  # index of the next event of the same shard
        last: dict[int, int] = {}
        nxt_occ = [0] * len(events)
        for i in range(len(events) - 1, -1, -1):
            s = events[i][2]
            nxt_occ[i] = last.get(s, 1 << 62)
            last[s] = i
        next_of: dict[int, int] = {}
    timeline = None
    cur_epoch = -1
    for i, (e, t, s) in enumerate(events):
        if policy == "plan" and e != cur_epoch:  # a new iterator: its own timeline
            cur_epoch = e
            segs = [(Plan(counts, SEED, ep, shuffle, window), [Split(n, world, r) for r in ranks])
                    for ep in (e, e + 1)]
            timeline = node_timeline(segs, len(counts))
        st = per.setdefault(e, [0, 0])
        st[0] += 1
        distinct.setdefault(e, set()).add(s)
        if policy == "optimal":
            next_of[s] = nxt_occ[i]
        if s in cache:
            cache.move_to_end(s)
            continue
        st[1] += 1
        while len(cache) >= capacity:
            if policy == "lru":
                cache.popitem(last=False)
            elif policy == "plan":
                assert timeline is not None
                victim = max(cache, key=lambda k: (timeline.next_use(k, t), -k))
                del cache[victim]
            else:
                victim = max(cache, key=lambda k: next_of[k])
                del cache[victim]
        cache[s] = None
    return [(per[e][0], per[e][1], len(distinct[e])) for e in sorted(per)]


def ratios(per_epoch: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Hit ratio (1 - downloads / opens) over all epochs and the warm ones (2+), and the
    fraction of the shards read that warm epochs download again."""
    def hit(rows: list[tuple[int, int, int]]) -> float:
        opens = sum(r[0] for r in rows)
        return 1 - sum(r[1] for r in rows) / opens if opens else float("nan")

    warm = per_epoch[1:]
    refetch = sum(r[1] for r in warm) / max(1, sum(r[2] for r in warm))
    return {"all": hit(per_epoch), "warm": hit(warm), "warm_refetch_fraction": refetch,
            "downloads_per_epoch": [r[1] for r in per_epoch]}


def run_simulation(shards: int, per_shard: int, epochs: int) -> list[dict[str, Any]]:
    counts = (per_shard,) * shards
    capacity = shards // 2  # equal shards: a 50% byte budget holds half of them
    rows = []
    for shape, world, ranks, workers in SHAPES:
        for order, shuffle, window in ORDERS:
            ev = accesses(counts, shuffle, window, world, ranks, workers, epochs)
            row: dict[str, Any] = {"shape": shape, "order": order, "opens": len(ev)}
            for policy in ("lru", "plan", "optimal"):
                row[policy] = ratios(simulate(ev, counts, capacity, policy, shuffle, window,
                                              world, ranks))
            rows.append(row)
            print(f"  {shape:<24} {order:<10} lru {row['lru']['all']:.3f}  "
                  f"plan {row['plan']['all']:.3f}  optimal {row['optimal']['all']:.3f}",
                  flush=True)
    return rows


def run_real(shards: int, per_shard: int, epochs: int, window: int) -> dict[str, Any]:
    import feedpipe
    from feedpipe import FeedDataset
    from feedpipe.convert._synth import make_records

    with tempfile.TemporaryDirectory(prefix="fp-bench-evict-") as tmp:
        make_records(os.path.join(tmp, "src"), count=shards * per_shard, size=2000,
                     per_dir=10**6, seed=1)
        feedpipe.shard(os.path.join(tmp, "src"), os.path.join(tmp, "ds"), max_samples=per_shard,
                       workers=1, show_progress=False)
        files = {f: os.path.getsize(os.path.join(tmp, "ds", f))
                 for f in os.listdir(os.path.join(tmp, "ds")) if f.endswith((".tar", ".idx"))}
        total = sum(files.values())
        budget = total // 2
        server = subprocess.Popen(
            [sys.executable, os.path.join(common.REPO, "tests", "_http_server.py"), tmp],
            stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            url = "http://127.0.0.1:" + server.stdout.readline().split()[1]
            ds = FeedDataset(f"{url}/ds", cache_dir=os.path.join(tmp, "cache"),
                             cache_size=budget, shuffle=True, seed=SEED, shuffle_window=window)
            per_epoch = []
            for e in range(epochs):
                urllib.request.urlopen(urllib.request.Request(url + "/__reset__", data=b"",
                                                              method="POST")).read()
                s0 = dict(vars(ds.cache.stats))
                ds.set_epoch(e)
                n = sum(1 for _ in ds)
                s1 = vars(ds.cache.stats)
                stats = json.loads(urllib.request.urlopen(url + "/__stats__").read())
                served = sum(v["bytes"] for k, v in stats.items() if k.endswith(".tar"))
                d = {k: s1[k] - s0[k] for k in s1}
                opens = d["hits"] + d["fills"] - d["prefetched"] + d["degraded"]
                per_epoch.append({"samples": n, "opens": opens, "downloads": d["fills"],
                              "distinct": shards,
                                  "prefetched": d["prefetched"], "evictions": d["evictions"],
                                  "tar_bytes_served": served,
                                  "cache_bytes_after": ds.cache.usage()["bytes"]})
        finally:
            server.kill()
            server.wait()
    counts = (per_shard,) * shards
    ev = accesses(counts, True, window, 1, (0,), 1, epochs)
    sim = {p: ratios(simulate(ev, counts, shards // 2, p, True, window, 1, (0,)))
           for p in ("lru", "plan")}
    rows = [(r["opens"], r["downloads"], r["distinct"]) for r in per_epoch]
    return {"shards": shards, "samples_per_shard": per_shard, "window": window,
            "dataset_bytes": total, "budget_bytes": budget, "epochs": per_epoch,
            "hit_ratio": ratios(rows), "simulated_same_config": sim}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shards")
    ap.add_argument("--epochs", type=int, default=5)
    a = ap.parse_args()
    shards, per_shard = (64, 32) if a.quick else (256, 64)
    print(f"simulation: {shards} shards x {per_shard} samples, budget 50%, {a.epochs} epochs")
    sim = run_simulation(shards, per_shard, a.epochs)
    print("real run through the cache (counting HTTP server)")
    real = run_real(32, 16, a.epochs, window=4)
    doc = {"benchmark": "eviction", "quick": a.quick, "epochs": a.epochs,
           "budget_fraction": 0.5, "batch_size": BATCH,
           "simulation": {"shards": shards, "samples_per_shard": per_shard, "rows": sim},
           "real": real, "environment": common.environment()}
    path = common.write_results("eviction-quick" if a.quick else "eviction", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    header = ["world", "order", "LRU all", "plan all", "optimal all", "LRU warm", "plan warm",
              "optimal warm", "LRU refetch", "plan refetch"]
    rows = [[r["shape"], r["order"]] + [f"{r[p]['all']:.3f}" for p in ("lru", "plan", "optimal")]
            + [f"{r[p]['warm']:.3f}" for p in ("lru", "plan", "optimal")]
            + [f"{r[p]['warm_refetch_fraction']:.2f}" for p in ("lru", "plan")] for r in sim]
    print()
    print(f"hit ratio (1 - downloads/opens), budget 50% of the dataset, {a.epochs} epochs; "
          "warm = epochs 2+; refetch = fraction of a warm epoch's shards downloaded again")
    print(common.table(rows, header))
    hr, simr = real["hit_ratio"], real["simulated_same_config"]
    print()
    print(f"real run, {real['shards']} shards, window {real['window']}: hit ratio all "
          f"{hr['all']:.3f} warm {hr['warm']:.3f}, refetch {hr['warm_refetch_fraction']:.2f}; "
          f"downloads per epoch "
          f"{hr['downloads_per_epoch']} (simulated, all / warm / refetch: plan "
          f"{simr['plan']['all']:.3f} / {simr['plan']['warm']:.3f} / "
          f"{simr['plan']['warm_refetch_fraction']:.2f}, LRU {simr['lru']['all']:.3f} / "
          f"{simr['lru']['warm']:.3f} / {simr['lru']['warm_refetch_fraction']:.2f})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
