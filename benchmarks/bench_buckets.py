"""Aspect-ratio buckets: ``feedpipe.Bucketed`` against the shortest correct alternative a user
would write, a bucketed batch sampler over a map-style ``Dataset`` of the same images.

Corpus: ``--images`` JPEGs (default 1,500; seed 0) whose sides are drawn from 128 to 512 pixels
(aspect ratios from 1/4 to 4), written once under ``--root`` twice: as files in a folder (what
the map-style dataset reads) and as feedpipe shards (``write_samples``; the sizes are recorded
at shard time). Buckets: :func:`feedpipe.generated_buckets` of ``--area`` (256^2), step 32,
ratios within [1/4, 4].

Megatron-Energon's grouping (where ``megatron-energon`` is installed; ``--systems`` leaves it
out): the same shards prepared once with ``energon prepare`` (a copy beside them, its
``.nv-meta``: ``ImageClassificationSample`` of ``jpg``), ``get_train_dataset(...,
repeat=False)`` with a task encoder whose ``batch_group_criterion`` is the image's bucket
(feedpipe's own assignment) and whose ``encode_sample`` resizes to cover the bucket and crops
the centre (torch); a new dataset each epoch (``seed_offset=epoch``); its ``plan s`` is the
one-time ``energon prepare`` where the run made it. Energon delivers each
group's remainder as a short batch at the end of a pass. Its correctness beside feedpipe's:
one epoch read by 2 ranks one after the other, each rank's batch count and whether the ranks
together delivered each image exactly once (``ranks``).

The alternative (:class:`Sampler` and :class:`Images` below): the sizes read once with
Pillow's lazy ``Image.open`` (timed apart, as ``plan_s``), each image to the nearest bucket in
log ratio, each epoch every bucket's indices shuffled with ``seed + epoch``, cut into batches,
remainders dropped and the batches shuffled together; a ``DataLoader(batch_sampler=...)``
whose dataset decodes with Pillow, resizes to cover the bucket and crops the centre (torch at
one thread a process in both systems: the machine is shared). feedpipe:
``FeedLoader(Bucketed(FeedDataset(shards), batch, buckets))`` with ``BucketCrop``'s centre
crop.

Each (system, workers) runs in a fresh interpreter: ``--epochs`` epochs (the first with the
workers' start), checking every batch: one bucket, no image twice in an epoch, and the images
delivered plus the remainders equal to the corpus. ``--passes`` passes, the order alternated.
The figure to read: the per-pass ratio of feedpipe's steady images/s (median of epochs 2..N) to
the alternative's at the same number of workers, its median over passes, and the load average
beside it (the machine may be shared).

Usage::

    python benchmarks/bench_buckets.py [--images 1500] [--batch 16] [--epochs 3] [--passes 3]
        [--root DIR] [--name bench_buckets]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402  (beside this script)
    RESULTS,
    alternating,
    default_root,
    emit,
    environment,
    finish,
    fmt,
    load_spec,
    median,
    run_worker,
    spread,
    table,
)

SYSTEMS = ("feedpipe", "sampler", "energon")
WORKERS = (0, 2)


def make_corpus(root: str, n: int) -> dict[str, Any]:
    import cv2

    import feedpipe

    folder, shards = os.path.join(root, f"files-{n}"), os.path.join(root, f"shards-{n}")
    rng = np.random.default_rng(0)
    sides = rng.integers(128, 513, size=(n, 2))
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        os.makedirs(folder, exist_ok=True)
        samples = []
        for i, (w, h) in enumerate(sides.tolist()):
            img = rng.integers(0, 256, size=(h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
            img = cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)  # smooth: JPEG-like
            data = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
            with open(os.path.join(folder, f"{i:06d}.jpg"), "wb") as f:
                f.write(data)
            samples.append({"__key__": f"{i:06d}", "jpg": data, "cls": i})
        feedpipe.write_samples(samples, shards, max_samples=500)
    return {"folder": folder, "shards": shards, "images": n}


# -- the alternative a user would write -------------------------------------------------------
class Images:
    """A map-style dataset of the images in a folder: index -> (the image cropped to its
    bucket's resolution, the index)."""

    def __init__(self, files: list[str], target: list[tuple[int, int]]) -> None:
        self.files, self.target = files, target

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        bw, bh = self.target[i]
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = max(bw / w, bh / h)
            rw, rh = max(bw, round(w * s)), max(bh, round(h * s))
            im = im.resize((rw, rh), Image.BILINEAR)
            left, top = (rw - bw) // 2, (rh - bh) // 2
            im = im.crop((left, top, left + bw, top + bh))
            a = np.ascontiguousarray(np.asarray(im).transpose(2, 0, 1))
        return torch.from_numpy(a), i


class Sampler:
    """Batches of one bucket each: every bucket's indices shuffled with ``seed + epoch``, cut
    into batches (each remainder dropped), the batches shuffled together."""

    def __init__(self, bucket_of: np.ndarray, batch: int, seed: int = 0) -> None:
        self.bucket_of, self.batch, self.seed, self.epoch = bucket_of, batch, seed, 0
        self.remainders = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + self.epoch)
        out, self.remainders = [], 0
        for b in np.unique(self.bucket_of):
            ids = rng.permutation(np.flatnonzero(self.bucket_of == b))
            whole = len(ids) // self.batch * self.batch
            self.remainders += len(ids) - whole
            out += [ids[k:k + self.batch].tolist() for k in range(0, whole, self.batch)]
        return [out[k] for k in rng.permutation(len(out))]

    def __iter__(self) -> Any:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def alternative(spec: dict[str, Any]) -> tuple[Any, Any, float]:
    from PIL import Image
    from torch.utils.data import DataLoader

    import feedpipe
    from feedpipe.plan._buckets import assign_buckets

    t0 = time.perf_counter()
    folder = spec["folder"]
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder))]
    sizes = []
    for f in files:
        with Image.open(f) as im:  # the header only
            sizes.append(im.size)
    buckets = feedpipe.generated_buckets(spec["area"], 32, 4.0)
    bucket_of = assign_buckets(np.array(sizes), buckets)
    sampler = Sampler(bucket_of, spec["batch"])
    ds = Images(files, [buckets[k] for k in bucket_of.tolist()])
    kw: dict[str, Any] = {"persistent_workers": True} if spec["workers"] else {}
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=spec["workers"], **kw)
    return loader, sampler, time.perf_counter() - t0


