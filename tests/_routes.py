"""The route contract's fixtures: one loader per route over the same shards, and the reference
route each is compared with. Imported by tests/test_routes.py and run in subprocesses
(``python _routes.py JSON``) for resumption in a new interpreter."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch

# case -> (family, what it needs); a case is a route's name, or ROUTE:fn for a second setup
# of it. "raw" routes deliver raw sample dicts (default collation); "img" routes deliver
# (images, labels) batches of a BatchCollator, labels being global ids; "fn" cases run the
# transform as a function with the default collation (the way DataLoader users write it); "tok"
# routes deliver rows of feedpipe.Packed over a token corpus made beside the shards
# (tokens_path), each token of it unique.
ROUTES = {
    "refs": ("raw", "inline"),
    "refs-workers": ("raw", "workers"),
    "samples": ("raw", "inline"),
    "samples-workers": ("raw", "workers"),
    "samples:fn": ("fn", "inline"),
    "samples-workers:fn": ("fn", "workers"),
    "rows": ("img", "inline"),
    "rows-threads": ("img", "threads"),
    "rows-workers": ("img", "workers"),
    "samples-threads": ("img", "threads"),
    "gather": ("img", "inline"),
    # a Mixture of two sources (MIXED) on the routes that serve one
    "refs:mix": ("raw", "inline"),
    "refs-workers:mix": ("raw", "workers"),
    "samples-workers:mix": ("raw", "workers"),
    "samples-workers:mixfn": ("fn", "workers"),
    "rows-workers:mix": ("img", "workers"),
    "rows-threads:mix": ("img", "threads"),
    "packed": ("tok", "inline"),
    "packed-workers": ("tok", "workers"),
    # a source written outside feedpipe (tests/_third_party.py) on the routes its capabilities
    # allow: raw samples by reference and in workers, images written into rows in workers and on
    # threads, a transform as a function in workers
    "refs:third": ("raw", "inline"),
    "samples-workers:third": ("raw", "workers"),
    "rows-workers:third": ("img", "workers"),
    "rows-threads:third": ("img", "threads"),
    "samples-workers:thirdfn": ("fn", "workers"),
    # feedpipe.Bucketed (aspect-ratio buckets) over the same shards: each batch one bucket,
    # cropped at random to its resolution, inline and in workers
    "samples:bkt": ("fn", "inline"),
    "samples-workers:bkt": ("fn", "workers"),
    # feedpipe.VideoClips over videos made beside the shards (videos_path): each sample a clip
    # decoded with PyAV, labelled with its clip id, inline and in workers
    "samples:vid": ("fn", "inline"),
    "samples-workers:vid": ("fn", "workers"),
}
BUCKETS = [(16, 8), (8, 8), (8, 16)]  # the bkt cases' buckets, (width, height): 2:1, 1:1, 1:2
# (the shared shards give them 7 batches of 4: an elastic resume after 4 leaves one a rank)
MIXED = ("a", "b")  # a mixture's sources: the same shards twice, told apart by __source__
APART = 1000  # a mixture's ids in tests: source number * APART + the id in the source
SIZE = 8
BATCH = 4
SEQ = 16  # the tok routes' seq_len
VIDEOS, CLIPS = 13, 2  # the vid cases' videos (2 clips each: 26 clips, 7 batches of 4)


def token_docs() -> list[Any]:
    """The tok routes' documents: document ``i``'s tokens are ``i * 1000 + j``."""
    import numpy as np

    rng = np.random.default_rng(7)
    return [np.arange(int(n), dtype=np.int32) + i * 1000
            for i, n in enumerate(rng.integers(0, 60, size=160))]


def tokens_path(path: str) -> str:
    """The token corpus of the tok routes beside the shards at ``path``, written once."""
    out = os.path.join(os.path.dirname(os.path.abspath(path)),
                       os.path.basename(os.path.abspath(path)) + "-tokens")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        from feedpipe.convert._shard_writer import write_samples

        tmp = f"{out}.tmp{os.getpid()}"
        write_samples([{"__key__": f"d{i:03d}", "tokens.npy": d}
                       for i, d in enumerate(token_docs())], tmp, max_samples=20)
        try:
            os.rename(tmp, out)
        except OSError:  # another process wrote it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def videos_path(path: str) -> str:
    """The vid cases' videos beside the shards at ``path``, sharded once: video ``i`` has
    ``10 + i`` frames, 3 videos a shard."""
    out = os.path.join(os.path.dirname(os.path.abspath(path)),
                       os.path.basename(os.path.abspath(path)) + "-videos")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        from _videos import make_video

        from feedpipe.convert._shard_writer import write_samples

        tmp = f"{out}.tmp{os.getpid()}"
        write_samples([{"__key__": f"v{i:03d}", "mp4": make_video(10 + i, width=32, height=24)}
                       for i in range(VIDEOS)], tmp, max_samples=3)
        try:
            os.rename(tmp, out)
        except OSError:  # another process wrote it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def data_path(case: str, path: str) -> str:
    """Where the shards a case reads are."""
    if video(case):
        return videos_path(path)
    return tokens_path(path) if ROUTES[case][0] == "tok" else path


class IdImages:
    """:class:`~feedpipe.ImagePipeline`'s uint8 image of a sample with its global id as the
    label (so that image batches say which samples they hold), writing into batch rows as the
    pipeline does. ``mark``: a directory where each process that runs it leaves a file named by
    its pid."""

    def __init__(self, train: bool, mark: str | None = None, base: int = 0) -> None:
        from feedpipe.transforms._pipeline import ImagePipeline

        self.train = train
        self.pipe = ImagePipeline(SIZE, train=train, mean=None, label_field=None)
        self.out_shape = self.pipe.out_shape
        self.out_dtype = self.pipe.out_dtype
        self.mark = mark
        self.base = base  # added to the label (a mixture's sources numbered apart)

    def _mark(self) -> None:
        if self.mark is not None:
            open(os.path.join(self.mark, str(os.getpid())), "a").close()

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        self._mark()
        return self.pipe(sample), int(sample["__index__"]) + self.base

    def into(self, sample: dict[str, Any], out: torch.Tensor) -> int:
        self._mark()
        self.pipe.into(sample, out)
        return int(sample["__index__"]) + self.base


def route_of(case: str) -> str:
    """The route a case of :data:`ROUTES` runs."""
    return case.split(":")[0]


def mixed(case: str) -> bool:
    """Whether a case of :data:`ROUTES` reads a Mixture."""
    return case.split(":")[-1].startswith("mix")


def third(case: str) -> bool:
    """Whether a case of :data:`ROUTES` reads the third-party source (tests/_third_party.py)."""
    return case.split(":")[-1].startswith("third")


def bucketed(case: str) -> bool:
    """Whether a case of :data:`ROUTES` reads a :class:`feedpipe.Bucketed`."""
    return case.split(":")[-1] == "bkt"


def video(case: str) -> bool:
    """Whether a case of :data:`ROUTES` reads a :class:`feedpipe.VideoClips`."""
    return case.split(":")[-1] == "vid"


class ClipIds:
    """The vid cases' transform: the decoded clip's frames with its clip id (``video * CLIPS +
    clip``) as the label; ``mark`` as :class:`IdImages`'s."""

    def __init__(self, mark: str | None = None) -> None:
        self.mark = mark

    def __call__(self, clip: dict[str, Any]) -> tuple[torch.Tensor, int]:
        if self.mark is not None:
            open(os.path.join(self.mark, str(os.getpid())), "a").close()
        return clip["frames"], int(clip["video"]) * CLIPS + int(clip["clip"])


