"""The probe's verdict: which stage bounds samples/s, the predicted ceiling, the accelerator
utilisation a step time would see, and what to change. A pure function of measured figures.

The model. Storage delivers ``storage`` samples/s whatever the CPU does: its reads overlap
computation. The CPU stages (read, decode, batch) run one after another inside each DataLoader
worker. So with ``P = min(workers, cpus)`` busy processes they give
``P / (1/read + 1/decode + 1/batch)`` samples/s together. The bounding one among them is the
slowest: it takes the largest share of each sample's CPU time. Host-to-device copies run apart,
on the copy engine. The ceiling is the least of storage, CPU and host-to-device.

One verdict. Each stage is a part of the loader's own accounts (``stats()["bound"]``): storage
and read are its ``fetch``, decode its ``compute``, batch its ``sink``. Where the FeedLoader a
script gets was run and its accounts name another part than the stage rates do, the measurement
decides: the verdict names the stage of the part it measured, and says so. The advice about the
bounding part comes first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CPU_STAGES = ("read", "decode", "batch")
# each stage's part of the loader's accounts (stats()["time"]); h2d is the DeviceLoader's
PART_OF = {"storage": "fetch", "read": "fetch", "decode": "compute", "batch": "sink",
           "h2d": "h2d"}
STAGES_OF = {"fetch": ("storage", "read"), "compute": ("decode",), "sink": ("batch",)}
# the README glossary's terms: L1 is the shard cache (cache_dir=); decoded samples go to the
# decoded store, which is no numbered tier
DECODED_STORE = ("FeedDataset(..., decoded_cache=DIR): the transform's fixed-shape outputs kept "
                 "on local disk")


@dataclass(frozen=True)
class Figures:
    """What the verdict is made from (samples/s unless said otherwise; ``None``: not measured)."""

    kind: str  # "file" | "directory" | "dataset"
    target: str
    cpus: int
    workers: int
    batch_size: int
    storage: float | None = None  # samples/s storage delivers (see storage_basis)
    storage_mb_per_s: float | None = None
    storage_basis: str = ""  # e.g. "sequential, cold, 4 threads, 1 MiB blocks"
    read: float | None = None
    decode: float | None = None
    batch: float | None = None
    h2d: float | None = None
    h2d_pinned_gb_per_s: float | None = None
    h2d_pageable_gb_per_s: float | None = None
    loader: dict[int, float] = field(default_factory=dict)  # measured FeedLoader samples/s
    small_files_per_s: float | None = None
    small_file_mb_per_s: float | None = None
    mean_file_bytes: float | None = None
    sequential_mb_per_s: float | None = None  # best sequential figure, same cache state
    jpeg: bool = False
    remote: bool = False
    fits_in_memory: bool = False
    cuda: bool = False
    step_time_ms: float | None = None
    cold_mb_per_s: float | None = None  # sequential, pages dropped: the device
    warm_mb_per_s: float | None = None  # sequential, from the page cache: memory
    # the FeedLoader a script gets: the part of its loop (fetch, compute, sink) that took the
    # most of its time, start-up left out (stats()["bound"] when start-up did not bound it),
    # and its seconds per part (stats()["time"])
    loader_bound: str | None = None
    loader_time: dict[str, float] = field(default_factory=dict)
    cache_dir: bool = False  # the loader read through the L1 shard cache
    # the link to a remote store as the loader uses it (diagnostics/_link.py: latency_s,
    # one_stream_mb_per_s, streams, aggregate_mb_per_s, cold_epoch_s), and the dataset's bytes
    link: dict[str, Any] | None = None
    dataset_bytes: int | None = None


@dataclass(frozen=True)
class Verdict:
    bounding_stage: str | None
    ceiling_samples_per_s: float | None
    ceiling_mb_per_s: float | None
    stage_samples_per_s: dict[str, float | None]
    parallelism: int
    demand_samples_per_s: float | None
    accelerator_utilisation: float | None
    measured_loader_samples_per_s: float | None  # the best FeedLoader run, for comparison
    measured_loader_workers: int | None
    advice: list[str]
    storage_cold_mb_per_s: float | None = None
    storage_warm_mb_per_s: float | None = None
    # the bounding stage as a part of the loader's accounts (stats()["bound"]'s names)
    bounding_part: str | None = None
    bound_basis: str | None = None  # what decided it: the stage rates, or the loader's accounts
    advice_about: list[str | None] = field(default_factory=list)  # each advice's part
    parallelism_note: str | None = None  # why fewer workers than asked for are planned
    # a remote dataset: what the link allows a cold epoch through the L1 cache, in seconds
    cold_epoch_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def decide(f: Figures) -> Verdict:
    """The verdict for figures ``f``.

    Example:
        >>> v = decide(Figures(kind="dataset", target="d", cpus=8, workers=8, batch_size=64,
        ...                    storage=9000.0, read=20000.0, decode=300.0, batch=50000.0))
        >>> v.bounding_stage, round(v.ceiling_samples_per_s)
        ('decode', 2351)
    """
    p = max(1, min(f.workers, f.cpus))
    cpu_rates = {s: getattr(f, s) for s in CPU_STAGES if getattr(f, s)}
    stages: dict[str, float | None] = {"storage": f.storage}
    stages.update({s: (getattr(f, s) * p if getattr(f, s) else None) for s in CPU_STAGES})
    stages["h2d"] = f.h2d
    bound, ceiling = _bound(f, cpu_rates, p)
    basis = "the stage rates" if bound is not None else None
    if bound is not None and f.loader_bound is not None and \
            PART_OF.get(bound) == f.loader_bound:
        basis = ("the stage rates and the FeedLoader a script gets (its stats()['bound'] "
                 "names the same part)")
    # the ceiling stays the least of the stage rates: whichever part bounds, none delivers more
    stage, why = _measured_part(f, bound, stages)
    if stage is not None:
        bound, basis = stage, why
    demand = utilisation = None
    if f.step_time_ms and f.step_time_ms > 0:
        demand = f.batch_size / (f.step_time_ms / 1e3)
        if ceiling:
            utilisation = min(1.0, ceiling / demand)
    best_w = max(f.loader, key=lambda w: f.loader[w]) if f.loader else None
    advice = _advice(f, bound, ceiling, p, cpu_rates, demand)
    return Verdict(bound, ceiling, _ceiling_mb(f, ceiling), stages, p, demand, utilisation,
                   f.loader[best_w] if best_w is not None else None, best_w,
                   [a for _, a in advice], f.cold_mb_per_s, f.warm_mb_per_s,
                   PART_OF.get(bound) if bound else None, basis, [k for k, _ in advice],
                   _parallelism_note(f, p), (f.link or {}).get("cold_epoch_s"))


def _bound(f: Figures, cpu_rates: dict[str, float],
           p: int) -> tuple[str | None, float | None]:
    """The stage the stage rates say bounds (the CPU's slowest stage where the CPU does), and
    the ceiling it sets in samples/s."""
    cpu = p / sum(1 / r for r in cpu_rates.values()) if cpu_rates else None
    candidates = {k: v for k, v in (("storage", f.storage), ("cpu", cpu), ("h2d", f.h2d)) if v}
    if not candidates:
        return ("storage" if f.kind == "file" and f.storage_mb_per_s else None), None
    bound = min(candidates, key=lambda k: candidates[k])
    ceiling = candidates[bound]
    if bound == "cpu":
        bound = min(cpu_rates, key=lambda k: cpu_rates[k])
    return bound, ceiling


def _ceiling_mb(f: Figures, ceiling: float | None) -> float | None:
    """The ceiling in MB/s: a file's storage rate, or the samples/s ceiling at the dataset's
    bytes per sample."""
    if f.kind == "file":
        return f.storage_mb_per_s
    if ceiling and f.storage and f.storage_mb_per_s:
        return ceiling * f.storage_mb_per_s / f.storage
    return None


def _link_floor(f: Figures) -> str:
    """What the link allows a cold epoch, against what the samples/s ceiling gives, for the
    remote-fetch advice ("" where the link was not measured)."""
    link = f.link or {}
    cold = link.get("cold_epoch_s")
    if not cold or not f.dataset_bytes:
        return ""
    one, agg, n = link.get("one_stream_mb_per_s"), link["aggregate_mb_per_s"], link["streams"]
    streams = (f" ({_fmt(one)} MB/s on one range read: fetches in flight, not larger samples, "
               "reach it)" if one and agg > 1.5 * one else "")
    return (f" The link gives {_fmt(agg)} MB/s with {n} range reads in flight{streams}, "
            f"{link['latency_s'] * 1e3:.0f} ms to a first byte: a cold epoch of this dataset's "
            f"{f.dataset_bytes / 1e6:,.1f} MB through the L1 cache needs about {cold:.3g} s.")


def _parallelism_note(f: Figures, p: int) -> str | None:
    if f.workers <= p:
        return None
    return (f"{f.workers} workers asked for; this machine has {f.cpus} usable CPU(s), so at "
            f"most {p} work at once: the ceiling counts {p}")


def _measured_part(f: Figures, bound: str | None,
                   stages: dict[str, float | None]) -> tuple[str | None, str | None]:
    """The stage the loader's accounts point at (the slower of the stages of the part they
    name) where that part is not ``bound``'s, and a sentence saying why the verdict follows
    them; ``None, None`` where they agree, were not taken, name no stage measured here, or
    host-to-device bounds (outside the loader's accounts)."""
    part = f.loader_bound
    if part not in STAGES_OF or bound is None or PART_OF.get(bound) in (None, "h2d", part):
        return None, None
    chosen = [s for s in STAGES_OF[part] if stages.get(s)]
    if not chosen:
        return None, None
    stage = min(chosen, key=lambda s: stages[s] or 0.0)
    t = f.loader_time
    secs = ", ".join(f"{k} {t[k]:.3g} s" for k in ("fetch", "compute", "sink") if k in t)
    why = (f"the stage rates alone point at {bound} ({PART_OF[bound]}), but the FeedLoader a "
           f"script gets spent the most of its time in {part} ({secs}): the verdict follows "
           "that measurement")
    return stage, why


def _advice(f: Figures, bound: str | None, ceiling: float | None, p: int,
            cpu_rates: dict[str, float], demand: float | None) -> list[tuple[str | None, str]]:
    """``(part, advice)`` pairs, the part each addresses (``None``: a framing of the others),
    ordered: what bounds first, then the rest; a step-time framing before all of them."""
    part = PART_OF.get(bound) if bound else None
    remote_fetch = bool(f.remote and part == "fetch" and f.kind == "dataset")
    out = _storage_advice(f, bound, remote_fetch) + _stage_advice(f, bound, remote_fetch)
    # worker counts after the bounding stage's own remedies: more workers serve a CPU stage,
    # and remote fetches (more requests in flight)
    about = part if bound in CPU_STAGES or remote_fetch else "workers"
    out += [(about, a) for a in _worker_advice(f, bound, p, cpu_rates)]
    # what bounds first; the rest keep their order
    out = [x for x in out if x[0] == part] + [x for x in out if x[0] != part]
    _frame(out, f, part, ceiling, demand)
    return out


def _storage_advice(f: Figures, bound: str | None,
                    remote_fetch: bool) -> list[tuple[str | None, str]]:
    """The advice about where the samples come from: a single file, small files, a remote
    store without (or with) the L1 cache, storage that bounds."""
    out: list[tuple[str | None, str]] = []
    if f.kind == "file":
        out.append(("fetch", "A single file has no per-sample pipeline: shard the dataset with "
                             "`feedpipe shard SRC OUT` and probe OUT for the stage breakdown "
                             "and a samples/s ceiling."))
    if f.kind == "directory" and f.small_files_per_s:
        seq = (f" while sequential reads give {_fmt(f.sequential_mb_per_s)} MB/s"
               if f.sequential_mb_per_s else "")
        mean = f" (mean {f.mean_file_bytes / 1e3:,.0f} KB)" if f.mean_file_bytes else ""
        out.append(("fetch", f"Shard the small files: `feedpipe shard {f.target} OUT` then "
                             f"train from OUT. Opening files one by one gives "
                             f"{_fmt(f.small_files_per_s)} files/s{mean}, "
                             f"{_fmt(f.small_file_mb_per_s or 0)} MB/s{seq}."))
    if remote_fetch and f.cache_dir:
        out.append(("fetch", "Remote fetches bound even through the L1 shard cache: an "
                             "epoch that finds a shard missing fetches it first; a cache_size "
                             "that holds the whole dataset keeps later epochs local."
                             + _link_floor(f)))
    elif remote_fetch:
        t = f.loader_time
        spent = (f" (the FeedLoader a script gets: fetch {t['fetch']:.3g} s of its "
                 f"{t.get('wait', 0.0):.3g} s wait for batches)" if "fetch" in t else "")
        out.append(("fetch", f"Remote fetches bound{spent}: without a cache every sample is "
                             "its own request to the remote store. Set the L1 shard cache, "
                             "FeedDataset(..., cache_dir=LOCAL_NVME_DIR, cache_size=...): each "
                             "shard is fetched once, whole, ahead of the plan, and every "
                             "sample is then read from local disk (later epochs too); more "
                             "DataLoader workers overlap more requests meanwhile."
                             + _link_floor(f)))
    elif bound == "storage" and f.kind != "file":
        where = "the remote store" if f.remote else "this storage"
        if f.fits_in_memory:
            warm = (f" (warm, from the page cache: {_fmt(f.warm_mb_per_s)} MB/s)"
                    if f.warm_mb_per_s else "")
            out.append(("fetch", f"Storage bounds ({f.storage_basis}), but the dataset fits in "
                                 f"memory{warm}: keep it in the page cache or put the L1 shard "
                                 "cache on /dev/shm (FeedDataset(..., cache_dir='/dev/shm/"
                                 "feedpipe')) so later epochs read from memory."))
        else:
            out.append(("fetch", f"Storage bounds ({f.storage_basis}): enable the L1 shard "
                                 "cache (FeedDataset(..., cache_dir=LOCAL_NVME_DIR, "
                                 "cache_size=...)) so that epochs after the first read local "
                                 f"disk instead of {where}, or the decoded store "
                                 f"({DECODED_STORE}) so that they skip reading and decoding."))
    return out


def _stage_advice(f: Figures, bound: str | None,
                  remote_fetch: bool) -> list[tuple[str | None, str]]:
    """The remedies of the pipeline stage that bounds: decode, read, batch, host-to-device."""
    out: list[tuple[str | None, str]] = []
    if bound == "decode":
        out.append(("compute", f"Decoding bounds: enable the decoded store ({DECODED_STORE}) so "
                               "that later epochs skip decoding."))
        if f.jpeg and f.cuda:
            out.append(("compute", "Move JPEG decoding to this machine's GPU with DALI (pip "
                                   "install 'feedpipe[dali]'): nvJPEG decodes on the GPU and "
                                   "frees the CPU cores (`feedpipe probe` on the GPU machine "
                                   "shows the decode stage's rate)."))
        elif f.jpeg:
            out.append(("compute", "Decode fewer pixels: JPEG decoding costs in proportion to "
                                   "the pixels, so store the images near the size you train at "
                                   "(downscale them once before `feedpipe shard`); "
                                   "ImagePipeline's random-resized crop decodes only the crop "
                                   "window where it can."))
    if bound == "read" and not remote_fetch:
        out.append(("fetch", "The shard reader bounds: use larger samples or fewer fields per "
                             f"sample, or enable the decoded store ({DECODED_STORE}) or the L3 "
                             "DeviceCache so that later epochs skip reading."))
    if bound == "batch":
        out.append(("sink", "Batching bounds: return fixed-shape tensors from the transform so "
                            "that collation is one stack, not per-sample Python objects."))
    if bound == "h2d":
        pin = (f" (pinned {f.h2d_pinned_gb_per_s:.1f} GB/s vs pageable "
               f"{f.h2d_pageable_gb_per_s:.1f} GB/s)"
               if f.h2d_pinned_gb_per_s and f.h2d_pageable_gb_per_s else "")
        out.append(("h2d", f"Host-to-device copies bound{pin}: use pinned memory with "
                           "feedpipe.DeviceLoader, send uint8 and convert on the device, or "
                           "keep the hot set on the device with DeviceCache."))
    return out


def _frame(out: list[tuple[str | None, str]], f: Figures, part: str | None,
           ceiling: float | None, demand: float | None) -> None:
    """Frame ``out`` by the step time: the pipeline keeps up (the remedies only for a shorter
    step), or the accelerator's wait; and say so where nothing was found to change."""
    if demand is not None and ceiling:
        if ceiling >= demand:
            # the remedies are for a faster step; said as such, they no longer read as
            # advice to change what needs no change
            shorter = f.batch_size / ceiling * 1e3
            keeps = (f"The input pipeline keeps up: its ceiling of {_fmt(ceiling)} samples/s "
                     f"exceeds the {_fmt(demand)} samples/s a {f.step_time_ms:g} ms step at "
                     f"batch {f.batch_size} consumes; no change is needed for this step time.")
            if out:
                keeps += (f" Only for a step shorter than {shorter:.0f} ms would the following "
                          "help:")
            out.insert(0, (None, keeps))
        else:
            out.append((part, f"The accelerator would wait for data "
                              f"{100 * (1 - ceiling / demand):.0f}% of the time: it consumes "
                              f"{_fmt(demand)} samples/s, the pipeline delivers "
                              f"{_fmt(ceiling)}."))
    if not out:
        out.append((None, "Nothing to change was found; pass --step-time to see the "
                          "accelerator utilisation for your model."))


def _worker_advice(f: Figures, bound: str | None, p: int,
                   cpu_rates: dict[str, float]) -> list[str]:
    """What to do with ``num_workers``. Measured FeedLoader rates decide (a difference under
    20% is taken for noise); the stage rates' prediction is given only where no measurement
    speaks against it, so the two never disagree."""
    rates = f.loader
    best = max(rates, key=lambda w: rates[w]) if rates else None
    told = ", ".join(f"{_fmt(rates[w])} at num_workers={w}" for w in sorted(rates))
    predicted = None
    if bound in CPU_STAGES and f.workers < f.cpus:
        ceiling = f.cpus / sum(1 / r for r in cpu_rates.values())
        predicted = (f"by the stage rates num_workers={f.cpus} would raise the CPU ceiling to "
                     f"about {_fmt(ceiling)} samples/s")
    planned = max((v for w, v in rates.items() if w <= f.workers), default=0.0)
    if best is not None and best > f.workers and rates[best] > 1.2 * planned:
        more = (f"; {predicted}" if predicted and f.cpus > best else "")
        return [f"Use more DataLoader workers: num_workers={best} was fastest here (samples/s: "
                f"{told}), more than the {f.workers} planned for{more}."]
    if best is not None and len(rates) >= 2 and best < max(rates) and \
            rates[best] > 1.2 * rates[max(rates)]:
        return [f"Measured: num_workers={best} was fastest here (samples/s: {told}): more "
                f"worker processes did not make batches faster on this machine, so keep "
                f"num_workers={best}."]
    if best is not None and any(w > f.workers for w in rates):
        return []  # more workers were measured and were not faster: no prediction against that
    if predicted:
        return [f"Use more DataLoader workers: num_workers={f.workers} keeps {p} of {f.cpus} "
                f"cores busy; {predicted}."]
    return []
