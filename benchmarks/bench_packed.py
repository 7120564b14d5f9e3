"""Packed token rows: ``feedpipe.Packed`` against LitData's ``TokensLoader`` and MosaicML
Streaming on the same token corpus.

Corpus: ``--docs`` documents of random length (uniform in ``[16, 2 * --mean-len]``, seed 0) of
int32 token ids, written once per system into its own format under ``--root``: feedpipe shards
(``tokens.npy`` fields, ``write_samples``), a LitData ``optimize`` output read by
``TokensLoader(block_size=seq_len)``, an MDS dataset read by ``StreamingDataset`` and packed in
the loop (Streaming has no packer of its own). Each system runs in a fresh interpreter, one
process, no workers, batches of ``--batch`` rows of ``--seq-len`` tokens, ``--epochs`` whole
epochs one after the other (each system's own next epoch: a new shuffle); ``--passes`` passes,
the systems' order reversed every other pass. Measured there, per epoch: tokens delivered
(rows x seq_len: feedpipe's one padded last row counts, LitData leaves its short last block
out), wall and CPU seconds (the first epoch's include its first batch, setup excluded); and
time to the first batch, peak RSS (``VmHWM``).

Two figures per system and pass: the **first epoch** (a fresh process's first pass: it pays
once-a-process costs, such as mapping and first touching the shards, and on this corpus an
epoch lasts a tenth of a second, so they weigh far more than in a real run) and the **steady
epochs** (the median of epochs 2..N: what a long run sees once those costs are behind it; each
still pays its own epoch's planning and shuffle). Both systems are measured alike.

**The bar** (issue 29: packed tokens/s at least 2x the best peer) is read on the steady epochs
by wall time: the median over passes of the per-pass ratio of feedpipe's steady tokens/s to the
best peer's. Beside it: the same ratio for the first epoch, and both by tokens per CPU second of
the process (the figure to read where other work shares the cores: wall time then counts the
waits for a core). feedpipe's batches also carry ``position_ids``, ``labels`` (int64, as
the issue asks) and ``cu_seqlens``; LitData's are the token ids only, in their stored dtype.

Where feedpipe's optional C extension (``feedpipe._native._packrows``, which copies the token
pieces) is built, ``feedpipe-numpy`` is feedpipe with it switched off, as where it did not build
(not a peer, in no ratio).

**The floor** (not a peer, in no ratio): a numpy loop that writes the same three int64 fields of
every batch and does nothing else (ids cast from the corpus's int32 tokens read in order,
labels a copy of them, positions a copy of a ramp): what writing those bytes costs on this
machine, so that feedpipe's distance to it says how much is left to cut.

Streaming is left out, with the reason in the JSON, where it does not import.

Usage::

    python benchmarks/bench_packed.py [--docs N] [--epochs 6] [--passes 9] [--root DIR]
        [--out benchmarks/results/packed.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import default_root, environment  # noqa: E402  (beside this script)

# why Streaming cannot be measured beside a CPU-only torch, whatever else its import lacks
STREAMING_NEEDS_TORCHVISION = (
    "; and `import streaming` imports torchvision (streaming/__init__ imports streaming.vision, "
    "whose base class is torchvision's VisionDataset), which is not installed here: the "
    "torchvision wheels on PyPI are CUDA builds whose _C.so needs libc10_cuda.so and "
    "libtorch_cuda.so, which a CPU-only torch does not ship, so `import torchvision` fails "
    "(RuntimeError: operator torchvision::nms does not exist)")


def corpus(n: int, mean: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 2 * mean, size=n)
    return [rng.integers(0, 50_000, size=int(k), dtype=np.int32) for k in lengths]


def _lit_fn(doc: Any) -> Any:
    import torch

    return torch.from_numpy(doc)


def prepare(system: str, root: str, docs: list[np.ndarray]) -> str:
    out = os.path.join(root, system)
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    if system == "feedpipe":
        from feedpipe import write_samples

        write_samples(({"__key__": f"d{i:07d}", "tokens.npy": d} for i, d in enumerate(docs)),
                      out, max_samples=max(1, len(docs) // 8))
    elif system == "litdata":
        from litdata import optimize
        from litdata.streaming.item_loader import TokensLoader

        optimize(fn=_lit_fn, inputs=docs, output_dir=out, chunk_size=1 << 22,
                 item_loader=TokensLoader(), num_workers=1, mode="overwrite")
    elif system == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=out, columns={"tokens": "ndarray:int32"}) as w:
            for d in docs:
                w.write({"tokens": d})
    with open(os.path.join(out, ".complete"), "w") as f:
        f.write("ok")
    return out


def measure(system: str, path: str, seq_len: int, batch: int, epochs: int,
            docs: int, mean_len: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    epoch: Any  # a callable: an iterator over one epoch's batches
    if system in ("feedpipe", "feedpipe-numpy"):
        import feedpipe

        if system == "feedpipe-numpy":  # as where the C extension did not build
            from feedpipe.stream import _packed

            _packed._packrows = None
        ds = feedpipe.FeedDataset(path, shuffle=True, seed=0)
        loader = feedpipe.FeedLoader(feedpipe.Packed(ds, seq_len), batch_size=batch)
        epoch = loader.__iter__

        def count(b: Any) -> int:
            return int(b["input_ids"].numel())
    elif system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        ld = StreamingDataset(path, item_loader=TokensLoader(block_size=seq_len), shuffle=True)
        epoch = StreamingDataLoader(ld, batch_size=batch, num_workers=0).__iter__

        def count(b: Any) -> int:
            return int(b.numel())
    elif system == "floor":
        epoch = _floor(docs, mean_len, seq_len, batch)

        def count(b: Any) -> int:
            return int(b["input_ids"].numel())
    else:
        from streaming import StreamingDataset as SD

        sd = SD(local=path, shuffle=True, shuffle_seed=0, batch_size=batch)

        def packed() -> Any:
            import torch

            buf: list[np.ndarray] = []
            have = 0
            rows: list[np.ndarray] = []
            for s in sd:
                buf.append(s["tokens"])
                have += len(s["tokens"])
                while have >= seq_len:
                    flat = np.concatenate(buf)
                    rows.append(flat[:seq_len])
                    buf, have = [flat[seq_len:]], have - seq_len
                    if len(rows) == batch:
                        yield torch.from_numpy(np.stack(rows).astype(np.int64))
                        rows = []
            if have:
                rows.append(np.concatenate(buf))
            if rows:
                yield [torch.from_numpy(r.astype(np.int64)) for r in rows]
        epoch = packed

        def count(b: Any) -> int:
            return int(b.numel()) if hasattr(b, "numel") else sum(int(r.numel()) for r in b)
    setup = time.perf_counter() - t0
    walls, cpus, tokens = [], [], []
    ttfb = 0.0
    for e in range(epochs):
        t1, c1 = time.perf_counter(), time.process_time()
        it = epoch()
        first = next(it)
        if e == 0:
            ttfb = time.perf_counter() - t1
        n = count(first)
        for b in it:
            n += count(b)
        walls.append(time.perf_counter() - t1)
        cpus.append(time.process_time() - c1)
        tokens.append(n)
    steady_wall = float(np.median(walls[1:])) if epochs > 1 else float("nan")
    steady_cpu = float(np.median(cpus[1:])) if epochs > 1 else float("nan")
    return {"system": system, "tokens": tokens[0], "setup_s": setup, "first_batch_s": ttfb,
            "epoch_s": walls[0], "tokens_per_s": tokens[0] / walls[0], "cpu_s": cpus[0],
            "tokens_per_cpu_s": tokens[0] / max(cpus[0], 1e-9),
            "steady_epoch_s": steady_wall, "steady_tokens_per_s": tokens[-1] / steady_wall,
            "steady_cpu_s": steady_cpu,
            "steady_tokens_per_cpu_s": tokens[-1] / max(steady_cpu, 1e-9),
            "epoch_walls_s": walls, "epoch_cpus_s": cpus,
            "peak_rss_bytes": peak_rss()}


def _floor(docs: int, mean_len: int, seq_len: int, batch: int) -> Any:
    """The floor's epochs: every batch's three int64 fields written by numpy and nothing else
    (the corpus's tokens read in order: no shuffle, no pieces, no padding row)."""
    import torch

    flat = np.concatenate(corpus(docs, mean_len))
    n = batch * seq_len
    ramp = np.tile(np.arange(seq_len, dtype=np.int64), batch)

    def epoch() -> Any:
        for lo in range(0, len(flat) - n + 1, n):
            buf = np.empty((3, n), dtype=np.int64)
            ids, pos, labels = buf
            ids[:] = flat[lo:lo + n]
            labels[:] = ids
            pos[:] = ramp
            yield {"input_ids": torch.from_numpy(ids.reshape(batch, seq_len)),
                   "position_ids": torch.from_numpy(pos.reshape(batch, seq_len)),
                   "labels": torch.from_numpy(labels.reshape(batch, seq_len))}
    return epoch


def peak_rss() -> int:
    """This process's peak resident set (``VmHWM``: ``ru_maxrss`` keeps the high-water mark of
    the process that started it, here the one holding the whole corpus)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PEERS = ("litdata", "streaming")
FIGURES = {  # ratio name -> the per-system figure it compares
    "steady": "steady_tokens_per_s", "steady_cpu": "steady_tokens_per_cpu_s",
    "first": "tokens_per_s", "first_cpu": "tokens_per_cpu_s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--mean-len", type=int, default=600)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=6, help="epochs per process (>= 2)")
    ap.add_argument("--passes", type=int, default=9)
    ap.add_argument("--root", default=default_root("packed"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "packed.json"))
    ap.add_argument("--measure", nargs=2, metavar=("SYSTEM", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.epochs < 2:
        ap.error("--epochs must be at least 2: the steady figure is epochs 2..N")
    if a.measure:
        print(json.dumps(measure(a.measure[0], a.measure[1], a.seq_len, a.batch, a.epochs,
                                 a.docs, a.mean_len)))
        return
    load_before = list(os.getloadavg())
    docs = corpus(a.docs, a.mean_len)
    paths, skipped = {}, {}
    for system in ("feedpipe", "litdata", "streaming"):
        try:
            paths[system] = prepare(system, os.path.join(a.root, f"{a.docs}-{a.mean_len}"), docs)
        except Exception as e:  # noqa: BLE001  (a peer that does not import is left out, said)
            skipped[system] = f"does not import here: {type(e).__name__}: {e}"
            if system == "streaming" and importlib.util.find_spec("torchvision") is None:
                skipped[system] += STREAMING_NEEDS_TORCHVISION
    paths["floor"] = "-"  # made in its own process from the corpus's seed
    from feedpipe.stream._packed import piece_copier

    if piece_copier() != "numpy":  # feedpipe as where its C extension did not build, too
        paths["feedpipe-numpy"] = paths["feedpipe"]
    # every system's modules from their bytecode caches, as an installed package's are: the
    # first pass writes the caches where PYTHONDONTWRITEBYTECODE kept them from being written
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    passes: dict[str, list[dict[str, Any]]] = {s: [] for s in paths}
    ratios: dict[str, list[float]] = {k: [] for k in FIGURES}
    floor_share: list[float] = []  # feedpipe's steady tokens per CPU second over the floor's
    for k in range(a.passes):
        order = list(paths) if k % 2 == 0 else list(reversed(paths))
        this = {}
        for system in order:
            if system in skipped:
                continue
            cmd = [sys.executable, __file__, "--measure", system, paths[system], "--seq-len",
                   str(a.seq_len), "--batch", str(a.batch), "--epochs", str(a.epochs),
                   "--docs", str(a.docs), "--mean-len", str(a.mean_len)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode != 0:
                skipped[system] = p.stderr.strip().splitlines()[-1] if p.stderr else "failed"
                continue
            this[system] = json.loads(p.stdout.strip().splitlines()[-1])
            passes[system].append(this[system])
        peers = {s: r for s, r in this.items() if s in PEERS}
        if "feedpipe" in this and peers:
            for name, key in FIGURES.items():
                ratios[name].append(this["feedpipe"][key] / max(r[key] for r in peers.values()))
        if "feedpipe" in this and "floor" in this:
            floor_share.append(this["feedpipe"]["steady_tokens_per_cpu_s"]
                               / this["floor"]["steady_tokens_per_cpu_s"])
    results = []
    for system, rs in passes.items():
        if not rs:
            continue
        med = {key: float(np.median([r[key] for r in rs]))
               for key in ("setup_s", "first_batch_s", "epoch_s", "tokens_per_s", "cpu_s",
                           "tokens_per_cpu_s", "steady_epoch_s", "steady_tokens_per_s",
                           "steady_cpu_s", "steady_tokens_per_cpu_s")}
        results.append({"system": system, "tokens": rs[0]["tokens"], **med,
                        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                        "passes": len(rs)})
    median = {name: float(np.median(v)) if v else None for name, v in ratios.items()}

    def said(name: str) -> str:
        return (f"{median[name]:.2f}x (per pass {', '.join(f'{r:.2f}' for r in ratios[name])})"
                if median[name] is not None else "-")
    summary = ("no peer measured" if median["steady"] is None else
               f"feedpipe.Packed tokens/s over the best peer, median of {len(ratios['steady'])} "
               f"per-pass ratios.\nThe bar's figure, steady epochs (2..{a.epochs}) by wall: "
               f"{said('steady')}\nsteady epochs by CPU: {said('steady_cpu')}\n"
               f"first epoch by wall: {said('first')}\nfirst epoch by CPU: {said('first_cpu')}")
    numpy_share = [a["steady_tokens_per_cpu_s"] / b["steady_tokens_per_cpu_s"] for a, b in zip(
        passes.get("feedpipe-numpy", []), passes["feedpipe"])]
    if numpy_share:
        summary += (f"\nfeedpipe without its C extension (numpy copies the pieces), steady "
                    f"tokens per CPU second over feedpipe's: {np.median(numpy_share):.2f} "
                    f"(per pass {', '.join(f'{r:.2f}' for r in numpy_share)})")
    if floor_share:
        summary += (f"\nfeedpipe's steady tokens per CPU second over the numpy floor's (writing "
                    f"the three int64 fields only): {np.median(floor_share):.2f} (per pass "
                    f"{', '.join(f'{r:.2f}' for r in floor_share)})")
    doc = {"benchmark": "packed", "environment": environment(),
           "params": {"docs": a.docs, "mean_len": a.mean_len, "seq_len": a.seq_len,
                      "batch": a.batch, "epochs": a.epochs, "passes": a.passes,
                      "corpus_tokens": int(sum(len(d) for d in docs))},
           "results": results, "skipped": skipped,
           "steady_ratio": median["steady"], "steady_cpu_ratio": median["steady_cpu"],
           "first_ratio": median["first"], "first_cpu_ratio": median["first_cpu"],
           "ratios": ratios["steady"], "cpu_ratios": ratios["steady_cpu"],
           "first_ratios": ratios["first"], "first_cpu_ratios": ratios["first_cpu"],
           "floor_shares": floor_share, "numpy_shares": numpy_share,
           "piece_copier": piece_copier(),
           "load_before": load_before, "load_after": list(os.getloadavg()),
           "summary_text": summary}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    print(doc["summary_text"])
    for r in results:
        print(f"{r['system']:10s} steady {r['steady_tokens_per_s']:>14,.0f} tokens/s  first "
              f"epoch {r['tokens_per_s']:>14,.0f} tokens/s  first batch "
              f"{r['first_batch_s']:.3f} s  peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    for s, why in skipped.items():
        print(f"{s:10s} skipped: {why}")
    print(f"load average {os.getloadavg()}")
    from render_results import render

    render(a.out, force=True)


if __name__ == "__main__":
    main()
