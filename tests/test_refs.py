"""Raw batches built by reference (feedpipe.raw_batches): the same batches as the general path,
with only member positions crossing from the workers, and every damage still an error."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe.errors import ShardFormatError, SourceNotFoundError
from feedpipe.loader import _InProcessBatches, collate_samples
from feedpipe.raw_batches import BatchRefs, BatchResolver, batch_refs, eligible

from _data import make_dataset

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "shards", "example")


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("raw")))  # 25 samples, shards of 7


def general_path(url: str, batch_size: int, **kw) -> list[dict]:  # type: ignore[no-untyped-def]
    """The oracle: FeedDataset's own samples, collated in this process by collate_samples."""
    ds = FeedDataset(url, **kw)
    ds.set_batch_size(batch_size)
    return list(_InProcessBatches(ds, batch_size, collate_samples))


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
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


@pytest.mark.parametrize("workers,max_open", [(0, 64), (2, 64), (0, 2), (2, 2)])
@pytest.mark.parametrize("shuffle,batch_size", [(False, 4), (True, 5), (True, 1)])
def test_batches_equal_the_general_path(workers: int, max_open: int, shuffle: bool,
                                        batch_size: int) -> None:
    # the example dataset has a JSON sidecar on some samples only: lists with None where absent.
    # Its 3 shards fit in 64 open maps (planned here from index columns), not in 2 (planned by
    # the workers, or here sample by sample)
    fl = FeedLoader(FeedDataset(EXAMPLE, shuffle=shuffle, seed=7, max_open_shards=max_open),
                    batch_size=batch_size, num_workers=workers)
    assert fl._by_reference
    got = list(fl)
    assert_same_batches(got, general_path(EXAMPLE, batch_size, shuffle=shuffle, seed=7))
    if batch_size > 1:
        assert any(None in b["json"] for b in got if "json" in b)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_ranks_padding_and_resume_match(ds_path: str, rank: int) -> None:
    kw = dict(shuffle=True, seed=3, rank=rank, world_size=3)
    ds = FeedDataset(ds_path, **kw)
    fl = FeedLoader(ds, batch_size=3, num_workers=2)
    fl.set_epoch(2)
    it = iter(fl)
    next(it)
    state = fl.state_dict()
    del it
    resumed = FeedLoader(FeedDataset(ds_path, **kw), batch_size=3, num_workers=2)
    resumed.load_state_dict(state)
    oracle = FeedDataset(ds_path, **kw)
    oracle.load_state_dict(state)
    oracle.set_batch_size(3)
    assert_same_batches(list(resumed), list(_InProcessBatches(oracle, 3, collate_samples)))


def test_more_shards_in_a_batch_than_open_maps(ds_path: str) -> None:
    fl = FeedLoader(FeedDataset(ds_path, shuffle=True, seed=1, max_open_shards=1),
                    batch_size=25, num_workers=2)
    got = list(fl)
    assert len(set(got[0]["__shard__"])) == 4
    assert_same_batches(got, general_path(ds_path, 25, shuffle=True, seed=1))


def test_only_positions_cross_from_the_workers(ds_path: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True)
    ds.set_batch_size(8)
    refs = list(batch_refs(ds, 0, 1))
    assert all(isinstance(r, BatchRefs) for r in refs)
    payload = sum(len(v) for b in general_path(ds_path, 8, shuffle=True) for k, col in b.items()
                  if k[:2] != "__" for v in col if v is not None)
    sent = sum(len(pickle.dumps(r)) for r in refs)
    assert payload > 4 * sent  # JPEGs of 8-16 px are small; real ones make the gap far wider
    back = pickle.loads(pickle.dumps(refs[0]))
    assert back.keys == refs[0].keys and back.first == refs[0].first


def test_pin_memory_and_defaults_choose_the_path(ds_path: str) -> None:
    fl = FeedLoader(FeedDataset(ds_path), batch_size=4, num_workers=2, pin_memory=True)
    assert fl._by_reference
    batches = list(fl)
    assert sorted(i for b in batches for i in b["__index__"].tolist()) == list(range(25))
    if torch.cuda.is_available():  # pinned as the DataLoader's pin_memory=True would
        assert all(b["__index__"].is_pinned() for b in batches)
    assert not eligible(FeedDataset(ds_path, transform=dict))  # a transform: samples, not bytes
    assert not FeedLoader(FeedDataset(ds_path), batch_size=4,
                          collate_fn=lambda s: s)._by_reference  # the caller collates


