"""``feedpipe probe --plot``: what the storage delivers and what each pipeline stage can do, in
one PNG drawn from the report dict alone. Needs the ``plot`` extra (matplotlib), imported only
here.

Each panel is drawn only where the probe measured its figures:

- sequential read curves: MB/s by block size, a line per cache state and thread count (for a
  directory of small files: their open+read rates instead);
- the stage bars: samples/s on a linear axis from zero, the bounding stage in red, the ceiling
  and the accelerator's demand as lines.

Legends sit below their axes, never on the curves. A bar far beyond the ceiling is cut at the
axis edge and labelled with its value.
"""

from __future__ import annotations

from typing import Any

from .._helpers.dependency import require

_COLOURS = {"cold": "tab:blue", "warm": "tab:orange", "remote": "tab:green"}
_STYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))]
_NAMES = {"storage": "storage", "read": "read", "decode": "decode", "batch": "batch",
          "h2d": "host-to-device"}
# the stage axis shows this many times the ceiling (or the demand, if higher): enough to see
# how far the other stages are from bounding, while the bounding one stays readable
_SPAN = 4.0


def _num(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _thousands(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _num(x) if x else "0"))


def _sequential(ax: Any, cells: list[dict[str, Any]]) -> None:
    for cache in ("cold", "warm", "remote"):
        mine = [c for c in cells if c["cache"] == cache]
        for i, t in enumerate(sorted({c["threads"] for c in mine})):
            pts = sorted((c["block_bytes"], c["mb_per_s"]) for c in mine
                         if c["threads"] == t and c["mb_per_s"])
            ax.plot([b / 1024 for b, _ in pts], [m for _, m in pts], marker="o", markersize=4,
                    linestyle=_STYLES[i % len(_STYLES)], color=_COLOURS[cache],
                    label=f"{cache}, {t} thread{'s' if t > 1 else ''}")
    ax.set_xscale("log", base=2)
    ticks = sorted({c["block_bytes"] for c in cells})
    ax.set_xticks([b / 1024 for b in ticks],
                  [f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K" for b in ticks])
    ax.minorticks_off()
    rates = [c["mb_per_s"] for c in cells if c["mb_per_s"]]
    if rates and max(rates) > 20 * min(rates):  # cold and warm differ by orders of magnitude
        ax.set_yscale("log")
    ax.set_xlabel("block size")
    ax.set_ylabel("MB/s")
    ax.set_title("Sequential read", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, ncol=min(5, max(1, len(ax.lines) // 2)), loc="upper center",
              bbox_to_anchor=(0.5, -0.16), frameon=False)


def _small_files(ax: Any, small: dict[str, list[dict[str, Any]]]) -> None:
    runs = [r for cache in ("cold", "warm", "remote") for r in small.get(cache, [])]
    labels = [f"{r['cache']}, {r['threads']} thread{'s' if r['threads'] > 1 else ''}"
              for r in runs]
    rates = [r["files_per_s"] for r in runs]
    ax.barh(labels, rates, color=[_COLOURS[r["cache"]] for r in runs])
    ax.invert_yaxis()
    ax.set_xlim(0, max(rates) * 1.25)
    for y, (r, x) in enumerate(zip(runs, rates)):
        ax.text(x, y, f" {_num(x)} files/s, {r['mb_per_s']:,.0f} MB/s", va="center",
                fontsize=8)
    mean = runs[0]["mean_file_bytes"]
    _thousands(ax)
    ax.set_xlabel("files/s")
    ax.set_title(f"Small files: open+read+close (mean {_num(mean)}B)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)


def _stages(ax: Any, v: dict[str, Any]) -> None:
    stages = [(k, x) for k, x in v["stage_samples_per_s"].items() if x]
    names = [_NAMES.get(k, k) for k, _ in stages]
    values = [x for _, x in stages]
    ceiling, demand = v["ceiling_samples_per_s"], v["demand_samples_per_s"]
    ref = max([x for x in (ceiling, demand) if x] or [min(values)])
    edge = min(max(values) * 1.15, ref * _SPAN)
    bound = v["bounding_stage"]
    colours = ["tab:red" if k == bound else "tab:gray" for k, _ in stages]
    ax.barh(names, [min(x, edge) for x in values], color=colours)
    ax.invert_yaxis()  # the order a sample meets them, top to bottom
    ax.set_xlim(0, edge * 1.18)  # room for the labels
    for y, x in enumerate(values):
        cut = x > edge
        ax.text(min(x, edge), y, f" {_num(x)}/s" + (" (off scale)" if cut else ""),
                va="center", fontsize=8, fontweight="bold" if stages[y][0] == bound else None)
    if ceiling:
        ax.axvline(ceiling, color="k", linestyle="--", linewidth=1,
                   label=f"ceiling {_num(ceiling)}/s ({bound} bounds)")
    if demand:
        ax.axvline(demand, color="tab:purple", linewidth=1.5,
                   label=f"accelerator demand {_num(demand)}/s")
    _thousands(ax)
    ax.set_xlabel(f"samples/s with {v['parallelism']} worker(s)")
    ax.set_title("Pipeline stages", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    if ceiling or demand:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False,
                  ncol=2)


PARTS = ("startup", "fetch", "compute", "sink", "wait", "step")


def _parts(ax: Any, runs: list[dict[str, Any]]) -> None:
    """Seconds per part of each FeedLoader run (``stats()["time"]``), the bounding part in red."""
    from matplotlib.patches import Patch

    height = 0.8 / len(runs)
    keys = []
    for i, r in enumerate(runs):
        t = r["time"]
        ys = [y + i * height for y in range(len(PARTS))]
        colours = ["tab:red" if k == r["bound"] else f"C{i}" for k in PARTS]
        ax.barh(ys, [t.get(k, 0.0) for k in PARTS], height=height, color=colours)
        keys.append(Patch(color=f"C{i}", label=f"{r['route']} (bound, in red: {r['bound']}; "
                                               f"wall {t['wall']:.2f} s)"))
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(PARTS))], list(PARTS))
    ax.invert_yaxis()
    ax.set_xlabel("seconds in the pass (parts in workers: their seconds added up)")
    ax.set_title("FeedLoader parts (stats()['time'])", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=keys, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16),
              frameon=False)


def figure(doc: dict[str, Any]) -> Any:
    """The probe report ``doc`` (``ProbeReport.to_dict()``) drawn as a matplotlib figure (the
    caller closes it): one panel per kind of figure measured."""
    require("matplotlib", extra="plot", purpose="feedpipe probe --plot")
    import matplotlib

    matplotlib.use("Agg")  # no display needed; called before pyplot is imported
    import matplotlib.pyplot as plt

    st, v = doc["storage"], doc["verdict"]
    cells = st["sequential"]["cells"]
    panels = []
    if cells:
        panels.append(lambda ax: _sequential(ax, cells))
    elif st.get("small_files"):
        panels.append(lambda ax: _small_files(ax, st["small_files"]))
    if any(v["stage_samples_per_s"].values()):
        panels.append(lambda ax: _stages(ax, v))
    runs = [r for r in (doc.get("pipeline") or {}).get("accounts") or [] if "time" in r]
    if runs:
        panels.append(lambda ax: _parts(ax, runs))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 4.8),
                             squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(ax)
    if not panels:
        axes[0][0].set_axis_off()
        axes[0][0].text(0.5, 0.5, "nothing measured to draw", ha="center")
    fig.suptitle(f"feedpipe probe {doc['target']['url']}", fontsize=10)
    fig.tight_layout()
    return fig


def plot(doc: dict[str, Any], path: str) -> str:
    """Write the probe report ``doc`` (``ProbeReport.to_dict()``) as a PNG at ``path``."""
    from ..errors import OutputError

    fig = figure(doc)  # checks for matplotlib and picks the Agg backend first
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    except OSError as e:
        raise OutputError(f"{path}: cannot write the plot ({e.strerror})") from e
    finally:
        plt.close(fig)
    return path
