"""Packed token rows: ``feedpipe.Packed`` against LitData's ``TokensLoader`` and MosaicML
Streaming on the same token corpus.

Corpus: ``--docs`` documents of random length (uniform in ``[16, 2 * --mean-len]``, seed 0) of
int32 token ids, written once per system into its own format under ``--root``: feedpipe shards
(``tokens.npy`` fields, ``write_samples``), a LitData ``optimize`` output read by
``TokensLoader(block_size=seq_len)``, an MDS dataset read by ``StreamingDataset`` and packed in
the loop (Streaming has no packer of its own). Each system runs in a fresh interpreter, one
process, no workers, batches of ``--batch`` rows of ``--seq-len`` tokens, one whole epoch;
``--passes`` passes, the systems' order reversed every other pass. Measured there: tokens
delivered per second (rows x seq_len delivered: feedpipe's one padded last row counts, LitData
leaves its short last block out; setup excluded, first batch included), time to the first batch,
peak RSS (``VmHWM``). Reported: each system's median over the passes, and the median of the
per-pass ratios of feedpipe's tokens/s to the best peer's of the same pass, and the same
ratio of tokens per CPU second of the process (the figure to read where other work shares the
cores: wall time then counts the waits for a core). feedpipe's batches
also carry ``position_ids``, ``labels`` and ``cu_seqlens``; LitData's are the token ids only.
Streaming is left out, with the reason in the JSON, where it does not import.

Usage::

    python benchmarks/bench_packed.py [--docs N] [--root DIR] [--out benchmarks/results/packed.json]
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


def measure(system: str, path: str, seq_len: int, batch: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    if system == "feedpipe":
        import feedpipe

        ds = feedpipe.FeedDataset(path, shuffle=True, seed=0)
        it: Any = iter(feedpipe.FeedLoader(feedpipe.Packed(ds, seq_len), batch_size=batch))

        def count(b: Any) -> int:
            return int(b["input_ids"].numel())
    elif system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        ld = StreamingDataset(path, item_loader=TokensLoader(block_size=seq_len), shuffle=True)
        it = iter(StreamingDataLoader(ld, batch_size=batch, num_workers=0))

        def count(b: Any) -> int:
            return int(b.numel())
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
        it = packed()

        def count(b: Any) -> int:
            return int(b.numel()) if hasattr(b, "numel") else sum(int(r.numel()) for r in b)
    setup = time.perf_counter() - t0
    t1, c1 = time.perf_counter(), time.process_time()
    first = next(it)
    ttfb = time.perf_counter() - t1
    tokens = count(first)
    for b in it:
        tokens += count(b)
    wall = time.perf_counter() - t1
    cpu = time.process_time() - c1
    return {"system": system, "tokens": tokens, "setup_s": setup, "first_batch_s": ttfb,
            "epoch_s": wall, "tokens_per_s": tokens / wall, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
            "peak_rss_bytes": peak_rss()}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--mean-len", type=int, default=600)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--root", default=default_root("packed"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "packed.json"))
    ap.add_argument("--measure", nargs=2, metavar=("SYSTEM", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], a.measure[1], a.seq_len, a.batch)))
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
    # every system's modules from their bytecode caches, as an installed package's are: the
    # first pass writes the caches where PYTHONDONTWRITEBYTECODE kept them from being written
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    passes: dict[str, list[dict[str, Any]]] = {s: [] for s in paths}
    ratios, cpu_ratios = [], []
    for k in range(a.passes):
        order = list(paths) if k % 2 == 0 else list(reversed(paths))
        this = {}
        for system in order:
            if system in skipped:
                continue
            cmd = [sys.executable, __file__, "--measure", system, paths[system], "--seq-len",
                   str(a.seq_len), "--batch", str(a.batch)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode != 0:
                skipped[system] = p.stderr.strip().splitlines()[-1] if p.stderr else "failed"
                continue
            this[system] = json.loads(p.stdout.strip().splitlines()[-1])
            passes[system].append(this[system])
        peers = [r["tokens_per_s"] for s, r in this.items() if s != "feedpipe"]
        if "feedpipe" in this and peers:
            ratios.append(this["feedpipe"]["tokens_per_s"] / max(peers))
            cpu_ratios.append(this["feedpipe"]["tokens_per_cpu_s"] / max(
                r["tokens_per_cpu_s"] for s, r in this.items() if s != "feedpipe"))
    results = []
    for system, rs in passes.items():
        if not rs:
            continue
        med = {key: float(np.median([r[key] for r in rs]))
               for key in ("setup_s", "first_batch_s", "epoch_s", "tokens_per_s", "cpu_s",
                           "tokens_per_cpu_s")}
        results.append({"system": system, "tokens": rs[0]["tokens"], **med,
                        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                        "passes": len(rs)})
    ratio = float(np.median(ratios)) if ratios else None
    cpu_ratio = float(np.median(cpu_ratios)) if cpu_ratios else None
    doc = {"benchmark": "packed", "environment": environment(),
           "params": {"docs": a.docs, "mean_len": a.mean_len, "seq_len": a.seq_len,
                      "batch": a.batch, "passes": a.passes,
                      "corpus_tokens": int(sum(len(d) for d in docs))},
           "results": results, "skipped": skipped,
           "ratios": ratios, "cpu_ratios": cpu_ratios, "load_before": load_before,
           "load_after": list(os.getloadavg()),
           "summary_text": (f"feedpipe.Packed tokens/s over the best peer: {ratio:.2f}x "
                            f"(median of {len(ratios)} per-pass ratios; "
                            f"{', '.join(f'{r:.2f}' for r in ratios)}); tokens per CPU "
                            f"second: {cpu_ratio:.2f}x (per pass "
                            f"{', '.join(f'{r:.2f}' for r in cpu_ratios)})"
                            if ratio and cpu_ratio else "no peer measured")}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    print(doc["summary_text"])
    for r in results:
        print(f"{r['system']:10s} {r['tokens_per_s']:>14,.0f} tokens/s  first batch "
              f"{r['first_batch_s']:.3f} s  peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    for s, why in skipped.items():
        print(f"{s:10s} skipped: {why}")
    print(f"load average {os.getloadavg()}")
    from render_results import render

    render(a.out, force=True)


if __name__ == "__main__":
    main()
