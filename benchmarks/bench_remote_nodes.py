"""What the store sees when several nodes read one dataset over their own links (issue 48):
bytes and requests per node against its share, a warm epoch, a cache of half the dataset, and
the store's rate and cost per epoch on paper for 8 to 1,024 nodes.

    PYTHONPATH=. python benchmarks/bench_remote_nodes.py              # 3,000 samples, ~300 MB
    PYTHONPATH=. python benchmarks/bench_remote_nodes.py --n 600      # ~60 MB

The data is bench_remote.py's (random bytes of 80-120 KB in ~8 MB feedpipe tars, written once
under ``--root``). Each simulated node is one rank process with a cache directory of its own
and a ``linkstore.py`` store of its own (its own RTT and token bucket), so the store's counters
are that node's requests and bytes. The ranks read with ``shuffle=True``, ``rank=r``,
``world_size=N``, ``ranks_per_node=1`` and batch 64, through these phases (the ranks wait for
each other and the counters are read and reset between phases):

- ``cold``: epoch 0, empty caches;
- ``warm``: epoch 0 again in the same processes (the same pieces: the cache holds them);
- ``next``: epoch 1 (each node's piece changes every epoch: what it adds is the new shards).

Every phase is checked: across the nodes every sample exactly once, each with its CRC-32. A node's
*share* is the tar bytes of the dataset times its samples / all samples.

``--half``: one node, ``cache_size`` of half the dataset's tar bytes, epochs 0 and 1 (a new
order); the second epoch's hit rate (store-counted bytes, and the cache's own hits/misses), and
the cache directory's size sampled every 5 ms against the budget.

The on-paper table scales the measured requests per shard, bytes per node and the layout's bound
(the dataset plus at most one shard per node boundary) to a 100 TB dataset in 64 MB shards at
1 GB/s per node, with illustrative prices ($0.02 per GB, $0.0004 per 1,000 GETs; the probe takes
prices as ``--price-per-gb`` / ``--price-per-1k-requests`` and has no table of its own), and
checks the same model against the 1- and 4-node measurements.

Writes ``results/bench_remote_nodes[-TAG].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_remote import BUCKET, MB, key_of, prepare, sample_bytes  # noqa: E402
from common import RESULTS, default_root, emit, environment, load_spec, run_worker  # noqa: E402

BATCH = 64
PHASES = {"cold": 0, "warm": 0, "next": 1}
PRICE_PER_GB, PRICE_PER_1K = 0.02, 0.0004  # illustrative, as docs/performance.md's table


# -- a rank (a worker process) -----------------------------------------------------------------
def _wait_for(path: str, timeout: float) -> None:
    t_end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > t_end:
            raise TimeoutError(f"no {path} after {timeout} s")
        time.sleep(0.01)


def rank_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One node: its epochs one after the other, waiting for the harness between them."""
    from feedpipe import FeedDataset, FeedLoader

    with open(spec["expect"], encoding="utf-8") as f:
        expect: dict[str, int] = json.load(f)
    ds = FeedDataset(spec["url"], shuffle=True, seed=1, rank=spec["rank"],
                     world_size=spec["world"], ranks_per_node=1, cache_dir=spec["cache_dir"],
                     cache_size=spec.get("cache_size"), shuffle_window=spec.get("window"))
    loader = FeedLoader(ds, batch_size=BATCH, num_workers=spec.get("workers", 0))
    out: dict[str, Any] = {"phases": {}, "layout": None}
    for i, (name, epoch) in enumerate(spec["phases"]):
        loader.set_epoch(epoch)
        bad = 0
        keys: list[str] = []
        before = _cache_counts(ds)
        t0 = time.perf_counter()
        for batch in loader:
            for k, v in zip(batch["__key__"], batch["bin"], strict=True):
                keys.append(str(k))
                bad += expect.get(str(k)) != zlib.crc32(v)
        wall = time.perf_counter() - t0
        after = _cache_counts(ds)
        plan = ds.plan(epoch)
        out["layout"] = list(plan.layout or []) or None
        # the shards the plan gives this node: what it must fetch at the least
        piece = len(plan.node_shards(spec["rank"]) if plan.layout is not None
                    else plan.node_shards(0))
        out["phases"][name] = {"epoch": epoch, "wall_s": wall, "keys": keys, "corrupt": bad,
                               "cache": {k: after[k] - before[k] for k in after},
                               "peak_bytes": _peak(ds), "piece_shards": piece}
        with open(os.path.join(spec["sync"], f"done{i}-r{spec['rank']}"), "w"):
            pass
        if i + 1 < len(spec["phases"]):
            _wait_for(os.path.join(spec["sync"], f"go{i + 1}"), spec["timeout"])
    return out


