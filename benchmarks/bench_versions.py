"""Two versions of feedpipe side by side on the same shards: the code at a git ref (``--before``,
default ``main``) against the working tree, alternating passes in one run.

Phases (datasets from ``benchmarks/datasets.py``, sharded once by the working tree):

- ``direct``: ``FeedDataset(shuffle=True)`` of ``images`` iterated directly, the plain
  DataLoader way (sample dicts, one process), every field's length and first byte read;
  ``--read-epochs`` epochs after one untimed; samples/s.
- ``read``: raw samples of ``images``, ``FeedLoader(batch_size=256, num_workers=2)``,
  ``--read-epochs`` epochs after one untimed; samples/s.
- ``read-tiny``: the same on ``tiny`` (1 KiB records), 2 epochs after one untimed.
- ``decode``: full-size JPEGs (``photos``, 400-640 px) through ``ImagePipeline(224,
  mean=None)`` written in place into a ``BatchCollator(256, (3, 224, 224))``,
  ``num_workers=2``, two epochs after a warm-up batch; images/s.
- ``decode-small``: the small JPEGs of ``images`` (160-320 px) through ``ImagePipeline(224,
  train=False)`` (normalised ``float32``) into a ``BatchCollator(128, pipe.out_shape,
  pipe.out_dtype)``, ``num_workers=2`` (the ``rows-workers`` route), one epoch after a
  warm-up batch: where a batch's own overhead is not hidden by decoding.
- ``transform``: the ``samples`` route with a Python transform (``num_workers=0``, batches of
  256, a function of each sample's bytes and label), 2 epochs after one untimed; samples/s.
- ``convert`` / ``convert-tiny``: ``feedpipe.shard`` of the ``images`` / ``tiny`` source trees
  with 2 workers into a fresh directory; source files/s.
- ``mixture``: a ``Mixture`` of three sources (``images``' shards opened three times, seeded
  apart, weights 0.5 / 0.3 / 0.2), raw batches of 256 with ``num_workers=2``,
  ``--read-epochs`` epochs after one untimed; samples/s.
- ``packed``: ``Packed(FeedDataset(tokens, shuffle=True), 2048)`` in batches of 8 rows,
  ``num_workers=0``, over 20,000 int32 token documents of random length (mean 600, written
  once by the working tree), ``--read-epochs`` epochs after one untimed; tokens/s.
  ``mixture`` and ``packed`` are left out, said on stderr and in the JSON's ``skipped``, when
  the ``--before`` ref has no ``Mixture`` / ``Packed`` (b174a8c has neither).
- ``ledger`` / ``ledger-0``: what ``FeedLoader(ledger=DIR)`` costs. Not two versions: the
  working tree's ``read`` phase (``ledger-0``: the same with ``num_workers=0``) without a ledger
  (the ``before`` column) against the same with a fresh ledger directory (the ``tree`` column),
  alternating like the others. Its bar is the ledger's, >= 0.99x, on the ratio of CPU seconds
  (main process and workers) for the same samples: the ledger adds work, never waiting, and on a
  shared machine wall time swings with the neighbours' load far more than 1%. Not in the
  default phases.
- ``convert-parquet``: ``feedpipe.shard`` of a Parquet file written by pandas (``--parquet-rows``
  rows of a short text, an integer label and a float; one row group) with 1 worker (a ref's
  pool may decode the whole row group once per part); rows/s. Not in the default phases: a ref
  from before Parquet conversion cannot run it.

Each pass is a fresh interpreter importing feedpipe from the version's tree (``PYTHONPATH``);
peak RSS is summed over the process tree (``peer_memory.PeakMemory``). Within a pass the two
versions run back to back, so a pass's ratio sees the same machine load; the bar is on the median
of the per-pass ratios: the working tree at >= 0.97x the ref's rate, and peak RSS at <= 1.1x, in
every phase. The table gives the per-pass ratios' spread beside the median.

Every pass also records the CPU seconds of its timed part (``_cpu_seconds``: the process and its
ended children, the loader's workers and the converter's pool), and a second table gives, per
phase, the ratio of the ref's CPU seconds per sample to the tree's (>= 1: the tree spends no more
CPU for the same work). On a loaded machine wall time swings with the neighbours' load far more
than 3%, CPU time much less: ``--bar cpu`` holds the speed bar on the CPU ratio instead of the
rate ratio.

Usage::

    python benchmarks/bench_versions.py [--before main] [--root DIR] [--passes 5] [--quick]
        [--phases direct,read,...] [--bar wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import resource
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

PHASES = ("direct", "read", "read-tiny", "decode", "decode-small", "transform", "convert",
          "convert-tiny", "mixture", "packed")
# phases of public names younger than some refs: a ref without the name has nothing to compare
NEEDS = {"mixture": "Mixture", "packed": "Packed"}
MIX_WEIGHTS = {"web": 0.5, "books": 0.3, "code": 0.2}
SEQ_LEN, PACKED_BATCH = 2048, 8
SAME_TREE = ("ledger", "ledger-0")  # the working tree without and with a ledger
BATCH = 256
SPEED_BAR, RSS_BAR = 0.97, 1.1
BARS = {"ledger": 0.99, "ledger-0": 0.99}  # the ledger may cost 1% of the raw-read route


def label_and_size(sample: dict[str, Any]) -> tuple[int, int]:
    """The ``transform`` phase's Python transform: a little work on each sample's bytes."""
    return len(sample["jpg"]), int(bytes(sample["cls"]))


def _names() -> tuple[Any, Any]:
    try:
        from feedpipe import BatchCollator, ImagePipeline
    except ImportError:  # a tree from before these names were exported (the flat layout)
        from feedpipe.collator import BatchCollator
        from feedpipe.transforms import ImagePipeline
    return BatchCollator, ImagePipeline


def _timed() -> Any:
    """A clock started now: calling it gives ``(wall seconds, CPU seconds)`` since."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    return lambda: (time.perf_counter() - t0, _cpu_seconds() - c0)