def ours(spec: dict[str, Any]) -> tuple[Any, Any, float]:
    import feedpipe

    _ = feedpipe.Bucketed, feedpipe.FeedDataset, feedpipe.FeedLoader  # imported before the clock
    t0 = time.perf_counter()
    src = feedpipe.Bucketed(feedpipe.FeedDataset(spec["shards"], seed=0), spec["batch"],
                            area=spec["area"], step=32, max_ratio=4.0)
    kw: dict[str, Any] = {"persistent_workers": True} if spec["workers"] else {}
    loader = feedpipe.FeedLoader(src, batch_size=spec["batch"], num_workers=spec["workers"],
                                 **kw)
    return loader, src, time.perf_counter() - t0


def energon_dir(shards: str) -> str:
    """A copy of the shards prepared for Energon (its ``.nv-meta`` beside the tars), made once."""
    import shutil
    import subprocess

    out = shards + "-energon"
    if not os.path.exists(os.path.join(out, ".nv-meta", "dataset.yaml")):
        os.makedirs(out, exist_ok=True)
        for f in sorted(os.listdir(shards)):
            if f.endswith(".tar"):
                shutil.copy(os.path.join(shards, f), out)
        energon = os.path.join(os.path.dirname(sys.executable), "energon")
        subprocess.run([energon, "prepare", out, "--non-interactive", "--split-ratio", "1,0,0",
                        "--sample-type", "ImageClassificationSample", "--field-map",
                        '{"image": "jpg", "label": "cls"}', "--no-progress",
                        "--force-overwrite"], check=True, capture_output=True, timeout=600)
    return out


class EnergonLoader:
    """Energon's grouping over the prepared shards: ``set_epoch`` then iterate, batches of
    ``(images, ids)``."""

    def __init__(self, spec: dict[str, Any], rank: int = 0, world: int = 1) -> None:
        self.spec, self.rank, self.world, self.epoch = spec, rank, world, 0
        self.path = energon_dir(spec["shards"])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        from megatron.energon import WorkerConfig, get_loader, get_train_dataset

        wc = WorkerConfig(rank=self.rank, world_size=self.world,
                          num_workers=self.spec["workers"], seed_offset=self.epoch)
        ds = get_train_dataset(self.path, worker_config=wc, batch_size=None,
                               shuffle_buffer_size=100, max_samples_per_sequence=100,
                               task_encoder=_grouping(self.spec), repeat=False)
        return iter(get_loader(ds))


