"""feedpipe.Bucketed read through FeedLoader: every batch of one bucket at its resolution, each
image at most once per epoch over all ranks (what is left out counted in stats()), the same
batches in 0 and 2 real worker processes, two real gloo ranks, and a state saved mid-epoch
resumed on another number of ranks to exactly the rest."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp
from _buckets_data import BUCKETS, N, gloo_rank, make_images, shape_of

import feedpipe
from feedpipe.plan._buckets import assign_buckets


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_images(str(tmp_path_factory.mktemp("buckets") / "ds"))


def source(path: str, rank: int = 0, world: int = 1, **kw: Any) -> feedpipe.Bucketed:
    return feedpipe.Bucketed(feedpipe.FeedDataset(path, seed=3, rank=rank, world_size=world),
                             batch_size=4, buckets=BUCKETS, **kw)


def labels(batches: list[Any]) -> list[list[int]]:
    return [b["cls"].tolist() for b in batches]


def test_each_batch_is_one_bucket_at_its_resolution_each_image_once(images: str) -> None:
    src = source(images)
    loader = feedpipe.FeedLoader(src, batch_size=4)
    batches = list(loader)
    want_bucket = assign_buckets(np.array([shape_of(i) for i in range(N)]), BUCKETS)
    assert want_bucket.tolist() == [i % 3 for i in range(N)]
    seen: list[int] = []
    for b in batches:
        ids = b["cls"].tolist()
        (k,) = {int(want_bucket[i]) for i in ids}  # one bucket a batch
        w, h = BUCKETS[k]
        assert tuple(b["image"].shape) == (4, 3, h, w)
        # the original sizes are the images', the image is what the crop made of them
        assert [tuple(s) for s in b["original_size"].tolist()] == \
            [shape_of(i)[::-1] for i in ids]
        assert [int(v) for v in b["image"][:, 0, h // 2, w // 2]] == [i % 255 for i in ids]
        seen += ids
    assert len(seen) == len(set(seen)) == len(loader) * 4
    # 18, 18, 17 images: remainders 2, 2, 1 left out; nothing else with one rank
    st = loader.stats()["sources"]
    assert st == {"48x24": 16, "32x32": 16, "24x48": 16, "remainders": 5, "unequal_ranks": 0,
                  "unsized": 0}
    assert len(seen) + st["remainders"] == N


def test_the_order_interleaves_buckets_and_changes_with_the_epoch(images: str) -> None:
    loader = feedpipe.FeedLoader(source(images), batch_size=4)
    first, again = labels(list(loader)), None
    loader.set_epoch(0)
    again = labels(list(loader))
    loader.set_epoch(1)
    second = labels(list(loader))
    assert first == again and first != second
    shapes = [assign_buckets(np.array([shape_of(b[0])]), BUCKETS)[0] for b in first]
    assert len(set(shapes[:4])) > 1 or len(set(shapes[4:8])) > 1  # not bucket after bucket


def test_two_worker_processes_make_the_same_batches(images: str) -> None:
    inline = labels(list(feedpipe.FeedLoader(source(images), batch_size=4)))
    loader = feedpipe.FeedLoader(source(images), batch_size=4, num_workers=2)
    assert labels(list(loader)) == inline
    pids = loader.stats()["worker_pids"]
    assert len(pids) == 2 and os.getpid() not in pids


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_equal_batches_each_image_at_most_once(images: str, world: int) -> None:
    loaders = [feedpipe.FeedLoader(source(images, r, world), batch_size=4)
               for r in range(world)]
    per_rank = [labels(list(ld)) for ld in loaders]
    assert len({len(b) for b in per_rank}) == 1
    seen = [i for r in per_rank for b in r for i in b]
    st = loaders[0].stats()["sources"]
    assert len(seen) == len(set(seen))
    assert len(seen) + st["remainders"] + st["unequal_ranks"] == N


@pytest.mark.parametrize(("w1", "w2"), [(2, 3), (3, 1)])
def test_a_state_resumes_on_another_number_of_ranks_to_exactly_the_rest(
        images: str, w1: int, w2: int) -> None:
    loaders = [feedpipe.FeedLoader(source(images, r, w1), batch_size=4) for r in range(w1)]
    its = [iter(ld) for ld in loaders]
    before = [i for it in its for _ in range(1) for i in next(it)["cls"].tolist()]
    state = loaders[0].state_dict()
    after = []
    for r in range(w2):
        ld = feedpipe.FeedLoader(source(images, r, w2), batch_size=4)
        ld.load_state_dict(state)
        after += [i for b in labels(list(ld)) for i in b]
    # exactly the rest of the epoch: the whole epoch's batches on one rank, from the same plan
    whole = feedpipe.FeedLoader(source(images), batch_size=4)
    every = {i for b in labels(list(whole)) for i in b}
    seen = before + after
    assert len(seen) == len(set(seen)) and set(seen) <= every
    lost = every - set(seen)
    assert len(lost) == ld.stats()["sources"]["unequal_ranks"] < w2 * 4


def test_refusals_are_named(images: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(feedpipe.PlanError, match="batch_size=4"):
        len(feedpipe.FeedLoader(source(images), batch_size=5))
    with pytest.raises(ValueError, match="transform"):
        feedpipe.Bucketed(feedpipe.FeedDataset(images, transform=lambda x: x), batch_size=4)
    state = feedpipe.FeedLoader(source(images), batch_size=4).state_dict()
    other = feedpipe.Bucketed(feedpipe.FeedDataset(images, seed=3), batch_size=4,
                              buckets=BUCKETS[:2])
    with pytest.raises(feedpipe.StateError, match="buckets"):
        feedpipe.FeedLoader(other, batch_size=4).load_state_dict(state)
    with caplog.at_level(logging.WARNING):
        feedpipe.FeedLoader(other, batch_size=4).load_state_dict(state, strict=False)
    assert any("afresh" in r.getMessage() for r in caplog.records)


def test_a_dataset_without_recorded_sizes_is_told_how_to_record_them(
        images: str, tmp_path: Path) -> None:
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(images, copy)
    for f in os.listdir(copy):
        if f.endswith(".sizes.npy"):
            os.remove(os.path.join(copy, f))
    with pytest.raises(feedpipe.InputError, match="record_image_sizes"):
        source(copy)
    feedpipe.record_image_sizes(copy)
    assert labels(list(feedpipe.FeedLoader(source(copy), batch_size=4))) == \
        labels(list(feedpipe.FeedLoader(source(images), batch_size=4)))


def test_random_crops_are_reproducible_and_differ_by_epoch(tmp_path: Path) -> None:
    import cv2

    ramp = np.tile(np.arange(80, dtype=np.uint8)[None, :, None] * 3, (40, 1, 3))
    out = str(tmp_path / "ramp")
    feedpipe.write_samples([{"__key__": f"r{i}", "png": cv2.imencode(".png", ramp)[1].tobytes(),
                             "cls": i} for i in range(8)], out)

    def corners(epoch: int) -> list[list[int]]:
        src = feedpipe.Bucketed(feedpipe.FeedDataset(out), batch_size=4, buckets=[(16, 16)],
                                crop="random")
        ld = feedpipe.FeedLoader(src, batch_size=4)
        ld.set_epoch(epoch)
        return sorted(c for b in ld for c in b["crop_top_left"].tolist())

    assert corners(0) == corners(0) != corners(1)
    assert all(top == 0 and 0 <= left <= 40 for top, left in corners(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_gloo_ranks_with_two_workers_each(images: str, tmp_path: Path) -> None:
    out = str(tmp_path / "ranks.json")
    mp.spawn(gloo_rank, args=(2, _free_port(), images, out), nprocs=2, join=True)
    with open(out) as f:
        ranks = json.load(f)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == ranks[0]["len"] > 0
    for r in ranks:
        assert len(set(r["workers"])) == 2 and r["pid"] not in r["workers"]
    for r0, r1 in zip(ranks[0]["batches"], ranks[1]["batches"]):
        assert len(r0[0]) == len(r1[0]) == 4
    seen = [i for r in ranks for ids, _ in r["batches"] for i in ids]
    assert len(seen) == len(set(seen))
    want = assign_buckets(np.array([shape_of(i) for i in range(N)]), BUCKETS)
    for r in ranks:
        for ids, shape in r["batches"]:
            (k,) = {int(want[i]) for i in ids}
            assert shape == [4, 3, BUCKETS[k][1], BUCKETS[k][0]]
