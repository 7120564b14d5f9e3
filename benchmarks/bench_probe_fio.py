"""Trust check for ``feedpipe probe``: its sequential-read MB/s against ``fio`` on the same file,
block size and thread count, cold and warm.

A random (incompressible) file of ``--size`` bytes (2 GiB by default) is generated and fsync'ed in a
temp dir under ``--dir`` (the system temp dir) and deleted at the end, whatever happens. For each
block size and thread count, each pass runs both tools, alternating which goes first:

    probe   ``python -m feedpipe probe FILE --block-sizes B --threads T --duration D --json -``:
            its cold cell (pages dropped with posix_fadvise(DONTNEED), each thread reads its
            1/T of the file once) and its warm cell (file resident, threads wrap around in their
            region until the deadline).
    fio     ``--rw=read --ioengine=psync --bs=B --numjobs=T --size=S/T --offset_increment=S/T
            --thread --group_reporting``, the same layout: cold with ``--invalidate=1`` (fio drops
            the file's pages with the same fadvise before the job) and reading each region once,
            warm with ``--invalidate=0 --time_based`` after the file was read into the page cache.
            ``--clocksource=clock_gettime``: fio's default (``cpu``, raw TSC reads several times
            per I/O) is pathologically slow on some VMs (on the 2-vCPU VM this was written on,
            whose kernel logs "TSC doesn't count with P0 frequency", it cut fio's warm 1 MiB
            reads from ~2.9 GB/s to ~0.8 GB/s while dd and plain preadv did 5+ GB/s).
            ``--iomem_align=4096``: page-aligned buffers, as dd and the probe use; with fio's
            default buffer the kernel's copy out of the page cache ran at about half speed
            (5 GB/s against 15 GB/s for dd and for fio with aligned buffers).

Both run for at most ``--duration`` seconds per measurement. Reported: medians over the passes,
and the difference probe vs fio in % of fio (the target is within 15%).

Cold runs start from the same state for both tools: the file's pages are dropped (fadvise
DONTNEED) and the machine is left ``--settle`` seconds (5) before the tool starts (and drops them
again itself). On a VM the guest's freshly freed page cache is handed back to the host (free page
reporting); a cold read that starts before that has happened refills guest memory cheaply, one
that starts after pays for the host re-faulting it, and the same cold read then ran at ~1.9 GB/s
or at ~0.5 GB/s depending only on the delay since the drop. Settling puts both tools in the
second, reproducible state.

Usage::

    python benchmarks/bench_probe_fio.py [--size 2GiB] [--blocks 1MiB,16MiB] [--threads 1,4]
                                         [--duration 10] [--passes 3] [--settle 5]
                                         [--dir DIR] [--name probe_fio]

Writes ``benchmarks/results/NAME.json``. Needs ``fio`` (Debian: ``apt-get install fio``).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

from feedpipe.cli._main import parse_size  # noqa: E402
from feedpipe.diagnostics._probe import generate_file  # noqa: E402


def drop_and_settle(path: str, settle: float) -> None:
    """The common starting point of a cold run (see the module docstring)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    time.sleep(settle)


def run_probe(path: str, block: int, threads: int, duration: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "feedpipe", "probe", path, "--block-sizes", str(block),
           "--threads", str(threads), "--duration", str(duration), "--json", "-",
           "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30 * duration + 300,
                       cwd=common.REPO)
    if r.returncode != 0:
        raise RuntimeError(f"probe failed: {r.stderr[-2000:]}")
    doc = json.loads(r.stdout)
    out = {c["cache"]: c["mb_per_s"] for c in doc["storage"]["sequential"]["cells"]}
    out["resident_after_drop"] = doc["storage"]["page_cache"]["resident_after_drop"]
    out["resident_before_warm"] = doc["storage"]["page_cache"]["resident_before_warm"]
    return out