def test_shard_truncated_after_planning_names_it(ds_path: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "copy")
    shutil.copytree(ds_path, root)
    ds = FeedDataset(root)
    ds.set_batch_size(25)
    refs = next(batch_refs(ds, 0, 1))  # the worker's readers checked the shards here
    shard = os.path.join(root, ds.manifest.shards[1].name)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 700)
    with pytest.raises(ShardFormatError, match=ds.manifest.shards[1].name + ".*truncated"):
        BatchResolver(ds)(refs)
    os.remove(shard)
    with pytest.raises(SourceNotFoundError, match=ds.manifest.shards[1].name):
        BatchResolver(ds)(refs)


def test_member_past_the_end_is_an_error(ds_path: str) -> None:
    ds = FeedDataset(ds_path)
    ds.set_batch_size(4)
    refs = next(batch_refs(ds, 0, 1))
    offs, sizes = refs.fields["jpg"]
    sizes[2] = ds.manifest.shards[0].bytes  # an index entry that runs off the file
    with pytest.raises(ShardFormatError, match=rf"{refs.keys[2]}\.jpg at offset {offs[2]}"):
        BatchResolver(ds)(refs)


def _can_populate() -> bool:
    import mmap

    from feedpipe.raw_batches import _MADV_POPULATE_READ

    m = mmap.mmap(-1, 4096)
    try:
        m.madvise(_MADV_POPULATE_READ, 0, 4096)
        return True
    except (OSError, ValueError):
        return False
    finally:
        m.close()


def test_indexes_are_parsed_once_and_batches_planned_here(ds_path: str, tmp_path,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import feedpipe.reader as reader_mod

    def oracle(epoch: int, **kw) -> list[dict]:  # type: ignore[no-untyped-def]
        ds = FeedDataset(ds_path, **kw)
        ds.set_epoch(epoch)
        ds.set_batch_size(4)
        return list(_InProcessBatches(ds, 4, collate_samples))

    want = [oracle(e, shuffle=True, seed=3) for e in (0, 1)]
    plain = oracle(0)
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
        # each index parsed once, here, for both epochs: the batches were planned here from the
        # dataset's index columns, with no worker process started
        assert log.read_text().split() == [str(os.getpid())] * shards
        readers = fl.dataset._readers
        assert sorted(readers) == list(range(shards)) and "_columns" in fl.dataset.__dict__
        assert all(not r._mm.closed for r in readers.values())  # the resolver borrowed them
        # one rank reads every member: each map was faulted in whole, once (kernels >= 5.14)
        assert all(r._populated for r in readers.values()) or not _can_populate()
    # more shards than open maps: nothing is opened ahead; the workers plan and parse
    log.write_text("")
    few = FeedLoader(FeedDataset(ds_path, max_open_shards=2), batch_size=4, num_workers=2)
    assert_same_batches(list(few), plain)
    assert len(few.dataset._readers) == 0 and "_columns" not in few.dataset.__dict__
    if not torch.cuda.is_initialized():  # else the workers start from a forkserver, unpatched
        assert str(os.getpid()) not in log.read_text().split() and log.read_text()


@pytest.mark.parametrize("url", ["example", "made"])
@pytest.mark.parametrize("shuffle,batch_size,world", [(False, 4, 1), (True, 5, 1), (True, 1, 1),
                                                      (True, 3, 3), (True, 32, 1)])
def test_column_plans_equal_the_per_sample_plans(ds_path: str, url: str, shuffle: bool,
                                                 batch_size: int, world: int) -> None:
    from feedpipe.raw_batches import columns

    root = EXAMPLE if url == "example" else ds_path
    for rank in range(world):
        for workers in (1, 2):
            loop = FeedDataset(root, shuffle=shuffle, seed=5, rank=rank, world_size=world)
            col = FeedDataset(root, shuffle=shuffle, seed=5, rank=rank, world_size=world)
            for ds in (loop, col):
                ds.set_epoch(1)
                ds.set_batch_size(batch_size)
            assert col._open_all() and columns(col) is not None
            for w in range(workers):
                a = list(batch_refs(loop, w, workers))
                b = list(batch_refs(col, w, workers))
                assert len(a) == len(b) and (a or w > 0)  # a worker may get no batch
                for x, y in zip(a, b):
                    assert x.keys == y.keys and x.first == y.first
                    assert list(x.fields) == list(y.fields)  # the same fields, same order
                    assert (x.shards == y.shards).all() and (x.ids == y.ids).all()
                    for e in x.fields:
                        assert (x.fields[e][0] == y.fields[e][0]).all(), e
                        assert (x.fields[e][1] == y.fields[e][1]).all(), e
    # the example has a sidecar on some samples only: some batch meets it after its first sample
    ds = FeedDataset(EXAMPLE, shuffle=True, seed=5)
    ds.set_batch_size(5)
    ds._open_all()
    columns(ds)
    assert any("json" in r.fields and list(r.fields).index("json") >= r.first
               for r in batch_refs(ds, 0, 1))
