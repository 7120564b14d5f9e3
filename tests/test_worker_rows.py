"""Batches written in place (the ``rows``, ``rows-threads`` and ``rows-workers`` routes;
feedpipe.worker_rows, batch_loop.RowMaker): ImagePipeline.into gives __call__'s pixels;
FeedLoader with a matching BatchCollator takes an in-place route at num_workers=0, with transform
threads and with worker processes, and its batches equal the per-sample route's, in order; errors
name the sample; resumption continues exactly; worker buffers are reused only once nothing in the
training process holds their batch."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from feedpipe import FeedDataset, FeedLoader
from feedpipe.errors import DecodeError
from feedpipe.stream import _batch_loop as batch_loop
from feedpipe.stream._collator import BatchCollator, shared_empty, storage_refs
from feedpipe.stream._routes import ROUTES
from feedpipe.stream._shard_set import ShardSet
from feedpipe.stream._worker_rows import RowRelease, Ticket, WorkerRing, writes_into
from feedpipe.stream._worker_source import WorkerBatches, WorkerMeta, as_is, ring_depth
from feedpipe.transforms._pipeline import ImagePipeline

N = 25  # samples of the ds_path fixture (conftest)
SIZE = 8


class PerSample:
    """An ImagePipeline without ``into``: the per-sample route (tensor per sample, then the
    collator's copy), the reference."""

    def __init__(self, pipeline: ImagePipeline) -> None:
        self.pipeline = pipeline

    def __call__(self, sample: dict[str, Any]) -> Any:
        return self.pipeline(sample)


class OnlyInto(ImagePipeline):
    """An ImagePipeline whose per-sample call fails: a loader that gives batches with it wrote
    every sample in place (in worker processes too, where nothing can be counted)."""

    def __call__(self, sample: Any) -> Any:
        raise AssertionError("the per-sample path ran")


def pipeline(cls: type = ImagePipeline, **kw: Any) -> Any:
    kw.setdefault("mean", None)
    return cls(SIZE, **kw)


def loader(ds_path: str, transform: Any, *, dtype: torch.dtype = torch.uint8,
           **loader_kw: Any) -> FeedLoader:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=transform)
    return FeedLoader(ds, batch_size=4, collate_fn=BatchCollator(4, (3, SIZE, SIZE), dtype),
                      **loader_kw)


def run(ds_path: str, transform: Any, *, epoch: int = 1, dtype: torch.dtype = torch.uint8,
        **loader_kw: Any) -> list[Any]:
    fl = loader(ds_path, transform, dtype=dtype, **loader_kw)
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


@pytest.mark.parametrize("how,route", [({"num_workers": 0}, "rows"),
                                       ({"transform_threads": 2}, "rows-threads"),
                                       ({"num_workers": 2}, "rows-workers"),
                                       ({"num_workers": 2, "device": "cpu"}, "rows-workers")])
def test_in_place_batches_equal_the_per_sample_path(ds_path: str, how: dict[str, Any],
                                                    route: str) -> None:
    fl = loader(ds_path, pipeline(OnlyInto), **how)
    assert fl.route.name == route and fl.route.compute == "into" and fl.route.sink == "rows"
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


def test_a_mismatched_collator_takes_the_per_sample_route(ds_path: str) -> None:
    # a float32 collator for uint8 images: the collator's copy converts
    assert loader(ds_path, pipeline(), dtype=torch.float32).route.name == "samples"
    with pytest.raises(ValueError, match="does not write into the collator's rows"):
        loader(ds_path, pipeline(), dtype=torch.float32, route="rows")
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


