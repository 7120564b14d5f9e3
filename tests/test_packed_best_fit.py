"""``Packed(..., packing=BestFit())``: documents kept whole in rows with padding left in them, read
through the same routes, states and ledger as the default packing. Every token of the corpus is
unique (document ``i``'s token ``j`` is ``i * 1000 + j``)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feedpipe import BestFit, FeedDataset, FeedLoader, Packed, check_ledger
from feedpipe.convert._shard_writer import write_samples
from feedpipe.errors import StateError

SEQ = 16
LENGTHS = [int(n) for n in np.random.default_rng(5).integers(1, 40, size=30)]
ALL = Counter(i * 1000 + j for i, n in enumerate(LENGTHS) for j in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("bestfit") / "tok")
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": np.arange(n) + i * 1000}
                   for i, n in enumerate(LENGTHS)], root, max_samples=7)
    return root


def packed(path: str, rank: int = 0, world: int = 1, **kw: Any) -> Packed:
    return Packed(FeedDataset(path, shuffle=True, seed=2, rank=rank, world_size=world, **kw),
                  SEQ, packing=BestFit())


def rows_of(batch: dict[str, Any]) -> list[list[tuple[int, int, int]]]:
    """Each row's (token, position, label) where the label is not padding."""
    out = []
    for ids, pos, lab in zip(batch["input_ids"].tolist(), batch["position_ids"].tolist(),
                             batch["labels"].tolist()):
        out.append([(t, p, lab_) for t, p, lab_ in zip(ids, pos, lab) if lab_ != -100])
    return out


def check_whole(rows: list[list[tuple[int, int, int]]]) -> None:
    """Every document no longer than a row lies whole in one row, its positions 0, 1, ..."""
    for row in rows:
        for d in {t // 1000 for t, _, _ in row}:
            if LENGTHS[d] <= SEQ:
                mine = [(t, p) for t, p, _ in row if t // 1000 == d]
                assert mine == [(d * 1000 + j, j) for j in range(LENGTHS[d])]


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (3, 0), (1, 2), (2, 2)])
def test_every_token_once_and_every_short_document_whole(corpus: str, world: int,
                                                        workers: int) -> None:
    route = "packed-workers" if workers else "auto"
    lds = [FeedLoader(packed(corpus, r, world), batch_size=3, num_workers=workers, route=route)
           for r in range(world)]
    assert len({len(ld) for ld in lds}) == 1
    got: Counter[int] = Counter()
    for ld in lds:
        for b in ld:
            rows = rows_of(b)
            check_whole(rows)
            got.update(t for row in rows for t, _, _ in row)
            assert (b["labels"][b["labels"] != -100] == b["input_ids"][b["labels"] != -100]).all()
            assert b["cu_seqlens"][-1] == b["input_ids"].numel()
        if workers:
            assert len(set(ld.stats()["worker_pids"])) == 2
            assert os.getpid() not in ld.stats()["worker_pids"]
    assert got == ALL


@pytest.mark.parametrize("stop", [1, 3, 6])
def test_a_resume_on_another_world_reads_exactly_the_rest(corpus: str, stop: int) -> None:
    ld = FeedLoader(packed(corpus), batch_size=2)
    it = iter(ld)
    got = Counter(t for _ in range(stop) for row in rows_of(next(it)) for t, _, _ in row)
    state = ld.state_dict()
    assert state["packed"]["packing"] == "best-fit"
    more = [FeedLoader(packed(corpus, r, 2), batch_size=2) for r in range(2)]
    for m in more:
        m.load_state_dict(state)
        got.update(t for b in m for row in rows_of(b) for t, _, _ in row)
    assert got == ALL


def test_a_state_of_another_packing_is_refused(corpus: str) -> None:
    plain = FeedLoader(Packed(FeedDataset(corpus, shuffle=True, seed=2), SEQ), batch_size=2)
    next(iter(plain))
    with pytest.raises(StateError, match="packing"):
        FeedLoader(packed(corpus), batch_size=2).load_state_dict(plain.state_dict())


def test_the_fill_rate_is_said(corpus: str, caplog: pytest.LogCaptureFixture) -> None:
    p = packed(corpus)
    with caplog.at_level(logging.INFO, logger="feedpipe"):
        rows = p.num_rows(0)
    fill = p.fill(0)
    assert fill == pytest.approx(sum(LENGTHS) / (rows * SEQ)) and fill < 1
    assert f"{rows} rows of {SEQ} tokens packed by 'best-fit', {100 * fill:.1f}%" in caplog.text


def test_the_ledger_proves_best_fit_rows_and_names_a_lost_batch(corpus: str,
                                                               tmp_path: Path) -> None:
    ld = FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    it = iter(ld)
    got = Counter(t for _ in range(2) for row in rows_of(next(it)) for t, _, _ in row)
    state = ld.state_dict()
    state["position"] += 2  # a batch never delivered
    again = FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    again.load_state_dict(state)
    got.update(t for b in again for row in rows_of(b) for t, _, _ in row)
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert not r["ok"] and r["packed"]["packing"] == "best-fit"
    lost: Counter[int] = Counter()
    for d, s, k in e["losses"]["pieces"]:
        lost.update(range(d * 1000 + s, d * 1000 + s + k))
    assert lost == ALL - got and e["losses"]["ids"] == [4, 5]
    whole = FeedLoader(packed(corpus), batch_size=3, ledger=tmp_path / "m")
    for _ in whole:
        pass
    assert check_ledger(tmp_path / "m")["ok"]
