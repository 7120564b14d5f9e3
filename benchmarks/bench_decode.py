"""Single-core JPEG decode + resize to 224x224: which decoder and which resize feedpipe's CPU
pipeline should use, measured.

Every system turns the same JPEG bytes into a 224x224 RGB ``uint8`` image: the centred square of the
shorter side, resized (antialiased bilinear) to 224 — the evaluation transform without the 0.875
margin. Three image sets are made with ``make_image_folder`` (``feedpipe/convert/_synth.py``,
quality 85): ``small`` (20 JPEGs, 160-320 px a side, where no reduced-scale decode is possible) and
``large`` (20 JPEGs, 640-1280 px, where 3/8 to 1/4 scale decoding applies). The synthetic images
carry strong pixel noise, about 4 bits per pixel at quality 85, so Huffman decoding, which no scaled
decode saves, dominates; ``large-smooth`` is the ``large`` set low-passed (1/4 area mean, bicubic
back up) and re-encoded at quality 85, about 0.5-1 bit per pixel like typical photos. The bits per
pixel of each set are in the JSON.

Systems:
    sj-full             simplejpeg full-size decode, crop, torch uint8 interpolate (channels-last)
    sj-reduced          simplejpeg decode at the smallest k/8 scale (factor >= 2) keeping the
                        shorter side >= 224 (DecodeJPEG(min_size=224)), crop, torch interpolate
    sj-reduced-fast     sj-reduced with fastdct and fastupsample
    sj-full-floatresize sj-full but resizing in float32 (what a naive uint8->float port does)
    pil-full            Pillow decode, Image.resize(BILINEAR, box=crop) (antialiased)
    pil-draft           Pillow with draft('RGB', size) (libjpeg scaled decode), then resize
    fp-eval             feedpipe.ImagePipeline (eval, uint8, crop_fraction=1: the same task),
                        sample dict in, CHW tensor out: what ships
    fp-train            ImagePipeline(224, train=True): random-resized crop + flip, normalised
                        float32 CHW (per-sample rng included)
    dali-cpu            DALI 'cpu' backend (decoders.image, resize, crop), num_threads=1, fed by
                        external_source in batches of the 20 images (reference; DALI's executor
                        threads share the same core)

Each pass is a fresh interpreter pinned to one CPU (``sched_setaffinity``), torch at one thread,
that holds every system: one untimed warm-up pass per system, then *rounds* until ``--seconds``
have elapsed (at least 3), each round timing one pass over the set of every system, in an order
that alternates between rounds (and between passes). Interleaving matters on a shared, noisy
machine: a burst of load from elsewhere hits every system alike, and the per-round ratio to
``sj-full`` cancels most of it. Reported per set and system: the median over passes of the
median images/s over rounds (and its spread over passes), the median over passes of the median
per-round ratio to ``sj-full`` (the figure to trust), and the mean absolute difference (grey
levels) of the system's images from ``sj-full``'s (untimed).

Usage::

    python benchmarks/bench_decode.py [--quick] [--passes 3] [--seconds 20]
                                      [--systems sj-full,sj-reduced,...] [--sets small,large]

Writes ``benchmarks/results/decode.json`` (``decode-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SIZE = 224
SYSTEMS = ("sj-full", "sj-reduced", "sj-reduced-fast", "sj-full-floatresize", "pil-full",
           "pil-draft", "fp-eval", "fp-train", "dali-cpu")
SETS = {"small": (160, 320), "large": (640, 1280), "large-smooth": (640, 1280)}
COUNT = 20


# -- worker side ---------------------------------------------------------------------------
def _load(folder: str) -> list[bytes]:
    out = []
    for p in common.walk_files(folder):
        if p.endswith(".jpg"):
            with open(p, "rb") as f:
                out.append(f.read())
    return out


def _center(h: int, w: int) -> tuple[int, int, int]:
    side = min(h, w)
    return (h - side) // 2, (w - side) // 2, side


def _make_system(name: str, jpegs: list[bytes]) -> Any:
    """A function ``run() -> list of outputs`` doing one pass over ``jpegs``."""
    import numpy as np

    if name.startswith("sj-"):
        import simplejpeg
        import torch
        import torch.nn.functional as F

        from feedpipe.transforms._geometry import shorter_side_size
        from feedpipe.transforms._resize import resize_to_tensor

        reduced = name.startswith("sj-reduced")
        fast = name == "sj-reduced-fast"
        floaty = name == "sj-full-floatresize"

        def one(data: bytes) -> Any:
            mh = mw = 0
            if reduced:
                h, w, _, _ = simplejpeg.decode_jpeg_header(data)
                mh, mw = shorter_side_size(h, w, SIZE)
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=mh, min_width=mw,
                                         min_factor=2, fastdct=fast, fastupsample=fast)
            top, left, side = _center(*img.shape[:2])
            crop = img[top:top + side, left:left + side]
            if floaty:
                x = torch.from_numpy(crop).permute(2, 0, 1).unsqueeze(0).float()
                x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True,
                                  align_corners=False)
                return x[0].round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
            return resize_to_tensor(crop, (SIZE, SIZE)).permute(1, 2, 0).numpy()

        return lambda: [one(j) for j in jpegs]

    if name.startswith("pil-"):
        import io

        from PIL import Image

        draft = name == "pil-draft"

        def one_pil(data: bytes) -> Any:
            im = Image.open(io.BytesIO(data))
            if draft:
                w, h = im.size
                s = min(h, w)
                im.draft("RGB", (max(SIZE, -(-w * SIZE // s)), max(SIZE, -(-h * SIZE // s))))
            im = im.convert("RGB")
            w, h = im.size
            top, left, side = _center(h, w)
            out = im.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + side, top + side))
            return np.asarray(out)

        return lambda: [one_pil(j) for j in jpegs]

    if name.startswith("fp-"):
        from feedpipe import ImagePipeline, ImageSpec

        train = name == "fp-train"
        spec = ImageSpec(SIZE, train=True) if train else ImageSpec(SIZE, train=False,
                                                                     crop_fraction=1.0, mean=None)
        pipe = ImagePipeline.from_spec(spec, label_field=None)
        samples = [{"jpg": j, "__index__": i, "__epoch__": 0, "__seed__": 0}
                   for i, j in enumerate(jpegs)]
        if train:
            return lambda: [pipe(s) for s in samples]
        return lambda: [pipe(s).permute(1, 2, 0).numpy() for s in samples]

    if name == "dali-cpu":
        from nvidia.dali import Pipeline, fn, types

        arrays = [np.frombuffer(j, dtype=np.uint8) for j in jpegs]
        pipe = Pipeline(batch_size=len(arrays), num_threads=1, device_id=None,
                        prefetch_queue_depth=1)
        with pipe:
            enc = fn.external_source(source=lambda: arrays, batch=True, dtype=types.UINT8)
            img = fn.decoders.image(enc, device="cpu", output_type=types.RGB)
            img = fn.resize(img, resize_shorter=SIZE, antialias=True)
            img = fn.crop(img, crop=(SIZE, SIZE))
            pipe.set_outputs(img)
        pipe.build()

        def run_dali() -> list[Any]:
            (out,) = pipe.run()
            return [np.array(out[i]) for i in range(len(out))]

        return run_dali
    raise SystemExit(f"unknown system {name}")


def _pin_one_core() -> int | None:
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1]
    os.sched_setaffinity(0, {core})
    return core


def worker(spec: dict[str, Any]) -> None:
    """All systems in one process pinned to one core, interleaved: round ``r`` runs one pass of
    every system (order alternating by round), so a burst of contention from the rest of the
    machine hits every system alike; per-round ratios to ``sj-full`` cancel most of it."""
    core = _pin_one_core()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    jpegs = _load(spec["folder"])
    names = spec["systems"]
    runs = {n: _make_system(n, jpegs) for n in names}
    ref = runs["sj-full"]() if "sj-full" in runs else _make_system("sj-full", jpegs)()
    diffs: dict[str, float | None] = {}
    for n, run in runs.items():
        outs = run()  # warm-up, and the outputs for the quality check (untimed)
        if n == "fp-train":
            diffs[n] = None  # random crops: not comparable
            continue
        if any(tuple(o.shape) != (SIZE, SIZE, 3) for o in outs):
            raise SystemExit(f"{n}: wrong output shape {outs[0].shape}")
        diffs[n] = float(np.mean([np.abs(np.asarray(o, dtype=np.int16) - r.astype(np.int16))
                                  .mean() for o, r in zip(outs, ref)]))
    rates: dict[str, list[float]] = {n: [] for n in names}
    t_end = time.perf_counter() + spec["seconds"]
    r = 0
    while r < spec["min_rounds"] or time.perf_counter() < t_end:
        for n in common.alternating(names, r):
            t0 = time.perf_counter()
            runs[n]()
            rates[n].append(len(jpegs) / (time.perf_counter() - t0))
        r += 1
    common.emit({"core": core, "rounds": r, "rates": rates, "mean_abs_diff": diffs})


# -- parent side ---------------------------------------------------------------------------
def _smooth(src: str, dst: str) -> None:
    """Low-pass every JPEG of ``src`` into ``dst`` (photo-like entropy), quality 85."""
    import numpy as np
    import simplejpeg
    import torch
    import torch.nn.functional as F

    for p in common.walk_files(src):
        with open(p, "rb") as f:
            img = simplejpeg.decode_jpeg(f.read(), colorspace="RGB")
        h, w = img.shape[:2]
        x = torch.from_numpy(img).permute(2, 0, 1)[None].float()
        x = F.interpolate(F.avg_pool2d(x, 4), size=(h, w), mode="bicubic", align_corners=False)
        out = x[0].clamp(0, 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
        rel = os.path.relpath(p, src)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        with open(os.path.join(dst, rel), "wb") as f:
            f.write(simplejpeg.encode_jpeg(np.ascontiguousarray(out), quality=85,
                                           colorspace="RGB"))


def make_sets(root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    import simplejpeg

    from feedpipe.convert._synth import make_image_folder

    out = {}
    for name in names:
        lo, hi = SETS[name]
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            if name.endswith("-smooth"):
                raw = os.path.join(root, name + "-raw")
                make_image_folder(raw, classes=1, per_class=COUNT, min_size=lo, max_size=hi,
                                  sidecar_every=0, quality=85, seed=7)
                _smooth(raw, folder)
            else:
                make_image_folder(folder, classes=1, per_class=COUNT, min_size=lo, max_size=hi,
                                  sidecar_every=0, quality=85, seed=7)
        jpegs = _load(folder)
        pixels = sum(int(a) * int(b) for a, b, _, _ in map(simplejpeg.decode_jpeg_header, jpegs))
        out[name] = {"folder": folder, "count": len(jpegs), "min_size": lo, "max_size": hi,
                     "quality": 85, "bytes": sum(map(len, jpegs)),
                     "bits_per_pixel": 8 * sum(map(len, jpegs)) / pixels}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 passes of 5 s per set")
    ap.add_argument("--passes", type=int, default=None,
                    help="worker processes per set, system order alternating (3; quick 2)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="interleaved rounds per pass and set, at least 3 rounds (20; quick 5)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--root", default=None, help="where the JPEG sets go (a temp dir)")
    a = ap.parse_args(argv)
    passes = a.passes or (2 if a.quick else 3)
    seconds = a.seconds or (5.0 if a.quick else 20.0)
    systems = [s for s in a.systems.split(",") if s]
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        if "dali-cpu" in systems:
            print("nvidia.dali not importable: skipping dali-cpu", file=sys.stderr)
            systems.remove("dali-cpu")
    sets = [s for s in a.sets.split(",") if s]
    env = common.environment()
    env["versions"].update({m: common._version(m) for m in ("pillow", "nvidia-dali-cuda130")})
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        made = make_sets(a.root or tmp, sets)
        folders = {s: made[s].pop("folder") for s in sets}
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sets}
        for p in range(passes):
            for s in sets:
                res = common.run_worker(SCRIPT, {"systems": common.alternating(systems, p),
                                                 "folder": folders[s], "seconds": seconds,
                                                 "min_rounds": 3})
                if "error" in res:
                    failed = True
                    print(f"!! {s}: {res['error']}\n{res.get('stderr_tail', '')}",
                          file=sys.stderr)
                else:
                    runs[s].append(res)
            print(f"pass {p + 1}/{passes} done", file=sys.stderr)
    results: dict[str, Any] = {}
    rows = []
    for s in sets:
        results[s] = {}
        for name in systems:
            # per pass: median images/s over its rounds, and median of per-round ratios
            ips = [common.median(r["rates"][name]) for r in runs[s]]
            ratios = [common.median(x / b for x, b in zip(r["rates"][name], r["rates"]["sj-full"]))
                      for r in runs[s]] if "sj-full" in systems else []
            med, ratio = common.median(ips), common.median(ratios)
            diff = next((r["mean_abs_diff"][name] for r in runs[s]), None)
            results[s][name] = {"images_per_s_median": med,
                                "images_per_s_pass_medians": ips,
                                "ratio_to_sj_full": ratio,
                                "ratio_to_sj_full_pass_medians": ratios,
                                "rounds_per_pass": [r["rounds"] for r in runs[s]],
                                "mean_abs_diff_vs_sj_full": diff}
            rows.append([f"{s}/{name}", common.fmt(med),
                         "-" if not ips else f"{common.fmt(min(ips))}-{common.fmt(max(ips))}",
                         common.fmt(ratio, 2),
                         "-" if not ratios else f"{min(ratios):.2f}-{max(ratios):.2f}",
                         common.fmt(diff, 2)])
    doc = {
        "benchmark": "bench_decode",
        "task": f"JPEG bytes -> centred square of the shorter side resized to {SIZE}x{SIZE} "
                "RGB uint8, one CPU core",
        "sets": made,
        "passes": passes,
        "seconds_per_pass": seconds,
        "environment": env,
        "results": results,
    }
    path = common.write_results("decode-quick" if a.quick else "decode", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    print(common.table(rows, ["set/system", "images/s", "pass spread", "x sj-full",
                              "ratio spread", "diff"]))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(common.load_spec(sys.argv[2]))
    else:
        sys.exit(main())
