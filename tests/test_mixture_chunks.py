"""A mixture's plan computed by formula and by chunks, never held whole: the interleave against
its definition, chunk boundaries invisible, any position reached directly (a resume equals the
tail), and the plan's memory bounded at an epoch of 10^8 samples."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe.plan._interleave as interleave
from feedpipe.plan._interleave import Interleave
from feedpipe.plan._mixture import MixturePlan
from feedpipe.plan._order import Split

counts = st.lists(st.integers(0, 40), min_size=1, max_size=7).filter(lambda c: sum(c) > 0)


def defined(c: list[int]) -> tuple[list[int], list[int]]:
    """The interleave by its definition: every draw ``(s, j)`` sorted by its cell
    ``floor(E (2j + 1) / (2 c_s))``, ties by source."""
    e = sum(c)
    draws = sorted(((e * (2 * j + 1)) // (2 * n), s, j) for s, n in enumerate(c) for j in range(n))
    return [s for _, s, _ in draws], [j for _, _, j in draws]


@pytest.mark.parametrize("python_ints", [False, True], ids=["int64", "python-int"])
@settings(max_examples=80, deadline=None)
@given(c=counts, block=st.integers(1, 50), data=st.data())
def test_the_interleave_is_its_definition_in_any_chunks_and_at_any_positions(
        python_ints, c, block, data) -> None:  # type: ignore[no-untyped-def]
    """Both ways the formulas are computed (int64 below epochs of 2**31, Python integers
    above), in runs of any block size."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interleave, "BLOCK", block)
        if python_ints:
            mp.setattr(interleave, "_SMALL", 1)
        iv = Interleave(np.array(c))
        assert iv.small is not python_ints
        check_interleave(iv, c, data)


def check_interleave(iv: Interleave, c: list[int], data: st.DataObject) -> None:
    e = iv.size
    src, j = defined(c)
    whole = iv.run(0, e)
    assert whole[0].tolist() == src and whole[1].tolist() == j
    cuts = sorted(data.draw(st.lists(st.integers(0, e), max_size=6)))
    pieces = [iv.run(a, b) for a, b in zip([0, *cuts], [*cuts, e])]
    assert np.concatenate([p[0] for p in pieces]).tolist() == src  # chunk boundaries invisible
    assert np.concatenate([p[1] for p in pieces]).tolist() == j
    for a in range(e + 1):  # the state at any position: the draws before it
        assert iv.before(a).tolist() == np.bincount(src[:a], minlength=len(c)).tolist()
    pos = np.array(data.draw(st.lists(st.integers(0, e - 1), max_size=40)), dtype=np.int64)
    got = iv.at(pos)
    assert got[0].tolist() == [src[p] for p in pos] and got[1].tolist() == [j[p] for p in pos]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=5),
       weights=st.lists(st.floats(0.05, 10), min_size=5, max_size=5),
       size=st.integers(1, 300), world=st.integers(1, 9), epoch=st.integers(0, 3),
       data=st.data())
def test_a_resume_at_any_position_on_any_world_is_exactly_the_tail(
        sizes, weights, size, world, epoch, data) -> None:  # type: ignore[no-untyped-def]
    """Every rank's positions from a resume point (strided, padded, read a few batches at a
    time) draw what the whole epoch holds at those positions, and the ranks together deliver
    the tail once (plus the documented padding)."""
    plan = MixturePlan([[n] for n in sizes], weights[:len(sizes)], size, seed=5)
    src, ids = plan.draws(epoch, np.arange(size))
    start = data.draw(st.integers(0, size))
    dealt: list[tuple[int, int]] = []
    for rank in range(world):
        split = Split(size, world, rank, start=start)
        for lo in range(0, split.length, 7):
            pos = split.positions(lo, min(lo + 7, split.length))
            s, i = plan.draws(epoch, pos)
            assert s.tolist() == src[pos].tolist() and i.tolist() == ids[pos].tolist()
            dealt.extend(zip(s.tolist(), i.tolist()))
    tail = list(zip(src[start:].tolist(), ids[start:].tolist()))
    assert sorted(set(dealt)) == sorted(set(tail))
    assert len(dealt) == len(tail) + Split(size, world, 0, start=start).padding


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=5),
       weights=st.lists(st.floats(0.05, 10), min_size=5, max_size=5),
       size=st.integers(1, 300), world=st.integers(1, 5), batch=st.integers(1, 9),
       batches=st.integers(0, 40), start=st.integers(0, 300))
def test_the_samples_delivered_per_source_are_counted_by_formula(
        sizes, weights, size, world, batch, batches, start) -> None:  # type: ignore[no-untyped-def]
    plan = MixturePlan([[n] for n in sizes], weights[:len(sizes)], size, seed=1)
    src, _ = plan.draws(0, np.arange(size))
    split = Split(size, world, world - 1, start=min(start, size))
    n = min(batches * batch, split.length)
    want = np.bincount(src[split.positions(0, n)], minlength=len(sizes))
    assert plan.source_counts(split, batch, batches).tolist() == want.tolist()


