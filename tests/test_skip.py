"""A transform that raises SampleSkipped leaves that sample out of its batch, on every route that
runs a transform: a warning names it, stats() counts it, nothing else is lost. A batch that
loses every sample is left out whole (one rank), or refused (several ranks)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from feedpipe import (
    BatchCollator,
    DecodeError,
    EmptyEpochError,
    FeedDataset,
    FeedLoader,
    ImagePipeline,
    ShardWriter,
)

CORRUPT = {5, 6, 17}  # ids of samples whose JPEG is cut short
N = 24


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """24 samples (shards of 8), three of them with a corrupt JPEG; label = the sample's id."""
    import numpy as np
    import simplejpeg

    def jpeg_bytes(h: int, w: int, seed: int) -> bytes:
        img = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
        return simplejpeg.encode_jpeg(img, quality=90)

    out = tmp_path_factory.mktemp("broken") / "ds"
    with ShardWriter(str(out), max_samples=8) as w:
        for i in range(N):
            data = jpeg_bytes(20, 20, seed=i)
            w.write({"__key__": f"s{i:03d}", "jpg": data[:40] if i in CORRUPT else data,
                     "cls": i})
    return str(out)


ROUTES = [("samples", {}), ("samples-workers", {"num_workers": 2}),
          ("samples-threads", {"transform_threads": 2}), ("rows", {}),
          ("rows-workers", {"num_workers": 2}), ("rows-threads", {"transform_threads": 2})]


@pytest.mark.parametrize("route,kw", ROUTES)
def test_skipped_samples_are_left_out_logged_and_counted(broken: str, route: str, kw: dict,
                                                        caplog) -> None:  # type: ignore[no-untyped-def]
    pipe = ImagePipeline(8, train=False, mean=None, on_error="skip")
    ds = FeedDataset(broken, transform=pipe)
    ld = FeedLoader(ds, batch_size=4, collate_fn=BatchCollator(4, (3, 8, 8)), route=route, **kw)
    with caplog.at_level(logging.WARNING):
        batches = list(ld)
    labels = torch.cat([y for _, y in batches]).tolist()
    assert labels == [i for i in range(N) if i not in CORRUPT]
    assert len(batches) == len(ld) == 6  # a short batch, never a missing one
    assert [len(y) for _, y in batches] == [4, 2, 4, 4, 3, 4]
    assert ld.stats()["skipped"] == len(CORRUPT)
    if kw.get("num_workers") is None:  # worker processes log to their own stderr
        assert sum("was left out" in r.getMessage() for r in caplog.records) == len(CORRUPT)
    want = {i: ImagePipeline(8, train=False, mean=None)(s)[0] for i, s in
            enumerate(FeedDataset(broken)) if i not in CORRUPT}
    for images, ys in batches:  # rows after a skipped one moved up, pixels intact
        for img, y in zip(images, ys.tolist()):
            assert torch.equal(img, want[y])


def test_without_skip_the_corrupt_sample_stops_the_epoch_naming_it(broken: str) -> None:
    ds = FeedDataset(broken, transform=ImagePipeline(8, train=False, mean=None))
    with pytest.raises(DecodeError, match="s005"):
        list(FeedLoader(ds, batch_size=4))


@pytest.mark.parametrize("route,kw", ROUTES)
def test_a_batch_whose_every_sample_is_skipped_is_left_out(broken: str, route: str,
                                                           kw: dict) -> None:
    """batch_size=1 (the case a DataLoader user meets first): each corrupt sample is a whole
    batch. The epoch goes on without it, len() stays the plan's and a resume point taken after
    it is exact."""
    pipe = ImagePipeline(8, train=False, mean=None, on_error="skip")

    def loader() -> FeedLoader:
        return FeedLoader(FeedDataset(broken, transform=pipe), batch_size=1,
                          collate_fn=BatchCollator(1, (3, 8, 8)), route=route, **kw)

    ld = loader()
    got = [int(y) for _, y in ld]
    assert got == [i for i in range(N) if i not in CORRUPT] and len(ld) == N
    stats = ld.stats()
    assert (stats["batches"], stats["left_out"], stats["skipped"]) == (N - 3, 3, 3)

    part = loader()
    it = iter(part)
    head = [int(next(it)[1]) for _ in range(6)]  # ids 0-4 and 7: past the left-out 5 and 6
    state = part.state_dict()
    it.close()
    assert head == [0, 1, 2, 3, 4, 7] and state["position"] == 8
    rest = loader()
    rest.load_state_dict(state)
    assert head + [int(y) for _, y in rest] == got


