"""Chart of bench_train.py's results: per model, images/s of each system as a bar (feedpipe's
highlighted), its ratio to the synthetic-data ceiling and its data-wait fraction written on it, the
ceiling and the 97% bar as lines; a failed system is named with "failed".

Usage::

    python benchmarks/plot_train.py --results benchmarks/results/bench_train.json [--out X.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def plot(doc: dict[str, Any], out: str) -> str:
    """Write the chart of ``doc`` (bench_train's JSON) to ``out``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(doc["results"])
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        res = doc["results"][model]
        names = list(res)
        vals = [res[s].get("images_per_s") or 0.0 for s in names]
        syn = res.get("synthetic", {}).get("images_per_s")
        colors = ["#2a7" if s.startswith("feedpipe") else "#999" if s == "synthetic" else "#68c"
                  for s in names]
        ys = range(len(names))
        ax.barh(list(ys), vals, color=colors)
        ax.set_yticks(list(ys), [res[s].get("label", s) for s in names])
        ax.invert_yaxis()
        for y, s, v in zip(ys, names, vals):
            r = res[s]
            if "error" in r:
                ax.text(0, y, "  failed", va="center", color="#c33")
                continue
            wait = r.get("wait_fraction")
            txt = f" {v:,.0f}"
            if syn:
                txt += f"  {v / syn:.2f}x"
            if wait is not None:
                txt += f"  wait {100 * wait:.1f}%"
            ax.text(v, y, txt, va="center", fontsize=8)
        if syn:
            ax.axvline(syn, color="#555", lw=0.8)
            ax.axvline(0.97 * syn, color="#555", lw=0.8, ls="--")
        ax.set_xlabel("images/s (steady state)")
        ax.set_xlim(0, max(vals + [1.0]) * 1.45)
        ax.set_title(f"{model} — {doc['device']}"
                     + (f", {doc['environment'].get('gpu', '')}" if doc["device"] == "cuda"
                        else " (CPU: no GPU figure)"), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True, help="bench_train's JSON")
    ap.add_argument("--out", default=None, help="PNG path (default: beside the JSON)")
    a = ap.parse_args(argv)
    with open(a.results, encoding="utf-8") as fh:
        doc = json.load(fh)
    print(plot(doc, a.out or os.path.splitext(a.results)[0] + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
