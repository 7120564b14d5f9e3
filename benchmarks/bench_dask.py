"""Conversion on a Dask cluster: files/s with 1, 2 and 4 worker processes against the local
process pool, and Dask's coordination overhead per task.

Source: ``--files`` records of ``--size`` bytes in 40 top-level directories
(``feedpipe.convert._synth``), read once untimed so they are in the page cache. Every
system-pass runs in a fresh interpreter (``common.run_worker``); passes alternate the order of
the systems.

Systems:
    local-w1, local-w2   ``feedpipe.shard(src, out, workers=N)`` (the local process pool)
    dask-1, -2, -4       ``feedpipe.shard(src, out, dask=client)`` on a ``LocalCluster`` of N
                         worker processes x 1 thread on 127.0.0.1, started before timing
    noop-1, -2, -4       the same submission pattern (``client.submit`` + ``as_completed``) with
                         tasks that do nothing: the pure coordination cost per task

Per dask run the task stream gives every task's compute time, and the workers' and the client's
process CPU time is read before and after:

    span               first task start to last task stop; ``client s`` = wall - span is the
                       listing, planning and manifest on the client (the same work as local-w*)
    busy               sum of task compute / (span x workers): worker utilisation while tasks run
    idle/task          (span x workers - sum of compute) / tasks: worker time not spent computing
                       (coordination plus the tail where some workers have no task left)
    coord share        the same run count's no-op cost per task (noop-N wall/task) / the median
                       task time: the fraction of a task that coordination adds
    worker CPU         the workers' CPU seconds / (span x min(workers, cores)): how full the cores
                       are (1.0 = every core the workers can use is busy)
                       (a worker's process CPU includes its own share of coordination: the
                       no-op runs show how much)

``feedpipe.convert._dask`` groups parts into tasks of ~4,096 files / 64 MiB (whole shards where
they fit), so tasks take hundreds of milliseconds against ~10-20 ms of coordination each. With
2 cores the conversion cannot scale past 2 workers; the figures show whether the time goes into
the work (CPU) or into coordination.

Usage::

    python benchmarks/bench_dask.py [--files 20000] [--size 4096] [--passes 3] [--quick]

Writes ``benchmarks/results/bench_dask.json`` (``bench_dask-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
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
SYSTEMS = ("local-w1", "local-w2", "dask-1", "dask-2", "dask-4")
NOOP_TASKS = 500
MAX_BYTES = 8 << 20


def _noop(i: int) -> int:
    return i


def _cpu_s() -> float:
    return time.process_time()


def _dask_run(n: int, fn: Any) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=n, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.run(lambda: None)  # every worker up
        client.get_task_stream()  # start recording
        cpu0 = client.run(_cpu_s)
        t0 = time.perf_counter()
        res = fn(client)
        wall = time.perf_counter() - t0
        cpu1 = client.run(_cpu_s)
        stream = client.get_task_stream(start=0)
    compute = [sum(s["stop"] - s["start"] for s in t["startstops"] if s["action"] == "compute")
               for t in stream]
    stops = [s for t in stream for s in t["startstops"]]
    span = (max(s["stop"] for s in stops) - min(s["start"] for s in stops)) if stops else wall
    busy = sum(compute)
    worker_cpu = sum(cpu1[w] - cpu0[w] for w in cpu1 if w in cpu0)
    tasks = max(1, len(compute))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    res.update({"wall_s": wall, "span_s": span, "client_s": wall - span, "tasks": len(compute),
                "task_compute_s_sum": busy,
                "busy_fraction_wall": busy / (wall * n),
                "busy_fraction": busy / (span * n),
                "overhead_per_task_ms": (span * n - busy) / tasks * 1e3,
                "wall_per_task_ms": wall / tasks * 1e3,
                "task_compute_ms_median": common.median(compute) * 1e3 if compute else None,
                "worker_cpu_s": worker_cpu,
                "worker_cpu_util": worker_cpu / (span * min(n, cores or 1))})
    return res


def worker(spec: dict[str, Any]) -> int:
    from feedpipe import shard

    system, src = spec["system"], spec["src"]
    out = tempfile.mkdtemp(prefix="bench-dask-", dir=spec["work"])
    try:
        kind, _, n = system.partition("-")
        if kind == "local":
            t0 = time.perf_counter()
            s = shard(src, out, workers=int(n[1:]), max_bytes=MAX_BYTES, show_progress=False)
            res = {"wall_s": time.perf_counter() - t0, "files": s.files}
        elif kind == "dask":
            res = _dask_run(int(n), lambda c: {"files": shard(
                src, out, dask=c, max_bytes=MAX_BYTES, show_progress=False).files})
        else:
            from distributed import as_completed

            res = _dask_run(int(n), lambda c: {"ok": sum(
                f.result() >= 0 for f in as_completed(
                    [c.submit(_noop, i, pure=False) for i in range(NOOP_TASKS)]))})
        if "files" in res:
            res["files_per_s"] = res["files"] / res["wall_s"]
        res["system"] = system
    finally:
        shutil.rmtree(out, ignore_errors=True)
    common.emit(res)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2,000 files, 1 pass")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "feedpipe-bench-dask"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        return worker(common.load_spec(a.worker))
    if a.quick:
        a.files, a.passes = 2000, 1
    from feedpipe.convert._synth import make_records

    src = os.path.join(a.root, f"src-{a.files}x{a.size}")
    if not os.path.isdir(src):
        make_records(src + ".tmp", count=a.files, size=a.size,
                     per_dir=-(-a.files // 40), seed=1)
        os.replace(src + ".tmp", src)
    work = os.path.join(a.root, "work")
    os.makedirs(work, exist_ok=True)
    common.warm_files(common.walk_files(src))
    systems = [*SYSTEMS, "noop-1", "noop-2", "noop-4"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    failed = False
    for p in range(a.passes):
        for system in common.alternating(systems, p):
            r = common.run_worker(SCRIPT, {"system": system, "src": src, "work": work})
            if "error" in r:
                print(f"{system}: {r['error']}\n{r.get('stderr_tail', '')}", file=sys.stderr)
                failed = True
                continue
            runs[system].append(r)
            common.sync_disk()
            print(f"pass {p} {system}: {r['wall_s']:.2f}s", file=sys.stderr)

    def med(system: str, key: str) -> float | None:
        return common.median(r.get(key) for r in runs[system] if r.get(key) is not None)

    keys = ("wall_s", "files_per_s", "span_s", "client_s", "busy_fraction", "busy_fraction_wall",
            "overhead_per_task_ms", "task_compute_ms_median", "wall_per_task_ms", "tasks",
            "worker_cpu_s", "worker_cpu_util")
    stats: dict[str, dict[str, Any]] = {s: {k: med(s, k) for k in keys} for s in systems}
    base = stats["local-w2"]["files_per_s"]
    for s in SYSTEMS:
        fps = stats[s]["files_per_s"]
        stats[s]["ratio_to_local_w2"] = fps / base if fps and base else None
        if s.startswith("dask-"):
            noop = stats[f"noop-{s[5:]}"]["wall_per_task_ms"]
            task = stats[s]["task_compute_ms_median"]
            stats[s]["coord_ms_per_task"] = noop
            stats[s]["coord_share"] = noop / (noop + task) if noop and task else None
    doc = {"benchmark": "bench_dask", "environment": common.environment(src),
           "params": {"files": a.files, "size": a.size, "passes": a.passes,
                      "max_bytes": MAX_BYTES, "noop_tasks": NOOP_TASKS},
           "stats": stats, "runs": runs}
    path = common.write_results("bench_dask-quick" if a.quick else "bench_dask", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    rows = [[s, common.fmt(stats[s]["files_per_s"]), common.fmt(stats[s]["wall_s"], 2),
             common.fmt(stats[s]["client_s"], 2),
             common.fmt(stats[s].get("ratio_to_local_w2"), 2), common.fmt(stats[s]["tasks"]),
             common.fmt(stats[s]["task_compute_ms_median"], 1),
             common.fmt(stats[s].get("coord_ms_per_task"), 1),
             common.fmt(stats[s].get("coord_share"), 3),
             common.fmt(stats[s]["overhead_per_task_ms"], 1),
             common.fmt(stats[s]["busy_fraction"], 2),
             common.fmt(stats[s]["worker_cpu_util"], 2)]
            for s in systems]
    print(common.table(rows, ["system", "files/s", "wall s", "client s", "x local-w2", "tasks",
                              "task ms", "coord ms/task", "coord share", "idle/task ms",
                              "busy", "worker CPU"]))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