def test_a_dataset_read_directly_leaves_skipped_samples_out(broken: str) -> None:
    """One rank: left out. Several: refused, since a DataLoader over ranks that deliver
    different numbers of samples can make different numbers of batches (DDP would hang)."""
    from torch.utils.data import DataLoader

    pipe = ImagePipeline(8, train=False, mean=None, on_error="skip")
    labels = torch.cat([y for _, y in DataLoader(FeedDataset(broken, transform=pipe),
                                                 batch_size=4)]).tolist()
    assert labels == [i for i in range(N) if i not in CORRUPT]
    ranked = FeedDataset(broken, transform=pipe, rank=1, world_size=2)
    with pytest.raises(DecodeError, match="rank 1: .*2 ranks, read directly"):
        list(DataLoader(ranked, batch_size=4))


def test_read_directly_each_batch_of_the_plan_is_refused_on_its_own(broken: str) -> None:
    """Read directly, consecutive batches of the plan (one sample each) are read together: on
    several ranks a batch that loses every sample is still refused, after the samples before
    it."""
    pipe = ImagePipeline(8, train=False, mean=None, on_error="skip")
    ds = FeedDataset(broken, transform=pipe, rank=1, world_size=2)
    ids = ds.sample_ids().tolist()
    first_bad = next(j for j, g in enumerate(ids) if g in CORRUPT)
    got: list[int] = []
    with pytest.raises(DecodeError, match="rank 1: every one of the 1 samples"):
        for _, y in ds:  # batches of one sample
            got.append(int(y))
    assert got == ids[:first_bad]


def test_left_out_batches_pass_a_device_loader_and_free_worker_buffers(broken: str) -> None:
    pipe = ImagePipeline(8, train=False, mean=None, on_error="skip")
    on_device = FeedLoader(FeedDataset(broken, transform=pipe), batch_size=1,
                           collate_fn=BatchCollator(1, (3, 8, 8)), device="cpu")
    assert [int(y) for _, y in on_device] == [i for i in range(N) if i not in CORRUPT]
    assert on_device.stats()["left_out"] == 3
    ring = FeedLoader(FeedDataset(broken, transform=pipe), batch_size=1, num_workers=2,
                      collate_fn=BatchCollator(1, (3, 8, 8)), route="rows-workers",
                      persistent_workers=True)
    for _ in range(2):  # the second epoch reuses what the first handed back
        got = [int(y) for _, y in ring]
    assert got == [i for i in range(N) if i not in CORRUPT]
    buffers = ring.stats()["buffers"]  # the left-out batches' buffers came back too
    assert buffers["batches"] == 2 * N and buffers["released"] >= 2 * N - 1
    assert buffers["reused"] > 0


def test_with_several_ranks_a_batch_left_out_whole_is_an_error(tmp_path: Path) -> None:
    """A rank that yielded fewer batches than the others would hang DDP's collectives."""
    out = tmp_path / "all-bad"
    with ShardWriter(str(out)) as w:
        for i in range(8):
            w.write({"__key__": f"s{i}", "jpg": b"\xff\xd8\xff" + bytes(20), "cls": i})
    pipe = ImagePipeline(8, mean=None, on_error="skip")
    ds = FeedDataset(str(out), transform=pipe, rank=1, world_size=2)
    with pytest.raises(DecodeError, match="rank 1: every one of the 4 samples.*2 ranks.*larger "
                                          "batch_size.*--on-error skip"):
        list(FeedLoader(ds, batch_size=4))
    alone = FeedLoader(FeedDataset(str(out), transform=pipe), batch_size=4)
    with pytest.raises(EmptyEpochError, match="the epoch delivered no batch"):
        list(alone)  # one rank: no hang, but an epoch of nothing trains nothing
    assert alone.stats()["left_out"] == 2