@pytest.mark.parametrize("workers,route", [(0, "rows"), (2, "rows-workers")])
def test_a_bad_sample_stops_the_epoch_naming_it(ds_path: str, workers: int, route: str) -> None:
    ds, bad = _broken(ds_path)
    fl = FeedLoader(ds, batch_size=4, num_workers=workers,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    assert fl.route.name == route
    got = 0
    with pytest.raises(DecodeError, match=repr(bad)):
        for _ in fl:
            got += 1
    assert got == 2  # the batches before the failing one were delivered


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_in_place_continues_exactly(ds_path: str, workers: int) -> None:
    want = run(ds_path, PerSample(pipeline()))

    def make() -> FeedLoader:
        return loader(ds_path, pipeline(OnlyInto), num_workers=workers)

    fl = make()
    fl.set_epoch(1)
    it = iter(fl)
    first = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    state = fl.state_dict()
    del it
    assert state["position"] == 12
    fl2 = make()
    fl2.load_state_dict(state)
    fl2.set_epoch(1)
    rest = [tuple(t.clone() for t in b) for b in fl2]
    assert same(first + rest, want)


def test_in_place_batches_reuse_the_collators_ring(ds_path: str) -> None:
    c = BatchCollator(4, (3, SIZE, SIZE))
    fl = FeedLoader(FeedDataset(ds_path, transform=pipeline(OnlyInto)), batch_size=4,
                    collate_fn=c)
    assert fl.route.name == "rows"
    for _ in fl:
        pass  # each batch dropped before the next: the ring's buffers come round again
    assert c.stats()["batches"] == 7 and c.stats()["reused"] >= 5


def test_worker_buffers_are_allocated_in_shared_memory() -> None:
    x = shared_empty((2, 3, 4), torch.uint8)
    assert x.is_shared() and tuple(x.shape) == (2, 3, 4) and x.is_contiguous()
    x.fill_(5)
    assert int(x.sum()) == 5 * 24
    y = shared_empty((3,), torch.int64)
    assert y.is_shared() and y.dtype == torch.int64


@pytest.mark.parametrize("workers", [0, 2])
def test_labels_of_a_dtype_numpy_lacks(ds_path: str, workers: int) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    fl = FeedLoader(ds, batch_size=4, num_workers=workers,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE), label_dtype=torch.bfloat16))
    fl.set_epoch(1)
    got = [b[1].clone() for b in fl]
    want = [b[1] for b in run(ds_path, PerSample(pipeline()))]
    assert len(got) == len(want) == 7
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16))
               for g, w in zip(got, want))


def _rows(batch: Any) -> Any:
    return tuple(t.clone() for t in batch)


def test_worker_buffers_come_back_and_held_batches_stay_intact(ds_path: str) -> None:
    # Worker processes reuse their shared-memory buffers once this process lets go of a batch
    # (WorkerRing / RowRelease): batches the loop keeps, whole or as views, are never
    # overwritten, an epoch stopped early leaves nothing wrong behind, and dropped ones come back.
    want = {e: run(ds_path, PerSample(pipeline()), epoch=e) for e in (1, 2, 3, 4, 5)}
    ds = FeedDataset(ds_path, shuffle=True, seed=3, transform=pipeline(OnlyInto))
    fl = FeedLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, prefetch_factor=1,
                    collate_fn=BatchCollator(4, (3, SIZE, SIZE)))
    assert fl.route.name == "rows-workers"

    def epoch(e: int) -> Any:
        fl.set_epoch(e)
        return iter(fl)

    def buffers() -> dict[str, int]:
        return dict(fl.stats()["buffers"])  # counted over the loader's life

    assert same([_rows(b) for b in epoch(1)], want[1])  # each batch dropped: buffers return
    first = buffers()
    assert first["batches"] == 7 and first["released"] >= 5
    kept = list(epoch(2))  # every batch kept as it came, no copy
    assert same(kept, want[2])
    second = buffers()
    assert second["batches"] == 14
    # a batch the loop holds is never handed back: the only releases since epoch 1 are of its
    # own batches, the last of which the loop let go of after that epoch ended
    assert second["released"] <= first["batches"]
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
    before = buffers()
    assert same([_rows(b) for b in epoch(5)], want[5])
    last = buffers()
    assert last["batches"] - before["batches"] == 7
    assert last["reused"] > before["reused"] and last["released"] - before["released"] >= 5


def _table() -> tuple[torch.Tensor, Any]:
    table = shared_empty((2, 4), torch.int64).zero_()  # a worker ring's: issued, released
    return table, table[1].numpy()


def _shared_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return shared_empty((2, 3, 2, 2), torch.uint8), shared_empty((2,), torch.int64)


def test_a_worker_ring_reuses_only_buffers_handed_back() -> None:
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
    small, _ = ring.buffer(1)  # a short last batch: the first rows of a buffer
    assert tuple(small.shape) == (1, 3, 2, 2)
    with pytest.raises(ValueError, match="3 rows"):
        ring.buffer(3)
    ring.send_table = True  # a new epoch: the table goes again with its first batch
    ring.buffer(2)
    assert ring.ticket().table is ring.table and ring.ticket().table is None


