"""Real training steps fed by each data system, side by side on one machine (issue 24).

Trains torchvision's ResNet-50 (bf16 autocast, channels_last, SGD, batch 256) and ViT-B/16 (bf16
autocast, AdamW, batch 256), with ``torch.compile`` where it works (train_loop.py), on an
ImageNet-like dataset generated on local disk (train_data.py: 50,000 JPEGs of 500x375 at quality
90 in 1,000 classes), fed by each system of train_systems.py in its documented best setup for the
machine's cores: (a) synthetic batches already on the GPU, the ceiling; (b) torchvision's
ImageFolder + DataLoader; (c) DALI's own pipeline; (d) feedpipe's CPU path; (e) feedpipe's DALI
stage; (f) feedpipe's second epoch from the decoded store and from DeviceCache.

Each (model, system) runs in a fresh process (common.run_worker): the model is built and
compiled on a synthetic batch first (outside every figure), then the system is opened and timed
to its first batch, then ``--warmup`` steps, then ``--steps`` measured steps. Figures per system
and model: steady-state images/s; the fraction of step time the loop waited for data (CUDA
events; on the CPU wall clock, labelled); CPU cores busy (CPU seconds of the process tree / wall
seconds over the measured steps); peak host RSS summed over the process tree (psutil); GPU memory
(torch's peak allocated and reserved, and the device's peak in use); the first epoch's time to
first batch. A system that fails is reported with its error. The bars of issue 24 are computed as
ratios of figures from this same run and written, met or not, into the Markdown.

``--quick`` runs on the CPU in seconds: a tiny conv net, 256 JPEGs of 128x96 in 8 classes, batch
32 at 64 px, 2 workers, over the systems that run on a CPU, each over one whole epoch, and
checks that every system delivered every sample (tests/test_bench_train.py runs it).

Usage::

    python benchmarks/bench_train.py                       # GPU machine: both models, all systems
    python benchmarks/bench_train.py --models resnet50     # one model (each fits a 10-min slot)
    python benchmarks/bench_train.py --quick               # CPU, seconds
    python benchmarks/plot_train.py --results benchmarks/results/bench_train.json

Writes ``benchmarks/results/<name>.json`` and ``.md`` and ``.png`` (name: ``bench_train``,
``-quick`` suffixed with --quick, or ``--name``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import train_data
from train_systems import FEEDPIPE, QUICK_SYSTEMS, SYSTEMS

SCRIPT = os.path.abspath(__file__)
MODELS = ("resnet50", "vit_b_16")
BARS = {"synthetic": 0.97, "wait": 0.03, "cpu_vs_torchvision": 1.5, "dali_vs_dali": 1.0}


# ----------------------------------------------------------------------------- worker side


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One (model, system) measurement in this process."""
    import itertools

    import torch
    import train_loop as tl
    from train_systems import Context, check_system, open_system

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    res: dict[str, Any] = {"system": spec["system"], "model": spec["model"]}
    check_system(spec["system"])  # fail before the model is built and compiled
    sampler = tl.TreeSampler(device)
    with sampler:
        trainer = tl.Trainer(spec["model"], spec["classes"], device, spec["compile"])
        g = torch.Generator().manual_seed(1)
        shape = (spec["batch"], 3, spec["size"], spec["size"])
        xw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
        yw = torch.randint(0, spec["classes"], (spec["batch"],), generator=g).to(device)
        res["model_warm_s"] = trainer.warm(xw, yw, steps=1 if spec["check"] else 3)
        res["compile"], res["compile_error"] = trainer.compiled, trainer.compile_error
        del xw, yw
        ctx = Context(spec, device)
        t0 = time.perf_counter()
        system = open_system(spec["system"], ctx)
        try:
            res["label"], res["setup"] = system.name, system.setup
            res["prepare"] = system.prepare()
            it = system.epoch(0)
            first = next(it)
            x, y = system.unpack(first)
            trainer.sync()
            res["first_batch_s"] = time.perf_counter() - t0
            labels: list[Any] | None = [] if spec["check"] else None
            if system.fill_epochs:  # the store's filling epoch: read, not trained on
                n = len(y)
                for b in it:
                    n += len(system.unpack(b)[1])
                trainer.sync()
                fill_s = time.perf_counter() - t0
                res["fill"] = {"seconds": fill_s, "samples": n, "images_per_s": n / fill_s}
                it = system.epoch(1)
            else:
                it = itertools.chain([first], it)
            del first, x, y
            aug_gen = torch.Generator(device).manual_seed(0)
            augment = ((lambda x: tl.gpu_augment(x, spec["size"], aug_gen, trainer.mean,
                                                 trainer.std)) if system.augment else None)
            res["augment"] = "random-resized crop + flip on the device" if augment else None
            res.update(tl.measure(it, system.unpack, trainer, spec["warmup"], spec["steps"],
                                  sampler, augment, labels))
            if labels is not None:  # the rest of the epoch, then: every sample once?
                labels += [system.unpack(b)[1].cpu() for b in it]
                res["delivered"] = int(sum(len(v) for v in labels))
                res["label_counts"] = torch.bincount(torch.cat(labels),
                                                     minlength=spec["classes"]).tolist()
            res["stats"] = system.stats()
        finally:
            system.close()
    res["peak_rss_bytes"] = sampler.peak_rss
    res["peak_processes"] = sampler.peak_procs
    if cuda:
        res["gpu_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        res["gpu_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        res["gpu_peak_used_bytes"] = sampler.peak_gpu_used
    return res


def worker(arg: str) -> int:
    spec = common.load_spec(arg)
    try:
        res = run_one(spec)
    except Exception as e:  # noqa: BLE001 - reported, not dropped
        import traceback

        res = {"system": spec["system"], "model": spec["model"],
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    common.emit(res)
    return 0


# ----------------------------------------------------------------------------- driver side


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def bars(results: dict[str, dict[str, Any]], cuda: bool) -> list[dict[str, Any]]:
    """Issue 24's bars for one model, from this run's figures (each a ratio)."""
    def ips(s: str) -> float | None:
        return results.get(s, {}).get("images_per_s")

    out: list[dict[str, Any]] = []
    syn = ips("synthetic")
    fp = [(ips(s), s) for s in FEEDPIPE if ips(s)]
    best = max(fp) if fp else (None, None)
    r = _ratio(best[0], syn)
    wait = results.get(best[1] or "", {}).get("wait_fraction")
    out.append({"bar": f">= {BARS['synthetic']:.0%} of the synthetic-data rate and data wait "
                       f"<= {BARS['wait']:.0%} (feedpipe's best path: {best[1]})",
                "ratio": r, "wait_fraction": wait,
                "met": (r is not None and wait is not None and r >= BARS["synthetic"]
                        and wait <= BARS["wait"])})
    tv = next((s for s in ("torchvision", "files-pil") if s in results), "torchvision")
    tv_res = results.get(tv, {})
    bound = (tv_res.get("wait_fraction") or 0) > BARS["wait"] or \
        (_ratio(ips(tv), syn) or 1.0) < BARS["synthetic"]
    r = _ratio(ips("feedpipe"), ips(tv))
    out.append({"bar": f"feedpipe's CPU path >= {BARS['cpu_vs_torchvision']}x {tv} images/s "
                       "where the DataLoader is the bottleneck",
                "ratio": r, "dataloader_bound": bound,
                "met": None if not bound else (r is not None and r >= BARS["cpu_vs_torchvision"])})
    r = _ratio(ips("feedpipe-dali"), ips("dali"))
    out.append({"bar": "feedpipe's DALI path >= DALI's own pipeline images/s", "ratio": r,
                "met": None if r is None else r >= BARS["dali_vs_dali"]})
    for b in out:
        b["counts"] = cuda  # the bars are GPU bars: on the CPU the ratios are shown, not judged
    return out


TABLE_HEAD = ("| system | images/s | x synthetic | data wait | ms/step | cores busy | "
              "peak RSS GB | GPU peak GB | first batch s | note |")


def markdown(doc: dict[str, Any]) -> str:
    f = common.fmt
    gb = 1e9
    cuda = doc["device"].startswith("cuda")
    env = doc["environment"]
    steps = "the rest of the epoch's" if doc["quick"] else str(doc["args"]["steps"])
    spec = doc["data"]["spec"]
    title = (f"# bench_train ({'quick, ' if doc['quick'] else ''}{doc['device']}"
             f"{', ' + env.get('gpu', '') if cuda else ' — CPU: no GPU figure'})")
    about = (f"Data: {spec['images']:,} JPEGs of {spec['width']}x{spec['height']} "
             f"q{spec['quality']} in {spec['classes']} classes (mean "
             f"{doc['data']['mean_jpeg_bytes'] / 1e3:.1f} kB); batch {doc['args']['batch']}, "
             f"{doc['args']['size']} px, {doc['workers']} workers/threads, {doc['cpus']} CPUs; "
             f"{doc['args']['warmup']} warm-up + {steps} measured steps, one pass per system. "
             f"Data wait: {'CUDA events' if cuda else 'wall clock (CPU)'}.")
    head = [title, "", about, ""]
    lines = head
    for model, res in doc["results"].items():
        syn = res.get("synthetic", {}).get("images_per_s")
        lines += [f"## {model}", "", TABLE_HEAD,
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for s, r in res.items():
            if "error" in r:
                lines.append(f"| {s} | - | - | - | - | - | - | - | - | failed: "
                             f"{r['error'][:200].replace('|', '/')} |")
                continue
            note = [f"compile {r.get('compile')}"]
            if r.get("fill"):
                note.append(f"fill epoch {f(r['fill']['images_per_s'])} img/s")
            if r.get("prepare", {}).get("warmup_s") is not None:
                note.append(f"warm-up {f(r['prepare']['warmup_s'], 1)} s")
            if "delivered" in r:
                note.append(f"delivered {r['delivered']}/{doc['data']['spec']['images']}")
            wait = r.get("wait_fraction")
            lines.append(
                f"| {r.get('label', s)} | {f(r.get('images_per_s'))} | "
                f"{f(_ratio(r.get('images_per_s'), syn), 3)} | "
                f"{f(100 * wait, 1) + '%' if wait is not None else '-'} | "
                f"{f(r.get('ms_per_step'), 1)} | {f(r.get('cores_busy'), 1)} | "
                f"{f(r.get('peak_rss_bytes', 0) / gb, 2)} | "
                f"{f(r['gpu_peak_used_bytes'] / gb, 1) if r.get('gpu_peak_used_bytes') else '-'}"
                f" | {f(r.get('first_batch_s'), 2)} | {'; '.join(note)} |")
        lines += ["", "| bar | ratio | met |", "|---|---:|---|"]
        for b in doc["bars"][model]:
            met = ("n/a on the CPU" if not b["counts"] else
                   "n/a (the DataLoader keeps up)" if b["met"] is None and
                   "dataloader_bound" in b else "not measured" if b["met"] is None else
                   "**met**" if b["met"] else "**not met**")
            extra = (f" (wait {f(100 * b['wait_fraction'], 1)}%)"
                     if b.get("wait_fraction") is not None else "")
            lines.append(f"| {b['bar']} | {f(b['ratio'], 3)}{extra} | {met} |")
        lines.append("")
    lines += ["Setups:", ""]
    first = next(iter(doc["results"].values()), {})  # every model runs the same setups
    for s, r in first.items():
        if r.get("setup"):
            lines.append(f"* {r.get('label', s)}: {r['setup']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=train_data.default_root(),
                    help="dataset cache directory (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, a few hundred JPEGs")
    ap.add_argument("--models", default=None, help=f"comma-separated of {','.join(MODELS)}")
    ap.add_argument("--systems", default=None, help=f"comma-separated of {','.join(SYSTEMS)}")
    ap.add_argument("--images", type=int, default=None, help="dataset size (default 50,000)")
    ap.add_argument("--classes", type=int, default=None, help="classes (default 1,000)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (256; quick 32)")
    ap.add_argument("--size", type=int, default=None, help="training image side (224; quick 64)")
    ap.add_argument("--workers", type=int, default=None, help="workers/threads (all CPUs; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (15; quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (100; quick: the rest "
                    "of the epoch)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile: auto = on CUDA only")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per system run")
    ap.add_argument("--name", default=None, help="results file stem")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: use --quick or --device cpu", file=sys.stderr)
        return 2
    q = a.quick
    cpus = train_data._cpus()
    spec = dict(train_data.QUICK if q else train_data.FULL)
    if a.images:
        spec["images"] = a.images
    if a.classes:
        spec["classes"] = a.classes
    models = (a.models or ("tiny" if q else ",".join(MODELS))).split(",")
    systems = (a.systems or ",".join(QUICK_SYSTEMS if q else SYSTEMS)).split(",")
    if "synthetic" in systems:  # the ceiling first
        systems.remove("synthetic")
        systems.insert(0, "synthetic")
    batch = a.batch or (32 if q else 256)
    size = a.size or (64 if q else 224)
    workers = a.workers or (2 if q else cpus)
    warmup = a.warmup if a.warmup is not None else (1 if q else 15)
    per_epoch = spec["images"] // batch  # full batches: compiled shapes never change
    steps = a.steps or (10**9 if q else 100)
    if not q and warmup + steps > per_epoch:
        steps = max(1, per_epoch - warmup)
        print(f"--steps lowered to {steps}: warm-up and measured steps stay within one epoch's "
              f"{per_epoch} full batches", file=sys.stderr)
    a.root = os.path.abspath(a.root)  # the workers run in benchmarks/
    if a.out:
        common.RESULTS = os.path.abspath(a.out)
    os.makedirs(common.RESULTS, exist_ok=True)
    t_start = time.perf_counter()
    data = train_data.ensure(a.root, spec, workers=cpus)
    scratch = os.path.join(a.root, "scratch")
    os.makedirs(scratch, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "bench_train", "quick": q, "device": device, "cpus": cpus,
        "workers": workers, "args": {**vars(a), "batch": batch, "size": size, "warmup": warmup,
                                     "steps": steps, "models": models, "systems": systems},
        "environment": common.environment(a.root), "data": data, "results": {}, "bars": {},
        "page_cache": "warm: the dataset was just generated or read on this machine"}
    if device == "cuda":
        doc["environment"]["gpu"] = torch.cuda.get_device_name(0)
        doc["environment"]["torch_cuda"] = torch.version.cuda
    for mod in ("torchvision", "nvidia-dali-cuda130", "psutil", "opencv-python-headless",
                "pillow"):
        doc["environment"]["versions"][mod] = common._version(mod)
    name = a.name or ("bench_train" + ("-quick" if q else ""))
    failed = False
    for model in models:
        doc["results"][model] = {}
        for system in systems:
            wspec = {"system": system, "model": model, "device": device, "batch": batch,
                     "size": size, "classes": spec["classes"], "workers": workers,
                     "warmup": warmup, "steps": steps, "compile": "off" if q else a.compile,
                     "check": q, "images": data["images"], "shards": data["shards"],
                     "samples": spec["images"], "scratch": scratch}
            t0 = time.perf_counter()
            r = common.run_worker(SCRIPT, wspec, timeout=a.timeout or (300 if q else 900))
            r["run_s"] = time.perf_counter() - t0
            doc["results"][model][system] = r
            if "error" in r:
                failed = True
                print(f"{model:9s} {system:15s} FAILED: {r['error']}\n{r.get('stderr_tail', '')}"
                      f"{r.get('traceback', '')}", file=sys.stderr, flush=True)
            else:
                print(f"{model:9s} {r.get('label', system):15s} "
                      f"{common.fmt(r.get('images_per_s')):>8s} img/s, wait "
                      f"{100 * (r.get('wait_fraction') or 0):5.1f}%, cores "
                      f"{common.fmt(r.get('cores_busy'), 1)}, first batch "
                      f"{common.fmt(r.get('first_batch_s'), 2)} s", flush=True)
            common.write_results(name, doc)  # so far: a run cut short keeps what it measured
        labels = {r.get("label", s): r for s, r in doc["results"][model].items()}
        doc["bars"][model] = bars(labels, device == "cuda")
    text = markdown(doc)
    print("\n" + text)
    with open(os.path.join(common.RESULTS, name + ".md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    if not a.no_plot:
        try:
            import plot_train

            doc["plot"] = os.path.relpath(plot_train.plot(doc, os.path.join(
                common.RESULTS, name + ".png")), common.REPO)
        except ImportError as e:
            doc["plot_error"] = f"no plot: {e}"
    return common.finish(name, doc, [text], [], failed, t_start)


if __name__ == "__main__":
    sys.exit(main())
