"""A FeedDataset iterated directly (the plain DataLoader way: sample dicts, one by one): the
loop's once-a-batch work (locating shards, checking them for truncation) is done once for a run
of samples, and the samples are the same as one at a time."""

from __future__ import annotations

import os

import pytest
from _data import make_dataset

import feedpipe
from feedpipe import FeedDataset
from feedpipe.format._reader import ShardReader
from feedpipe.stream import _dataset


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("direct")))  # 25 samples, 4 shards


def fields(s: dict) -> tuple:  # type: ignore[type-arg]
    cls = s["cls"]
    return s["__index__"], s["__key__"], bytes(s["jpg"]), cls if type(cls) is int else bytes(cls)


def test_shards_are_checked_once_a_run_not_once_a_sample(ds_path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    checks = []
    real = ShardReader.check
    monkeypatch.setattr(ShardReader, "check", lambda r: checks.append(r.name) or real(r))
    ds = FeedDataset(ds_path, shuffle=True, seed=3)
    got = list(ds)
    assert sorted(s["__index__"] for s in got) == list(range(25))
    shards = len(feedpipe.load_manifest(ds_path).shards)
    assert len(checks) == shards  # one run of 25: each of its shards checked once


def test_runs_deliver_what_one_sample_at_a_time_does(ds_path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ds = FeedDataset(ds_path, shuffle=True, seed=5, decode={"cls": int})
    ds.set_epoch(2)
    whole = [fields(s) for s in ds]
    monkeypatch.setattr(_dataset, "RUN", 3)  # runs that end inside shards
    assert [fields(s) for s in ds] == whole
    assert [c for *_, c in whole] == [ds.sample(g)["cls"] for g, *_ in whole]  # decoded


def test_shards_closed_in_the_middle_of_a_run_are_opened_again(ds_path: str) -> None:
    ds = FeedDataset(ds_path)
    expected = [fields(s) for s in ds]
    it = iter(ds)
    first = next(it)
    ds.close()  # the run's readers closed under it
    assert [fields(first)] + [fields(s) for s in it] == expected
    ds.close()


def test_samples_read_by_workers_are_bytes(ds_path: str) -> None:
    from torch.utils.data import DataLoader

    got = list(DataLoader(FeedDataset(ds_path), batch_size=None, num_workers=2))
    assert sorted(s["__index__"] for s in got) == list(range(25))
    assert all(type(s["jpg"]) is bytes for s in got)
    assert os.path.basename(got[0]["__shard__"]).endswith(".tar")