def run_fio(path: str, size: int, block: int, threads: int, duration: float, cold: bool) -> float:
    region = size // threads
    cmd = ["fio", "--name=seq", f"--filename={path}", "--rw=read", f"--bs={block}",
           f"--numjobs={threads}", f"--size={region}", f"--offset_increment={region}",
           "--ioengine=psync", "--direct=0", f"--invalidate={1 if cold else 0}",
           f"--runtime={duration}", "--thread", "--group_reporting", "--output-format=json",
           "--clocksource=clock_gettime", "--iomem_align=4096"]
    if not cold:
        cmd.append("--time_based")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration * 10 + 120)
    if r.returncode != 0:
        raise RuntimeError(f"fio failed: {r.stderr[-2000:]}")
    text = r.stdout[r.stdout.index("{"):]  # fio may print notes before the JSON
    job = json.loads(text)["jobs"][0]
    return job["read"]["bw_bytes"] / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=2 << 30)
    ap.add_argument("--blocks", default="1MiB,16MiB")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--name", default="probe_fio", help="results/NAME.json")
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds between dropping the pages and a cold run")
    a = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (Debian: apt-get install fio); nothing to compare",
              file=sys.stderr)
        return 1
    blocks = [parse_size(b) for b in a.blocks.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    tmp = tempfile.mkdtemp(prefix="feedpipe-bench-probe-fio-", dir=a.dir)
    path = os.path.join(tmp, "data.bin")
    runs: list[dict[str, Any]] = []
    try:
        gen = generate_file(path, a.size)
        print(f"generated {a.size:,} bytes at {gen['mb_per_s']:.0f} MB/s in {path}")
        for block in blocks:
            for nthreads in threads:
                for p in range(a.passes):
                    for tool in common.alternating(["fio", "probe"], p):
                        drop_and_settle(path, a.settle)
                        t0 = time.perf_counter()
                        if tool == "fio":
                            cold = run_fio(path, a.size, block, nthreads, a.duration, cold=True)
                            common.warm_files([path])
                            warm = run_fio(path, a.size, block, nthreads, a.duration, cold=False)
                            res: dict[str, Any] = {"cold": cold, "warm": warm}
                        else:
                            res = run_probe(path, block, nthreads, a.duration)
                        res.update(tool=tool, block_bytes=block, threads=nthreads, pass_=p,
                                   wall_s=round(time.perf_counter() - t0, 2))
                        runs.append(res)
                        print(f"  pass {p} {tool:5} bs={block >> 10:>6} KiB threads={nthreads:>2}"
                              f"  cold {res['cold']:8.0f} MB/s  warm {res['warm']:8.0f} MB/s",
                              flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = []
    rows = []
    for block in blocks:
        for nthreads in threads:
            mine = [r for r in runs if r["block_bytes"] == block and r["threads"] == nthreads]
            entry: dict[str, Any] = {"block_bytes": block, "threads": nthreads}
            for cache in ("cold", "warm"):
                fio = common.median(r[cache] for r in mine if r["tool"] == "fio")
                prb = common.median(r[cache] for r in mine if r["tool"] == "probe")
                diff = 100 * (prb - fio) / fio if fio and prb else None
                entry[cache] = {"fio_mb_per_s": fio, "probe_mb_per_s": prb,
                                "diff_pct_of_fio": diff,
                                "within_15pct": diff is not None and abs(diff) <= 15,
                                "fio_spread": common.spread(
                                    r[cache] for r in mine if r["tool"] == "fio"),
                                "probe_spread": common.spread(
                                    r[cache] for r in mine if r["tool"] == "probe")}
                rows.append([f"{block >> 10} KiB x {nthreads}", cache, common.fmt(fio),
                             common.fmt(prb), common.fmt(diff, 1)])
            summary.append(entry)
    doc = {"benchmark": "bench_probe_fio", "environment": common.environment(a.dir),
           "fio_version": common._cmd_first_line(["fio", "--version"]),
           "settings": {"size_bytes": a.size, "blocks": blocks, "threads": threads,
                        "duration_s": a.duration, "passes": a.passes, "dir": a.dir,
                        "settle_s": a.settle,
                        "fio_options": "--rw=read --ioengine=psync --thread --group_reporting "
                                       "--clocksource=clock_gettime --iomem_align=4096; cold: "
                                       "--invalidate=1; warm: --invalidate=0 --time_based"},
           "summary": summary, "runs": runs}
    out = common.write_results(a.name, doc)
    render_results.render(out, force=True)  # the Markdown and chart beside it
    print()
    print(common.table(rows, ["block x threads", "cache", "fio MB/s", "probe MB/s",
                              "diff % of fio"]))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
