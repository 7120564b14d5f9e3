"""A Mixture's plan at long epochs: memory and time to the first batch over 100 sources at
epochs of 10^6, 10^8 and 10^9 samples (issue 44, "Plans that fit a long run": under 100 MB of
plan memory per process and the first batch within 1 s).

Each measurement runs in a fresh interpreter (one subprocess each, so one's memory does not
colour the next), with an address-space limit (``--limit-gb``) and a timeout: a case past either
is reported as such, not retried.

    plan     ``MixturePlan`` of 100 synthetic sources given by their shard counts only (what the
             plan reads of a source: 1,000 shards of 10,000 samples each, 10^7 samples a source,
             10^9 declared in all; no data exists), weights 1..3 spread over the sources, the
             epoch's size ``E``; then the draws of rank 0 / worker 0's first group of batches
             (8 ranks, 2 workers, batch 256: the 16,384-position group the loader asks for
             first), and of the same group resumed at position ``0.7 E``. Time: making the plan
             plus the first group (``first_s``), the resumed group alone (``resume_s``). Memory:
             the peak RSS growth over both (``VmHWM`` reset through ``/proc/self/clear_refs``,
             minus ``VmRSS`` before) and, in the same process after, the ``tracemalloc`` peak
             of a new plan's resumed group (traced apart: tracing slows allocations). A plan
             at an epoch of 1,000 is made first (imports, numpy's first calls).
    loader   ``FeedLoader(Mixture(...), batch_size=256)`` over 100 real tiny sources (one
             shard of 1,000 samples each, a 16-byte ``bin`` field and a ``cls`` label, written
             once under ``--root``), weights as above, ``epoch_size=E``: with 10^5 samples
             in all, each source is drawn over and over (its permutation continues cycle after
             cycle), which is what lets a 10^9 epoch run on a small disk; the plan's work is
             the same as over large sources but for the per-source permutations, which
             ``plan`` measures at full size. Time: from ``Mixture(...)`` to the first batch
             (the sources' ``FeedDataset`` objects made before, as a script makes them), then
             ``load_state_dict`` of a state at ``0.7 E`` to the first batch of the resumed
             loader. Memory: peak RSS growth over both. A loader over the same sources at an
             epoch of 1,000 reads a batch first (imports, shard maps, the route's first calls),
             so the growth is what the epoch's size adds.
    packed   ``Packed(Mixture(...), seq_len=2048)`` over 100 real tiny sources of token
             documents (one shard of 1,000 ``tokens.npy`` documents of 1..64 tokens each),
             ``epoch_size=E``, in batches of 8 rows: time from ``Mixture(...)`` to the first
             batch, then a state at row ``0.7 R`` (``R`` the epoch's rows) loaded into a new
             loader to its first batch (checked against that row made by the first loader),
             after a first batch at an epoch of 1,000 as for ``loader``. Memory: the peak RSS
             growth over both and the process's peak RSS (``VmHWM``, imports included).

``--tree DIR`` runs the measurements on the feedpipe of another checkout (e.g. main, for the
figures before the change). Usage::

    python benchmarks/bench_mixture_plan.py [--sizes 1e6,1e8,1e9] [--modes plan,loader,packed]
        [--tree DIR] [--limit-gb 8] [--timeout 300] [--out benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import default_root, environment  # noqa: E402  (beside this script)

SOURCES = 100
PER_SOURCE = 1000  # samples of each real source (loader, packed)
RANKS, WORKERS, BATCH = 8, 2, 256
GROUP = 16384  # the positions the loader's first group of batches asks for


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakRss:
    """Peak RSS growth over a block: VmHWM after minus VmRSS before (HWM reset first)."""

    def __enter__(self) -> PeakRss:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.delta = _status("VmHWM") - self.before


def weights() -> list[float]:
    return [1 + 2 * i / (SOURCES - 1) for i in range(SOURCES)]


def measure_plan(size: int) -> dict[str, Any]:
    import tracemalloc

    import numpy as np

    from feedpipe.plan._mixture import MixturePlan
    from feedpipe.plan._order import Split, batch_groups, worker_positions

    sources = [[10_000] * 1000 for _ in range(SOURCES)]

    def first_group(plan: Any, start: int) -> Any:
        split = Split(plan.epoch_size, RANKS, 0, start=start)
        ts = next(batch_groups(split, BATCH, 0, WORKERS, chunk=GROUP))
        pos, _ = worker_positions(split, BATCH, ts)
        return plan.draws(0, pos)

    first_group(MixturePlan(sources, weights(), 1000, seed=2), 0)  # imports, numpy's first calls
    with PeakRss() as rss:
        t0 = time.perf_counter()
        plan = MixturePlan(sources, weights(), size, seed=1)
        src, _ = first_group(plan, 0)
        t1 = time.perf_counter()
        first_group(plan, int(size * 0.7))
        t2 = time.perf_counter()
    del plan
    tracemalloc.start()  # again, traced (tracemalloc slows allocations: not timed)
    first_group(MixturePlan(sources, weights(), size, seed=1), int(size * 0.7))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"first_s": t1 - t0, "resume_s": t2 - t1, "peak_rss_delta_mb": rss.delta / 1e6,
            "tracemalloc_peak_mb": peak / 1e6, "group": len(src),
            "sources_in_first_group": int(len(np.unique(src)))}


def prepare(root: str, kind: str) -> list[str]:
    """The 100 tiny real sources of ``kind`` (``bin`` or ``tokens``), written once."""
    import numpy as np

    from feedpipe import write_samples

    paths = [os.path.join(root, kind, f"s{i:03d}") for i in range(SOURCES)]
    rng = np.random.default_rng(0)
    for i, p in enumerate(paths):
        if os.path.exists(os.path.join(p, "manifest.json")):
            continue
        if kind == "bin":
            data = ({"__key__": f"{i}-{j:05d}", "bin": rng.bytes(16), "cls": j % 10}
                    for j in range(PER_SOURCE))
        else:
            data = ({"__key__": f"{i}-{j:05d}",
                     "tokens.npy": rng.integers(0, 50_000, int(rng.integers(1, 65)),
                                                dtype=np.int32)} for j in range(PER_SOURCE))
        write_samples(data, p, max_samples=PER_SOURCE)
    return paths


def measure_loader(size: int, root: str) -> dict[str, Any]:
    from feedpipe import FeedDataset, FeedLoader, Mixture

    paths = prepare(root, "bin")
    sources = {f"s{i:03d}": FeedDataset(p, shuffle=True, decode={"cls": int})
               for i, p in enumerate(paths)}
    # a first loader at an epoch of 1,000: imports, shard maps, the route's first calls
    next(iter(FeedLoader(Mixture(sources, weights(), epoch_size=1000), batch_size=BATCH)))
    with PeakRss() as rss:
        t0 = time.perf_counter()
        ld = FeedLoader(Mixture(sources, weights(), epoch_size=size, seed=1), batch_size=BATCH)
        it = iter(ld)
        batch = next(it)
        t1 = time.perf_counter()
        state = ld.state_dict()
        state["position"] = int(size * 0.7)
        again = FeedLoader(Mixture(sources, weights(), epoch_size=size, seed=1),
                           batch_size=BATCH)
        again.load_state_dict(state)
        resumed = next(iter(again))
        t2 = time.perf_counter()
    return {"first_s": t1 - t0, "resume_s": t2 - t1, "peak_rss_delta_mb": rss.delta / 1e6,
            "rss_mb": _status("VmRSS") / 1e6, "batch": len(batch["cls"]),
            "resumed_batch": len(resumed["cls"]), "route": ld.route.name,
            "sources_in_first_batch": len(set(batch["__source__"]))}


def measure_packed(size: int, root: str) -> dict[str, Any]:
    from feedpipe import FeedDataset, FeedLoader, Mixture, Packed

    paths = prepare(root, "tokens")
    sources = {f"s{i:03d}": FeedDataset(p, shuffle=True) for i, p in enumerate(paths)}

    def loader(epoch_size: int) -> Any:
        packed = Packed(Mixture(sources, weights(), epoch_size=epoch_size, seed=1), seq_len=2048)
        return packed, FeedLoader(packed, batch_size=8)

    # a first loader at an epoch of 1,000: imports, shard maps, the route's first calls
    next(iter(loader(1000)[1]))
    with PeakRss() as rss:
        t0 = time.perf_counter()
        packed, ld = loader(size)
        batch = next(iter(ld))
        t1 = time.perf_counter()
        rows = packed.num_rows(0)
        state = ld.state_dict()
        state["position"] = int(rows * 0.7)  # a Packed's position is a row
        again_packed, again = loader(size)
        again.load_state_dict(state)
        resumed = next(iter(again))
        t2 = time.perf_counter()
    # the resumed batch's first row is row 0.7 R of the epoch, made from the first loader's plan
    want = packed.rows(0, [int(rows * 0.7)])["input_ids"][0]
    return {"first_s": t1 - t0, "resume_s": t2 - t1, "peak_rss_delta_mb": rss.delta / 1e6,
            "peak_rss_mb": _status("VmHWM") / 1e6, "rss_mb": _status("VmRSS") / 1e6,
            "rows": int(batch["input_ids"].shape[0]), "epoch_rows": int(rows),
            "resumed_row_matches": bool((resumed["input_ids"][0] == want).all()),
            "route": ld.route.name}


def child(spec: dict[str, Any]) -> None:
    limit = int(spec["limit_gb"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    mode, size = spec["mode"], int(spec["size"])
    if mode == "plan":
        out = measure_plan(size)
    elif mode == "loader":
        out = measure_loader(size, spec["root"])
    else:
        out = measure_packed(size, spec["root"])
    print("RESULT " + json.dumps(out), flush=True)


def run(spec: dict[str, Any], tree: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": tree}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                            json.dumps(spec)], capture_output=True, text=True, env=env,
                           timeout=timeout, cwd=tree)
    except subprocess.TimeoutExpired:
        return {"outcome": f"timeout after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"outcome": "ok", "process_s": wall, **json.loads(line[7:])}
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"outcome": f"failed (exit {p.returncode}): {tail[0][:200]}", "process_s": wall}


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [
        "# bench_mixture_plan: a Mixture's plan at epochs of 10^6, 10^8 and 10^9",
        "",
        "Plan memory and time to the first batch over 100 sources (issue 44: under 100 MB a "
        "process and within 1 s). Measured by `benchmarks/bench_mixture_plan.py` (its "
        "docstring says what each mode does); each figure in a fresh interpreter with an "
        f"address-space limit of {doc['params']['limit_gb']} GiB and a timeout of "
        f"{doc['params']['timeout_s']} s.",
        "",
        f"**Environment:** {env.get('date_utc', '')}; {env.get('cpu_count', '?')} CPUs "
        f"({env.get('cpu_model', '?')}); Python {env.get('python', '?')}; numpy "
        f"{(env.get('versions') or {}).get('numpy', '?')}; git "
        f"`{str((env.get('git') or {}).get('revision', '?'))[:12]}`; load average "
        f"{doc['loadavg_before'][0]:.2f} at the start, {doc['loadavg_after'][0]:.2f} at the end "
        "(a machine shared with other work: the times are this load's).",
        "",
        f"Command: `{doc['command']}`",
        "",
        "| tree | mode | epoch | outcome | first batch (s) | resumed at 0.7 E (s) | "
        "peak RSS growth (MB) | tracemalloc peak (MB) | process peak RSS (MB) |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def f(x: Any, d: int = 2) -> str:
        return "" if x is None else f"{x:,.{d}f}"

    for r in doc["results"]:
        lines.append(
            f"| {r['tree']} | {r['mode']} | {r['size']:.0e} | {r['outcome']} | "
            f"{f(r.get('first_s'), 3)} | {f(r.get('resume_s'), 3)} | "
            f"{f(r.get('peak_rss_delta_mb'), 1)} | {f(r.get('tracemalloc_peak_mb'), 1)} | "
            f"{f(r.get('peak_rss_mb'), 1)} |")
    lines += ["", "## Summary", "", doc["summary_text"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--sizes", default="1e6,1e8,1e9")
    ap.add_argument("--modes", default="plan,loader,packed")
    ap.add_argument("--tree", action="append", default=[],
                    help="NAME=DIR: measure another checkout's feedpipe too (repeatable)")
    ap.add_argument("--no-this", action="store_true", help="only the --tree checkouts")
    ap.add_argument("--limit-gb", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--root", default=default_root("mixture-plan"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_mixture_plan.json"))
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    trees = [] if a.no_this else [("this", os.path.dirname(HERE))]
    trees += [tuple(t.split("=", 1)) for t in a.tree]
    load_before = os.getloadavg()
    results = []
    for name, tree in trees:
        for mode in a.modes.split(","):
            for size in (int(float(s)) for s in a.sizes.split(",")):
                spec = {"mode": mode, "size": size, "root": a.root, "limit_gb": a.limit_gb}
                r = {"tree": name, "mode": mode, "size": size,
                     **run(spec, os.path.abspath(tree), a.timeout)}
                print(json.dumps(r), flush=True)
                results.append(r)
    ok = [r for r in results if r["tree"] == trees[0][0]]
    worst_mem = max((max(r.get("peak_rss_delta_mb", 0), r.get("tracemalloc_peak_mb", 0))
                     for r in ok if r["outcome"] == "ok"), default=None)
    worst_first = max((r["first_s"] for r in ok if r["outcome"] == "ok"), default=None)
    summary = (f"tree {trees[0][0]!r}, {a.modes} at {a.sizes}: "
               f"{sum(r['outcome'] == 'ok' for r in ok)} of {len(ok)} cases ran; the most plan "
               f"memory {worst_mem or 0:.1f} MB, the slowest first batch {worst_first or 0:.3f} s")
    doc = {"benchmark": "mixture_plan", "environment": environment(a.root),
           "command": "python benchmarks/bench_mixture_plan.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "params": {"sources": SOURCES, "sizes": a.sizes, "limit_gb": a.limit_gb,
                      "timeout_s": a.timeout, "ranks": RANKS, "workers": WORKERS,
                      "batch": BATCH, "group": GROUP},
           "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
           "results": results, "summary_text": summary}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    with open(a.out[:-len(".json")] + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(doc))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