def _epochs(fl: Any, epochs: int, count: Any) -> tuple[int, float, float]:
    """One untimed epoch (maps, indexes, page cache, workers), then ``epochs`` timed ones."""
    fl.set_epoch(0)
    for _ in fl:
        pass
    n = 0
    clock = _timed()
    for e in range(1, epochs + 1):
        fl.set_epoch(e)
        for b in fl:
            n += count(b)
    return (n, *clock())


def _decode(fl: Any, epochs: int) -> tuple[int, float, float]:
    """Images/s after a warm-up batch (workers started), to the end of ``epochs`` epochs."""
    fl.set_epoch(0)
    it = iter(fl)
    next(it)
    n = 0
    clock = _timed()
    for e in range(epochs):
        if e:
            fl.set_epoch(e)
            it = iter(fl)
        for images, _labels in it:
            n += len(images)
    del it  # the last epoch's workers end, so that their CPU seconds are counted
    return (n, *clock())


def _direct(ds: Any, epochs: int) -> tuple[int, float, float]:
    def epoch(e: int) -> int:
        ds.set_epoch(e)
        k = seen = 0
        for s in ds:
            for v in s.values():
                if type(v) is memoryview and len(v):
                    seen += v[0]  # the field's first byte read
            k += 1
        return k

    epoch(0)
    n = 0
    clock = _timed()
    for e in range(1, epochs + 1):
        n += epoch(e)
    return (n, *clock())