class BucketIds:
    """The bkt cases' transform: :class:`feedpipe.BucketCrop`'s random crop to the sample's
    bucket, with its global id as the label; ``mark`` as :class:`IdImages`'s."""

    def __init__(self, mark: str | None = None) -> None:
        from feedpipe import BucketCrop

        self.crop, self.mark = BucketCrop("random", label_field=None), mark

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        if self.mark is not None:
            open(os.path.join(self.mark, str(os.getpid())), "a").close()
        return self.crop(sample)["image"], int(sample["__index__"])


def dataset(case: str, path: str, **ds_kw: Any) -> Any:
    """The case's dataset: a FeedDataset, a Mixture of :data:`MIXED` sources over the same
    shards, each with its own transform (its labels numbered apart) and seed, or the third-party
    source over the same shards."""
    from feedpipe import FeedDataset, Mixture

    if third(case):
        from _third_party import TarFolder

        return TarFolder(path, **{k: ds_kw[k] for k in ("seed", "rank", "world_size",
                                                         "transform", "max_open_shards")
                                  if k in ds_kw})
    if video(case):
        from feedpipe import VideoClips

        t = ds_kw.pop("transform", None)
        return VideoClips(videos_path(path), frames=3, stride=2, clips_per_video=CLIPS,
                          size=(SIZE, SIZE), seed=ds_kw["seed"], rank=ds_kw["rank"],
                          world_size=ds_kw["world_size"], transform=ClipIds(getattr(t, "mark",
                                                                                     None)))
    if bucketed(case):
        from feedpipe import Bucketed

        t = ds_kw.pop("transform", None)
        return Bucketed(FeedDataset(path, **ds_kw), BATCH, buckets=BUCKETS,
                        transform=BucketIds(getattr(t, "mark", None)))
    if not mixed(case):
        return FeedDataset(path, **ds_kw)
    sources = {}
    for k, name in enumerate(MIXED):
        kw = dict(ds_kw, seed=ds_kw["seed"] + k)
        t = kw.get("transform")
        if t is not None:
            kw["transform"] = IdImages(t.train, t.mark, base=k * APART)
        sources[name] = FeedDataset(path, **kw)
    return Mixture(sources, seed=ds_kw["seed"])


