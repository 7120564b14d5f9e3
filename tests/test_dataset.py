"""FeedDataset and FeedLoader with real worker processes."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch
from _data import make_dataset
from torch.utils.data import DataLoader

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe.errors import ManifestError, PlanError, StateError
from feedpipe.format._reader import ShardReader


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 25 samples in 4 shards of 7, 7, 7, 4: odd on purpose (padding, uneven shards)
    return make_dataset(str(tmp_path_factory.mktemp("ds")))


def ids_of(loader) -> list[int]:  # type: ignore[no-untyped-def]
    return [i for b in loader for i in b["__index__"].tolist()]


def test_unshuffled_iteration_is_manifest_order_with_raw_bytes(ds_path: str) -> None:
    ds = FeedDataset(ds_path)
    samples = list(ds)
    assert [s["__index__"] for s in samples] == list(range(25))
    m = feedpipe.load_manifest(ds_path)
    expected = []
    for rec in m.shards:
        with ShardReader(os.path.join(ds_path, rec.name)) as r:
            expected += [(s["__key__"], s["__shard__"], bytes(s["jpg"]), bytes(s["cls"]))
                         for s in r]
    got = [(s["__key__"], s["__shard__"], bytes(s["jpg"]), bytes(s["cls"])) for s in samples]
    assert got == expected
    assert isinstance(samples[0]["jpg"], memoryview)
    src = os.path.join(os.path.dirname(ds_path), "src")
    first = samples[0]
    with open(os.path.join(src, feedpipe.source_path(first["__key__"], "jpg")), "rb") as f:
        assert f.read() == bytes(first["jpg"])


def test_plain_dataloader_with_two_workers_delivers_each_sample_once(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    got = [s["__index__"] for s in loader]
    assert sorted(got) == list(range(25))
    assert isinstance(next(iter(loader))["jpg"], bytes)  # raw fields cross the process boundary


def test_persistent_workers_follow_set_epoch(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=5)
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                        collate_fn=feedpipe.stream._collate.collate_samples)
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        ids = [i for b in loader for i in b["__index__"].tolist()]
        assert sorted(ids) == list(range(25))
        orders.append(ids)
    assert len({tuple(o) for o in orders}) == 3


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_processes_deliver_the_order_of_the_training_process(ds_path: str,
                                                                    workers: int) -> None:
    """The same ids in the same order from real worker processes (their pids checked) as from
    the training process alone: the plan, not the executor, decides the order."""
    ref = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=9), batch_size=3, route="samples")
    ref.set_epoch(4)
    loader = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=9), batch_size=3,
                        num_workers=workers, route="samples-workers")
    loader.set_epoch(4)
    assert ids_of(loader) == ids_of(ref)
    pids = loader.stats()["worker_pids"]
    assert len(pids) == workers and os.getpid() not in pids
    assert ref.stats()["parts"]["executor"] == "inline"
    assert len(loader) == 9


def test_the_start_method_is_the_users(ds_path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """As with a DataLoader: workers fork by default, also once CUDA is initialised (they never
    touch CUDA); a context the user names is used; a process marked unsafe to fork from (DALI's
    threads) refuses to fork, naming the fix."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    ref = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=9), batch_size=3, route="samples")
    loader = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=9), batch_size=3, num_workers=2,
                        route="samples-workers")
    assert ids_of(loader) == ids_of(ref)
    assert loader.stats()["start_method"] == "fork"
    chosen = FeedLoader(FeedDataset(ds_path), batch_size=3, num_workers=2,
                        route="samples-workers", multiprocessing_context="forkserver")
    assert sorted(ids_of(chosen)) == list(range(25))
    assert chosen.stats()["start_method"] == "forkserver"
    unsafe = FeedLoader(FeedDataset(ds_path), batch_size=3, num_workers=2,
                        route="samples-workers")
    unsafe.mark_fork_unsafe("DALI's threads")
    with pytest.raises(feedpipe.StartMethodError,
                       match="multiprocessing_context='forkserver'.*picklable.*__main__"):
        next(iter(unsafe))
    told_fork = FeedLoader(FeedDataset(ds_path), batch_size=3, num_workers=2,
                           route="samples-workers", multiprocessing_context="fork")
    told_fork.mark_fork_unsafe("DALI's threads")
    with pytest.raises(feedpipe.StartMethodError, match="would fork"):
        next(iter(told_fork))  # a fork asked for by name is no safer