def worker(spec: dict[str, Any]) -> None:
    from peer_memory import PeakMemory

    import feedpipe

    BatchCollator, ImagePipeline = _names()
    phase, root = spec["phase"], spec["shards"]
    with PeakMemory() as mem:
        if phase == "direct":
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0)
            n, dt, cpu = _direct(ds, spec["epochs"])
        elif phase in ("read", "read-tiny"):
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0)
            fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2)
            n, dt, cpu = _epochs(fl, spec["epochs"] if phase == "read" else 2,
                                 lambda b: len(b["__key__"]))
        elif phase in SAME_TREE:
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0)
            ledger = tempfile.mkdtemp(prefix="bench-versions-ledger-") if spec["ledger"] else None
            spent = _attributed()
            fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2 if phase == "ledger"
                                     else 0, ledger=ledger)
            fl.set_epoch(0)
            for _ in fl:  # untimed: maps, indexes, page cache, first imports
                pass
            spent.update(dict.fromkeys(spent, 0.0))
            cpu, n, t0 = _cpu_seconds(), 0, time.perf_counter()
            for e in range(1, spec["epochs"] + 1):
                fl.set_epoch(e)
                for b in fl:
                    n += len(b["__key__"])
            dt, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu
            if fl.route.name != "refs":  # the attribution sees the training process only
                spent = {}
            if ledger is not None:
                shutil.rmtree(ledger, ignore_errors=True)
        elif phase == "mixture":  # three sources (one shard set, seeded apart), raw batches
            mix = feedpipe.Mixture({name: feedpipe.FeedDataset(root, shuffle=True, seed=i)
                                    for i, name in enumerate(MIX_WEIGHTS)}, MIX_WEIGHTS)
            fl = feedpipe.FeedLoader(mix, batch_size=BATCH, num_workers=2)
            n, dt, cpu = _epochs(fl, spec["epochs"], lambda b: len(b["__key__"]))
        elif phase == "packed":  # token documents packed to rows; the rate counts tokens
            packed = feedpipe.Packed(feedpipe.FeedDataset(root, shuffle=True, seed=0), SEQ_LEN)
            fl = feedpipe.FeedLoader(packed, batch_size=PACKED_BATCH)
            n, dt, cpu = _epochs(fl, spec["epochs"], lambda b: int(b["input_ids"].numel()))
        elif phase == "decode":
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0,
                                      transform=ImagePipeline(224, mean=None))
            fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2,
                                     collate_fn=BatchCollator(BATCH, (3, 224, 224)))
            n, dt, cpu = _decode(fl, 2)
        elif phase == "decode-small":
            pipe = ImagePipeline(224, train=False)
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0, transform=pipe)
            fl = feedpipe.FeedLoader(ds, batch_size=128, num_workers=2,
                                     collate_fn=BatchCollator(128, pipe.out_shape,
                                                              pipe.out_dtype))
            n, dt, cpu = _decode(fl, 1)
        elif phase == "transform":
            ds = feedpipe.FeedDataset(root, shuffle=True, seed=0, transform=label_and_size)
            fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=0)
            n, dt, cpu = _epochs(fl, 2, lambda b: len(b[0]))  # (sizes, labels)
        else:  # convert, convert-tiny
            out = tempfile.mkdtemp(prefix="bench-versions-out-")
            shutil.rmtree(out)
            clock = _timed()
            feedpipe.shard(spec["src"], out, max_bytes=64 << 20,
                           workers=1 if phase == "convert-parquet" else 2,
                           labels_from_dirs=phase == "convert", show_progress=False)
            dt, cpu = clock()
            n = spec["files"]
            shutil.rmtree(out, ignore_errors=True)
    route = getattr(locals().get("fl"), "route", None)
    extra = {f"{k}_cpu_seconds": v for k, v in spent.items()} if phase in SAME_TREE else {}
    emit({"samples": n, "seconds": dt, "rate": n / dt, "cpu_seconds": cpu,
          "feedpipe": feedpipe.__file__,
          "route": route if isinstance(route, str) else None, **extra, **mem.result()})


