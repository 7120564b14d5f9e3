"""Each FeedLoader owns its epoch: several loaders over one FeedDataset (a training and an
evaluation loader, two batch sizes) never change each other's batch size, length, position or
epoch, on every executor (inline, threads, worker processes, persistent ones included)."""

from __future__ import annotations

from typing import Any

import pytest

from feedpipe import FeedDataset, FeedLoader

N = 25  # ds_path: 25 samples in shards of 7


def tagged(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform (the threads executor runs one): the sample's id and key."""
    return {"__index__": sample["__index__"], "__key__": sample["__key__"]}


# executor -> (dataset arguments, loader arguments)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "inline": ({}, {"route": "samples"}),
    "inline-refs": ({}, {"route": "refs"}),
    "threads": ({"transform": tagged}, {"route": "samples-threads", "transform_threads": 2}),
    "workers": ({}, {"route": "samples-workers", "num_workers": 2}),
    "persistent-workers": ({}, {"route": "samples-workers", "num_workers": 2,
                                "persistent_workers": True}),
    "refs-workers": ({"max_open_shards": 2}, {"route": "refs-workers", "num_workers": 2}),
}


def dataset(path: str, case: str) -> FeedDataset:
    return FeedDataset(path, shuffle=True, seed=3, **CASES[case][0])


def loader(ds: FeedDataset, case: str, batch_size: int) -> FeedLoader:
    return FeedLoader(ds, batch_size=batch_size, **CASES[case][1])


def three(path: str, case: str) -> tuple[FeedLoader, FeedLoader, FeedLoader]:
    """The issue's scenario: ``a`` (batch 4), ``b`` (batch 8), then ``c`` (batch 4), one
    dataset."""
    ds = dataset(path, case)
    return loader(ds, case, 4), loader(ds, case, 8), loader(ds, case, 4)


def ids(batches: list[Any]) -> list[int]:
    return [i for b in batches for i in b["__index__"].tolist()]


def alone(path: str, case: str, batch_size: int, epoch: int = 0) -> list[int]:
    """What a loader alone on its own dataset delivers in ``epoch``."""
    ld = loader(dataset(path, case), case, batch_size)
    ld.set_epoch(epoch)
    return ids(list(ld))


@pytest.mark.parametrize("case", list(CASES))
def test_each_loader_deals_its_own_batch_size_and_length(ds_path: str, case: str) -> None:
    a, b, c = three(ds_path, case)
    for ld, size in ((b, 8), (a, 4), (c, 4), (b, 8)):
        got = list(ld)
        sizes = [len(x["__index__"]) for x in got]
        assert sizes[:-1] == [size] * (len(got) - 1) and 0 < sizes[-1] <= size, (size, sizes)
        assert len(ld) == len(got)
    assert len(a) == len(c) == 7 and len(b) == 4


@pytest.mark.parametrize("case", list(CASES))
def test_a_state_names_the_position_its_own_loader_reached(ds_path: str, case: str) -> None:
    a, b, c = three(ds_path, case)
    it_b = iter(b)
    seen = ids([next(it_b), next(it_b)])
    it_a = iter(a)  # the other loaders read meanwhile
    next(it_a)
    next(iter(c))
    state = b.state_dict()
    assert state["position"] == 16 and state["epoch"] == 0
    assert a.state_dict()["position"] == 4
    resumed = loader(dataset(ds_path, case), case, 8)
    resumed.load_state_dict(state)
    rest = ids(list(resumed))
    assert seen + rest == alone(ds_path, case, 8)  # nothing skipped, nothing twice
    # the interrupted loader itself goes on with its own batches
    assert seen + ids(list(it_b)) == alone(ds_path, case, 8)


# two worker cases of the three run with --slow: each pass starts worker processes
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in ("persistent-workers", "refs-workers") else c
                                  for c in CASES])
def test_one_loaders_passes_leave_the_others_epoch(ds_path: str, case: str) -> None:
    a, b, _ = three(ds_path, case)
    first = ids(list(a))
    second = ids(list(a))  # a's second pass: its epoch 1
    assert first == alone(ds_path, case, 4, 0) and second == alone(ds_path, case, 4, 1)
    assert b.state_dict()["epoch"] == 0
    assert ids(list(b)) == alone(ds_path, case, 8, 0)
    assert a.state_dict()["epoch"] == 2 and a.epoch == 1 and b.epoch == 0
    b.set_epoch(5)
    assert a.epoch == 1 and ids(list(a)) == alone(ds_path, case, 4, 2)


@pytest.mark.parametrize("case", ["inline", "workers"])
def test_loading_a_state_into_one_loader_leaves_the_other(ds_path: str, case: str) -> None:
    a, b, _ = three(ds_path, case)
    saved = loader(dataset(ds_path, case), case, 8)
    it = iter(saved)
    next(it)
    b.load_state_dict(saved.state_dict())
    assert ids(list(a)) == alone(ds_path, case, 4)  # a starts its epoch at its beginning
    assert len(ids(list(b))) == N - 8


def test_the_dataset_read_directly_keeps_its_own_epoch(ds_path: str) -> None:
    """The dataset's own set_epoch/state_dict are those of a plain DataLoader reading it; a
    FeedLoader over the same dataset neither moves them nor follows them."""
    ds = dataset(ds_path, "inline")
    ld = loader(ds, "inline", 4)
    list(ld)
    list(ld)
    assert ds.epoch == 0 and ds.state_dict()["epoch"] == 0
    ds.set_epoch(3)
    assert [x["__index__"] for x in ds] == alone(ds_path, "inline", 1, 3)
    assert ld.epoch == 1 and ids(list(ld)) == alone(ds_path, "inline", 4, 2)


def _set_epoch_in_another_process(ld: FeedLoader, out: Any) -> None:
    ld.set_epoch(7)
    out.put(ld.epoch)


@pytest.mark.slow
def test_a_loader_sent_to_another_rank_keeps_its_epoch_to_itself(ds_path: str) -> None:
    """A loader sent to a spawned process (as Lightning's ddp_spawn sends it to each rank)
    shares its sender's epoch memory until it writes it: then it takes its own."""
    import torch.multiprocessing as mp

    ld = loader(dataset(ds_path, "workers"), "workers", 4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_set_epoch_in_another_process, args=(ld, out))
    p.start()
    assert out.get(timeout=120) == 7
    p.join(timeout=120)
    assert p.exitcode == 0 and ld.epoch == 0
    assert ids(list(ld)) == alone(ds_path, "workers", 4, 0)


def test_setting_the_datasets_epoch_under_a_loader_is_said(ds_path: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """The habit of calling set_epoch on the dataset (DistributedSampler style) moves the
    direct reader's epoch only: a loader over the dataset says so once, and keeps its own."""
    ds = dataset(ds_path, "inline")
    ld = loader(ds, "inline", 4)
    with caplog.at_level("WARNING", logger="feedpipe"):
        list(ld)
        ds.set_epoch(3)
        second = ids(list(ld))
        list(ld)
    said = [r.getMessage() for r in caplog.records if "FeedDataset's epoch" in r.getMessage()]
    assert len(said) == 1 and "set to 3" in said[0] and "loader.set_epoch(e)" in said[0]
    assert "(epoch 1 next)" in said[0] and second == alone(ds_path, "inline", 4, 1)
