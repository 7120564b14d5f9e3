"""Listing a big source tree: one process (``sources.list_tree``) vs the parallel streamed listing
(``listing.list_tree_parallel``) with 1 and 2 workers.

Source: ``--files`` files of 16 bytes in ``--dirs`` top-level directories (two levels deep),
created once; every system-pass runs in a fresh interpreter, the directory entries warm in the
dentry cache (one untimed walk first). Reported per system: median files/s and the parent's peak
RSS growth while it lists and walks every sample once (``list_tree`` builds all samples in memory;
the streamed listing holds chunk counts and one sample at a time).

Usage::

    python benchmarks/bench_listing.py [--files 300000] [--dirs 64] [--passes 3] [--quick]

Writes ``benchmarks/results/bench_listing.json`` (``bench_listing-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SYSTEMS = ("list_tree", "parallel-w1", "parallel-w2")


def _rss_kb() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def worker(spec: dict[str, Any]) -> int:
    from feedpipe.convert._listing import list_tree_parallel
    from feedpipe.convert._sources import list_tree

    src, system = spec["src"], spec["system"]
    base = _rss_kb()
    peak = base
    t0 = time.perf_counter()
    n = 0
    if system == "list_tree":
        listing = list_tree(src)
        peak = max(peak, _rss_kb())
        for _ in listing.samples:
            n += 1
    else:
        with list_tree_parallel(src, workers=int(system[-1]), show_progress=False) as t:
            for i, _ in enumerate(t):
                n += 1
                if i % 10000 == 0:
                    peak = max(peak, _rss_kb())
    wall = time.perf_counter() - t0
    peak = max(peak, _rss_kb())
    common.emit({"system": system, "wall_s": wall, "samples": n, "files_per_s": n / wall,
                 "rss_growth_mb": (peak - base) / 1024,
                 "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    return 0


def _make(src: str, files: int, dirs: int) -> None:
    tmp = src + ".tmp"
    for i in range(files):
        d = os.path.join(tmp, f"d{i % dirs:04d}", f"s{(i // dirs) % 16:02d}")
        if i < dirs * 16:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:08d}.bin"), "wb") as f:
            f.write(b"%016d" % i)
    os.replace(tmp, src)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=300_000)
    ap.add_argument("--dirs", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20,000 files, 1 pass")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "feedpipe-bench-list"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        return worker(common.load_spec(a.worker))
    if a.quick:
        a.files, a.passes = 20_000, 1
    src = os.path.join(a.root, f"tree-{a.files}x{a.dirs}")
    if not os.path.isdir(src):
        os.makedirs(a.root, exist_ok=True)
        _make(src, a.files, a.dirs)
    for _ in os.walk(src):  # dentries warm
        pass
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    failed = False
    for p in range(a.passes):
        for system in common.alternating(SYSTEMS, p):
            r = common.run_worker(SCRIPT, {"system": system, "src": src})
            if "error" in r:
                print(f"{system}: {r['error']}\n{r.get('stderr_tail', '')}", file=sys.stderr)
                failed = True
                continue
            runs[system].append(r)
            print(f"pass {p} {system}: {r['wall_s']:.2f}s", file=sys.stderr)
    stats = {s: {k: common.median(r[k] for r in runs[s])
                 for k in ("wall_s", "files_per_s", "rss_growth_mb", "maxrss_mb")}
             for s in SYSTEMS}
    base = stats["list_tree"]["files_per_s"]
    for s in SYSTEMS:
        fps = stats[s]["files_per_s"]
        stats[s]["ratio_to_list_tree"] = fps / base if fps and base else None
    doc = {"benchmark": "bench_listing", "environment": common.environment(src),
           "params": {"files": a.files, "dirs": a.dirs, "passes": a.passes},
           "stats": stats, "runs": runs}
    path = common.write_results("bench_listing-quick" if a.quick else "bench_listing", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    rows = [[s, common.fmt(stats[s]["files_per_s"]), common.fmt(stats[s]["wall_s"], 2),
             common.fmt(stats[s]["ratio_to_list_tree"], 2),
             common.fmt(stats[s]["rss_growth_mb"], 1), common.fmt(stats[s]["maxrss_mb"], 1)]
            for s in SYSTEMS]
    print(common.table(rows, ["system", "files/s", "wall s", "x list_tree", "RSS growth MB",
                              "max RSS MB"]))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
