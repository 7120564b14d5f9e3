"""The ledger check of a Packed over a Mixture (``feedpipe ledger``) recomputes the epoch's rows a
window of documents at a time, as the reader planned them: the check of a large epoch holds no
array the size of the epoch, and its rows, row count and named pieces are those of the whole
epoch's layout."""

from __future__ import annotations

import tracemalloc
from itertools import islice
from pathlib import Path

import numpy as np

import feedpipe
from feedpipe import check_ledger
from feedpipe.plan._packing import CutLayout, offsets_of
from feedpipe.stream._ledger_kinds import packed_epoch, positions, row_pieces

EPOCH = 2 * 10**6  # the whole epoch's order, lengths and prefix sums: 48 MB
BOUND = 12 * 10**6  # what the check may allocate (bytes)


def _mixture(root: Path, epoch_size: int) -> feedpipe.Mixture:
    rng = np.random.default_rng(5)
    for name in ("a", "b", "c"):
        if not (root / name).exists():
            feedpipe.write_samples(
                ({"__key__": f"{name}{j:03d}", "tokens.npy":
                  rng.integers(1, 1000, int(rng.integers(1, 40)), dtype=np.int32)}
                 for j in range(60)), str(root / name), max_samples=20)
    sources = {n: feedpipe.FeedDataset(str(root / n), shuffle=True) for n in "abc"}
    return feedpipe.Mixture(sources, [1, 2, 3], epoch_size=epoch_size, seed=5)


def test_the_check_of_a_large_packed_mixture_builds_no_epoch_sized_array(
        tmp_path: Path) -> None:
    """A Packed mixture's ledger of an epoch of 2 * 10^6 documents, two batches read: checking
    it allocates under 12 MB (the whole epoch's order, lengths and prefix sums: 48 MB), and
    the epoch it names has the whole epoch's row count."""
    small = feedpipe.FeedLoader(feedpipe.Packed(_mixture(tmp_path, 10), seq_len=64),
                                batch_size=4, ledger=tmp_path / "warm")
    next(iter(small))  # the check's imports and first calls are not traced
    check_ledger(tmp_path / "warm")
    # long rows: the checker's counts per row (per id) stay small
    packed = feedpipe.Packed(_mixture(tmp_path, EPOCH), seq_len=4096)
    ld = feedpipe.FeedLoader(packed, batch_size=4, ledger=tmp_path / "l")
    it = iter(ld)
    got = [b["input_ids"] for b in islice(it, 2)]
    it.close()
    tracemalloc.start()
    try:
        r = check_ledger(tmp_path / "l")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BOUND, peak
    e = r["epochs"][0]
    assert not e["finished"] and e["delivered"] == 4 * len(got) and r["missing"] == []
    assert e["expected"] == packed.num_rows(0) and e["repeats"]["count"] == 0


def test_a_windowed_check_names_the_pieces_of_the_whole_epochs_rows(tmp_path: Path) -> None:
    """Rows far apart at the epoch's start, middle and end (each from its own window): the
    pieces the check names are those of the whole epoch's layout, a repeated row twice."""
    mix = _mixture(tmp_path, 3 * 10**5)
    packed = feedpipe.Packed(mix, seq_len=64)
    info = packed.ledger_info()
    lengths = packed.lengths(0)
    order = mix.plan(0).sample_ids(np.arange(3 * 10**5))
    whole = CutLayout(offsets_of(lengths[order]), 64)
    assert positions(info, 0) == whole.num_rows
    assert not isinstance(packed_epoch(info, 0)[0], np.ndarray)  # planned by windows
    last = whole.num_rows - 1
    rows = np.array([0, 1, 1, last // 2, last - 1, last])
    want = []
    for r in rows.tolist():
        want += [[int(order[d]), s, k] for d, s, k in whole.row_pieces(r)]
    got = row_pieces(info, 0, rows)

    # the check joins a document's pieces in consecutive rows and lists a repeated row's pieces
    # each twice in a row: compare the tokens named, each as many times as named
    def tokens(pieces: list[list[int]]) -> list[tuple[int, int]]:
        return sorted((d, t) for d, s, k in pieces for t in range(s, s + k))

    assert tokens(got) == tokens(want) and len(tokens(got)) > 5 * 64