def _grouping(spec: dict[str, Any]) -> Any:
    """Energon's task encoder: each image to its bucket, cropped to the bucket's resolution,
    grouped by bucket in batches of ``spec["batch"]``."""
    import torch
    from megatron.energon import DefaultTaskEncoder

    import feedpipe
    from feedpipe.plan._buckets import assign_buckets

    buckets = feedpipe.generated_buckets(spec["area"], 32, 4.0)
    batch = spec["batch"]

    class Grouping(DefaultTaskEncoder):  # type: ignore[misc]
        def encode_sample(self, s: Any) -> Any:
            img = s.image  # [3, H, W] float in [0, 1], Energon's decoder
            h, w = int(img.shape[1]), int(img.shape[2])
            k = int(assign_buckets(np.array([[w, h]]), buckets)[0])
            bw, bh = (int(x) for x in buckets[k])
            sc = max(bw / w, bh / h)
            rw, rh = max(bw, round(w * sc)), max(bh, round(h * sc))
            x = torch.nn.functional.interpolate(img[None], size=(rh, rw), mode="bilinear")[0]
            top, left = (rh - bh) // 2, (rw - bw) // 2
            return {"image": x[:, top:top + bh, left:left + bw], "id": int(s.__key__),
                    "bucket": k}

        def batch_group_criterion(self, s: Any) -> Any:
            return s["bucket"], batch

        def batch(self, samples: list[Any]) -> Any:
            return (torch.stack([s["image"] for s in samples]),
                    torch.tensor([s["id"] for s in samples]))

        def encode_batch(self, b: Any) -> Any:
            return b

    return Grouping()


