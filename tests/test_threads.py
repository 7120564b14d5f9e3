"""FeedLoader(transform_threads=N) (feedpipe.thread_batches): the transform on a pool of threads
in this process gives the batches of num_workers=0, in the same order; the transform really runs
on the pool; errors, resumption and the decoded store behave as in the per-sample path; the pool
is gone when the loop is."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe.collator import BatchCollator
from feedpipe.errors import DecodeError
from feedpipe.transforms import ImagePipeline

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


def batches(ds_path: str, *, threads: int, epoch: int = 1, collate: bool = True,
            transform: Any = None, **ds_kwargs: Any) -> list[Any]:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=transform or OnThreads(),
                     **ds_kwargs)
    fl = FeedLoader(ds, batch_size=4, transform_threads=threads,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)) if collate else None)
    fl.set_epoch(epoch)
    return [tuple(t.clone() for t in b) if collate else b for b in fl]


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_give_the_batches_of_num_workers_0(ds_path: str, threads: int) -> None:
    want = batches(ds_path, threads=0)
    assert len(want) == 7 and sum(len(b[1]) for b in want) == N
    assert same(batches(ds_path, threads=threads), want)
    # another epoch draws other crops, and threads still agree with it
    assert not same(batches(ds_path, threads=0, epoch=2), want)
    assert same(batches(ds_path, threads=threads, epoch=2), batches(ds_path, threads=0, epoch=2))


def test_the_default_collation_works_on_threads_too(ds_path: str) -> None:
    want = batches(ds_path, threads=0, collate=False)
    got = batches(ds_path, threads=2, collate=False)
    assert len(got) == len(want) == 7
    for (x, y), (u, v) in zip(got, want):
        assert torch.equal(x, u) and torch.equal(y, v)


def test_the_transform_runs_on_the_pool(ds_path: str) -> None:
    tf = OnThreads()
    batches(ds_path, threads=2, transform=tf)
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


def test_threads_fill_the_decoded_store_and_read_it_back(ds_path: str, tmp_path: Path) -> None:
    def eval_batches(threads: int, store: Path) -> tuple[list[Any], FeedDataset]:
        ds = FeedDataset(ds_path, shuffle=True, seed=3, decoded_cache=str(store),
                         transform=ImagePipeline(SIZE, train=False, mean=None))
        fl = FeedLoader(ds, batch_size=4, transform_threads=threads,
                        collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
        fl.set_epoch(1)
        return [tuple(t.clone() for t in b) for b in fl], ds

    want, _ = eval_batches(0, tmp_path / "plain")
    first, ds = eval_batches(2, tmp_path / "threads")
    assert same(first, want)
    store = ds.decoded
    assert store is not None and store.complete()
    assert store.stats.fills == N and store.stats.hits == 0
    again, ds2 = eval_batches(2, tmp_path / "threads")  # complete: read back, nothing computed
    assert same(again, want)
    assert ds2.decoded is not None and ds2.decoded.stats.fills == 0


def test_transform_threads_arguments_are_checked(ds_path: str) -> None:
    ds = FeedDataset(ds_path, transform=OnThreads())
    with pytest.raises(ValueError, match="num_workers=2"):
        FeedLoader(ds, batch_size=4, num_workers=2, transform_threads=2)
    with pytest.raises(ValueError, match="0 or more"):
        FeedLoader(ds, batch_size=4, transform_threads=-1)
    with pytest.raises(ValueError, match="has none"):
        FeedLoader(FeedDataset(ds_path), batch_size=4, transform_threads=2)


def test_bare_images_fill_the_collator_in_place(ds_path: str) -> None:
    def bare(threads: int) -> list[torch.Tensor]:
        ds = FeedDataset(ds_path, shuffle=True, seed=3,
                         transform=ImagePipeline(SIZE, train=True, mean=None, label_field=None))
        fl = FeedLoader(ds, batch_size=4, transform_threads=threads,
                        collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
        return [b.clone() for b in fl]

    want, got = bare(0), bare(2)
    assert len(got) == len(want) == 7
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_a_wrong_image_shape_names_the_sample(ds_path: str) -> None:
    ds = FeedDataset(ds_path, transform=ImagePipeline(SIZE + 1, train=False, mean=None))
    fl = FeedLoader(ds, batch_size=4, transform_threads=2,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    with pytest.raises(ValueError, match=r"shape \(3, 9, 9\), the collator takes \(3, 8, 8\)"):
        next(iter(fl))


def test_threads_behind_a_device_loader(ds_path: str) -> None:
    want = batches(ds_path, threads=0)
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=OnThreads())
    fl = FeedLoader(ds, batch_size=4, transform_threads=2, device="cpu",
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    fl.set_epoch(1)
    got = [tuple(t.clone() for t in b) for b in fl]
    assert same(got, want)
    assert fl.state_dict()["position"] == N
