"""``Packed`` rows made in worker processes (route ``packed-workers``): once a worker's ring
buffers are mapped in the training process, a group of batches crosses as its layout and a ticket
only, with no shared-memory segment (whose file descriptor is handed over by a round trip to the
worker's resource-sharer thread, waiting for the worker's GIL); every token exactly once (the
ledger), from real worker processes, resumable mid-epoch."""

from __future__ import annotations

import functools
import os
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import FeedDataset, FeedLoader, Packed, check_ledger
from feedpipe.convert._shard_writer import write_samples
from feedpipe.stream._shared_order import SharedOrder

SEQ = 16
LENGTHS = [int(n) for n in np.random.default_rng(11).integers(1, 70, size=60)]
ALL = Counter(i * 1000 + j for i, n in enumerate(LENGTHS) for j in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("packedw") / "tok")
    # document i's token j is i * 1000 + j: every token of the corpus unique
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": np.arange(n, dtype=np.int64) + i * 1000}
                   for i, n in enumerate(LENGTHS)], root, max_samples=13)
    return root


def _tokens(batch: dict[str, Any]) -> list[int]:
    return batch["input_ids"][batch["labels"] != -100].tolist()


def _loader(path: str, **kw: Any) -> FeedLoader:
    return FeedLoader(Packed(FeedDataset(path, shuffle=True, seed=5), SEQ), batch_size=2, **kw)