def _cache_counts(ds: Any) -> dict[str, int]:
    st = ds.cache.stats if ds.cache is not None else None
    return {k: int(getattr(st, k, 0) or 0) for k in ("hits", "misses", "fills", "evictions",
                                                      "over_budget", "bytes_fetched")}


def _peak(ds: Any) -> int | None:
    try:
        return int(ds.cache.usage()["peak_bytes"])
    except Exception:  # noqa: BLE001 - a figure missing is not the run failing
        return None


# -- the harness -------------------------------------------------------------------------------
def _dir_bytes(path: str) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                    elif e.is_dir(follow_symlinks=False):
                        total += _dir_bytes(e.path)
                except FileNotFoundError:  # renamed or evicted while we looked
                    pass
    except FileNotFoundError:
        pass
    return total


class Sampler(threading.Thread):
    """The size of each cache directory every ``every`` seconds: the most seen per phase."""

    def __init__(self, dirs: list[str], every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.dirs, self.every = dirs, every
        self.peak = [0] * len(dirs)
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for i, d in enumerate(self.dirs):
                self.peak[i] = max(self.peak[i], _dir_bytes(d))
            self.samples += 1
            self._halt.wait(self.every)

    def take(self) -> tuple[list[int], int]:
        peak, n = self.peak, self.samples
        self.peak, self.samples = [0] * len(self.dirs), 0
        return peak, n

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_nodes(data: dict[str, Any], world: int, *, phases: list[tuple[str, int]], rtt: float,
              node_rate: float, cache_size: int | None = None, workers: int = 0,
              window: int | None = None, timeout: float = 300) -> dict[str, Any]:
    """``world`` rank processes, each with its own store (link) and cache directory, through
    ``phases``; per phase and node: the store's counts, the samples read, the cache's peak."""
    from linkstore import LinkStore

    script = os.path.abspath(__file__)
    tmp = tempfile.mkdtemp(prefix="bench-nodes-")
    stores = [LinkStore(data["base"]).start() for _ in range(world)]
    try:
        for s in stores:
            s.configure(rtt=rtt, node_rate=node_rate)
        sync = os.path.join(tmp, "sync")
        os.makedirs(sync)
        dirs = [os.path.join(tmp, f"node{r}") for r in range(world)]
        specs = [{"mode": "rank", "url": f"{stores[r].url}/{BUCKET}/fp", "rank": r,
                  "world": world, "cache_dir": dirs[r], "cache_size": cache_size,
                  "workers": workers, "window": window, "phases": phases, "sync": sync,
                  "expect": data["expect"],
                  "timeout": timeout} for r in range(world)]
        sampler = Sampler(dirs)
        sampler.start()
        per_phase: list[dict[str, Any]] = []
        with ThreadPoolExecutor(world) as ex:
            futs = [ex.submit(run_worker, script, sp, timeout * len(phases)) for sp in specs]
            for i in range(len(phases)):
                t_end = time.monotonic() + timeout
                while not all(os.path.exists(os.path.join(sync, f"done{i}-r{r}"))
                              for r in range(world)):
                    if any(f.done() for f in futs) or time.monotonic() > t_end:
                        break
                    time.sleep(0.01)
                peak, n = sampler.take()
                st = [s.stats() for s in stores]
                for s in stores:
                    s.reset()
                per_phase.append({"store": [_store_counts(x) for x in st], "dir_peak": peak,
                                  "dir_samples": n})
                with open(os.path.join(sync, f"go{i + 1}"), "w"):
                    pass
            ranks = [f.result() for f in futs]
        sampler.stop()
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)
    errors = [r for r in ranks if "error" in r]
    if errors:
        return {"error": "; ".join(str(r["error"])[:600] for r in errors)}
    return summarise(data, world, phases, per_phase, ranks, cache_size)


