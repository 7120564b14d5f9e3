"""Decoding images that are not plain JPEGs: which library ``feedpipe.image_decode`` should use for
each format, measured, and what ``ImagePipeline`` costs per format.

Part 1, ``decoders``: every candidate turns the same encoded bytes into an HWC ``uint8`` RGB array
(alpha dropped, 16-bit reduced to 8, EXIF orientation ignored: what ``image_decode`` promises):
    opencv    ``cv2.imdecode(..., IMREAD_COLOR_RGB | IMREAD_IGNORE_ORIENTATION)``
    pillow    ``Image.open`` + ``convert("RGB")`` (where the mode is not RGB) + ``np.asarray``
    pyvips    ``Image.new_from_buffer(access="sequential")``, 16-bit cast down, alpha and grey
              bands handled, ``write_to_memory`` (where ``pyvips`` imports; its operation
              cache off)
    pillow-heif  ``pillow_heif.open_heif`` (HEIC only; where it imports)
    simplejpeg   (the JPEG row only: today's JPEG decoder, for reference)
Formats (``feedpipe.convert._synth``'s noisy gradients, 500 x 375 like an average ImageNet
photo, made in memory): PNG RGB, RGBA, palette, grey, 16-bit RGB; WebP lossy, lossless; AVIF;
HEIC; JPEG RGB and CMYK. A decoder that cannot read a format is left out of its row. Each
decoder's pixels are compared (untimed) with OpenCV's: the maximum absolute difference is in the
table.

Part 2, ``pipeline``: ``ImagePipeline(224, train=True, mean=None)`` per sample on each format's
bytes (random-resized crop, flip, CHW ``uint8``), as a ratio to the JPEG row.

The process is pinned to one CPU (``sched_setaffinity``; multi-threaded decoders get one core, as
a DataLoader worker does), torch and OpenCV at one thread, libvips' concurrency 1. After one
untimed warm-up, each of ``--passes`` passes hands every image of a format to every decoder back
to back, in an order that rotates with the image and the pass (``common.alternating``), so a
burst of load from elsewhere hits all of them alike; a pass's figure is the sum over its images.
Reported: the median over passes of the microseconds per image, and the median of the per-pass
ratios to OpenCV (the figure to trust on a noisy machine).

Usage::

    python benchmarks/bench_image_formats.py [--count 30] [--passes 7] [--quick]

Writes ``benchmarks/results/image_formats.json`` and ``image_formats.md`` (``-quick`` suffix with
``--quick``).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import render_results

Decoder = Callable[[bytes], Any]


def _images(count: int, h: int, w: int) -> list[Any]:
    import numpy as np

    from feedpipe.convert._synth import _image

    rng = np.random.default_rng(0)
    return [_image(rng, h, w, i % 7) for i in range(count)]


def _encode(images: list[Any]) -> dict[str, list[bytes]]:
    """Every format and mode of the table, from the same pictures."""
    import cv2
    import numpy as np
    import simplejpeg
    from PIL import Image

    def pil(arr: Any, fmt: str, mode: str | None = None, **kw: Any) -> bytes:
        im = Image.fromarray(arr)
        if mode is not None:
            im = im.convert(mode) if mode != "P" else im.quantize(256)
        buf = io.BytesIO()
        im.save(buf, fmt, **kw)
        return buf.getvalue()

    out: dict[str, list[bytes]] = {}
    alpha = [np.dstack([a, np.full(a.shape[:2], 200, np.uint8)]) for a in images]
    out["png-rgb"] = [pil(a, "PNG") for a in images]
    out["png-rgba"] = [pil(a, "PNG") for a in alpha]
    out["png-palette"] = [pil(a, "PNG", "P") for a in images]
    out["png-grey"] = [pil(a, "PNG", "L") for a in images]
    out["png-rgb16"] = [cv2.imencode(".png", (a[:, :, ::-1].astype(np.uint16) * 257))[1].tobytes()
                        for a in images]
    out["webp-lossy"] = [pil(a, "WEBP", quality=85) for a in images]
    out["webp-lossless"] = [pil(a, "WEBP", lossless=True) for a in images]
    out["avif"] = [pil(a, "AVIF", quality=75) for a in images]
    try:
        import pillow_heif
    except ImportError:
        pass
    else:
        heic = []
        for a in images:
            buf = io.BytesIO()
            pillow_heif.from_bytes("RGB", (a.shape[1], a.shape[0]), a.tobytes()).save(
                buf, format="HEIF", quality=75)
            heic.append(buf.getvalue())
        out["heic"] = heic
    out["jpeg-rgb"] = [simplejpeg.encode_jpeg(a, quality=85) for a in images]
    out["jpeg-cmyk"] = [pil(a, "JPEG", "CMYK", quality=85) for a in images]
    return out


def _decoders() -> dict[str, Decoder]:
    import cv2
    import numpy as np
    import simplejpeg
    from PIL import Image

    cv2.setNumThreads(0)
    flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION

    def opencv(data: bytes) -> Any:
        return cv2.imdecode(np.frombuffer(data, np.uint8), flags)

    def pillow(data: bytes) -> Any:
        im = Image.open(io.BytesIO(data))
        if im.mode != "RGB":
            im = im.convert("RGB")
        return np.asarray(im)

    out: dict[str, Decoder] = {"opencv": opencv, "pillow": pillow,
                               "simplejpeg": lambda d: simplejpeg.decode_jpeg(d, "RGB")}
    try:
        import pyvips
    except (ImportError, OSError):
        pass
    else:
        pyvips.concurrency_set(1)
        pyvips.cache_set_max(0)  # no operation cache: every pass decodes, as the others do

        def vips(data: bytes) -> Any:
            im = pyvips.Image.new_from_buffer(data, "", access="sequential")
            if im.format != "uchar":
                im = im.cast("uchar", shift=True)
            bands = im.bands
            if bands in (2, 4):
                im = im.extract_band(0, n=bands - 1)
            if im.bands == 1:
                im = im.bandjoin([im, im])
            return np.frombuffer(im.write_to_memory(), np.uint8).reshape(im.height, im.width, 3)

        out["pyvips"] = vips
    try:
        import pillow_heif
    except ImportError:
        pass
    else:
        def heif(data: bytes) -> Any:
            f = pillow_heif.open_heif(io.BytesIO(data), convert_hdr_to_8bit=True)
            arr = np.asarray(f)
            return arr[:, :, :3]

        out["pillow-heif"] = heif
    return out


_ONLY = {"simplejpeg": ("jpeg-rgb", "jpeg-cmyk"), "pillow-heif": ("heic",)}


def _reference(decoders: dict[str, Decoder], data: bytes) -> tuple[str, Any]:
    """The first decoder (OpenCV where it can) that reads ``data``, and its pixels."""
    for name, dec in decoders.items():
        try:
            got = dec(data)
        except Exception:  # noqa: BLE001, S112 - a decoder that cannot read it is skipped
            continue
        if got is not None:
            return name, got
    raise SystemExit("no decoder reads this format")


def _works(dec: Decoder, data: list[bytes], ref: Any) -> tuple[bool, int | None]:
    import numpy as np

    try:
        got = dec(data[0])
    except Exception:  # noqa: BLE001 - a decoder that cannot read the format is left out
        return False, None
    if got is None or got.shape != (*ref.shape[:2], 3):
        return False, None
    return True, int(np.abs(got.astype(np.int16) - ref.astype(np.int16)).max())


def _bench(cases: dict[str, Callable[[int], object]], n: int, passes: int,
           base: str) -> dict[str, Any]:
    """Time ``cases[name](i)`` for every item ``i < n``: within a pass, each item goes through
    every case back to back, in an order that rotates with the item and the pass, so a burst of
    load from elsewhere hits every case alike; a pass's time is the sum over its items."""
    names = list(cases)
    for fn in cases.values():  # warm-up
        fn(0)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for p in range(passes):
        spent = dict.fromkeys(names, 0.0)
        for i in range(n):
            for name in common.alternating(names, p + i):
                t0 = clock()
                cases[name](i)
                spent[name] += clock() - t0
        for name in names:
            times[name].append(spent[name] / n * 1e6)
    out: dict[str, Any] = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[base])] if base in times else []
        out[name] = {"us_per_image": round(statistics.median(ts), 1),
                     "ratio_to_" + base: round(statistics.median(ratios), 3) if ratios else None,
                     "passes_us": [round(t, 1) for t in ts]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=30, help="images per format")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--height", type=int, default=375)
    ap.add_argument("--width", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="8 images, 3 passes")
    ap.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: the last)")
    args = ap.parse_args(argv)
    if args.quick:
        args.count, args.passes = 8, 3

    if hasattr(os, "sched_setaffinity"):
        cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)
    from feedpipe import ImagePipeline

    encoded = _encode(_images(args.count, args.height, args.width))
    decoders = _decoders()
    decode: dict[str, Any] = {}
    for fmt, data in encoded.items():
        usable = {name: dec for name, dec in decoders.items()
                  if name not in _ONLY or fmt in _ONLY[name]}
        ref_name, ref = _reference(usable, data[0])
        row: dict[str, Callable[[int], object]] = {}
        diffs: dict[str, int | None] = {}
        for name, dec in usable.items():
            ok, diff = _works(dec, data, ref)
            if ok:
                row[name] = (lambda i, dec=dec, data=data: dec(data[i]))
                diffs[name] = diff
        base = "opencv" if "opencv" in row else ref_name
        res = _bench(row, len(data), args.passes, base)
        for name in res:
            res[name]["ratio_to_opencv"] = res[name].pop("ratio_to_" + base) if (
                base == "opencv") else None
            res[name]["max_diff_from_reference"] = diffs[name]
            res[name]["reference"] = ref_name
        decode[fmt] = {"mean_bytes": round(sum(map(len, data)) / len(data)), "decoders": res}
        print(fmt, {k: (v["us_per_image"], v["ratio_to_opencv"]) for k, v in res.items()},
              flush=True)

    cases: dict[str, Callable[[int], object]] = {}
    for fmt, data in encoded.items():
        samples = [{"img": d, "__index__": i, "__epoch__": 1} for i, d in enumerate(data)]
        pipe_fmt = ImagePipeline(224, train=True, mean=None, label_field=None, image_field="img")
        try:
            pipe_fmt(samples[0])
        except Exception as e:  # noqa: BLE001 - e.g. HEIC without pillow-heif
            print(f"pipeline {fmt}: {e}")
            continue
        cases[fmt] = lambda i, p=pipe_fmt, s=samples: p(s[i])
    pipeline = _bench(cases, args.count, args.passes, "jpeg-rgb")
    print("pipeline", {k: (v["us_per_image"], v["ratio_to_jpeg-rgb"])
                       for k, v in pipeline.items()})

    env = common.environment()
    env["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    env["versions"].update({m: common._version(m) for m in (
        "opencv-python-headless", "pillow", "pyvips", "pyvips-binary", "pillow-heif")})
    doc = {"environment": env, "count": args.count, "passes": args.passes,
           "size": [args.height, args.width], "pinned_cpus": 1, "decode": decode,
           "pipeline": pipeline}
    name = "image_formats" + ("-quick" if args.quick else "")
    path = common.write_results(name, doc)
    md = _markdown(doc)
    with open(path[:-len(".json")] + ".md", "w", encoding="utf-8") as f:
        f.write(md)
    render_results.render(path, force=True, parts=("png",))  # its chart (the .md is above)
    print(md)
    print(f"wrote {path}")
    return 0


