"""Bar chart of bench_peers.py's results: one panel per phase, one bar per system (feedpipe
highlighted), the value as a ratio to the fastest peer written on each bar.

Usage::

    python benchmarks/plot_peers.py [--quick] [--out benchmarks/results/bench_peers.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from peer_report import FP, LABEL  # noqa: E402

ORDER = ("feedpipe", "feedpipe-store", "feedpipe-threads", "files", "wds", "wids", "mosaic",
         "litdata", "dali")


def panels(summ: dict) -> list[tuple[str, dict, str, bool]]:
    """(title, column, key, lower-is-better) for every phase present."""
    out = []
    img, tiny = summ.get("images", {}), summ.get("tiny", {})
    for ds_name, s in (("images", img), ("tiny", tiny)):
        if "convert" in s:
            out.append((f"conversion, {ds_name}: files/s", s["convert"], "files_per_s", False))
    for nw in (0, 2):
        for ds_name, s in (("images", img), ("tiny", tiny)):
            if f"read-nw{nw}" in s:
                out.append((f"raw read, {ds_name}, {nw} workers: samples/s", s[f"read-nw{nw}"],
                            "samples_per_s", False))
    for nw in (0, 2):
        if f"decode-nw{nw}" in img:
            out.append((f"decode+crop 224+batch, {nw} workers: images/s (epoch 1)",
                        img[f"decode-nw{nw}"], "samples_per_s", False))
        if f"second-nw{nw}" in img:
            out.append((f"second epoch, {nw} workers: images/s", img[f"second-nw{nw}"],
                        "samples_per_s", False))
    for nw in (0, 2):
        if f"decode-nw{nw}" in img:
            out.append((f"peak RSS (decode), {nw} workers: MB", img[f"decode-nw{nw}"],
                        "peak_rss_bytes", True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=None, help="the JSON (default: bench_peers[-quick])")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    name = "bench_peers" + ("-quick" if a.quick else "")
    src = a.results or os.path.join(common.RESULTS, name + ".json")
    out = a.out or os.path.join(common.RESULTS, name + ".png")
    with open(src, encoding="utf-8") as f:
        doc = json.load(f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels(doc["summary"])
    cols = 3
    rows = -(-len(ps) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 4.2, rows * 2.6), squeeze=False)
    for ax, (title, col, key, low) in zip(axes.flat, ps):
        names = [s for s in ORDER if s in col]
        vals = [(col[s].get(key) or 0) / (1e6 if "bytes" in key else 1) for s in names]
        colors = ["#d62728" if s in FP else "#7f7f7f" for s in names]
        ax.barh(range(len(names)), vals, color=colors)
        ax.set_yticks(range(len(names)), [LABEL[s].replace("PyTorch DataLoader, files",
                                                           "DataLoader+files") for s in names],
                    fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title + (" (lower is better)" if low else ""), fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        top = max(vals) if vals else 1
        for i, s in enumerate(names):
            r = col[s].get(f"{key}_ratio")
            why = col[s].get("why") or ""
            txt = f"{r:.2f}x" if r is not None else ("pending" if why.startswith("pending")
                                                     else "error" if why.startswith("error")
                                                     else "n/a")
            ax.text(vals[i] + top * 0.01, i, txt, va="center", fontsize=6)
        ax.set_xlim(0, top * 1.25 or 1)
    for ax in list(axes.flat)[len(ps):]:
        ax.axis("off")
    env = doc["environment"]
    fig.suptitle(f"feedpipe vs peers ({'quick' if doc['quick'] else 'full'} datasets), "
                 f"{env['cpu_affinity']} cores {env['cpu_model']}; ratio = to the fastest peer",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=60)
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