def test_the_training_side_hands_back_only_batches_nothing_holds() -> None:
    table, released = _table()
    rel = RowRelease(persistent=True)

    def arrive(slot: int) -> Any:
        # as the DataLoader hands batches over: each rebuilt from shared memory, the last one
        # copied out of it on the way (pin_memory), so not held in shared memory here
        token = 10 + slot
        table[0, slot] = token
        if slot < 3:
            batch: Any = _shared_batch()
        else:
            batch = (torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.zeros(2))
        rel.receive(batch, Ticket(7, slot, token, slot == 1, table if slot == 0 else None))
        return batch

    x0 = arrive(0)
    rel.poll()
    assert released.tolist() == [0, 0, 0, 0]  # the loop holds it
    del x0  # the loop lets go of batch 0
    rel.poll()  # as the loop asks for the next batch
    assert released.tolist() == [10, 0, 0, 0]
    held = arrive(1)  # keeps batch 1 whole
    x2 = arrive(2)[0][1:]  # and a view of batch 2
    x3 = arrive(3)
    assert released.tolist() == [10, 0, 0, 13]  # the copy at once; 1 and 2 still held
    rel.poll()
    assert released.tolist() == [10, 0, 0, 13]
    del held, x2, x3
    rel.close()  # persistent workers: what nothing holds goes back to them
    assert released.tolist() == [10, 11, 12, 13]
    assert rel.stats() == {"batches": 4, "reused": 1, "released": 4}


def test_a_batch_from_a_worker_whose_table_never_came_is_left_alone() -> None:
    _, released = _table()
    rel = RowRelease(persistent=True)
    lone = storage_refs(torch.empty(1))
    batch = _shared_batch()
    rel.receive(batch, Ticket(7, 0, 10, False, None))  # no table for key 7 yet
    assert storage_refs(batch[0]) == lone  # not held here
    del batch
    rel.close()
    assert released.tolist() == [0, 0, 0, 0] and rel.stats()["released"] == 0
    rel.receive(torch.zeros(2), None)  # a batch without a ticket (no ring): nothing to do
    assert rel.stats()["batches"] == 1


def test_an_epoch_of_workers_that_end_with_it_lets_go_of_its_batches() -> None:
    # non-persistent workers are gone with the epoch: close() hands nothing back (nobody
    # would reuse it) and keeps no hold on batches the loop still has
    table, released = _table()
    lone = storage_refs(torch.empty(1))
    for persistent in (False, True):
        rel = RowRelease(persistent=persistent)
        table[0, 0] = 10
        batch = _shared_batch()
        rel.receive(batch, Ticket(7, 0, 10, False, table))
        assert storage_refs(batch[0]) > lone  # held while the epoch runs
        rel.close()
        if persistent:
            assert storage_refs(batch[0]) > lone  # kept, to hand back once let go
            del batch
            rel.poll()
            assert released.tolist() == [10, 0, 0, 0]
        else:
            assert storage_refs(batch[0]) == lone and storage_refs(batch[1]) == lone
            del batch
            rel.poll()
            assert released.tolist() == [0, 0, 0, 0] and rel.stats()["released"] == 0


class _Arrivals(IterableDataset):
    """Four (batch, meta) pairs as worker processes send them, noting the released words each
    time the next is asked for (what a worker given its next task would find)."""

    def __init__(self, table: torch.Tensor, seen: list[list[int]]) -> None:
        super().__init__()
        self.table, self.seen = table, seen

    def __iter__(self) -> Any:
        table = self.table
        for slot in range(4):
            self.seen.append(table[1].tolist())
            table[0, slot] = 10 + slot
            batch = _shared_batch()
            yield batch, WorkerMeta(os.getpid(), 0, Ticket(7, slot, 10 + slot, False,
                                                           table if slot == 0 else None))
            del batch


def test_a_dropped_batch_is_handed_back_before_the_next_is_fetched() -> None:
    # The DataLoader gives a worker its next task as it receives that worker's last batch; the
    # buffer of a batch the loop has moved on from must be back before then (when the loop asks
    # for the next batch), else the worker finds it busy and takes another buffer.
    table, released = _table()
    seen: list[list[int]] = []
    source = DataLoader(_Arrivals(table, seen), batch_size=None, collate_fn=as_is)
    stats: dict[str, Any] = {}
    for _ in WorkerBatches(source, ROUTES["rows-workers"], stats,
                           release=RowRelease(persistent=True)):
        pass  # the loop holds each batch until it asks for the next
    assert seen == [[0, 0, 0, 0], [0, 0, 0, 0], [10, 0, 0, 0], [10, 11, 0, 0]]
    assert released.tolist() == [10, 11, 12, 0]  # the last one is still the loop's variable
    assert stats["worker_pids"] == {os.getpid()}


