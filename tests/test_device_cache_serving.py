"""DeviceCache's batch serving: batched on-device gathers give exactly the per-sample result,
with one gather kernel per batch and nothing that waits for the device.

Runs on the CPU (``device="cpu"``); the ``cuda`` parametrisation runs where a CUDA device exists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from feedpipe import DeviceCache
from feedpipe.plan._order import Plan

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])]
N = 37


def _field(spec: tuple[tuple[int, ...], torch.dtype], i: int, k: int) -> torch.Tensor:
    """Sample ``i``'s field ``k``: distinct, deterministic values of the field's dtype."""
    shape, dtype = spec
    g = torch.Generator().manual_seed(1000 * i + k)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    hi = 256 if dtype == torch.uint8 else 30000
    return torch.randint(0, hi, shape, generator=g).to(dtype)


# Field layouts: row sizes that widen to int64 (96, 192 bytes), to int32 (12), that do not widen
# (105, 6 bytes), 0-d labels, bool and float fields, small and large fields together.
LAYOUTS: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {
    "image-label": [((3, 8, 8), torch.uint8), ((), torch.int64)],
    "odd-rows": [((3, 5, 7), torch.uint8), ((3,), torch.int16), ((), torch.bool)],
    "floats": [((4, 6), torch.float32), ((2,), torch.float64), ((3,), torch.int32),
               ((5, 4, 2), torch.uint8)],
}


def _samples(layout: str, as_dict: bool) -> list[Any]:
    specs = LAYOUTS[layout]
    out: list[Any] = []
    for i in range(N):
        fields = [_field(s, i, k) for k, s in enumerate(specs)]
        out.append({f"f{k}": t for k, t in enumerate(fields)} if as_dict else tuple(fields))
    return out


def _per_sample(samples: list[Any], ids: list[int], as_dict: bool) -> list[torch.Tensor]:
    """The reference: each sample's field taken on its own and stacked."""
    first = samples[0]
    keys = list(first) if as_dict else range(len(first))
    return [torch.stack([samples[i][k] for i in ids]) for k in keys]


def _fields_of(batch: Any, as_dict: bool) -> list[torch.Tensor]:
    if as_dict:
        assert isinstance(batch, dict)
        return list(batch.values())
    assert isinstance(batch, tuple)
    return list(batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_batched_gather_equals_the_per_sample_result(layout: str, as_dict: bool,
                                                     device: str) -> None:
    samples = _samples(layout, as_dict)
    cache = DeviceCache(1 << 20, device=device)
    cache.warmup([(i, s) if as_dict else (i, *s) for i, s in enumerate(samples)],
                 num_samples=N)
    assert cache.resident == N
    plan_ids = Plan((20, 17), seed=4, epoch=1).sample_ids(np.arange(N)).tolist()
    orders = [plan_ids, list(range(N))[::-1], [5, 5, 0, 36, 5]]  # repeats too (padding)
    for order in orders:
        for bs in (1, 3, 8, N + 4):
            got = list(cache.batches(order, bs))
            assert len(got) == -(-len(order) // bs)
            for b, batch in enumerate(got):
                ids = order[b * bs:(b + 1) * bs]
                want = _per_sample(samples, ids, as_dict)
                have = _fields_of(batch, as_dict)
                if as_dict:
                    assert list(batch) == list(samples[0])
                assert len(have) == len(want)
                for h, w in zip(have, want):
                    assert h.device.type == device and h.is_contiguous()
                    assert h.dtype == w.dtype and h.shape == w.shape
                    assert torch.equal(h.cpu(), w)
    assert cache.stats()["hits"] == sum(len(o) for o in orders) * 4
    assert list(cache.batches([], 4)) == []  # an empty epoch (a rank with no share): no batch


def test_served_batches_are_copies_owned_by_the_caller() -> None:
    """Writing into a served batch changes neither the cache nor any other batch."""
    samples = _samples("image-label", as_dict=False)
    cache = DeviceCache(1 << 20, device="cpu")
    cache.warmup([(i, *s) for i, s in enumerate(samples)], num_samples=N)
    order = list(range(N))
    first = list(cache.batches(order, 4))
    for img, lbl in first:
        img.fill_(0)
        lbl.fill_(-1)
    again = list(cache.batches(order, 4))
    for b, (img, lbl) in enumerate(again):
        ids = order[b * 4:(b + 1) * 4]
        assert torch.equal(img, torch.stack([samples[i][0] for i in ids]))
        assert torch.equal(lbl, torch.stack([samples[i][1] for i in ids]))
    assert all(int(lbl.min()) == -1 for _, lbl in first)  # the first pass's batches kept theirs


class _Ops(TorchDispatchMode):
    """Records every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# ops that make the host wait for the device (a value read back, a data-dependent size)
_SYNCING = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero",
            "aten.equal", "aten.unique", "aten.masked_select"}


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_a_resident_epoch_runs_one_gather_per_batch(as_dict: bool) -> None:
    """Each batch of a resident epoch is one gather (the image); a label is gathered once for the
    whole epoch and sliced; nothing reads a value back from the device."""
    samples = _samples("image-label", as_dict)
    cache = DeviceCache(1 << 20, device="cpu")
    cache.warmup([(i, s) if as_dict else (i, *s) for i, s in enumerate(samples)],
                 num_samples=N)
    order = Plan((N,), seed=0, epoch=0).sample_ids(np.arange(N))
    bs = 5
    it = cache.batches(order, bs)
    with _Ops() as rec:
        batches = list(it)
    nb = -(-N // bs)
    assert len(batches) == nb
    gathers = [op for op in rec.ops if op in ("aten.index_select", "aten.index", "aten.take",
                                              "aten.gather")]
    assert len(gathers) == nb + 1  # one per batch, plus the small field's epoch gather
    assert not _SYNCING.intersection(rec.ops)
