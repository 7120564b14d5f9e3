"""Properties of the packed rows' plan (feedpipe.plan._packing): pure functions of the documents'
lengths in order, seq_len and the world, checked over random corpora with Hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe.convert._shard_writer import write_samples
from feedpipe.plan._order import Split
from feedpipe.plan._packing import (
    CONCATENATE,
    BestFit,
    ConcatenateAndCut,
    CutLayout,
    offsets_of,
    packing_named,
    row_pieces,
    rows_split,
)
from feedpipe.stream._packed import Packed

LENGTHS = st.lists(st.integers(0, 40), min_size=0, max_size=30)


def _tokens_of(layout, rows):
    """Every (document, token) the rows hold, with how many times."""
    p = layout.pieces(np.asarray(rows, dtype=np.int64))
    out: dict[tuple[int, int], int] = {}
    for d, s, k in zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()):
        for t in range(s, s + k):
            out[(d, t)] = out.get((d, t), 0) + 1
    return out


def _every_token(lengths):
    return {(d, t): 1 for d, n in enumerate(lengths) for t in range(n)}


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 17))
def test_every_token_is_in_exactly_one_row(lengths, seq_len):
    layout = CONCATENATE.layout(np.array(lengths, dtype=np.int64), seq_len)
    assert layout.num_rows == -(-sum(lengths) // seq_len)
    assert _tokens_of(layout, range(layout.num_rows)) == _every_token(lengths)
    p = layout.pieces(np.arange(layout.num_rows, dtype=np.int64))
    fill = np.bincount(p.row, weights=p.length, minlength=layout.num_rows)
    # every row is full but the last; a piece lies in one row and continues its document
    assert (fill[:-1] == seq_len).all() and (len(fill) == 0 or 0 < fill[-1] <= seq_len)
    assert (p.length > 0).all() and (np.diff(p.row) >= 0).all()


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 17), st.data())
def test_any_rows_give_the_pieces_of_each_row_alone(lengths, seq_len, data):
    """A group of rows (ascending, with gaps and padding rows past the tokens) has the pieces
    each of its rows has on its own: a reader's group of batches and the checker agree."""
    layout = CONCATENATE.layout(np.array(lengths, dtype=np.int64), seq_len)
    top = layout.num_rows + 3
    rows = sorted(data.draw(st.sets(st.integers(0, top), max_size=12)))
    p = layout.pieces(np.array(rows, dtype=np.int64))
    got = list(zip(p.row.tolist(), p.doc.tolist(), p.start.tolist(), p.length.tolist()))
    want = [(i, *piece) for i, r in enumerate(rows)
            for piece in row_pieces(offsets_of(np.array(lengths)), r, seq_len)]
    assert got == want
    assert all(not layout.row_pieces(r) for r in rows if r >= layout.num_rows)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 17), st.integers(1, 5), st.data())
def test_ranks_read_every_token_once_and_as_many_rows_each(lengths, seq_len, world, data):
    """From any start row (a resume), the ranks' shares hold exactly the rest of the epoch's
    tokens, each once, and every rank as many rows (padding rows past the tokens)."""
    layout = CONCATENATE.layout(np.array(lengths, dtype=np.int64), seq_len)
    start = data.draw(st.integers(0, layout.num_rows))
    splits = [rows_split(layout.num_rows, start, world, r) for r in range(world)]
    assert len({s.length for s in splits}) == 1
    rows = np.concatenate([s.positions(0, s.length) for s in splits])
    assert sorted(rows.tolist()) == list(range(start, start + splits[0].length * world))
    got = _tokens_of(layout, np.sort(rows))
    before = _tokens_of(layout, range(start))
    assert got == {t: 1 for t in _every_token(lengths) if t not in before}


@settings(max_examples=100, deadline=None)
@given(LENGTHS, st.integers(1, 9), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4),
       st.booleans())
def test_workers_of_each_rank_share_its_rows_once(lengths, seq_len, world, workers, batch,
                                                  whole):
    """A rank's worker processes deal its batches round-robin: their rows are the rank's,
    each once (FeedLoader(drop_last=True) leaves the short last batch out)."""
    layout = CONCATENATE.layout(np.array(lengths, dtype=np.int64), seq_len)
    for rank in range(world):
        split = rows_split(layout.num_rows, 0, world, rank, whole)
        got = []
        for w in range(workers):
            for t in split.worker_batches(batch, w, workers):
                got += split.positions(t * batch, min(t * batch + batch, split.length)).tolist()
        keep = split.batches(batch) * batch if whole else split.length
        assert sorted(got) == split.positions(0, min(keep, split.length)).tolist()


