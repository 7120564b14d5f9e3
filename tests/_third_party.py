"""A source written outside feedpipe, against its public names only (:class:`feedpipe.Source`,
:class:`feedpipe.Capabilities`, :class:`feedpipe.ShardSet`, :func:`feedpipe.load_manifest`,
:class:`feedpipe.World`): the samples of a folder of tar shards, in an order of its own.

It is what a user would write for a new kind of data, and it plugs into ``FeedLoader`` as it is:
the route contract (tests/test_routes.py, the ``:third`` cases) and
tests/test_third_party_source.py read it on every route its capabilities allow, with worker
processes, threads and mid-epoch resumption.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

import feedpipe

log = logging.getLogger("third_party")


class RotatedOrder:
    """The source's own plan: epoch ``e`` reads the ``n`` samples from ``(seed + 7 e) % n`` on,
    wrapping round (a pure function of seed and epoch, as a plan must be)."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n, self.epoch = n, int(epoch)
        self.shift = (seed + 7 * self.epoch) % n

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        return (np.asarray(positions, dtype=np.int64) + self.shift) % self.n


class ReadSamples:
    """Its fetch: each id's sample dict read from the shards, checked for a shard cut since it
    was opened (a :class:`feedpipe.ShardFormatError` naming it), ``copy``: fields as bytes."""

    def __init__(self, shards: feedpipe.ShardSet, epoch: int, seed: int, copy: bool) -> None:
        self.shards, self.epoch, self.seed, self.copy = shards, epoch, seed, copy

    def __call__(self, ids: np.ndarray) -> list[tuple[int, Any, bool]]:
        shards = self.shards
        s_of, i_of = shards.locate(ids)
        used = sorted(set(s_of.tolist()))
        with shards.hold(used):  # opening one closes none this batch reads
            readers = {s: shards.reader(s) for s in used}
        shards.check(used)
        out = []
        for g, s, i in zip(ids.tolist(), s_of.tolist(), i_of.tolist()):
            x = readers[s].sample(i)
            x["__epoch__"], x["__seed__"] = self.epoch, self.seed
            if self.copy:
                x = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in x.items()}
            out.append((g, x, False))
        return out


class TarFolder(feedpipe.Source):
    """The samples of a folder of tar shards with a manifest, each through ``transform``,
    ``rotated`` each epoch (:class:`RotatedOrder`) rather than shuffled."""

    def __init__(self, path: str, *, seed: int = 0, transform: Any = None,
                 rank: int | None = None, world_size: int | None = None,
                 max_open_shards: int = 64) -> None:
        self.url = path
        self.manifest = feedpipe.load_manifest(path)
        self.seed = int(seed)
        self.transform = transform
        self.decode: dict[str, Any] = {}
        self.decoded = None
        self.world = (feedpipe.World(rank, world_size) if rank is not None and world_size
                      else feedpipe.detect_world())
        self.max_open_shards = max_open_shards
        self.shards = feedpipe.ShardSet(path, self.manifest, max_open=max_open_shards)

    def plan(self, epoch: int | None = None) -> Any:
        return RotatedOrder(self.manifest.total_samples, self.seed, epoch or 0)

    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        return {"kind": "tar-folder", "epoch": int(epoch), "position": int(position),
                "seed": self.seed, "samples": self.manifest.total_samples}

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        mine = {"kind": "tar-folder", "seed": self.seed,
                "samples": self.manifest.total_samples}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            why = f"{self.url}: the state is of {theirs}, this folder is {mine}"
            if strict:
                raise feedpipe.StateError(why + " (strict=False starts the saved epoch afresh)")
            log.warning("%s: starting epoch %s afresh", why, state.get("epoch", 0))
            return int(state.get("epoch", 0)), 0
        return int(state["epoch"]), int(state["position"])

    def capabilities(self, collate_fn: Any) -> feedpipe.Capabilities:
        t = self.transform
        into = (isinstance(collate_fn, feedpipe.BatchCollator)
                and callable(getattr(t, "into", None))
                and tuple(getattr(t, "out_shape", ())) == collate_fn.shape
                and getattr(t, "out_dtype", None) == collate_fn.dtype)
        return feedpipe.Capabilities(
            transform=t is not None, into=into, local=self.shards.local,
            shards_fit=len(self.shards) <= self.max_open_shards, fetch="tar-folder")

    def sample_fetch(self, epoch: int, *, copy: bool) -> ReadSamples:
        return ReadSamples(self.shards, epoch, self.seed, copy)


def index_and_pid(sample: dict[str, Any]) -> dict[str, int]:
    """A transform that says which sample it made and in which process."""
    import os

    return {"id": int(sample["__index__"]), "pid": os.getpid()}
