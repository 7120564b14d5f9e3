"""Raw batches by reference (feedpipe.refs, the ``refs`` and ``refs-workers`` routes): the same
batches as the per-sample route, with only member positions crossing from the workers, column
plans equal to per-sample plans, and every damage still an error naming the shard."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from _data import make_dataset

from feedpipe import FeedDataset, FeedLoader
from feedpipe._helpers.fork_safety import default_start_method
from feedpipe.errors import ShardFormatError, SourceNotFoundError
from feedpipe.stream._batch_loop import EpochReader
from feedpipe.stream._epoch import EpochState
from feedpipe.stream._refs import BatchRefs, Columns, RefFetch, Resolver

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "shards", "example")


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("raw")))  # 25 samples, shards of 7


def general_path(url: str, batch_size: int, *, epoch: int | None = None,
                 state: dict[str, Any] | None = None, **kw: Any) -> list[dict[str, Any]]:
    """The oracle: the per-sample route (each sample dict from the shards, collated by the
    default collation) in this process."""
    fl = FeedLoader(FeedDataset(url, **kw), batch_size=batch_size, route="samples")
    if epoch is not None:
        fl.set_epoch(epoch)
    if state is not None:
        fl.load_state_dict(state)
    return list(fl)


def plan_refs(ds: FeedDataset, worker: int, workers: int, columns: Columns | None = None, *,
              batch_size: int, epoch: int = 0) -> list[BatchRefs]:
    """The references of every batch of one reader of ``ds``'s ``epoch`` in batches of
    ``batch_size``, as that reader plans them (from the index columns when given, else sample
    by sample)."""
    state = EpochState(batch_size)
    state.set_epoch(epoch)
    fetch = RefFetch(ds.shards, epoch, ds.seed, columns=columns)
    return [fetch(ids) for ids in EpochReader(ds, state, worker, workers).batches()]


def assert_same_batches(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a) == list(b)  # the same fields in the same order
        for k in a:
            if isinstance(b[k], torch.Tensor):
                assert isinstance(a[k], torch.Tensor) and a[k].dtype == b[k].dtype, k
                assert torch.equal(a[k], b[k]), k
            else:
                assert type(a[k]) is list and a[k] == b[k], k
                assert all(v is None or type(v) is bytes for v in a[k] if k[:2] != "__"), k


@pytest.mark.parametrize("workers,max_open,route", [(0, 64, "refs"), (2, 64, "refs"),
                                                    (0, 2, "refs"), (2, 2, "refs-workers")])
@pytest.mark.parametrize("shuffle,batch_size", [(False, 4), (True, 5), (True, 1)])
def test_batches_equal_the_general_path(workers: int, max_open: int, route: str, shuffle: bool,
                                        batch_size: int) -> None:
    # the example dataset has a JSON sidecar on some samples only: lists with None where absent.
    # Its 3 shards fit in 64 open maps (planned here from index columns), not in 2 (planned by
    # the workers, or here sample by sample)
    fl = FeedLoader(FeedDataset(EXAMPLE, shuffle=shuffle, seed=7, max_open_shards=max_open),
                    batch_size=batch_size, num_workers=workers)
    assert fl.route.name == route and fl.route.fetch == "refs" and fl.route.sink == "resolve"
    got = list(fl)
    assert_same_batches(got, general_path(EXAMPLE, batch_size, shuffle=shuffle, seed=7))
    if batch_size > 1:
        assert any(None in b["json"] for b in got if "json" in b)
    stats = fl.stats()
    assert stats["route"] == route and stats["batches"] == len(got)
    if route == "refs-workers":
        assert len(stats["worker_pids"]) == workers and os.getpid() not in stats["worker_pids"]
    else:
        assert "worker_pids" not in stats


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_ranks_padding_and_resume_match(ds_path: str, rank: int) -> None:
    kw: dict[str, Any] = {"shuffle": True, "seed": 3, "rank": rank, "world_size": 3}
    fl = FeedLoader(FeedDataset(ds_path, **kw), batch_size=3, num_workers=2)
    fl.set_epoch(2)
    it = iter(fl)
    next(it)
    state = fl.state_dict()
    del it
    resumed = FeedLoader(FeedDataset(ds_path, **kw), batch_size=3, num_workers=2)
    resumed.load_state_dict(state)
    assert resumed.route.name == "refs"
    assert_same_batches(list(resumed), general_path(ds_path, 3, state=state, **kw))


def test_more_shards_in_a_batch_than_open_maps(ds_path: str) -> None:
    fl = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=1, max_open_shards=1),
                    batch_size=25, num_workers=2)
    assert fl.route.name == "refs-workers"
    got = list(fl)
    assert len(set(got[0]["__shard__"])) == 4
    assert_same_batches(got, general_path(ds_path, 25, shuffle=True, seed=1))


def test_only_positions_cross_from_the_workers(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True)
    refs = plan_refs(ds, 0, 1, batch_size=8)
    assert len(refs) == 4 and all(isinstance(r, BatchRefs) for r in refs)
    payload = sum(len(v) for b in general_path(ds_path, 8, shuffle=True) for k, col in b.items()
                  if k[:2] != "__" for v in col if v is not None)
    sent = sum(len(pickle.dumps(r)) for r in refs)
    assert payload > 4 * sent  # JPEGs of 8-16 px are small; real ones make the gap far wider
    back = pickle.loads(pickle.dumps(refs[0]))
    assert back.keys == refs[0].keys and back.first == refs[0].first
    assert list(back.fields) == list(refs[0].fields) and (back.ids == refs[0].ids).all()
    # what the training process makes of the references is the batch itself
    assert_same_batches([Resolver(ds)(back)], general_path(ds_path, 8, shuffle=True)[:1])


def test_pin_memory_and_defaults_choose_the_route(ds_path: str) -> None:
    fl = FeedLoader(FeedDataset(ds_path), batch_size=4, num_workers=2, pin_memory=True)
    assert fl.route.name == "refs"
    batches = list(fl)
    assert sorted(i for b in batches for i in b["__index__"].tolist()) == list(range(25))
    if torch.cuda.is_available():  # pinned as the DataLoader's pin_memory=True would
        assert all(b["__index__"].is_pinned() for b in batches)
    # a transform: samples, not bytes
    with_transform = FeedDataset(ds_path, transform=dict)
    assert FeedLoader(with_transform, batch_size=4).route.fetch != "refs"
    with pytest.raises(ValueError, match="the dataset has a transform"):
        FeedLoader(with_transform, batch_size=4, route="refs")
    # the caller collates
    assert FeedLoader(FeedDataset(ds_path), batch_size=4,
                      collate_fn=lambda s: s).route.fetch != "refs"
    with pytest.raises(ValueError, match="a collate_fn was given"):
        FeedLoader(FeedDataset(ds_path), batch_size=4, collate_fn=lambda s: s, route="refs")


def test_shard_truncated_after_planning_names_it(ds_path: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "copy")
    shutil.copytree(ds_path, root)
    planner = FeedDataset(root)  # a worker: its shards are open, their indexes read
    refs = plan_refs(planner, 0, 1, batch_size=25)[0]
    name = planner.manifest.shards[1].name
    assert name in refs_shards(planner, refs)
    shard = os.path.join(root, name)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 700)
    # resolved where the shard was open before it was cut, and where it is opened after
    with pytest.raises(ShardFormatError, match=re.escape(name) + ".*truncated"):
        Resolver(planner)(refs)
    with pytest.raises(ShardFormatError, match=re.escape(name) + ".*truncated"):
        Resolver(FeedDataset(root))(refs)
    os.remove(shard)
    with pytest.raises(SourceNotFoundError, match=re.escape(name)):
        Resolver(FeedDataset(root))(refs)


def refs_shards(ds: FeedDataset, refs: BatchRefs) -> set[str]:
    return {ds.shards.names[s] for s in refs.shards.tolist()}


def test_member_past_the_end_is_an_error(ds_path: str) -> None:
    ds = FeedDataset(ds_path)
    refs = plan_refs(ds, 0, 1, batch_size=4)[0]
    offs, sizes = refs.fields["jpg"]
    sizes[2] = ds.manifest.shards[0].bytes  # an index entry that runs off the file
    with pytest.raises(ShardFormatError,
                       match=re.escape(f"{refs.keys[2]}.jpg at offset {offs[2]}")):
        Resolver(ds)(refs)


def _can_populate() -> bool:
    import mmap

    from feedpipe.format._reader import MADV_POPULATE_READ

    m = mmap.mmap(-1, 4096)
    try:
        m.madvise(MADV_POPULATE_READ, 0, 4096)
        return True
    except (OSError, ValueError):
        return False
    finally:
        m.close()


def test_indexes_are_parsed_once_and_batches_planned_here(ds_path: str, tmp_path,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import feedpipe.format._reader as reader_mod

    want = [general_path(ds_path, 4, epoch=e, shuffle=True, seed=3) for e in (0, 1)]
    plain = general_path(ds_path, 4)
    log = tmp_path / "parses"
    log.write_text("")
    real = reader_mod.parse_index

    def counted(text: str, where: str = "<index>"):  # type: ignore[no-untyped-def]
        with open(log, "a") as f:  # O_APPEND: one line per parse, from any process
            f.write(f"{os.getpid()}\n")
        return real(text, where)

    monkeypatch.setattr(reader_mod, "parse_index", counted)  # forked workers inherit it
    for context in (None, "forkserver"):  # how workers would start does not matter
        log.write_text("")
        fl = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=3), batch_size=4, num_workers=2,
                        **({"multiprocessing_context": context} if context else {}))
        shards = len(fl.dataset.manifest.shards)
        for epoch in (0, 1):
            fl.set_epoch(epoch)
            assert_same_batches(list(fl), want[epoch])
            # planned here from the dataset's index columns, with no worker process started
            stats = fl.stats()
            assert stats["route"] == "refs" and stats["parts"]["executor"] == "inline"
            assert "worker_pids" not in stats
        # each index parsed once, here, for both epochs
        assert log.read_text().split() == [str(os.getpid())] * shards
        readers = fl.dataset.shards.open_readers()
        assert readers is not None and len(readers) == shards
        assert all(r.buffer is not None and not r.buffer.closed for r in readers)
        # one rank reads every member: each map was faulted in whole, once (kernels >= 5.14)
        assert all(r.populated for r in readers) or not _can_populate()
    # more shards than open maps: nothing is opened ahead; the workers plan and parse
    log.write_text("")
    few = FeedLoader(FeedDataset(ds_path, max_open_shards=2), batch_size=4, num_workers=2)
    assert_same_batches(list(few), plain)
    assert few.stats()["route"] == "refs-workers" and len(few.stats()["worker_pids"]) == 2
    assert few.dataset.shards.open_readers() is None
    if default_start_method() == "fork":  # (also after CUDA init) the patch reached them
        assert str(os.getpid()) not in log.read_text().split() and log.read_text()


@pytest.mark.parametrize("url", ["example", "made"])
@pytest.mark.parametrize("shuffle,batch_size,world", [(False, 4, 1), (True, 5, 1), (True, 1, 1),
                                                      (True, 3, 3), (True, 32, 1)])
def test_column_plans_equal_the_per_sample_plans(ds_path: str, url: str, shuffle: bool,
                                                 batch_size: int, world: int) -> None:
    root = EXAMPLE if url == "example" else ds_path
    for rank in range(world):
        for workers in (1, 2):
            loop = FeedDataset(root, shuffle=shuffle, seed=5, rank=rank, world_size=world)
            col = FeedDataset(root, shuffle=shuffle, seed=5, rank=rank, world_size=world)
            assert col.shards.open_all()
            readers = col.shards.open_readers()
            assert readers is not None
            columns = Columns(readers)
            for w in range(workers):
                a = plan_refs(loop, w, workers, batch_size=batch_size, epoch=1)
                b = plan_refs(col, w, workers, columns, batch_size=batch_size, epoch=1)
                assert len(a) == len(b) and (a or w > 0)  # a worker may get no batch
                for x, y in zip(a, b):
                    assert x.keys == y.keys and x.first == y.first
                    assert list(x.fields) == list(y.fields)  # the same fields, same order
                    assert (x.shards == y.shards).all() and (x.ids == y.ids).all()
                    assert x.epoch == y.epoch == 1
                    for e in x.fields:
                        assert (x.fields[e][0] == y.fields[e][0]).all(), e
                        assert (x.fields[e][1] == y.fields[e][1]).all(), e
    # the example has a sidecar on some samples only: some batch meets it after its first sample
    ds = FeedDataset(EXAMPLE, shuffle=True, seed=5)
    assert ds.shards.open_all()
    columns = Columns(ds.shards.open_readers())  # type: ignore[arg-type]
    assert any("json" in r.fields and list(r.fields).index("json") >= r.first
               for r in plan_refs(ds, 0, 1, columns, batch_size=5))
    assert np.all(columns.offsets["jpg"] >= 0)  # every sample has its image


def test_stats_say_how_the_refs_route_planned(ds_path: str) -> None:
    """The refs route plans from the index columns when every shard fits in max_open_shards,
    else sample by sample; stats() names which."""
    fits = FeedLoader(FeedDataset(ds_path, shuffle=True), batch_size=4, route="refs")
    few = FeedLoader(FeedDataset(ds_path, shuffle=True, max_open_shards=2), batch_size=4,
                     route="refs")
    ids = [b["__index__"].tolist() for b in fits]
    assert ids == [b["__index__"].tolist() for b in few]
    assert fits.stats()["refs_plan"] == "columns" and few.stats()["refs_plan"] == "per-sample"


@pytest.fixture(scope="module")
def records_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Fixed-size records over 5 shards: a 40-byte ``bin`` on every sample (the one-size gather,
    from one shard and from several), an empty ``pad``, a 3-byte ``txt`` on every 4th sample
    (a field some samples lack) and, on every 7th, ``txt`` written before ``bin`` (a second
    layout of fields)."""
    import feedpipe

    out = str(tmp_path_factory.mktemp("records") / "ds")
    rng = np.random.default_rng(0)
    with feedpipe.ShardWriter(out, max_samples=7) as w:
        for i in range(33):
            s: dict[str, Any] = {"__key__": f"{i:04d}"}
            if i % 7 == 3:
                s["txt"] = b"%03d" % i
            s["bin"] = rng.integers(0, 256, 40, dtype=np.uint8).tobytes()
            s["pad"] = b""
            if i % 4 == 0 and "txt" not in s:
                s["txt"] = b"%03d" % i
            w.write(s)
    return out


