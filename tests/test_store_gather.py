"""Whole batches gathered from a complete decoded store (feedpipe.store_batches): the same
batches, in the same order, as the per-sample path; damaged records recomputed; resumption;
structures the gather does not take fall back to the per-sample path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe import store_batches as sb
from feedpipe.collator import BatchCollator
from feedpipe.decoded_store import DecodedStore
from feedpipe.transforms import ImagePipeline

from _data import damage_record, make_dataset

N = 25  # samples of make_dataset
SIZE = 8


class Counted:
    """ImagePipeline (eval, uint8) that appends each key it computes to a file (counts calls
    across worker processes)."""

    def __init__(self, calls: str, bare: bool = False) -> None:
        self.calls, self.bare = calls, bare
        self.pipeline = ImagePipeline(SIZE, train=False, mean=None,
                                      label_field=None if bare else "cls")

    def __call__(self, sample: dict[str, Any]) -> Any:
        with open(self.calls, "a") as f:
            f.write(sample["__key__"] + "\n")
        return self.pipeline(sample)


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("ds")))  # 25 samples, shards of 7


def loader(ds_path: str, store: Path, calls: Path, *, bare: bool = False,
           workers: int = 2) -> FeedLoader:
    ds = FeedDataset(ds_path, shuffle=True, seed=5, transform=Counted(str(calls), bare),
                     decoded_cache=str(store))
    return FeedLoader(ds, batch_size=4, num_workers=workers,
                      collate_fn=BatchCollator(4, (3, SIZE, SIZE)))


def copies(batches: Any) -> list[Any]:
    """Batches copied out of the collator's reused buffers."""
    out = []
    for b in batches:
        out.append(tuple(t.clone() for t in b) if isinstance(b, tuple) else b.clone())
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        xs, ys = (x, y) if isinstance(x, tuple) else ((x,), (y,))
        if not all(torch.equal(u, v) for u, v in zip(xs, ys)):
            return False
    return True


class Spy:
    """Counts DecodedStore.gather calls (the gathered path ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = DecodedStore.gather

        def gather(store: DecodedStore, ids: np.ndarray, head: np.ndarray,
                   tail: np.ndarray) -> np.ndarray:
            self.calls += 1
            return real(store, ids, head, tail)
        monkeypatch.setattr(DecodedStore, "gather", gather)


@pytest.mark.parametrize("bare,workers", [(False, 2), (True, 2), (False, 0)])
def test_gathered_batches_equal_the_per_sample_path(ds_path: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    bare: bool, workers: int) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls, bare=bare)
    fill.set_epoch(2)
    filled = copies(fill)  # through the 2 workers: fills the store
    assert len(calls.read_text().splitlines()) == N and fill.dataset.decoded.complete()

    spy = Spy(monkeypatch)
    fast = loader(ds_path, tmp_path / "store", calls, bare=bare, workers=workers)
    fast.set_epoch(2)
    gathered = copies(fast)
    assert spy.calls == len(gathered) == 7  # 25 samples in batches of 4
    assert same(gathered, filled)
    assert fast.dataset.decoded.stats.hits == N and len(calls.read_text().splitlines()) == N

    monkeypatch.setattr(sb, "store_batches", lambda *a: None)
    monkeypatch.setattr("feedpipe.loader.store_batches", lambda *a: None)
    slow = loader(ds_path, tmp_path / "store", calls, bare=bare, workers=workers)
    slow.set_epoch(2)
    assert same(copies(slow), gathered)
    assert spy.calls == 7  # the per-sample path gathers nothing


def test_a_damaged_or_missing_record_is_recomputed_and_stored_again(
        ds_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls)
    truth = copies(fill)
    damage_record(fill.dataset.decoded.path, 3, N)

    spy = Spy(monkeypatch)
    again = loader(ds_path, tmp_path / "store", calls)
    assert same(copies(again), truth) and spy.calls == 7
    stats = again.dataset.decoded.stats
    assert (stats.damaged, stats.misses, stats.fills, stats.hits) == (1, 1, 1, N - 1)
    assert len(calls.read_text().splitlines()) == N + 1

    fixed = loader(ds_path, tmp_path / "store", calls)
    assert same(copies(fixed), truth) and fixed.dataset.decoded.stats.damaged == 0


def test_resume_mid_epoch_from_the_gathered_path(ds_path: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls)
    fill.set_epoch(1)
    truth = copies(fill)

    part = loader(ds_path, tmp_path / "store", calls)
    part.set_epoch(1)
    it = iter(part)
    head = copies([next(it), next(it), next(it)])
    state = part.state_dict()
    it.close()
    rest = loader(ds_path, tmp_path / "store", calls)
    rest.load_state_dict(state)
    assert same(head + copies(rest), truth)


def test_structures_the_gather_does_not_take_use_the_per_sample_path(
        ds_path: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls)
    list(fill)
    ds = fill.dataset
    assert sb.store_batches(ds, 4, BatchCollator(4, (3, SIZE, SIZE))) is not None
    assert sb.store_batches(ds, 4, BatchCollator(4, (3, SIZE + 1, SIZE))) is None  # shape
    assert sb.store_batches(ds, 4, BatchCollator(4, (3, SIZE, SIZE), torch.float32)) is None
    assert sb.store_batches(ds, 4, lambda batch: batch) is None  # not a BatchCollator
    fresh = FeedDataset(ds_path, transform=Counted(str(calls)),
                        decoded_cache=str(tmp_path / "empty"))
    assert sb.store_batches(fresh, 4, BatchCollator(4, (3, SIZE, SIZE))) is None  # not filled


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pin_memory_pins_batches_served_from_the_store(ds_path: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    list(loader(ds_path, tmp_path / "store", calls))
    ds = FeedDataset(ds_path, shuffle=True, seed=5, transform=Counted(str(calls)),
                     decoded_cache=str(tmp_path / "store"))
    pinned = FeedLoader(ds, batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    assert all(x.is_pinned() and y.is_pinned() for x, y in pinned)
