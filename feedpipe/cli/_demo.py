"""``feedpipe demo``: the whole pipeline on a small synthetic dataset, explained as it runs."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..errors import OutputError

MARK = ".feedpipe-demo"  # names a --workdir as one the demo may clear and refill
MADE = ("images", "shards", "l1", "decoded", "l2")  # what the demo writes in its work directory


def demo(workdir: str | None = None, keep: bool = False, *,
         print_fn: Callable[..., None] = print) -> dict[str, Any]:
    """Run the whole pipeline on a small synthetic dataset, saying what happens as it runs.

    It makes images, shards them and streams them. It runs two shuffled epochs on two simulated
    ranks, with a save and a resume in the middle, and checks that every sample arrived exactly
    once. Then it shows the cache tiers (L1 shards, decoded store, L2 function index) and the
    device end (DeviceLoader, DeviceCache). ``feedpipe demo`` runs it; an example here would
    start worker processes, so the command's test runs it instead (``tests/test_demo.py``).

    Args:
        workdir: where to work, kept afterwards (default: a temp dir, removed at the end). A
            directory an earlier demo used is reused: its images, shards and caches are made
            anew. A directory holding other files of those names is refused.
        keep: keep the temp work directory.
        print_fn: where the running commentary goes (default: :func:`print`).

    Returns:
        The figures: ``workdir``, ``kept``, ``samples``, ``shards``, ``streamed``, ``epochs``,
        ``exactly_once``, ``tiers`` and ``device`` (the ``--json`` document).
    """
    from ..convert._shard import shard
    from ..convert._synth import make_image_folder

    own = workdir is None
    root: str = tempfile.mkdtemp(prefix="feedpipe-demo-") if workdir is None else workdir
    src, out = os.path.join(root, "images"), os.path.join(root, "shards")
    p = print_fn
    replaced = [] if own else _claim(root)
    result: dict[str, Any] | None = None
    try:
        fate = ("kept afterwards" if keep or not own
                else "removed at the end; --keep or --workdir DIR keeps it")
        p(f"feedpipe demo (work directory: {root}, {fate})")
        if replaced:
            p(f"   an earlier demo ran here: its {', '.join(d + '/' for d in replaced)} were "
              "removed and are made anew")
        nfiles = make_image_folder(src, classes=8, per_class=40, min_size=48, max_size=96, seed=0)
        p(f"1. made {nfiles} files: 320 JPEG images in 8 class folders, a JSON sidecar on every "
          "10th")
        s = shard(src, out, max_samples=64, labels_from_dirs=True, show_progress=False)
        p(f"2. feedpipe shard: {s.samples} samples -> {s.shards} shards ({s.bytes / 1e6:.2f} MB) "
          f"in {s.seconds:.2f}s, with DALI .idx indexes and manifest.json")

        n = _stream_step(out, p)
        seen: dict[int, list[int]] = {}
        for epoch in (0, 1):
            seen[epoch] = _epoch_step(out, epoch, s.samples, p)
        same = seen[0] == seen[1]
        once = all(sorted(v) == list(range(s.samples)) for v in seen.values())
        p(f"5. epochs 0 and 1 have {'the same' if same else 'different'} orders; "
          + ("each delivered every sample exactly once" if once
             else "PROBLEM: an epoch did not deliver every sample exactly once"))
        tiers = _cache_steps(out, root, p)
        device = _device_steps(out, p)
        result = {"workdir": root, "kept": keep or not own, "samples": s.samples,
                  "shards": s.shards, "streamed": n,
                  "epochs": {e: len(v) for e, v in seen.items()}, "exactly_once": once,
                  "tiers": tiers, "device": device}
        return result
    finally:
        if own and not keep:
            shutil.rmtree(root, ignore_errors=True)
            p(f"removed {root}")
        else:
            p(f"kept {root}")
        if result is not None:
            p(("verdict: OK, every epoch delivered every sample exactly once, across a resume "
               "on another number of ranks" if result["exactly_once"] else
               "verdict: PROBLEM, an epoch did not deliver every sample exactly once")
              + "; next: the tutorial (docs/tutorial.md), on your own images")


def _stream_step(out: str, p: Callable[..., None]) -> int:
    """Step 3: one pass of a FeedDataset over the shards, and its first sample; the samples."""
    import simplejpeg

    from ..stream._dataset import FeedDataset

    ds = FeedDataset(out)
    t0 = time.perf_counter()
    n, nbytes = 0, 0
    fields: Counter[str] = Counter()
    for sample in ds:
        n += 1
        for k, v in sample.items():
            if not k.startswith("__"):
                fields[k] += 1
                nbytes += len(v)
    dt = time.perf_counter() - t0
    first = next(iter(ds))
    img = simplejpeg.decode_jpeg(first["jpg"])
    p(f"3. FeedDataset streamed {n} samples ({nbytes / 1e6:.2f} MB) in {dt * 1e3:.1f} ms, "
      f"zero-copy from memory-mapped shards; fields {dict(sorted(fields.items()))}")
    p(f"   first sample: key {first['__key__']!r}, class {bytes(first['cls']).decode()}, "
      f"image {img.shape[1]}x{img.shape[0]}")
    return n


_WORLD, _BATCH = 2, 16  # the simulated ranks of steps 4 and 5, and their batch size


def _epoch_step(out: str, epoch: int, samples: int, p: Callable[..., None]) -> list[int]:
    """Step 4: one shuffled epoch on two ranks (epoch 1 stopped halfway, saved and resumed on
    one rank), said with its counts; the sample indices delivered, in order."""
    from ..stream._dataset import FeedDataset
    from ..stream._loader import FeedLoader

    world, batch = _WORLD, _BATCH
    ids: list[int] = []
    saved = None
    loaders = [FeedLoader(FeedDataset(out, shuffle=True, seed=7, rank=r, world_size=world),
                          batch_size=batch) for r in range(world)]
    iters = []
    for ld in loaders:
        ld.set_epoch(epoch)
        iters.append(iter(ld))
    steps = len(loaders[0])
    per_rank = [0] * world  # samples each rank trained on before a stop
    for step in range(steps):
        if epoch == 1 and step == steps // 2:
            saved = loaders[0].state_dict()  # rank 0's state resumes every rank
            break
        for r, it in enumerate(iters):
            got = next(it)["__index__"].tolist()
            ids += got
            per_rank[r] += len(got)
    where = f" over {world} ranks ({per_rank} per rank)"
    if saved is not None:
        p(f"   epoch 1: stopped after {steps // 2} of {steps} steps, saved state "
          f"{{epoch: {saved['epoch']}, position: {saved['position']}}}; resuming with 1 "
          "rank instead of 2")
        resumed = FeedLoader(FeedDataset(out, shuffle=True, seed=7, rank=0, world_size=1),
                             batch_size=batch)
        resumed.load_state_dict(saved)
        after = 0
        for b in resumed:
            got = b["__index__"].tolist()
            ids += got
            after += len(got)
        where = (f", {per_rank} on {world} ranks before the stop and {after} on 1 "
                 "rank after the resume")
    counts = Counter(ids)
    dup = sum(c - 1 for c in counts.values() if c > 1)
    p(f"{'4.' if epoch == 0 else '  '} epoch {epoch}: {len(ids)} samples{where}, "
      f"{len(counts)} distinct of {samples}, repeats {dup}, "
      f"first ids {ids[:6]}")
    return ids


def _claim(root: str) -> list[str]:
    """Make ``root`` ready for a demo: created if missing; the output of an earlier demo there
    (recognised by its marker file) removed. Refuses a directory holding files of the demo's
    names that a demo did not make. Returns the names removed."""
    found = [d for d in MADE if os.path.lexists(os.path.join(root, d))]
    mark = os.path.join(root, MARK)
    if found and not os.path.isfile(mark):
        raise OutputError(f"{root}: already holds {', '.join(d + '/' for d in found)} that "
                          "feedpipe demo did not make; give --workdir a new or empty directory "
                          "(the demo writes images/, shards/ and cache directories there)")
    try:
        os.makedirs(root, exist_ok=True)
        for d in found:
            path = os.path.join(root, d)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        with open(mark, "w", encoding="utf-8") as f:
            f.write("made by `feedpipe demo`: the next demo with this --workdir replaces "
                    + ", ".join(d + "/" for d in MADE) + "\n")
    except OSError as e:
        raise OutputError(f"{root}: cannot prepare the demo's work directory ({e})") from e
    return found


def _cache_steps(out: str, root: str, p: Any) -> dict[str, Any]:
    """The cache tiers, two epochs each: L1 (shards fetched once from a stand-in remote store),
    the decoded store (epoch 2 skips reading and decoding), L2 (a memoised function)."""
    from .._helpers.storage_io import remove_tree, write_bytes
    from ..caches.l2._index import FunctionIndex
    from ..stream._dataset import FeedDataset
    from ..transforms._ops import decode_jpeg
    from ..transforms._pipeline import ImagePipeline

    def two_epochs(ds: FeedDataset) -> list[float]:
        secs = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            t0 = time.perf_counter()
            for _ in ds:
                pass
            secs.append(time.perf_counter() - t0)
        return secs

    for tier in ("l1", "decoded", "l2"):  # start cold, also in a kept --workdir
        shutil.rmtree(os.path.join(root, tier), ignore_errors=True)
    # L1: the shards in an fsspec memory:// store stand in for s3:// or https://
    remote = f"memory://feedpipe-demo-{os.getpid()}/shards"
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name), "rb") as f:
            write_bytes(f"{remote}/{name}", f.read())
    try:
        # shards mixed two at a time (shuffle_window=2), two open at once: what a reader holds
        # fits the budget smaller than the dataset, which is met by evicting
        l1 = FeedDataset(remote, shuffle=True, seed=7, cache_dir=os.path.join(root, "l1"),
                         cache_size="1MB", max_open_shards=2, shuffle_window=2)
        two_epochs(l1)
        c = l1.cache.stats  # type: ignore[union-attr]
    finally:
        remove_tree(remote.rsplit("/", 1)[0])
    size = sum(r.bytes for r in l1.manifest.shards)
    p(f"6. L1 shard cache (budget 1 MB, dataset {size / 1e6:.2f} MB, shards from memory:// "
      f"standing in for a remote store): 2 epochs, {c.fills} "
      f"downloads ({c.prefetched} prefetched ahead), {c.hits} reads from the cache, "
      f"{c.evictions} evictions of the shard needed furthest ahead")

    pipe = ImagePipeline(48, train=False, mean=None)
    dec = FeedDataset(out, shuffle=True, seed=7, transform=pipe,
                      decoded_cache=os.path.join(root, "decoded"))
    e1, e2 = two_epochs(dec)
    d = dec.decoded.stats  # type: ignore[union-attr]
    p(f"7. decoded store (memmap of 3x48x48 uint8 crops): epoch 1 decoded {d.misses} images in "
      f"{e1 * 1e3:.0f} ms and stored them; epoch 2 served {d.hits} from the store in "
      f"{e2 * 1e3:.0f} ms without opening a shard ({e1 / max(e2, 1e-9):.0f}x)")

    index = FunctionIndex(os.path.join(root, "l2"))
    thumb = index.wrap(lambda jpg: decode_jpeg(jpg)[::8, ::8].copy(), params="thumb-1/8")
    l2 = FeedDataset(out, shuffle=True, seed=7, transform=lambda smp: thumb(bytes(smp["jpg"])))
    two_epochs(l2)
    st = index.stats()
    p(f"8. L2 function index (LMDB; key = function fingerprint + xxh3-128 of the input): "
      f"{st.misses} computed, {st.hits} hits, {st.dedup} duplicate inputs, {st.entries} entries")
    return {"l1": {"fills": c.fills, "hits": c.hits, "evictions": c.evictions},
            "decoded": {"hits": d.hits, "misses": d.misses, "speedup": e1 / max(e2, 1e-9)},
            "l2": {"hits": st.hits, "misses": st.misses, "entries": st.entries}}


def _device_steps(out: str, p: Any) -> dict[str, Any]:
    """The device end: decoded batches through FeedLoader's DeviceLoader, then the L3
    DeviceCache serving an epoch by on-device gather. CUDA when present, else the CPU path."""
    import torch

    from ..device._cache import DeviceCache
    from ..stream._dataset import FeedDataset
    from ..stream._loader import FeedLoader
    from ..transforms._pipeline import ImagePipeline

    device = "cuda" if torch.cuda.is_available() else "cpu"
    step_s = 0.004  # a stand-in training step, so that "waiting for data" means something
    ds = FeedDataset(out, shuffle=True, seed=7, transform=ImagePipeline(48, mean=None))
    loader = FeedLoader(ds, batch_size=32, num_workers=2, device=device)
    n, shape = 0, None
    for images, labels in loader:
        n += len(labels)
        shape = (tuple(images.shape), str(images.dtype).replace("torch.", ""), str(images.device))
        time.sleep(step_s)
    starvation, steady = _starvation(loader.stats())
    where = "CUDA: pinned buffers, side-stream copies" if device == "cuda" else \
        "no CUDA here: background prefetch, CPU tensors"
    p(f"9. FeedLoader(device={device!r}) [{where}]: {n} images decoded, random-resized-cropped "
      f"and flipped to 48x48 in 2 worker processes; batches {shape[0] if shape else '-'} "
      f"{shape[1] if shape else ''} on {shape[2] if shape else device}")
    if starvation is None:
        p("   the time spent waiting for data could not be measured: the DeviceLoader timed no "
          "step")
    elif steady is not None:  # the figure a long run sees first; the start is a one-off
        p(f"   with a {step_s * 1e3:.0f} ms step the loop waited for data {steady:.1%} of the "
          f"time after the first batch ({starvation:.1%} counting the first, which includes "
          "starting the workers): the data-starvation fraction")
    else:
        p(f"   with a {step_s * 1e3:.0f} ms step the loop waited for data {starvation:.1%} of "
          "the time (one batch only, the workers' start included): the data-starvation "
          "fraction")

    evalpipe = ImagePipeline(48, train=False, mean=None)
    per_sample = 3 * 48 * 48 + 8
    total = FeedDataset(out).manifest.total_samples
    cache = DeviceCache(per_sample * total // 2, device=device)  # half fits: the rest streams
    cache.warmup(FeedDataset(out), transform=evalpipe, show_progress=False)
    order = FeedDataset(out, shuffle=True, seed=7)
    served = sum(len(labels) for _, labels in cache.batches(order, 32))
    cs = cache.stats()
    p(f"10. DeviceCache on {device}: warm-up put {cs['resident']} of {cs['num_samples']} decoded "
      f"samples in {cs['bytes_used'] / 1e6:.2f} MB of preallocated buffers; an epoch of "
      f"{served} samples was served by on-device gather, hit ratio {cs['hit_ratio']:.2f} (the "
      "rest read and decoded through the normal path)")
    return {"device": device, "delivered": n, "starvation": starvation,
            "steady_starvation": steady, "cache_hit_ratio": cs["hit_ratio"],
            "cache_resident": cs["resident"]}


def _starvation(stats: dict[str, Any]) -> tuple[float | None, float | None]:
    """The DeviceLoader's data-starvation fractions from ``FeedLoader.stats()`` (they live under
    ``"device"``): the whole pass, and the pass after its first batch. ``None`` for a figure the
    loader could not measure (the DeviceLoader reports 0.0 then, which would read as "never
    waited"): no timed step, or a single batch for the second."""
    dev = stats.get("device") or {}
    steps, wall = dev.get("steps") or 0, dev.get("wall_s") or 0.0
    if steps < 1 or wall <= 0 or dev.get("starvation") is None:
        return None, None
    return dev["starvation"], dev.get("steady_starvation") if steps > 1 else None
