"""Packed rows with and without worker processes: ``feedpipe.Packed`` read with 0 workers, with
``num_workers=2`` on the route the loader picks by itself, and with ``num_workers=2`` forced onto
the ``packed-workers`` route, on a long-tailed token corpus, no transform.

Corpus: ``--docs`` documents (default 20,000) of int32 token ids whose lengths are log-normal
(seed 0; mean about 596 tokens, about 4% longer than a 2,048-token row), written once under
``--root`` with ``write_samples``. Each configuration runs in a fresh interpreter: ``--epochs``
epochs of batches of ``--batch`` rows of ``--seq-len`` tokens (persistent workers), the loop
counting the tokens of each batch (``--touch``: also summing its ``input_ids``, which reads
every token once, as a copy to a device would). ``--passes`` passes, the configurations' order
alternated (:func:`common.alternating`). Per configuration and pass: the first epoch (worker
start-up included) and the steady epochs (median of epochs 2..N), by wall time and by CPU time
(the training process's and its workers' together, read from ``/proc``), and the route taken
with the log record that explains it.

The figures to read: the per-pass ratio of each 2-worker configuration's steady tokens/s to
0 workers' in the same pass, its median over passes (the goal for ``packed-workers`` is at
least 0.8; the route picked by itself must not be slower than 0 workers), and the load average
beside them (the machine may be shared).

Two more configurations read the documents through a transform costing CPU per document
(:func:`tokenise`, a stand-in for a tokeniser), ``--transform-epochs`` epochs each: 0 workers, and
2 workers on the route the loader picks (``packed-workers``: the workers share the transform);
their ratio is against 0 workers with the same transform.

``--before DIR``: also run every configuration with the ``feedpipe`` of another checkout (its
C extensions built; ``PYTHONPATH=DIR`` for its runs), in the same passes, alternated with this
tree's; its configurations are named with `` (before)`` and compared with its own 0 workers.

Usage::

    python benchmarks/bench_packed_workers.py [--docs 20000] [--epochs 6] [--passes 3]
        [--transform-epochs 3] [--touch] [--root DIR] [--name bench_packed_workers]
        [--configs "0 workers;..."] [--before DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402  (beside this script)
    alternating,
    default_root,
    emit,
    environment,
    finish,
    fmt,
    load_spec,
    median,
    run_worker,
    spread,
    table,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "0 workers": {"num_workers": 0, "route": "auto"},
    "2 workers, auto route": {"num_workers": 2, "route": "auto"},
    "2 workers, packed-workers": {"num_workers": 2, "route": "packed-workers"},
    # a transform costing CPU per document (tokenise): workers have work to share
    "0 workers, tokenise": {"num_workers": 0, "route": "auto", "transform": True},
    "2 workers, tokenise, auto route": {"num_workers": 2, "route": "auto", "transform": True,
                                        "base": "0 workers, tokenise"},
}


def tokenise(sample: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for a tokenising transform, costing CPU per document: the document's bytes
    parsed (``np.load``), and each id hashed into a 50,000-id vocabulary four times over."""
    import io

    ids = np.load(io.BytesIO(bytes(sample["tokens.npy"]))).astype(np.int64)
    for _ in range(4):
        ids = (ids * 2654435761 + 40503) % 50_000
    return {"tokens.npy": ids}


def lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.maximum(1, rng.lognormal(5.89, 1.0, size=n)).astype(np.int64)


def make_corpus(root: str, n: int) -> dict[str, Any]:
    from feedpipe.convert._shard_writer import write_samples

    ls = lengths(n)
    path = os.path.join(root, f"corpus-{n}")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        rng = np.random.default_rng(1)
        write_samples(({"__key__": f"d{i:06d}",
                        "tokens.npy": rng.integers(0, 50_000, size=int(k), dtype=np.int32)}
                       for i, k in enumerate(ls.tolist())), path, max_samples=2000)
    return {"path": path, "documents": n, "tokens": int(ls.sum()),
            "mean_tokens": float(ls.mean()), "longer_than_2048": int((ls > 2048).sum())}


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) of processes ``pids``, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import logging

    import feedpipe

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("feedpipe").addHandler(Keep(logging.INFO))
    cfg = CONFIGS[spec["config"]]
    kw: dict[str, Any] = {"persistent_workers": True} if cfg["num_workers"] else {}
    transform = tokenise if cfg.get("transform") else None
    ld = feedpipe.FeedLoader(
        feedpipe.Packed(feedpipe.FeedDataset(spec["path"], shuffle=True, seed=0,
                                             transform=transform), spec["seq_len"]),
        batch_size=spec["batch"], num_workers=cfg["num_workers"], route=cfg["route"], **kw)
    touch = spec["touch"]
    epochs = []
    pids: list[int] = []
    for _ in range(spec["transform_epochs"] if transform else spec["epochs"]):
        c0, w0 = time.process_time(), _cpu_of(pids)
        t0 = time.perf_counter()
        n = 0
        check = 0
        for b in ld:
            ids = b["input_ids"]
            n += ids.numel()
            if touch:
                check += int(ids.sum())
        wall = time.perf_counter() - t0
        pids = ld.stats().get("worker_pids", [])
        here = time.process_time() - c0
        # the workers' CPU this epoch (their first epoch: since they started)
        workers = _cpu_of(pids) - (w0 if epochs else 0.0)
        epochs.append({"tokens": n, "wall_s": wall, "cpu_main_s": here, "cpu_workers_s": workers,
                       "tokens_per_s": n / wall, "tokens_per_cpu_s": n / (here + workers)})
    stats = ld.stats()
    return {"route": stats["route"], "messages": stats.get("messages"),
            "buffers": stats.get("buffers"), "log": said, "epochs": epochs}


