"""``feedpipe probe --plot``: read-throughput curves and a stage bar chart in one PNG, drawn from
the report dict alone. Needs the ``plot`` extra (matplotlib), imported only here."""

from __future__ import annotations

from typing import Any

from .dependency import require

_COLOURS = {"cold": "tab:blue", "warm": "tab:orange", "remote": "tab:green"}


def plot(doc: dict[str, Any], path: str) -> str:
    """Write the probe report ``doc`` (``ProbeReport.to_dict()``) as a PNG at ``path``."""
    require("matplotlib", extra="plot", purpose="feedpipe probe --plot")
    import matplotlib

    matplotlib.use("Agg")  # no display needed; called before pyplot is imported
    import matplotlib.pyplot as plt

    from .errors import OutputError

    fig, (ax_seq, ax_stage) = plt.subplots(1, 2, figsize=(12, 4.5))
    cells = doc["storage"]["sequential"]["cells"]
    styles = ["-", "--", ":", "-.", (0, (5, 1))]
    for cache in ("cold", "warm", "remote"):
        mine = [c for c in cells if c["cache"] == cache]
        for i, t in enumerate(sorted({c["threads"] for c in mine})):
            pts = sorted((c["block_bytes"], c["mb_per_s"] or 0) for c in mine if c["threads"] == t)
            ax_seq.plot([b / 1024 for b, _ in pts], [m for _, m in pts], marker="o",
                        linestyle=styles[i % len(styles)], color=_COLOURS[cache],
                        label=f"{cache}, {t} thread{'s' if t > 1 else ''}")
    ax_seq.set_xscale("log", base=2)
    ticks = sorted({c["block_bytes"] for c in cells})
    ax_seq.set_xticks([b / 1024 for b in ticks],
                      [f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K" for b in ticks])
    ax_seq.set_xlabel("block size")
    ax_seq.set_ylabel("MB/s")
    ax_seq.set_title("Sequential read")
    if cells:
        ax_seq.legend(fontsize=7, ncol=2)
    else:
        ax_seq.text(0.5, 0.5, "not measured", ha="center", transform=ax_seq.transAxes)

    v = doc["verdict"]
    stages = [(k, x) for k, x in v["stage_samples_per_s"].items() if x]
    names = [k for k, _ in stages]
    colours = ["tab:red" if k == v["bounding_stage"] else "tab:gray" for k in names]
    ax_stage.barh(names, [x for _, x in stages], color=colours)
    ax_stage.set_xscale("log")
    ax_stage.set_xlabel(f"samples/s with {v['parallelism']} worker(s)")
    title = "Pipeline stages"
    if v["ceiling_samples_per_s"]:
        ax_stage.axvline(v["ceiling_samples_per_s"], color="k", linestyle="--", linewidth=1)
        title += f" (ceiling {v['ceiling_samples_per_s']:,.0f}/s, {v['bounding_stage']} bounds)"
    if v["demand_samples_per_s"]:
        ax_stage.axvline(v["demand_samples_per_s"], color="tab:purple", linewidth=1,
                         label="accelerator demand")
        ax_stage.legend(fontsize=7)
    ax_stage.set_title(title, fontsize=10)
    if not stages:
        ax_stage.text(0.5, 0.5, "no per-sample stages", ha="center", transform=ax_stage.transAxes)
    fig.suptitle(f"feedpipe probe {doc['target']['url']}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the plot ({e.strerror})") from e
    finally:
        plt.close(fig)
    return path
