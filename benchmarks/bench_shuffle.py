"""Shuffle quality: feedpipe's plan vs webdataset's shard-shuffle + buffer-shuffle vs a full
random permutation, on a dataset written in class order.

The dataset exists only as sample ids: ``--classes`` x ``--per-class`` samples (100 x 200 =
20,000) written in class order, cut into shards of ``--shard-samples`` (100), so every shard
holds one class and sample id ``i`` has class ``i // per_class`` and shard ``i // shard_samples``.
No bytes are read: the order a system delivers is a function of ids only, so this measures the
order, not the I/O.

Systems (each run as a DataLoader with ``W`` ranks x ``nw`` workers and batch size 256, for
``1x2`` and ``2x2``; a rank's stream is its batches in the order a DataLoader returns them:
batch ``t`` from worker ``t % nw``, skipping exhausted workers):

    random          numpy ``Generator.permutation(N)`` as the global order, split over ranks
                    exactly like feedpipe (the reference; ``--ref-trials`` draws)
    feedpipe        ``feedpipe.Plan(counts, seed=0, epoch=e, shuffle=True, window=w)`` and
                    ``Split``/``iter_ids`` per (rank, worker), for window None (all shards), 32,
                    8, 2
    wds-bN          webdataset 1.0.2's pipeline, run with webdataset's own generators:
                    shard list -> ``split_by_node`` (rank::W; the default ``single_node_only``
                    refuses W>1) -> ``split_by_worker`` (worker::nw) -> ``filters.shuffle(100)``
                    (what ``WebDataset(shardshuffle=True)`` becomes) -> samples of each shard in
                    order -> ``filters.shuffle(bufsize=N, initial=N)`` (``.shuffle(N)``; its
                    default ``initial`` is 100, shown once as ``wds-b1000-init100``) -> batches
                    of 256 per worker. Each epoch gets new seeds for both shuffles (favourable
                    to webdataset: ``WebDataset`` passes one ``seed`` fixed at construction to
                    its shard shuffle, so a worker's shard order repeats every epoch).

Equal memory. feedpipe holds no shuffle buffer: each worker holds the plan (O(shards) int64),
one chunk of ids (16,384 int64) and the batch being assembled, plus read-only maps of the shards
it reads (at most ``max_open_shards`` = 64): clean, shared, reclaimable page cache. A
webdataset worker streams one shard at a time and keeps ``bufsize`` samples in private memory.
Counted as private memory, feedpipe's equal is ``bufsize ~ 0`` (no sample-level shuffle at all).
Counted the generous way for webdataset (every mapped shard fully resident), feedpipe window ``w``
holds ``w x 100`` samples and window None ``min(shards touched, 64) x 100 = 6,400``, so the
equal-memory peers are ``wds-b200``, ``wds-b800``, ``wds-b3200`` and ``wds-b6400``; ``wds-b1000``
and ``wds-b5000`` are common settings.

Measures (per rank stream and epoch; full batches only for the per-batch ones):

    classes/batch   mean and min distinct classes in a batch of 256 (random: ~92.4 of 100)
    shards/batch    mean distinct shards in a batch
    |r|             |Pearson correlation| between output position and sample id
    |tau|           |Kendall tau| between output position and sample id (exact, O(n log n))
    disp            mean |pos/n - rank(id)/n| (normalised displacement; random: ~1/3)

Each is compared with the reference by a z-score: (system's mean over epochs and ranks - the
reference's mean) / (the reference's standard deviation / sqrt(number of system observations)).
"Same as random" means |z| < 3 for every measure.

Reading locality (per worker and epoch, from the same id streams): shards touched; live shards
(the most shards whose first and last use straddle one point of the stream: what must be open at
once for each shard to be opened once); shard opens with FeedDataset's 64 open maps (each open
maps the tar and parses its ``.idx``), evicting least recently used (its policy at 5c684c9) and
first opened (later trees). webdataset opens each of its shards once, one at a time.

Usage::

    python benchmarks/bench_shuffle.py [--quick] [--epochs 10] [--ref-trials 200]

Writes ``benchmarks/results/bench_shuffle.json`` (``bench_shuffle-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

BATCH = 256
WORLDS = ((1, 2), (2, 2))
WINDOWS = (None, 32, 8, 2)
WDS_BUFS = ((200, None), (800, None), (1000, None), (1000, 100), (3200, None), (5000, None),
            (6400, None))
MAX_OPEN = 64
MEASURES = ("classes_mean", "classes_min", "shards_mean", "abs_pearson", "abs_tau", "disp")


# -- measures ---------------------------------------------------------------------------------
def inversions(a: np.ndarray) -> int:
    """Pairs ``j < i`` with ``a[j] > a[i]`` for distinct non-negative ints, in O(n log n) numpy:
    such a pair differs first at one bit ``k``; at level ``k`` group by the bits above ``k``
    (stable, so sequence order is kept) and count, for each 0 at bit ``k``, the 1s before it."""
    a = np.asarray(a, dtype=np.int64)
    n = len(a)
    total = 0
    for k in range(max(1, int(a.max()).bit_length())):
        prefix = a >> (k + 1)
        order = np.argsort(prefix, kind="stable")
        p = prefix[order]
        b = (a[order] >> k) & 1
        cum = np.cumsum(b)
        starts = np.r_[0, np.flatnonzero(np.diff(p)) + 1]
        gid = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
        before = cum - b - (cum[starts] - b[starts])[gid]
        total += int(before[b == 0].sum())
    return total


def stream_measures(batches: list[np.ndarray], per_class: int,
                    shard_samples: int) -> dict[str, float]:
    ids = np.concatenate(batches)
    n = len(ids)
    full = [b for b in batches if len(b) == BATCH]
    classes = np.array([len(np.unique(b // per_class)) for b in full])
    shards = np.array([len(np.unique(b // shard_samples)) for b in full])
    pos = np.arange(n, dtype=np.float64)
    r = float(np.corrcoef(pos, ids.astype(np.float64))[0, 1])
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(ids, kind="stable")] = np.arange(n)
    tau = 1.0 - 4.0 * inversions(rank) / (n * (n - 1))
    disp = float(np.mean(np.abs(pos - rank) / n))
    return {"classes_mean": float(classes.mean()), "classes_min": float(classes.min()),
            "shards_mean": float(shards.mean()), "abs_pearson": abs(r), "abs_tau": abs(tau),
            "disp": disp}


def locality(worker_ids: np.ndarray, shard_samples: int) -> dict[str, float]:
    """How one worker's stream touches shards (see the module docstring)."""
    s = (worker_ids // shard_samples).tolist()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, x in enumerate(s):
        first.setdefault(x, i)
        last[x] = i
    events = np.zeros(len(s) + 1, dtype=np.int64)
    for x in first:
        events[first[x]] += 1
        events[last[x] + 1] -= 1
    live = int(np.cumsum(events).max()) if s else 0
    opens = {}
    for policy in ("lru", "fifo"):
        # FeedDataset._reader keeps max_open_shards maps in an OrderedDict; at HEAD 5c684c9 it
        # evicted the least recently used, the working tree of 2a83f13+ the first opened
        cache: OrderedDict[int, None] = OrderedDict()
        n_open = 0
        for x in s:
            if x in cache:
                if policy == "lru":
                    cache.move_to_end(x)
            else:
                n_open += 1
                if len(cache) >= MAX_OPEN:
                    cache.popitem(last=False)
                cache[x] = None
        opens[policy] = n_open
    return {"shards_touched": len(first), "live_shards": live, "lru64_opens": opens["lru"],
            "fifo64_opens": opens["fifo"], "samples_per_open": len(s) / max(opens["fifo"], 1)}


def interleave(per_worker: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The DataLoader's order: one batch from each worker in turn, skipping exhausted ones."""
    out: list[np.ndarray] = []
    its = [iter(w) for w in per_worker]
    alive = list(range(len(its)))
    while alive:
        for w in list(alive):
            try:
                out.append(next(its[w]))
            except StopIteration:
                alive.remove(w)
    return out


# -- systems: each returns, per rank, (rank stream batches, per-worker id streams) ----------------
RankStreams = list[tuple[list[np.ndarray], list[np.ndarray]]]


def run_random(n: int, world: int, workers: int, seed: int) -> RankStreams:
    from feedpipe.plan._order import Split

    perm = np.random.default_rng(seed).permutation(n)
    out = []
    for rank in range(world):
        split = Split(n, world, rank)
        per = []
        for w in range(workers):
            per.append([perm[split.positions(t * BATCH, min(t * BATCH + BATCH, split.length))]
                        for t in split.worker_batches(BATCH, w, workers)])
        out.append((interleave(per), [np.concatenate(p) for p in per]))
    return out


def run_feedpipe(counts: tuple[int, ...], world: int, workers: int, epoch: int,
                 window: int | None, check: bool) -> RankStreams:
    from feedpipe.plan._order import Plan, Split, all_ids, iter_ids

    plan = Plan(counts, seed=0, epoch=epoch, shuffle=True, window=window)
    n = plan.num_samples
    out = []
    seen = []
    for rank in range(world):
        split = Split(n, world, rank)
        per = [list(iter_ids(plan, split, BATCH, w, workers)) for w in range(workers)]
        stream = interleave(per)
        if check and np.concatenate(stream).tolist() != all_ids(plan, split, BATCH, workers):
            raise RuntimeError("benchmark's interleave differs from feedpipe.plan._order.all_ids")
        seen.append(np.concatenate(stream))
        out.append((stream, [np.concatenate(p) for p in per]))
    allseen = np.sort(np.concatenate(seen))
    pad = len(allseen) - n
    if not np.array_equal(np.unique(allseen), np.arange(n)) or pad >= world:
        raise RuntimeError(f"feedpipe window={window} epoch={epoch}: not exactly once")
    return out


def run_wds(n_shards: int, shard_samples: int, world: int, workers: int, epoch: int,
            bufsize: int, initial: int | None) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    from itertools import islice

    from webdataset import filters

    out = []
    for rank in range(world):
        per_batches = []
        per_ids = []
        for w in range(workers):
            # webdataset.shardlists.split_by_node / split_by_worker are islice(rank, None, W)
            # over the url list; they read the world from torch, so apply the same islice here.
            urls = iter(range(n_shards))
            if world > 1:
                urls = islice(urls, rank, None, world)
            if workers > 1:
                urls = islice(urls, w, None, workers)
            seed = hash((epoch, rank, w)) & 0xFFFFFFFF
            shards = filters.shuffle(100, seed=seed)(urls)  # WebDataset(shardshuffle=True)

            def samples(shards=shards):  # tar_file_expander + group_by_keys, in shard order
                for s in shards:
                    yield from range(s * shard_samples, (s + 1) * shard_samples)

            kw = {"initial": bufsize if initial is None else initial}
            ids = np.fromiter(filters.shuffle(bufsize, seed=seed + 1, **kw)(samples()), np.int64)
            per_ids.append(ids)
            per_batches.append([ids[i:i + BATCH] for i in range(0, len(ids), BATCH)])
        out.append((interleave(per_batches), per_ids))
    return out


# -- driver -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """The id-only dataset of the shuffle benchmarks and how long to run: ``args`` (the parsed
    command line), ``n`` samples in ``counts`` shards, ``epochs`` per system, ``trials`` draws
    of the random reference."""

    args: argparse.Namespace
    n: int
    counts: tuple[int, ...]
    epochs: int
    trials: int


def parse_sizes(doc: str, argv: list[str] | None, epochs: tuple[int, int],
                trials: tuple[int, int]) -> Sizes:
    """The shuffle benchmarks' command line (``--quick``, the dataset's shape, ``--epochs``,
    ``--ref-trials``); ``epochs``/``trials``: the defaults, ``(full, quick)``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer epochs and reference draws")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--per-class", type=int, default=200)
    ap.add_argument("--shard-samples", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=None,
                    help=f"epochs per system ({epochs[0]}; quick {epochs[1]})")
    ap.add_argument("--ref-trials", type=int, default=None,
                    help=f"random permutations for the reference ({trials[0]}; quick {trials[1]})")
    a = ap.parse_args(argv)
    n = a.classes * a.per_class
    if n % a.shard_samples:
        ap.error("classes * per_class must be a multiple of shard_samples")
    return Sizes(a, n, (a.shard_samples,) * (n // a.shard_samples),
                 a.epochs or epochs[a.quick], a.ref_trials or trials[a.quick])


def summarise(obs: list[dict[str, float]],
              ref: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    s: dict[str, Any] = {"n": len(obs)}
    for m in MEASURES:
        xs = np.array([o[m] for o in obs])
        s[m] = {"mean": float(xs.mean()), "sd": float(xs.std(ddof=1)) if len(xs) > 1 else 0.0,
                "min": float(xs.min()), "max": float(xs.max())}
        if ref is not None:
            se = ref[m]["sd"] / np.sqrt(len(xs))
            s[m]["z"] = float((xs.mean() - ref[m]["mean"]) / se) if se > 0 else None
    if ref is not None:
        zs = [abs(s[m]["z"]) for m in MEASURES if s[m].get("z") is not None]
        s["max_abs_z"] = max(zs) if zs else None
        s["same_as_random"] = bool(zs) and max(zs) < 3
    return s


def main(argv: list[str] | None = None) -> int:
    sizes = parse_sizes(__doc__, argv, epochs=(10, 3), trials=(200, 40))
    a, n, counts, epochs, trials = sizes.args, sizes.n, sizes.counts, sizes.epochs, sizes.trials
    n_shards = len(counts)
    env = common.environment()
    t0 = time.perf_counter()

    systems: list[tuple[str, Any]] = [("random", None)]
    systems += [(f"feedpipe-w{'all' if w is None else w}", w) for w in WINDOWS]
    systems += [(f"wds-b{b}" + (f"-init{i}" if i is not None else ""), (b, i)) for b, i in WDS_BUFS]

    results: dict[str, Any] = {}
    for world, workers in WORLDS:
        wkey = f"{world}x{workers}"
        ref_obs = []
        for t in range(trials):
            for stream, _ in run_random(n, world, workers, 10_000 + t):
                ref_obs.append(stream_measures(stream, a.per_class, a.shard_samples))
        ref = summarise(ref_obs, None)
        res: dict[str, Any] = {"random": {**ref, "locality": None}}
        for name, arg in systems[1:]:
            obs, loc = [], []
            for e in range(epochs):
                if name.startswith("feedpipe"):
                    ranks = run_feedpipe(counts, world, workers, e, arg, check=e == 0)
                else:
                    ranks = run_wds(n_shards, a.shard_samples, world, workers, e, *arg)
                for stream, per_worker in ranks:
                    obs.append(stream_measures(stream, a.per_class, a.shard_samples))
                    loc.extend(locality(p, a.shard_samples) for p in per_worker)
            summ = summarise(obs, ref)
            summ["locality"] = {k: float(np.mean([x[k] for x in loc])) for k in loc[0]}
            if name.startswith("wds"):
                # webdataset streams: one shard open per worker, plus its sample buffer
                # webdataset streams each of its shards once, one at a time, into its buffer
                summ["locality"]["lru64_opens"] = summ["locality"]["shards_touched"]
                summ["locality"]["fifo64_opens"] = summ["locality"]["shards_touched"]
                summ["locality"]["samples_per_open"] = float(a.shard_samples)
                summ["locality"]["live_shards"] = 1
                summ["locality"]["open_at_once"] = 1
                summ["locality"]["buffered_samples"] = arg[0]
            else:
                summ["locality"]["open_at_once"] = min(summ["locality"]["live_shards"], MAX_OPEN)
                summ["locality"]["buffered_samples"] = 0
            res[name] = summ
        results[wkey] = res

    doc = {
        "benchmark": "bench_shuffle",
        "quick": a.quick,
        "environment": env,
        "params": {"classes": a.classes, "per_class": a.per_class, "samples": n,
                   "shard_samples": a.shard_samples, "shards": n_shards, "batch_size": BATCH,
                   "worlds": [f"{w}x{k}" for w, k in WORLDS], "epochs": epochs,
                   "ref_trials": trials, "max_open_shards": MAX_OPEN,
                   "wds_shard_shuffle": "filters.shuffle(100) after split_by_node/worker",
                   "equal_memory": "feedpipe window w ~ wds bufsize w*shard_samples; window "
                                   "None ~ min(touched, 64)*shard_samples (mapped shards counted "
                                   "as resident); private memory: feedpipe ~ 0 buffered samples"},
        "results": results,
        "seconds": time.perf_counter() - t0,
    }
    path = common.write_results("bench_shuffle-quick" if a.quick else "bench_shuffle", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it

    for wkey, res in results.items():
        rows = []
        for name, s in res.items():
            loc = s.get("locality") or {}
            rows.append([
                name,
                common.fmt(s["classes_mean"]["mean"], 1), common.fmt(s["classes_min"]["mean"], 1),
                common.fmt(s["shards_mean"]["mean"], 1), common.fmt(s["abs_pearson"]["mean"], 4),
                common.fmt(s["abs_tau"]["mean"], 4), common.fmt(s["disp"]["mean"], 3),
                "-" if s.get("max_abs_z") is None else common.fmt(s["max_abs_z"], 1),
                "ref" if name == "random" else ("yes" if s["same_as_random"] else "NO"),
                common.fmt(loc.get("live_shards")), common.fmt(loc.get("open_at_once")),
                common.fmt(loc.get("buffered_samples")),
                common.fmt(loc.get("lru64_opens")), common.fmt(loc.get("fifo64_opens")),
                common.fmt(loc.get("shards_touched")),
            ])
        print(f"\n{wkey} (ranks x workers), {n:,} samples in class order, {n_shards} shards of "
              f"{a.shard_samples}, batch {BATCH}; {epochs} epochs, reference {trials} draws")
        print(common.table(rows, ["system", "cls/b", "min cls/b", "shd/b", "|r|", "|tau|",
                                  "disp", "max|z|", "random?", "live", "open", "buffer",
                                  "opens LRU", "opens FIFO", "touched"]))
    print("\ncls/b, min cls/b: mean and per-epoch minimum distinct classes per batch; shd/b: "
          "distinct shards per batch;\n|r|, |tau|: position vs id; disp: normalised mean "
          "displacement; max|z|: largest z-score vs random over the six measures;\nlive: shards "
          "a worker would need open at once to open each once; open: shards it has open at once "
          "(feedpipe: live shards capped at its 64 maps; wds: 1);\n"
          "buffer: samples held in a shuffle buffer per worker; opens LRU/FIFO: shard opens per "
          "worker and epoch with 64 open maps evicted least recently used / first opened "
          "(FeedDataset's policy: LRU at 5c684c9, FIFO in later trees); touched: shards a worker "
          "reads per epoch")
    print(f"\nwrote {path} in {doc['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
