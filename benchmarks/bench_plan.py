"""Planning cost: ``feedpipe.plan._order.Plan`` for 100 million samples over 100,000 shards.

Target (issue 3): planning 100M samples over 100k shards takes under 2 s and under 1 GB.

Measured, each in a fresh interpreter (one subprocess per measurement, so RSS figures are not
polluted by earlier ones):

    plan            ``Plan(counts, seed, epoch, shuffle=True, window)`` with ``counts`` a tuple of
                    100,000 x 1,000 (what ``FeedDataset`` passes), then the ids of the first batch
                    of rank 0 / worker 0 (so the plan is usable). Wall time: the first call and
                    the median of ``--reps`` more. Memory: peak RSS delta (``VmHWM`` reset through
                    ``/proc/self/clear_refs`` before, minus ``VmRSS`` before; this includes
                    numpy's and Python's allocations and freed-then-reused pages) and, in a
                    separate run, the ``tracemalloc`` peak (numpy reports its buffers to
                    tracemalloc, so this counts numpy arrays and Python objects).
    ids             ``iter_ids`` for rank 0, worker 0 of 8 ranks x 8 workers (batch 256): the
                    ids of the first ``--positions`` samples of that worker's share, timed; the
                    samples/s projects the time to compute the worker's whole share (N / 64) and
                    the whole epoch's ids on one core. tracemalloc peak during the iteration.
    dataset-wall    ``FeedDataset(root, shuffle=True, rank=0, world_size=8)`` on a synthetic
                    ``manifest.json`` of the same 100,000 shards (written to a temp dir; the
                    shards need not exist until read), then ``plan()``, ``split()`` and the first
                    batch's ids: planning as a training script meets it (JSON parse, one
                    ``ShardRecord`` per shard, two ``Plan``s). Time and peak RSS delta.
    numpy-perm      peer: ``np.random.default_rng(0).permutation(N)`` (a materialised global
                    order, what a list-based sampler holds): time and peak RSS delta
    torch-randperm  peer: ``torch.randperm(N, generator=g)`` (what
                    ``torch.utils.data.DistributedSampler`` computes, before its ``.tolist()``)

Windows: None (the whole dataset mixed; the default), 64 and 2 (shards per window).

Usage::

    python benchmarks/bench_plan.py [--quick] [--reps 5] [--positions 1000000]

``--quick``: 10M samples over 10k shards, 200k positions. Writes
``benchmarks/results/bench_plan.json`` (``bench_plan-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
BATCH = 256
RANKS, WORKERS = 8, 8
WINDOWS = (None, 64, 2)
TARGET_S, TARGET_BYTES = 2.0, 1 << 30


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS growth over a block: VmHWM after minus VmRSS before (HWM reset first)."""

    def __enter__(self) -> PeakRss:
        self.reset = _reset_peak()
        self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _status("VmHWM")
        self.after = _status("VmRSS")
        self.delta = self.peak - self.before if self.reset else None


