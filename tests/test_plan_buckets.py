"""The aspect-ratio bucket plan (feedpipe/plan/_buckets.py), as properties: each sample in at
most one batch of an epoch over all ranks, the ones left out exactly the stated remainders,
every batch of one bucket, every rank the same number of batches, the order a function of seed
and epoch, and a state saved mid-epoch resumed on another number of ranks to exactly the rest."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedpipe.errors import PlanError
from feedpipe.plan._buckets import (
    SDXL_BUCKETS,
    BucketSplit,
    assign_buckets,
    bucket_plan,
    generated_buckets,
)
from feedpipe.plan._order import worker_positions

buckets_of = st.lists(st.integers(-1, 4), min_size=0, max_size=120)


def rank_batches(plan, split: BucketSplit) -> list[np.ndarray]:
    """A rank's batches of ids, as the loader deals them (worker_positions)."""
    n = split.batches(split.batch_size)
    out = []
    for t in range(n):
        pos, lens = worker_positions(split, split.batch_size, np.array([t]))
        assert lens.tolist() == [split.batch_size]
        out.append(plan.sample_ids(pos))
    return out


def epoch_over_ranks(plan, world: int, start: int = 0) -> list[list[np.ndarray]]:
    return [rank_batches(plan, BucketSplit(plan.num_samples, world, r, start,
                                           batch_size=plan.batch_size)) for r in range(world)]


def test_sdxl_buckets_are_the_published_table() -> None:
    assert len(SDXL_BUCKETS) == 41
    assert (1024, 1024) in SDXL_BUCKETS and (832, 1216) in SDXL_BUCKETS
    assert SDXL_BUCKETS[0] == (512, 2048) and SDXL_BUCKETS[-1] == (2048, 512)
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in SDXL_BUCKETS)


@given(area=st.integers(64, 2048).map(lambda s: s * s), step=st.sampled_from([8, 32, 64]),
       ratio=st.floats(1.0, 6.0))
def test_generated_buckets_keep_area_step_and_ratio(area: int, step: int, ratio: float) -> None:
    try:
        b = generated_buckets(area, step, ratio)
    except PlanError as e:  # said, never an empty list
        assert "no width and height" in str(e)
        return
    assert b and len(set(b)) == len(b)
    for w, h in b:
        assert w % step == 0 and h % step == 0 and w * h <= area
        assert 1 / ratio - 1e-12 <= w / h <= ratio + 1e-12
        assert (w, h + step) not in b and w * (h + step) > area  # the largest height that fits


@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 5000)), min_size=1, max_size=50),
       st.sampled_from([SDXL_BUCKETS, generated_buckets(512 * 512, 32, 3.0)]))
def test_every_image_goes_to_the_bucket_nearest_its_ratio(sizes, buckets) -> None:
    got = assign_buckets(np.array(sizes), buckets)
    for (w, h), k in zip(sizes, got.tolist()):
        d = [abs(np.log(w / h) - np.log(bw / bh)) for bw, bh in buckets]
        assert d[k] == min(d) and k == d.index(min(d))


def test_an_unknown_size_is_in_no_bucket() -> None:
    assert assign_buckets(np.array([[-1, -1], [10, 10]]), [(1, 1)]).tolist() == [-1, 0]


