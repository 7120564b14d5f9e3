"""DeviceCache serving bandwidth against a plain device-to-device copy of the same bytes (issue 24).

A cache holds ``--samples`` images of ``3 x size x size`` uint8 plus an int64 label, all
resident; one shuffled epoch is served in batches of ``--batch`` through the public
``DeviceCache.batches``. Its figure is the batch bytes delivered per second (images and labels),
measured three ways against peers timed in the same run, with the same bytes counted:

    epoch     from the ``batches()`` call (the epoch's index goes to the device) to the last batch
    steady    from the first batch handed out to the last (the per-batch serving alone)
    copy      the same batches as contiguous ``copy_`` calls, batch by batch, from a buffer of
              the same size (one kernel per batch, no gather): what serving costs without a gather
    peak      one copy of ``--peak-mb`` MB: the device's device-to-device bandwidth

Ratios: ``epoch / peak`` is the bar of issue 24 (>= 0.5 on a GPU for 224 x 224 batches of 256);
``epoch / copy`` says how much the gather costs over a copy of the same batches.

Timing: CUDA events around each run on a GPU (no synchronisation inside a run); on the CPU, wall
clock (``time.perf_counter``), and the report says so. One untimed warm-up run, then the median of
``--repeats`` runs.

Usage::

    python benchmarks/bench_device_cache.py                # on a GPU machine (cuda when present)
    python benchmarks/bench_device_cache.py --device cpu   # the CPU mode: wall clock, no GPU figure
    python benchmarks/bench_device_cache.py --quick        # fewer samples

Writes ``benchmarks/results/device_cache[-cpu][-quick].json`` and ``.md`` with the environment.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import render_results

from feedpipe import DeviceCache

BAR = 0.5  # issue 24: served bytes/s >= 50% of the device-to-device copy bandwidth


class Clock:
    """Seconds of the work queued between ``start()`` and ``stop()``: CUDA events on a GPU (read
    once the run is over), wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.kind = "cuda events" if self.cuda else "wall clock (CPU)"

    def time(self, body: Callable[[], Any]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            body()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        body()
        return time.perf_counter() - t0


def median_of(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: allocator, kernels, page faults
    runs = [fn() for _ in range(repeats)]
    return statistics.median(runs), runs


def measure(device: torch.device, samples: int, size: int, batch: int, repeats: int,
            peak_mb: int) -> dict[str, Any]:
    shape = (3, size, size)
    per = int(np.prod(shape)) + 8  # image bytes + an int64 label
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (min(samples, 256), *shape), dtype=torch.uint8, generator=g)
    cache = DeviceCache(samples * per, device=device)
    t0 = time.perf_counter()
    cache.warmup(((i, pool[i % len(pool)], i) for i in range(samples)), num_samples=samples,
                 batch_size=batch, show_progress=False)
    warm_s = time.perf_counter() - t0
    if cache.resident != samples:
        raise RuntimeError(f"only {cache.resident} of {samples} samples became resident")
    order = np.random.default_rng(0).permutation(samples)
    nbytes = samples * per
    clock = Clock(device)
    held: list[Any] = []

    def serve_epoch() -> None:
        for img, _lbl in cache.batches(order, batch):
            held.append(img)  # kept until the run ends: no memory reuse that a copy would not see
        held.clear()

    epoch_s, epoch_runs = median_of(lambda: clock.time(serve_epoch), repeats)

    def steady() -> float:
        it = cache.batches(order, batch)
        first = next(it)
        s = clock.time(lambda: held.extend(b[0] for b in it))
        held.clear()
        del first
        return s

    steady_s, _ = median_of(steady, repeats)
    steady_bytes = (samples - min(batch, samples)) * per

    src_img = torch.randint(0, 256, (samples, *shape), dtype=torch.uint8, generator=g).to(device)
    src_lbl = torch.arange(samples, dtype=torch.int64).to(device)
    copy_s = copy_batches(src_img, src_lbl, batch, clock, repeats)
    kernels = gather_kernels(device, src_img, order, batch, clock, repeats)
    src_img = src_lbl = torch.empty(0)  # free them before the large copy
    peak_s = peak_copy(device, peak_mb, clock, repeats)
    gb = 1e9
    res: dict[str, Any] = {
        "device": str(device), "timing": clock.kind, "samples": samples,
        "sample_shape": list(shape), "batch": batch, "batches": -(-samples // batch),
        "batch_MB": batch * per / 1e6, "cache_MB": nbytes / 1e6, "warmup_s": warm_s,
        "epoch_GBps": nbytes / epoch_s / gb, "epoch_runs_s": epoch_runs,
        "steady_GBps": steady_bytes / steady_s / gb if steady_bytes else None,
        "copy_same_batches_GBps": nbytes / copy_s / gb,
        "peak_copy_GBps": (peak_mb << 20) / peak_s / gb, "peak_copy_MB": peak_mb,
        "samples_per_s": samples / epoch_s, "kernels_GBps": kernels,
    }
    res["epoch_to_peak"] = res["epoch_GBps"] / res["peak_copy_GBps"]
    res["steady_to_peak"] = (res["steady_GBps"] / res["peak_copy_GBps"]
                             if res["steady_GBps"] else None)
    res["epoch_to_copy"] = res["epoch_GBps"] / res["copy_same_batches_GBps"]
    res["bar"] = {"what": f"served GB/s >= {BAR:.0%} of the device-to-device copy bandwidth",
                  "ratio": res["epoch_to_peak"], "met": res["epoch_to_peak"] >= BAR,
                  "counts": device.type == "cuda"}
    return res


def copy_batches(images: torch.Tensor, labels: torch.Tensor, batch: int, clock: Clock,
                 repeats: int) -> float:
    """Seconds to copy ``images`` and ``labels`` batch by batch into fresh tensors (median)."""
    held: list[torch.Tensor] = []

    def run() -> None:
        for a in range(0, len(images), batch):
            img = torch.empty_like(images[a:a + batch])
            img.copy_(images[a:a + batch])
            lbl = torch.empty_like(labels[a:a + batch])
            lbl.copy_(labels[a:a + batch])
            held.append(img)
        held.clear()

    return median_of(lambda: clock.time(run), repeats)[0]


def peak_copy(device: torch.device, mb: int, clock: Clock, repeats: int) -> float:
    """Seconds for one copy of ``mb`` MB between two device buffers (median)."""
    big = torch.empty(mb << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    return median_of(lambda: clock.time(lambda: dst.copy_(big)), repeats)[0]


def gather_kernels(device: torch.device, images: torch.Tensor, order: np.ndarray, batch: int,
                   clock: Clock, repeats: int) -> dict[str, float]:
    """GB/s of the image gather alone, batch by batch in ``order``, done several ways on the same
    bytes: the 4-D uint8 tensor, its rows as uint8, as int64 (what DeviceCache does), and as
    complex128 (16-byte elements) where a row divides; for choosing the gather, not a bar."""
    n = len(images)
    rows = images.reshape(n, -1)
    views = {"uint8 4-D": images, "uint8 rows": rows}
    if rows.shape[1] % 8 == 0:
        views["int64 rows"] = rows.view(torch.int64)
    if rows.shape[1] % 16 == 0:
        views["complex128 rows"] = rows.view(torch.complex128)
    index = torch.from_numpy(np.asarray(order, dtype=np.int64)).to(device).split(batch)
    out: dict[str, float] = {}
    for name, v in views.items():
        def run(v: torch.Tensor = v) -> None:
            held = [v.index_select(0, part) for part in index]
            del held
        sec, _ = median_of(lambda: clock.time(run), repeats)
        out[name] = images.numel() / sec / 1e9
    return out


def markdown(doc: dict[str, Any]) -> str:
    r = doc["result"]
    f = common.fmt
    where = ("" if r["device"].startswith("cuda")
             else " — CPU MODE, wall clock: not a GPU figure, the bar applies on a GPU only")
    what = (f"{r['samples']:,} samples of {r['sample_shape']} uint8 + int64 label "
            f"({f(r['cache_MB'], 0)} MB), batch {r['batch']} ({f(r['batch_MB'], 1)} MB), "
            f"timing: {r['timing']}, median of {doc['args']['repeats']} runs.")
    lines = [f"# DeviceCache serving bandwidth ({r['device']}{where})", "", what, "",
             "| serving | GB/s | x peak copy | x copy of the same batches |",
             "|---|---:|---:|---:|"]
    for name, key in (("DeviceCache, whole epoch", "epoch_GBps"),
                      ("DeviceCache, after the first batch", "steady_GBps"),
                      ("copy of the same batches", "copy_same_batches_GBps"),
                      (f"one {r['peak_copy_MB']} MB copy (peak)", "peak_copy_GBps")):
        v = r[key]
        lines.append(f"| {name} | {f(v, 1)} | {f(v / r['peak_copy_GBps'], 3) if v else '-'} | "
                     f"{f(v / r['copy_same_batches_GBps'], 3) if v else '-'} |")
    lines += ["", "The image gather alone (GB/s): " + ", ".join(
        f"{k} {f(v, 1)}" for k, v in r["kernels_GBps"].items()) + "."]
    b = r["bar"]
    met = ("**met**" if b["met"] else "**not met**") if b["counts"] else "n/a on the CPU"
    lines += ["", f"Bar: {b['what']}: {f(b['ratio'], 3)} — {met}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when available, else cpu")
    ap.add_argument("--samples", type=int, default=None,
                    help="resident samples (default: 20,000 on a GPU, 1,024 on the CPU)")
    ap.add_argument("--size", type=int, default=224, help="image side (default %(default)s)")
    ap.add_argument("--batch", type=int, default=256, help="batch size (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs, median (default 5)")
    ap.add_argument("--peak-mb", type=int, default=None,
                    help="size of the peak copy (default 1024 on a GPU, 256 on the CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--name", default=None, help="results file stem")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    a = ap.parse_args(argv)
    want = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: use --device cpu (wall clock, no GPU figure)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if want == "cuda" else \
        torch.device("cpu")
    cuda = device.type == "cuda"
    samples = a.samples or ((2_048 if a.quick else 20_000) if cuda else (512 if a.quick else 1_024))
    peak = a.peak_mb or (1024 if cuda else 256)
    doc: dict[str, Any] = {"benchmark": "bench_device_cache", "args": vars(a),
                           "environment": common.environment()}
    if cuda:
        doc["environment"]["gpu"] = torch.cuda.get_device_name(device)
    doc["result"] = measure(device, samples, a.size, a.batch, a.repeats, peak)
    text = markdown(doc)
    print(text)
    if a.out:
        common.RESULTS = os.path.abspath(a.out)
    name = a.name or ("device_cache" + ("" if cuda else "-cpu") + ("-quick" if a.quick else ""))
    path = common.write_results(name, doc)
    with open(os.path.join(common.RESULTS, name + ".md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    render_results.render(path, force=True, parts=("png",))  # its chart (the .md is above)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