def _store_counts(st: dict[str, Any]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for path, v in st["per_object"].items():
        kind = ("tar" if path.endswith(".tar") else "idx" if path.endswith(".idx") else "other")
        k = by_kind.setdefault(kind, {"requests": 0, "bytes": 0, "objects": 0})
        k["requests"] += v["requests"]
        k["bytes"] += v["bytes"]
        k["objects"] += 1
    return {"requests": st["requests"], "requests_total": st["requests_total"],
            "bytes": st["bytes"], "max_in_flight": st["max_in_flight"], "by_kind": by_kind}


def summarise(data: dict[str, Any], world: int, phases: list[tuple[str, int]],
              per_phase: list[dict[str, Any]], ranks: list[dict[str, Any]],
              cache_size: int | None) -> dict[str, Any]:
    n = data["n"]
    tar_bytes = data["tar_bytes"]
    largest = max(data["shard_bytes"])
    out: dict[str, Any] = {"world": world, "layout": ranks[0]["layout"], "phases": {}}
    for i, (name, epoch) in enumerate(phases):
        got = [r["phases"][name] for r in ranks]
        counts: dict[str, int] = {}
        for g in got:
            for k in g["keys"]:
                counts[k] = counts.get(k, 0) + 1
        expected = {key_of(j) for j in range(n)}
        total_read = sum(counts.values())
        nodes = []
        for r, g in enumerate(got):
            st = per_phase[i]["store"][r]
            share = tar_bytes * len(g["keys"]) / n
            tar = st["by_kind"].get("tar", {"bytes": 0, "requests": 0, "objects": 0})
            nodes.append({
                "samples": len(g["keys"]), "wall_s": round(g["wall_s"], 3),
                "share_bytes": round(share), "bytes": st["bytes"], "tar_bytes": tar["bytes"],
                "tar_over_share": round(tar["bytes"] / share, 4) if share else None,
                "excess_in_largest_shards": round((tar["bytes"] - share) / largest, 3),
                "shards_fetched": tar["objects"], "piece_shards": g["piece_shards"],
                "share_in_shards": round(len(data["shard_bytes"]) * len(g["keys"]) / n, 3),
                "requests": st["requests_total"], "requests_by_method": st["requests"],
                "requests_by_kind": {k: v["requests"] for k, v in st["by_kind"].items()},
                "bytes_by_kind": {k: v["bytes"] for k, v in st["by_kind"].items()},
                "max_in_flight": st["max_in_flight"], "cache_counts": g["cache"],
                "cache_peak_bytes": g["peak_bytes"],
                "dir_peak_sampled": per_phase[i]["dir_peak"][r], "corrupt": g["corrupt"]})
        out["phases"][name] = {
            "epoch": epoch, "nodes": nodes,
            "exactly_once": (set(counts) == expected and total_read == n
                             and not any(g["corrupt"] for g in got)),
            "duplicates": sum(1 for c in counts.values() if c > 1),
            "missing": len(expected - set(counts)), "samples_read": total_read,
            "store_bytes": sum(x["bytes"] for x in nodes),
            "store_tar_bytes": sum(x["tar_bytes"] for x in nodes),
            "store_requests": sum(x["requests"] for x in nodes),
            "dir_samples": per_phase[i]["dir_samples"]}
    if cache_size is not None:
        out["cache_size"] = cache_size
        out["documented_bound"] = cache_size + largest + max(data["idx_bytes"])
    return out


def on_paper(one: dict[str, Any], four: dict[str, Any] | None, data: dict[str, Any],
             node_rate: float) -> dict[str, Any]:
    """The store's requests, bytes, rates and cost per epoch for N nodes, from the measured
    1-node cold epoch: requests per shard fetched (tar ranges + index), per node besides (the
    manifest), index and manifest bytes; shards fetched = every shard once plus at most one
    more per node boundary (the node layout's bound, checked at 4 nodes here)."""
    c1 = one["phases"]["cold"]["nodes"][0]
    shards = len(data["shard_bytes"])
    fetched = c1["shards_fetched"]
    rq, by = c1["requests_by_kind"], c1["bytes_by_kind"]
    m = {"tar_requests_per_shard": rq.get("tar", 0) / fetched,
         "tar_ranges_per_MB": rq.get("tar", 0) / c1["tar_bytes"] * MB,
         "idx_requests_per_shard": rq.get("idx", 0) / fetched,
         "requests_per_node_fixed": c1["requests"] - rq.get("tar", 0) - rq.get("idx", 0),
         "idx_bytes_per_shard": by.get("idx", 0) / fetched,
         "other_bytes_per_node": by.get("other", 0), "shards": shards,
         "mean_shard_bytes": data["tar_bytes"] / shards}
    m["requests_per_shard_fetched"] = m["tar_requests_per_shard"] + m["idx_requests_per_shard"]

    def model(nodes: int, n_shards: float, tar_total: float, shard: float, per_shard_req: float,
              idx_bytes: float, other_bytes: float) -> dict[str, float]:
        fetches = n_shards + (nodes - 1)
        return {"requests": nodes * m["requests_per_node_fixed"] + per_shard_req * fetches,
                "bytes": tar_total + (nodes - 1) * shard + fetches * idx_bytes
                + nodes * other_bytes}

    def here(nodes: int) -> dict[str, float]:
        return model(nodes, shards, data["tar_bytes"], max(data["shard_bytes"]),
                     m["requests_per_shard_fetched"], m["idx_bytes_per_shard"],
                     m["other_bytes_per_node"])

    check = {}
    for name, run, nodes in (("1 node", one, 1), ("4 nodes", four, 4)):
        if run is None or "error" in run:
            continue
        b = here(nodes)
        cold = run["phases"]["cold"]
        check[name] = {"model_requests_at_most": round(b["requests"], 1),
                       "measured_requests": cold["store_requests"],
                       "model_bytes_at_most": round(b["bytes"]),
                       "measured_bytes": cold["store_bytes"],
                       "dataset_tar_bytes": data["tar_bytes"],
                       "cost_model": _cost(b["bytes"], b["requests"]),
                       "cost_measured": _cost(cold["store_bytes"], cold["store_requests"])}
    small = []
    for nodes in (1, 4, 8, 64, 256, 1024):
        b = here(nodes)
        epoch_s = (data["tar_bytes"] / nodes + max(data["shard_bytes"])) / node_rate
        small.append({"nodes": nodes, "store_bytes": b["bytes"], "store_requests": b["requests"],
                      "epoch_s": epoch_s, "store_bytes_per_s": b["bytes"] / epoch_s,
                      "store_requests_per_s": b["requests"] / epoch_s,
                      "cost": _cost(b["bytes"], b["requests"])})
    # a 100 TB dataset in 64 MB shards, each node reading 1 GB/s: a shard takes as many ranges
    # per MB as measured, plus its index; index and manifest bytes grow with the shard's samples
    # and with the number of shards
    big_total, big_shard, rate = 100e12, 64e6, 1e9
    n_big = big_total / big_shard
    grow = big_shard / m["mean_shard_bytes"]
    per_shard = math.ceil(m["tar_ranges_per_MB"] * big_shard / MB) + m["idx_requests_per_shard"]
    rows = []
    for nodes in (1, 8, 64, 256, 1024):
        b = model(nodes, n_big, big_total, big_shard, per_shard, m["idx_bytes_per_shard"] * grow,
                  m["other_bytes_per_node"] * n_big / shards)
        epoch_s = (big_total / nodes + big_shard) / rate
        every_req = nodes * (n_big * per_shard + m["requests_per_node_fixed"])
        rows.append({"nodes": nodes, "per_node_bytes": big_total / nodes + big_shard,
                     "epoch_s": epoch_s, "store_bytes": b["bytes"],
                     "store_bytes_per_s": b["bytes"] / epoch_s, "store_requests": b["requests"],
                     "store_requests_per_s": b["requests"] / epoch_s,
                     "cost": _cost(b["bytes"], b["requests"]),
                     "every_node_every_shard_bytes": nodes * big_total,
                     "every_node_every_shard_cost": _cost(nodes * big_total, every_req)})
    return {"measured": m, "check": check,
            "big": {"dataset_bytes": big_total, "shard_bytes": big_shard, "node_rate": rate,
                    "requests_per_shard": per_shard, "rows": rows},
            "this_dataset": {"node_rate": node_rate, "rows": small},
            "prices": {"per_gb": PRICE_PER_GB, "per_1k_requests": PRICE_PER_1K}}


def _cost(nbytes: float, requests: float) -> float:
    from feedpipe.diagnostics._accounts import epoch_cost  # the probe's own arithmetic

    return float(epoch_cost({"remote": {"bytes": nbytes, "requests": requests}}, PRICE_PER_GB,
                            PRICE_PER_1K) or 0.0)


def dataset(root: str, n: int) -> dict[str, Any]:
    """bench_remote.py's data of ``n`` samples (written once under ``root``), described."""
    return describe(prepare(root, n))


def fp_dataset(base: str, n: int, shard_bytes: int, seed: int = 0) -> dict[str, Any]:
    """Only feedpipe tars of ``n`` samples under ``base/bkt/fp`` (a small dataset for tests)."""
    from feedpipe import ShardWriter

    with ShardWriter(os.path.join(base, BUCKET, "fp"), max_bytes=shard_bytes) as w:
        for i in range(n):
            w.write({"__key__": key_of(i), "bin": sample_bytes(seed, i)})
    return describe({"n": n, "seed": seed, "base": base})


def describe(d: dict[str, Any]) -> dict[str, Any]:
    n = d["n"]
    fp = os.path.join(d["base"], BUCKET, "fp")
    shards = sorted(x for x in os.listdir(fp) if x.endswith(".tar"))
    d["shard_bytes"] = [os.path.getsize(os.path.join(fp, s)) for s in shards]
    d["idx_bytes"] = [os.path.getsize(os.path.join(fp, s[:-4] + ".idx"))
                      for s in shards if os.path.exists(os.path.join(fp, s[:-4] + ".idx"))] or [0]
    d["tar_bytes"] = sum(d["shard_bytes"])
    exp = os.path.join(d["base"], "expect.json")
    if not os.path.exists(exp):
        tmp = exp + f".{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({key_of(i): zlib.crc32(sample_bytes(d["seed"], i)) for i in range(n)}, f)
        os.replace(tmp, exp)
    d["expect"] = exp
    return d


# -- the report --------------------------------------------------------------------------------
def _node_rows(run: dict[str, Any], phase: str) -> list[str]:
    p = run["phases"][phase]
    out = []
    for r, x in enumerate(p["nodes"]):
        out.append(f"| {run['world']} | {phase} | {r} | {x['samples']} | "
                   f"{x['share_bytes'] / MB:.1f} | {x['tar_bytes'] / MB:.1f} | "
                   f"{x['tar_over_share']:.3f} | {x['excess_in_largest_shards']:+.2f} | "
                   f"{x['shards_fetched']} / {x['piece_shards']} / {x['share_in_shards']:.2f} | "
                   f"{x['requests']} | "
                   f"{x['bytes'] / MB:.1f} |")
    out.append(f"| {run['world']} | {phase} | all | {p['samples_read']} | "
               f"{sum(x['share_bytes'] for x in p['nodes']) / MB:.1f} | "
               f"{p['store_tar_bytes'] / MB:.1f} | | | | {p['store_requests']} | "
               f"{p['store_bytes'] / MB:.1f} (exactly once: {p['exactly_once']}) |")
    return out


def _half_rows(d: dict[str, Any], label: str, h: dict[str, Any]) -> list[str]:
    title = f"## A cache of half the dataset (1 node, epochs 0 and 1, shuffle_window={label})"
    if "error" in h:
        return [title, "", f"failed: {h['error'][:600]}", ""]
    e0, e1 = h["phases"]["cold"]["nodes"][0], h["phases"]["next"]["nodes"][0]
    lines = [title, "",
             f"`cache_size` {h['cache_size'] / MB:.1f} MB (half the tars); documented bound "
             f"for one reader {h['documented_bound'] / MB:.1f} MB (size + the largest shard and "
             "its index). Hit rate by bytes = 1 - tar bytes fetched / the dataset's.", "",
             "| epoch | tar MB fetched | / dataset | hit rate by bytes | cache hits / misses / "
             "fills / evictions / over budget | requests | dir peak sampled MB | cache "
             "peak_bytes MB | exactly once |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, x, ph in (("0 (cold)", e0, h["phases"]["cold"]), ("1", e1, h["phases"]["next"])):
        frac = x["tar_bytes"] / d["tar_bytes"]
        c = x["cache_counts"]
        lines.append(f"| {name} | {x['tar_bytes'] / MB:.1f} | {frac:.3f} | {1 - frac:.3f} | "
                     f"{c['hits']} / {c['misses']} / {c['fills']} / {c['evictions']} / "
                     f"{c['over_budget']} | {x['requests']} | {x['dir_peak_sampled'] / MB:.1f} "
                     f"({ph['dir_samples']} samples) | {(x['cache_peak_bytes'] or 0) / MB:.1f} | "
                     f"{ph['exactly_once']} |")
    c = e1["cache_counts"]
    hr = c["hits"] / max(1, c["hits"] + c["misses"])
    return lines + ["", f"Second epoch: hit rate {1 - e1['tar_bytes'] / d['tar_bytes']:.3f} by "
                    f"bytes, {hr:.3f} by the cache's hits / (hits + misses).", ""]


def report(doc: dict[str, Any]) -> str:
    d = doc["data"]
    env = doc["env"]
    lines = ["# bench_remote_nodes", "",
             f"{env['date_utc']}, {env['cpu_count']} CPUs, load average {doc['loadavg']} "
             f"(start / end); {d['n']} samples, {d['tar_bytes'] / MB:.1f} MB in "
             f"{len(d['shard_bytes'])} tars (largest {max(d['shard_bytes']) / MB:.2f} MB); "
             f"each node its own store at RTT {doc['rtt'] * 1000:.0f} ms, "
             f"{doc['node_rate'] / MB:.0f} MB/s, its own cache directory; shuffle, batch 64, "
             "0 workers. Bytes and requests are the store's counts.", ""]
    if doc.get("nodes"):
        lines += ["## Bytes and requests per node", "",
                  "share = tar bytes x the node's samples / all samples; excess in largest "
                  "shards = (tar bytes fetched - share) / the largest tar; shards fetched / the "
                  "shards its piece of the plan holds / the share in shards; requests and bytes "
                  "include the manifest and indexes.", "",
                  "| nodes | phase | node | samples | share MB | tar MB fetched | / share | "
                  "excess (largest shards) | shards fetched / piece / share | requests | "
                  "bytes MB |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for run in doc["nodes"].values():
            if "error" in run:
                lines.append(f"| {run.get('world', '?')} | failed: {run['error'][:300]} |")
                continue
            for phase in run["phases"]:
                lines += _node_rows(run, phase)
        lines.append("")
    for label, h in (doc.get("half") or {}).items():
        lines += _half_rows(d, label, h)
    p = doc.get("paper")
    if p:
        m = p["measured"]
        lines += ["## On paper", "",
                  f"Measured at 1 node: {m['requests_per_shard_fetched']:.2f} requests per shard "
                  f"fetched ({m['tar_ranges_per_MB']:.3f} tar ranges per MB + "
                  f"{m['idx_requests_per_shard']:.2f} index), "
                  f"{m['requests_per_node_fixed']:.1f} requests per node besides (the manifest), "
                  f"{m['idx_bytes_per_shard'] / 1e3:.1f} kB of index per shard, "
                  f"{m['other_bytes_per_node'] / 1e3:.1f} kB of manifest per node. Prices "
                  f"${p['prices']['per_gb']} per GB, ${p['prices']['per_1k_requests']} per 1,000 "
                  "requests (illustrative; computed with the probe's `epoch_cost`).", "",
                  "Check against the measurements (cold epoch; the model is the bound: every "
                  "shard once plus one per node boundary):", "",
                  "| run | requests: model <= / measured | bytes MB: model <= / measured | "
                  "cost: model / measured |", "| --- | ---: | ---: | ---: |"]
        for name, c in p["check"].items():
            lines.append(f"| {name} | {c['model_requests_at_most']:.0f} / "
                         f"{c['measured_requests']} | {c['model_bytes_at_most'] / MB:.1f} / "
                         f"{c['measured_bytes'] / MB:.1f} | ${c['cost_model']:.6f} / "
                         f"${c['cost_measured']:.6f} |")
        b = p["big"]
        lines += ["", f"A {b['dataset_bytes'] / 1e12:.0f} TB dataset in "
                  f"{b['shard_bytes'] / 1e6:.0f} MB shards, each node reading "
                  f"{b['node_rate'] / 1e9:.0f} GB/s, {b['requests_per_shard']:.0f} requests per "
                  "shard (the measured ranges per MB, and the index):", "",
                  "| nodes | per node an epoch | epoch | store bytes an epoch | store bytes/s | "
                  "store requests/s | cost an epoch | every node every shard |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in b["rows"]:
            lines.append(f"| {r['nodes']:,} | {r['per_node_bytes'] / 1e9:,.1f} GB | "
                         f"{r['epoch_s']:,.0f} s | {r['store_bytes'] / 1e12:,.3f} TB | "
                         f"{r['store_bytes_per_s'] / 1e9:,.0f} GB/s | "
                         f"{r['store_requests_per_s']:,.0f} | ${r['cost']:,.0f} | "
                         f"{r['every_node_every_shard_bytes'] / 1e15:,.1f} PB, "
                         f"${r['every_node_every_shard_cost']:,.0f} |")
        s = p["this_dataset"]
        lines += ["", f"This benchmark's dataset at {s['node_rate'] / MB:.0f} MB/s per node "
                  "(the model; with more nodes than shards a node has less than one shard):", "",
                  "| nodes | store MB an epoch | requests | store MB/s | requests/s | cost |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in s["rows"]:
            lines.append(f"| {r['nodes']:,} | {r['store_bytes'] / MB:,.1f} | "
                         f"{r['store_requests']:,.0f} | {r['store_bytes_per_s'] / MB:,.0f} | "
                         f"{r['store_requests_per_s']:,.0f} | ${r['cost']:.6f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--nodes", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--rtt", type=float, default=0.05)
    ap.add_argument("--node-rate", type=float, default=50e6,
                    help="bytes/s per node (4 nodes share this machine's few hundred MB/s)")
    ap.add_argument("--half-windows", nargs="*", default=["all", "4"],
                    help="shuffle_window of each half-cache run ('all': None)")
    ap.add_argument("--root", default=default_root("remote"))
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tag", default="")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    if args.worker:
        spec = load_spec(args.worker)
        emit(rank_worker(spec))
        return 0
    data = dataset(args.root, args.n)
    load0 = os.getloadavg()
    doc: dict[str, Any] = {"env": environment(args.root), "rtt": args.rtt,
                           "node_rate": args.node_rate,
                           "data": {k: v for k, v in data.items() if k not in ("base", "expect")},
                           "nodes": {}}
    for world in args.nodes:
        print(f"== {world} node(s)", flush=True)
        doc["nodes"][str(world)] = run_nodes(data, world, phases=list(PHASES.items()),
                                             rtt=args.rtt, node_rate=args.node_rate,
                                             timeout=args.timeout)
        print(json.dumps(_brief(doc["nodes"][str(world)])), flush=True)
    doc["half"] = {}
    for w in args.half_windows:
        print(f"== half cache, shuffle_window={w}", flush=True)
        doc["half"][w] = run_nodes(data, 1, phases=[("cold", 0), ("next", 1)], rtt=args.rtt,
                                   node_rate=args.node_rate, cache_size=data["tar_bytes"] // 2,
                                   window=None if w == "all" else int(w), timeout=args.timeout)
        print(json.dumps(_brief(doc["half"][w])), flush=True)
    one, four = doc["nodes"].get("1"), doc["nodes"].get("4")
    if one and "error" not in one:
        doc["paper"] = on_paper(one, four, data, args.node_rate)
    doc["loadavg"] = " / ".join(f"{x:.1f}" for x in (load0[0], os.getloadavg()[0]))
    name = "bench_remote_nodes" + (f"-{args.tag}" if args.tag else "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    md = report(doc)
    with open(os.path.join(args.out, name + ".md"), "w", encoding="utf-8") as f:
        f.write(md + "\n")
    print(md)
    bad = [r for r in [*doc["nodes"].values(), *doc["half"].values()]
           if "error" in r or any(not p["exactly_once"] for p in r.get("phases", {}).values())]
    return 1 if bad else 0


def _brief(run: dict[str, Any]) -> Any:
    if "error" in run:
        return run
    return {ph: {"exactly_once": p["exactly_once"], "store_requests": p["store_requests"],
                 "store_tar_MB": round(p["store_tar_bytes"] / MB, 1),
                 "per_node_tar_over_share": [x["tar_over_share"] for x in p["nodes"]]}
            for ph, p in run["phases"].items()}


if __name__ == "__main__":
    sys.exit(main())
