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

``--counter instructions`` runs no timed passes: each version runs every phase once, in one
interpreter under valgrind's callgrind, and the table gives instructions per sample of each
phase's timed part (the process and the worker processes that start and end inside it), the ref's
over the tree's. Counts hardly move with the machine's load; they see no cache misses, page
faults, I/O or waiting, so they stand beside the CPU-time ratio, never for it (versions_count.py).

Usage::

    python benchmarks/bench_versions.py [--before main] [--root DIR] [--passes 5] [--quick]
        [--phases direct,read,...] [--bar wall|cpu] [--counter time|instructions]
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
import versions_count
import versions_data
import versions_report
from common import REPO, alternating, emit, environment, load_spec, run_worker, write_results
from versions_report import SAME_TREE, Runs

PHASES = ("direct", "read", "read-tiny", "decode", "decode-small", "transform", "convert",
          "convert-tiny", "mixture", "packed")
# phases of public names younger than some refs: a ref without the name has nothing to compare
NEEDS = {"mixture": "Mixture", "packed": "Packed"}
MIX_WEIGHTS = {"web": 0.5, "books": 0.3, "code": 0.2}
SEQ_LEN, PACKED_BATCH = 2048, 8
BATCH = 256


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


MARKS: list[Any] = []  # called with "start" / "end" around each timed part (versions_count)


def _timed() -> Any:
    """A clock started now: calling it gives ``(wall seconds, CPU seconds)`` since."""
    for mark in MARKS:
        mark("start")
    t0, c0 = time.perf_counter(), _cpu_seconds()

    def clock() -> tuple[float, float]:
        spent = time.perf_counter() - t0, _cpu_seconds() - c0
        for mark in MARKS:
            mark("end")
        return spent
    return clock


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
    """Images/s after a warm-up batch (workers started), to the end of ``epochs`` epochs. When
    counting instructions the warm-up batch is counted in, so that the workers start inside the
    counted part (versions_count sees a process whole or not at all)."""
    fl.set_epoch(0)
    clock = _timed() if MARKS else None
    it = iter(fl)
    n = len(next(it)[0]) if MARKS else 0
    clock = clock or _timed()
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


def _read(feedpipe: Any, spec: dict[str, Any]) -> Any:
    phase, root = spec["phase"], spec["shards"]
    ds = feedpipe.FeedDataset(root, shuffle=True, seed=0)
    if phase == "direct":
        return (*_direct(ds, spec["epochs"]), None)
    fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2)
    return (*_epochs(fl, spec["epochs"] if phase == "read" else 2,
                     lambda b: len(b["__key__"])), fl)


def _ledger(feedpipe: Any, spec: dict[str, Any]) -> Any:
    ds = feedpipe.FeedDataset(spec["shards"], shuffle=True, seed=0)
    ledger = tempfile.mkdtemp(prefix="bench-versions-ledger-") if spec["ledger"] else None
    spent = _attributed()
    fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2 if spec["phase"] == "ledger"
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
    return n, dt, cpu, fl, {f"{k}_cpu_seconds": v for k, v in spent.items()}


def _mixture(feedpipe: Any, spec: dict[str, Any]) -> Any:
    """Three sources (one shard set, seeded apart), raw batches."""
    mix = feedpipe.Mixture({name: feedpipe.FeedDataset(spec["shards"], shuffle=True, seed=i)
                            for i, name in enumerate(MIX_WEIGHTS)}, MIX_WEIGHTS)
    fl = feedpipe.FeedLoader(mix, batch_size=BATCH, num_workers=2)
    return (*_epochs(fl, spec["epochs"], lambda b: len(b["__key__"])), fl)


def _packed(feedpipe: Any, spec: dict[str, Any]) -> Any:
    """Token documents packed to rows; the rate counts tokens."""
    packed = feedpipe.Packed(feedpipe.FeedDataset(spec["shards"], shuffle=True, seed=0), SEQ_LEN)
    fl = feedpipe.FeedLoader(packed, batch_size=PACKED_BATCH)
    return (*_epochs(fl, spec["epochs"], lambda b: int(b["input_ids"].numel())), fl)


