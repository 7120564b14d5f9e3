"""Resume cost: continue a 1,000,000-sample epoch at 90% with ``FeedLoader.load_state_dict`` vs
reading up to 90% (a naive skip-by-reading resume).

Dataset: 1,000,000 records of 16 bytes (``make_records(size=16)`` of ``feedpipe/convert/_synth.py``
into ``ROOT/resume-src``, one file each), sharded by ``feedpipe.shard(src, out, workers=2)`` with
the default options (256 MB shards: 4 shards of ~262,000 samples, 1 KiB of tar per sample) into
``ROOT/resume-shards``. Both are generated once and cached (a ``.complete.json`` marker records the
parameters; generation goes to a temp dir that is renamed at the end). ``--quick``: 100,000 records
(``resume-src-quick`` / ``resume-shards-quick``). The shards and indexes are read once, untimed,
before the measurements: the page cache is warm.

Every measurement is a fresh interpreter (``FeedDataset`` + ``FeedLoader`` built there; imports
not timed), ``FeedDataset(root, shuffle=True, seed=0)``, ``FeedLoader(ds, batch_size=256,
num_workers=NW)``, epoch 0, 1 rank:

    full        iterate the whole epoch (NW=0). Timed: setup (dataset + loader), the first batch,
                the batches up to 90% (``ceil(0.9 N / 256)`` batches: what a skip-by-reading
                resume must read), and the rest. At the 90% batch it takes
                ``loader.state_dict()`` (a real state: position ``ceil(0.9 N / 256) * 256``) and
                it saves the epoch's ``__index__`` order.
    resume      a new process: ``loader.load_state_dict(state)``, then iterate to the end. Timed:
                setup + ``load_state_dict``, the first batch, the rest. Two states: ``real`` (the
                state taken above, unchanged) and ``p90`` (the same state dict with ``position``
                set to exactly ``0.9 N``; ``FeedLoader.state_dict()`` of a loader with other batch
                sizes or world sizes can hold any position). Verified: the ``__index__``es
                delivered equal the uninterrupted order's tail from that position, exactly
                (same ids, same order, none repeated, none lost).
    fresh       a new process, no state: the first batch from position 0 (what any start costs).

``resume`` and ``fresh`` are run with NW=0 and NW=2 (DataLoader worker processes).

A second dataset (``--many-shards``, on by default in full mode) shards the same source into
100 shards of 10,000 (``max_samples=10000``) and measures ``resume`` (NW=0) for its first
``--probe-batches`` batches only (window None: one pass, it is slow), with ``shuffle_window``
None and 32: with window None each
worker touches every shard in every batch, more than ``FeedDataset``'s ``max_open_shards=64``
maps, so its LRU reopens (maps and re-parses the ``.idx`` of) a shard for most samples.

Usage::

    python benchmarks/bench_resume.py [--quick] [--passes 2] [--root DIR]
                                      [--no-many-shards] [--probe-batches 4]

``--root`` defaults to ``feedpipe-bench`` under the system temp dir (``tempfile.gettempdir()``).
Writes ``benchmarks/results/bench_resume.json`` (``bench_resume-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
DEFAULT_ROOT = os.path.join(tempfile.gettempdir(), "feedpipe-bench")
BATCH = 256
MARKER = ".complete.json"


# -- dataset ------------------------------------------------------------------------------------
def _marker(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _fresh_tmp(path: str) -> str:
    if os.path.exists(path):
        shutil.rmtree(path)
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    return tmp


def ensure_source(root: str, count: int) -> str:
    from feedpipe.convert import _synth as synth

    spec = {"count": count, "size": 16, "per_dir": 10_000, "seed": 0}
    src = os.path.join(root, "resume-src" + ("" if count == 1_000_000 else f"-{count}"))
    m = _marker(src)
    if m is not None and m.get("spec") == spec:
        return src
    tmp = _fresh_tmp(src)
    print(f"generating {count:,} records of 16 B in {src} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    synth.make_records(tmp, **spec)
    with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
        json.dump({"spec": spec, "seconds": time.perf_counter() - t0}, f)
    os.replace(tmp, src)
    print(f"  done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return src


def ensure_shards(root: str, src: str, max_samples: int | None) -> dict[str, Any]:
    import feedpipe

    spec = {"src": src, "workers": 2, "max_samples": max_samples}
    name = os.path.basename(src).replace("resume-src", "resume-shards")
    out = os.path.join(root, name + ("" if max_samples is None else f"-max{max_samples}"))
    m = _marker(out)
    if m is not None and m.get("spec") == spec:
        return {"root": out, **m["summary"]}
    tmp = _fresh_tmp(out)
    print(f"sharding {src} into {out} (workers=2) ...", file=sys.stderr, flush=True)
    summary = feedpipe.shard(src, tmp, workers=2, max_samples=max_samples,
                             show_progress=False).to_dict()
    summary.pop("skipped_inputs", None)
    summary["out"] = out
    with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
        json.dump({"spec": spec, "summary": summary}, f)
    os.replace(tmp, out)
    print(f"  {summary['shards']} shards in {summary['seconds']:.0f}s", file=sys.stderr,
          flush=True)
    return {"root": out, **summary}


# -- worker side --------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def work(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    t0 = time.perf_counter()
    import feedpipe.stream._shard_set
    from feedpipe import FeedDataset, FeedLoader, ShardReader

    t_import = time.perf_counter() - t0
    opens = {"count": 0, "seconds": 0.0}

    class CountingReader(ShardReader):
        """Counts and times shard opens (map + index parse); NW=0 runs only (this process)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            t = time.perf_counter()
            super().__init__(*args, **kwargs)
            opens["seconds"] += time.perf_counter() - t
            opens["count"] += 1

    # benchmark-side instrumentation only: the shard set is where a dataset opens its shards
    feedpipe.stream._shard_set.ShardReader = CountingReader
    what, root, nw = spec["what"], spec["root"], spec["workers"]
    t0 = time.perf_counter()
    ds = FeedDataset(root, shuffle=True, seed=0, shuffle_window=spec.get("window"))
    loader = FeedLoader(ds, batch_size=BATCH, num_workers=nw)
    loader.set_epoch(0)
    if spec.get("state") is not None:
        loader.load_state_dict(spec["state"])
    t_setup = time.perf_counter() - t0
    n = ds.manifest.total_samples
    start = loader.state_dict()["position"]  # the loader's resume point, not the dataset's
    out: dict[str, Any] = {"import_s": t_import, "setup_s": t_setup, "samples_total": n,
                           "start": start, "len": ds.split_at(start).length}
    rss0 = _rss()
    cut = math.ceil(0.9 * n / BATCH) if what == "full" else None
    limit = spec.get("max_batches")
    ids: list[np.ndarray] = []
    got = 0
    t0 = time.perf_counter()
    t_first = t_cut = None
    for b, batch in enumerate(loader, start=1):
        idx = batch["__index__"]
        ids.append(np.asarray(idx, dtype=np.int64))
        got += len(idx)
        if b == 1:
            t_first = time.perf_counter() - t0
            if nw == 0:
                out["rss_after_first_batch_bytes"] = _rss()
                out["first_batch_shard_opens"] = opens["count"]
                out["first_batch_open_s"] = opens["seconds"]
        if b == cut:
            t_cut = time.perf_counter() - t0
            out["state_at_90"] = loader.state_dict()
        if limit is not None and b >= limit:
            break
    t_all = time.perf_counter() - t0
    order = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if nw == 0:
        out.update({"shard_opens": opens["count"], "shard_open_s": opens["seconds"],
                    "rss_base_bytes": rss0})
    out.update({"first_batch_s": t_first, "samples": got, "iter_s": t_all,
                "batches": len(ids), "samples_per_s": got / t_all if t_all else None})
    if what == "full":
        out["to_90_s"] = t_cut
        out["rest_s"] = t_all - t_cut
        np.save(spec["order_path"], order)
        out["is_permutation"] = bool(np.array_equal(np.sort(order), np.arange(n)))
        out["is_shuffled"] = bool(not np.array_equal(order, np.arange(n)))
    elif spec.get("order_path") and limit is None:
        full = np.load(spec["order_path"])
        start = out["start"]
        tail = full[start:]
        out["expected_samples"] = len(tail)
        out["tail_equal"] = bool(len(order) == len(tail) and np.array_equal(order, tail))
        out["repeats"] = int(len(order) - len(np.unique(order)))
        out["missing"] = int(len(np.setdiff1d(tail, order)))
        out["already_seen"] = int(len(np.intersect1d(order, full[:start])))
    return out


