"""Crop + resize to 224 + flip into a CHW ``uint8`` image, on one core: the one-pass C resize that
:func:`feedpipe.transforms._resize.resize_to_tensor` takes for enlargements against the OpenCV
path it takes without the C extension and the torch path it takes without either.

The images are decoded once (untimed) from the ``--quick`` peer dataset's JPEGs (160-320 px, made
by ``datasets.py`` under ``--root``, bench_peers.py's default root unless given) or from
``feedpipe.convert._synth`` images when that folder is absent (said on stderr); every image gets
the random-resized crop box and flip that ``ImagePipeline`` would draw (torchvision's algorithm,
scale 0.08-1). Only crops that fit inside 224x224 (enlargements, the C and OpenCV case) are
timed; ``--all`` times reductions too, which every path sends through torch.

Systems:
    torch    ``resize_to_tensor`` with the C extension and OpenCV hidden: contiguous HWC copy
             (with the flip), ``F.interpolate(bilinear, antialias=True)`` on ``uint8``
             channels-last, then the CHW write
    opencv   ``resize_to_tensor`` with the C extension hidden: ``cv2.resize(INTER_LINEAR)``,
             ``cv2.flip``, ``cv2.split`` into the planes of a CHW tensor
    onepass  ``resize_to_tensor`` as shipped: ``feedpipe._native._jpegcrop.resize_into``
             (resize, flip and CHW write in one pass)

Each writes into the rows of one reused batch buffer of 256 (as ``ImagePipeline.into`` writes a
``BatchCollator``'s). Rounds alternate the order of the systems; reported: the median ms per
image over rounds, the median per-round ratios to onepass, and the mean / max absolute
difference of the torch and opencv outputs from onepass's (grey levels).

Usage::

    python benchmarks/bench_resize.py [--seconds 10] [--images 500] [--all] [--root DIR]

Writes ``benchmarks/results/resize.json``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import datasets  # noqa: E402
import render_results  # noqa: E402


def _images(n: int, root: str) -> list[Any]:
    import numpy as np

    from feedpipe.transforms._jpeg import decode_jpeg

    src = os.path.join(datasets.dataset_dir(root, True, "images"), "src")
    files = sorted(glob.glob(os.path.join(src, "*", "*.jpg")))[:n]
    if files:
        out = []
        for f in files:
            with open(f, "rb") as fh:
                out.append(decode_jpeg(fh.read()))
        return out
    from feedpipe.convert._synth import _image

    print(f"no JPEGs under {src}: timing {n} synthetic images instead (bench_peers.py --quick "
          "--root ROOT makes the peer dataset)", file=sys.stderr)
    rng = np.random.default_rng(0)
    return [_image(rng, int(rng.integers(160, 321)), int(rng.integers(160, 321)), i % 7)
            for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--all", action="store_true", help="time reductions too")
    ap.add_argument("--root", default=common.default_root("peers"),
                    help="bench_peers.py's data root, for its --quick JPEGs (default: "
                         "%(default)s)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from feedpipe.transforms import _opencv, _resize
    from feedpipe.transforms._geometry import random_resized_crop_box
    from feedpipe.transforms._resize import resize_to_tensor

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    if _opencv.opencv() is None:
        raise SystemExit("opencv-python-headless is not installed")
    rng = np.random.default_rng(0)
    work = []
    for img in _images(args.images, args.root):
        b = random_resized_crop_box(img.shape[0], img.shape[1], rng)
        crop = img[b.top:b.top + b.height, b.left:b.left + b.width]
        if args.all or (b.height <= 224 and b.width <= 224):
            work.append((crop, bool(rng.random() < 0.5)))

    one_pass = _resize._resize_into
    if one_pass is None:
        raise SystemExit("feedpipe._native._jpegcrop is not built (pip install -e . with "
                         "libjpeg-dev)")
    systems = ["torch", "opencv", "onepass"]

    batch = torch.empty((256, 3, 224, 224), dtype=torch.uint8)

    def run(system: str, keep: bool = False) -> list[Any]:
        _opencv._CV2 = False if system == "torch" else None
        _resize._resize_into = one_pass if system == "onepass" else None
        try:
            # into the rows of one batch buffer, as ImagePipeline.into writes a BatchCollator's
            return [resize_to_tensor(c, (224, 224), flip=f, out=batch[i % len(batch)]).clone()
                    if keep else resize_to_tensor(c, (224, 224), flip=f,
                                                  out=batch[i % len(batch)])
                    for i, (c, f) in enumerate(work)]
        finally:
            _opencv._CV2 = None
            _resize._resize_into = one_pass

    outs = {s: run(s, keep=True) for s in systems}  # warm-up, and the outputs to compare
    times: dict[str, list[float]] = {s: [] for s in systems}
    ratios: dict[str, list[float]] = {"torch": [], "opencv": []}
    t_end = time.perf_counter() + args.seconds
    r = 0
    while r < 3 or time.perf_counter() < t_end:
        per = {}
        for s in common.alternating(systems, r):
            t0 = time.perf_counter()
            run(s)
            per[s] = (time.perf_counter() - t0) / len(work) * 1e3
            times[s].append(per[s])
        for s in ratios:
            ratios[s].append(per[s] / per["onepass"])
        r += 1
    grey = {}
    for s in ("torch", "opencv"):
        diffs = [(a.int() - b.int()).abs() for a, b in zip(outs[s], outs["onepass"])]
        grey[s] = {"mean": float(sum(float(d.float().mean()) for d in diffs) / len(diffs)),
                   "max": int(max(int(d.max()) for d in diffs))}
    doc = {
        "environment": common.environment(),
        "task": "random-resized crop of a decoded 160-320 px image -> 224x224 CHW uint8, flip "
                f"with p=0.5; {'all crops' if args.all else 'enlargements only'}",
        "images": len(work), "rounds": r,
        "ms_per_image": {s: common.median(v) for s, v in times.items()},
        "over_onepass": {s: common.median(v) for s, v in ratios.items()},
        "grey_levels_from_onepass": grey,
    }
    path = common.write_results("resize", doc)
    render_results.render(path, force=True)  # the Markdown and chart beside it
    ms = doc["ms_per_image"]
    print(f"{len(work)} crops, {r} rounds, ms per image: onepass {ms['onepass']:.3f}, opencv "
          f"{ms['opencv']:.3f} ({doc['over_onepass']['opencv']:.2f}x), torch {ms['torch']:.3f} "
          f"({doc['over_onepass']['torch']:.2f}x); max difference from onepass: opencv "
          f"{grey['opencv']['max']}, torch {grey['torch']['max']} grey levels -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