@given(LENGTHS, st.integers(1, 17))
def test_the_layout_is_a_function_of_its_inputs(lengths, seq_len):
    a = ConcatenateAndCut().layout(np.array(lengths, dtype=np.int64), seq_len)
    b = CONCATENATE.layout(np.array(list(lengths), dtype=np.int32), seq_len)
    rows = np.arange(a.num_rows + 1, dtype=np.int64)
    pa, pb = a.pieces(rows), b.pieces(rows)
    assert a.num_rows == b.num_rows
    assert all(np.array_equal(getattr(pa, f), getattr(pb, f))
               for f in ("row", "doc", "start", "length"))


def test_rows_split_is_a_split_of_whole_rank_rows():
    s = rows_split(7, 3, 3, 2, whole_batches=True)
    assert s == Split(9, 3, 2, 3, False, True)
    assert isinstance(CONCATENATE.layout(np.array([1]), 1), CutLayout)


def test_packed_refuses_what_is_no_packing_strategy(tmp_path):
    write_samples([{"__key__": "d0", "tokens.npy": np.arange(3)}], str(tmp_path / "tok"))
    ds = feedpipe.FeedDataset(str(tmp_path / "tok"))
    with pytest.raises(TypeError, match="packing strategy"):
        Packed(ds, 4, packing="best-fit")  # type: ignore[arg-type]
    assert Packed(ds, 4).packing is CONCATENATE  # the default: concatenate and cut


# -- best fit ----------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(LENGTHS, st.integers(1, 17))
def test_best_fit_holds_every_token_once_and_splits_no_document_that_fits(lengths, seq_len):
    layout = BestFit().layout(np.array(lengths, dtype=np.int64), seq_len)
    assert not layout.contiguous
    assert _tokens_of(layout, range(layout.num_rows)) == _every_token(lengths)
    p = layout.pieces(np.arange(layout.num_rows, dtype=np.int64))
    fill = np.bincount(p.row, weights=p.length, minlength=layout.num_rows)
    assert (fill <= seq_len).all() and (fill > 0).all()  # no row over seq_len, none empty
    for d, n in enumerate(lengths):
        mine = p.doc == d
        if 0 < n <= seq_len:  # a document no longer than a row: one piece, whole
            assert mine.sum() == 1 and p.length[mine].tolist() == [n]
        else:  # a longer one: whole rows of its own, its rest placed as a document
            by_start = p.length[mine][np.argsort(p.start[mine])]
            assert (by_start[:-1] == seq_len).all() and mine.sum() == -(-n // seq_len)
    # the fill rate said is the documents' share of the rows
    total = sum(lengths)
    assert layout.fill == pytest.approx(total / max(1, layout.num_rows * seq_len))
    assert layout.num_rows >= -(-total // seq_len)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 17), st.integers(1, 4), st.data())
def test_best_fit_rows_deal_to_ranks_and_resume_like_any_rows(lengths, seq_len, world, data):
    layout = BestFit().layout(np.array(lengths, dtype=np.int64), seq_len)
    start = data.draw(st.integers(0, layout.num_rows))
    splits = [rows_split(layout.num_rows, start, world, r) for r in range(world)]
    rows = np.sort(np.concatenate([s.positions(0, s.length) for s in splits]))
    before = _tokens_of(layout, range(start))
    assert _tokens_of(layout, rows) == {t: 1 for t in _every_token(lengths) if t not in before}
    # a group of rows has the pieces of its rows alone, and the layout is the same made again
    again = BestFit().layout(np.array(lengths, dtype=np.int64), seq_len)
    pick = np.array(sorted(data.draw(st.sets(st.integers(0, layout.num_rows + 2),
                                             max_size=8))), dtype=np.int64)
    got, want = layout.pieces(pick), again.pieces(pick)
    assert all(np.array_equal(getattr(got, f), getattr(want, f))
               for f in ("row", "doc", "start", "length"))
    alone = [layout.pieces(np.array([r])) for r in pick.tolist()]
    assert got.doc.tolist() == [d for a in alone for d in a.doc.tolist()]


def test_best_fit_fills_the_fullest_row_a_document_fits():
    layout = BestFit().layout(np.array([5, 4, 3, 1, 2]), 6)
    rows = [layout.pieces(np.array([r])).doc.tolist() for r in range(layout.num_rows)]
    assert rows == [[0, 3], [1, 4], [2]] and layout.fill == pytest.approx(15 / 18)
    assert packing_named("best-fit").name == "best-fit"
    assert packing_named("concatenate") is CONCATENATE