BEFORE = " (before)"  # the configurations run with --before's feedpipe


def _tree(path: str | None) -> None:
    """The ``feedpipe`` the next worker imports: ``path`` (``None``: as this process was
    started)."""
    if path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--transform-epochs", type=int, default=3)
    ap.add_argument("--configs", default=";".join(CONFIGS),
                    help="the configurations to run, separated by ';' (default: all)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--touch", action="store_true")
    ap.add_argument("--root", default=default_root("packed-workers"))
    ap.add_argument("--name", default="bench_packed_workers")
    ap.add_argument("--before", help="a checkout whose feedpipe runs beside this tree's")
    a = ap.parse_args()
    if a.worker:
        emit(worker(load_spec(a.worker)))
        return 0
    t_start = time.perf_counter()
    os.makedirs(a.root, exist_ok=True)
    corpus = make_corpus(a.root, a.docs)
    doc: dict[str, Any] = {"benchmark": a.name, "environment": environment(a.root),
                           "args": {k: v for k, v in vars(a).items() if k != "worker"},
                           "corpus": corpus, "passes": [], "errors": []}
    failed = False
    chosen = [n for n in CONFIGS if n in a.configs.split(";")]
    names = chosen + ([f"{n}{BEFORE}" for n in chosen] if a.before else [])
    here = os.environ.get("PYTHONPATH")
    for p in range(a.passes):
        run: dict[str, Any] = {"order": alternating(names, p), "loadavg": None,
                               "loadavg_before": list(os.getloadavg()), "results": {}}
        for name in run["order"]:
            before = name.endswith(BEFORE)
            _tree(a.before if before else here)
            res = run_worker(__file__, {"config": name.removesuffix(BEFORE),
                                        "path": corpus["path"],
                                        "seq_len": a.seq_len, "batch": a.batch,
                                        "epochs": a.epochs, "touch": a.touch,
                                        "transform_epochs": a.transform_epochs})
            _tree(here)
            if "error" in res:
                failed = True
                doc["errors"].append({"pass": p, "config": name, **res})
                print(f"pass {p} {name}: FAILED {res['error']}\n{res.get('stderr_tail', '')}")
                continue
            ep = res["epochs"]
            res["first"] = ep[0]
            res["steady_tokens_per_s"] = median(e["tokens_per_s"] for e in ep[1:])
            res["steady_tokens_per_cpu_s"] = median(e["tokens_per_cpu_s"] for e in ep[1:])
            run["results"][name] = res
            print(f"pass {p} {name}: route {res['route']}, steady "
                  f"{fmt(res['steady_tokens_per_s'] / 1e6, 1)}M tokens/s, "
                  f"{fmt(res['steady_tokens_per_cpu_s'] / 1e6, 1)}M tokens/CPU s")
        run["loadavg"] = list(os.getloadavg())
        run["ratio_to_0_workers"] = {}
        for name, r in run["results"].items():  # each against 0 workers with its transform
            tag = BEFORE if name.endswith(BEFORE) else ""
            base = run["results"].get(
                CONFIGS[name.removesuffix(BEFORE)].get("base", "0 workers") + tag)
            if base is None:
                continue
            run["ratio_to_0_workers"][name] = {
                "wall": r["steady_tokens_per_s"] / base["steady_tokens_per_s"],
                "cpu": r["steady_tokens_per_cpu_s"] / base["steady_tokens_per_cpu_s"],
                "first_epoch_wall": r["first"]["tokens_per_s"] / base["first"]["tokens_per_s"]}
        doc["passes"].append(run)
    rows = []
    summary: dict[str, Any] = {}
    for name in names:
        got = [r for r in doc["passes"] if name in r["results"]]
        ratios = [r["ratio_to_0_workers"][name] for r in got if name in r["ratio_to_0_workers"]]
        summary[name] = {
            "route": sorted({r["results"][name]["route"] for r in got}),
            "steady_tokens_per_s": median(r["results"][name]["steady_tokens_per_s"]
                                          for r in got),
            "steady_tokens_per_cpu_s": median(r["results"][name]["steady_tokens_per_cpu_s"]
                                              for r in got),
            "ratio_wall": median(x["wall"] for x in ratios),
            "ratio_wall_spread": spread(x["wall"] for x in ratios),
            "ratio_cpu": median(x["cpu"] for x in ratios),
            "ratio_first_epoch_wall": median(x["first_epoch_wall"] for x in ratios),
        }
        s = summary[name]
        rows.append([name, ",".join(s["route"]),
                     fmt((s["steady_tokens_per_s"] or 0) / 1e6, 1),
                     fmt((s["steady_tokens_per_cpu_s"] or 0) / 1e6, 1),
                     fmt(s["ratio_wall"], 2), fmt(s["ratio_cpu"], 2),
                     fmt(s["ratio_first_epoch_wall"], 2)])
    doc["summary"] = summary
    loads = [r["loadavg"][0] for r in doc["passes"]]
    text = [table(rows, ["configuration", "route", "steady M tok/s", "M tok/CPU s",
                         "x 0 workers (wall)", "x 0 workers (CPU)", "x first epoch"]),
            f"\n\nload average (1 min) after each pass: {', '.join(f'{x:.1f}' for x in loads)}"
            f"; corpus {corpus['documents']} documents, mean {corpus['mean_tokens']:.0f} "
            f"tokens, {corpus['longer_than_2048']} longer than 2,048\n"]
    print("".join(text))
    return finish(a.name, doc, text, [], failed, t_start)


if __name__ == "__main__":
    sys.exit(main())
