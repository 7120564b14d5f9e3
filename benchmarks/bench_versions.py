"""Two versions of feedpipe side by side on the same shards: the code at a git ref (``--before``,
default ``main``) against the working tree, alternating passes in one run.

Phases, each on the ``images`` dataset (``benchmarks/datasets.py``) sharded once:

- ``read``: raw samples, ``FeedLoader(FeedDataset(shuffle=True), batch_size=256,
  num_workers=2)``, ``--read-epochs`` epochs after one untimed epoch; samples/s.
- ``decode``: ``ImagePipeline(224, mean=None)`` written in place into a
  ``BatchCollator(256, (3, 224, 224))``, ``num_workers=2``, one epoch after a warm-up of a few
  batches; images/s.

Each pass is a fresh interpreter importing feedpipe from the version's tree (``PYTHONPATH``);
peak RSS is summed over the process tree (``peer_memory.PeakMemory``). Within a pass the two
versions run back to back, so a pass's ratio sees the same machine load; the bar is on the median
of the per-pass ratios: the working tree at >= 0.9x the ref's rate, and peak RSS at <= 1.1x, in
every phase.

Usage::

    python benchmarks/bench_versions.py [--before main] [--root DIR] [--passes 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import render_results
from common import (
    REPO,
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

PHASES = ("read", "decode")
BATCH = 256


def worker(spec: dict[str, Any]) -> None:
    from peer_memory import PeakMemory

    import feedpipe

    try:
        from feedpipe import BatchCollator, ImagePipeline
    except ImportError:  # a tree from before these names were exported (the flat layout)
        from feedpipe.collator import BatchCollator
        from feedpipe.transforms import ImagePipeline

    root, phase = spec["shards"], spec["phase"]
    with PeakMemory() as mem:
        if phase == "read":
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0)
            fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2)
            fl.set_epoch(0)
            for _ in fl:  # untimed: maps, indexes, page cache
                pass
            n = 0
            t0 = time.perf_counter()
            for e in range(1, spec["epochs"] + 1):
                fl.set_epoch(e)
                for b in fl:
                    n += len(b["__key__"])
            dt = time.perf_counter() - t0
        else:
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0,
                                      transform=ImagePipeline(224, mean=None))
            fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2,
                                     collate_fn=BatchCollator(BATCH, (3, 224, 224)))
            fl.set_epoch(0)
            it = iter(fl)
            n = 0
            for _ in range(4):  # warm-up: workers started, first batches made
                n += len(next(it)[0])
            n = 0
            t0 = time.perf_counter()
            for images, _labels in it:
                n += len(images)
            dt = time.perf_counter() - t0
    emit({"samples": n, "seconds": dt, "rate": n / dt, "feedpipe": feedpipe.__file__,
          **mem.result()})


def tree_of(ref: str, where: str) -> str:
    """A checkout of ``ref`` under ``where`` (a git worktree), with the C extension built."""
    path = os.path.join(where, "before")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-f", path, ref],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path,
                   check=False, capture_output=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--before", default="main", help="git ref of the code to compare with")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "feedpipe-bench"),
                    help="where the datasets are generated and sharded")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--read-epochs", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the small dataset, 2 passes")
    ap.add_argument("--name", default="bench_versions")
    a = ap.parse_args(argv)
    if a.worker:
        worker(load_spec(a.worker))
        return 0
    import datasets

    import feedpipe

    src = datasets.ensure("images", root=a.root, quick=a.quick)["src"]
    shards = os.path.join(os.path.dirname(src), "feedpipe-versions-labels")
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        shutil.rmtree(shards, ignore_errors=True)
        feedpipe.shard(src, shards, max_bytes=64 << 20, workers=2, labels_from_dirs=True,
                       show_progress=False)
    passes = 2 if a.quick else a.passes
    scratch = tempfile.mkdtemp(prefix="bench-versions-")
    before = tree_of(a.before, scratch)
    trees = {"before": before, "after": REPO}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    errors = []
    t_start = time.perf_counter()
    try:
        for p in range(passes):
            for phase in a.phases.split(","):
                for version in alternating(list(trees), p):
                    os.environ["PYTHONPATH"] = trees[version]
                    r = run_worker(__file__, {"shards": shards, "phase": phase,
                                              "epochs": a.read_epochs})
                    if "error" in r:
                        errors.append(f"{phase} {version}: {r['error']}\n{r.get('stderr_tail')}")
                        print(errors[-1], file=sys.stderr)
                        continue
                    runs.setdefault((phase, version), []).append(r)
                    print(f"pass {p} {phase:6s} {version:6s} {r['rate']:>10,.0f}/s "
                          f"peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB", flush=True)
    finally:
        os.environ.pop("PYTHONPATH", None)
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", before],
                       check=False, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    rows, summary, bars = [], {}, {}
    for phase in a.phases.split(","):
        med = {v: median(r["rate"] for r in runs.get((phase, v), [])) for v in trees}
        rss = {v: median(r["peak_rss_bytes"] for r in runs.get((phase, v), [])) for v in trees}
        pairs = list(zip(runs.get((phase, "before"), []), runs.get((phase, "after"), [])))
        speed = median(a["rate"] / b["rate"] for b, a in pairs)
        mem = median(a["peak_rss_bytes"] / b["peak_rss_bytes"] for b, a in pairs)
        ok = speed is not None and mem is not None and speed >= 0.9 and mem <= 1.1
        bars[phase] = {"speed_ratio": speed, "rss_ratio": mem, "met": ok,
                       "pass_ratios": [a["rate"] / b["rate"] for b, a in pairs]}
        summary[phase] = {v: {"median_rate": med[v], "median_peak_rss_bytes": rss[v],
                              "spread": spread(r["rate"] for r in runs.get((phase, v), []))}
                          for v in trees}
        rows.append([phase, fmt(med["before"]), fmt(med["after"]), fmt(speed, 3),
                     fmt((rss["before"] or 0) / 1e6), fmt((rss["after"] or 0) / 1e6),
                     fmt(mem, 3), "met" if ok else "NOT MET"])
    text = table(rows, ["phase", f"{a.before} /s", "tree /s", "pass ratio", f"{a.before} MB",
                        "tree MB", "RSS ratio", "bar"])
    print(text)
    command = "python benchmarks/bench_versions.py " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    env = environment(shards)
    doc = {"benchmark": "bench_versions", "command": command.strip(), "before": a.before,
           "passes": passes,
           "environment": env, "summary": summary, "bars": bars,
           "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}, "errors": errors,
           "elapsed_seconds": time.perf_counter() - t_start}
    path = write_results(a.name, doc)
    with open(path[:-5] + ".md", "w", encoding="utf-8") as f:
        git = env.get("git") or {}
        f.write(f"# {a.before} against the working tree ({passes} alternating passes)\n\n")
        f.write(f"`{command.strip()}`, {env.get('date_utc', '?')}, working tree at "
                f"{str(git.get('revision', '?'))[:7]}{' (dirty)' if git.get('dirty') else ''}, "
                f"{env.get('cpu_count', '?')} cores, load average at the start "
                f"{env.get('loadavg_at_start', '?')}.\n\n")
        f.write("```\n" + text + "\n```\n\n")
        f.write("Bar: the median of the per-pass ratios, >= 0.9x the rate and <= 1.1x the peak "
                "RSS of the ref, in every phase.\n")
    render_results.render(path, force=True, parts=("png",))  # the chart beside them
    print(f"results written to {path}")
    return 1 if errors or not all(b["met"] for b in bars.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
