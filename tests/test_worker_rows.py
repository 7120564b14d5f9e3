"""Batches written in place (feedpipe.row_batches): ImagePipeline.into gives __call__'s pixels;
FeedLoader with a matching BatchCollator takes the in-place path at num_workers=0, with
transform threads and with worker processes, and its batches equal the per-sample path's, in
order; errors name the sample; resumption continues exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import simplejpeg
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe.collator import BatchCollator, _shared_empty
from feedpipe.errors import DecodeError
from feedpipe.row_batches import writes_into
from feedpipe.transforms import ImagePipeline

N = 25  # samples of the ds_path fixture (conftest)
SIZE = 8


class PerSample:
    """An ImagePipeline without ``into``: the per-sample path (tensor per sample, then the
    collator's copy), the reference."""

    def __init__(self, pipeline: ImagePipeline) -> None:
        self.pipeline = pipeline

    def __call__(self, sample: dict[str, Any]) -> Any:
        return self.pipeline(sample)


class OnlyInto(ImagePipeline):
    """An ImagePipeline whose per-sample call fails: a loader that gives batches with it took
    the in-place path for every sample (in worker processes too, where nothing can be counted)."""

    def __call__(self, sample: Any) -> Any:
        raise AssertionError("the per-sample path ran")


def pipeline(cls: type = ImagePipeline, **kw: Any) -> Any:
    kw.setdefault("mean", None)
    return cls(SIZE, **kw)


def run(ds_path: str, transform: Any, *, epoch: int = 1, dtype: torch.dtype = torch.uint8,
        **loader_kw: Any) -> list[Any]:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=transform)
    fl = FeedLoader(ds, batch_size=4, collate_fn=BatchCollator(4, (3, SIZE, SIZE), dtype),
                    **loader_kw)
    fl.set_epoch(epoch)
    out = []
    for b in fl:
        out.append(tuple(t.clone() for t in b) if isinstance(b, tuple) else b.clone())
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, tuple):
            return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))
        return torch.equal(x, y)
    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


def test_into_writes_the_pixels_and_returns_the_label_of_call(ds_path: str) -> None:
    samples = list(FeedDataset(ds_path, shuffle=True, seed=1))
    for kw in ({"train": True, "mean": None}, {"train": False, "mean": None}, {"train": True}):
        p = ImagePipeline(SIZE, **kw)  # type: ignore[arg-type]
        for s in samples[:10]:
            image, label = p(s)
            out = torch.full(p.out_shape, 7, dtype=p.out_dtype)
            assert p.into(s, out) == label
            assert torch.equal(out, image), kw
    bare = ImagePipeline(SIZE, mean=None, label_field=None)
    out = torch.empty(bare.out_shape, dtype=torch.uint8)
    assert bare.into(samples[0], out) is None
    assert torch.equal(out, bare(samples[0]))


def test_into_writes_a_strided_row_and_the_torch_resize_path(ds_path: str) -> None:
    s = next(iter(FeedDataset(ds_path)))
    # a shrinking resize (torch's antialiased path), into a non-contiguous view
    p = ImagePipeline(4, train=False, mean=None)
    big = torch.zeros(3, 4, 8, dtype=torch.uint8)
    view = big[:, :, ::2]
    p.into(s, view)
    assert torch.equal(view, p(s)[0]) and big[:, :, 1::2].eq(0).all()


