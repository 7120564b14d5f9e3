"""FeedLoader behaves as the DataLoader users know (issue 20): len is the whole epoch, a new pass
after a complete epoch is the next epoch, drop_last drops the short batch, fields decode."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from feedpipe import FeedDataset, FeedLoader

N = 25  # ds_path: 25 samples in shards of 7


def ids(batches: list) -> list[int]:
    return [i for b in batches for i in b["__index__"].tolist()]


def test_len_is_the_whole_epoch_also_after_a_restore(ds_path: str) -> None:
    ld = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4)
    assert len(ld) == 7
    it = iter(ld)
    seen = [next(it) for _ in range(3)]
    state = ld.state_dict()
    again = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4)
    again.load_state_dict(state)
    assert len(again) == 7  # as StatefulDataLoader: the epoch's length, not what is left
    rest = list(again)
    assert len(rest) == 4
    assert sorted(ids(seen) + ids(rest)) == list(range(N))


def test_a_new_pass_after_a_complete_epoch_is_the_next_epoch(ds_path: str) -> None:
    ld = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
    orders = []
    for _ in range(3):
        orders.append(ids(list(ld)))
        assert sorted(orders[-1]) == list(range(N))
    assert len({tuple(o) for o in orders}) == 3
    assert ld.epoch == 2
    ref = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
    ref.set_epoch(1)
    assert ids(list(ref)) == orders[1]  # the advance is set_epoch(e + 1)


def test_an_unfinished_pass_restarts_its_epoch(ds_path: str) -> None:
    ld = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
    first = next(iter(ld))
    assert ld.epoch == 0
    full = ids(list(ld))
    assert full[:4] == first["__index__"].tolist() and ld.epoch == 0


def test_set_epoch_chooses_and_a_restore_keeps_its_epoch(ds_path: str) -> None:
    ld = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
    list(ld)
    ld.set_epoch(7)
    e7 = ids(list(ld))
    ld2 = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
    ld2.set_epoch(7)
    it = iter(ld2)
    head = ids([next(it), next(it)])
    state = ld2.state_dict()
    assert state["epoch"] == 7
    ld3 = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4)
    ld3.load_state_dict(state)
    assert head + ids(list(ld3)) == e7
    assert ld3.epoch == 7
    list(ld3)  # the pass after the resumed epoch is epoch 8
    assert ld3.epoch == 8


@pytest.mark.parametrize("route,workers", [("refs", 0), ("samples-workers", 2),
                                           ("samples", 0)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_drop_last_drops_each_ranks_short_batch(ds_path: str, route: str, workers: int,
                                                world: int) -> None:
    per_rank = -(-N // world)
    counts, seen = [], []
    for rank in range(world):
        ld = FeedLoader(FeedDataset(ds_path, shuffle=True, rank=rank, world_size=world),
                        batch_size=4, drop_last=True, route=route, num_workers=workers)
        batches = list(ld)
        assert all(len(b["__key__"]) == 4 for b in batches)
        assert len(batches) == len(ld) == per_rank // 4
        counts.append(len(batches))
        seen += ids(batches)
    assert len(set(counts)) == 1  # every rank the same number of batches
    c = Counter(seen)
    # a sample repeats only as the padding that evens the ranks out, never more
    assert sum(c.values()) - len(c) <= per_rank * world - N and max(c.values()) <= 2


def test_drop_last_resumes_exactly(ds_path: str) -> None:
    full = ids(list(FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4,
                               drop_last=True)))
    ld = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4, drop_last=True)
    it = iter(ld)
    head = ids([next(it), next(it)])
    again = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4, drop_last=True)
    again.load_state_dict(ld.state_dict())
    assert head + ids(list(again)) == full and len(full) == 24


@pytest.mark.parametrize("route,workers", [("refs", 0), ("refs-workers", 2), ("samples", 0),
                                           ("samples-workers", 2)])
def test_decode_makes_integer_labels(ds_path: str, route: str, workers: int) -> None:
    ds = FeedDataset(ds_path, decode={"cls": int}, max_open_shards=2 if "refs-w" in route else 64)
    batches = list(FeedLoader(ds, batch_size=4, route=route, num_workers=workers))
    labels = torch.cat([b["cls"] for b in batches])
    assert labels.dtype == torch.int64
    raw = FeedDataset(ds_path)
    assert labels.tolist() == [int(bytes(s["cls"])) for s in raw]


def test_decode_before_the_transform_and_named_errors(ds_path: str) -> None:
    seen = []
    ds = FeedDataset(ds_path, decode={"cls": int, "jpg": lambda b: len(b)},
                     transform=lambda s: seen.append((s["cls"], s["jpg"])) or s["cls"])
    batch = next(iter(FeedLoader(ds, batch_size=3)))
    assert batch.dtype == torch.int64 and all(isinstance(j, int) for _, j in seen)
    bad = FeedDataset(ds_path, decode={"jpg": int})
    with pytest.raises(ValueError, match=r"field 'jpg' does not decode"):
        next(iter(bad))
    with pytest.raises(ValueError, match="decode="):
        FeedDataset(ds_path, decode={"cls": "roman"})