def _decoding(feedpipe: Any, spec: dict[str, Any]) -> Any:
    BatchCollator, ImagePipeline = _names()
    if spec["phase"] == "decode":
        ds = feedpipe.FeedDataset(spec["shards"], shuffle=True, seed=0,
                                  transform=ImagePipeline(224, mean=None))
        fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=2,
                                 collate_fn=BatchCollator(BATCH, (3, 224, 224)))
        return (*_decode(fl, 2), fl)
    pipe = ImagePipeline(224, train=False)
    ds = feedpipe.FeedDataset(spec["shards"], shuffle=True, seed=0, transform=pipe)
    fl = feedpipe.FeedLoader(ds, batch_size=128, num_workers=2,
                             collate_fn=BatchCollator(128, pipe.out_shape, pipe.out_dtype))
    return (*_decode(fl, 1), fl)


def _transform(feedpipe: Any, spec: dict[str, Any]) -> Any:
    ds = feedpipe.FeedDataset(spec["shards"], shuffle=True, seed=0, transform=label_and_size)
    fl = feedpipe.FeedLoader(ds, batch_size=BATCH, num_workers=0)
    return (*_epochs(fl, 2, lambda b: len(b[0])), fl)  # (sizes, labels)


def _convert(feedpipe: Any, spec: dict[str, Any]) -> Any:
    phase = spec["phase"]
    out = tempfile.mkdtemp(prefix="bench-versions-out-")
    shutil.rmtree(out)
    clock = _timed()
    feedpipe.shard(spec["src"], out, max_bytes=64 << 20,
                   workers=1 if phase == "convert-parquet" else 2,
                   labels_from_dirs=phase == "convert", show_progress=False)
    dt, cpu = clock()
    shutil.rmtree(out, ignore_errors=True)
    return spec["files"], dt, cpu, None


RUNNERS = {"direct": _read, "read": _read, "read-tiny": _read, "ledger": _ledger,
           "ledger-0": _ledger, "mixture": _mixture, "packed": _packed, "decode": _decoding,
           "decode-small": _decoding, "transform": _transform, "convert": _convert,
           "convert-tiny": _convert, "convert-parquet": _convert}


def run_phase(spec: dict[str, Any]) -> tuple[Any, ...]:
    """One phase in this process: ``(samples, wall s, CPU s, loader or None, extra fields)``."""
    import feedpipe

    got = RUNNERS[spec["phase"]](feedpipe, spec)
    return got if len(got) == 5 else (*got, {})


def worker(spec: dict[str, Any]) -> None:
    if "count" in spec:  # every phase in this one process, under callgrind (versions_count)
        import versions_count

        versions_count.count_worker(spec, run_phase, MARKS)
        return
    from peer_memory import PeakMemory

    import feedpipe

    with PeakMemory() as mem:
        n, dt, cpu, fl, extra = run_phase(spec)
    route = getattr(fl, "route", None)
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


OF_PHASE = {"direct": "images", "read": "images", "read-tiny": "tiny", "decode": "photos",
            "decode-small": "images", "transform": "images", "convert": "images",
            "convert-tiny": "tiny", "convert-parquet": "parquet", "ledger": "images",
            "ledger-0": "images", "mixture": "images", "packed": "tokens"}


def _args(argv: list[str] | None) -> argparse.Namespace:
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
    ap.add_argument("--counter", choices=("time", "instructions"), default="time",
                    help="instructions: no timed passes; each version runs every phase once in "
                    "one process under callgrind, and the table gives instructions per sample "
                    "of the timed part (versions_count.py)")
    ap.add_argument("--parquet-rows", type=int, default=200_000,
                    help="rows of the convert-parquet phase's table")
    return ap.parse_args(argv)


