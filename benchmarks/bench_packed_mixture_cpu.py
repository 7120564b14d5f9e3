"""CPU of a full epoch of ``Packed(Mixture)`` at 0 workers: this tree against another checkout
(``--ref``, e.g. a ``git worktree`` of main with the C extensions copied in), in alternating
passes, each pass a fresh process per tree that reads a warm-up epoch and then ``--epochs``
epochs, timed by the process's CPU clock (wall beside it); a pass's figure is the median
epoch of each process, its ratio tree / ref.

The data: ``--sources`` sources of ``--docs`` token documents each (int32, 1 to 599 tokens),
written once under ``--root``; the mixture's weights are 1, 2, ..., its epoch ``--epoch-size``
documents, ``seq_len=2048``, batches of 8 rows.

    python benchmarks/bench_packed_mixture_cpu.py --ref ../main-checkout --passes 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import default_root  # noqa: E402

sys.path.remove(HERE)

CHILD = r"""
import json, os, sys, time
from feedpipe import FeedDataset, FeedLoader, Mixture, Packed
spec = json.loads(sys.argv[1])
paths = [os.path.join(spec["root"], f"s{i:02d}") for i in range(spec["sources"])]
sources = {f"s{i:02d}": FeedDataset(p, shuffle=True) for i, p in enumerate(paths)}
w = [1.0 + i for i in range(spec["sources"])]
def epoch(e):
    packed = Packed(Mixture(sources, w, epoch_size=spec["epoch_size"], seed=1), seq_len=2048)
    ld = FeedLoader(packed, batch_size=8, num_workers=0)
    ld.set_epoch(e)
    return sum(int(b["input_ids"].shape[0]) for b in ld)
epoch(0)
out = []
for e in range(spec["epochs"]):
    c, t = time.process_time(), time.perf_counter()
    rows = epoch(e)
    out.append({"cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - t,
                "rows": rows})
print(json.dumps(out))
"""


def prepare(root: str, sources: int, docs: int) -> None:
    import numpy as np

    from feedpipe import write_samples

    rng = np.random.default_rng(0)
    for i in range(sources):
        p = os.path.join(root, f"s{i:02d}")
        if os.path.exists(os.path.join(p, "manifest.json")):
            continue
        write_samples(({"__key__": f"{i}-{j:05d}", "tokens.npy": rng.integers(
            0, 50_000, int(rng.integers(1, 600)), dtype=np.int32)} for j in range(docs)),
            p, max_samples=max(1, docs // 4))


def one(tree: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": tree}
    got = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    return list(json.loads(got.stdout.strip().splitlines()[-1]))


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Packed(Mixture) epoch CPU: tree against {doc['ref']}", "",
             f"`{doc['command']}`, {doc['when']}, load average at the start "
             f"{doc['load_start']}, at the end {doc['load_end']}.", "",
             "pass | tree CPU s/epoch | ref CPU s/epoch | ratio tree/ref | tree wall | ref wall",
             "---|---|---|---|---|---"]
    for i, p in enumerate(doc["passes"]):
        lines.append(f"{i} | {p['tree_cpu']:.4f} | {p['ref_cpu']:.4f} | {p['ratio']:.3f} | "
                     f"{p['tree_wall']:.4f} | {p['ref_wall']:.4f}")
    lines += ["", f"Median of the per-pass ratios: {doc['median_ratio']:.3f} "
              f"(rows per epoch {doc['rows']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=7)
    ap.add_argument("--sources", type=int, default=20)
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--epoch-size", type=int, default=200_000)
    ap.add_argument("--root", default=default_root("packed-mixture-cpu"))
    ap.add_argument("--name", default="bench_packed_mixture_cpu")
    a = ap.parse_args(argv)
    tree = os.path.dirname(HERE)
    sys.path.insert(0, tree)
    prepare(a.root, a.sources, a.docs)
    spec = {"root": a.root, "sources": a.sources, "epoch_size": a.epoch_size,
            "epochs": a.epochs}
    load_start = list(os.getloadavg())
    passes = []
    for i in range(a.passes):  # alternating, the first system swapped each pass
        order = [("tree", tree), ("ref", a.ref)] if i % 2 == 0 else [("ref", a.ref),
                                                                     ("tree", tree)]
        got = {name: one(path, spec) for name, path in order}
        # the median epoch of each process: an epoch slowed by another's load counts less
        cpu = {k: statistics.median(e["cpu_s"] for e in v) for k, v in got.items()}
        wall = {k: statistics.median(e["wall_s"] for e in v) for k, v in got.items()}
        assert got["tree"][0]["rows"] == got["ref"][0]["rows"]
        passes.append({"tree_cpu": cpu["tree"], "ref_cpu": cpu["ref"],
                       "ratio": cpu["tree"] / cpu["ref"], "tree_wall": wall["tree"],
                       "ref_wall": wall["ref"], "rows": got["tree"][0]["rows"]})
        print(passes[-1], flush=True)
    ratios = sorted(p["ratio"] for p in passes)
    doc = {"command": "python benchmarks/bench_packed_mixture_cpu.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "ref": os.path.basename(os.path.abspath(a.ref)), "spec": spec,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_start": load_start, "load_end": list(os.getloadavg()),
           "cores": os.cpu_count(), "passes": passes,
           "median_ratio": ratios[len(ratios) // 2], "rows": passes[0]["rows"]}
    out = os.path.join(HERE, "results", a.name)
    with open(out + ".json", "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    with open(out + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
