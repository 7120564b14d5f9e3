"""The device end of the pipeline: host-to-device copies, DeviceLoader overlap, DeviceCache gather.

Sections (each a ratio to a peer measured in the same run):

1. **copy**: host-to-device GB/s from pageable and from pinned memory at several sizes (CUDA
   events around ``reps`` copies), and the ratio of each to the *ceiling*: the pinned copy of the
   largest size. CPU mode: host memcpy GB/s (``copy_`` between CPU tensors) only.
2. **step**: a synthetic training step (a matmul loop calibrated to ``--step-ms``, 20 ms, that
   also reads the batch) fed three ways: from batches already on the device (*resident*, the
   ideal), through ``DeviceLoader`` from pageable host batches, and with a plain synchronous
   ``.to(device)`` in the loop (*naive*). Reported: ms per step and DeviceLoader/resident (target:
   within 5%), with DeviceLoader's starvation figures. CPU mode: the host source makes each batch
   (``torch.randint``, standing in for decode and collation) and DeviceLoader prefetches it on a
   thread while the step runs; *resident* reads premade batches; *naive* makes them in the loop.
3. **cache**: ``DeviceCache`` serving one epoch by on-device gather: batches/s and GB/s of batch
   bytes, against the device memory bandwidth measured by a device-to-device copy of a large
   tensor (bytes copied per second, counted the same way as gathered batch bytes); also a run
   with half the dataset resident and the rest from a host fallback.
4. **dali**: DALI decode (``feedpipe.DaliStage``) against the CPU pipeline on the same shards;
   without nvidia-dali it says why it was skipped.

Timing: one untimed warm-up run, then the median of ``--repeats`` runs. On CUDA a run ends with one
``torch.cuda.synchronize()`` (after the loop, never in it).

Usage::

    python benchmarks/bench_device.py                 # on a GPU machine (CUDA when present)
    python benchmarks/bench_device.py --device cpu    # the CPU mode: no GPU figure
    python benchmarks/bench_device.py --quick         # smaller sizes, fewer steps

``--root DIR`` holds the DALI section's synthetic JPEG shards, made once (default:
``feedpipe-bench-device`` under the system temp dir).

Writes ``benchmarks/results/device.json`` (``device-cpu.json`` in CPU mode, ``-quick`` suffixed
with ``--quick``) with the environment.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import render_results  # noqa: E402

from feedpipe import DeviceCache, DeviceLoader, Plan  # noqa: E402

MB = 1 << 20


# -- timing ---------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_run(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    return statistics.median(runs), runs


def timed(device: torch.device, body: Callable[[], Any]) -> float:
    """Seconds for ``body`` including the device work it queued (one sync at the end)."""
    sync(device)
    t0 = time.perf_counter()
    body()
    sync(device)
    return time.perf_counter() - t0


def event_timed(device: torch.device, body: Callable[[], Any]) -> Callable[[], float]:
    """A run of ``body`` timed by CUDA events around it: seconds of device time."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def run() -> float:
        sync(device)
        start.record()
        body()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return run


def copies(dst: torch.Tensor, src: torch.Tensor, reps: int, **kw: Any) -> Callable[[], None]:
    """``reps`` copies of ``src`` into ``dst`` (the arguments bound now, not at the call)."""
    def body() -> None:
        for _ in range(reps):
            dst.copy_(src, **kw)
    return body


