"""The rows of a Packed mixture planned a window at a time (feedpipe.plan._packing_chunks) are
today's rows of the whole epoch (CutLayout over the epoch's order): the same row count, the same
pieces of every group of rows, the same documents, for random sources, weights, epochs, window
and search sizes, and for the rows a reader resumed at any row on any number of ranks reads.
And a Packed over a mixture of an epoch of 10^9 documents makes its first batch without an
array the size of the epoch."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe.plan import _packing_chunks as chunks
from feedpipe.plan._mixture import MixturePlan
from feedpipe.plan._packing import CutLayout, offsets_of, rows_split
from feedpipe.plan._packing_chunks import ChunkedCut, MixtureTokens


@contextmanager
def sizes(block: int, span: int, cycle_cum: int, ahead: int) -> Iterator[None]:
    """The window's block and read-ahead, the search's span and the cycle sums' limit set
    small (as tests of the chunking: windows, searches and cycles cut at every place)."""
    old = chunks.BLOCK, chunks.SPAN, chunks.CYCLE_CUM, chunks.AHEAD
    chunks.BLOCK, chunks.SPAN, chunks.CYCLE_CUM, chunks.AHEAD = block, span, cycle_cum, ahead
    try:
        yield
    finally:
        chunks.BLOCK, chunks.SPAN, chunks.CYCLE_CUM, chunks.AHEAD = old


@st.composite
def mixtures(draw: Any) -> tuple[MixturePlan, np.ndarray, np.ndarray, int, int]:
    n = draw(st.integers(1, 5))
    shards = [draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)) for _ in range(n)]
    weights = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n).filter(any))
    epoch_size = draw(st.integers(1, 200))
    shuffle = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    plan = MixturePlan(shards, weights, epoch_size, seed=draw(st.integers(0, 9)), shuffle=shuffle)
    total = int(plan.sizes.sum())
    lengths = np.array(draw(st.lists(st.integers(0, 30), min_size=total, max_size=total)),
                       dtype=np.int64)
    bases = np.zeros(n, dtype=np.int64)
    np.cumsum(plan.sizes[:-1], out=bases[1:])
    return plan, lengths, bases, draw(st.integers(0, 4)), draw(st.integers(1, 40))


def whole(plan: MixturePlan, lengths: np.ndarray, bases: np.ndarray,
          epoch: int, L: int) -> tuple[np.ndarray, CutLayout]:
    """Today's plan: the epoch's order and the CutLayout of all of it."""
    src, ids = plan.draws(epoch, np.arange(plan.epoch_size))
    order = bases[src] + ids
    return order, CutLayout(offsets_of(lengths[order]), L)


def same_pieces(lay: ChunkedCut, ref: CutLayout, order: np.ndarray, rows: np.ndarray) -> None:
    doc, into, k = lay.spans(rows)
    rd, ri, rk = ref.spans(rows)
    assert (doc.tolist(), into.tolist(), k.tolist()) == (rd.tolist(), ri.tolist(), rk.tolist())
    assert lay.order[doc].tolist() == order[rd].tolist()
    p, q = lay.pieces(rows), ref.pieces(rows)
    for a, b in zip((p.row, p.doc, p.start, p.length), (q.row, q.doc, q.start, q.length)):
        assert a.tolist() == b.tolist()


knobs = st.tuples(st.integers(1, 40), st.integers(1, 40), st.sampled_from([0, 3, 1 << 16]),
                  st.integers(1, 60))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixtures(), knobs, st.data())
def test_windows_make_the_whole_epochs_rows(m: Any, knob: Any, data: st.DataObject) -> None:
    """Row count, tokens before any position, and the pieces of random ascending groups of
    rows (padding rows past the epoch's among them) equal the whole epoch's plan."""
    plan, lengths, bases, epoch, L = m
    order, ref = whole(plan, lengths, bases, epoch, L)
    with sizes(*knob):
        tokens = MixtureTokens(plan, epoch, lengths, bases)
        assert tokens.total == ref.tokens
        for p in data.draw(st.lists(st.integers(0, plan.epoch_size), max_size=6)):
            assert tokens.before(p) == int(ref.offsets[p])
        lay = ChunkedCut(tokens, L)
        assert (lay.num_rows, lay.fill) == (ref.num_rows, ref.fill)
        for _ in range(data.draw(st.integers(1, 4))):
            rows = np.array(sorted(set(data.draw(st.lists(
                st.integers(0, ref.num_rows + 2), min_size=1, max_size=8)))), dtype=np.int64)
            same_pieces(lay, ref, order, rows)
        if ref.tokens:  # the document holding any token
            t = data.draw(st.integers(0, ref.tokens - 1))
            assert lay.locate(t) == int(np.searchsorted(ref.offsets, t, side="right")) - 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixtures(), knobs, st.integers(1, 3), st.integers(1, 5), st.data())
def test_a_resumed_reader_on_any_world_reads_the_rest(m: Any, knob: Any, world: int,
                                                      batch: int, data: st.DataObject) -> None:
    """From a resume row, each rank of ``world`` reads its rows (rows_split) batch after batch,
    each batch planned by a fresh layout or the same one: the pieces are the whole plan's, and
    over the ranks every token from the resume row's first on is read once."""
    plan, lengths, bases, epoch, L = m
    order, ref = whole(plan, lengths, bases, epoch, L)
    start = data.draw(st.integers(0, ref.num_rows))
    fresh = data.draw(st.booleans())
    with sizes(*knob):
        read: list[int] = []
        for rank in range(world):
            lay = ChunkedCut(MixtureTokens(plan, epoch, lengths, bases), L)
            split = rows_split(lay.num_rows, start, world, rank)
            rows = split.positions(0, split.length)
            for b in range(0, len(rows), batch):
                if fresh:
                    lay = ChunkedCut(MixtureTokens(plan, epoch, lengths, bases), L)
                same_pieces(lay, ref, order, rows[b:b + batch])
                doc, into, k = lay.spans(rows[b:b + batch])
                for d, i, n in zip(doc.tolist(), into.tolist(), k.tolist()):
                    read += range(int(ref.offsets[d]) + i, int(ref.offsets[d]) + i + n)
    assert sorted(read) == list(range(min(start * L, ref.tokens), ref.tokens))


def test_a_packed_mixture_of_a_billion_documents_plans_its_first_batch_in_little_memory(
        tmp_path: Any) -> None:
    """Packed(Mixture(..., epoch_size=10**9)): the first batch's rows are the epoch's first
    tokens in plan order, its row count the whole epoch's (by formula), and the plan allocates
    under 64 MB (the order alone would be 8 GB)."""
    rng = np.random.default_rng(3)
    docs = {}
    for name in ("a", "b", "c"):
        docs[name] = [rng.integers(1, 1000, int(rng.integers(1, 40)), dtype=np.int32)
                      for _ in range(50)]
        feedpipe.write_samples(({"__key__": f"{name}{j:03d}", "tokens.npy": d}
                                for j, d in enumerate(docs[name])), str(tmp_path / name),
                               max_samples=20)
    sources = {n: feedpipe.FeedDataset(str(tmp_path / n), shuffle=True) for n in docs}
    # a first batch of a short epoch: the loader's imports are not traced
    next(iter(feedpipe.FeedLoader(feedpipe.Packed(feedpipe.Mixture(sources, epoch_size=10),
                                                  seq_len=64), batch_size=4)))
    mix = feedpipe.Mixture(sources, [1, 2, 3], epoch_size=10**9, seed=5)
    packed = feedpipe.Packed(mix, seq_len=64)
    tracemalloc.start()
    try:
        batch = next(iter(feedpipe.FeedLoader(packed, batch_size=4)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    ids = mix.plan(0).sample_ids(np.arange(200))
    first = np.concatenate([packed.document(int(g), 0) for g in ids])[:4 * 64]
    assert batch["input_ids"].reshape(-1).tolist() == first.tolist()
    lengths = packed.lengths(0)
    per_source = np.add.reduceat(lengths, mix.shards.bases[:3])
    # 10**9 draws of sources of 50 documents: whole cycles, and the partial one's prefix
    tokens = MixtureTokens(mix.mixture_plan, 0, lengths, mix.shards.bases).total
    cycles = mix.mixture_plan.counts // 50
    assert (cycles * per_source).sum() <= tokens <= ((cycles + 1) * per_source).sum()
    assert packed.num_rows(0) == -(-tokens // 64)


def test_a_packed_mixture_of_transformed_documents_takes_any_epoch_size(tmp_path: Any) -> None:
    """Documents made by each source's transform, an epoch shorter and one longer than the
    sources: every row holds the epoch's documents in plan order (the lengths are kept by
    sample number, not by the epoch's positions)."""
    for name in "ab":
        feedpipe.write_samples(({"__key__": f"{name}{j:03d}", "n": str(j + 1).encode()}
                                for j in range(10)), str(tmp_path / name), max_samples=5)

    def tokens(s: dict[str, Any]) -> dict[str, Any]:
        return {"tokens.npy": np.arange(int(s["n"])) + 100 * int(s["__key__"][0] == "b")}

    for epoch_size in (5, 50):
        mix = feedpipe.Mixture({n: feedpipe.FeedDataset(str(tmp_path / n), transform=tokens)
                                for n in "ab"}, epoch_size=epoch_size, seed=1)
        packed = feedpipe.Packed(mix, seq_len=8, pad_id=-1)
        got = np.concatenate([b["input_ids"].reshape(-1).numpy()
                              for b in feedpipe.FeedLoader(packed, batch_size=2)])
        ids = mix.plan(0).sample_ids(np.arange(epoch_size))
        want = np.concatenate([packed.document(int(g), 0) for g in ids])
        assert got[:len(want)].tolist() == want.tolist()
        assert (got[len(want):] == -1).all() and len(got) - len(want) < 2 * 8


def test_a_packed_mixture_saved_on_two_ranks_resumes_on_three_to_exactly_the_rest(
        tmp_path: Any) -> None:
    """An epoch drawing each source many times over (its cycles continue), read on two ranks
    for three steps, the state resumed on three: every row of the epoch is delivered once,
    each the epoch's concatenation in plan order cut at ``seq_len``, padding only past it."""
    rng = np.random.default_rng(7)
    for name, n in (("web", 30), ("code", 11)):
        feedpipe.write_samples(({"__key__": f"{name}{j:03d}", "tokens.npy":
                                 rng.integers(1, 1000, int(rng.integers(0, 50)), dtype=np.int32)}
                                for j in range(n)), str(tmp_path / name), max_samples=8)
    L, B = 32, 2

    def loader(rank: int, world: int) -> Any:
        mix = feedpipe.Mixture({n: feedpipe.FeedDataset(str(tmp_path / n), shuffle=True,
                                                        rank=rank, world_size=world)
                                for n in ("web", "code")}, [3, 1], epoch_size=700, seed=2)
        return feedpipe.FeedLoader(feedpipe.Packed(mix, seq_len=L, pad_id=-1), batch_size=B)

    got: dict[int, list[int]] = {}

    def take(ld: Any, rank: int, world: int, start: int, steps: int | None) -> None:
        for b, batch in enumerate(ld):
            for i, row in enumerate(batch["input_ids"].tolist()):
                r = start + rank + world * (b * B + i)
                assert r not in got
                got[r] = row
            if b + 1 == steps:
                break

    two = [loader(r, 2) for r in range(2)]
    for r, ld in enumerate(two):
        take(ld, r, 2, 0, 3)
    state = two[0].state_dict()
    assert state["position"] == 12
    for r in range(3):
        ld = loader(r, 3)
        ld.load_state_dict(state)
        take(ld, r, 3, 12, None)
    packed = loader(0, 1).dataset
    ids = packed.dataset.plan(0).sample_ids(np.arange(700))
    tokens = np.concatenate([packed.document(int(g), 0) for g in ids]).tolist()
    rows = packed.num_rows(0)
    assert rows == -(-len(tokens) // L) and sorted(got)[:rows] == list(range(rows))
    for r, row in got.items():
        want = tokens[r * L:(r + 1) * L]
        assert row == want + [-1] * (L - len(want))