@pytest.mark.parametrize("shuffle,batch_size", [(False, 7), (False, 10), (True, 6), (True, 33)])
def test_fixed_size_records_equal_the_general_path(records_path: str, shuffle: bool,
                                                   batch_size: int) -> None:
    fl = FeedLoader(FeedDataset(records_path, shuffle=shuffle, seed=2), batch_size=batch_size)
    assert fl.route.name == "refs"
    got = list(fl)
    assert fl.stats()["refs_plan"] == "columns"
    assert_same_batches(got, general_path(records_path, batch_size, shuffle=shuffle, seed=2))
    # batches of 7 in order: each from one shard; the others: some across shards
    assert any(len(set(b["__shard__"])) > 1 for b in got) == (shuffle or batch_size != 7)
    assert all(v == b"" for b in got for v in b["pad"])


def test_column_layouts_are_each_samples_fields(records_path: str) -> None:
    ds = FeedDataset(records_path)
    assert ds.shards.open_all()
    columns = Columns(ds.shards.open_readers())  # type: ignore[arg-type]
    assert len(columns.layouts) == 3  # bin+pad, bin+pad+txt, txt+bin+pad
    for g in range(len(columns.keys)):
        assert list(columns.layouts[columns.layout[g]]) == columns.fields_of(g)