def _phases(a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    phases = a.phases.split(",")
    skipped = {p: f"{a.before} has no feedpipe.{NEEDS[p]}" for p in phases
               if p in NEEDS and not versions_data.has_name(a.before, NEEDS[p])}
    for p, why in skipped.items():
        print(f"phase {p} left out: {why} (compare with a later --before)", file=sys.stderr)
    return [p for p in phases if p not in skipped], skipped


def _passes(a: argparse.Namespace, phases: list[str], data: dict[str, Any],
            trees: dict[str, str]) -> tuple[Runs, list[str]]:
    """Every phase, the two versions alternating pass by pass, each run a fresh interpreter."""
    runs: Runs = {}
    errors = []
    for p in range(a.passes):
        for phase in phases:
            for version in alternating(list(trees), p):
                same = phase in SAME_TREE
                os.environ["PYTHONPATH"] = REPO if same else trees[version]
                r = run_worker(__file__, {**data[OF_PHASE[phase]], "phase": phase,
                                          "epochs": a.read_epochs,
                                          "ledger": same and version == "after"})
                if "error" in r:
                    errors.append(f"{phase} {version}: {r['error']}\n{r.get('stderr_tail')}")
                    print(errors[-1], file=sys.stderr)
                    continue
                runs.setdefault((phase, version), []).append(r)
                print(f"pass {p} {phase:12s} {version:6s} {r['rate']:>10,.0f}/s "
                      f"peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB", flush=True)
    return runs, errors


def _write(a: argparse.Namespace, argv: list[str] | None, phases: list[str],
           data: dict[str, Any], doc: dict[str, Any], out: dict[str, Any]) -> str:
    command = "python benchmarks/bench_versions.py " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    env = environment(data[OF_PHASE[phases[0]]]["shards"])
    doc = {"benchmark": "bench_versions", "command": command.strip(), "before": a.before,
           "passes": a.passes, "counter": a.counter, "environment": env,
           "summary": out.get("summary"), "bars": out["bars"], "counts": out.get("counts"),
           **doc}
    path = write_results(a.name, doc)
    head = {"env": env, "before": a.before, "passes": a.passes, "command": command.strip(),
            "bar_on": a.bar, "load": f"{doc['load_at_start']} at the start, "
            f"{[round(x, 2) for x in env.get('loadavg_at_start') or []]} at the end"}
    if a.counter == "instructions":
        versions_count.markdown(path[:-5] + ".md", head, out)  # no chart of counts
        return path
    versions_report.markdown(path[:-5] + ".md", head, out, phases)
    render_results.render(path, force=True, parts=("png",))  # the chart beside them
    return path


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.worker:
        worker(load_spec(a.worker))
        return 0
    phases, skipped = _phases(a)
    if not phases:
        print("no phase left to compare", file=sys.stderr)
        return 1
    data = versions_data.prepare(a, phases)
    a.passes = a.passes or (2 if a.quick else 5)
    scratch = tempfile.mkdtemp(prefix="bench-versions-")
    # phases that compare the working tree with itself need no checkout of the ref
    same = all(p in SAME_TREE for p in phases)
    before = REPO if same else versions_data.tree_of(a.before, scratch)
    trees = {"before": before, "after": REPO}
    for tree in set(trees.values()):
        versions_data.bytecode(tree)
    t_start, load = time.perf_counter(), os.getloadavg()
    try:
        if a.counter == "instructions":
            out = versions_count.count(__file__, trees, [(p, data[OF_PHASE[p]]) for p in phases],
                                       scratch)
            runs, errors = {}, out["errors"]
        else:
            runs, errors = _passes(a, phases, data, trees)
            out = versions_report.report(phases, runs, a.before, a.bar)
    finally:
        os.environ.pop("PYTHONPATH", None)
        if before != REPO:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", before],
                           check=False, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(out["text"])
    print(out.get("cpu_text", ""))
    print("\n".join(out.get("cpu_rows", [])))
    path = _write(a, argv, phases, data, {
        "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}, "errors": errors,
        "skipped": skipped, "elapsed_seconds": time.perf_counter() - t_start,
        "load_at_start": [round(x, 2) for x in load]}, out)
    print(f"results written to {path}")
    return 1 if errors or not all(b["met"] for b in out["bars"].values()) else 0

if __name__ == "__main__":
    sys.exit(main())
