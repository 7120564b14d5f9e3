"""Aspect-ratio buckets: which bucket each image goes to, and an epoch of batches each drawn
from one bucket, as pure functions of (the images' sizes, the buckets, batch size, seed, epoch).

An epoch is a sequence of **units**, each ``batch_size`` sample ids of one bucket: every bucket's
samples shuffled and cut into whole units, the units of all buckets then shuffled together (so
the buckets' batches are interleaved in an order drawn from the plan). The sequence does not
depend on the number of ranks: rank ``r`` of ``w`` reads units ``r, r + w, r + 2w, ...`` of the
rest of the epoch (:class:`BucketSplit`), so a state saved after ``k`` steps (``k w`` units)
resumes on any number of ranks at unit ``k w``, exactly the rest.

The rules for what does not fill a batch, counted in :class:`BucketPlan` and
``FeedLoader.stats()["sources"]``:

* a bucket's remainder (fewer than ``batch_size`` samples once its whole units are cut) is
  **dropped** from the epoch; which samples those are is drawn again each epoch, so none is
  left out every epoch;
* the last units that would give some ranks one more batch than others (fewer than the world
  size) are dropped from the epoch too;
* a sample without a recorded size (``(-1, -1)``: no image, or a header not read) is in no
  bucket and never read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ._order import Split

# SDXL's multi-aspect training buckets, (width, height): Podell et al., "SDXL: Improving Latent
# Diffusion Models for High-Resolution Image Synthesis" (arXiv:2307.01952), appendix "Multi-aspect
# training", whose table lists these resolutions (about 1024^2 pixels each, sides multiples of 64,
# aspect ratios from 1/4 to 4). The landscape half; the portrait half is its transpose.
_SDXL_LANDSCAPE = ((2048, 512), (1984, 512), (1920, 512), (1856, 512), (1792, 576), (1728, 576),
                   (1664, 576), (1600, 640), (1536, 640), (1472, 704), (1408, 704), (1344, 704),
                   (1344, 768), (1280, 768), (1216, 832), (1152, 832), (1152, 896), (1088, 896),
                   (1088, 960), (1024, 960))
SDXL_BUCKETS: tuple[tuple[int, int], ...] = tuple(sorted(
    {*_SDXL_LANDSCAPE, (1024, 1024), *((h, w) for w, h in _SDXL_LANDSCAPE)},
    key=lambda s: s[0] / s[1]))
"""SDXL's 41 bucket resolutions, ``(width, height)``, from the tallest to the widest."""


def sdxl_buckets() -> tuple[tuple[int, int], ...]:
    """SDXL's bucket resolutions, ``(width, height)`` from the tallest to the widest: the 41 of
    its multi-aspect training (Podell et al., arXiv:2307.01952, appendix), about 1024^2 pixels
    each, sides multiples of 64, aspect ratios from 1/4 to 4.

    Example:
        >>> b = sdxl_buckets()
        >>> len(b), b[0], (1024, 1024) in b, b[-1]
        (41, (512, 2048), True, (2048, 512))
    """
    return SDXL_BUCKETS


