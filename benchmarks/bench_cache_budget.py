"""L1 cache budget node-wide: the cache directory's peak size against ``cache_size`` when many
readers share it (issue 23: 4 readers x 2 workers had peaked at 2.51x the budget).

``--procs`` processes (8), each a ``FeedDataset(url, cache_dir=..., cache_size=...)`` read through
a DataLoader with ``--workers`` worker processes (2): 16 readers on one cache directory, each
keeping up to ``--max-open`` shards open (a shuffle window of as many shards), over a counting HTTP
server on 127.0.0.1 (``tests/_http_server.py``), for ``--epochs`` epochs. Every sample's bytes are
checked against the source.

Two configurations in the same run:

budget     ``cache_size`` = ``--budget-shards`` entries (shard + index);
unbounded  no ``cache_size``: the peer, the directory's size without a budget.

Figures (counts, not timings: they do not depend on the machine's load):

- ``peak_bytes``: the largest size a download took the directory to, as the cache's ledger
  records it under its lock (``ShardCache.usage()["peak_bytes"]``); ``sampled_peak_bytes``: the
  largest size a thread of this script saw, polling the directory every 2 ms (a cross-check);
- ``bound_bytes`` = ``cache_size`` + readers x the largest entry: the documented bound;
- ratios: peak / ``cache_size``, peak / bound, and bytes the server sent / the dataset's bytes.

Usage::

    python benchmarks/bench_cache_budget.py [--root DIR] [--procs 8] [--workers 2] [--quick]

Writes ``benchmarks/results/cache_budget.json`` and ``.md`` (``cache_budget-quick.*`` with
``--quick``) and prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import render_results

CTX = mp.get_context("fork")


def dir_bytes(path: str) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    pass
    except FileNotFoundError:
        pass
    return total


def digest(sample: dict[str, Any]) -> str:
    return hashlib.sha256(bytes(sample["bin"])).hexdigest()


def reader(q: Any, url: str, cache: str, budget: int | None, seed: int, epochs: int,
           workers: int, max_open: int, truth: dict[str, str]) -> None:
    try:
        from torch.utils.data import DataLoader

        from feedpipe import FeedDataset, ShardCache

        ds = FeedDataset(url, cache_dir=ShardCache(cache, budget, prefetch=2), shuffle=True,
                         seed=seed, shuffle_window=max_open, max_open_shards=max_open)
        n = bad = 0
        for e in range(epochs):
            ds.set_epoch(e)
            for s in DataLoader(ds, batch_size=None, num_workers=workers):
                n += 1
                bad += digest(s) != truth[s["__key__"]]
        q.put({"samples": n, "wrong": bad})
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        q.put({"error": repr(e)})


def make_data(root: str, shards: int, per_shard: int, size: int) -> str:
    import feedpipe
    from feedpipe.convert._synth import make_records

    ds = os.path.join(root, "ds")
    if not os.path.exists(os.path.join(ds, "manifest.json")):
        shutil.rmtree(root, ignore_errors=True)
        make_records(os.path.join(root, "src"), count=shards * per_shard, size=size,
                     per_dir=10**6, seed=7)
        feedpipe.shard(os.path.join(root, "src"), ds, max_samples=per_shard, workers=1,
                       show_progress=False)
    return ds


def run(url: str, server: str, cache: str, budget: int | None, a: argparse.Namespace,
        truth: dict[str, str]) -> dict[str, Any]:
    from feedpipe import ShardCache

    shutil.rmtree(cache, ignore_errors=True)
    urllib.request.urlopen(urllib.request.Request(server + "/__reset__", data=b"",
                                                  method="POST")).read()
    sampled = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):  # a benchmark's cross-check, not the measurement
            sampled[0] = max(sampled[0], dir_bytes(cache))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    q = CTX.Queue()
    procs = [CTX.Process(target=reader, args=(q, url, cache, budget, i, a.epochs, a.workers,
                                              a.max_open, truth)) for i in range(a.procs)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    reports = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    done.set()
    t.join()
    usage = ShardCache(cache, budget).usage()
    stats = json.loads(urllib.request.urlopen(server + "/__stats__").read())
    served = sum(v["bytes"] for k, v in stats.items() if k.endswith((".tar", ".idx")))
    return {"budget_bytes": budget, "seconds": time.perf_counter() - t0, "reports": reports,
            "peak_bytes": usage["peak_bytes"], "peak_readers": usage["peak_readers"],
            "sampled_peak_bytes": sampled[0], "bytes_after": usage["bytes"],
            "bytes_served": served}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=common.default_root("cache-budget"),
                    help="where the dataset and the cache directories go (default: under the "
                         "system temp dir)")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-open", type=int, default=4, help="shards each reader keeps open")
    ap.add_argument("--budget-shards", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="a smaller dataset")
    a = ap.parse_args()
    t_start = time.perf_counter()
    shards, per_shard, size = (32, 16, 2000) if a.quick else (64, 32, 8000)
    data = make_data(os.path.join(a.root, f"data-{shards}x{per_shard}x{size}"), shards,
                     per_shard, size)
    from feedpipe import FeedDataset

    truth = {s["__key__"]: digest(s) for s in FeedDataset(data)}
    entries: dict[str, int] = {}
    for f in os.listdir(data):
        if f.endswith((".tar", ".idx")):
            entries[f[:-4]] = entries.get(f[:-4], 0) + os.path.getsize(os.path.join(data, f))
    largest, dataset_bytes = max(entries.values()), sum(entries.values())
    budget = a.budget_shards * largest
    readers = a.procs * max(1, a.workers)
    server = subprocess.Popen([sys.executable, os.path.join(common.REPO, "tests",
                                                            "_http_server.py"),
                               os.path.dirname(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        base = "http://127.0.0.1:" + server.stdout.readline().split()[1]
        url = f"{base}/{os.path.basename(data)}"
        results = {name: run(url, base, os.path.join(a.root, f"cache-{name}"), b, a, truth)
                   for name, b in (("budget", budget), ("unbounded", None))}
    finally:
        server.kill()
        server.wait()
    bound = budget + readers * largest
    rows, errors = [], []
    for name, r in results.items():
        errors += [x["error"] for x in r["reports"] if "error" in x]
        wrong = sum(x.get("wrong", 0) for x in r["reports"])
        r["wrong_samples"] = wrong
        r["peak_over_budget"] = r["peak_bytes"] / budget
        r["peak_over_bound"] = r["peak_bytes"] / bound
        r["served_over_dataset"] = r["bytes_served"] / dataset_bytes
        rows.append([name, common.fmt(r["peak_bytes"]), common.fmt(r["sampled_peak_bytes"]),
                     f"{r['peak_over_budget']:.2f}x", f"{r['peak_over_bound']:.2f}x",
                     common.fmt(r["bytes_after"]), f"{r['served_over_dataset']:.2f}x",
                     str(r["peak_readers"]), str(wrong)])
    header = ["config", "peak bytes", "sampled peak", "peak/budget", "peak/bound",
              "bytes after", "served/dataset", "readers", "wrong"]
    text = (f"{a.procs} processes x {a.workers} workers = {readers} readers on one cache_dir, "
            f"{shards} shards (largest entry {largest:,} B, dataset {dataset_bytes:,} B), "
            f"max_open_shards = shuffle_window = {a.max_open}, {a.epochs} epochs\n"
            f"cache_size {budget:,} B ({a.budget_shards} entries); bound = cache_size + "
            f"{readers} x largest entry = {bound:,} B\n\n" + common.table(rows, header) + "\n")
    print(text)
    name = "cache_budget-quick" if a.quick else "cache_budget"
    doc = {"benchmark": "cache_budget", "quick": a.quick, "procs": a.procs,
           "workers": a.workers, "readers": readers, "epochs": a.epochs,
           "max_open_shards": a.max_open, "shards": shards, "samples_per_shard": per_shard,
           "record_bytes": size, "largest_entry_bytes": largest, "dataset_bytes": dataset_bytes,
           "budget_bytes": budget, "bound_bytes": bound, "results": results, "errors": errors,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "environment": common.environment(a.root)}
    os.makedirs(common.RESULTS, exist_ok=True)
    with open(os.path.join(common.RESULTS, f"{name}.md"), "w", encoding="utf-8") as f:
        f.write(f"# L1 cache budget, node-wide\n\n```\n{text}```\n")
    rc = common.finish(name, doc, [text], [], bool(errors) or any(
        r["wrong_samples"] for r in results.values()), t_start)
    render_results.render(os.path.join(common.RESULTS, name + ".json"), force=True,
                          parts=("png",))  # its chart (the .md is above)
    return rc


if __name__ == "__main__":
    sys.exit(main())