def test_into_refuses_a_wrong_buffer_and_names_bad_samples(ds_path: str) -> None:
    p = pipeline()
    s = next(iter(FeedDataset(ds_path)))
    with pytest.raises(ValueError, match=r"torch.uint8 tensor of shape \(3, 8, 8\)"):
        p.into(s, torch.empty(3, 9, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        p.into(s, torch.empty(3, SIZE, SIZE, dtype=torch.float32))
    bad = dict(s, jpg=b"\xff\xd8 not a jpeg")
    with pytest.raises(DecodeError, match=repr(s["__key__"])):
        p.into(bad, torch.empty(p.out_shape, dtype=torch.uint8))
    with pytest.raises(DecodeError, match="no 'cls' field"):
        p.into({k: v for k, v in s.items() if k != "cls"}, torch.empty(p.out_shape,
                                                                       dtype=torch.uint8))


def test_writes_into_needs_a_matching_collator() -> None:
    p = pipeline()
    assert writes_into(p, BatchCollator(4, (3, SIZE, SIZE)))
    assert not writes_into(p, BatchCollator(4, (3, SIZE + 1, SIZE)))
    assert not writes_into(p, BatchCollator(4, (3, SIZE, SIZE), torch.float32))
    assert writes_into(ImagePipeline(SIZE), BatchCollator(4, (3, SIZE, SIZE), torch.float32))
    assert not writes_into(PerSample(p), BatchCollator(4, (3, SIZE, SIZE)))
    assert not writes_into(p, None)


@pytest.mark.parametrize("how", [{"num_workers": 0}, {"transform_threads": 2},
                                 {"num_workers": 2}, {"num_workers": 2, "device": "cpu"}])
def test_in_place_batches_equal_the_per_sample_path(ds_path: str, how: dict[str, int]) -> None:
    want = run(ds_path, PerSample(pipeline()))
    assert len(want) == 7 and sum(len(b[1]) for b in want) == N
    assert same(run(ds_path, pipeline(OnlyInto), **how), want)
    assert not same(run(ds_path, pipeline(OnlyInto), epoch=2, **how), want)
    assert same(run(ds_path, pipeline(OnlyInto), epoch=2, **how),
                run(ds_path, PerSample(pipeline()), epoch=2))


@pytest.mark.parametrize("how", [{"num_workers": 0}, {"num_workers": 2}])
def test_normalised_and_bare_images_in_place(ds_path: str, how: dict[str, int]) -> None:
    want = run(ds_path, PerSample(pipeline(mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2))),
               dtype=torch.float32)
    got = run(ds_path, pipeline(OnlyInto, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2)),
              dtype=torch.float32, **how)
    assert same(got, want) and want[0][0].dtype == torch.float32
    bare = run(ds_path, pipeline(OnlyInto, label_field=None), **how)
    assert len(bare) == 7 and all(isinstance(b, torch.Tensor) for b in bare)
    assert same(bare, [b[0] for b in run(ds_path, PerSample(pipeline()))])


def test_a_mismatched_collator_takes_the_per_sample_path(ds_path: str) -> None:
    # a float32 collator for uint8 images: the collator's copy converts, as before
    got = run(ds_path, pipeline(), dtype=torch.float32, num_workers=0)
    want = run(ds_path, PerSample(pipeline()))
    assert same([(x.to(torch.uint8), y) for x, y in got], want)