# -- 1. copies ------------------------------------------------------------------------------------
def bench_copy(device: torch.device, sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    rows = []
    if device.type != "cuda":
        for mb in sizes_mb:
            src = torch.randint(0, 255, (mb * MB,), dtype=torch.uint8)
            dst = torch.empty_like(src)
            reps = max(1, 512 // mb)
            sec, runs = median_run(partial(timed, device, copies(dst, src, reps)), repeats)
            rows.append({"mb": mb, "host_memcpy_GBps": mb * MB * reps / sec / 1e9})
        return {"mode": "cpu", "rows": rows,
                "note": "no host-to-device copy without a GPU: host memcpy GB/s only"}
    for mb in sizes_mb:
        n = mb * MB
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        out = {"mb": mb}
        for kind in ("pageable", "pinned"):
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, pin_memory=kind == "pinned")
            reps = max(2, 1024 // mb)
            sec, _ = median_run(event_timed(device, copies(dst, src, reps, non_blocking=True)),
                                repeats)
            out[f"{kind}_GBps"] = n * reps / sec / 1e9
        rows.append(out)
    ceiling = rows[-1]["pinned_GBps"]
    for r in rows:
        r["pageable_to_ceiling"] = r["pageable_GBps"] / ceiling
        r["pinned_to_ceiling"] = r["pinned_GBps"] / ceiling
        r["pinned_over_pageable"] = r["pinned_GBps"] / r["pageable_GBps"]
    return {"mode": "cuda", "rows": rows, "ceiling_GBps": ceiling,
            "ceiling_is": f"pinned copy of {sizes_mb[-1]} MB"}


# -- 2. synthetic step ----------------------------------------------------------------------------
class Step:
    """A matmul loop of ``k`` products (calibrated to ``target_ms``) that also reads the batch."""

    def __init__(self, device: torch.device, target_ms: float) -> None:
        cuda = device.type == "cuda"
        n = 4096 if cuda else 256
        dtype = torch.bfloat16 if cuda else torch.float32
        g = torch.Generator().manual_seed(0)
        self.w = (torch.randn(n, n, generator=g) / n ** 0.5).to(device, dtype)
        self.y0 = torch.randn(n, n, generator=g).to(device, dtype)
        self.acc = torch.zeros((), device=device)
        self.device = device
        self.k = 8
        per = timed(device, lambda: self(None)) / self.k
        for _ in range(3):
            per = min(per, timed(device, lambda: self(None)) / self.k)
        self.k = max(1, round(target_ms / 1e3 / per))
        self.ms = timed(device, lambda: [self(None) for _ in range(5)]) / 5 * 1e3

    def __call__(self, batch: torch.Tensor | None) -> None:
        y = self.y0
        for _ in range(self.k):
            y = torch.tanh(y @ self.w)
        self.acc += y[0, 0].float()
        if batch is not None:
            self.acc += batch.float().mean()  # the step reads every byte of the batch


def bench_step(device: torch.device, steps: int, batch_shape: tuple[int, ...], target_ms: float,
               repeats: int) -> dict[str, Any]:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # the "device" is the CPU: leave a core to the host side that DeviceLoader overlaps
        torch.set_num_threads(max(1, threads - 1))
    try:
        return _bench_step(device, steps, batch_shape, target_ms, repeats)
    finally:
        torch.set_num_threads(threads)


def _bench_step(device: torch.device, steps: int, batch_shape: tuple[int, ...], target_ms: float,
                repeats: int) -> dict[str, Any]:
    step = Step(device, target_ms)
    cuda = device.type == "cuda"
    pool_n = 4
    host = [torch.randint(0, 255, batch_shape, dtype=torch.uint8) for _ in range(pool_n)]
    resident = [b.to(device) for b in host]
    last: dict[str, Any] = {}

    if cuda:
        def source() -> Iterator[torch.Tensor]:  # pageable host batches, ready-made
            for i in range(steps):
                yield host[i % pool_n]
    else:
        def source() -> Iterator[torch.Tensor]:  # the host makes each batch (decode/collate)
            for _ in range(steps):
                yield torch.randint(0, 255, batch_shape, dtype=torch.uint8)

    def run_resident() -> float:
        return timed(device, lambda: [step(resident[i % pool_n]) for i in range(steps)])

    def run_loader() -> float:
        loader = DeviceLoader(source(), device=device, depth=2, time_gpu=cuda)

        def body() -> None:
            for b in loader:
                step(b)
        sec = timed(device, body)
        last["stats"] = loader.stats()
        return sec

    def run_naive() -> float:
        return timed(device, lambda: [step(b.to(device)) for b in source()])

    res = {}
    for name, fn in (("resident", run_resident), ("device_loader", run_loader),
                     ("naive", run_naive)):
        sec, runs = median_run(fn, repeats)
        res[name] = {"ms_per_step": sec / steps * 1e3, "runs_s": runs}
    ratio = res["device_loader"]["ms_per_step"] / res["resident"]["ms_per_step"]
    return {"mode": device.type, "steps": steps, "batch_shape": list(batch_shape),
            "batch_MB": float(np.prod(batch_shape)) / MB, "matmuls_per_step": step.k,
            "compute_ms_per_step": step.ms, "systems": res,
            "loader_over_resident": ratio, "naive_over_resident":
                res["naive"]["ms_per_step"] / res["resident"]["ms_per_step"],
            "within_5pct": ratio <= 1.05 if cuda else None,
            "device_loader_stats": last.get("stats"),
            "torch_threads": torch.get_num_threads()}


# -- 3. DeviceCache -------------------------------------------------------------------------------
def bench_cache(device: torch.device, n: int, shape: tuple[int, ...], batch: int,
                repeats: int, bw_mb: int) -> dict[str, Any]:
    per = int(np.prod(shape)) + 8
    base = torch.randint(0, 255, (1024, *shape), dtype=torch.uint8)
    items = ((i, base[i % 1024], i) for i in range(n))
    cache = DeviceCache(n * per, device=device)
    t0 = time.perf_counter()
    cache.warmup(items, num_samples=n, batch_size=batch, show_progress=False)
    warm_s = time.perf_counter() - t0
    plan = Plan((n,), seed=0, epoch=0)
    batch_bytes = n * per

    def epoch(c: DeviceCache, **kw: Any) -> float:
        acc = torch.zeros((), device=device, dtype=torch.int64)

        def body() -> None:
            nonlocal acc
            for _img, lbl in c.batches(plan, batch, **kw):
                acc += lbl[0]  # touch the batch so the gather is not left queued
        return timed(device, body)

    sec, runs = median_run(lambda: epoch(cache), repeats)
    nb = -(-n // batch)
    big = torch.empty(bw_mb * MB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    reps = 5
    bw_s, _ = median_run(partial(timed, device, copies(dst, big, reps)), repeats)
    bw = bw_mb * MB * reps / bw_s / 1e9
    del big, dst
    gbps = batch_bytes / sec / 1e9

    half = DeviceCache(n * per // 2, device=device)
    half.warmup(((i, base[i % 1024], i) for i in range(n)), num_samples=n, show_progress=False)

    def host_fallback(ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return base[torch.from_numpy(ids % 1024)], torch.from_numpy(ids)
    hsec, _ = median_run(lambda: epoch(half, fallback=host_fallback), repeats)
    return {"mode": device.type, "samples": n, "sample_shape": list(shape), "batch": batch,
            "dataset_MB": batch_bytes / MB, "warmup_s": warm_s,
            "batches_per_s": nb / sec, "samples_per_s": n / sec, "gather_GBps": gbps,
            "device_copy_GBps": bw, "gather_to_copy": gbps / bw, "runs_s": runs,
            "half_resident": {"batches_per_s": nb / hsec, "gather_GBps": batch_bytes / hsec / 1e9,
                              "hit_ratio": half.stats()["hit_ratio"],
                              "resident_fraction": half.stats()["resident_fraction"]},
            "stats": cache.stats()}


# -- 4. DALI decode vs the CPU pipeline -----------------------------------------------------------
def make_jpeg_shards(root: str, n: int, min_size: int, max_size: int) -> str:
    """``n`` synthetic JPEGs in 8 class folders, sharded once into a directory under ``root``."""
    from feedpipe import shard
    from feedpipe.convert._synth import make_image_folder

    where = os.path.join(root, f"jpegs-{n}-{max_size}")
    out = os.path.join(where, "shards")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        src = os.path.join(where, "images")
        make_image_folder(src, classes=8, per_class=n // 8, min_size=min_size, max_size=max_size,
                          seed=0)
        shard(src, out, max_samples=256, labels_from_dirs=True, show_progress=False)
    return out


def bench_dali(device: torch.device, quick: bool, repeats: int, root: str) -> dict[str, Any]:
    """Images/s of the DALI stage (GPU "mixed" decode on CUDA, DALI's CPU mode otherwise) and of
    the CPU ImagePipeline in DataLoader workers delivered to the same device by FeedLoader's
    DeviceLoader, on the same shards with the same ImageSpec."""
    from feedpipe import DaliStage, FeedDataset, FeedLoader, ImagePipeline, ImageSpec

    try:
        import nvidia.dali  # noqa: F401, PLC0415
    except ImportError:
        return {"skipped": "nvidia-dali is not installed: pip install 'feedpipe[dali]'"}
    cuda = device.type == "cuda"
    n = (1024 if quick else 8192) if cuda else (128 if quick else 512)
    root = make_jpeg_shards(root, n, 160 if cuda else 64, 320 if cuda else 128)
    spec = ImageSpec(size=224 if cuda else 96, train=True)
    batch = 256 if cuda else 64
    workers = max(1, min(8, os.cpu_count() or 1))

    device_id = device.index if cuda else None
    # DALI's own threads decode; FeedLoader's workers read the shards and collate the encoded
    # bytes. They start from a forkserver: forking beside DALI's threads is refused
    feed = FeedLoader(FeedDataset(root, shuffle=True), batch_size=batch,
                      num_workers=min(4, workers), persistent_workers=True,
                      multiprocessing_context="forkserver")
    # the same bytes premade in memory: what DALI does when its feed costs nothing
    samples = list(FeedDataset(root, shuffle=False))
    premade = [([bytes(s["jpg"]) for s in samples[i:i + batch]],
                [bytes(s["cls"]) for s in samples[i:i + batch]]) for i in range(0, n, batch)]

    def make_run(stage: Any, what: str) -> Callable[[], float]:
        # one stage (one DALI pipeline, one set of persistent workers) for the warm-up and every
        # timed pass: building a pipeline or starting workers is a once-per-job cost
        epoch = 0

        def run() -> float:
            nonlocal epoch
            if hasattr(getattr(stage, "batches", stage), "set_epoch"):  # not a premade list
                stage.set_epoch(epoch)
            epoch += 1
            count = 0

            def body() -> None:
                nonlocal count
                for b in stage:
                    count += len(b[1])  # DaliBatch.labels / the (images, labels) pair
            sec = timed(device, body)
            if count != n:
                raise RuntimeError(f"{what} delivered {count} of {n} images")
            return n / sec
        return run

    def run_dali() -> Callable[[], float]:
        return make_run(DaliStage(feed, spec=spec, device_id=device_id, num_threads=workers),
                        "DALI stage")

    def run_dali_premade() -> Callable[[], float]:
        return make_run(DaliStage(premade, batch_size=batch, spec=spec, device_id=device_id,
                                       num_threads=workers), "DALI stage (premade feed)")

    def run_cpu() -> Callable[[], float]:
        dataset = FeedDataset(root, shuffle=True, transform=ImagePipeline.from_spec(spec))
        loader = FeedLoader(dataset,
                            batch_size=batch, num_workers=workers, device=device,
                            persistent_workers=True)
        return make_run(loader, "CPU pipeline")

    out: dict[str, Any] = {"images": n, "batch": batch, "size": spec.size, "workers": workers,
                           "dali_mode": "gpu (mixed)" if cuda else "cpu (device_id=None)"}
    for name, make in (("dali", run_dali), ("dali_premade_feed", run_dali_premade),
                       ("cpu_pipeline", run_cpu)):
        try:
            fn = make()
            fn()  # warm-up (builds DALI's pipeline, starts the workers)
            out[f"{name}_images_per_s"] = statistics.median(fn() for _ in range(repeats))
        except Exception as e:  # noqa: BLE001 - one broken system must not hide the other
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
    if "dali_images_per_s" in out and "cpu_pipeline_images_per_s" in out:
        out["dali_over_cpu"] = out["dali_images_per_s"] / out["cpu_pipeline_images_per_s"]
    return out


# -- report ---------------------------------------------------------------------------------------
def gpu_env(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_bytes=p.total_memory,
                   multiprocessors=p.multi_processor_count)
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,"
                 "pcie.link.width.current", "--format=csv,noheader"], capture_output=True,
                text=True, timeout=20).stdout.strip()
        except Exception:  # noqa: BLE001
            env["nvidia_smi"] = None
    return env


def print_report(doc: dict[str, Any]) -> None:
    f = common.fmt
    label = "CUDA" if doc["mode"] == "cuda" else "CPU MODE (no GPU: GPU figures need a GPU machine)"
    print(f"\n== bench_device: {label} ==")
    c = doc["copy"]
    print("\n1. host-to-device copy" if c["mode"] == "cuda" else "\n1. host memcpy (CPU)")
    if c["mode"] == "cuda":
        print(common.table(
            [[str(r["mb"]), f(r["pageable_GBps"], 1), f(r["pinned_GBps"], 1),
              f(r["pageable_to_ceiling"], 2), f(r["pinned_to_ceiling"], 2),
              f(r["pinned_over_pageable"], 2)] for r in c["rows"]],
            ["MB", "pageable GB/s", "pinned GB/s", "pageable/ceil", "pinned/ceil",
             "pinned/pageable"]))
        print(f"ceiling: {f(c['ceiling_GBps'], 1)} GB/s ({c['ceiling_is']})")
    else:
        print(common.table([[str(r["mb"]), f(r["host_memcpy_GBps"], 1)] for r in c["rows"]],
                           ["MB", "memcpy GB/s"]))
        print(c["note"])
    s = doc["step"]
    print(f"\n2. synthetic step ({s['mode']}): {s['matmuls_per_step']} matmuls, "
          f"compute {f(s['compute_ms_per_step'], 1)} ms, batch {list(s['batch_shape'])} uint8 "
          f"({f(s['batch_MB'], 1)} MB), {s['steps']} steps")
    resident_ms = s["systems"]["resident"]["ms_per_step"]
    rows = [[k, f(v["ms_per_step"], 2), f(v["ms_per_step"] / resident_ms, 3)]
            for k, v in s["systems"].items()]
    print(common.table(rows, ["fed by", "ms/step", "x resident"]))
    st = s["device_loader_stats"] or {}
    if s["within_5pct"] is None:
        target = "the 5% target is for CUDA: on the CPU the batch making and the step share cores"
    else:
        target = ("within" if s["within_5pct"] else "NOT within") + " 5%"
    gpu_wait = st.get("gpu_wait_s")
    print(f"DeviceLoader/resident = {f(s['loader_over_resident'], 3)} ({target}); starvation "
          f"{f(st.get('starvation'), 3)}, steady {f(st.get('steady_starvation'), 3)}, "
          f"first wait {f((st.get('first_wait_s') or 0) * 1e3, 1)} ms"
          + (f", GPU wait {f(gpu_wait * 1e3, 1)} ms" if gpu_wait is not None else ""))
    k = doc["cache"]
    print(f"\n3. DeviceCache ({k['mode']}): {k['samples']} samples {k['sample_shape']} uint8 + "
          f"label ({f(k['dataset_MB'], 0)} MB), batch {k['batch']}, "
          f"warm-up {f(k['warmup_s'], 2)} s")
    half = k["half_resident"]
    print(common.table([
        ["all resident", f(k["batches_per_s"], 0), f(k["gather_GBps"], 2),
         f(k["gather_to_copy"], 2)],
        ["half resident + host fallback", f(half["batches_per_s"], 0),
         f(half["gather_GBps"], 2), f(half["gather_GBps"] / k["device_copy_GBps"], 2)],
        ["device copy (bandwidth)", "-", f(k["device_copy_GBps"], 2), "1.00"],
    ], ["serving", "batches/s", "GB/s", "x copy"]))
    d = doc["dali"]
    if "skipped" in d or "error" in d or "source" in d:
        print("\n4. DALI decode: " + (d.get("skipped") or d.get("error") or str(d)))
    else:
        print(f"\n4. decode + augment to {d['size']}px, {d['images']} synthetic JPEGs, batch "
              f"{d['batch']}, {d['workers']} workers/threads (DALI {d['dali_mode']})")
        print(common.table([[k, f(d.get(f"{k}_images_per_s"), 0), d.get(f"{k}_error", "")]
                            for k in ("dali", "dali_premade_feed", "cpu_pipeline")],
                           ["pipeline", "images/s", "error"]))
        if "dali_over_cpu" in d:
            print(f"DALI / CPU pipeline = {f(d['dali_over_cpu'], 2)}")
    if doc["mode"] != "cuda":
        print("\nGPU figures (pinned vs pageable H2D, step overlap on CUDA, device gather vs HBM "
              "bandwidth, DALI GPU decode) need a GPU machine: run this script there without "
              "--device cpu.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when available, else cpu")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="synthetic step compute time")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/device*.json)")
    ap.add_argument("--root", default=common.default_root("device"),
                    help="where the DALI section's JPEG shards are made once "
                         "(default: %(default)s)")
    args = ap.parse_args()
    want = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: use --device cpu (the CPU mode)", file=sys.stderr)
        return 2
    if want == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    cuda, q = device.type == "cuda", args.quick
    doc: dict[str, Any] = {"benchmark": "bench_device", "mode": device.type, "quick": q,
                           "environment": {**common.environment(), **gpu_env(device)},
                           "args": vars(args)}
    if cuda:
        sizes = [1, 16, 64] if q else [1, 8, 64, 256]
    else:
        sizes = [1, 16, 64] if q else [1, 16, 128]
    doc["copy"] = bench_copy(device, sizes, args.repeats)
    shape = (256, 3, 224, 224) if cuda else (64, 3, 64, 64)
    doc["step"] = bench_step(device, 30 if q else 100, shape, args.step_ms, args.repeats)
    if cuda:
        doc["cache"] = bench_cache(device, 20000 if q else 100000, (3, 64, 64), 512, args.repeats,
                                   256 if q else 1024)
    else:
        doc["cache"] = bench_cache(device, 5000 if q else 20000, (3, 32, 32), 256, args.repeats,
                                   64 if q else 256)
    doc["dali"] = bench_dali(device, q, args.repeats, args.root)
    print_report(doc)
    name = "device" + ("" if cuda else "-cpu") + ("-quick" if q else "")
    path = args.out or common.write_results(name, doc)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        import json

        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