def test_a_warm_up_with_workers_is_refused_beside_dali(ds_path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from feedpipe._helpers import fork_safety

    monkeypatch.setattr(fork_safety, "_marks", [])
    fork_safety.mark_process_fork_unsafe("DALI's threads (a DaliStage runs in this process)")
    cache = feedpipe.DeviceCache(10_000, device="cpu")
    with pytest.raises(feedpipe.StartMethodError, match="warm up with num_workers=0"):
        cache.warmup(FeedDataset(ds_path), transform=lambda s: torch.zeros(2),
                     num_workers=2, show_progress=False)
    assert cache.warmup(FeedDataset(ds_path), transform=lambda s: torch.zeros(2),
                        show_progress=False)["resident"] == 25


def test_an_unset_start_method_is_the_platforms_default(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Nobody chose a method: the platform's default decides whether workers would fork (fork on
    Linux before Python 3.14, forkserver from 3.14), read without fixing it."""
    import multiprocessing

    from feedpipe._helpers.fork_safety import default_start_method

    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)
    for methods in (["forkserver", "spawn", "fork"], ["fork", "spawn", "forkserver"]):
        monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda m=methods: m)
        assert default_start_method() == methods[0]


def test_len_and_balance_over_ranks(ds_path: str) -> None:
    for drop_last, per_rank in ((False, 9), (True, 8)):
        lens = [len(FeedDataset(ds_path, rank=r, world_size=3, drop_last=drop_last))
                for r in range(3)]
        assert lens == [per_rank] * 3
        all_ids = []
        for r in range(3):
            loader = FeedLoader(FeedDataset(ds_path, shuffle=True, rank=r, world_size=3,
                                            drop_last=drop_last), batch_size=4, num_workers=2)
            got = ids_of(loader)
            assert len(got) == per_rank
            all_ids += got
        c = Counter(all_ids)
        if drop_last:
            assert max(c.values()) == 1 and len(c) == 24
        else:
            assert set(c) == set(range(25)) and sum(c.values()) == 27


def test_more_ranks_and_workers_than_shards(ds_path: str) -> None:
    got = []
    for r in range(3):
        loader = FeedLoader(FeedDataset(ds_path, shuffle=True, rank=r, world_size=3),
                            batch_size=1, num_workers=4)
        got += ids_of(loader)
    assert set(got) == set(range(25)) and len(got) == 27


def test_checkpoint_mid_epoch_in_process(ds_path: str) -> None:
    full = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4, num_workers=2)
    full.set_epoch(2)
    want = ids_of(full)
    loader = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4, num_workers=2)
    loader.set_epoch(2)
    it = iter(loader)
    before = [i for _ in range(3) for i in next(it)["__index__"].tolist()]
    state = loader.state_dict()
    assert state["position"] == 12 and state["epoch"] == 2
    json.dumps(state)  # plain data: fits any checkpoint format
    resumed = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=2, num_workers=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual loop calls this; it must keep the resume point
    assert before + ids_of(resumed) == want
    # the next epoch starts from the beginning again
    resumed.set_epoch(3)
    assert sorted(ids_of(resumed)) == list(range(25))


def test_state_at_epoch_end_resumes_at_the_next_epoch(ds_path: str) -> None:
    loader = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4)
    loader.set_epoch(0)
    ids_of(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    again = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4)
    again.load_state_dict(state)
    want = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4)
    want.set_epoch(1)
    assert ids_of(again) == ids_of(want)


def test_state_from_another_dataset_is_refused(ds_path: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    loader = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=1), batch_size=4)
    state = loader.state_dict()
    other = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=2), batch_size=4)
    with pytest.raises(StateError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(StateError):
        other.load_state_dict({"nothing": 1})


def test_bad_datasets_and_worlds(ds_path: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError):
        FeedDataset(ds_path, rank=3, world_size=3)
    with pytest.raises(PlanError):
        FeedDataset(ds_path, rank=0)
    with pytest.raises(PlanError, match="drop_last"):
        FeedDataset(ds_path, rank=0, world_size=26, drop_last=True)
    # 26 ranks without drop_last: one sample each, 1 repeat
    assert len(FeedDataset(ds_path, rank=25, world_size=26)) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.json").write_text(json.dumps(
        {"format": "feedpipe-manifest", "version": 1, "shards": [], "total_samples": 0}))
    with pytest.raises(PlanError, match="no samples"):
        FeedDataset(str(empty))
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "manifest.json").write_text(json.dumps(
        {"format": "feedpipe-manifest", "version": 99, "shards": []}))
    with pytest.raises(ManifestError, match="newer"):
        FeedDataset(str(newer))
    with pytest.raises(FileNotFoundError):
        FeedDataset(str(tmp_path / "missing"))
    with pytest.raises(TypeError):
        FeedLoader(FeedDataset(ds_path), batch_size=2, shuffle=True)


def test_world_detection_from_environment(ds_path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ds = FeedDataset(ds_path)
    assert (ds.world.rank, ds.world.world_size, ds.world.local_rank) == (1, 2, 1)
    assert len(ds) == 13
    explicit = FeedDataset(ds_path, rank=0, world_size=1)
    assert explicit.world.world_size == 1
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert FeedDataset(ds_path).world.rank == 2


def test_transform_runs_in_workers(ds_path: str) -> None:
    loader = FeedLoader(FeedDataset(ds_path, transform=_cls_tensor), batch_size=5, num_workers=2)
    batches = list(loader)
    assert all(isinstance(b, torch.Tensor) for b in batches)
    assert sorted(torch.cat(batches).tolist()) == sorted(
        int(bytes(s["cls"])) for s in FeedDataset(ds_path))


def _cls_tensor(sample):  # type: ignore[no-untyped-def]
    return torch.tensor(int(bytes(sample["cls"])))


def test_worker_batches_equal_in_process_batches_field_by_field(ds_path: str) -> None:
    """Workers send integer fields as numpy (cheap to pickle); FeedLoader hands out the same
    tensors as with num_workers=0, dtype included."""
    def batches(workers: int) -> list[dict]:
        fl = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=2), batch_size=4,
                        num_workers=workers,
                        route="samples-workers" if workers else "samples")
        return list(fl)

    here, there = batches(0), batches(2)
    assert len(here) == len(there)
    for a, b in zip(here, there):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert isinstance(b[k], torch.Tensor) and b[k].dtype == a[k].dtype == torch.int64
                assert torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k


def test_indexing_reads_a_sample_by_global_id(ds_path: str) -> None:
    """``ds[g]`` is ``ds.sample(g)``, on every rank and in any order (the README's random access
    by index), Python's negative indices count from the dataset's end, and an id outside the
    dataset is an IndexError naming the valid range; the dataset stays an iterable one for a
    DataLoader."""
    ds = FeedDataset(ds_path, shuffle=True, seed=3, rank=1, world_size=2, decode={"cls": int})
    for g in (17, 0, 24, 5):
        got, want = ds[g], ds.sample(g)
        assert got["__index__"] == g and got["__key__"] == want["__key__"]
        assert {k: bytes(v) if isinstance(v, memoryview) else v for k, v in got.items()} == {
            k: bytes(v) if isinstance(v, memoryview) else v for k, v in want.items()}
    assert ds[-1]["__index__"] == 24 and ds[-25]["__index__"] == 0
    assert ds[torch.tensor(3).item()]["__index__"] == 3
    assert ds[np.int64(7)]["__index__"] == 7
    for bad in (25, -26):
        with pytest.raises(IndexError, match=r"0 \.\. 24|-25 \.\. 24"):
            ds[bad]
    with pytest.raises(TypeError, match="sample_ids"):
        ds[1:3]  # type: ignore[index]
    assert isinstance(ds, torch.utils.data.IterableDataset)
    loader = DataLoader(FeedDataset(ds_path), batch_size=None, num_workers=0)
    assert [s["__index__"] for s in loader] == list(range(25))