def _count_storages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the shared-memory storages this process receives from worker processes."""
    from torch.multiprocessing import reductions

    got = [0]
    for name in ("rebuild_storage_fd", "rebuild_storage_filename"):
        real = getattr(reductions, name)

        # named as the function it replaces, so that pickle in a forked worker still sends it
        # by that name
        @functools.wraps(real)
        def counted(*args: Any, _real: Any = real) -> Any:
            got[0] += 1
            return _real(*args)
        monkeypatch.setattr(reductions, name, counted)
    return got


def test_reused_worker_buffers_cross_without_shared_memory(corpus: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           ) -> None:
    """With persistent workers, a group of batches a worker writes into a buffer the training
    process handed back crosses with no shared-memory storage: over two epochs after the first,
    the storages received are at most the shipments made in fresh buffers (and each worker's
    table), where before every shipment sent its buffer again. The batches equal the in-process
    route's, come from two worker processes, and the ledger proves every token of each epoch
    once."""
    from feedpipe.stream import _packed

    monkeypatch.setattr(_packed, "GROUP_BATCHES", 2)  # several shipments a worker (forked)
    ref = _loader(corpus)
    want = []
    for e in range(3):
        ref.set_epoch(e)
        want.append([{k: v.clone() for k, v in b.items()} for b in ref])
    assert len(want[0]) >= 12
    ld = _loader(corpus, num_workers=2, route="packed-workers", persistent_workers=True,
                 ledger=tmp_path / "l")
    assert ld.route.name == "packed-workers"
    got: Counter[int] = Counter()
    for b in ld:  # epoch 0: the rings' buffers are made and mapped here
        got.update(_tokens(b))
    del b
    storages = _count_storages(monkeypatch)
    before = ld.stats()["buffers"]
    for e in (1, 2):
        ld.set_epoch(e)
        n = 0
        for b, w in zip(ld, want[e], strict=True):
            assert all(torch.equal(b[k], w[k]) for k in w)
            got.update(_tokens(b))
            n += 1
        del b
        assert n == len(want[e])
    after = ld.stats()["buffers"]
    shipments = after["batches"] - before["batches"]
    reused = after["reused"] - before["reused"]
    assert reused >= 4 and shipments == ld.stats()["messages"] * 2
    assert storages[0] <= shipments - reused + 2, (storages[0], shipments, reused)
    pids = ld.stats()["worker_pids"]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert got == Counter({t: 3 for t in ALL})
    r = check_ledger(tmp_path / "l")
    assert r["ok"] and all(e["finished"] and e["exactly_once"] for e in r["epochs"])


def test_a_state_saved_mid_epoch_in_workers_resumes_to_exactly_the_rest(corpus: str) -> None:
    """A state saved after some batches of the worker route resumes, in new worker processes,
    to exactly the batches not delivered, in order."""
    want = [_tokens(b) for b in _loader(corpus)]
    ld = _loader(corpus, num_workers=2, route="packed-workers", persistent_workers=True)
    first = [_tokens(b) for b in islice(ld, 5)]
    state = ld.state_dict()
    again = _loader(corpus, num_workers=2, route="packed-workers")
    again.load_state_dict(state)
    rest = [_tokens(b) for b in again]
    assert first + rest == want
    assert len(set(again.stats()["worker_pids"])) == 2


def test_the_epoch_order_is_read_from_the_training_process_not_recomputed() -> None:
    """The board gives a reader the order its writer published for an epoch, none for another
    epoch, and nothing written from a process other than the one that made it."""
    board = SharedOrder(5)
    assert board.read(0) is None
    board.publish(2, np.array([4, 1, 0, 3, 2]))
    assert board.read(2).tolist() == [4, 1, 0, 3, 2] and board.read(3) is None
    board.owner = -1  # as in a worker process: it reads, never writes
    board.publish(3, np.arange(5))
    assert board.read(3) is None and board.read(2).tolist() == [4, 1, 0, 3, 2]


def test_the_c_fill_writes_ids_positions_and_labels_or_refuses() -> None:
    """``_packrows.fill`` writes a batch's ids and labels (the tokens) and its positions (from 0
    at each piece) as numpy would, and refuses counts that do not cover the batch."""
    _packrows = pytest.importorskip("feedpipe._native._packrows")
    tokens = np.array([7, 8, 9, 10, 11], dtype=np.uint16)
    out = np.full((3, 5), -1, dtype=np.int64)
    _packrows.fill(out, tokens, np.array([2, 3], dtype=np.int64))
    assert out.tolist() == [[7, 8, 9, 10, 11], [0, 1, 0, 1, 2], [7, 8, 9, 10, 11]]
    with pytest.raises(ValueError, match="summing to n"):
        _packrows.fill(out, tokens, np.array([2, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="summing to n"):
        _packrows.fill(out, tokens, np.array([6, -1], dtype=np.int64))
    with pytest.raises(TypeError, match="not handled"):
        _packrows.fill(out, tokens.astype(np.float32), np.array([5], dtype=np.int64))


def test_a_worker_hands_over_each_token_once_in_the_documents_dtype(
        corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared memory a worker hands the training process holds each token of the epoch
    once, in the documents' dtype (int64 here): the batches' ids, positions and labels are
    written in the training process, so what crosses is 8 bytes a token, where a worker that
    wrote the batch fields sent 24 and more (the three int64 fields and ``cu_seqlens``)."""
    from feedpipe.stream import _packed
    from feedpipe.stream._worker_rows import RowRelease

    monkeypatch.setattr(_packed, "GROUP_BATCHES", 2)  # several shipments a worker (forked)
    crossed: list[int] = []
    real = RowRelease.receive

    def receive(self: RowRelease, batch: Any, ticket: Any) -> None:
        crossed.append(batch.numel() * batch.element_size())  # the buffer of one shipment
        real(self, batch, ticket)
    monkeypatch.setattr(RowRelease, "receive", receive)
    ld = _loader(corpus, num_workers=2, route="packed-workers", persistent_workers=True)
    for e in range(2):
        ld.set_epoch(e)
        got: Counter[int] = Counter()
        for b in ld:
            got.update(_tokens(b))
        assert got == ALL
    assert len(crossed) >= 8  # several shipments an epoch, reused buffers among them
    assert sum(crossed) == 2 * 8 * sum(LENGTHS)


def test_batches_held_for_a_whole_epoch_stay_as_they_were_made(
        corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch of an epoch held by the loop until its end (a user who keeps them all), the
    workers reusing their buffers all along: each batch still equals the in-process route's at
    the end. A worker that wrote into a buffer before the training process had made every
    batch out of it would change batches made later, and this would fail."""
    from feedpipe.stream import _packed

    monkeypatch.setattr(_packed, "GROUP_BATCHES", 1)  # a shipment a batch: buffers reused often
    ref = _loader(corpus)
    ref.set_epoch(1)
    want = [{k: v.clone() for k, v in b.items()} for b in ref]
    ld = _loader(corpus, num_workers=2, route="packed-workers", persistent_workers=True)
    for _ in ld:  # epoch 0: the rings' buffers are made and mapped here
        pass
    ld.set_epoch(1)
    before = ld.stats()["buffers"]
    held = list(ld)
    after = ld.stats()["buffers"]
    assert after["reused"] - before["reused"] >= len(held) // 2 - 4
    assert len(held) == len(want)
    for b, w in zip(held, want, strict=True):
        assert all(torch.equal(b[k], w[k]) for k in w)