# -- worker side (one measurement per process) -------------------------------------------------
def work(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    n_shards, per_shard = spec["shards"], spec["per_shard"]
    n = n_shards * per_shard
    what = spec["what"]
    if what in ("plan", "plan-tracemalloc"):
        from feedpipe.plan._order import Plan, Split, iter_ids

        counts = tuple([per_shard] * n_shards)  # FeedDataset: tuple(s.samples for s in shards)
        window = spec["window"]

        def build() -> int:
            p = Plan(counts, seed=0, epoch=1, shuffle=True, window=window)
            first = next(iter_ids(p, Split(p.num_samples, RANKS, 0), BATCH, 0, WORKERS))
            return len(first)

        if what == "plan-tracemalloc":
            import tracemalloc

            tracemalloc.start()
            build()
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            return {"tracemalloc_peak_bytes": peak}
        with PeakRss() as m:
            t0 = time.perf_counter()
            got = build()
            first = time.perf_counter() - t0
        if got != BATCH:
            raise RuntimeError(f"first batch has {got} ids, not {BATCH}")
        times = []
        for _ in range(spec["reps"]):
            t0 = time.perf_counter()
            build()
            times.append(time.perf_counter() - t0)
        return {"first_s": first, "median_s": statistics.median(times), "times_s": times,
                "rss_before_bytes": m.before, "peak_rss_delta_bytes": m.delta,
                "rss_retained_bytes": m.after - m.before}
    if what == "ids":
        import tracemalloc

        from feedpipe.plan._order import Plan, Split, iter_ids

        counts = tuple([per_shard] * n_shards)
        plan = Plan(counts, seed=0, epoch=1, shuffle=True, window=spec["window"])
        split = Split(n, RANKS, 0)
        want = spec["positions"]

        def run() -> tuple[float, int, int]:
            t0 = time.perf_counter()
            got, lo, hi = 0, n, -1
            for ids in iter_ids(plan, split, BATCH, 0, WORKERS):
                got += len(ids)
                lo, hi = min(lo, int(ids.min())), max(hi, int(ids.max()))
                if got >= want:
                    break
            return time.perf_counter() - t0, got, hi - lo

        run()  # warm-up (page faults, numpy's first calls)
        rates = []
        for _ in range(spec["reps"]):
            dt, got, span = run()
            rates.append(got / dt)
        tracemalloc.start()
        run()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        share = split.length // WORKERS
        rate = statistics.median(rates)
        return {"samples": got, "samples_per_s": rate, "rates": rates, "id_span": span,
                "worker_share": share, "projected_worker_epoch_s": share / rate,
                "projected_all_ids_one_core_s": n / rate, "tracemalloc_peak_bytes": peak}
    if what == "dataset":
        from feedpipe import FeedDataset
        from feedpipe.plan._order import iter_ids

        with PeakRss() as m:
            t0 = time.perf_counter()
            ds = FeedDataset(spec["root"], shuffle=True, seed=0, rank=0, world_size=RANKS,
                             shuffle_window=spec["window"])
            t_init = time.perf_counter() - t0
            plan, split = ds.plan(), ds.split()
            first = next(iter_ids(plan, split, BATCH, 0, WORKERS))
            dt = time.perf_counter() - t0
        if len(first) != BATCH or ds.manifest.total_samples != n:
            raise RuntimeError("unexpected dataset")
        return {"first_s": dt, "init_s": t_init, "median_s": dt, "rss_before_bytes": m.before,
                "peak_rss_delta_bytes": m.delta, "rss_retained_bytes": m.after - m.before}
    if what == "numpy-perm":
        with PeakRss() as m:
            t0 = time.perf_counter()
            perm = np.random.default_rng(0).permutation(n)
            dt = time.perf_counter() - t0
        del perm
        return {"median_s": dt, "peak_rss_delta_bytes": m.delta}
    if what == "torch-randperm":
        import torch

        g = torch.Generator()
        g.manual_seed(0)
        with PeakRss() as m:
            t0 = time.perf_counter()
            perm = torch.randperm(n, generator=g)
            dt = time.perf_counter() - t0
        del perm
        return {"median_s": dt, "peak_rss_delta_bytes": m.delta,
                "torch_threads": torch.get_num_threads()}
    raise ValueError(what)


# -- driver -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10M samples / 10k shards")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--positions", type=int, default=None, help="ids timed (1M; quick 200k)")
    ap.add_argument("--no-peers", action="store_true", help="skip numpy/torch permutations")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        common.emit(work(common.load_spec(a.worker)))
        return 0
    shards, per_shard = (10_000, 1_000) if a.quick else (100_000, 1_000)
    positions = a.positions or (200_000 if a.quick else 1_000_000)
    n = shards * per_shard
    base = {"shards": shards, "per_shard": per_shard, "reps": a.reps}
    env = common.environment()
    t0 = time.perf_counter()
    res: dict[str, Any] = {}
    failed = []
    for window in WINDOWS:
        wk = "all" if window is None else str(window)
        r = common.run_worker(SCRIPT, {**base, "what": "plan", "window": window})
        r.update(common.run_worker(SCRIPT, {**base, "what": "plan-tracemalloc", "window": window}))
        res[f"plan-w{wk}"] = r
        res[f"ids-w{wk}"] = common.run_worker(
            SCRIPT, {**base, "what": "ids", "window": window, "positions": positions})
    # FeedDataset end to end on a synthetic manifest (shards not needed until read)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-plan-") as mdir:
        with open(os.path.join(mdir, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump({"format": "feedpipe-manifest", "version": 1,
                       "shards": [{"name": f"data-{i:06d}.tar", "samples": per_shard,
                                   "bytes": per_shard * 1024, "sha256": f"{i:064x}"}
                                  for i in range(shards)],
                       "total_samples": n, "fields": ["bin"]}, f)
        res["dataset-wall"] = common.run_worker(
            SCRIPT, {**base, "what": "dataset", "window": None, "root": mdir})
    if not a.no_peers:
        for peer in ("numpy-perm", "torch-randperm"):
            res[peer] = common.run_worker(SCRIPT, {**base, "what": peer})
    for k, r in res.items():
        if "error" in r:
            failed.append(k)
            print(f"ERROR {k}: {r['error']}\n{r.get('stderr_tail', '')}", file=sys.stderr)

    verdict = {}
    for key in [f"plan-w{'all' if w is None else w}" for w in WINDOWS] + ["dataset-wall"]:
        r = res.get(key, {"error": "missing"})
        if "error" in r:
            continue
        mem = max(x for x in (r.get("peak_rss_delta_bytes"), r.get("tracemalloc_peak_bytes"))
                  if x is not None)
        verdict[key] = {
            "time_s": r["first_s"], "memory_bytes": mem,
            "under_2s": r["first_s"] < TARGET_S, "under_1GB": mem < TARGET_BYTES}
    doc = {"benchmark": "bench_plan", "quick": a.quick, "environment": env,
           "params": {"samples": n, "shards": shards, "per_shard": per_shard, "ranks": RANKS,
                      "workers": WORKERS, "batch_size": BATCH, "positions": positions,
                      "reps": a.reps, "windows": list(WINDOWS)},
           "results": res, "targets": {"seconds": TARGET_S, "bytes": TARGET_BYTES},
           "verdict": verdict, "seconds": time.perf_counter() - t0}
    path = common.write_results("bench_plan-quick" if a.quick else "bench_plan", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it

    mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f}"  # noqa: E731
    rows = []
    for k, r in res.items():
        if "error" in r:
            rows.append([k, "ERROR", "", "", "", ""])
        elif k.startswith("plan"):
            rows.append([k, f"{r['first_s'] * 1e3:,.1f}", f"{r['median_s'] * 1e3:,.1f}",
                         mb(r["peak_rss_delta_bytes"]), mb(r["tracemalloc_peak_bytes"]), ""])
        elif k.startswith("dataset"):
            rows.append([k, f"{r['first_s'] * 1e3:,.1f}", "", mb(r["peak_rss_delta_bytes"]),
                         "", f"of which FeedDataset.__init__ (manifest JSON + Plan) "
                         f"{r['init_s'] * 1e3:,.0f} ms"])
        elif k.startswith("ids"):
            rows.append([k, "", "", "", mb(r["tracemalloc_peak_bytes"]),
                         f"{r['samples_per_s'] / 1e6:,.2f} M/s; share {r['worker_share']:,} in "
                         f"{r['projected_worker_epoch_s']:.2f} s; all {n:,} on 1 core "
                         f"{r['projected_all_ids_one_core_s']:.0f} s"])
        else:
            rows.append([k, f"{r['median_s'] * 1e3:,.1f}", "", mb(r["peak_rss_delta_bytes"]),
                         "", ""])
    print(f"\n{n:,} samples over {shards:,} shards of {per_shard:,}; ids for rank 0 / worker 0 "
          f"of {RANKS} ranks x {WORKERS} workers, batch {BATCH}")
    print(common.table(rows, ["measure", "first ms", "median ms", "peak RSS +MB",
                              "tracemalloc MB", "ids"]))
    for k, v in verdict.items():
        print(f"target {k}: {v['time_s']:.3f} s (<2 s: {'yes' if v['under_2s'] else 'NO'}), "
              f"{v['memory_bytes'] / 1e6:,.1f} MB (<1 GB: {'yes' if v['under_1GB'] else 'NO'})")
    print(f"\nwrote {path} in {doc['seconds']:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