# -- driver -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100,000 records, 1 pass")
    ap.add_argument("--passes", type=int, default=None, help="passes (2; quick 1)")
    ap.add_argument("--root", default=DEFAULT_ROOT)
    ap.add_argument("--many-shards", dest="many", action="store_true", default=None)
    ap.add_argument("--no-many-shards", dest="many", action="store_false")
    ap.add_argument("--probe-batches", type=int, default=4)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        common.emit(work(common.load_spec(a.worker)))
        return 0
    count = 100_000 if a.quick else 1_000_000
    passes = a.passes or (1 if a.quick else 2)
    many = (not a.quick) if a.many is None else a.many
    os.makedirs(a.root, exist_ok=True)
    t_gen = time.perf_counter()
    src = ensure_source(a.root, count)
    data = ensure_shards(a.root, src, None)
    many_data = ensure_shards(a.root, src, count // 100) if many else None
    t_gen = time.perf_counter() - t_gen
    roots = [data["root"]] + ([many_data["root"]] if many_data else [])
    shard_files = [os.path.join(r, f) for r in roots for f in sorted(os.listdir(r))
                   if f.endswith((".tar", ".idx"))]
    common.warm_files(shard_files)
    env = common.environment(data["root"])
    work_dir = os.path.join(a.root, "resume-work")
    os.makedirs(work_dir, exist_ok=True)
    p90 = int(0.9 * count)

    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    failed: list[str] = []

    def record(name: str, r: dict[str, Any]) -> dict[str, Any]:
        runs.setdefault(name, []).append(r)
        if "error" in r:
            failed.append(name)
            print(f"ERROR {name}: {r['error']}\n{r.get('stderr_tail', '')}", file=sys.stderr)
        return r

    for p in range(passes):
        order_path = os.path.join(work_dir, f"order-{count}-{p}.npy")
        full = record("full", common.run_worker(
            SCRIPT, {"what": "full", "root": data["root"], "workers": 0,
                     "order_path": order_path}))
        if "error" in full:
            break
        real = full["state_at_90"]
        edited = {**real, "position": p90}
        jobs = [(f"resume-{lab}-nw{nw}", st, nw) for nw in (0, 2)
                for lab, st in (("real", real), ("p90", edited))]
        jobs += [(f"fresh-nw{nw}", None, nw) for nw in (0, 2)]
        for name, state, nw in common.alternating(jobs, p):
            record(name, common.run_worker(
                SCRIPT, {"what": "resume" if state else "fresh", "root": data["root"],
                         "workers": nw, "state": state,
                         "order_path": order_path if state else None,
                         "max_batches": None if state else 1}))
    if many_data and not failed:
        probe_state = {"version": 1, "epoch": 0, "position": p90, "num_samples": count,
                       "seed": 0, "shuffle": True}
        for window in (None, 32):
            for _ in range(1 if window is None else passes):
                record(f"many-shards-w{'all' if window is None else window}", common.run_worker(
                    SCRIPT, {"what": "resume", "root": many_data["root"], "workers": 0,
                             "window": window,
                             "state": {**probe_state, "shuffle_window": window},
                             "max_batches": a.probe_batches}))

    def med(name: str, key: str) -> float | None:
        return common.median(r.get(key) for r in runs.get(name, []) if "error" not in r)

    summary: dict[str, Any] = {}
    for name in runs:
        summary[name] = {k: med(name, k) for k in (
            "setup_s", "first_batch_s", "iter_s", "to_90_s", "rest_s", "samples_per_s",
            "first_batch_shard_opens", "first_batch_open_s", "shard_opens", "shard_open_s",
            "rss_base_bytes", "rss_after_first_batch_bytes")}
        summary[name]["start_cost_s"] = ((summary[name]["setup_s"] or 0)
                                         + (summary[name]["first_batch_s"] or 0))
        oks = [r.get("tail_equal") for r in runs[name] if "tail_equal" in r]
        if oks:
            summary[name]["tail_equal_all_passes"] = all(oks)
    naive = None
    if "full" in summary and summary["full"]["to_90_s"] is not None:
        naive = summary["full"]["setup_s"] + summary["full"]["to_90_s"]
        for name, s in summary.items():
            if name.startswith("resume"):
                s["speedup_vs_naive"] = naive / s["start_cost_s"] if s["start_cost_s"] else None

    doc = {"benchmark": "bench_resume", "quick": a.quick, "environment": env,
           "params": {"samples": count, "record_bytes": 16, "batch_size": BATCH,
                      "position_p90": p90, "passes": passes, "dataset": data,
                      "many_shards_dataset": many_data, "probe_batches": a.probe_batches,
                      "page_cache": "warm (shards and indexes read once before the runs)",
                      "generate_or_check_s": t_gen},
           "summary": summary, "naive_resume_s": naive, "runs": runs,
           "seconds": time.perf_counter() - t0}
    path = common.write_results("bench_resume-quick" if a.quick else "bench_resume", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it

    f = lambda x, d=2: common.fmt(x, d)  # noqa: E731
    rows = []
    for name, s in summary.items():
        rows.append([name, f(s["setup_s"], 3), f(s["first_batch_s"], 3), f(s["start_cost_s"], 3),
                     f(s["to_90_s"]), f(s["iter_s"]), common.fmt(s["samples_per_s"]),
                     f(s.get("speedup_vs_naive"), 1),
                     common.fmt(s["first_batch_shard_opens"]), f(s["first_batch_open_s"]),
                     common.fmt(s["shard_opens"]), f(s["shard_open_s"]),
                     "-" if s["rss_after_first_batch_bytes"] is None or s["rss_base_bytes"] is None
                     else f"{(s['rss_after_first_batch_bytes'] - s['rss_base_bytes']) / 1e6:,.0f}",
                     {True: "yes", False: "NO"}.get(s.get("tail_equal_all_passes"), "-")])
    print(f"\n{count:,} x 16 B samples, {data['shards']} shards; batch {BATCH}, 1 rank; "
          f"resume at 90%; medians of {passes} pass(es)")
    print(common.table(rows, ["run", "setup s", "1st batch s", "start s", "to 90% s",
                              "iter s", "samples/s", "x naive", "opens@1st", "open s@1st",
                              "opens", "open s", "+RSS MB@1st", "tail ok"]))
    print(f"\nnaive skip-by-reading resume (setup + read to 90%): {f(naive)} s; start s = setup "
          "(dataset, loader, load_state_dict) + first batch;\niter s: the whole run after setup "
          f"(many-shards: {a.probe_batches} batches only); tail ok: resumed ids == uninterrupted "
          "order's tail, every pass;\nopens, open s: shard opens (map + .idx parse) and their "
          "time, by the first batch and in the whole run (NW=0 only); +RSS MB@1st: RSS growth "
          "from setup to the first batch (NW=0: the open shards' indexes)")
    print(f"\nwrote {path} in {doc['seconds']:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
