"""Shuffle quality and bytes per node of feedpipe's node layout, beside its global order and
MosaicML Streaming's canonical nodes, on the dataset benchmarks/bench_shuffle.py uses.

The dataset exists only as sample ids: ``--classes`` x ``--per-class`` samples (100 x 200 =
20,000) written in class order, cut into shards of ``--shard-samples`` (100), so every shard
holds one class. No bytes are read: the order a system delivers is a function of ids only.

Worlds: ``nodes x ranks per node x workers per rank`` = 4x1x2 (the issue's 4 nodes) and 4x2x2,
batch 256 per rank. Systems:

    random          numpy ``permutation(N)`` as the global order, split over ranks as feedpipe
                    splits (the reference; ``--ref-trials`` draws)
    feedpipe-global ``Plan(counts, seed, epoch, shuffle=True)``: every rank mixed over all shards
    feedpipe-node   ``Plan(..., layout=(world_size, ranks_per_node))``: each node its own piece
                    of the shards each epoch, mixed inside (also with ``window=8``)
    streaming-*     MosaicML Streaming's own ``get_partitions`` + ``get_shuffle`` (what
                    ``StreamingDataset`` runs each epoch: ``generate_work_random_batching``) with
                    ``num_canonical_nodes`` = the physical nodes, ``partition_algo="relaxed"``,
                    its default ``shuffle_block_size`` (max(4,000,000 // nodes, 2**18), more
                    than this dataset: a block is a canonical node's whole span) and the
                    shuffle algorithms ``py1e`` (its default), ``py1s``, ``py1br``

Measures: per rank stream, as bench_shuffle.py (classes and shards per batch, |r|, |tau|,
displacement, z-scores against random; "same as random" is |z| < 3 for all); per *global* batch
(the batch ``t`` of every rank together, what one optimizer step averages over): distinct
classes; per node and epoch: shards touched over its share in shards (1.0: a node reads only its
share; the global order reads every shard), the most of any node, and the share of a node's
shards that it also read the epoch before (the pieces change every epoch).

Usage::

    python benchmarks/bench_node_shuffle.py [--quick]

Writes ``benchmarks/results/bench_node_shuffle.json`` and ``.md`` (``-quick`` with ``--quick``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_shuffle import BATCH, interleave, parse_sizes, stream_measures, summarise  # noqa: E402

WORLDS = ((4, 1, 2), (4, 2, 2))


def streaming_fns() -> tuple[Any, Any, str] | None:
    """Streaming's ``get_partitions`` and ``get_shuffle`` and its version, or None. Its package
    ``__init__`` imports its vision datasets (torchvision); the two modules need only numpy, so
    they are imported without it."""
    spec = importlib.util.find_spec("streaming")
    if spec is None or spec.origin is None:
        return None
    root = os.path.dirname(spec.origin)
    for name, path in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod
    from importlib.metadata import version

    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle
    return get_partitions, get_shuffle, version("mosaicml-streaming")


# -- systems: per rank (stream batches), and per node the shards it reads ---------------------
def run_split(order_of: Any, n: int, nodes: int, rpn: int, workers: int,
              pad_own: bool) -> list[list[np.ndarray]]:
    from feedpipe.plan._order import Split

    world = nodes * rpn
    out = []
    for rank in range(world):
        split = Split(n, world, rank, pad_own=pad_own)
        per = []
        for w in range(workers):
            per.append([order_of(split.positions(t * BATCH, min(t * BATCH + BATCH, split.length)))
                        for t in split.worker_batches(BATCH, w, workers)])
        out.append(interleave(per))
    return out


def run_feedpipe(counts: tuple[int, ...], nodes: int, rpn: int, workers: int, epoch: int,
                 layout: bool, window: int | None) -> list[list[np.ndarray]]:
    from feedpipe.plan._order import Plan

    plan = Plan(counts, seed=0, epoch=epoch, shuffle=True, window=window,
                layout=(nodes * rpn, rpn) if layout else None)
    return run_split(plan.sample_ids, plan.num_samples, nodes, rpn, workers, layout)


def run_streaming(fns: Any, counts: tuple[int, ...], nodes: int, rpn: int, workers: int,
                  epoch: int, algo: str) -> list[list[np.ndarray]]:
    get_partitions, get_shuffle, _ = fns
    n = sum(counts)
    ids = get_partitions("relaxed", n, nodes, nodes, rpn, workers, BATCH, 0, None)
    shuffle = get_shuffle(algo, np.asarray(counts, np.int64), nodes, 9176, epoch,
                          max(4_000_000 // nodes, 1 << 18))
    ids = np.where(ids != -1, shuffle[ids], -1)
    out = []
    for node in range(nodes):
        for r in range(rpn):
            per = [[b[b != -1] for b in ids[node, r, w] if (b != -1).any()]
                   for w in range(workers)]
            out.append(interleave(per))
    return out


def check_once(ranks: list[list[np.ndarray]], n: int, world: int, name: str) -> None:
    seen = np.concatenate([np.concatenate(r) for r in ranks])
    if not np.array_equal(np.unique(seen), np.arange(n)) or len(seen) - n >= world:
        raise RuntimeError(f"{name}: not every sample once")


def node_reads(ranks: list[list[np.ndarray]], rpn: int, shard_samples: int) -> list[set[int]]:
    nodes = len(ranks) // rpn
    return [set(np.unique(np.concatenate([np.concatenate(ranks[k * rpn + r])
                                          for r in range(rpn)]) // shard_samples).tolist())
            for k in range(nodes)]


def global_classes(ranks: list[list[np.ndarray]], per_class: int) -> list[int]:
    steps = min(len(r) for r in ranks)
    return [len(np.unique(np.concatenate([r[t] for r in ranks]) // per_class))
            for t in range(steps) if all(len(r[t]) == BATCH for r in ranks)]


def main(argv: list[str] | None = None) -> int:
    sizes = parse_sizes(__doc__, argv, epochs=(8, 3), trials=(100, 20))
    a, n, counts, epochs, trials = sizes.args, sizes.n, sizes.counts, sizes.epochs, sizes.trials
    n_shards = len(counts)
    fns = streaming_fns()
    t0 = time.perf_counter()
    systems: list[tuple[str, Any]] = [
        ("feedpipe-global", lambda e, K, R, W: run_feedpipe(counts, K, R, W, e, False, None)),
        ("feedpipe-node", lambda e, K, R, W: run_feedpipe(counts, K, R, W, e, True, None)),
        ("feedpipe-node-w8", lambda e, K, R, W: run_feedpipe(counts, K, R, W, e, True, 8)),
    ]
    if fns is not None:
        for algo in ("py1e", "py1s", "py1br"):
            systems.append((f"streaming-{algo}", lambda e, K, R, W, algo=algo:
                            run_streaming(fns, counts, K, R, W, e, algo)))

    results: dict[str, Any] = {}
    for nodes, rpn, workers in WORLDS:
        world = nodes * rpn
        key = f"{nodes}x{rpn}x{workers}"
        ref_obs, ref_global = [], []
        for t in range(trials):
            perm = np.random.default_rng(10_000 + t).permutation(n)
            ranks = run_split(lambda p, perm=perm: perm[p], n, nodes, rpn, workers, False)
            ref_obs += [stream_measures(r, a.per_class, a.shard_samples) for r in ranks]
            ref_global += global_classes(ranks, a.per_class)
        ref = summarise(ref_obs, None)
        res: dict[str, Any] = {"random": {**ref, "global_classes": float(np.mean(ref_global))}}
        share = n_shards / nodes
        for name, run in systems:
            obs, glob, over, again = [], [], [], []
            prev: list[set[int]] | None = None
            for e in range(epochs):
                ranks = run(e, nodes, rpn, workers)
                check_once(ranks, n, world, f"{name} {key} epoch {e}")
                obs += [stream_measures(r, a.per_class, a.shard_samples) for r in ranks]
                glob += global_classes(ranks, a.per_class)
                reads = node_reads(ranks, rpn, a.shard_samples)
                over += [len(x) / share for x in reads]
                if prev is not None:
                    again += [len(x & y) / max(len(x), 1) for x, y in zip(reads, prev,
                                                                         strict=True)]
                prev = reads
            s = summarise(obs, ref)
            s["global_classes"] = float(np.mean(glob))
            s["node_shards_over_share"] = {"mean": float(np.mean(over)),
                                           "max": float(np.max(over))}
            s["node_shards_kept_next_epoch"] = float(np.mean(again)) if again else None
            res[name] = s
        results[key] = res

    doc = {
        "benchmark": "bench_node_shuffle",
        "quick": a.quick,
        "environment": common.environment(),
        "params": {"classes": a.classes, "per_class": a.per_class, "samples": n,
                   "shard_samples": a.shard_samples, "shards": n_shards, "batch_size": BATCH,
                   "worlds": [f"{k}x{r}x{w}" for k, r, w in WORLDS], "epochs": epochs,
                   "ref_trials": trials,
                   "streaming": None if fns is None else {
                       "version": fns[2], "partition_algo": "relaxed",
                       "num_canonical_nodes": "physical nodes",
                       "shuffle_block_size": "max(4_000_000 // nodes, 2**18)"}},
        "results": results,
        "seconds": time.perf_counter() - t0,
    }
    name = "bench_node_shuffle-quick" if a.quick else "bench_node_shuffle"
    path = common.write_results(name, doc)
    md = [f"# {name}", "", f"{n:,} samples in class order, {n_shards} shards of "
          f"{a.shard_samples} (one class each), batch {BATCH} per rank, {epochs} epochs, "
          f"reference {trials} random permutations. Streaming: "
          f"{'not installed' if fns is None else 'mosaicml-streaming ' + fns[2]}.", "",
          "cls/b: distinct classes per rank batch (of 100); global cls/b: per global batch "
          "(every rank's batch t); max|z|: largest z-score vs random over the per-rank measures; "
          "node shards/share: shards a node reads over its share in shards (mean, max); "
          "kept: share of a node's shards it read the epoch before.", ""]
    for key, res in results.items():
        rows = []
        for sys_name, s in res.items():
            nd = s.get("node_shards_over_share") or {}
            kept = s.get("node_shards_kept_next_epoch")
            rows.append([sys_name, common.fmt(s["classes_mean"]["mean"], 1),
                         common.fmt(s["global_classes"], 1),
                         common.fmt(s["shards_mean"]["mean"], 1),
                         common.fmt(s["abs_pearson"]["mean"], 4),
                         common.fmt(s["abs_tau"]["mean"], 4), common.fmt(s["disp"]["mean"], 3),
                         "-" if s.get("max_abs_z") is None else common.fmt(s["max_abs_z"], 1),
                         "ref" if sys_name == "random" else (
                             "yes" if s["same_as_random"] else "NO"),
                         "-" if not nd else f"{nd['mean']:.2f} / {nd['max']:.2f}",
                         "-" if kept is None else f"{kept:.2f}"])
        head = ["system", "cls/b", "global cls/b", "shd/b", "|r|", "|tau|", "disp", "max|z|",
                "random?", "node shards/share", "kept"]
        md += [f"## {key} (nodes x ranks per node x workers)", "",
               "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        md.append("")
        print(f"\n{key}")
        print(common.table(rows, head))
    with open(path[:-len(".json")] + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    print(f"\nwrote {path} in {doc['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
