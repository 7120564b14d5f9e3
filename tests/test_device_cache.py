"""DeviceCache (L3): warm-up, epoch batches in plan order, partial residency with a fallback.

Every test runs on the CPU; the ``cuda`` parametrisations run where a CUDA device exists.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import DeviceCache, FeedDataset
from feedpipe.errors import DeviceCacheError
from feedpipe.plan._order import Plan, Split
from feedpipe.stream._dataset import sample_ids_of

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "shards", "example")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])]
N = 50
COUNTS = (20, 20, 10)
SHAPE = (3, 4, 4)


def image(i: int) -> torch.Tensor:
    return torch.full(SHAPE, i % 256, dtype=torch.uint8)


def items(n: int = N) -> list[tuple[int, torch.Tensor, int]]:
    return [(i, image(i), i) for i in range(n)]


class Fallback:
    """The 'normal pipeline' for non-resident ids; records what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked += ids.tolist()
        images = torch.stack([image(i) for i in ids.tolist()])
        return images, torch.as_tensor(ids, dtype=torch.int64)


def delivered(batches: Any, device: str) -> list[int]:
    out = []
    for img, lbl in batches:
        assert img.device.type == device and lbl.device.type == device
        assert img.dtype == torch.uint8 and img.shape[1:] == SHAPE
        lbl = lbl.cpu()
        assert torch.equal(img.cpu(), torch.stack([image(i) for i in lbl.tolist()]))
        out += lbl.tolist()
    return out


BYTES = int(np.prod(SHAPE)) + 8  # uint8 image + int64 label