def _attributed() -> dict[str, float]:
    """CPU seconds of this thread spent in the ledger's methods (``ledger``) and in io counting
    (``io``: the tally's reads and what its counted fetch adds around the fetch), filled in as
    the pass runs: their share of the pass's CPU seconds, measured in the same process at the
    same moments, resolves a cost of 1% that A/B passes on a shared machine cannot. The timing
    calls themselves are counted in, so the shares are upper bounds."""
    from feedpipe.stream import _io, _ledger

    spent = {"ledger": 0.0, "io": 0.0}
    clock = time.thread_time

    def timed(cls: Any, name: str, key: str) -> None:
        real = getattr(cls, name)

        def run(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return real(*a, **k)
            finally:
                spent[key] += clock() - t
        setattr(cls, name, run)

    for name in ("begin", "batch", "mark", "finish", "end"):
        timed(_ledger.Ledger, name, "ledger")
    for name in ("__init__", "take"):
        timed(_io.IoTally, name, "io")
    counted = _io.IoTally.counted

    def counting(self: Any, fetch: Any) -> Any:
        def inner(ids: Any) -> Any:
            t = clock()
            try:
                return fetch(ids)
            finally:
                spent["io"] -= clock() - t  # the fetch itself is not the counting's

        wrapped = counted(self, inner)
        if wrapped is inner:
            return fetch

        def outer(ids: Any) -> Any:
            t = clock()
            try:
                return wrapped(ids)
            finally:
                spent["io"] += clock() - t
        return outer

    _io.IoTally.counted = counting  # type: ignore[method-assign]
    return spent


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (the loader's workers end with
    each epoch): on a shared machine wall time swings with the neighbours' load, CPU time much
    less, and the work a ledger adds shows in it."""
    own = time.process_time()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own + kids.ru_utime + kids.ru_stime


def _parquet(root: str, rows: int) -> dict[str, Any]:
    """The convert-parquet phase's table, written by pandas once (small fields: where the
    per-row cost, not the bytes, is the limit)."""
    path = os.path.join(root, "parquet", f"rows-{rows}.parquet")
    if not os.path.exists(path):
        import numpy as np
        import pandas as pd

        rng = np.random.default_rng(0)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pd.DataFrame({"text": [f"row {i} " + "x" * int(n)
                               for i, n in enumerate(rng.integers(20, 60, rows))],
                      "label": rng.integers(0, 10, rows), "score": rng.random(rows)}
                     ).to_parquet(path + ".tmp")
        os.replace(path + ".tmp", path)
    return {"src": path, "shards": os.path.dirname(path), "files": rows}


def _tokens(root: str, docs: int) -> dict[str, Any]:
    """The packed phase's corpus: ``docs`` int32 token documents of random length (mean 600,
    seed 0) as ``tokens.npy`` fields, written once by the working tree."""
    out = os.path.join(root, "tokens", f"docs-{docs}")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        import numpy as np

        import feedpipe

        rng = np.random.default_rng(0)
        lengths = rng.integers(16, 1200, size=docs)
        shutil.rmtree(out, ignore_errors=True)
        feedpipe.write_samples(
            ({"__key__": f"d{i:07d}",
              "tokens.npy": rng.integers(0, 50_000, size=int(k), dtype=np.int32)}
             for i, k in enumerate(lengths)), out, max_samples=max(1, docs // 8))
    return {"src": out, "shards": out, "files": docs}


def has_name(ref: str, name: str) -> bool:
    """Whether ``ref``'s public API exports ``name`` (read from its ``feedpipe/__init__.py``)."""
    r = subprocess.run(["git", "-C", REPO, "show", f"{ref}:feedpipe/__init__.py"],
                       capture_output=True, text=True, check=False)
    return f'"{name}"' in r.stdout


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
    ap.add_argument("--passes", type=int, default=None, help="alternating passes (5; quick 2)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--read-epochs", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="the small dataset (and 2 passes unless --passes)")
    ap.add_argument("--name", default="bench_versions")
    ap.add_argument("--bar", choices=("wall", "cpu"), default="wall",
                    help="hold the speed bar on the rate ratio (wall) or the CPU-seconds ratio "
                    "(cpu: for a loaded machine); both are reported")
    ap.add_argument("--parquet-rows", type=int, default=200_000,
                    help="rows of the convert-parquet phase's table")
    a = ap.parse_args(argv)
    if a.worker:
        worker(load_spec(a.worker))
        return 0
    import datasets

    import feedpipe

    phases = a.phases.split(",")
    skipped = {p: f"{a.before} has no feedpipe.{NEEDS[p]}" for p in phases
               if p in NEEDS and not has_name(a.before, NEEDS[p])}
    for p, why in skipped.items():
        print(f"phase {p} left out: {why} (compare with a later --before)", file=sys.stderr)
    phases = [p for p in phases if p not in skipped]
    if not phases:
        print("no phase left to compare", file=sys.stderr)
        return 1
    data = {}
    for name, labels in (("images", True), ("tiny", False), ("photos", True)):
        info = datasets.ensure(name, root=a.root, quick=a.quick)
        shards = os.path.join(os.path.dirname(info["src"]), "feedpipe-versions"
                              + ("-labels" if labels else ""))
        if not os.path.exists(os.path.join(shards, "manifest.json")):
            shutil.rmtree(shards, ignore_errors=True)
            feedpipe.shard(info["src"], shards, max_bytes=64 << 20, workers=2,
                           labels_from_dirs=labels, show_progress=False)
        data[name] = {"src": info["src"], "shards": shards, "files": info["files"]}
    if "convert-parquet" in phases:
        data["parquet"] = _parquet(a.root, a.parquet_rows)
    if "packed" in phases:
        data["tokens"] = _tokens(a.root, 2000 if a.quick else 20_000)
    of_phase = {"direct": "images", "read": "images", "read-tiny": "tiny", "decode": "photos",
                "decode-small": "images", "transform": "images", "convert": "images",
                "convert-tiny": "tiny", "convert-parquet": "parquet", "ledger": "images",
                "ledger-0": "images", "mixture": "images", "packed": "tokens"}
    passes = a.passes or (2 if a.quick else 5)
    scratch = tempfile.mkdtemp(prefix="bench-versions-")
    # phases that compare the working tree with itself need no checkout of the ref
    before = REPO if all(p in SAME_TREE for p in phases) else tree_of(a.before, scratch)
    trees = {"before": before, "after": REPO}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    errors = []
    t_start = time.perf_counter()
    try:
        for p in range(passes):
            for phase in phases:
                for version in alternating(list(trees), p):
                    same = phase in SAME_TREE
                    os.environ["PYTHONPATH"] = REPO if same else trees[version]
                    r = run_worker(__file__, {**data[of_phase[phase]], "phase": phase,
                                              "epochs": a.read_epochs,
                                              "ledger": same and version == "after"})
                    if "error" in r:
                        errors.append(f"{phase} {version}: {r['error']}\n{r.get('stderr_tail')}")
                        print(errors[-1], file=sys.stderr)
                        continue
                    runs.setdefault((phase, version), []).append(r)
                    print(f"pass {p} {phase:12s} {version:6s} {r['rate']:>10,.0f}/s "
                          f"peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB", flush=True)
    finally:
        os.environ.pop("PYTHONPATH", None)
        if before != REPO:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", before],
                           check=False, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    rows, summary = [], {}
    bars: dict[str, dict[str, Any]] = {}
    cpu_rows: list[str] = []
    cpu_table: list[list[str]] = []
    for phase in phases:
        med = {v: median(r["rate"] for r in runs.get((phase, v), [])) for v in trees}
        rss = {v: median(r["peak_rss_bytes"] for r in runs.get((phase, v), [])) for v in trees}
        pairs = list(zip(runs.get((phase, "before"), []), runs.get((phase, "after"), [])))
        ratios = [a["rate"] / b["rate"] for b, a in pairs]
        speed = median(ratios)
        mem = median(a["peak_rss_bytes"] / b["peak_rss_bytes"] for b, a in pairs)
        bar = BARS.get(phase, SPEED_BAR)
        # CPU seconds per sample, the ref's over the tree's (a passes' counts may differ a little)
        cpu_ratios = [(b["cpu_seconds"] / b["samples"]) / (a["cpu_seconds"] / a["samples"])
                      for b, a in pairs if a.get("cpu_seconds") and b.get("cpu_seconds")]
        cpu = median(cpu_ratios)
        held = cpu if a.bar == "cpu" else speed
        ok = held is not None and mem is not None and held >= bar and mem <= RSS_BAR
        if phase not in SAME_TREE:
            lo_hi_cpu = spread(cpu_ratios)
            cpu_table.append([phase, fmt(cpu, 3), "-" if lo_hi_cpu is None
                              else f"{lo_hi_cpu[0]:.2f}-{lo_hi_cpu[1]:.2f}",
                              " ".join(f"{r:.3f}" for r in cpu_ratios),
                              "met" if cpu is not None and cpu >= bar else "NOT MET"])
        if phase in SAME_TREE:  # the ledger's cost: CPU seconds per sample (see _cpu_seconds)
            runs_of = {v: runs.get((phase, v), []) for v in trees}
            ok = cpu is not None and mem is not None and cpu >= bar and mem <= RSS_BAR
            cpu_rows.append(f"{phase}: CPU-time ratio {fmt(cpu, 4)} (per pass "
                            f"{' '.join(f'{r:.3f}' for r in cpu_ratios)}); wall-time ratio "
                            f"{fmt(speed, 4)} (per pass {' '.join(f'{r:.3f}' for r in ratios)})")
            shares = {k: [r[f"{k}_cpu_seconds"] / r["cpu_seconds"] for r in runs_of[v]
                          if f"{k}_cpu_seconds" in r]
                      for k, v in (("ledger", "after"), ("io", "before"))}
            share = {k: median(v) for k, v in shares.items()}
            ok = ok or (share["ledger"] is not None and share["ledger"] <= 1 - bar
                        and mem is not None and mem <= RSS_BAR)
            for k, v in shares.items():
                if v:
                    cpu_rows.append(f"{phase}: {k} share of the pass's CPU seconds, median "
                                    f"{100 * (share[k] or 0):.3f}% (per pass "
                                    f"{' '.join(f'{100 * x:.3f}' for x in v)})")
            bars[phase] = {"ledger_share": share["ledger"], "io_share": share["io"],
                           "ledger_pass_shares": shares["ledger"], "io_pass_shares": shares["io"]}
        bars[phase] = {**bars.get(phase, {}), "speed_ratio": speed, "rss_ratio": mem, "met": ok,
                       "speed_bar": bar, "cpu_ratio": cpu, "cpu_pass_ratios": cpu_ratios,
                       "bar_on": "cpu" if phase in SAME_TREE else a.bar,
                       "pass_ratios": ratios,
                       "routes": sorted({str(r.get("route")) for r in runs.get((phase, "after"),
                                                                                 [])})}
        summary[phase] = {v: {"median_rate": med[v], "median_peak_rss_bytes": rss[v],
                              "spread": spread(r["rate"] for r in runs.get((phase, v), []))}
                          for v in trees}
        lo_hi = spread(ratios)
        rows.append([phase, fmt(med["before"]), fmt(med["after"]), fmt(speed, 3),
                     "-" if lo_hi is None else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}",
                     fmt((rss["before"] or 0) / 1e6), fmt((rss["after"] or 0) / 1e6),
                     fmt(mem, 3), "met" if ok else "NOT MET"])
    text = table(rows, ["phase", f"{a.before} /s", "tree /s", "pass ratio", "per pass",
                        f"{a.before} MB", "tree MB", "RSS ratio", "bar"])
    cpu_text = table(cpu_table, ["phase", f"CPU ratio ({a.before}/tree)", "per pass",
                                 "pass ratios", f"bar {SPEED_BAR}"]) if cpu_table else ""
    print(text)
    print(cpu_text)
    print("\n".join(cpu_rows))
    command = "python benchmarks/bench_versions.py " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    env = environment(data[of_phase[phases[0]]]["shards"])
    doc = {"benchmark": "bench_versions", "command": command.strip(), "before": a.before,
           "passes": passes,
           "environment": env, "summary": summary, "bars": bars,
           "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}, "errors": errors,
           "skipped": skipped,
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
        if cpu_text:
            f.write("CPU seconds per sample of the timed part (process and ended children), the "
                    "ref's over the tree's, per pass and their median:\n\n```\n" + cpu_text
                    + "\n```\n\n")
        f.write(f"Bar: the median of the per-pass ratios, >= {SPEED_BAR}x the "
                f"{'rate' if a.bar == 'wall' else 'CPU seconds per sample (--bar cpu)'} and "
                f"<= {RSS_BAR}x the peak RSS of the ref, in every phase; 'per pass': the lowest "
                "and highest per-pass ratio.\n")
        if any(p in SAME_TREE for p in phases):
            f.write(f"\n{', '.join(p for p in phases if p in SAME_TREE)}: both columns are the "
                    "working tree, the first without, the second with FeedLoader(ledger=DIR); "
                    f"bar: the median of the per-pass ratios of CPU seconds (without / with, "
                    f"main process and workers, the same samples) >= {BARS['ledger']}x, or the "
                    "median share of the pass's CPU seconds spent in the ledger's methods <= "
                    f"{100 * (1 - BARS['ledger']):.0f}% (measured in the pass with the ledger; "
                    "io: the share of io counting, in the pass without it):\n\n")
            f.write("".join(f"- {r}\n" for r in cpu_rows))
    render_results.render(path, force=True, parts=("png",))  # the chart beside them
    print(f"results written to {path}")
    return 1 if errors or not all(b["met"] for b in bars.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
