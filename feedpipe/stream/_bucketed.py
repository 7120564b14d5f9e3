"""``Bucketed``: the images of a dataset in batches of one aspect-ratio bucket each, every image
resized and cropped to its bucket's resolution; a :class:`~feedpipe.Source` like any other.

The plan is :mod:`feedpipe.plan._buckets`'s (each image to the bucket nearest its aspect ratio,
from the sizes ``feedpipe shard`` recorded beside the shards: nothing is decoded to plan); the
samples are the dataset's own, each given its bucket's resolution as ``__bucket__`` before the
transform (:class:`~feedpipe.BucketCrop` by default) makes it that size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._redact import logger
from ..errors import StateError
from ..format._image_sizes import load_sizes
from ..plan._buckets import (
    BucketPlan,
    BucketSplit,
    assign_buckets,
    bucket_plan,
    check_buckets,
    generated_buckets,
)
from ..transforms._bucket_crop import BucketCrop
from ._routes import Capabilities
from ._source import Source
from ._wrapping import OverDataset

log = logger("feedpipe.buckets")


class BucketFetch:
    """The fetch of a :class:`Bucketed`: the dataset's samples, each with its bucket's
    ``(width, height)`` as ``__bucket__``."""

    def __init__(self, inner: Callable[[np.ndarray], list[Any]], resolution: np.ndarray,
                 bucket_of: np.ndarray) -> None:
        self.inner, self.resolution, self.bucket_of = inner, resolution, bucket_of

    def __call__(self, ids: np.ndarray) -> list[Any]:
        out = self.inner(ids)
        res = self.resolution[self.bucket_of[np.asarray(ids, dtype=np.int64)]].tolist()
        for (_, x, _), wh in zip(out, res):
            x["__bucket__"] = (wh[0], wh[1])
        return out


class Bucketed(OverDataset[Source], Source):
    """The images of ``dataset`` in batches of ``batch_size`` from one aspect-ratio bucket each.

    Each image goes to the bucket nearest its aspect ratio (in log ratio), from the sizes
    recorded beside the shards (``feedpipe shard`` records them;
    :func:`~feedpipe.record_image_sizes` once for older shards). Each epoch every bucket's
    images are shuffled and cut into batches, and the batches of all buckets are shuffled
    together: a pure function of the seed and the epoch. Over all ranks an epoch delivers each
    image at most once, every rank the same number of batches, and a saved state resumes on
    any number of ranks to exactly the rest of the epoch. What is left out of an epoch, counted in
    ``FeedLoader.stats()["sources"]``: each bucket's remainder (fewer than ``batch_size``
    images, drawn again each epoch), the last batches that would give some ranks one more
    than others, and images without a recorded size.

    Args:
        dataset: the :class:`~feedpipe.FeedDataset` of the images (no transform or decoded
            store of its own: the bucket's transform is this source's). Its seed is the plan's;
            its ``shuffle`` and ``drop_last`` do not apply.
        batch_size: images per batch; a :class:`~feedpipe.FeedLoader` over it takes the same.
        buckets: the resolutions, ``(width, height)`` pairs (:func:`~feedpipe.sdxl_buckets`,
            or any list); ``None``: :func:`~feedpipe.generated_buckets` of ``area``, ``step``
            and ``max_ratio``.
        transform: what each sample (with ``__bucket__``) goes through; ``None``:
            ``BucketCrop(crop, label_field=label_field)``.
        crop: ``"center"`` or ``"random"`` for the default transform.
        label_field: the default transform's label field (``None``: no label).

    Example:
        >>> import tempfile, cv2, numpy as np, feedpipe
        >>> out = tempfile.mkdtemp()
        >>> def jpg(w, h):
        ...     return cv2.imencode(".jpg", np.zeros((h, w, 3), np.uint8))[1].tobytes()
        >>> _ = feedpipe.write_samples([{"__key__": f"{i}", "jpg": jpg(40 + 20 * (i % 2), 40),
        ...                              "cls": i} for i in range(8)], out)
        >>> src = feedpipe.Bucketed(feedpipe.FeedDataset(out), batch_size=4,
        ...                         buckets=[(32, 32), (48, 32)])
        >>> [tuple(b["image"].shape) for b in feedpipe.FeedLoader(src, batch_size=4)]
        [(4, 3, 32, 48), (4, 3, 32, 32)]
    """

    prefetches = False  # the shard cache fetches on demand: the plan is of buckets, not shards

    def __init__(self, dataset: Source, batch_size: int, *,
                 buckets: Sequence[Sequence[int]] | None = None, area: int = 1024 * 1024,
                 step: int = 64, max_ratio: float = 4.0, transform: Any = None,
                 crop: str = "center", label_field: str | None = "cls") -> None:
        if getattr(dataset, "transform", None) is not None or dataset.decoded is not None:
            raise ValueError(f"Bucketed({dataset.url}): the dataset has a transform or decoded "
                             "store of its own, which would not see each image's bucket; give "
                             "the transform to Bucketed(transform=...) and leave the dataset's "
                             "out")
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise ValueError(f"batch_size must be an integer of 1 or more, not {batch_size!r}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.buckets = check_buckets(generated_buckets(area, step, max_ratio)
                                     if buckets is None else buckets)
        self.bucket_of = assign_buckets(load_sizes(dataset.url, dataset.manifest), self.buckets)
        self.transform = BucketCrop(crop, label_field=label_field) if transform is None \
            else transform
        self.decode = dataset.decode
        self.decoded = None
        self._plans: dict[int, BucketPlan] = {}
        digest = hashlib.blake2b(self.buckets.tobytes(), digest_size=8)
        digest.update(self.bucket_of.tobytes())
        self._entry = {"batch_size": self.batch_size, "assignment": digest.hexdigest()}
        unsized = int((self.bucket_of < 0).sum())
        if unsized:
            log.warning("%s: %d of %d samples have no recorded image size and are in no "
                        "bucket: they are never read", dataset.url, unsized, len(self.bucket_of))

    # -- what the dataset describes (its url, manifest, shards, world, seed, epoch: OverDataset)
    @property
    def max_open_shards(self) -> int:  # type: ignore[override]
        """The dataset's ``max_open_shards``."""
        return self.dataset.max_open_shards

    # -- the plan ----------------------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> BucketPlan:  # type: ignore[override]
        """``epoch``'s batches of one bucket each, in order (a pure function of the images'
        buckets, the batch size, the seed and ``epoch``)."""
        e = self.epoch if epoch is None else int(epoch)
        p = self._plans.get(e)
        if p is None:
            p = bucket_plan(self.bucket_of, len(self.buckets), self.batch_size, self.seed, e)
            self._plans = {e: p}  # the epoch being read; the next one replaces it
        return p

    def split_at(self, start: int = 0, whole_batches: bool = False, *,
                 epoch: int | None = None) -> BucketSplit:
        """This rank's batches of ``epoch`` from position ``start`` on (every batch whole)."""
        w = self.world
        return BucketSplit(self.plan(epoch).num_samples, w.world_size, w.rank, int(start),
                           batch_size=self.batch_size)

    def sample_fetch(self, epoch: int, *, copy: bool) -> BucketFetch:
        """The dataset's samples of a batch of ids, each with its bucket as ``__bucket__``."""
        return BucketFetch(self.dataset.sample_fetch(epoch, copy=copy),
                           self.buckets, self.bucket_of)

    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        """Sample ``g`` as the transform sees it in ``epoch``, with its ``__bucket__``."""
        x = self.dataset.sample(g, epoch)
        w, h = self.buckets[self.bucket_of[int(g)]].tolist()
        x["__bucket__"] = (w, h)
        return x

    def capabilities(self, collate_fn: Any) -> Capabilities:
        """A transform to share among workers or threads; the dataset's shards."""
        return Capabilities(transform=True, into=False, local=self.shards.local,
                            shards_fit=len(self.shards) <= self.max_open_shards,
                            fetch="bucketed")

    # -- state and resume --------------------------------------------------------------------
    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The dataset's state at ``position`` of ``epoch``, with the buckets it was planned
        with (the batch size and a digest of the buckets and the images' assignment)."""
        state = self.dataset.state_at(epoch, 0)
        state["position"] = int(position)
        state["buckets"] = dict(self._entry)
        return state

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, position)`` of ``state``: a state of another dataset, seed, batch size,
        bucket list or image sizes, or not at a whole batch, is refused with a
        :class:`~feedpipe.StateError` (``strict=False``: logged, the saved epoch afresh)."""
        why = self._mismatch(state)
        if why is not None:
            if strict:
                raise StateError(f"cannot resume {self.url}: {why}; the batches would differ "
                                 "and images would repeat or be lost (load_state_dict(state, "
                                 "strict=False) starts the saved epoch afresh instead)")
            log.warning("feedpipe: %s: %s; starting epoch %s afresh", self.url, why,
                        state.get("epoch", 0))
            return int(state.get("epoch", 0)), 0
        return int(state["epoch"]), int(state["position"])

    def _mismatch(self, state: Any) -> str | None:
        if not isinstance(state, dict) or "position" not in state:
            return "not a feedpipe loader state (no 'position')"
        inner = self.dataset.resume_point({**state, "position": 0}, strict=False)
        if inner != (state.get("epoch"), 0):
            return "the state is of another dataset or seed"
        if state.get("buckets") != self._entry:
            return (f"the state was saved with buckets {state.get('buckets')!r}, this source "
                    f"has {self._entry!r} (another batch size, bucket list or image sizes)")
        pos, epoch = state["position"], int(state["epoch"])
        n = self.plan(epoch).num_samples
        if not isinstance(pos, int) or not 0 <= pos <= n or pos % self.batch_size:
            return f"the saved position {pos!r} is not a whole batch of epoch {epoch} ({n})"
        return None

    # -- what the loader reports -------------------------------------------------------------
    def delivered(self, epoch: int, split: Any, batches: int,
                  batch_size: int) -> dict[str, int]:
        """``stats()["sources"]``: the images of each bucket (``"WxH"``) in this rank's first
        ``batches`` batches, and what the epoch leaves out over all ranks: ``remainders`` (each
        bucket's), ``unequal_ranks`` (the batches that would unbalance the ranks) and
        ``unsized`` (images in no bucket)."""
        plan = self.plan(epoch)
        n = min(int(batches), split.batches(batch_size))
        pos = split.positions(0, n * batch_size)
        counts = np.bincount(plan.bucket_of_positions(pos), minlength=len(self.buckets))
        out = {f"{w}x{h}": int(c) for (w, h), c in zip(self.buckets.tolist(), counts) if c}
        out["remainders"] = int(plan.remainders.sum())
        out["unequal_ranks"] = int(split.dropped)
        out["unsized"] = plan.unbucketed
        return out