@pytest.mark.parametrize("device", DEVICES)
def test_whole_dataset_resident_serves_the_plan_order(device: str) -> None:
    cache = DeviceCache(10 * N * BYTES, device=device)
    warmed = []
    s = cache.warmup(items(), num_samples=N, batch_size=8, warm=warmed.append)
    assert s["resident"] == N and s["slots"] == N and s["resident_fraction"] == 1.0
    assert s["bytes_per_sample"] == BYTES and s["bytes_used"] == N * BYTES
    assert len(warmed) == 1 and warmed[0][0].shape == (8, *SHAPE)
    for epoch in (0, 1):
        plan = Plan(COUNTS, seed=3, epoch=epoch)
        want = plan.sample_ids(np.arange(N)).tolist()
        assert delivered(cache.batches(plan, 8), device) == want
    s = cache.stats()
    assert s["hits"] == 2 * N and s["misses"] == 0 and s["hit_ratio"] == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_partial_residency_falls_back_and_still_delivers_every_sample_once(device: str) -> None:
    resident = 17
    cache = DeviceCache(resident * BYTES + BYTES // 2, device=device)
    fb = Fallback()
    s = cache.warmup(items(), num_samples=N, fallback=fb)
    assert s["resident"] == resident and s["resident_fraction"] == resident / N
    assert s["bytes_used"] <= s["capacity_bytes"]
    plan = Plan(COUNTS, seed=5, epoch=2)
    want = plan.sample_ids(np.arange(N)).tolist()
    assert delivered(cache.batches(plan, 6), device) == want
    assert sorted(fb.asked) == list(range(resident, N))  # only what is not resident
    s = cache.stats()
    assert s["hits"] == resident and s["misses"] == N - resident
    assert s["hit_ratio"] == s["resident_fraction"] == resident / N


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_of_an_epoch_together_get_every_sample_once(device: str) -> None:
    cache = DeviceCache(30 * BYTES, device=device)
    cache.warmup(items(), num_samples=N, fallback=Fallback())
    plan = Plan(COUNTS, seed=1, epoch=4)
    got = Counter()
    for rank in range(3):
        split = Split(N, world_size=3, rank=rank)
        mine = delivered(cache.batches((plan, split), 4), device)
        assert mine == plan.sample_ids(split.positions(0, split.length)).tolist()
        got.update(mine)
    assert set(got) == set(range(N)) and sum(got.values()) == N + 1  # one padding repeat


def test_nothing_fits_everything_comes_from_the_fallback() -> None:
    fb = Fallback()
    cache = DeviceCache(BYTES - 1, device="cpu")
    assert cache.warmup(items(), num_samples=N, fallback=fb)["resident"] == 0
    order = list(range(N))[::-1]
    assert delivered(cache.batches(order, 7), "cpu") == order
    assert cache.stats()["hit_ratio"] == 0.0


def test_dict_samples_come_back_as_dicts() -> None:
    cache = DeviceCache(1 << 20, device="cpu")
    cache.warmup([(i, {"img": image(i), "label": torch.tensor(i)}) for i in range(10)],
                 num_samples=10)
    (b,) = list(cache.batches([3, 1, 4], batch_size=8))
    assert list(b) == ["img", "label"] and b["label"].tolist() == [3, 1, 4]
    assert torch.equal(b["img"][2], image(4))


def test_misuse_is_reported_clearly() -> None:
    assert issubclass(DeviceCacheError, ValueError)
    assert feedpipe.DeviceCacheError is DeviceCacheError
    cache = DeviceCache(1 << 20, device="cpu")
    with pytest.raises(DeviceCacheError, match="warmup"):
        cache.batches([0], 1)
    with pytest.raises(DeviceCacheError, match="sample 1, field 0"):
        cache.warmup([(0, image(0)), (1, torch.zeros(2, 2, dtype=torch.uint8))], num_samples=2)
    with pytest.raises(DeviceCacheError, match="num_samples"):
        cache.warmup(iter(items()))
    cache.warmup(items(), num_samples=N)
    with pytest.raises(DeviceCacheError, match="outside"):
        cache.batches([0, N], 4)
    small = DeviceCache(5 * BYTES, device="cpu")
    small.warmup(items(), num_samples=N)
    with pytest.raises(DeviceCacheError, match="not resident.*fallback"):
        small.batches(list(range(N)), 4)
    with pytest.raises(DeviceCacheError, match="fallback's field"):
        list(small.batches([9], 4, fallback=lambda ids: (torch.zeros(1, 2), torch.tensor([9]))))


# -- from a FeedDataset ----------------------------------------------------------------------------
def head_bytes(sample: dict[str, Any]) -> tuple[torch.Tensor, int, int]:
    """A fixed-shape stand-in for decoding: the JPEG's last 32 bytes, the class label, the id."""
    return torch.frombuffer(bytearray(bytes(sample["jpg"])[-32:]), dtype=torch.uint8), \
        int(bytes(sample["cls"])), sample["__index__"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("capacity_samples", [24, 9])
def test_warmup_from_a_feeddataset_serves_its_epoch(num_workers: int,
                                                    capacity_samples: int) -> None:
    truth = {s["__index__"]: head_bytes(s) for s in FeedDataset(EXAMPLE)}
    cache = DeviceCache(capacity_samples * (32 + 8 + 8), device="cpu")
    ds = FeedDataset(EXAMPLE, shuffle=True, seed=11, rank=1, world_size=2)
    ds.set_epoch(3)
    s = cache.warmup(ds, transform=head_bytes, num_workers=num_workers, batch_size=5,
                     show_progress=False)
    assert s["resident"] == capacity_samples and s["num_samples"] == 24
    want = sample_ids_of(ds).tolist()  # this rank's share of epoch 3
    got = []
    for head, label, index in cache.batches(ds, 5):  # misses: the default DatasetFallback
        for h, lab, i in zip(head, label.tolist(), index.tolist()):
            assert torch.equal(h, truth[i][0]) and lab == truth[i][1]
            got.append(i)
    assert got == want
    st = cache.stats()
    assert st["hits"] + st["misses"] == len(want)
    assert st["misses"] == sum(1 for i in want if i >= capacity_samples)  # manifest-order fill


def decoded_head(sample: dict[str, Any]) -> tuple[torch.Tensor, int, int]:
    """head_bytes over a dataset made with ``decode={"cls": int}`` (the label is an int)."""
    assert isinstance(sample["cls"], int), sample["cls"]
    return torch.frombuffer(bytearray(bytes(sample["jpg"])[-32:]), dtype=torch.uint8), \
        sample["cls"], sample["__index__"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_warmup_and_fallback_see_the_samples_the_dataset_delivers(num_workers: int,
                                                                  tmp_path: Any) -> None:
    """The dataset's decode= and shard cache hold for the warm-up and for the default fallback:
    a transform written for the dataset's samples gets the same samples there."""
    truth = {s["__index__"]: head_bytes(s) for s in FeedDataset(EXAMPLE)}
    cache = DeviceCache(9 * (32 + 8 + 8), device="cpu")  # 9 of 24 resident: the rest falls back
    ds = FeedDataset(EXAMPLE, shuffle=True, seed=2, decode={"cls": int},
                     cache_dir=str(tmp_path / "l1"))
    cache.warmup(ds, transform=decoded_head, num_workers=num_workers, show_progress=False)
    got = []
    for head, label, index in cache.batches(ds, 5):
        for h, lab, i in zip(head, label.tolist(), index.tolist()):
            assert torch.equal(h, truth[i][0]) and lab == truth[i][1]
            got.append(i)
    assert sorted(got) == list(range(24)) and cache.stats()["misses"] == 15