def make(case: str, path: str, *, world: int = 1, rank: int = 0, workers: int = 0,
         store: str | None = None, mark: str | None = None, reference: bool = False,
         seed: int = 11, **extra: Any) -> Any:
    """The FeedLoader of ``case`` (or, with ``reference=True``, of the reference route for it:
    ``samples`` in this process, same dataset and collation)."""
    from feedpipe import FeedLoader
    from feedpipe.stream._collator import BatchCollator

    family, executor = ROUTES[case]
    route = route_of(case)
    ds_kw: dict[str, Any] = {"shuffle": True, "seed": seed, "rank": rank, "world_size": world}
    ld_kw: dict[str, Any] = {"batch_size": BATCH}
    if family == "tok":
        from feedpipe import FeedDataset, Packed

        ld_kw.update(extra)
        if workers and not reference:
            ld_kw["num_workers"] = workers
        return FeedLoader(Packed(FeedDataset(tokens_path(path), **ds_kw), SEQ),
                          route="packed" if reference else route, **ld_kw)
    if family == "fn":  # a random crop: the seeds must follow the samples too
        ds_kw["transform"] = IdImages(train=True, mark=mark)
    if family == "img":  # the gather route calls no transform: it marks no process
        ds_kw["transform"] = IdImages(train=route != "gather",
                                      mark=None if route == "gather" else mark)
        ld_kw["collate_fn"] = BatchCollator(BATCH, (3, SIZE, SIZE))
        if route == "gather":
            ds_kw["decoded_cache"] = store
    if route == "refs-workers":
        ds_kw["max_open_shards"] = 2  # more shards than fit: the workers plan
    if reference:
        ds_kw.pop("decoded_cache", None)
        return FeedLoader(dataset(case, path, **ds_kw), route="samples", **ld_kw)
    if executor == "threads":
        ld_kw["transform_threads"] = 2
    elif workers:
        ld_kw["num_workers"] = workers
    ld_kw.update(extra)
    return FeedLoader(dataset(case, path, **ds_kw), route=route, **ld_kw)


def fill_store(path: str, store: str) -> None:
    """Fill the decoded store the ``gather`` route reads (one epoch of its transform)."""
    from feedpipe import FeedDataset, FeedLoader
    from feedpipe.stream._collator import BatchCollator

    ds = FeedDataset(path, shuffle=True, seed=11, transform=IdImages(train=False),
                     decoded_cache=store)
    for _ in FeedLoader(ds, batch_size=BATCH, collate_fn=BatchCollator(BATCH, (3, SIZE, SIZE)),
                        route="samples"):
        pass
    if ds.decoded is None or not ds.decoded.complete():
        raise RuntimeError("the decoded store did not fill")


def ids_of(batch: Any) -> list[int]:
    """The global ids of a batch of any family (of tok batches: their tokens; a mixture's
    numbered apart by source)."""
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"][batch["labels"] != -100].tolist()
    if isinstance(batch, dict):
        if "__source__" in batch:
            return [MIXED.index(s) * APART + i
                    for s, i in zip(batch["__source__"], batch["__index__"].tolist())]
        return batch["__index__"].tolist()
    return batch[1].tolist()


def digest(batch: Any) -> str:
    """A digest of everything a batch holds (to compare batches across processes)."""
    h = hashlib.sha256()
    if isinstance(batch, dict):
        for k in sorted(batch):
            h.update(k.encode())
            h.update(repr(_plain(batch[k])).encode())
    else:
        for t in batch:
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(v)).hexdigest()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def resume(args: dict[str, Any]) -> dict[str, Any]:
    """In this (new) process: the case's loader of ``args``, loaded with ``args["state"]``,
    iterated to the end of the epoch; the batches' digests and ids."""
    ld = make(args["case"], args["path"], world=args.get("world", 1), rank=args.get("rank", 0),
              workers=args.get("workers", 0), store=args.get("store"))
    ld.load_state_dict(args["state"])
    batches = list(ld)
    return {"digests": [digest(b) for b in batches], "ids": [ids_of(b) for b in batches],
            "pids": ld.stats().get("worker_pids", []), "len": len(ld)}


if __name__ == "__main__":
    import _routes  # the classes under their module's name, as the tests pickle and hash them

    print(json.dumps(_routes.resume(json.loads(sys.argv[1]))))
