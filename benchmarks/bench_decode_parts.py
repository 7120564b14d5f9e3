"""Where a decoded image's time goes on the recommended path (``ImagePipeline(224, train=True,
mean=None)`` writing into the rows of a ``BatchCollator``), per image, on one core.

The parts, each timed alone over the same JPEGs with the same crops and flips (the pipeline's
own draws for ``__seed__`` 0, ``__epoch__`` 1), in rounds that rotate their order:

    pipeline        ``ImagePipeline.into(sample, row)`` into the rows of one batch buffer: all
                    of the per-image work below, with its Python glue
    prelude         header (``jpeg_size``), the sample's generator, the crop and flip draw and
                    the DCT scale choice: the Python before the decode
    decode window   the decode floor: ``feedpipe._native._jpegcrop.decode_crop`` of each crop
                    window at the chosen scale, nothing else (no resize)
    resize+flip     ``resize_to_tensor(window, 224, flip=..., out=row)`` on the decoded windows:
                    resize, flip and the CHW write into the batch row
    whole decode    ``simplejpeg.decode_jpeg`` of each whole image at full size (the reference
                    ceiling bench_peers.py's ``ceil`` phase measures)
    one call, enlargements
                    ``feedpipe._native._jpegcrop.decode_crop_into`` of each crop window that
                    enlarges to 224 (the pipeline's one call for them: decode, resize, flip,
                    CHW write), per such image
    resize+flip, enlargements / reductions
                    the resize+flip part on the enlarged windows only and on the others only
                    (torch's antialiased reduction), per image of each kind
    loader          ``FeedLoader`` over shards of the same JPEGs (repeated to
                    ``--loader-images``), ``BatchCollator(256)``, shuffled epochs after their
                    first batch: the main process's CPU per image with 0 workers when the
                    transform skips the image work (the loop, labels, the sample's generator),
                    when it only reads the image's bytes (plus the shard's page faults), and
                    for the whole pipeline; images/s of the whole pipeline with 0 and 2
                    workers (with 2 workers on this machine's cores: not per-core)

Reported: the median over rounds of CPU microseconds per image (``time.thread_time``: on a
shared machine it counts this thread's own work, not the waits) for each part, wall figures
beside them, and the shares of the pipeline's time (the rest, ``pipeline - prelude - decode -
resize``, is the Python glue). Torch and OpenCV at one thread.

Usage::

    python benchmarks/bench_decode_parts.py [--images DIR] [--count 768] [--rounds 5]
                                            [--no-loader] [--loader-images 4096]

``--images``: a folder tree of JPEGs; default: the images bench_peers.py made under its default
root (160-320 px), else ``make_image_folder`` images in a temp dir. Writes
``benchmarks/results/bench_decode_parts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def _jpeg_paths(folder: str, count: int) -> list[str]:
    paths = sorted(p for p in common.walk_files(folder) if p.lower().endswith((".jpg", ".jpeg")))
    step = max(1, len(paths) // count)  # spread over the classes, not the first folders only
    return paths[::step][:count]


def _loader_parts(jpegs: list[bytes], tmp: str, rounds: int, total: int) -> dict[str, Any]:
    """The loop around the pipeline: ``FeedLoader`` + ``BatchCollator(256)`` over shards of
    ``jpegs``, main-process CPU microseconds per image with 0 workers for three transforms
    (the image work skipped; only the image's bytes read, which faults the shard's pages in;
    the whole pipeline), and images/s (wall) of the whole pipeline with 0 and 2 workers."""
    import feedpipe
    from feedpipe import BatchCollator, FeedLoader, ImagePipeline, ShardWriter

    class Skipped(ImagePipeline):
        """Labels, the sample's generator and the row checks; no image work."""

        def _image(self, data: Any, rng: Any, out: Any = None) -> Any:
            return out

    class BytesRead(ImagePipeline):
        """As Skipped, plus one read of the image's bytes (its pages faulted in)."""

        def _image(self, data: Any, rng: Any, out: Any = None) -> Any:
            bytes(data)
            return out

    shards = os.path.join(tmp, "shards")
    with ShardWriter(shards) as wr:
        for i in range(total):
            wr.write({"__key__": f"{i:06d}", "jpg": jpegs[i % len(jpegs)], "cls": b"0"})
    out: dict[str, Any] = {}
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    cases = [("image work skipped", Skipped, 0), ("bytes read", BytesRead, 0),
             ("pipeline", ImagePipeline, 0), ("pipeline", ImagePipeline, 2)]
    loaders = []
    for name, cls, nw in cases:
        tf = cls(224, train=True, mean=None)
        ds = feedpipe.FeedDataset(shards, shuffle=True, seed=0, transform=tf)
        loaders.append((f"{name}, {nw} workers", nw, FeedLoader(
            ds, batch_size=256, num_workers=nw, collate_fn=BatchCollator(256, tf.out_shape))))
    for r in range(rounds):
        for name, nw, fl in loaders[r % len(loaders):] + loaders[:r % len(loaders)]:
            fl.set_epoch(r)
            it = iter(fl)
            got = len(next(it)[0])  # the first batch: workers start, the loop warms up
            t0, c0 = time.perf_counter(), time.thread_time()
            n = sum(len(b[0]) for b in it)
            if nw == 0:
                cpu.setdefault(name, []).append((time.thread_time() - c0) / n * 1e6)
            wall.setdefault(name, []).append(n / (time.perf_counter() - t0))
            if got + n != total:
                raise SystemExit(f"{name}: an epoch gave {got + n} images, not {total}")
            out.setdefault("loader_route", {})[name] = fl.route.name
    out["loader_cpu_us_per_image"] = {k: round(statistics.median(v), 1) for k, v in cpu.items()}
    out["loader_images_per_s"] = {k: round(statistics.median(v), 1) for k, v in wall.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", default=None)
    ap.add_argument("--count", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-loader", action="store_true")
    ap.add_argument("--loader-images", type=int, default=4096,
                    help="samples in the loader's shards (the JPEGs repeated under new keys)")
    ap.add_argument("--out", default=os.path.join(common.RESULTS, "bench_decode_parts.json"))
    args = ap.parse_args(argv)

    import torch

    from feedpipe import ImagePipeline
    from feedpipe.transforms import _jpeg
    from feedpipe.transforms._decode import image_format
    from feedpipe.transforms._geometry import as_size, scale_box
    from feedpipe.transforms._resize import resize_to_tensor
    from feedpipe.transforms._seeding import scratch_rng

    if _jpeg._jpegcrop is None:
        raise SystemExit("feedpipe._native._jpegcrop is not built here: no window decode to "
                         "measure")
    import simplejpeg

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="feedpipe-decode-parts-")
    folder = args.images
    default = os.path.join(common.default_root("peers"), "full", "images", "src")
    if folder is None and os.path.isdir(default):
        folder = default
    if folder is None:
        from feedpipe.convert._synth import make_image_folder

        folder = os.path.join(tmp.name, "images")
        make_image_folder(folder, classes=16, per_class=max(1, args.count // 16), min_size=160,
                          max_size=320)
    paths = _jpeg_paths(folder, args.count)
    jpegs = []
    for p in paths:
        with open(p, "rb") as f:
            jpegs.append(f.read())
    if not jpegs:
        raise SystemExit(f"no JPEGs under {folder}")
    n = len(jpegs)
    pipe = ImagePipeline(224, train=True, mean=None)
    spec, size = pipe.spec, as_size(224)
    samples = [{"jpg": d, "cls": b"0", "__key__": str(i), "__shard__": "bench", "__index__": i,
                "__seed__": 0, "__epoch__": 1} for i, d in enumerate(jpegs)]
    batch = torch.empty((n, *pipe.out_shape), dtype=torch.uint8)
    rows = batch.unbind(0)

    # the same geometry the pipeline draws, computed once (untimed) for the parts
    plans = []
    for s in samples:
        h, w = _jpeg.jpeg_size(s["jpg"])
        box, flip = spec.geometry(h, w, scratch_rng(0, 1, s["__index__"]))
        min_h = -(-h * size[0] // box.height) if box.height > size[0] else h
        min_w = -(-w * size[1] // box.width) if box.width > size[1] else w
        k = _jpeg.jpeg_scale_num(h, w, min(min_h, h), min(min_w, w))
        dh, dw = _jpeg.scaled_size(h, w, k)
        sbox = box if k == 8 else scale_box(box, dh / h, dw / w, dh, dw)
        plans.append((h, w, box, flip, k, sbox))
    windows = [_jpeg.decode_window(d, h, w, box, min_height=min(
        -(-h * 224 // box.height) if box.height > 224 else h, h), min_width=min(
        -(-w * 224 // box.width) if box.width > 224 else w, w))
        for d, (h, w, box, _, _, _) in zip(jpegs, plans)]
    for (_, _, _, _, _, sbox), win in zip(plans, windows):  # untimed: the floor is that window
        if win.shape[:2] != (sbox.height, sbox.width):
            raise SystemExit(f"decode_window gave {win.shape[:2]}, not {sbox}")
    reference = torch.stack([pipe(s)[0] for s in samples])

    def pipeline() -> None:
        for s, row in zip(samples, rows):
            pipe.into(s, row)

    def prelude() -> None:
        for s in samples:
            d = s["jpg"]
            image_format(d)
            h, w = _jpeg.jpeg_size(d)
            box, _ = spec.geometry(h, w, scratch_rng(0, 1, s["__index__"]))
            min_h = -(-h * size[0] // box.height) if box.height > size[0] else h
            min_w = -(-w * size[1] // box.width) if box.width > size[1] else w
            _jpeg.jpeg_scale_num(h, w, min(min_h, h), min(min_w, w))

    crop = _jpeg._jpegcrop.decode_crop

    def decode_floor() -> None:
        for d, (_, _, _, _, k, b) in zip(jpegs, plans):
            crop(d, b.top, b.left, b.height, b.width, k)

    def resize() -> None:
        for win, (_, _, _, flip, _, _), row in zip(windows, plans, rows):
            resize_to_tensor(win, size, flip=flip, out=row)

    def whole() -> None:
        for d in jpegs:
            simplejpeg.decode_jpeg(d, colorspace="RGB")

    grows = [sb.height <= size[0] and sb.width <= size[1] for *_, sb in plans]
    into = _jpeg._jpegcrop.decode_crop_into

    def one_call() -> None:
        for d, (_, _, _, flip, k, b), row, up in zip(jpegs, plans, rows, grows):
            if up:
                into(d, b.top, b.left, b.height, b.width, row.numpy(), *size, flip, k)

    def resize_part(enlargements: bool) -> Callable[[], None]:
        def run() -> None:
            for win, (_, _, _, flip, _, _), row, up in zip(windows, plans, rows, grows):
                if up == enlargements:
                    resize_to_tensor(win, size, flip=flip, out=row)
        return run

    parts: dict[str, Callable[[], None]] = {
        "pipeline": pipeline, "prelude": prelude, "decode window": decode_floor,
        "resize+flip": resize, "whole decode": whole, "one call, enlargements": one_call,
        "resize+flip, enlargements": resize_part(True),
        "resize+flip, reductions": resize_part(False)}
    enlarge = sum(grows)
    per = {k: n for k in parts}  # the images each part's time is divided by
    per.update({"one call, enlargements": max(1, enlarge),
                "resize+flip, enlargements": max(1, enlarge),
                "resize+flip, reductions": max(1, n - enlarge)})
    for fn in parts.values():  # warm-up
        fn()
    if not torch.equal(batch, reference):
        raise SystemExit("into() rows differ from __call__'s images")
    times: dict[str, list[float]] = {k: [] for k in parts}
    cpu: dict[str, list[float]] = {k: [] for k in parts}
    names = list(parts)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            parts[name]()
            cpu[name].append((time.thread_time() - c0) / per[name] * 1e6)
            times[name].append((time.perf_counter() - t0) / per[name] * 1e6)
    us = {k: statistics.median(v) for k, v in cpu.items()}
    glue = us["pipeline"] - us["prelude"] - us["decode window"] - us["resize+flip"]
    result: dict[str, Any] = {
        "cpu_us_per_image": {k: round(v, 1) for k, v in us.items()},
        "wall_us_per_image": {k: round(statistics.median(v), 1) for k, v in times.items()},
        "glue_cpu_us_per_image": round(glue, 1),
        "share_of_pipeline": {k: round(us[k] / us["pipeline"], 3)
                              for k in ("prelude", "decode window", "resize+flip")},
        "rounds_us": {k: [round(x, 1) for x in v] for k, v in times.items()},
        "scale_counts": {str(k): sum(1 for p in plans if p[4] == k) for k in (1, 2, 3, 4, 8)},
        "enlargements": enlarge, "flips": sum(1 for p in plans if p[3]),
    }
    if not args.no_loader:
        result.update(_loader_parts(jpegs, tmp.name, args.rounds, args.loader_images))
    doc = {"environment": common.environment(), "images": folder, "count": n,
           "mean_bytes": round(sum(map(len, jpegs)) / n), "rounds": args.rounds,
           "loadavg": list(os.getloadavg()), "results": result}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds_us"}, indent=1))
    print(f"loadavg {os.getloadavg()}; wrote {args.out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
