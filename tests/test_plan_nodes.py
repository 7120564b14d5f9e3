"""Properties of the node layout (``Plan(layout=(world_size, ranks_per_node))``): every sample once
across nodes, equal batches, each node reading its own piece of the shards (its share plus the
two boundary shards it shares with its neighbours), pieces changing with the epoch, exact and
elastic resume."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from feedpipe.plan._order import Plan, Split, all_ids, node_quotas

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "shards", "example")
counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=14).filter(lambda c: sum(c) > 0)
window_st = st.one_of(st.none(), st.integers(1, 4))


def layout_st() -> st.SearchStrategy[tuple[int, int]]:
    return st.integers(1, 4).flatmap(
        lambda rpn: st.tuples(st.integers(1, 3 * rpn + 2), st.just(rpn)))


def node_reads(plan: Plan, world: int, rpn: int, batch: int, workers: int,
               drop_last: bool) -> tuple[list[list[int]], dict[int, set[int]]]:
    """Each rank's ids in order and the shards each node's ranks read."""
    n = plan.num_samples
    per_rank, shards = [], {}
    for r in range(world):
        ids = all_ids(plan, Split(n, world, r, 0, drop_last, pad_own=True), batch, workers)
        per_rank.append(ids)
        s, _ = plan.shard_of(np.asarray(ids, dtype=np.int64))
        shards.setdefault(r // rpn, set()).update(s.tolist())
    return per_rank, shards


@given(counts=counts_st, seed=st.integers(0, 100), epoch=st.integers(0, 20), lay=layout_st(),
       workers=st.integers(1, 3), batch=st.integers(1, 7), drop_last=st.booleans(),
       window=window_st)
@settings(max_examples=200, deadline=None)
def test_each_node_reads_its_piece_and_every_sample_comes_once(
    counts, seed, epoch, lay, workers, batch, drop_last, window
) -> None:
    world, rpn = lay
    p = Plan(tuple(counts), seed, epoch, True, window, layout=lay)
    n = p.num_samples
    assert sorted(p.sample_ids(np.arange(n)).tolist()) == list(range(n))
    per_rank, shards = node_reads(p, world, rpn, batch, workers, drop_last)
    assert len({len(x) for x in per_rank}) == 1, "every rank must get the same number of samples"
    c = Counter(i for ids in per_rank for i in ids)
    split = Split(n, world, 0, 0, drop_last)
    if drop_last:  # at most world-1 left out, none twice
        assert set(c.values()) <= {1} and n - len(c) == split.dropped < world
    else:  # every sample, at most world-1 repeated
        assert set(c) == set(range(n)) and sum(c.values()) - n == split.padding < world
    quota = node_quotas(n, world, rpn)
    big = max(counts)
    pieces = [set(p.node_shards(k).tolist()) for k in range(p.nodes)]
    for k, read in shards.items():
        if n >= world:  # (a rank without a position of its own pads with another's)
            assert read <= pieces[k], "a node reads only the shards of its own piece"
        fetched = sum(counts[s] for s in pieces[k])
        # its share, plus the parts of the (at most two) boundary shards its neighbours own
        assert fetched < quota[k] + 2 * big
        inside = [s for s in pieces[k] if counts[s] > 0]
        assert len(inside) <= -(-int(quota[k]) // max(1, min(c for c in counts if c))) + 2
    # a shard is shared only where a piece ends: the store serves the dataset plus < one shard
    # per node
    shared = sum(len(x) for x in pieces) - len([c for c in counts if c])
    assert 0 <= shared <= p.nodes - 1
    total = sum(counts[s] for x in pieces for s in x)
    assert total <= n + (p.nodes - 1) * big


@given(shards=st.integers(4, 60), size=st.integers(1, 50), last=st.integers(1, 50),
       lay=layout_st(), seed=st.integers(0, 100), epoch=st.integers(0, 20))
@settings(max_examples=150, deadline=None)
def test_with_equal_shards_a_node_fetches_its_share_in_whole_shards_plus_one(
    shards, size, last, lay, seed, epoch
) -> None:
    """Shards of one size: a node fetches at most its share rounded up to whole shards, plus
    one shard; with the last shard shorter (as a writer leaves it), plus that one too."""
    for counts, extra in (((size,) * shards, 1), ((size,) * (shards - 1) + (min(last, size),), 2)):
        p = Plan(counts, seed, epoch, True, None, layout=lay)
        quota = node_quotas(p.num_samples, *lay)
        for k in range(p.nodes):
            assert len(p.node_shards(k)) <= -(-int(quota[k]) // size) + extra


@given(counts=counts_st, seed=st.integers(0, 100), epoch=st.integers(0, 20),
       window=window_st, workers=st.integers(1, 3), batch=st.integers(1, 7))
@settings(max_examples=100, deadline=None)
def test_one_node_is_the_global_order(counts, seed, epoch, window, workers, batch) -> None:
    for lay in ((1, 1), (3, 3), (2, 8)):
        a = Plan(tuple(counts), seed, epoch, True, window)
        b = Plan(tuple(counts), seed, epoch, True, window, layout=lay)
        n = a.num_samples
        assert b.nodes == 1
        assert a.sample_ids(np.arange(n)).tolist() == b.sample_ids(np.arange(n)).tolist()


def test_pieces_and_orders_change_with_the_epoch() -> None:
    counts = (50,) * 40
    plans = [Plan(counts, 7, e, True, None, layout=(8, 2)) for e in range(4)]
    for a, b in zip(plans, plans[1:], strict=False):
        assert any(set(a.node_shards(k).tolist()) != set(b.node_shards(k).tolist())
                   for k in range(4))
        n = a.num_samples
        assert a.sample_ids(np.arange(n)).tolist() != b.sample_ids(np.arange(n)).tolist()
    # another seed, another layout of the same epoch
    other = Plan(counts, 8, 0, True, None, layout=(8, 2))
    assert other.node_shards(0).tolist() != plans[0].node_shards(0).tolist()


@given(counts=counts_st, seed=st.integers(0, 100), lay=layout_st(), world2=st.integers(1, 6),
       batch=st.integers(1, 6), workers=st.integers(1, 3), workers2=st.integers(1, 3),
       stop=st.integers(0, 30), drop_last=st.booleans())
@settings(max_examples=150, deadline=None)
def test_resume_on_another_world_keeps_the_saved_layout_and_is_exact(
    counts, seed, lay, world2, batch, workers, workers2, stop, drop_last
) -> None:
    """Stop every rank after ``stop`` batches of a node-laid-out epoch, resume the rest on
    another world (the saved layout kept for that epoch): nothing twice, nothing lost."""
    world, rpn = lay
    p = Plan(tuple(counts), seed, 3, True, None, layout=lay)
    n = p.num_samples
    first = Split(n, world, 0, 0, drop_last, pad_own=True)
    stop = min(stop, first.batches(batch))
    before: list[int] = []
    for r in range(world):
        ids = all_ids(p, Split(n, world, r, 0, drop_last, pad_own=True), batch, workers)
        before += ids[: stop * batch]
    at = first.consumed(stop, batch)
    after: list[int] = []
    for r in range(world2):
        after += all_ids(p, Split(n, world2, r, at, drop_last, pad_own=True), batch, workers2)
    seen = Counter(before + after)
    if drop_last:
        assert max(seen.values(), default=1) == 1
        assert n - len(seen) < world + world2
    else:
        assert set(seen) == set(range(n))
        assert sum(seen.values()) - n < world + world2
    # the rest of the epoch is exactly the positions not consumed: nothing of the first part is
    # delivered again
    prefix = set(p.sample_ids(np.arange(at)).tolist())
    rest = set(p.sample_ids(np.arange(at, n)).tolist())
    assert not prefix & rest and len(prefix | rest) == n
    assert set(after) <= rest and set(before) <= prefix


def test_padding_stays_on_the_node() -> None:
    """With pad_own a padded rank repeats its own sample, so the padding reads no shard of
    another node's piece (the first remaining positions belong to node 0)."""
    counts = (10,) * 9 + (3,)  # 93 samples over 4 ranks: 3 ranks padded by one
    p = Plan(counts, 1, 0, True, None, layout=(4, 1))
    for r in range(4):
        ids = all_ids(p, Split(93, 4, r, pad_own=True), 5, 1)
        s, _ = p.shard_of(np.asarray(ids))
        assert set(s.tolist()) <= set(p.node_shards(r).tolist())