def _broken(ds_path: str) -> tuple[FeedDataset, str]:
    keys = [k for b in FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
            for k in b["__key__"]]
    bad = keys[9]  # in the third batch

    class Broken(ImagePipeline):
        def into(self, sample: Any, out: torch.Tensor) -> Any:
            if sample["__key__"] == bad:
                sample = dict(sample, jpg=b"\xff\xd8 truncated")
            return super().into(sample, out)

    return FeedDataset(ds_path, shuffle=True, seed=3, transform=Broken(SIZE, mean=None)), bad


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_sample_stops_the_epoch_naming_it(ds_path: str, workers: int) -> None:
    ds, bad = _broken(ds_path)
    fl = FeedLoader(ds, batch_size=4, num_workers=workers,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    with pytest.raises(DecodeError, match=repr(bad)):
        for _ in fl:
            pass


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_in_place_continues_exactly(ds_path: str, workers: int) -> None:
    want = run(ds_path, PerSample(pipeline()))

    def loader() -> FeedLoader:
        ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
        return FeedLoader(ds, batch_size=4, num_workers=workers,
                          collate_fn=BatchCollator(4, (3, SIZE, SIZE)))

    fl = loader()
    fl.set_epoch(1)
    it = iter(fl)
    first = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    state = fl.state_dict()
    del it
    assert state["position"] == 12
    fl2 = loader()
    fl2.load_state_dict(state)
    fl2.set_epoch(1)
    rest = [tuple(t.clone() for t in b) for b in fl2]
    assert same(first + rest, want)


def test_in_place_batches_reuse_the_collators_ring(ds_path: str) -> None:
    c = BatchCollator(4, (3, SIZE, SIZE))
    fl = FeedLoader(FeedDataset(ds_path, transform=pipeline(OnlyInto)), batch_size=4,
                    collate_fn=c)
    for _ in fl:
        pass  # each batch dropped before the next: the ring's buffers come round again
    assert c.stats()["batches"] == 7 and c.stats()["reused"] >= 5


def test_worker_buffers_are_allocated_in_shared_memory() -> None:
    x = _shared_empty((2, 3, 4), torch.uint8)
    assert x.is_shared() and tuple(x.shape) == (2, 3, 4) and x.is_contiguous()
    x.fill_(5)
    assert int(x.sum()) == 5 * 24
    y = _shared_empty((3,), torch.int64)
    assert y.is_shared() and y.dtype == torch.int64


def test_labels_of_a_dtype_numpy_lacks(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    fl = FeedLoader(ds, batch_size=4, collate_fn=BatchCollator(4, (3, SIZE, SIZE),
                                                               label_dtype=torch.bfloat16))
    fl.set_epoch(1)
    got = [b[1].clone() for b in fl]
    want = [b[1] for b in run(ds_path, PerSample(pipeline()))]
    assert all(torch.equal(g, w.to(torch.bfloat16)) for g, w in zip(got, want))


def _rows(batch: Any) -> Any:
    return tuple(t.clone() for t in batch)


def test_worker_buffers_come_back_and_held_batches_stay_intact(ds_path: str) -> None:
    # Worker processes reuse their shared-memory buffers once this process lets go of a batch
    # (row_batches.WorkerRing / RowBatches): batches the loop keeps, whole or as views, are never
    # overwritten, an epoch stopped early leaves nothing wrong behind, and dropped ones come back.
    want = {e: run(ds_path, PerSample(pipeline()), epoch=e) for e in (1, 2, 3, 4, 5)}
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    fl = FeedLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, prefetch_factor=1,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    rows = fl._rows
    assert rows is not None

    def epoch(e: int) -> Any:
        fl.set_epoch(e)
        return iter(fl)

    assert same([_rows(b) for b in epoch(1)], want[1])  # each batch dropped: buffers return
    first = rows.stats()
    assert first["batches"] == 7 and first["released"] >= 5
    kept = list(epoch(2))  # every batch kept as it came, no copy
    assert same(kept, want[2])
    assert rows.stats()["released"] - first["released"] <= 1  # only epoch 1's last batch
    views = [(x[1:3], y[:2]) for x, y in epoch(3)]  # only views kept
    want_views = [(x[1:3], y[:2]) for x, y in want[3]]
    assert same(kept, want[2]) and same(views, want_views)
    del kept, views
    # only Python storage objects kept (no tensor of them): still never overwritten
    storages = [x.untyped_storage() for x, _ in epoch(6)]
    assert same([_rows(b) for b in epoch(7)], run(ds_path, PerSample(pipeline()), epoch=7))
    want6 = [x.numpy().tobytes() for x, _ in run(ds_path, PerSample(pipeline()), epoch=6)]
    assert [bytes(st)[:len(w)] for st, w in zip(storages, want6)] == want6
    del storages
    it = epoch(4)
    next(it)  # an epoch stopped after one batch
    del it
    before = rows.stats()
    assert same([_rows(b) for b in epoch(5)], want[5])
    after = rows.stats()
    assert after["batches"] - before["batches"] == 7 and after["reused"] > before["reused"]


def test_a_worker_ring_reuses_only_buffers_handed_back() -> None:
    from feedpipe.row_batches import WorkerRing

    ring = WorkerRing(BatchCollator(2, (3, 2, 2)), depth=2)
    released = ring.table[1].numpy()

    holders = []  # the batches' holders, so that no freed buffer's address comes back

    def take() -> tuple[int, Any]:
        images, _ = ring.buffer(2)
        holders.append(images)
        return images.data_ptr(), ring.ticket()

    a, ta = take()
    b, tb = take()
    assert ta.table is ring.table and tb.table is None  # the table goes with the first batch
    assert a != b and not ta.reused and not tb.reused
    c, tc = take()  # none handed back: a new buffer in slot 0, a's left to its holder
    assert c not in (a, b) and tc.slot == ta.slot == 0 and tc.token != ta.token
    released[ta.slot] = ta.token  # a late release of a's batch frees nothing of c's
    d, td = take()
    assert d not in (a, b, c) and td.slot == 1
    released[tc.slot] = tc.token
    e, te = take()
    assert e == c and te.reused and te.slot == tc.slot
    with pytest.raises(ValueError, match="3 rows"):
        ring.buffer(3)


def test_the_training_side_hands_back_only_batches_nothing_holds() -> None:
    from feedpipe.row_batches import RowBatches, Ticket

    table = _shared_empty((2, 4), torch.int64).zero_()  # a worker ring's: issued, released
    released = table[1].numpy()

    def received() -> Any:
        # as the DataLoader hands batches over: each rebuilt from shared memory, the last one
        # copied out of it on the way (pin_memory), so not held in shared memory here
        for slot in range(4):
            token = 10 + slot
            table[0, slot] = token
            if slot < 3:
                batch = (_shared_empty((2, 3, 2, 2), torch.uint8),
                         _shared_empty((2,), torch.int64))
            else:
                batch = (torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.zeros(2))
            yield batch, Ticket(7, slot, token, slot == 1, table if slot == 0 else None)
            del batch

    rb = RowBatches(received())
    it = iter(rb)
    x0 = next(it)
    assert released.tolist() == [0, 0, 0, 0]
    del x0  # the loop lets go of batch 0
    held = next(it)  # keeps batch 1 whole
    assert released.tolist() == [10, 0, 0, 0]
    x2 = next(it)[0][1:]  # and a view of batch 2
    x3 = next(it)
    assert released.tolist() == [10, 0, 0, 13]  # the copy at once; 1 and 2 still held
    del held, x2, x3
    assert list(it) == [] and released.tolist() == [10, 11, 12, 13]
    assert rb.stats() == {"batches": 4, "reused": 1, "released": 4}


def test_a_dropped_batch_is_handed_back_before_the_next_is_fetched() -> None:
    # The DataLoader gives a worker its next task as it receives that worker's last batch; the
    # buffer of a batch the loop has moved on from must be back before then (when the loop asks
    # for the next batch), else the worker finds it busy and takes another buffer.
    from feedpipe.row_batches import RowBatches, Ticket

    table = _shared_empty((2, 4), torch.int64).zero_()
    released = table[1].numpy()
    seen = []

    def received() -> Any:
        for slot in range(4):
            seen.append(released.tolist())  # what a worker given a task now would find
            table[0, slot] = 10 + slot
            batch = (_shared_empty((2, 3, 2, 2), torch.uint8), _shared_empty((2,), torch.int64))
            yield batch, Ticket(7, slot, 10 + slot, False, table if slot == 0 else None)
            del batch

    for _ in RowBatches(received()):  # the loop holds each batch until it asks for the next
        pass
    assert seen == [[0, 0, 0, 0], [0, 0, 0, 0], [10, 0, 0, 0], [10, 11, 0, 0]]
    assert released.tolist() == [10, 11, 12, 0]  # the last one is still the loop's variable


def test_in_place_workers_keep_one_batch_in_flight_unless_told(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    for kw, want in (({}, 1), ({"prefetch_factor": 3}, 3)):
        fl = FeedLoader(ds, batch_size=4, num_workers=2,
                        collate_fn=BatchCollator(4, (3, SIZE, SIZE)), **kw)
        assert fl._rows is not None and fl._loader.prefetch_factor == want
    # the per-sample path keeps the DataLoader's default
    assert FeedLoader(ds, batch_size=4, num_workers=2)._loader.prefetch_factor == 2


def test_worker_buffers_come_back_to_spawned_workers(ds_path: str) -> None:
    # with workers started by spawn (as after CUDA: forkserver), the dataset and each worker's
    # table travel pickled; the batches are the same and buffers still come back
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    fl = FeedLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn",
                    persistent_workers=True, collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    for e in (1, 2):
        fl.set_epoch(e)
        assert same([_rows(b) for b in fl], run(ds_path, PerSample(pipeline()), epoch=e))
    assert fl._rows is not None and fl._rows.stats()["reused"] > 0


def test_buffer_reuse_can_be_turned_off(ds_path: str) -> None:
    # reuse_buffers=False (batches handed on to another process): every batch a fresh buffer
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    fl = FeedLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                    reuse_buffers=False, collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    for e in (1, 2):
        fl.set_epoch(e)
        batches = list(fl)  # kept whole: with reuse on, these would be the same buffers
        assert same(batches, run(ds_path, PerSample(pipeline()), epoch=e))
        ptrs = {b[0].untyped_storage().data_ptr() for b in batches}
        assert len(ptrs) == len(batches)
        del batches
    assert fl._rows is not None and fl._rows.stats() == {"batches": 0, "reused": 0,
                                                         "released": 0}


def test_shard_pages_are_dropped_while_a_batch_is_decoded(ds_path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # every DROP_ROWS rows and after each batch (the batch's samples are all fetched before any
    # is decoded, too late for the maps' own accounting); the batches are the same
    from feedpipe import row_batches

    monkeypatch.setattr(row_batches, "DROP_ROWS", 2)
    calls = []
    real = FeedDataset._drop_pages
    monkeypatch.setattr(FeedDataset, "_drop_pages", lambda self: calls.append(1) or real(self))
    got = run(ds_path, pipeline(OnlyInto), num_workers=0)
    assert same(got, run(ds_path, PerSample(pipeline())))
    # batches of 4 (the last of 1): a drop at rows 2 and at the end of each full batch
    full = sum(len(b[1]) == 4 for b in got)
    assert len(calls) == 2 * full + 1
