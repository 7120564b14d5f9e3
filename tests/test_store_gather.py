"""Whole batches gathered from a complete decoded store (the ``gather`` route,
feedpipe.store_gather): the same batches, in the same order, as the per-sample routes; damaged
or missing records recomputed and stored again; resumption; structures the gather does not take
use another route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _data import damage_record, make_dataset

from feedpipe import FeedDataset, FeedLoader
from feedpipe.caches.decoded._store import DecodedStore
from feedpipe.stream._collator import BatchCollator
from feedpipe.stream._store_gather import gatherable
from feedpipe.transforms._pipeline import ImagePipeline

N = 25  # samples of make_dataset
SIZE = 8


class Counted:
    """ImagePipeline (eval, uint8) that appends each key it computes to a file (counts calls
    across worker processes)."""

    deterministic = True  # not run a second time by the store's check: it counts its calls

    def __init__(self, calls: str, bare: bool = False, normalise: bool = False) -> None:
        self.calls, self.bare = calls, bare
        kw: dict[str, Any] = {} if normalise else {"mean": None}  # normalised: float32
        self.pipeline = ImagePipeline(SIZE, train=False, label_field=None if bare else "cls",
                                      **kw)

    def __call__(self, sample: dict[str, Any]) -> Any:
        with open(self.calls, "a") as f:
            f.write(sample["__key__"] + "\n")
        return self.pipeline(sample)


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("ds")))  # 25 samples, shards of 7


def loader(ds_path: str, store: Path, calls: Path, *, bare: bool = False, workers: int = 2,
           route: str = "auto", **kw: Any) -> FeedLoader:
    ds = FeedDataset(ds_path, shuffle=True, seed=5, transform=Counted(str(calls), bare),
                     decoded_cache=str(store))
    return FeedLoader(ds, batch_size=4, num_workers=workers, route=route,
                      collate_fn=BatchCollator(4, (3, SIZE, SIZE)), **kw)


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
                                                    caplog: pytest.LogCaptureFixture,
                                                    bare: bool, workers: int) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls, bare=bare)
    assert fill.route.name == "samples-workers"  # an empty store: the workers fill it
    fill.set_epoch(2)
    filled = copies(fill)
    assert len(calls.read_text().splitlines()) == N and fill.dataset.decoded.complete()
    assert len(fill.stats()["worker_pids"]) == 2

    spy = Spy(monkeypatch)
    fast = loader(ds_path, tmp_path / "store", calls, bare=bare, workers=workers)
    assert fast.route.name == "gather"
    fast.set_epoch(2)
    with caplog.at_level("WARNING", logger="feedpipe"):
        gathered = copies(fast)
    assert spy.calls == len(gathered) == 7  # 25 samples in batches of 4
    assert same(gathered, filled)
    assert fast.dataset.decoded.stats.hits == N and len(calls.read_text().splitlines()) == N
    stats = fast.stats()
    assert stats["route"] == "gather" and stats["parts"]["executor"] == "inline"
    assert "worker_pids" not in stats
    notes = [r.getMessage() for r in caplog.records if "route 'gather'" in r.getMessage()]
    assert len(notes) == (1 if workers else 0)  # the workers asked for and left unused: said

    for route in ("samples-workers", "samples") if workers else ("samples",):
        slow = loader(ds_path, tmp_path / "store", calls, bare=bare, workers=workers,
                      route=route)
        slow.set_epoch(2)
        assert same(copies(slow), gathered)
        assert slow.stats()["route"] == route
        assert spy.calls == 7  # the per-sample routes gather nothing
    assert len(calls.read_text().splitlines()) == N  # nor compute anything


@pytest.mark.parametrize("bare", [False, True])
def test_float_images_are_gathered_too(ds_path: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, bare: bool) -> None:
    """ImagePipeline's default output (normalised float32) with a BatchCollator of that dtype:
    records are gathered byte-wise into the float buffers."""
    def make(route: str) -> FeedLoader:
        pipe = Counted(str(tmp_path / "calls"), bare, normalise=True)
        assert pipe.pipeline.out_dtype == torch.float32
        ds = FeedDataset(ds_path, shuffle=True, seed=5, transform=pipe,
                         decoded_cache=str(tmp_path / "store"))
        return FeedLoader(ds, batch_size=4, route=route,
                          collate_fn=BatchCollator(4, (3, SIZE, SIZE), torch.float32))

    filled = copies(make("samples"))
    spy = Spy(monkeypatch)
    gathered = copies(make("gather"))
    assert spy.calls == 7 and same(gathered, filled)
    assert (gathered[0] if bare else gathered[0][0]).dtype == torch.float32


def test_stats_after_the_pass_that_filled_the_store_describe_that_pass(
        ds_path: str, tmp_path: Path) -> None:
    fill = loader(ds_path, tmp_path / "store", tmp_path / "calls", workers=0)
    assert fill.route.name == "samples"
    list(fill)
    assert fill.route.name == "gather"  # the next pass
    stats = fill.stats()
    assert stats["route"] == "samples" and stats["batches"] == 7
    assert stats["parts"]["fetch"] != "gather" and stats["parts"]["compute"] != "none"


def test_a_damaged_or_missing_record_is_recomputed_and_stored_again(
        ds_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls)
    truth = copies(fill)
    damage_record(fill.dataset.decoded.path, 3, N)

    spy = Spy(monkeypatch)
    again = loader(ds_path, tmp_path / "store", calls)
    assert again.route.name == "gather"
    assert same(copies(again), truth) and spy.calls == 7
    stats = again.dataset.decoded.stats
    assert (stats.damaged, stats.misses, stats.fills, stats.hits) == (1, 1, 1, N - 1)
    assert len(calls.read_text().splitlines()) == N + 1

    fixed = loader(ds_path, tmp_path / "store", calls)
    assert same(copies(fixed), truth) and fixed.dataset.decoded.stats.damaged == 0
    assert len(calls.read_text().splitlines()) == N + 1  # stored again: not computed again


def test_resume_mid_epoch_from_the_gathered_path(ds_path: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls)
    fill.set_epoch(1)
    truth = copies(fill)

    part = loader(ds_path, tmp_path / "store", calls)
    assert part.route.name == "gather"
    part.set_epoch(1)
    it = iter(part)
    head = copies([next(it), next(it), next(it)])
    state = part.state_dict()
    it.close()
    assert state["position"] == 12
    rest = loader(ds_path, tmp_path / "store", calls)
    rest.load_state_dict(state)
    assert rest.route.name == "gather"
    assert same(head + copies(rest), truth)
    assert len(calls.read_text().splitlines()) == N  # the store served all of it


def test_structures_the_gather_does_not_take_use_another_route(
        ds_path: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fill = loader(ds_path, tmp_path / "store", calls)
    list(fill)
    ds = fill.dataset
    assert gatherable(ds, BatchCollator(4, (3, SIZE, SIZE)))
    others: list[Any] = [BatchCollator(4, (3, SIZE + 1, SIZE)),  # shape
                         BatchCollator(4, (3, SIZE, SIZE), torch.float32),  # dtype
                         BatchCollator(4, (3, SIZE, SIZE), label_dtype=torch.int32),  # labels
                         lambda batch: batch]  # not a BatchCollator
    for collate in others:
        assert not gatherable(ds, collate)
        fl = FeedLoader(ds, batch_size=4, collate_fn=collate)
        assert fl.route.name == "samples"  # the complete store, sample by sample
        with pytest.raises(ValueError, match="cannot serve this loader"):
            FeedLoader(ds, batch_size=4, collate_fn=collate, route="gather")
    got = list(FeedLoader(ds, batch_size=4, collate_fn=lambda batch: batch))
    assert [len(b) for b in got] == [4] * 6 + [1]
    fresh = FeedDataset(ds_path, transform=Counted(str(calls)),
                        decoded_cache=str(tmp_path / "empty"))
    assert not gatherable(fresh, BatchCollator(4, (3, SIZE, SIZE)))  # not filled
    with pytest.raises(ValueError, match="not complete yet"):
        FeedLoader(fresh, batch_size=4, collate_fn=BatchCollator(4, (3, SIZE, SIZE)),
                   route="gather")
    assert FeedLoader(fresh, batch_size=4, num_workers=2,
                      collate_fn=BatchCollator(4, (3, SIZE, SIZE))).route.name == "samples-workers"
    assert not gatherable(FeedDataset(ds_path, transform=Counted(str(calls))),
                          BatchCollator(4, (3, SIZE, SIZE)))  # no store at all


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pin_memory_pins_batches_served_from_the_store(ds_path: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    list(loader(ds_path, tmp_path / "store", calls))
    ds = FeedDataset(ds_path, shuffle=True, seed=5, transform=Counted(str(calls)),
                     decoded_cache=str(tmp_path / "store"))
    pinned = FeedLoader(ds, batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    assert pinned.route.name == "gather"
    batches = list(pinned)
    assert len(batches) == 7 and all(x.is_pinned() and y.is_pinned() for x, y in batches)
