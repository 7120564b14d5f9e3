"""The ImageNet-like dataset bench_train.py trains on, generated once per spec and cached.

Every system reads the same JPEG files:

    ROOT/<name>/images/c0000/00000000.jpg ...   an image-folder tree: torchvision's ImageFolder
                                                and DALI's fn.readers.file read it as it is
    ROOT/<name>/shards/                         ``feedpipe shard --labels-from-dirs`` of it

Content: each image is made to cost what a photo costs to decode, not what a flat synthetic image
costs: a two-colour gradient background, 1/f noise summed over octaves (coarse shading down to
fine texture), a few dozen anti-aliased shapes of many sizes (edges at several frequencies),
textured regions and sensor noise, lightly blurred; encoded by OpenCV at the given quality with
4:2:0 chroma subsampling (as most ImageNet JPEGs are). Image ``i`` is class ``i % classes`` and is
a pure function of ``(seed, i)``: the same spec gives the same bytes on any machine, made in
parallel by a process pool. A dataset is complete when its ``.complete.json`` marker records the
same spec; it is generated into a temp directory and renamed, so no half dataset is ever used.

Usage (bench_train.py calls :func:`ensure`)::

    python benchmarks/train_data.py [--root DIR] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

MARKER = ".complete.json"
FULL = {"images": 50_000, "classes": 1_000, "width": 500, "height": 375, "quality": 90, "seed": 0}
QUICK = {"images": 256, "classes": 8, "width": 128, "height": 96, "quality": 90, "seed": 0}


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), "feedpipe-bench-train")


def spec_name(spec: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return f"imagenet-like-{spec['images']}x{spec['width']}x{spec['height']}-{digest}"


def photo(seed: int, i: int, height: int, width: int) -> np.ndarray:
    """Image ``i``: an ``(height, width, 3)`` uint8 BGR array with photo-like content."""
    import cv2

    rng = np.random.default_rng([seed, i])
    h, w = height, width
    c0, c1 = rng.uniform(20, 235, 3), rng.uniform(20, 235, 3)
    t = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    tilt = np.linspace(-0.3, 0.3, w, dtype=np.float32)[None, :, None] * rng.uniform(-1, 1)
    img = (c0 + (c1 - c0) * np.clip(t + tilt, 0, 1)).astype(np.float32)
    for k in range(7):  # 1/f noise: octave k has cells of about side / 2**(k+1)
        ny, nx = max(2, (2 << k) * h // max(h, w)), max(2, (2 << k) * w // max(h, w))
        small = rng.standard_normal((ny, nx, 3), dtype=np.float32)
        img += (40.0 * 0.62 ** k) * cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    img = np.ascontiguousarray(np.clip(img, 0, 255).astype(np.uint8))
    side = min(h, w)
    for _ in range(int(rng.integers(12, 40))):  # shapes from large to tiny: edges at every scale
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        r = max(1, int(side * rng.uniform(0.02, 0.5) ** 2))
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        thick = -1 if rng.random() < 0.6 else int(rng.integers(1, 5))
        kind = rng.integers(0, 4)
        if kind == 0:
            cv2.circle(img, (cx, cy), r, color, thick, cv2.LINE_AA)
        elif kind == 1:
            cv2.ellipse(img, (cx, cy), (r, max(1, r // 2)), float(rng.uniform(0, 180)), 0, 360,
                        color, thick, cv2.LINE_AA)
        elif kind == 2:
            cv2.rectangle(img, (cx - r, cy - r // 2), (cx + r, cy + r // 2), color, thick,
                          cv2.LINE_AA)
        else:
            pts = rng.integers(-r, r + 1, size=(int(rng.integers(3, 7)), 2)) + (cx, cy)
            cv2.polylines(img, [pts.astype(np.int32)], bool(rng.random() < 0.5), color,
                          max(1, thick), cv2.LINE_AA)
    f = img.astype(np.float32)
    shade = np.zeros((h, w, 1), np.float32)
    for k in range(2, 7):  # shading and texture over the shapes too: nothing is flat in a photo
        ny, nx = max(2, (2 << k) * h // max(h, w)), max(2, (2 << k) * w // max(h, w))
        small = rng.standard_normal((ny, nx), dtype=np.float32)
        shade[:, :, 0] += 0.75 ** k * cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    f *= 1.0 + 0.25 * shade
    f = np.asarray(cv2.GaussianBlur(f, (0, 0), float(rng.uniform(0.5, 0.8))), np.float32)  # lens
    mask = cv2.resize(rng.random((4, 4), dtype=np.float32), (w, h), interpolation=cv2.INTER_CUBIC)
    grain = rng.standard_normal((h, w), dtype=np.float32)
    f += (grain * (4.0 + 22.0 * np.clip(mask, 0, 1)))[:, :, None]  # textured regions (foliage)
    f += rng.standard_normal((h, w, 3), dtype=np.float32) * 2.0  # sensor noise
    return np.clip(f, 0, 255).astype(np.uint8)


def _write_range(args: tuple[str, dict[str, Any], int, int]) -> int:
    import cv2

    images, spec, a, b = args
    cv2.setNumThreads(1)
    total = 0
    for i in range(a, b):
        img = photo(spec["seed"], i, spec["height"], spec["width"])
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, spec["quality"]])
        if not ok:
            raise RuntimeError(f"OpenCV could not encode image {i}")
        path = os.path.join(images, f"c{i % spec['classes']:04d}", f"{i:08d}.jpg")
        with open(path, "wb") as fh:
            fh.write(buf.tobytes())
        total += len(buf)
    return total


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def generate(images: str, spec: dict[str, Any], workers: int) -> int:
    """Write the JPEGs of ``spec`` under ``images`` in parallel; returns their total bytes."""
    for c in range(spec["classes"]):
        os.makedirs(os.path.join(images, f"c{c:04d}"), exist_ok=True)
    n = spec["images"]
    step = max(1, min(500, -(-n // (workers * 4))))
    jobs = [(images, spec, a, min(n, a + step)) for a in range(0, n, step)]
    if workers <= 1:
        return sum(map(_write_range, jobs))
    with ProcessPoolExecutor(workers) as pool:
        return sum(pool.map(_write_range, jobs))


def ensure(root: str, spec: dict[str, Any], *, workers: int | None = None,
           verbose: bool = True) -> dict[str, Any]:
    """Make the dataset of ``spec`` under ``root`` unless it is there; returns its paths and
    figures (``images``: the image-folder tree, ``shards``: feedpipe's shards)."""
    import feedpipe

    base = os.path.join(root, spec_name(spec))
    try:
        with open(os.path.join(base, MARKER), encoding="utf-8") as fh:
            marker = json.load(fh)
        if marker.get("spec") == spec:
            return {**marker["info"], "images": os.path.join(base, "images"),
                    "shards": os.path.join(base, "shards")}
    except (OSError, ValueError):
        pass
    workers = workers or _cpus()
    shutil.rmtree(base, ignore_errors=True)
    tmp = base + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        if verbose:
            print(f"generating {spec['images']:,} JPEGs of {spec['width']}x{spec['height']} in "
                  f"{spec['classes']} classes under {base} ({workers} processes) ...",
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        nbytes = generate(os.path.join(tmp, "images"), spec, workers)
        t1 = time.perf_counter()
        feedpipe.shard(os.path.join(tmp, "images"), os.path.join(tmp, "shards"),
                       labels_from_dirs=True, workers=workers, show_progress=False)
        t2 = time.perf_counter()
        info = {"spec": spec, "jpeg_bytes": nbytes, "mean_jpeg_bytes": nbytes / spec["images"],
                "generate_s": t1 - t0, "shard_s": t2 - t1}
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as fh:
            json.dump({"spec": spec, "info": info}, fh, indent=1)
        os.replace(tmp, base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"  {nbytes / 1e6:,.0f} MB of JPEG (mean {nbytes / spec['images'] / 1e3:.1f} kB) in "
              f"{info['generate_s']:.0f} s, sharded in {info['shard_s']:.0f} s",
              file=sys.stderr, flush=True)
    return {**info, "images": os.path.join(base, "images"), "shards": os.path.join(base, "shards")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=default_root(), help="cache directory (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the small CPU variant")
    ap.add_argument("--images", type=int, default=None, help="number of images")
    ap.add_argument("--classes", type=int, default=None, help="number of classes")
    a = ap.parse_args(argv)
    spec = dict(QUICK if a.quick else FULL)
    if a.images:
        spec["images"] = a.images
    if a.classes:
        spec["classes"] = a.classes
    info = ensure(a.root, spec)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
