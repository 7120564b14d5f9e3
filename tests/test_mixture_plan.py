"""The mixture plan's invariants, as properties over random sources, weights and epoch sizes:
exact counts per source per epoch, no repeat within a source before it was drawn whole (across
epochs), sources spread evenly through the epoch, and the epoch a pure function of (seed, epoch)
that any world shape deals whole."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedpipe.errors import PlanError
from feedpipe.plan._mixture import MixturePlan, _source_seed, epoch_counts
from feedpipe.plan._order import Plan, Split

shards = st.lists(st.integers(1, 9), min_size=1, max_size=4)  # one source's shard counts
sources = st.lists(shards, min_size=1, max_size=4)


@st.composite
def mixtures(draw: st.DrawFn) -> tuple[list[list[int]], list[float] | None, int | None]:
    srcs = draw(sources)
    if draw(st.booleans()):
        return srcs, None, None
    weights = draw(st.lists(st.floats(0.05, 10), min_size=len(srcs), max_size=len(srcs)))
    return srcs, weights, draw(st.integers(1, 150))


@settings(max_examples=60, deadline=None)
@given(mixtures())
def test_each_epoch_draws_exact_counts_by_the_largest_remainder(mix) -> None:  # type: ignore[no-untyped-def]
    srcs, weights, size = mix
    plan = MixturePlan(srcs, weights, size, seed=1)
    sizes = [sum(s) for s in srcs]
    counts = plan.counts.tolist()
    assert sum(counts) == plan.epoch_size == (size if size is not None else sum(sizes))
    if weights is None:
        assert counts == sizes  # every source once at its own size
    else:
        quota = np.asarray(weights) / sum(weights) * plan.epoch_size
        assert all(np.floor(q) <= c <= np.floor(q) + 1 for q, c in zip(quota, counts))
    for epoch in (0, 3):
        src, _ = plan.draws(epoch, np.arange(plan.epoch_size))
        assert Counter(src.tolist()) == {s: c for s, c in enumerate(counts) if c}


@settings(max_examples=60, deadline=None)
@given(mixtures(), st.integers(0, 2**31))
def test_no_sample_of_a_source_repeats_before_the_source_was_drawn_whole(mix, seed) -> None:  # type: ignore[no-untyped-def]
    srcs, weights, size = mix
    plan = MixturePlan(srcs, weights, size, seed=seed)
    drawn: dict[int, list[int]] = {s: [] for s in range(len(srcs))}
    for epoch in range(4):  # in the order the epochs deliver them
        src, ids = plan.draws(epoch, np.arange(plan.epoch_size))
        for s, i in zip(src.tolist(), ids.tolist()):
            drawn[s].append(i)
    for s, ids in drawn.items():
        n = sum(srcs[s])
        assert all(0 <= i < n for i in ids)
        for at in range(0, len(ids), n):  # each run of n draws: a whole permutation so far
            block = ids[at:at + n]
            assert len(set(block)) == len(block), (s, block)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 10), min_size=2, max_size=4), st.integers(100, 2000))
def test_every_run_of_100_holds_each_source_within_5_points(weights, size) -> None:  # type: ignore[no-untyped-def]
    plan = MixturePlan([[50]] * len(weights), weights, size, seed=2)
    src, _ = plan.draws(0, np.arange(size))
    share = plan.counts / size
    onehot = src[:, None] == np.arange(len(weights))[None, :]
    runs = np.cumsum(np.vstack([np.zeros((1, len(weights))), onehot]), axis=0)
    window = (runs[100:] - runs[:-100]) / 100  # each source's share of every run of 100
    assert np.abs(window - share[None, :]).max() <= 0.05


@settings(max_examples=40, deadline=None)
@given(mixtures(), st.integers(1, 4), st.integers(0, 5))
def test_any_world_deals_the_same_epoch_and_resumes_to_exactly_the_rest(mix, world, epoch) -> None:  # type: ignore[no-untyped-def]
    srcs, weights, size = mix
    plan = MixturePlan(srcs, weights, size, seed=9)
    again = MixturePlan(srcs, weights, size, seed=9)  # a new process: the same epoch
    n = plan.epoch_size
    whole = list(zip(*(a.tolist() for a in plan.draws(epoch, np.arange(n)))))
    assert whole == list(zip(*(a.tolist() for a in again.draws(epoch, np.arange(n)))))
    stop = n // 3  # a resume point: these positions were consumed on one world...
    dealt: Counter[tuple[int, int]] = Counter(whole[:stop])
    for rank in range(world):  # ...and the rest dealt on another
        split = Split(n, world, rank, start=stop, drop_last=False)
        pos = split.positions(0, split.length)
        dealt.update(zip(*(a.tolist() for a in plan.draws(epoch, pos))))
    extra = dealt - Counter(whole)
    assert Counter(whole) - dealt == Counter()  # nothing lost
    assert sum(extra.values()) == Split(n, world, 0, start=stop).padding  # padding, as documented


@settings(max_examples=60, deadline=None)
@given(mixtures(), st.integers(0, 2**31), st.lists(st.booleans(), min_size=4, max_size=4),
       st.integers(1, 40))
def test_draws_are_each_sources_own_plan_in_any_chunks(mix, seed, shuffle, chunk) -> None:  # type: ignore[no-untyped-def]
    """The module's definition, checked against each source's own Plan: the k-th draw ever of
    source s is position k % size_s of its Plan of "epoch" k // size_s, whatever chunks of the
    epoch a reader asks for (a source's permutation drawn whole and kept, or drawn per chunk)."""
    srcs, weights, size = mix
    flags = shuffle[:len(srcs)]
    plan = MixturePlan(srcs, weights, size, seed=seed, shuffle=flags)
    sizes = [sum(s) for s in srcs]
    for epoch in (0, 1, 5):
        pos = np.arange(plan.epoch_size)
        got = [plan.draws(epoch, pos[at:at + chunk]) for at in range(0, len(pos), chunk)]
        src = np.concatenate([g[0] for g in got])
        ids = np.concatenate([g[1] for g in got])
        source_at, draw_at = plan.interleave.run(0, plan.epoch_size)
        assert src.tolist() == source_at.tolist()
        for p in range(plan.epoch_size):
            s = int(src[p])
            k = epoch * int(plan.counts[s]) + int(draw_at[p])
            own = Plan(tuple(srcs[s]), _source_seed(seed, s), k // sizes[s], flags[s])
            assert ids[p] == own.sample_ids(np.array([k % sizes[s]]))[0], (epoch, p)


def test_a_source_too_large_to_keep_whole_draws_the_same_ids_per_chunk(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Past the size a source's whole permutation is kept for, each chunk draws its own ids:
    the same ones."""
    import feedpipe.plan._mixture as mixture

    srcs, weights = [[40, 25], [7, 9, 3], [100]], [2, 1, 3]
    kept = MixturePlan(srcs, weights, 500, seed=3)
    assert all(kept._tabled)
    monkeypatch.setattr(mixture, "_WHOLE_MAX", 64)
    chunked = MixturePlan(srcs, weights, 500, seed=3)
    assert chunked._tabled == [False, True, False]
    for epoch in (0, 2):
        for at in range(0, 500, 37):
            pos = np.arange(at, min(at + 37, 500))
            a, b = kept.draws(epoch, pos), chunked.draws(epoch, pos)
            assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_bad_sources_and_weights_are_refused_with_the_reason() -> None:
    with pytest.raises(PlanError, match="at least one sample"):
        epoch_counts([3, 0])
    with pytest.raises(PlanError, match="one non-negative number per source"):
        epoch_counts([3, 4], [1.0])
    with pytest.raises(PlanError, match="not all zero"):
        epoch_counts([3, 4], [0, 0], 10)
    with pytest.raises(PlanError, match="epoch_size must be at least 1"):
        epoch_counts([3, 4], [1, 1], 0)
