"""Time to the first batch of ``Packed`` over a token dataset of ``--docs`` documents, planned
from the ``.lengths.npy`` files ``feedpipe shard --tokenizer`` writes, and from the shards'
indexes and ``.npy`` headers (the same dataset with the lengths files moved away).

The dataset is made once under ``--root`` by ``feedpipe.shard_tokens`` from a JSON Lines corpus
of ``--docs`` short documents (1 to 59 tokens, seed 0) with a stand-in tokenizer (a callable:
the figure here is the reader's, not the tokenizer's). Each measurement is a fresh interpreter
with ``torch`` and ``feedpipe`` imported before the clock starts: the time from building
``FeedLoader(Packed(FeedDataset(out, shuffle=True), 2048), batch_size=8)`` to its first batch;
the two ways alternate, ``--passes`` times.

Usage::

    python benchmarks/bench_token_first_batch.py [--docs 1000000] [--passes 3] [--root DIR]
        [--out benchmarks/results/bench_token_first_batch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULT_TAG, default_root, environment, load_spec, run_worker  # noqa: E402


def _tokens(texts: list[str]) -> list[list[int]]:
    return [[len(t) % 200] * (len(t) // 2) for t in texts]


def make(root: str, docs: int) -> str:
    out = os.path.join(root, "tokens")
    if os.path.exists(os.path.join(out, "manifest.json")):
        return out
    import numpy as np

    from feedpipe import shard_tokens

    os.makedirs(root, exist_ok=True)
    src = os.path.join(root, "corpus.jsonl")
    lengths = np.random.default_rng(0).integers(1, 60, size=docs)
    with open(src, "w", encoding="utf-8") as f:
        f.writelines('{"text": "%s"}\n' % ("ab" * int(k)) for k in lengths)
    shard_tokens(src, out, tokenizer=_tokens, vocab_size=256, workers=1, chunk_bytes=8 << 20)
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: F401  (imported before the clock, as in a training script)

    from feedpipe import FeedDataset, FeedLoader, Packed

    t0 = time.perf_counter()
    loader = FeedLoader(Packed(FeedDataset(spec["out"], shuffle=True), 2048), batch_size=8)
    next(iter(loader))
    return {"first_batch_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--root", default=default_root("token-first-batch"))
    ap.add_argument("--out", default=os.path.join(HERE, "results",
                                                  "bench_token_first_batch.json"))
    a = ap.parse_args()
    if a.worker is not None:
        print(RESULT_TAG + json.dumps(worker(load_spec(a.worker))), flush=True)
        return
    out = make(a.root, a.docs)
    lengths = sorted(n for n in os.listdir(out) if n.endswith(".lengths.npy"))
    aside = os.path.join(a.root, "lengths-aside")
    os.makedirs(aside, exist_ok=True)
    got: dict[str, list[float]] = {"lengths files": [], "indexes and headers": []}
    try:
        for _ in range(a.passes):
            for way in got:
                src, dst = (aside, out) if way == "lengths files" else (out, aside)
                for n in lengths:
                    if os.path.exists(os.path.join(src, n)):
                        os.replace(os.path.join(src, n), os.path.join(dst, n))
                r = run_worker(__file__, {"out": out})
                if "error" in r:
                    sys.exit(f"{way}: {r['error']}\n{r.get('stderr_tail', '')}")
                got[way].append(r["first_batch_s"])
                print(f"{way:>20}: first batch {r['first_batch_s']:.2f} s", flush=True)
    finally:
        for n in lengths:
            if os.path.exists(os.path.join(aside, n)):
                os.replace(os.path.join(aside, n), os.path.join(out, n))
    doc = {"benchmark": "bench_token_first_batch", "docs": a.docs, "runs": got,
           "median_s": {k: statistics.median(v) for k, v in got.items()},
           "command": " ".join(sys.argv), "environment": environment(a.root)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    lines = [f"# bench_token_first_batch: Packed over {a.docs:,} token documents", "",
             "| planned from | first batch, median of "
             f"{a.passes} (s) | runs (s) |", "| --- | ---: | --- |"]
    lines += [f"| {k} | {doc['median_s'][k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |"
              for k, v in got.items()]
    lines += ["", f"Machine: {doc['environment']['cpu_count']} cores, load at start "
                  f"{doc['environment'].get('loadavg_at_start')}. Command: `{doc['command']}`",
              ""]
    with open(a.out[:-5] + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