def test_1024_nodes_each_read_their_share_and_the_store_serves_the_dataset_once() -> None:
    """The bound on paper (docs/performance.md), computed: 1,024 nodes of 8 ranks over 20,000
    shards of unequal sizes."""
    rng = np.random.default_rng(0)
    counts = tuple(int(c) for c in rng.integers(50, 151, 20_000))
    world, rpn = 8192, 8
    p = Plan(counts, 11, 4, True, None, layout=(world, rpn))
    n = p.num_samples
    assert p.nodes == 1024
    assert np.array_equal(np.sort(p.sample_ids(np.arange(n))), np.arange(n))
    quota = node_quotas(n, world, rpn)
    c = np.asarray(counts)
    pieces = [p.node_shards(k) for k in range(p.nodes)]
    fetched = np.array([c[x].sum() for x in pieces])
    assert (fetched < quota + 2 * c.max()).all()
    assert sum(len(x) for x in pieces) <= len(counts) + 1023
    assert fetched.sum() <= n + 1023 * c.max()
    # a node's ranks read only its piece (ranks 8k..8k+7 of node k; a sample of nodes checked)
    for k in (0, 511, 1023):
        for r in range(k * rpn, (k + 1) * rpn):
            sp = Split(n, world, r, pad_own=True)
            s, _ = p.shard_of(p.sample_ids(sp.positions(0, sp.length)))
            assert set(s.tolist()) <= set(pieces[k].tolist())


def test_the_ledger_proves_a_node_layout_run_stopped_on_4_nodes_and_resumed_on_3(
        tmp_path: Path) -> None:
    """check_ledger rebuilds each part's plan with the layout the part recorded: 4 nodes stop
    after 2 batches, 3 ranks read the rest with the saved layout, then epoch 1 is cut for 3."""
    from feedpipe import FeedDataset, FeedLoader, check_ledger

    def loaders(world: int) -> list[FeedLoader]:
        return [FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=3, rank=r, world_size=world,
                                       node_local=True), batch_size=2, ledger=tmp_path)
                for r in range(world)]

    a = loaders(4)
    its = [iter(x) for x in a]
    seen = [i for _ in range(2) for it in its for i in next(it)["__index__"].tolist()]
    state = a[0].state_dict()
    assert state["layout"] == [4, 1]
    del its
    b = loaders(3)
    for x in b:
        x.load_state_dict(state)
    seen += [i for x in b for batch in x for i in batch["__index__"].tolist()]
    assert sorted(set(seen)) == list(range(24)) and len(seen) == 25  # 8 over 3 ranks: 1 padded
    for x in b:  # the next epoch, laid out for 3 nodes
        x.set_epoch(1)
        assert sum(len(batch["__index__"]) for batch in x) == 8
    r = check_ledger(tmp_path)
    assert r["ok"], r
    e0, e1 = r["epochs"]
    assert e0["finished"] and e0["exactly_once"] and e0["repeats"]["count"] == 0
    assert e0["padding"] == 1 and e0["losses"]["count"] == 0
    assert e1["finished"] and e1["exactly_once"]
