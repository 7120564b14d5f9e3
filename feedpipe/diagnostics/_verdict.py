"""The probe's verdict: which stage bounds samples/s, the predicted ceiling, the accelerator
utilisation a step time would see, and what to change. A pure function of measured figures.

The model. Storage delivers ``storage`` samples/s whatever the CPU does: its reads overlap
computation. The CPU stages (read, decode, batch) run one after another inside each DataLoader
worker. So with ``P = min(workers, cpus)`` busy processes they give
``P / (1/read + 1/decode + 1/batch)`` samples/s together. The bounding one among them is the
slowest: it takes the largest share of each sample's CPU time. Host-to-device copies run apart,
on the copy engine. The ceiling is the least of storage, CPU and host-to-device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CPU_STAGES = ("read", "decode", "batch")
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
    cpu = p / sum(1 / r for r in cpu_rates.values()) if cpu_rates else None
    candidates = {k: v for k, v in (("storage", f.storage), ("cpu", cpu), ("h2d", f.h2d)) if v}
    bound: str | None = None
    ceiling: float | None = None
    if candidates:
        bound = min(candidates, key=lambda k: candidates[k])
        ceiling = candidates[bound]
        if bound == "cpu":
            bound = min(cpu_rates, key=lambda k: cpu_rates[k])
    elif f.kind == "file" and f.storage_mb_per_s:
        bound = "storage"
    demand = utilisation = None
    if f.step_time_ms and f.step_time_ms > 0:
        demand = f.batch_size / (f.step_time_ms / 1e3)
        if ceiling:
            utilisation = min(1.0, ceiling / demand)
    mb = None
    if f.kind == "file":
        mb = f.storage_mb_per_s
    elif ceiling and f.storage and f.storage_mb_per_s:
        mb = ceiling * f.storage_mb_per_s / f.storage
    best_w = max(f.loader, key=lambda w: f.loader[w]) if f.loader else None
    return Verdict(bound, ceiling, mb, stages, p, demand, utilisation,
                   f.loader[best_w] if best_w is not None else None, best_w,
                   _advice(f, bound, ceiling, p, cpu_rates, demand), f.cold_mb_per_s,
                   f.warm_mb_per_s)


def _advice(f: Figures, bound: str | None, ceiling: float | None, p: int,
            cpu_rates: dict[str, float], demand: float | None) -> list[str]:
    out: list[str] = []
    if f.kind == "file":
        out.append("A single file has no per-sample pipeline: shard the dataset with `feedpipe "
                   "shard SRC OUT` and probe OUT for the stage breakdown and a samples/s ceiling.")
    if f.kind == "directory" and f.small_files_per_s:
        seq = (f" while sequential reads give {_fmt(f.sequential_mb_per_s)} MB/s"
               if f.sequential_mb_per_s else "")
        mean = f" (mean {f.mean_file_bytes / 1e3:,.0f} KB)" if f.mean_file_bytes else ""
        out.append(f"Shard the small files: `feedpipe shard {f.target} OUT` then train from OUT. "
                   f"Opening files one by one gives {_fmt(f.small_files_per_s)} files/s"
                   f"{mean}, {_fmt(f.small_file_mb_per_s or 0)} MB/s{seq}.")
    general, out = out, _worker_advice(f, bound, p, cpu_rates)
    if bound == "storage" and f.kind != "file":
        where = "the remote store" if f.remote else "this storage"
        if f.fits_in_memory:
            warm = (f" (warm, from the page cache: {_fmt(f.warm_mb_per_s)} MB/s)"
                    if f.warm_mb_per_s else "")
            out.append(f"Storage bounds ({f.storage_basis}), but the dataset fits in memory"
                       f"{warm}: keep it in the page cache or put the L1 shard cache on /dev/shm "
                       "(FeedDataset(..., cache_dir='/dev/shm/feedpipe')) so later epochs read "
                       "from memory.")
        else:
            out.append(f"Storage bounds ({f.storage_basis}): enable the L1 shard cache "
                       "(FeedDataset(..., cache_dir=LOCAL_NVME_DIR, cache_size=...)) so that "
                       f"epochs after the first read local disk instead of {where}, or the "
                       f"decoded store ({DECODED_STORE}) so that they skip reading and decoding.")
    if bound == "decode":
        out.append(f"Decoding bounds: enable the decoded store ({DECODED_STORE}) so that later "
                   "epochs skip decoding.")
        if f.jpeg and f.cuda:
            out.append("Move JPEG decoding to this machine's GPU with DALI (pip install "
                       "'feedpipe[dali]'): nvJPEG decodes on the GPU and frees the CPU cores "
                       "(`feedpipe probe` on the GPU machine shows the decode stage's rate).")
        elif f.jpeg:
            out.append("Decode fewer pixels: JPEG decoding costs in proportion to the pixels, so "
                       "store the images near the size you train at (downscale them once before "
                       "`feedpipe shard`); ImagePipeline's random-resized crop decodes only the "
                       "crop window where it can.")
    if bound == "read":
        out.append("The shard reader bounds: use larger samples or fewer fields per sample, or "
                   f"enable the decoded store ({DECODED_STORE}) or the L3 DeviceCache so that "
                   "later epochs skip reading.")
    if bound == "batch":
        out.append("Batching bounds: return fixed-shape tensors from the transform so that "
                   "collation is one stack, not per-sample Python objects.")
    if bound == "h2d":
        pin = (f" (pinned {f.h2d_pinned_gb_per_s:.1f} GB/s vs pageable "
               f"{f.h2d_pageable_gb_per_s:.1f} GB/s)"
               if f.h2d_pinned_gb_per_s and f.h2d_pageable_gb_per_s else "")
        out.append(f"Host-to-device copies bound{pin}: use pinned memory with feedpipe."
                   "DeviceLoader, send uint8 and convert on the device, or keep the hot set on "
                   "the device with DeviceCache.")
    if demand is not None and ceiling:
        if ceiling >= demand:
            # the remedies above are for a faster step; said as such, they no longer read as
            # advice to change what needs no change
            shorter = f.batch_size / ceiling * 1e3
            keeps = (f"The input pipeline keeps up: its ceiling of {_fmt(ceiling)} samples/s "
                     f"exceeds the {_fmt(demand)} samples/s a {f.step_time_ms:g} ms step at "
                     f"batch {f.batch_size} consumes; no change is needed for this step time.")
            if out:
                keeps += (f" Only for a step shorter than {shorter:.0f} ms would the following "
                          "help:")
            out.insert(0, keeps)
        else:
            out.append(f"The accelerator would wait for data {100 * (1 - ceiling / demand):.0f}% "
                       f"of the time: it consumes {_fmt(demand)} samples/s, the pipeline "
                       f"delivers {_fmt(ceiling)}.")
    out = general + out
    if not out:
        out.append("Nothing to change was found; pass --step-time to see the accelerator "
                   "utilisation for your model.")
    return out


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