def test_a_plan_of_an_epoch_of_10_to_the_8_holds_no_epoch_sized_array() -> None:
    """100 sources of 10^6 samples (1,000 shards each), an epoch of 10^8: making the plan and
    drawing a chunk at the start and one far into the epoch (a resume point) allocates a few
    MB, where an array per position would be 800 MB."""
    sources = [[1000] * 1000 for _ in range(100)]
    weights = np.linspace(1, 3, 100).tolist()
    tracemalloc.start()
    try:
        plan = MixturePlan(sources, weights, 10**8, seed=3)
        first = plan.draws(0, np.arange(16384))
        later = plan.draws(0, np.arange(70_000_000, 70_016_384))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"planning held {peak / 2**20:.0f} MiB"
    assert plan.counts.sum() == 10**8
    # the chunks are the plan's: each draw's source and a sample of it
    for src, ids in (first, later):
        assert len(src) == 16384 and (ids < 10**6).all() and (ids >= 0).all()
    assert np.bincount(first[0], minlength=100).min() > 0  # every source in the first chunk


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(sum),
                      min_size=1, max_size=4),
       weights=st.lists(st.floats(0.05, 10), min_size=4, max_size=4), size=st.integers(1, 400),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 6), chunk=st.integers(1, 90))
def test_ids_drawn_per_chunk_for_every_source_at_once_are_each_sources_own_plan(
        sizes, weights, size, seed, epoch, chunk) -> None:  # type: ignore[no-untyped-def]
    """With no permutation kept whole, every source's ids of a chunk come from one pass of
    Feistel rounds over all their domains: the same ids as each source's own Plan."""
    import feedpipe.plan._mixture as mixture
    from feedpipe.plan._mixture import _source_seed
    from feedpipe.plan._order import Plan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mixture, "TABLE_BYTES", 0)
        plan = MixturePlan(sizes, weights[:len(sizes)], size, seed=seed)
        assert not any(plan._tabled)
        got = [plan.draws(epoch, np.arange(a, min(a + chunk, size)))
               for a in range(0, size, chunk)]
    src = np.concatenate([g[0] for g in got])
    ids = np.concatenate([g[1] for g in got])
    draw = plan.interleave.run(0, size)[1]
    for p in range(size):
        s = int(src[p])
        n, k = sum(sizes[s]), epoch * int(plan.counts[s]) + int(draw[p])
        own = Plan(tuple(sizes[s]), _source_seed(seed, s), k // n)
        assert ids[p] == own.sample_ids(np.array([k % n]))[0], (epoch, p)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2**40), st.integers(0, 2**31), st.integers(0, 9)),
                min_size=1, max_size=20), st.integers(0, 2**40))
def test_feistel_over_many_domains_is_each_domains_feistel(domains, x) -> None:  # type: ignore[no-untyped-def]
    from feedpipe.plan._mixture import feistel_many
    from feedpipe.plan._order import feistel, round_keys

    n = np.array([d[0] for d in domains], dtype=np.uint64)
    xs = np.array([x % d[0] for d in domains], dtype=np.uint64)
    keys = np.stack([round_keys(seed, epoch, 0) for _, seed, epoch in domains])
    want = [int(feistel(xs[i:i + 1], int(n[i]), keys[i])[0]) for i in range(len(domains))]
    assert feistel_many(xs, n, keys).tolist() == want


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=5),
       weights=st.lists(st.floats(0.05, 10), min_size=5, max_size=5),
       size=st.integers(1, 600), stride=st.integers(9, 40), start=st.integers(0, 40),
       epoch=st.integers(0, 4))
def test_positions_far_apart_draw_the_ids_of_the_whole_epoch(
        sizes, weights, size, stride, start, epoch) -> None:  # type: ignore[no-untyped-def]
    """A rank of a large world asks for positions far apart: a source whose permutation is
    kept whole for dense reading draws those per chunk instead (or from the table already
    kept), the same ids as the whole epoch's."""
    plan = MixturePlan([[n] for n in sizes], weights[:len(sizes)], size, seed=7)
    src, ids = MixturePlan([[n] for n in sizes], weights[:len(sizes)], size, seed=7).draws(
        epoch, np.arange(size))
    for lo in range(min(start, size - 1), size, 5 * stride):
        pos = np.arange(lo, min(size, lo + 5 * stride), stride)
        s, i = plan.draws(epoch, pos)
        assert s.tolist() == src[pos].tolist() and i.tolist() == ids[pos].tolist()
