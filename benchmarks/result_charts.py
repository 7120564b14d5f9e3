"""The headline chart of each benchmark's result set: which figures of its JSON are plotted, and
the horizontal bar chart they are drawn as (``render_results.py`` calls :func:`write_chart`).

One function per benchmark picks the figures (``CHARTS``, keyed by the benchmark's name without
``bench_``); they only read the JSON, never compute a figure it does not hold, and leave out a
panel whose figures are absent (a quick or CPU-only run has fewer). Drawing is matplotlib's Agg
backend: one panel per row, a log axis only where a panel's values span more than two orders of
magnitude, the value written beside every bar, the legend outside the axes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from result_tables import number

FEEDPIPE = "#d62728"
PEER = "#8c8c8c"
PLAIN = "#1f77b4"
LOG_SPAN = 100.0  # max/min above which a panel gets a log axis


@dataclass
class Panel:
    """One bar chart: a bar (per series) for each label."""

    title: str
    unit: str
    labels: list[str]
    series: dict[str, list[float | None]]  # legend entry -> one value per label ("" alone: none)
    lower_is_better: bool = False
    refs: dict[str, float] = field(default_factory=dict)  # dashed reference lines


def get(node: Any, path: str) -> Any:
    """``node["a"]["b"]`` for ``path`` ``"a/b"`` (``"a.b"`` inside a record); None if absent."""
    for part in path.replace(".", "/").split("/") if path else ():
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def panel(title: str, unit: str, rows: Mapping[str, Any] | None, keys: str | Mapping[str, str],
          *, scale: float = 1.0, lower: bool = False,
          refs: Mapping[str, Any] | None = None) -> Panel | None:
    """A panel of ``rows`` (label -> record): ``keys`` is one key (one series) or legend ->
    key; a row whose figures are all absent is left out, and so is a panel with none."""
    if not rows:
        return None
    keymap = {"": keys} if isinstance(keys, str) else dict(keys)
    labels: list[str] = []
    series: dict[str, list[float | None]] = {s: [] for s in keymap}
    for label, rec in rows.items():
        vals = [_num(rec if k == "" else get(rec, k)) for k in keymap.values()]
        if all(v is None for v in vals):
            continue
        labels.append(label)
        for s, v in zip(keymap, vals):
            series[s].append(None if v is None else v * scale)
    series = {s: vs for s, vs in series.items() if any(v is not None for v in vs)}
    if not labels:
        return None
    ref = {k: v * scale for k, v in (refs or {}).items() if _num(v) is not None}
    return Panel(title, unit, labels, series, lower, ref)


def _pick(d: Mapping[str, Any] | None, keep: Callable[[str], bool]) -> dict[str, Any]:
    return {k: v for k, v in (d or {}).items() if keep(k)}


# -- one function per benchmark -------------------------------------------------------------------

def _convert(doc: dict) -> list[Panel | None]:
    return [panel(f"{ds}: conversion rate (median of passes)", "source files/s",
                  d.get("systems"), "files_per_s") for ds, d in doc.get("datasets", {}).items()]


def _dask(doc: dict) -> list[Panel | None]:
    st = doc.get("stats", {})
    return [panel("conversion rate (median of passes)", "files/s", st, "files_per_s"),
            panel("coordination cost: wall time per no-op task", "ms per task",
                  _pick(st, lambda k: k.startswith("noop")), "wall_per_task_ms", lower=True)]


def _listing(doc: dict) -> list[Panel | None]:
    st = doc.get("stats", {})
    return [panel("listing rate (median of passes)", "files/s", st, "files_per_s"),
            panel("peak RSS growth of the lister", "MB", st, "rss_growth_mb", lower=True)]


def _plan(doc: dict) -> list[Panel | None]:
    res = doc.get("results", {})
    ids = _pick(res, lambda k: k.startswith("ids-"))
    rest = _pick(res, lambda k: not k.startswith("ids-"))
    return [panel("time to plan an epoch (median of reps)", "seconds", rest, "median_s",
                  lower=True, refs={"target": get(doc, "targets/seconds")}),
            panel("peak RSS growth while planning", "MB", rest, "peak_rss_delta_bytes",
                  scale=1e-6, lower=True, refs={"target": get(doc, "targets/bytes")}),
            panel("sample ids produced from the plan", "ids/s", ids, "samples_per_s")]


def _read(doc: dict) -> list[Panel | None]:
    how = "steady state" if get(doc, "settings/steady") else "median of passes"
    return [panel(f"{ds}: read rate ({how})", "samples/s", d.get("systems"), "samples_per_s")
            for ds, d in doc.get("datasets", {}).items()]


def _resume(doc: dict) -> list[Panel | None]:
    rows: dict[str, Any] = {"naive (setup + reading up to 90%)": doc.get("naive_resume_s")}
    rows.update({k: v.get("start_cost_s") for k, v in doc.get("summary", {}).items()})
    return [panel("start cost: setup + the first batch (of the resumed epoch for resume-*)",
                  "seconds", rows, "", lower=True)]


def _shuffle(doc: dict) -> list[Panel | None]:
    return [panel(f"{world}: distinct classes per batch (mean; 'random' is a full permutation)",
                  "classes per batch", systems, "classes_mean.mean")
            for world, systems in doc.get("results", {}).items()]


def _decode(doc: dict) -> list[Panel | None]:
    return [panel(f"{name}: decode + resize to 224 (median of passes)", "images/s", systems,
                  "images_per_s_median") for name, systems in doc.get("results", {}).items()]


def _device(doc: dict) -> list[Panel | None]:
    copy = {f"{r.get('mb')} MB": r for r in get(doc, "copy/rows") or []}
    step = dict(get(doc, "step/systems") or {})
    if step:
        step["compute alone"] = {"ms_per_step": get(doc, "step/compute_ms_per_step")}
    cache = {"DeviceCache gather": get(doc, "cache/gather_GBps"),
             "gather, half resident": get(doc, "cache/half_resident/gather_GBps"),
             "device-to-device copy": get(doc, "cache/device_copy_GBps")}
    dali = {"DALI": get(doc, "dali/dali_images_per_s"),
            "DALI, premade feed": get(doc, "dali/dali_premade_feed_images_per_s"),
            "CPU pipeline": get(doc, "dali/cpu_pipeline_images_per_s")}
    what = "host memcpy" if get(doc, "copy/mode") == "cpu" else "host-to-device copy"
    return [panel(what, "GB/s", copy, {"pageable": "pageable_GBps", "pinned": "pinned_GBps",
                                       "host memcpy": "host_memcpy_GBps"}),
            panel("training step fed three ways", "ms per step", step, "ms_per_step", lower=True),
            panel("DeviceCache gather against a plain copy", "GB/s", cache, ""),
            panel("image pipeline", "images/s", dali, "")]


def _eviction(doc: dict) -> list[Panel | None]:
    sim = {f"{r.get('shape')}, {r.get('order')}": r for r in get(doc, "simulation/rows") or []}
    real = {"real run": get(doc, "real/hit_ratio"),
            "simulated plan": get(doc, "real/simulated_same_config/plan"),
            "simulated LRU": get(doc, "real/simulated_same_config/lru")}
    return [panel("simulation: hit ratio after the first epoch", "hit ratio", sim,
                  {"LRU": "lru.warm", "plan": "plan.warm", "optimal": "optimal.warm"}),
            panel("real run against the simulation of the same configuration", "hit ratio",
                  real, {"all epochs": "all", "after the first epoch": "warm"})]


def _hash(doc: dict) -> list[Panel | None]:
    summ = doc.get("summary", {})
    algos = list(dict.fromkeys(a for per in summ.values() for a in per))
    return [panel("hashing rate by input size (median of rounds)", "GB/s", summ,
                  {a: f"{a}/gb_per_s" for a in algos})]


def _probe_fio(doc: dict) -> list[Panel | None]:
    rows = {}
    for r in doc.get("summary", []):
        for temp in ("cold", "warm"):
            mib = (r.get("block_bytes") or 0) / 2**20
            t = r.get("threads")
            rows[f"{mib:g} MiB blocks x {t} thread{'' if t == 1 else 's'}, {temp}"] = r.get(temp)
    return [panel("sequential read: feedpipe probe against fio (median of passes)", "MB/s",
                  rows, {"fio": "fio_mb_per_s", "feedpipe probe": "probe_mb_per_s"})]


def _resize(doc: dict) -> list[Panel | None]:
    return [panel("crop + resize to 224 + flip, one core (median of rounds)", "ms per image",
                  doc.get("ms_per_image"), "", lower=True)]


def _tiers(doc: dict) -> list[Panel | None]:
    rows = _pick(doc.get("summary"), lambda k: not k.startswith("_"))
    return [panel("samples/s through each cache tier (median of passes)", "samples/s", rows,
                  {"epoch 1": "epoch1", "epoch 2": "epoch2"})]


def _window_decode(doc: dict) -> list[Panel | None]:
    return [panel("whole decode against window-only decode (median of rounds)", "µs per image",
                  doc.get("results"), {"whole": "us_per_image.whole",
                                       "window": "us_per_image.window"}, lower=True)]


def _cache_budget(doc: dict) -> list[Panel | None]:
    return [panel("cache directory size", "MB", doc.get("results"),
                  {"peak": "peak_bytes", "after the run": "bytes_after"}, scale=1e-6,
                  lower=True, refs={"budget (cache_size)": doc.get("budget_bytes"),
                                    "bound": doc.get("bound_bytes")})]


def _device_cache(doc: dict) -> list[Panel | None]:
    res = doc.get("result", {})
    rows = {"served, whole epoch": res.get("epoch_GBps"),
            "served, steady": res.get("steady_GBps"),
            "copy of the same batches": res.get("copy_same_batches_GBps"),
            "peak copy": res.get("peak_copy_GBps")}
    return [panel(f"DeviceCache serving on {res.get('device')}", "GB/s", rows, ""),
            panel("gather kernels", "GB/s", res.get("kernels_GBps"), "")]


def _versions(doc: dict) -> list[Panel | None]:
    unit = {"decode": "images/s"}
    return [panel(f"{phase}: before ({doc.get('before')}) and after (median of passes)",
                  unit.get(phase, "samples/s"), rows, "median_rate")
            for phase, rows in doc.get("summary", {}).items()]


def _image_formats(doc: dict) -> list[Panel | None]:
    dec = doc.get("decode", {})
    names = list(dict.fromkeys(n for f in dec.values() for n in f.get("decoders", {})))
    return [panel("decode to RGB uint8 (median of passes)", "µs per image", dec,
                  {n: f"decoders/{n}/us_per_image" for n in names}, lower=True),
            panel("ImagePipeline(224, train=True) per sample (median of passes)",
                  "µs per sample", doc.get("pipeline"), "us_per_image", lower=True)]


def _packed(doc: dict) -> list[Panel | None]:
    rows = {r["system"]: r for r in doc.get("results", [])}
    return [panel("packed rows: tokens/s (median of passes)", "tokens/s", rows,
                  {"steady epochs (the bar's figure)": "steady_tokens_per_s",
                   "first epoch": "tokens_per_s"}),
            panel("time to the first batch", "seconds", rows, "first_batch_s", lower=True),
            panel("peak RSS", "MiB", rows, "peak_rss_bytes", scale=1 / 2**20, lower=True)]


def _tiny_read(doc: dict) -> list[Panel | None]:
    rows = doc.get("summary", {})
    return [panel("raw read of tiny records (median of passes; cat: samples-equivalent)",
                  "samples/s", rows, "median_samples_per_s"),
            panel("peak RSS", "MiB", rows, "median_peak_rss_bytes", scale=1 / 2**20,
                  lower=True)]


CHARTS: dict[str, Callable[[dict], list[Panel | None]]] = {
    "convert": _convert, "dask": _dask, "listing": _listing, "plan": _plan, "read": _read,
    "resume": _resume, "shuffle": _shuffle, "decode": _decode, "device": _device,
    "eviction": _eviction, "hash": _hash, "probe_fio": _probe_fio, "resize": _resize,
    "tiers": _tiers, "window_decode": _window_decode, "cache_budget": _cache_budget,
    "device_cache": _device_cache, "versions": _versions, "image_formats": _image_formats,
    "packed": _packed, "tiny_read": _tiny_read,
}


def _mixture(doc: dict) -> list[Panel | None]:
    rows = {r["route"]: r for r in doc.get("results", [])}
    return [panel("raw batches: a mixture of three sources against one dataset of the same "
                  "samples (median of passes)", "samples/s", rows,
                  {"one dataset": "one_samples_per_s",
                   "Mixture of 3": "mixture_samples_per_s"})]


CHARTS["mixture"] = _mixture


# -- drawing --------------------------------------------------------------------------------------

def _is_feedpipe(label: str) -> bool:
    low = label.lower()
    return "feedpipe" in low or low.startswith("fp-")


def _tick(x: float, _pos: Any = None) -> str:
    """Axis numbers without matplotlib's offset and 1e6 multiplier."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{suffix}"
    return f"{x:g}"


