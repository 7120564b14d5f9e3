"""bench_versions' data and trees: the datasets each phase reads (sharded once by the working
tree) and a checkout of the ref with its C extensions built."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Any

from common import REPO


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


def bytecode(tree: str) -> None:
    """Compile ``tree``'s package to bytecode, as ``pip install`` does. Where none is written
    (``PYTHONDONTWRITEBYTECODE``, a read-only checkout), every fresh process would compile the
    modules it imports from source, and charge the version that imports more modules with their
    compiling: a first ``feedpipe.shard()`` imports the converter's modules inside its phase."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                    os.path.join(tree, "feedpipe")], check=True, capture_output=True)


def prepare(a: argparse.Namespace, phases: list[str]) -> dict[str, dict[str, Any]]:
    """Each phase's dataset, generated and sharded by the working tree once."""
    import datasets

    import feedpipe

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
    return data
