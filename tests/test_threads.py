"""FeedLoader(transform_threads=N) (the ``threads`` executor of the batch loop: routes
``rows-threads`` and ``samples-threads``): the transform on a pool of threads in this process
gives the batches of num_workers=0, in the same order; the transform really runs on the pool;
errors, resumption and the decoded store behave as in the per-sample route; the pool is gone when
the loop is."""

from __future__ import annotations

import gc
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe.errors import DecodeError
from feedpipe.stream._collator import BatchCollator
from feedpipe.transforms._pipeline import ImagePipeline

N = 25  # samples of the ds_path fixture (conftest)
SIZE = 8


class OnThreads:
    """The training ImagePipeline (random crops and flips, uint8), noting the thread of each
    call."""

    def __init__(self) -> None:
        self.pipeline = ImagePipeline(SIZE, train=True, mean=None)
        self.threads: list[str] = []

    def __call__(self, sample: dict[str, Any]) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.pipeline(sample)


def loader(ds_path: str, *, threads: int, collate: bool = True, transform: Any = None,
           **ds_kwargs: Any) -> FeedLoader:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=transform or OnThreads(),
                     **ds_kwargs)
    return FeedLoader(ds, batch_size=4, transform_threads=threads,
                      collate_fn=BatchCollator(4, (3, SIZE, SIZE)) if collate else None)


def batches(ds_path: str, *, threads: int, epoch: int = 1, collate: bool = True,
            transform: Any = None, route: str | None = None, **ds_kwargs: Any) -> list[Any]:
    """One epoch's batches (copied out of the collator's buffers); ``route``: the route the
    loader must take."""
    fl = loader(ds_path, threads=threads, collate=collate, transform=transform, **ds_kwargs)
    if route is not None:
        assert fl.route.name == route
    fl.set_epoch(epoch)
    out = [tuple(t.clone() for t in b) if collate else b for b in fl]
    stats = fl.stats()
    assert stats["batches"] == len(out)
    if route is not None:
        assert stats["route"] == route
        assert stats["parts"]["executor"] == ("threads" if threads else "inline")
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_give_the_batches_of_num_workers_0(ds_path: str, threads: int) -> None:
    want = batches(ds_path, threads=0, route="samples")
    assert len(want) == 7 and sum(len(b[1]) for b in want) == N
    assert same(batches(ds_path, threads=threads, route="rows-threads"), want)
    # another epoch draws other crops, and threads still agree with it
    assert not same(batches(ds_path, threads=0, epoch=2), want)
    assert same(batches(ds_path, threads=threads, epoch=2), batches(ds_path, threads=0, epoch=2))


def test_the_default_collation_works_on_threads_too(ds_path: str) -> None:
    want = batches(ds_path, threads=0, collate=False, route="samples")
    got = batches(ds_path, threads=2, collate=False, route="samples-threads")
    assert len(got) == len(want) == 7
    for (x, y), (u, v) in zip(got, want):
        assert torch.equal(x, u) and torch.equal(y, v)


def test_the_transform_runs_on_the_pool(ds_path: str) -> None:
    tf = OnThreads()
    batches(ds_path, threads=2, transform=tf, route="rows-threads")
    assert len(tf.threads) == N
    assert all(name.startswith("feedpipe-transform") for name in tf.threads), set(tf.threads)
    tf0 = OnThreads()
    batches(ds_path, threads=0, transform=tf0)
    assert set(tf0.threads) == {threading.current_thread().name}


class FailsOn:
    def __init__(self, key: str) -> None:
        self.key = key
        self.pipeline = ImagePipeline(SIZE, train=False, mean=None)

    def __call__(self, sample: dict[str, Any]) -> Any:
        if sample["__key__"] == self.key:
            raise DecodeError(f"sample {self.key!r}: broken on purpose")
        return self.pipeline(sample)


def test_an_error_in_a_thread_reaches_the_loop_and_the_pool_ends(ds_path: str) -> None:
    keys = [k for b in FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
            for k in b["__key__"]]
    bad = keys[9]  # in the third batch
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=FailsOn(bad))
    fl = FeedLoader(ds, batch_size=4, transform_threads=2,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    assert fl.route.name == "rows-threads"
    got = 0
    with pytest.raises(DecodeError, match="broken on purpose") as e:
        for _ in fl:
            got += 1
    assert bad in str(e.value)
    assert got == 2  # the batches before the failing one were delivered
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name.startswith("feedpipe-transform")]


def test_leaving_the_loop_early_stops_the_pool(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=OnThreads())
    fl = FeedLoader(ds, batch_size=4, transform_threads=2,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    it = iter(fl)
    next(it)
    assert fl.stats()["route"] == "rows-threads"
    assert [t for t in threading.enumerate() if t.name.startswith("feedpipe-transform")]
    it.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("feedpipe-transform")]