def _draw(ax: Any, p: Panel) -> None:
    from matplotlib.ticker import FuncFormatter

    n, k = len(p.labels), len(p.series)
    height = 0.8 / k
    vals = [v for vs in p.series.values() for v in vs if v is not None] + list(p.refs.values())
    pos = [v for v in vals if v > 0]
    log = bool(pos) and max(pos) / min(pos) > LOG_SPAN
    top = max(vals) if vals else 1.0
    highlight = k == 1 and any(_is_feedpipe(lb) for lb in p.labels)
    for j, (name, vs) in enumerate(p.series.items()):
        ys: list[float] = []
        xs: list[float] = []
        colors: list[str] = []
        for i, v in enumerate(vs):
            if v is None:
                continue
            # the bars a label has, side by side and centred on it (no gap for a missing one)
            present = [s for s, col in p.series.items() if col[i] is not None]
            ys.append(i + height * (present.index(name) - (len(present) - 1) / 2))
            xs.append(v)
            colors.append(f"C{j % 10}" if k > 1 else (FEEDPIPE if _is_feedpipe(p.labels[i])
                                                      else PEER) if highlight else PLAIN)
        ax.barh(ys, xs, height=height * 0.92, color=colors, label=name or None)
        for y, x in zip(ys, xs):
            at = max(x, min(pos)) * 1.04 if log else x + top * 0.01  # a 0 on a log axis: its foot
            ax.text(at, y, number(x), va="center", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.8})
    for j, (name, v) in enumerate(p.refs.items()):
        ax.axvline(v, color="k", linestyle=("--", ":")[j % 2], linewidth=1,
                   label=f"{name}: {number(v)}")
    ax.set_yticks(range(n), p.labels, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(pos) / 2, max(pos) * 2.5)
    else:
        ax.set_xlim(min(0.0, min(vals, default=0.0)), top * 1.15 or 1)
    ax.xaxis.set_major_formatter(FuncFormatter(_tick))
    ax.set_xlabel(p.unit + (" (log scale)" if log else "") + (", lower is better"
                                                                 if p.lower_is_better else ""),
                  fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(p.title, fontsize=9, loc="left")
    if k > 1 or p.refs:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def write_chart(panels: list[Panel], title: str, subtitle: str, out: str) -> str:
    """Draw ``panels`` one below the other into the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [0.9 + 0.24 * len(p.labels) * (1 + 0.45 * (len(p.series) - 1)) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights) + 0.7), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    for ax, p in zip(axes[:, 0], panels):
        _draw(ax, p)
    fig.suptitle(f"{title.replace('`', '')}\n{subtitle}", fontsize=10, x=0.01, ha="left")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return os.path.abspath(out)