def generated_buckets(area: int = 1024 * 1024, step: int = 64,
                      max_ratio: float = 4.0) -> tuple[tuple[int, int], ...]:
    """Buckets of about ``area`` pixels whose sides are multiples of ``step``: for each width
    ``k step``, the largest height (a multiple of ``step``) that keeps the area at most
    ``area``, where the aspect ratio lies within ``[1 / max_ratio, max_ratio]``; from the
    tallest to the widest.

    Example:
        >>> b = generated_buckets(1024 * 1024, 64, 4.0)
        >>> (1024, 1024) in b, b[0], b[-1]
        (True, (512, 2048), (2048, 512))
    """
    if area < step * step or step < 1 or max_ratio < 1:
        raise PlanError(f"generated_buckets(area={area}, step={step}, max_ratio={max_ratio}): "
                        "give an area of at least step^2, a step of 1 or more and a ratio of "
                        "1 or more")
    out = set()
    for w in range(step, area // step + 1, step):
        h = (area // w) // step * step
        if h >= step and 1 / max_ratio <= w / h <= max_ratio:
            out.add((w, h))
    # among buckets of one ratio keep the largest; a width whose height rounds to a taken one
    # with a smaller area is a worse fit of the same shape
    best: dict[float, tuple[int, int]] = {}
    for w, h in out:
        r = round(w / h, 9)
        if r not in best or w * h > best[r][0] * best[r][1]:
            best[r] = (w, h)
    if not best:
        raise PlanError(f"generated_buckets(area={area}, step={step}, max_ratio={max_ratio}): no "
                        "width and height of that step fit the area within the ratio; give a "
                        "larger max_ratio or a smaller step")
    return tuple(sorted(best.values(), key=lambda s: s[0] / s[1]))


def check_buckets(buckets: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """``buckets`` as an ``int64`` array of ``(width, height)`` rows, checked."""
    b = np.asarray(buckets, dtype=np.int64)
    if b.ndim != 2 or b.shape[1] != 2 or not len(b) or (b < 1).any():
        raise PlanError(f"buckets must be a non-empty list of (width, height) pairs of positive "
                        f"integers, not {buckets!r}")
    if len({(int(w), int(h)) for w, h in b}) != len(b):
        raise PlanError("buckets: a resolution is listed twice; give each bucket once")
    return b


def assign_buckets(sizes: np.ndarray,
                   buckets: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """Each image's bucket: the one nearest its aspect ratio in log ratio (of two equally near,
    the first listed); ``-1`` for a size of ``(-1, -1)`` (unknown).

    Example:
        >>> assign_buckets(np.array([[400, 300], [300, 400], [-1, -1]]),
        ...                [(1024, 1024), (1152, 896), (896, 1152)]).tolist()
        [1, 2, -1]
    """
    b = check_buckets(buckets)
    s = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    known = (s > 0).all(axis=1)
    out = np.full(len(s), -1, dtype=np.int32)
    if known.any():
        r = np.log(s[known, 0] / s[known, 1])
        rb = np.log(b[:, 0] / b[:, 1])
        out[known] = np.abs(r[:, None] - rb[None, :]).argmin(axis=1)
    return out


def _rng(seed: int, epoch: int) -> np.random.Generator:
    # one stream per (seed, epoch), hashed so that (seed, epoch + 1) and (seed + 1, epoch) differ
    h = hashlib.blake2b(f"buckets:{int(seed)}:{int(epoch)}".encode(), digest_size=16).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(h, "little")))


@dataclass(frozen=True)
class BucketPlan:
    """One epoch of bucketed batches (:func:`bucket_plan`).

    Attributes:
        epoch: the epoch.
        batch_size: samples per unit (one batch of one rank).
        units: ``(U, batch_size)`` sample ids, a unit a row, in the epoch's order.
        unit_bucket: each unit's bucket.
        remainders: each bucket's samples dropped as its remainder this epoch.
        unbucketed: samples in no bucket (no recorded size).
    """

    epoch: int
    batch_size: int
    units: np.ndarray
    unit_bucket: np.ndarray
    remainders: np.ndarray
    unbucketed: int

    @property
    def num_samples(self) -> int:
        """Positions of the epoch (whole units only)."""
        return int(self.units.size)

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """The id at each position (position ``p`` is sample ``p % batch_size`` of unit
        ``p // batch_size``)."""
        return self.units.reshape(-1)[np.asarray(positions, dtype=np.int64)]

    def bucket_of_positions(self, positions: np.ndarray) -> np.ndarray:
        """The bucket of each position."""
        return self.unit_bucket[np.asarray(positions, dtype=np.int64) // self.batch_size]


def bucket_plan(bucket_of: np.ndarray, num_buckets: int, batch_size: int, seed: int,
                epoch: int) -> BucketPlan:
    """The epoch ``epoch`` of samples whose buckets are ``bucket_of`` (``-1``: none): a pure
    function of its arguments (see the module docstring).

    Example:
        >>> p = bucket_plan(np.array([0, 0, 1, 1, 1, 0, 1]), 2, 2, seed=0, epoch=0)
        >>> p.units.shape, sorted(p.remainders.tolist()), p.unbucketed
        ((3, 2), [0, 1], 0)
    """
    if batch_size < 1:
        raise PlanError(f"batch_size must be 1 or more, not {batch_size}")
    bucket_of = np.asarray(bucket_of)
    rng = _rng(seed, epoch)
    order = np.argsort(bucket_of, kind="stable")  # ids grouped by bucket, ascending in each
    counts = np.bincount(bucket_of[bucket_of >= 0], minlength=num_buckets)
    unbucketed = int((bucket_of < 0).sum())
    starts = unbucketed + np.concatenate([[0], np.cumsum(counts)])
    units, owners = [], []
    remainders = counts % batch_size
    for b in range(num_buckets):
        ids = order[starts[b]:starts[b + 1]]
        ids = ids[rng.permutation(len(ids))]
        whole = len(ids) - int(remainders[b])
        units.append(ids[:whole].reshape(-1, batch_size))
        owners.append(np.full(whole // batch_size, b, dtype=np.int32))
    all_units = np.concatenate(units) if units else np.zeros((0, batch_size), np.int64)
    all_owners = np.concatenate(owners) if owners else np.zeros(0, np.int32)
    mix = rng.permutation(len(all_units))
    return BucketPlan(int(epoch), int(batch_size), all_units[mix].astype(np.int64),
                      all_owners[mix], remainders.astype(np.int64), unbucketed)


@dataclass(frozen=True)
class BucketSplit(Split):
    """One rank's share of a bucketed epoch from ``start`` on: its local batch ``t`` is unit
    ``start / batch_size + t w + r`` (``w`` ranks, rank ``r``), the units left over that would
    make the ranks unequal dropped. ``start`` is a whole number of units; the batch size of the
    loader reading it must be the plan's (another is refused: its batches would mix buckets).
    """

    batch_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start % self.batch_size:
            raise PlanError(f"a bucketed epoch resumes at a whole batch of {self.batch_size}; "
                            f"position {self.start} is not one (a state of another batch size?)")

    @property
    def length(self) -> int:
        return (self.remaining // self.batch_size) // self.world_size * self.batch_size

    @property
    def padding(self) -> int:
        return 0

    @property
    def dropped(self) -> int:
        return self.remaining - self.length * self.world_size

    def padded(self, local: np.ndarray) -> np.ndarray:
        # the loader's interleaved offset l w + r of rank r's local index l, as the offset of
        # that sample in the rank's unit: unit (l // B) w + r, sample l % B
        x = np.asarray(local, dtype=np.int64)
        w, size = self.world_size, self.batch_size
        ell, r = x // w, x % w
        return ((ell // size) * w + r) * size + ell % size

    def batches(self, batch_size: int) -> int:
        if batch_size != self.batch_size:
            raise PlanError(f"a bucketed source planned for batches of {self.batch_size} is read "
                            f"in batches of {batch_size}: its batches would mix buckets; give "
                            f"the loader batch_size={self.batch_size} (or the source "
                            f"batch_size={batch_size})")
        return self.length // batch_size