def test_a_resume_on_threads_continues_exactly(ds_path: str) -> None:
    want = batches(ds_path, threads=0)
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=OnThreads())
    fl = FeedLoader(ds, batch_size=4, transform_threads=2,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    fl.set_epoch(1)
    it = iter(fl)
    first = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    state = fl.state_dict()
    it.close()
    assert state["position"] == 12
    ds2 = FeedDataset(ds_path, shuffle=True, seed=3, transform=OnThreads())
    fl2 = FeedLoader(ds2, batch_size=4, transform_threads=2,
                     collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    fl2.load_state_dict(state)
    fl2.set_epoch(1)
    rest = [tuple(t.clone() for t in b) for b in fl2]
    assert same(first + rest, want)


def test_threads_fill_the_decoded_store_and_read_it_back(ds_path: str, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def make(threads: int, store: Path, route: str = "auto") -> FeedLoader:
        ds = FeedDataset(ds_path, shuffle=True, seed=3, decoded_cache=str(store),
                         transform=ImagePipeline(SIZE, train=False, mean=None))
        return FeedLoader(ds, batch_size=4, transform_threads=threads, route=route,
                          collate_fn=BatchCollator(4, (3, SIZE, SIZE)))

    def eval_batches(fl: FeedLoader) -> list[Any]:
        fl.set_epoch(1)
        return [tuple(t.clone() for t in b) for b in fl]

    want = eval_batches(make(0, tmp_path / "plain"))
    filling = make(2, tmp_path / "threads")
    # the store keeps the outputs: the threads call the transform, the collator copies them
    assert filling.route.name == "samples-threads"
    first = eval_batches(filling)
    assert same(first, want)
    store = filling.dataset.decoded
    assert store is not None and store.complete()
    assert store.stats.fills == N and store.stats.hits == 0
    reading = make(2, tmp_path / "threads")  # complete: read back, nothing computed
    with caplog.at_level("WARNING", logger="feedpipe"):
        again = eval_batches(reading)
    assert same(again, want)
    assert reading.dataset.decoded is not None and reading.dataset.decoded.stats.fills == 0
    # the route taken is one these arguments may name, and threads left unused are said
    route = reading.stats()["route"]
    assert make(2, tmp_path / "threads", route=route).route.name == route
    if reading.stats()["parts"]["executor"] != "threads":
        assert any("transform_threads=2" in r.getMessage() for r in caplog.records), \
            f"route {route!r} leaves transform_threads=2 unused without a word"


def test_transform_threads_arguments_are_checked(ds_path: str) -> None:
    ds = FeedDataset(ds_path, transform=OnThreads())
    with pytest.raises(ValueError, match="0 or more"):
        FeedLoader(ds, batch_size=4, transform_threads=-1)
    with pytest.raises(ValueError, match="num_workers=2"):
        FeedLoader(ds, batch_size=4, num_workers=2, transform_threads=2, route="rows-threads",
                   collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    with pytest.raises(ValueError, match="no transform"):
        FeedLoader(FeedDataset(ds_path), batch_size=4, transform_threads=2,
                   route="samples-threads")
    with pytest.raises(ValueError, match="transform_threads is 0"):
        FeedLoader(ds, batch_size=4, route="samples-threads")


@pytest.mark.parametrize("collate", [False, True])
def test_threads_and_worker_processes_together_are_refused(ds_path: str, collate: bool) -> None:
    # two ways to run the transform: one at a time, said with the fix
    ds = FeedDataset(ds_path, transform=OnThreads())
    with pytest.raises(ValueError, match="num_workers=2"):
        FeedLoader(ds, batch_size=4, num_workers=2, transform_threads=2,
                   collate_fn=BatchCollator(4, (3, SIZE, SIZE)) if collate else None)


def test_threads_for_a_dataset_without_a_transform_are_refused(ds_path: str) -> None:
    # nothing to run on them: an argument that would be ignored is said, not dropped
    with pytest.raises(ValueError, match="no transform"):
        FeedLoader(FeedDataset(ds_path), batch_size=4, transform_threads=2)


def test_bare_images_fill_the_collator_in_place(ds_path: str) -> None:
    def bare(threads: int) -> list[torch.Tensor]:
        ds = FeedDataset(ds_path, shuffle=True, seed=3,
                         transform=ImagePipeline(SIZE, train=True, mean=None, label_field=None))
        fl = FeedLoader(ds, batch_size=4, transform_threads=threads,
                        collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
        assert fl.route.name == ("rows-threads" if threads else "rows")
        return [b.clone() for b in fl]

    want, got = bare(0), bare(2)
    assert len(got) == len(want) == 7
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_a_wrong_image_shape_names_the_sample(ds_path: str) -> None:
    first = next(iter(FeedLoader(FeedDataset(ds_path), batch_size=4)))
    key, shard = first["__key__"][0], first["__shard__"][0]
    ds = FeedDataset(ds_path, transform=ImagePipeline(SIZE + 1, train=False, mean=None))
    fl = FeedLoader(ds, batch_size=4, transform_threads=2,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    assert fl.route.name == "rows-threads" and fl.route.compute == "call"
    with pytest.raises(ValueError, match=re.escape(f"sample {key!r} of {shard!r}: ") +
                       r"the transform gave shape \(3, 9, 9\), the collator takes \(3, 8, 8\)"):
        next(iter(fl))


def test_threads_behind_a_device_loader(ds_path: str) -> None:
    want = batches(ds_path, threads=0)
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=OnThreads())
    fl = FeedLoader(ds, batch_size=4, transform_threads=2, device="cpu",
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    fl.set_epoch(1)
    got = []
    for b in fl:
        got.append(tuple(t.clone() for t in b))
        # what the loop received, not what the DeviceLoader's thread prefetched
        if len(got) < 7:
            assert fl.state_dict()["position"] == 4 * len(got)
    assert same(got, want)
    assert fl.position == N
    assert fl.state_dict()["epoch"] == 2 and fl.state_dict()["position"] == 0  # the next one
    stats = fl.stats()
    assert stats["route"] == "rows-threads" and stats["batches"] == 7 and "device" in stats
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name.startswith("feedpipe-transform")]