@settings(max_examples=150, deadline=None)
@given(bucket_of=buckets_of, batch=st.integers(1, 7), world=st.integers(1, 4),
       seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_an_epoch_is_exactly_once_over_all_ranks_but_the_stated_remainders(
        bucket_of, batch, world, seed, epoch) -> None:
    b = np.array(bucket_of, dtype=np.int64)
    plan = bucket_plan(b, 5, batch, seed, epoch)
    ranks = epoch_over_ranks(plan, world)
    # every rank the same number of batches, each batch of one bucket
    assert len({len(r) for r in ranks}) == 1
    for r in ranks:
        for ids in r:
            assert len(ids) == batch and len(set(b[ids].tolist())) == 1 and b[ids[0]] >= 0
    got = np.concatenate([ids for r in ranks for ids in r]) if ranks[0] else np.zeros(0, int)
    assert len(set(got.tolist())) == len(got)  # never twice
    # the ones left out are exactly: the unbucketed, each bucket's remainder, and the units
    # that would make the ranks unequal
    split = BucketSplit(plan.num_samples, world, 0, batch_size=batch)
    left = len(b) - len(got)
    assert left == plan.unbucketed + int(plan.remainders.sum()) + split.dropped
    assert plan.unbucketed == int((b < 0).sum())
    counts = np.bincount(b[b >= 0], minlength=5)
    assert plan.remainders.tolist() == (counts % batch).tolist()
    assert split.dropped < world * batch


@settings(max_examples=100, deadline=None)
@given(bucket_of=buckets_of, batch=st.integers(1, 6), seed=st.integers(0, 5),
       epoch=st.integers(0, 5))
def test_the_plan_is_a_function_of_seed_and_epoch(bucket_of, batch, seed, epoch) -> None:
    b = np.array(bucket_of, dtype=np.int64)
    p, q = bucket_plan(b, 5, batch, seed, epoch), bucket_plan(b.copy(), 5, batch, seed, epoch)
    assert np.array_equal(p.units, q.units) and np.array_equal(p.unit_bucket, q.unit_bucket)


def test_epochs_and_seeds_differ_and_buckets_are_interleaved() -> None:
    b = np.repeat(np.arange(4), 64)
    p0, p1 = bucket_plan(b, 4, 8, 0, 0), bucket_plan(b, 4, 8, 0, 1)
    s1 = bucket_plan(b, 4, 8, 1, 0)
    assert not np.array_equal(p0.units, p1.units) and not np.array_equal(p0.units, s1.units)
    # (seed, epoch + 1) is not (seed + 1, epoch)
    assert not np.array_equal(bucket_plan(b, 4, 8, 0, 1).units, bucket_plan(b, 4, 8, 1, 0).units)
    # the buckets' batches are mixed, not one bucket after another
    runs = 1 + int((np.diff(p0.unit_bucket) != 0).sum())
    assert runs > 8
    assert sorted(np.bincount(p0.unit_bucket).tolist()) == [8, 8, 8, 8]


@settings(max_examples=150, deadline=None)
@given(bucket_of=st.lists(st.integers(0, 3), min_size=1, max_size=150), batch=st.integers(1, 5),
       w1=st.integers(1, 4), w2=st.integers(1, 4), frac=st.floats(0, 1), seed=st.integers(0, 3))
def test_a_state_resumed_on_another_number_of_ranks_reads_exactly_the_rest(
        bucket_of, batch, w1, w2, frac, seed) -> None:
    b = np.array(bucket_of, dtype=np.int64)
    plan = bucket_plan(b, 4, batch, seed, 2)
    first = BucketSplit(plan.num_samples, w1, 0, batch_size=batch)
    k = int(frac * first.batches(batch))  # steps every rank consumed before the save
    position = first.consumed(k, batch)
    before = [ids for r in epoch_over_ranks(plan, w1) for ids in r[:k]]
    after = [ids for r in epoch_over_ranks(plan, w2, position) for ids in r]
    seen = np.concatenate(before + after) if before + after else np.zeros(0, int)
    assert len(set(seen.tolist())) == len(seen)
    rest = BucketSplit(plan.num_samples, w2, 0, position, batch_size=batch)
    # exactly the epoch's whole units, less the units the new world leaves over
    assert len(seen) == plan.num_samples - rest.dropped
    whole = set(plan.units.reshape(-1).tolist())
    assert set(seen.tolist()) <= whole
    assert whole - set(seen.tolist()) == set(plan.sample_ids(
        np.arange(plan.num_samples - rest.dropped, plan.num_samples)).tolist())


def test_another_batch_size_is_refused_by_name() -> None:
    plan = bucket_plan(np.zeros(20, np.int64), 1, 4, 0, 0)
    split = BucketSplit(plan.num_samples, 1, 0, batch_size=4)
    with pytest.raises(PlanError, match="batch_size=4"):
        split.batches(5)
    with pytest.raises(PlanError, match="whole batch of 4"):
        BucketSplit(plan.num_samples, 1, 0, 6, batch_size=4)