def test_in_place_workers_keep_one_batch_in_flight_unless_told(ds_path: str) -> None:
    for transform, kw, route, want in (
            (pipeline(OnlyInto), {}, "rows-workers", 1),
            (pipeline(OnlyInto), {"prefetch_factor": 3}, "rows-workers", 3),
            (PerSample(pipeline()), {}, "samples-workers", 2)):  # the DataLoader's default
        fl = loader(ds_path, transform, num_workers=2, **kw)
        assert fl.route.name == route
        it = iter(fl)
        next(it)  # the DataLoader is made as the first pass starts
        it.close()
        assert fl.stats()["prefetch_factor"] == want, (route, kw)
    # a worker's ring holds the batches in flight, one the loop holds, one not yet seen
    # released and a spare
    assert ring_depth(1) == 4 and ring_depth(3) == 6 and ring_depth(None) == 5


def test_worker_buffers_come_back_to_spawned_workers(ds_path: str) -> None:
    # with workers started by spawn (as a user may ask, or must beside DALI), the dataset and
    # each worker's table travel pickled; the batches are the same and buffers still come back
    fl = loader(ds_path, pipeline(OnlyInto), num_workers=2, multiprocessing_context="spawn",
                persistent_workers=True)
    for e in (1, 2):
        fl.set_epoch(e)
        assert same([_rows(b) for b in fl], run(ds_path, PerSample(pipeline()), epoch=e))
        assert fl.stats()["route"] == "rows-workers" and len(fl.stats()["worker_pids"]) == 2
    buffers = fl.stats()["buffers"]
    assert buffers["batches"] == 14 and buffers["reused"] > 0


def _keep(inbox: Any, outbox: Any) -> None:
    """Another process that keeps the batches it is handed (no copy) and, at the end, says what
    they hold."""
    kept = []
    while (batch := inbox.get()) is not None:
        kept.append(batch)
        outbox.put(len(kept))  # received: the sender may let go of it
    outbox.put([hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
                for x, y in kept])


def test_buffer_reuse_can_be_turned_off(ds_path: str) -> None:
    # reuse_buffers=False: batches handed on to another process without a copy, and dropped
    # here, are never overwritten by a worker
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    keeper = ctx.Process(target=_keep, args=(inbox, outbox))
    keeper.start()
    try:
        fl = loader(ds_path, pipeline(OnlyInto), num_workers=2, persistent_workers=True,
                    reuse_buffers=False)
        assert fl.route.name == "rows-workers"
        want: list[str] = []
        for e in (1, 2):
            fl.set_epoch(e)
            for x, y in fl:
                want.append(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes())
                            .hexdigest())
                inbox.put((x, y))
                assert outbox.get(timeout=60) == len(want)
                del x, y  # only the other process has it now
        inbox.put(None)
        got = outbox.get(timeout=60)
    finally:
        keeper.join(timeout=60)
        if keeper.is_alive():
            keeper.kill()
    assert len(want) == 14 and got == want
    assert "buffers" not in fl.stats()  # nothing here hands a buffer back


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_pages_are_dropped_while_a_batch_is_decoded(ds_path: str, workers: int, tmp_path,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # every DROP_ROWS rows and after each batch (the batch's samples are all fetched before any
    # is decoded, too late for the maps' own accounting); the batches are the same
    monkeypatch.setattr(batch_loop, "DROP_ROWS", 2)
    calls = tmp_path / "drops"
    calls.write_text("")
    real = ShardSet.drop_pages

    def counted(self: ShardSet) -> None:
        with open(calls, "a") as f:  # O_APPEND: one line per drop, from any process
            f.write("1\n")
        real(self)

    monkeypatch.setattr(ShardSet, "drop_pages", counted)  # forked workers inherit it
    got = run(ds_path, pipeline(OnlyInto), num_workers=workers)
    assert same(got, run(ds_path, PerSample(pipeline())))
    # batches of 4 (the last of 1): a drop at row 2 and at the end of each full batch
    full = sum(len(b[1]) == 4 for b in got)
    assert full == 6 and len(calls.read_text().split()) == 2 * full + 1
