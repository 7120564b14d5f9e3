"""Deterministic benchmark datasets, generated once and cached.

Three source datasets (small files on disk), each under ``ROOT/<size>/<name>/src``:

- ``images``: an image-folder tree of JPEGs, 160-320 px per side, 100 class folders, a JSON sidecar
  on every 10th image (``make_image_folder`` of ``feedpipe/convert/_synth.py``). ``quality=78``
  gives a mean JPEG of about 16.4 KiB (16.8 kB) for this generator; 77 gives 15.6 KiB, 80 gives 18.4
  KiB. Full: 100 classes x 200 = 20,000 images + 2,000 sidecars = 22,000 files.
- ``tiny``: 200,000 records of 1 KiB (``make_records``, the same module), per-sample overhead.
- ``big``: 1,000 records of 1 MiB, for MB/s against ``cat``.
- ``photos``: full-size JPEGs, 400-640 px per side (``quality=85``, about 120 KiB each), 10 class
  folders of 150: where decoding, not the loop, takes the time (``bench_versions.py``). Made
  only when asked for (``--only photos``).

``--quick`` uses a smaller variant of each (2,000 images, 20,000 records, 200 x 1 MiB) under
``ROOT/quick``. A dataset is complete when its ``.complete.json`` marker exists and records the
same parameters; it is generated into a temp dir and renamed, so a killed run leaves no half
dataset behind. Same parameters, same bytes.

Usage::

    python benchmarks/datasets.py [--root DIR] [--quick] [--only images,tiny,big]

``--root`` defaults to ``feedpipe-bench`` under the system temp dir (``tempfile.gettempdir()``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

DEFAULT_ROOT = os.path.join(tempfile.gettempdir(), "feedpipe-bench")
MARKER = ".complete.json"
JPEG_QUALITY = 78

SPECS: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "images": {"kind": "images", "classes": 100, "per_class": 200, "min_size": 160,
                   "max_size": 320, "sidecar_every": 10, "quality": JPEG_QUALITY, "seed": 0},
        "tiny": {"kind": "records", "count": 200_000, "size": 1024, "per_dir": 10_000, "seed": 0},
        "big": {"kind": "records", "count": 1_000, "size": 1 << 20, "per_dir": 1_000, "seed": 1},
        "photos": {"kind": "images", "classes": 10, "per_class": 150, "min_size": 400,
                   "max_size": 640, "sidecar_every": 10, "quality": 85, "seed": 2},
    },
    "quick": {
        "images": {"kind": "images", "classes": 100, "per_class": 20, "min_size": 160,
                   "max_size": 320, "sidecar_every": 10, "quality": JPEG_QUALITY, "seed": 0},
        "tiny": {"kind": "records", "count": 20_000, "size": 1024, "per_dir": 10_000, "seed": 0},
        "big": {"kind": "records", "count": 200, "size": 1 << 20, "per_dir": 1_000, "seed": 1},
        "photos": {"kind": "images", "classes": 10, "per_class": 20, "min_size": 400,
                   "max_size": 640, "sidecar_every": 10, "quality": 85, "seed": 2},
    },
}
NAMES = ("images", "tiny", "big")


def size_name(quick: bool) -> str:
    return "quick" if quick else "full"


def dataset_dir(root: str, quick: bool, name: str) -> str:
    return os.path.join(root, size_name(quick), name)


def _read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _stats(src: str) -> dict[str, Any]:
    files = 0
    total = 0
    by_ext: dict[str, list[int]] = {}
    for dirpath, _, filenames in os.walk(src):
        for n in filenames:
            if n.startswith("."):
                continue
            s = os.path.getsize(os.path.join(dirpath, n))
            files += 1
            total += s
            ext = n.rsplit(".", 1)[-1]
            acc = by_ext.setdefault(ext, [0, 0])
            acc[0] += 1
            acc[1] += s
    return {
        "files": files,
        "bytes": total,
        "by_ext": {e: {"files": c, "bytes": b, "mean_bytes": b / c} for e, (c, b) in
                   sorted(by_ext.items())},
    }


def ensure(name: str, *, root: str = DEFAULT_ROOT, quick: bool = False,
           verbose: bool = True) -> dict[str, Any]:
    """Make dataset ``name`` if it is not cached; return its info (``src`` path, file counts,
    sizes, expected samples)."""
    from feedpipe.convert import _synth as synth

    spec = SPECS[size_name(quick)][name]
    base = dataset_dir(root, quick, name)
    src = os.path.join(base, "src")
    marker = _read_marker(base)
    if marker is not None and marker.get("spec") == spec and os.path.isdir(src):
        return marker["info"]
    if os.path.exists(base):
        shutil.rmtree(base)
    tmp = base + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(os.path.join(tmp, "src"))
    t0 = time.perf_counter()
    if verbose:
        print(f"generating {name} ({size_name(quick)}) in {base} ...", file=sys.stderr, flush=True)
    if spec["kind"] == "images":
        args = {k: v for k, v in spec.items() if k != "kind"}
        synth.make_image_folder(os.path.join(tmp, "src"), **args)
        samples = spec["classes"] * spec["per_class"]
    else:
        args = {k: v for k, v in spec.items() if k != "kind"}
        synth.make_records(os.path.join(tmp, "src"), **args)
        samples = spec["count"]
    info = {"name": name, "size": size_name(quick), "src": src, "samples": samples,
            **_stats(os.path.join(tmp, "src")), "generate_seconds": time.perf_counter() - t0}
    with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
        json.dump({"spec": spec, "info": info}, f, indent=1)
    os.replace(tmp, base)
    if verbose:
        print(f"  {info['files']:,} files, {info['bytes'] / 1e6:,.1f} MB in "
              f"{info['generate_seconds']:.0f}s", file=sys.stderr, flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=DEFAULT_ROOT, help="cache directory (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the small variant of each dataset")
    ap.add_argument("--only", default=",".join(NAMES), help="comma-separated subset of "
                    f"{','.join(SPECS['full'])}")
    a = ap.parse_args(argv)
    for name in a.only.split(","):
        info = ensure(name, root=a.root, quick=a.quick)
        exts = ", ".join(f"{e}: {v['files']:,} x {v['mean_bytes'] / 1024:.1f} KiB"
                         for e, v in info["by_ext"].items())
        print(f"{name:7s} {info['samples']:>9,} samples {info['files']:>9,} files "
              f"{info['bytes'] / 1e6:>9,.1f} MB  ({exts})  {info['src']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