def ranks_check(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch read by 2 ranks one after the other: each rank's batches, and whether the
    ranks together delivered each image once (plus what the plan left out, for feedpipe)."""
    import feedpipe

    counts, ids, left = [], [], 0
    for r in (0, 1):
        if spec["system"] == "energon":
            loader: Any = EnergonLoader(spec, r, 2)
        else:
            src = feedpipe.Bucketed(feedpipe.FeedDataset(spec["shards"], seed=0, rank=r,
                                                         world_size=2), spec["batch"],
                                    area=spec["area"], step=32, max_ratio=4.0)
            loader = feedpipe.FeedLoader(src, batch_size=spec["batch"])
        n = 0
        for b in loader:
            ids += b[1].tolist() if not isinstance(b, dict) else b["cls"].tolist()
            n += 1
        counts.append(n)
        if spec["system"] == "feedpipe":
            st = loader.stats()["sources"]
            left = st["remainders"] + st["unequal_ranks"]  # images, over all ranks
    return {"batches_per_rank": counts, "equal": len(set(counts)) == 1,
            "exactly_once": len(ids) == len(set(ids)) and len(ids) + left == spec["images"],
            "left_out_by_the_plan": left}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import feedpipe

    torch.set_num_threads(1)  # both systems: one thread a process on a shared 2-core machine
    from feedpipe.plan._buckets import assign_buckets

    if spec["system"] == "energon":
        t0 = time.perf_counter()
        loader = plan_of = EnergonLoader(spec)
        plan_s = time.perf_counter() - t0
    else:
        loader, plan_of, plan_s = (ours if spec["system"] == "feedpipe" else alternative)(spec)
    buckets = feedpipe.generated_buckets(spec["area"], 32, 4.0)
    sides = np.random.default_rng(0).integers(128, 513, size=(spec["images"], 2))
    truth = assign_buckets(sides, buckets)
    epochs = []
    for e in range(spec["epochs"]):
        loader.set_epoch(e) if hasattr(loader, "set_epoch") else plan_of.set_epoch(e)
        t0 = time.perf_counter()
        seen: list[int] = []
        mixed = 0
        for b in loader:
            if isinstance(b, dict):
                images, ids = b["image"], b["cls"].tolist()
            else:
                images, ids = b[0], b[1].tolist()
            ks = {int(truth[i]) for i in ids}
            w, h = buckets[int(truth[ids[0]])]
            mixed += len(ks) != 1 or tuple(images.shape[2:]) != (h, w)
            seen += ids
        wall = time.perf_counter() - t0
        if spec["system"] == "feedpipe":
            remainders = loader.stats()["sources"]["remainders"]
        elif spec["system"] == "energon":  # a group's remainder comes as a short batch
            remainders = 0
        else:
            remainders = plan_of.remainders
        epochs.append({"images": len(seen), "wall_s": wall, "images_per_s": len(seen) / wall,
                       "batches_of_two_buckets": mixed, "repeats": len(seen) - len(set(seen)),
                       "exactly_once": len(seen) == len(set(seen))
                       and len(seen) + remainders == spec["images"], "remainders": remainders,
                       "order": seen[:8]})
    out = {"plan_s": plan_s, "epochs": epochs}
    if spec["system"] != "sampler":
        out["ranks"] = ranks_check(spec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--area", type=int, default=256 * 256)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--root", default=default_root("buckets"))
    ap.add_argument("--name", default="bench_buckets")
    a = ap.parse_args()
    if a.worker:
        emit(worker(load_spec(a.worker)))
        return 0
    t_start = time.perf_counter()
    os.makedirs(a.root, exist_ok=True)
    corpus = make_corpus(a.root, a.images)
    doc: dict[str, Any] = {"benchmark": a.name, "environment": environment(a.root),
                           "args": {k: v for k, v in vars(a).items() if k != "worker"},
                           "corpus": corpus, "passes": [], "errors": []}
    systems = a.systems.split(",")
    configs = [f"{s}, {w} workers" for w in WORKERS for s in systems]
    failed = False
    for p in range(a.passes):
        run: dict[str, Any] = {"order": alternating(configs, p), "results": {}}
        for name in run["order"]:
            system, w = name.split(", ")[0], int(name.split(", ")[1].split()[0])
            res = run_worker(__file__, {**corpus, "system": system, "workers": w,
                                        "batch": a.batch, "area": a.area, "epochs": a.epochs})
            if "error" in res:
                failed = True
                doc["errors"].append({"pass": p, "config": name, **res})
                print(f"pass {p} {name}: FAILED {res['error']}\n{res.get('stderr_tail', '')}")
                continue
            ep = res["epochs"]
            res["steady_images_per_s"] = median(e["images_per_s"] for e in ep[1:])
            res["all_exactly_once"] = all(e["exactly_once"] and not e["batches_of_two_buckets"]
                                          for e in ep)
            run["results"][name] = res
            print(f"pass {p} {name}: steady {fmt(res['steady_images_per_s'])} images/s, first "
                  f"epoch {fmt(ep[0]['images_per_s'])}, plan {res['plan_s']:.2f} s, exactly "
                  f"once and one bucket a batch: {res['all_exactly_once']}")
        run["loadavg"] = list(os.getloadavg())
        run["ratio"] = {}
        for w in WORKERS:
            f, s = run["results"].get(f"feedpipe, {w} workers"), \
                run["results"].get(f"sampler, {w} workers")
            if f and s:
                run["ratio"][f"{w} workers"] = {
                    "steady": f["steady_images_per_s"] / s["steady_images_per_s"],
                    "first_epoch": f["epochs"][0]["images_per_s"]
                    / s["epochs"][0]["images_per_s"]}
            en = run["results"].get(f"energon, {w} workers")
            if f and en:
                run["ratio"].setdefault(f"{w} workers", {})["over_energon"] = (
                    f["steady_images_per_s"] / en["steady_images_per_s"])
        doc["passes"].append(run)
    rows, summary = [], {}
    for name in configs:
        got = [r["results"][name] for r in doc["passes"] if name in r["results"]]
        key = name.split(", ")[1]
        ratios = [r["ratio"][key] for r in doc["passes"] if "steady" in r["ratio"].get(key, {})]
        over_en = [r["ratio"][key]["over_energon"] for r in doc["passes"]
                   if "over_energon" in r["ratio"].get(key, {})]
        ranks = [g["ranks"] for g in got if "ranks" in g]
        s = summary[name] = {
            "ranks_batches": ranks[0]["batches_per_rank"] if ranks else None,
            "ranks_equal_and_exactly_once": all(x["equal"] and x["exactly_once"]
                                                for x in ranks) if ranks else None,
            "ranks_exactly_once": all(x["exactly_once"] for x in ranks) if ranks else None,
            "feedpipe_over_energon": median(over_en) if over_en and name.startswith(
                "feedpipe") else None,
            "steady_images_per_s": median(g["steady_images_per_s"] for g in got),
            "plan_s": median(g["plan_s"] for g in got),
            "exactly_once_every_epoch": all(g["all_exactly_once"] for g in got),
            "feedpipe_over_sampler": median(x["steady"] for x in ratios)
            if name.startswith("feedpipe") else None,
            "feedpipe_over_sampler_spread": spread(x["steady"] for x in ratios)
            if name.startswith("feedpipe") else None}
        rows.append([name, fmt(s["steady_images_per_s"]), f"{s['plan_s']:.2f}",
                     str(s["exactly_once_every_epoch"]),
                     "-" if not ranks else f"{s['ranks_batches']} {s['ranks_exactly_once']}",
                     fmt(s["feedpipe_over_sampler"], 2), fmt(s["feedpipe_over_energon"], 2)])
    doc["summary"] = summary
    loads = [r["loadavg"][0] for r in doc["passes"]]
    text = [table(rows, ["configuration", "steady images/s", "plan s", "exactly once",
                         "2 ranks: batches, exactly once", "feedpipe / sampler",
                         "feedpipe / energon"]),
            f"\n\nload average (1 min) after each pass: {', '.join(f'{x:.1f}' for x in loads)}"
            f"; {corpus['images']} JPEGs of 128-512 px sides, batch {a.batch}, buckets of "
            f"{a.area} px area\n"]
    print("".join(text))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{a.name}.md"), "w", encoding="utf-8") as f:
        f.write(f"# {a.name}\n\n{__doc__.split(chr(10) + chr(10))[0]}\n\n```\n{''.join(text)}"
                "```\n")
    return finish(a.name, doc, text, [], failed, t_start)


if __name__ == "__main__":
    sys.exit(main())
