"""Window-only JPEG decoding (``feedpipe._native._jpegcrop``) against simplejpeg's whole decode,
on the random-resized crops ``ImagePipeline(224, train=True)`` draws.

Two comparisons on the same JPEGs and the same crop boxes (``sample_rng(0, 1, i)`` per image):
    decode      ``simplejpeg.decode_jpeg`` + slice to the box, against
                ``decode_window`` of ``feedpipe/transforms/_jpeg.py`` (the C extension decoding
                the box only)
    pipeline    ``ImagePipeline(224, train=True, mean=None)`` per sample (header, crop draw,
                decode, resize, flip, CHW ``uint8``) with the extension, against the same with
                that module's ``_jpegcrop`` set to ``None`` (simplejpeg's whole decode)

Rounds alternate the order of the two sides; each round times one pass over all images per side.
Reported: the median over rounds of each side's microseconds per image, and the median per-round
ratio (whole / window), the figure to trust on a noisy machine. The window's pixels are checked
equal to the whole decode's sliced (untimed). One process, torch and OpenCV at one thread.

Usage::

    python benchmarks/bench_window_decode.py [--images DIR] [--count 2000] [--rounds 7]

``--images``: a folder tree of JPEGs (default: 160-320 px images of ``make_image_folder`` in
``feedpipe/convert/_synth.py``, made in a temp dir). Writes
``benchmarks/results/window_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402


def _jpegs(folder: str, count: int) -> list[bytes]:
    paths = sorted(p for p in common.walk_files(folder) if p.lower().endswith((".jpg", ".jpeg")))
    out = []
    for p in paths[:count]:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", default=None)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(common.RESULTS, "window_decode.json"))
    args = ap.parse_args(argv)

    import numpy as np
    import simplejpeg
    import torch

    from feedpipe import ImagePipeline
    from feedpipe.diagnostics._env import jpeg_window_decoder
    from feedpipe.transforms import _jpeg
    from feedpipe.transforms._jpeg import jpeg_size
    from feedpipe.transforms._pipeline import sample_rng

    if _jpeg._jpegcrop is None:
        raise SystemExit("feedpipe._native._jpegcrop is not built here: nothing to compare")
    torch.set_num_threads(1)
    tmp = None
    folder = args.images
    if folder is None:
        from feedpipe.convert._synth import make_image_folder

        tmp = tempfile.TemporaryDirectory(prefix="feedpipe-window-")
        folder = os.path.join(tmp.name, "images")
        make_image_folder(folder, classes=20, per_class=max(1, args.count // 20), min_size=160,
                          max_size=320)
    jpegs = _jpegs(folder, args.count)
    if not jpegs:
        raise SystemExit(f"no JPEGs under {folder}")
    pipe = ImagePipeline(224, train=True, mean=None, label_field=None)
    heads = [jpeg_size(d) for d in jpegs]
    boxes = [pipe.spec.geometry(h, w, sample_rng(0, 1, i))[0] for i, (h, w) in enumerate(heads)]
    for d, (h, w), b in zip(jpegs, heads, boxes):  # untimed: the same pixels
        whole = simplejpeg.decode_jpeg(d, colorspace="RGB")
        if not np.array_equal(_jpeg.decode_window(d, h, w, b),
                              whole[b.top:b.top + b.height, b.left:b.left + b.width]):
            raise SystemExit(f"window pixels differ from the whole decode's for box {b}")
    ext = _jpeg._jpegcrop
    samples = [{"jpg": d, "__index__": i, "__epoch__": 1} for i, d in enumerate(jpegs)]

    def whole_decode() -> None:
        for d, b in zip(jpegs, boxes):
            simplejpeg.decode_jpeg(d, colorspace="RGB")[b.top:b.top + b.height,
                                                        b.left:b.left + b.width]

    def window_decode() -> None:
        for d, (h, w), b in zip(jpegs, heads, boxes):
            _jpeg.decode_window(d, h, w, b)

    def pipeline(with_ext: bool) -> None:
        _jpeg._jpegcrop = ext if with_ext else None
        try:
            for s in samples:
                pipe(s)
        finally:
            _jpeg._jpegcrop = ext

    cases = {"decode": {"whole": whole_decode, "window": window_decode},
             "pipeline": {"whole": lambda: pipeline(False), "window": lambda: pipeline(True)}}
    result: dict[str, Any] = {}
    for case, sides in cases.items():
        for fn in sides.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {"whole": [], "window": []}
        for r in range(args.rounds):
            order = ["whole", "window"] if r % 2 == 0 else ["window", "whole"]
            for side in order:
                t0 = time.perf_counter()
                sides[side]()
                times[side].append((time.perf_counter() - t0) / len(jpegs) * 1e6)
        ratios = [a / b for a, b in zip(times["whole"], times["window"])]
        result[case] = {
            "us_per_image": {k: round(statistics.median(v), 1) for k, v in times.items()},
            "ratio_whole_over_window": round(statistics.median(ratios), 3),
            "rounds_us": {k: [round(x, 1) for x in v] for k, v in times.items()},
        }
        print(f"{case}: whole {result[case]['us_per_image']['whole']} us, window "
              f"{result[case]['us_per_image']['window']} us an image, "
              f"{result[case]['ratio_whole_over_window']}x")
    doc = {"environment": common.environment(), "images": folder if tmp is None else "synthetic",
           "count": len(jpegs), "mean_bytes": round(sum(map(len, jpegs)) / len(jpegs)),
           "jpeg_window_decoder": jpeg_window_decoder(), "rounds": args.rounds,
           "results": result}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    render_results.render(args.out, force=True, benchmark="window_decode")  # .md and .png
    print(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