def _markdown(doc: dict[str, Any]) -> str:
    h, w = doc["size"]
    lines = [(f"# Image formats: decoders ({doc['count']} images of {w}x{h} per format, "
              f"{doc['passes']} alternating passes, one CPU)"), "",
             ("Microseconds per image (median over passes); ratio: median per-pass ratio to "
              "OpenCV (lower is faster); max diff: largest difference in grey levels from "
              "the reference decoder's pixels (OpenCV's where it reads the format)."), "",
             "| format | bytes | decoder | us/image | ratio to opencv | max diff | reference |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for fmt, row in doc["decode"].items():
        ranked = sorted(row["decoders"].items(), key=lambda kv: (
            kv[1]["ratio_to_opencv"] if kv[1]["ratio_to_opencv"] is not None else 0.0,
            kv[1]["us_per_image"]))
        for name, r in ranked:
            lines.append(f"| {fmt} | {row['mean_bytes']} | {name} | {r['us_per_image']} | "
                         f"{r['ratio_to_opencv']} | {r['max_diff_from_reference']} | "
                         f"{r['reference']} |")
    lines += ["", "## ImagePipeline(224, train=True, mean=None) per format", "",
              "| format | us/sample | ratio to jpeg-rgb |", "| --- | ---: | ---: |"]
    for fmt, r in doc["pipeline"].items():
        lines.append(f"| {fmt} | {r['us_per_image']} | {r['ratio_to_jpeg-rgb']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
