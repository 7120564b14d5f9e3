"""``feedpipe.Packed``: token documents packed into rows of ``seq_len``, every token exactly once
per epoch over all ranks, resumable mid-document on another number of ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe import PackedFieldError
from feedpipe._helpers import dependency
from feedpipe.convert._shard_writer import write_samples
from feedpipe.errors import StateError
from feedpipe.plan._order import Plan, iter_ids
from feedpipe.stream._packed import piece_copier, row_pieces, rows_split


def _docs(lengths: list[int]) -> list[np.ndarray]:
    # document i's tokens are (i, j) encoded as i * 10_000 + j: each token of the corpus unique
    return [np.arange(n, dtype=np.int64) + i * 10_000 for i, n in enumerate(lengths)]


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 60, size=40).tolist()
    docs = _docs(lengths)
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": d} for i, d in enumerate(docs)],
                  str(tmp_path / "tok"), max_samples=9)
    return str(tmp_path / "tok"), docs


def _loaders(path, world, batch, seq_len=16):
    return [feedpipe.FeedLoader(feedpipe.Packed(
        feedpipe.FeedDataset(path, shuffle=True, seed=5, rank=r, world_size=world), seq_len),
        batch_size=batch) for r in range(world)]


def _tokens(batches) -> list[int]:
    out: list[int] = []
    for b in batches:
        real = b["labels"] != -100
        out += b["input_ids"][real].tolist()
    return out


def _lockstep(loaders, stop=None):
    """Batches of each loader read in lockstep, ``stop`` steps (None: all)."""
    its = [iter(ld) for ld in loaders]
    got: list[list[dict]] = [[] for _ in loaders]
    step = 0
    while stop is None or step < stop:
        done = 0
        for i, it in enumerate(its):
            b = next(it, None)
            if b is None:
                done += 1
            else:
                got[i].append(b)
        if done == len(its):
            break
        step += 1
    return got


def test_batch_layout(corpus):
    path, docs = corpus
    (loader,) = _loaders(path, 1, 4)
    batches = list(loader)
    all_tokens = sum(len(d) for d in docs)
    rows = np.concatenate([b["input_ids"].numpy() for b in batches])
    assert rows.shape == (-(-all_tokens // 16), 16)
    for b in batches:
        for k in ("input_ids", "position_ids", "labels"):
            assert b[k].dtype.is_floating_point is False and str(b[k].dtype) == "torch.int64"
            assert b[k].shape == b["input_ids"].shape
    # only the last row is padded; every other row is full
    labels = np.concatenate([b["labels"].numpy() for b in batches])
    assert (labels[:-1] != -100).all()
    assert (labels[-1][: all_tokens % 16 or 16] != -100).all()
    assert (labels[-1][all_tokens % 16 or 16:] == -100).all()
    # documents concatenated in plan order: the tokens are the plan's documents in order
    order = loader.dataset.order(0)
    assert _tokens(batches) == np.concatenate([docs[g] for g in order]).tolist()
    # position_ids restart at 0 at each document start and each continuation piece
    for b in batches:
        ids, pos = b["input_ids"].numpy(), b["position_ids"].numpy()
        for row_ids, row_pos, row_labels in zip(ids, pos, b["labels"].numpy()):
            for j in range(int((row_labels != -100).sum())):
                if j == 0 or row_ids[j] // 10_000 != row_ids[j - 1] // 10_000:
                    assert row_pos[j] == 0
                else:
                    assert row_pos[j] == row_pos[j - 1] + 1
        # cu_seqlens: boundaries of the pieces in the flattened batch
        cu = b["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == ids.size and cu == sorted(set(cu))
        starts = set(np.flatnonzero(pos.reshape(-1) == 0).tolist())
        assert starts <= set(cu[:-1])


@pytest.mark.parametrize("world,batch", [(1, 3), (2, 2), (3, 1)])
def test_every_token_once_over_ranks(corpus, world, batch):
    path, docs = corpus
    got = _lockstep(_loaders(path, world, batch))
    tokens = [t for per_rank in got for t in _tokens(per_rank)]
    assert Counter(tokens) == Counter(np.concatenate(docs).tolist())


@pytest.mark.parametrize("world,then", [(2, 2), (2, 3), (3, 1)])
def test_mid_epoch_resume_on_another_world(corpus, world, then):
    path, docs = corpus
    assert _loaders(path, world, 2)[0].state_dict()["position"] == 0
    loaders = _loaders(path, world, 2)
    got = _lockstep(loaders, stop=2)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert state["position"] == 2 * world * 2
    rest = _loaders(path, then, 2)
    for ld in rest:
        ld.load_state_dict(state)
    tail = _lockstep(rest)
    tokens = [t for per in got + tail for t in _tokens(per)]
    assert Counter(tokens) == Counter(np.concatenate(docs).tolist())


def test_resume_in_a_new_interpreter(corpus, tmp_path):
    path, docs = corpus
    (ld,) = _loaders(path, 1, 2)
    it = iter(ld)
    head = [next(it), next(it)]
    state = ld.state_dict()
    # row 4 starts inside a document here, so the resume continues a half-read document
    code = (
        "import json, sys, feedpipe\n"
        "ds = feedpipe.FeedDataset(sys.argv[1], shuffle=True, seed=5)\n"
        "ld = feedpipe.FeedLoader(feedpipe.Packed(ds, 16), batch_size=2)\n"
        "ld.load_state_dict(json.loads(sys.argv[2]))\n"
        "out = []\n"
        "for b in ld:\n"
        "    out += b['input_ids'][b['labels'] != -100].tolist()\n"
        "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code, path, json.dumps(state)],
                         capture_output=True, text=True, check=True)
    tokens = _tokens(head) + json.loads(res.stdout)
    assert tokens == np.concatenate([docs[g] for g in ld.dataset.order(0)]).tolist()


def test_half_consumed_document_resumes_to_the_rest(corpus):
    path, docs = corpus
    (ld,) = _loaders(path, 1, 1)
    offsets = ld.dataset.offsets(0)
    # a row that begins inside a document exists in this corpus
    mid = [r for r in range(1, ld.dataset.num_rows(0)) if r * 16 not in set(offsets.tolist())]
    assert mid
    it = iter(ld)
    head = [next(it) for _ in range(mid[0])]
    (again,) = _loaders(path, 1, 1)
    again.load_state_dict(ld.state_dict())
    rest = iter(again)
    first = next(rest)
    assert first["position_ids"][0, 0] == 0  # the continuation piece counts from 0
    assert _tokens(head + [first] + list(rest)) == _tokens(list(_loaders(path, 1, 1)[0]))


def test_second_epoch_reads_another_order(corpus):
    path, docs = corpus
    (ld,) = _loaders(path, 1, 4)
    e0 = _tokens(list(ld))
    e1 = _tokens(list(ld))
    assert ld.epoch == 1 and e0 != e1 and sorted(e0) == sorted(e1)


def test_state_of_another_seq_len_is_refused(corpus):
    path, _ = corpus
    (ld,) = _loaders(path, 1, 2, seq_len=16)
    next(iter(ld))
    (other,) = _loaders(path, 1, 2, seq_len=32)
    with pytest.raises(StateError, match="seq_len"):
        other.load_state_dict(ld.state_dict())


def test_a_document_that_is_not_token_ids_is_refused(tmp_path):
    write_samples([{"__key__": "a", "tokens.npy": np.zeros((2, 2), dtype=np.int64)}],
                  str(tmp_path / "bad"))
    with pytest.raises(PackedFieldError, match="1-D integer"):
        next(iter(feedpipe.FeedLoader(feedpipe.Packed(
            feedpipe.FeedDataset(str(tmp_path / "bad")), 8))))
    with pytest.raises(PackedFieldError, match="no field 'ids.npy'"):
        next(iter(feedpipe.FeedLoader(feedpipe.Packed(
            feedpipe.FeedDataset(str(tmp_path / "bad")), 8, field="ids.npy"))))


def test_worker_processes_deal_rows_like_samples(corpus):
    """num_workers > 0: the packed rows are made in DataLoader worker processes, and the
    batches are those of the loader in this process (the route contract suite holds the rest:
    tests/test_routes.py)."""
    path, _ = corpus
    ld = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(path, shuffle=True, seed=5),
                                             16), batch_size=2, num_workers=2,
                             route="packed-workers")
    assert isinstance(ld, feedpipe.FeedLoader) and ld.route.name == "packed-workers"
    got = list(ld)
    (want,) = _loaders(path, 1, 2)
    assert [b["input_ids"].tolist() for b in got] == [b["input_ids"].tolist() for b in want]
    assert len(ld.stats()["worker_pids"]) == 2


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
       seq_len=st.integers(1, 24), batch=st.integers(1, 5), world=st.integers(1, 4),
       then=st.integers(1, 4), stop=st.integers(0, 6))
def test_rows_deal_every_token_once(lengths, seq_len, batch, world, then, stop):
    """The packing and the dealing of rows alone: any lengths, seq_len, batch sizes and world
    sizes, with a resume after ``stop`` lockstep steps on ``then`` ranks."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    rows = -(-total // seq_len)
    seen: list[tuple[int, int]] = []

    def take(r):
        for d, off, k in row_pieces(offsets, r, seq_len):
            assert 0 < k and off + k <= lengths[d]
            seen.extend((d, off + j) for j in range(k))

    def dealt(start, w, r):
        split = rows_split(rows, start, w, r)
        return list(iter_ids(Plan((split.num_samples,), shuffle=False), split, batch, 0, 1))

    per_rank = [dealt(0, world, r) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # as many batches on every rank
    steps = min(stop, len(per_rank[0]))
    for r in range(world):
        for b in per_rank[r][:steps]:
            for row in b.tolist():
                if row < rows:  # past the epoch's tokens: a row of padding only
                    take(row)
    position = min(steps * world * batch, rows)
    for r in range(then):
        for b in dealt(position, then, r):
            for row in b.tolist():
                if row < rows:
                    take(row)
    assert sorted(seen) == [(d, j) for d, n in enumerate(lengths) for j in range(n)]
    for r in range(rows - 1):  # every row but the last is full
        assert sum(k for _, _, k in row_pieces(offsets, r, seq_len)) == seq_len


CALLS: list[str] = []  # texts the tokenizer was run on


def _trained_tokenizer(texts):
    """A word-level tokenizer of the ``tokenizers`` package trained here on ``texts``."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    return tok


def test_tokenisation_on_the_fly_is_cached(tmp_path):
    """The recipe of the README: text shards, a tokenizer wrapped by FunctionIndex, Packed over
    the result; the second epoch tokenises nothing."""
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 30)))) for _ in range(30)]
    write_samples([{"__key__": f"t{i:02d}", "txt": t} for i, t in enumerate(texts)],
                  str(tmp_path / "text"), max_samples=8)
    tok = _trained_tokenizer(texts)
    index = feedpipe.FunctionIndex(str(tmp_path / "memo"))

    def tokenize(sample):
        text = bytes(sample["txt"]).decode()
        CALLS.append(text)
        return {"tokens.npy": np.asarray(tok.encode(text).ids, dtype=np.int64)}

    ds = feedpipe.FeedDataset(str(tmp_path / "text"), shuffle=True,
                              transform=index.wrap(tokenize, fields=["txt"], version=1))
    CALLS.clear()
    loader = feedpipe.FeedLoader(feedpipe.Packed(ds, seq_len=32, pad_id=0), batch_size=4)
    first = _tokens(list(loader))
    assert len(set(CALLS)) == len(set(texts))  # the first epoch tokenised every document
    expected = Counter(t for text in texts for t in tok.encode(text).ids)
    assert Counter(first) == expected
    CALLS.clear()
    second = _tokens(list(loader))
    assert loader.epoch == 1 and CALLS == []  # tokenised nothing
    assert Counter(second) == expected


def test_early_stop_leaves_nothing_behind(corpus):
    """A loop that stops after one batch leaves no thread, process or open iterator state: the
    next pass of the same loader is a fresh epoch read whole."""
    import multiprocessing
    import threading

    path, docs = corpus
    before = (threading.active_count(), len(multiprocessing.active_children()))
    (ld,) = _loaders(path, 1, 2)
    for _ in ld:
        break
    del _
    after = (threading.active_count(), len(multiprocessing.active_children()))
    assert after == before
    ld.set_epoch(0)
    assert Counter(_tokens(list(ld))) == Counter(np.concatenate(docs).tolist())


def test_a_feedloader_still_pickles(corpus):
    """FeedLoader chooses the Packed reader in ``__new__``; pickle calls ``__new__`` with no
    dataset, so a loader sent to a spawned rank must still unpickle."""
    import pickle

    path, _ = corpus
    ld = pickle.loads(pickle.dumps(feedpipe.FeedLoader(feedpipe.FeedDataset(path), batch_size=3)))
    assert isinstance(ld, feedpipe.FeedLoader) and ld.batch_size == 3


def test_raw_documents_are_sliced_from_the_shards_not_read(corpus):
    """Raw ``.npy`` documents of local shards: their lengths come from the headers and their
    tokens are sliced out of the shards' maps; no document is read (decoded) whole, in the
    first epoch or later."""
    path, docs = corpus
    (ld,) = _loaders(path, 1, 4)
    first = _tokens(list(ld))
    assert ld.dataset.documents_read == 0
    assert first == np.concatenate([docs[g] for g in ld.dataset.order(0)]).tolist()
    assert Counter(_tokens(list(ld))) == Counter(first) and ld.dataset.documents_read == 0


def test_headers_of_every_dtype_and_version(tmp_path):
    """Documents of several integer dtypes (byte orders, widths), empty ones, lengths of
    several digit counts and a version-2 header in one dataset: every token, in plan order."""
    import io

    rng = np.random.default_rng(1)
    dtypes = [np.int32, np.uint16, np.int64, np.dtype(">i4"), np.uint8, np.int16]
    docs = [rng.integers(0, 200, size=int(n)).astype(dtypes[i % len(dtypes)])
            for i, n in enumerate(rng.choice([0, 1, 9, 10, 99, 100, 1234], size=30))]
    samples = [{"__key__": f"d{i:03d}", "tokens.npy": d} for i, d in enumerate(docs)]
    v2 = io.BytesIO()
    np.lib.format.write_array(v2, np.arange(7, dtype=np.int32), version=(2, 0))
    samples.append({"__key__": "d999", "tokens.npy": v2.getvalue()})
    docs.append(np.arange(7))
    write_samples(samples, str(tmp_path / "mixed"), max_samples=7)
    ds = feedpipe.FeedDataset(str(tmp_path / "mixed"), shuffle=True, seed=2)
    packed = feedpipe.Packed(ds, 13)
    got = _tokens(list(feedpipe.FeedLoader(packed, batch_size=3)))
    assert got == np.concatenate([docs[g] for g in packed.order(0)]).astype(np.int64).tolist()
    assert packed.documents_read == 0


def test_device_and_isinstance(corpus):
    """The loader over a Packed is a FeedLoader like any other: ``device=`` delivers its batches
    through a DeviceLoader (``"cpu"`` here), the same as without."""
    path, _ = corpus
    (want,) = _loaders(path, 1, 3)
    ld = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(path, shuffle=True, seed=5),
                                             16), batch_size=3, device="cpu")
    assert isinstance(ld, feedpipe.FeedLoader)
    got = list(ld)
    assert [b["position_ids"].tolist() for b in got] == [
        b["position_ids"].tolist() for b in want]
    assert "device" in ld.stats() and ld.stats()["route"] == "packed"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_the_same_on_every_rank(corpus, world, drop_last):
    """Every rank takes as many steps (a rank short of one hangs DDP): ``len(loader)`` is equal
    on every rank and is what each yields; rows past the epoch's tokens are padding only."""
    path, docs = corpus
    for batch in (1, 2, 3):
        loaders = [feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(
            path, shuffle=True, seed=5, rank=r, world_size=world), 16), batch_size=batch,
            drop_last=drop_last) for r in range(world)]
        lens = [len(ld) for ld in loaders]
        got = _lockstep(loaders)
        assert len(set(lens)) == 1 and [len(g) for g in got] == lens
        rows = [row for g in got for b in g for row in b["labels"]]
        filled = [int((row != -100).sum()) for row in rows]
        assert sum(1 for f in filled if 0 < f < 16) <= 1  # only the epoch's last row is short
        assert filled.count(0) < world  # rows of padding only: fewer than the ranks


def test_an_epoch_without_a_memoized_transform_imports_no_function_index(corpus):
    """The io tally asks whether the transform is a FunctionIndex's: a loader without one does
    not import the function index (and its LMDB wrapper) to find out, in its first batch."""
    path, _ = corpus
    code = ("import sys, feedpipe\n"
            "ld = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(sys.argv[1]), 16),"
            " batch_size=2)\n"
            "n = sum(1 for _ in ld)\n"
            "print(n, 'feedpipe.caches.l2._index' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"


@pytest.mark.parametrize("world", [1, 2])
def test_each_epoch_of_a_mixture_delivers_its_own_documents(tmp_path, world):
    """A ``Packed(Mixture(...))`` whose epochs draw different documents (``epoch_size`` below the
    sources' size) has as many rows as each epoch's own tokens need: every token of the epoch's
    documents once on every later epoch too, none lost to the first epoch's row count, and
    ``len(loader)`` the epoch's batches."""
    lengths = np.random.default_rng(0).integers(5, 60, size=80).tolist()
    docs = _docs(lengths)
    for name, part in (("web", docs[:60]), ("books", docs[60:])):
        write_samples([{"__key__": f"{name}{i:03d}", "tokens.npy": d}
                       for i, d in enumerate(part)], str(tmp_path / name), max_samples=16)

    def mixture(rank: int) -> feedpipe.Mixture:
        return feedpipe.Mixture({n: feedpipe.FeedDataset(str(tmp_path / n), shuffle=True,
                                                         rank=rank, world_size=world)
                                 for n in ("web", "books")},
                                weights={"web": 3, "books": 1}, epoch_size=20, seed=3)

    loaders = [feedpipe.FeedLoader(feedpipe.Packed(mixture(r), seq_len=32), batch_size=4)
               for r in range(world)]
    mix = mixture(0)
    totals = set()
    for epoch in range(5):
        lens = [len(ld) for ld in loaders]
        got = _lockstep(loaders)
        assert [len(g) for g in got] == lens == [lens[0]] * world
        drawn = mix.plan(epoch).sample_ids(np.arange(mix.epoch_size))
        want = Counter(t for g in drawn.tolist() for t in docs[g].tolist())
        assert Counter(t for g in got for t in _tokens(g)) == want, epoch
        totals.add(sum(want.values()))
    assert len(totals) > 1  # the epochs do draw documents of other lengths


needs_packrows = pytest.mark.skipif(
    piece_copier() == "numpy",
    reason="feedpipe._native._packrows did not build (no C compiler at install)")


def _epoch_batches(path, epoch=2):
    ld = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(path, shuffle=True, seed=5),
                                             16), batch_size=3)
    ld.set_epoch(epoch)
    return [{k: v.clone() for k, v in b.items()} for b in ld]


@needs_packrows
def test_the_c_copy_and_the_numpy_copy_give_the_same_batches(tmp_path, monkeypatch, caplog):
    """The token pieces copied and the fields written by ``feedpipe._native._packrows`` and by
    numpy (where it did not build) make the same batches, for each token dtype a document may
    have; the numpy copy says so in a log record."""
    import logging

    from feedpipe.stream import _packed, _packed_batches

    rng = np.random.default_rng(1)
    for dtype in (np.int32, np.uint16, np.int64, ">i4"):
        docs = [rng.integers(0, 30_000, size=int(n)).astype(dtype)
                for n in rng.integers(1, 50, size=30)]
        path = str(tmp_path / np.dtype(dtype).str)
        write_samples([{"__key__": f"d{i:03d}", "tokens.npy": d} for i, d in enumerate(docs)],
                      path, max_samples=7)
        fast = _epoch_batches(path)
        with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="feedpipe"):
            m.setattr(_packed, "_packrows", None)
            m.setattr(_packed_batches, "_packrows", None)  # the fields written by numpy too
            m.setattr(dependency, "UNBUILT_SAID", set())
            slow = _epoch_batches(path)
        assert "copies token pieces with numpy" in caplog.text
        caplog.clear()
        assert len(fast) == len(slow) > 1
        for a, b in zip(fast, slow):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), (dtype, k)
        want = [int(t) for i in feedpipe.FeedDataset(path, shuffle=True, seed=5).plan(2)
                .sample_ids(np.arange(len(docs))).tolist() for t in docs[i]]
        assert _tokens(fast) == want


@needs_packrows
def test_the_c_copy_refuses_pieces_outside_their_maps() -> None:
    from feedpipe._native import _packrows

    m = np.arange(16, dtype=np.uint8)
    out = np.zeros(4, dtype=np.int32)

    def i64(*v: int) -> np.ndarray:
        return np.array(v, dtype=np.int64)
    assert _packrows.gather(out, (m,), i64(0), i64(4), i64(2), 4) == 2
    assert out[:2].tolist() == np.frombuffer(m[4:12].tobytes(), dtype=np.int32).tolist()
    with pytest.raises(ValueError, match="outside its map"):
        _packrows.gather(out, (m,), i64(0), i64(12), i64(2), 4)  # past the map's end
    with pytest.raises(ValueError, match="outside its map"):
        _packrows.gather(out, (m,), i64(0), i64(17), i64(0), 4)  # starts past it
    with pytest.raises(ValueError, match="outside its map"):
        _packrows.gather(out, (m,), i64(1), i64(0), i64(1), 4)  # no such map
    with pytest.raises(ValueError, match="do not fit"):
        _packrows.gather(out, (m, m), i64(0, 1), i64(0, 0), i64(3, 3), 4)
    with pytest.raises(TypeError, match="int64"):
        _packrows.gather(out, (m,), np.zeros(1, np.int32), i64(0), i64(1), 4)
    assert out[2:].tolist() == [0, 0]  # nothing written by a refused call


@pytest.mark.parametrize("group", [1, 3])
def test_batches_do_not_depend_on_how_many_are_made_together(corpus, monkeypatch, group):
    """A reader's batches are made a group at a time (``GROUP_BATCHES``): groups of 1 or 3
    batches give the batches one group of the whole epoch gives."""
    from feedpipe.stream import _packed

    path, _ = corpus
    whole = _epoch_batches(path)
    assert len(whole) > 3 * group
    monkeypatch.setattr(_packed, "GROUP_BATCHES", group)
    got = _epoch_batches(path)
    assert len(got) == len(whole)
    for a, b in zip(got, whole):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _long_documents(path, lengths, max_samples=3):
    docs = _docs(lengths)
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": d} for i, d in enumerate(docs)],
                  str(path), max_samples=max_samples)
    return docs


def _resumed_at_every_step(path, docs, seq_len, world, then, batch, workers, strict=True):
    """An epoch read on ``world`` ranks in lockstep, its state saved after every step (before
    the first one too); for each saved state, the rest of the epoch read on ``then`` fresh
    ranks: the steps before the cut and the rest after it hold every token of the epoch once.
    Returns the positions (rows) the states were saved at."""
    def loaders(w):
        return [feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(
            path, shuffle=True, seed=7, rank=r, world_size=w), seq_len), batch_size=batch,
            num_workers=workers, route="packed-workers" if workers else "packed")
            for r in range(w)]

    first = loaders(world)
    its = [iter(ld) for ld in first]
    steps: list[list[dict]] = []
    states = [json.loads(json.dumps(first[0].state_dict()))]
    while True:
        step = [next(it, None) for it in its]
        if all(b is None for b in step):
            break
        assert None not in step  # every rank takes as many steps
        steps.append(step)  # type: ignore[arg-type]
        if len(steps) < len(first[0]):  # after the last step the state is the next epoch's
            states.append(json.loads(json.dumps(first[0].state_dict())))
    want = Counter(np.concatenate(docs).tolist())
    assert Counter(_tokens([b for s in steps for b in s])) == want
    for cut, state in enumerate(states):
        assert state["epoch"] == 0
        rest = loaders(then)
        for ld in rest:
            ld.load_state_dict(state, strict=strict)
        tail = _lockstep(rest)
        got = _tokens([b for s in steps[:cut] for b in s]) + [
            t for per in tail for t in _tokens(per)]
        assert Counter(got) == want, (cut, state["position"])
    return [s["position"] for s in states]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seq_len=st.integers(1, 9), world=st.integers(1, 3),
       then=st.integers(1, 3), batch=st.integers(1, 2))
def test_a_state_saved_at_any_row_resumes_to_the_rest_of_the_epoch(
        tmp_path_factory, data, seq_len, world, then, batch):
    """Documents longer than a row, so an epoch has more rows than documents: a state saved
    after any step of the epoch (past the document count too) resumes, on another number of
    ranks as well, to exactly the tokens not yet delivered. With ``world=batch=1`` a state is
    saved at every row of the epoch."""
    # each long document fills three rows or more: more rows than documents, short ones too
    long = data.draw(st.lists(st.integers(3 * seq_len + 1, 6 * seq_len), min_size=1,
                              max_size=3), label="long")
    short = data.draw(st.lists(st.integers(0, seq_len), max_size=2), label="short")
    lengths = data.draw(st.permutations(long + short), label="lengths")
    path = tmp_path_factory.mktemp("long")
    docs = _long_documents(path, lengths)
    rows = -(-sum(lengths) // seq_len)
    assert rows > len(docs)
    saved = _resumed_at_every_step(str(path), docs, seq_len, world, then, batch, workers=0)
    if world == batch == 1:  # every row, the last ones past the document count
        assert saved == list(range(rows))


@pytest.mark.slow
@pytest.mark.parametrize("world,then", [(1, 1), (1, 2), (2, 1)])
def test_worker_processes_resume_at_every_row(tmp_path, world, then):
    """With 2 worker processes saving and resuming, and ``strict=False`` (which started the
    epoch afresh over a state it could not place, repeating tokens): a state saved at every
    step of an epoch of more rows than documents resumes to exactly the rest."""
    lengths = [29, 3, 0, 17, 40]
    docs = _long_documents(tmp_path / "long", lengths)
    saved = _resumed_at_every_step(str(tmp_path / "long"), docs, 6, world, then, 1, workers=2,
                                   strict=False)  # on the packed-workers route
    rows = -(-sum(lengths) // 6)
    assert saved == list(range(0, rows, world)) and rows > 2 * len(docs)


def test_a_row_past_its_epoch_is_refused_naming_the_rows(tmp_path):
    """The saved row is checked against the saved epoch's rows (not its documents)."""
    docs = _long_documents(tmp_path / "long", [37, 3, 21])
    (ld,) = _loaders(str(tmp_path / "long"), 1, 1, seq_len=6)
    state = ld.state_dict()
    rows = -(-sum(len(d) for d in docs) // 6)
    ld.load_state_dict({**state, "position": rows})
    with pytest.raises(StateError, match=f"row {rows + 1} is outside epoch 0, which has "
                                         f"{rows} rows of 6 tokens"):
        ld.load_state_dict({**state, "position": rows + 1})


def _tokenised(sample):
    """A transform that makes each document (as a tokenizer would): workers have work."""
    return {"tokens.npy": np.load(__import__("io").BytesIO(bytes(sample["tokens.npy"])))}


def test_the_auto_route_uses_workers_only_where_a_transform_needs_them(corpus, caplog):
    """Raw ``.npy`` documents of local shards are a copy out of the shards' maps: with
    ``num_workers=2`` and no transform the loader packs in this process (route ``packed``) and
    a log record says why; with a transform making the documents it packs in the workers."""
    import logging

    path, docs = corpus
    want = _tokens(_loaders(path, 1, 2)[0])
    with caplog.at_level(logging.WARNING, logger="feedpipe"):
        ld = feedpipe.FeedLoader(feedpipe.Packed(
            feedpipe.FeedDataset(path, shuffle=True, seed=5), 16), batch_size=2, num_workers=2)
        assert ld.route.name == "packed"
        assert _tokens(list(ld)) == want and "worker_pids" not in ld.stats()
    said = [r.getMessage() for r in caplog.records if "packed" in r.getMessage()]
    assert len(said) == 1 and "leaves the num_workers=2 worker processes unused" in said[0]
    assert "copied straight out of the shards' maps, with no transform" in said[0]
    ld = feedpipe.FeedLoader(feedpipe.Packed(
        feedpipe.FeedDataset(path, shuffle=True, seed=5, transform=_tokenised), 16),
        batch_size=2, num_workers=2)
    assert ld.route.name == "packed-workers"
    assert _tokens(list(ld)) == want and len(ld.stats()["worker_pids"]) == 2


def _count_storages(monkeypatch) -> list[int]:
    """Count the shared-memory storages this process receives from worker processes (each a
    segment of its own, its file descriptor passed by a round trip to the sender)."""
    import functools

    from torch.multiprocessing import reductions

    got = [0]
    for name in ("rebuild_storage_fd", "rebuild_storage_filename"):
        real = getattr(reductions, name)

        # wraps: named as the function it replaces, so that pickle (in a forked worker, where
        # it is the module's function too) still sends it by that name
        @functools.wraps(real)
        def counted(*args, _real=real):
            got[0] += 1
            return _real(*args)
        monkeypatch.setattr(reductions, name, counted)
    return got


def test_worker_processes_send_a_group_of_batches_in_one_buffer(corpus, monkeypatch):
    """``packed-workers``: a worker sends a group of batches to a message, written into one
    shared-memory buffer (a batch's four tensors sent one by one were four shared-memory
    segments, each handed over by a round trip between the processes: 28 times slower than
    packing in this process); the buffers are reused once no batch of them is held, and a
    batch still held is never written over."""
    from feedpipe.stream import _packed

    path, _ = corpus
    monkeypatch.setattr(_packed, "GROUP_BATCHES", 3)  # several groups a worker (forked)
    (ref,) = _loaders(path, 1, 2)
    want = [{k: v.clone() for k, v in b.items()} for b in ref]
    storages = _count_storages(monkeypatch)
    ld = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(path, shuffle=True, seed=5),
                                             16), batch_size=2, num_workers=2,
                             route="packed-workers", persistent_workers=True)
    held = list(ld)  # every batch held: no buffer can be reused under one
    stats = ld.stats()
    assert len(held) == len(want) >= 12 and stats["route"] == "packed-workers"
    for a, b in zip(held, want):
        assert all(torch.equal(a[k], b[k]) for k in b)
    # a group of batches to a message (each worker's first batch alone), one buffer a message
    # and each worker's ring table: not four a batch
    groups = -(-len(want) // 3) + 2
    assert storages[0] <= groups + 2
    assert stats["messages"] <= groups and storages[0] <= stats["messages"] + 2
    del held, a
    before, sent = ld.stats()["buffers"], storages[0]
    for _ in range(2):  # batches let go as they come: their buffers go back to the workers
        ld.set_epoch(0)
        for got, b in zip(ld, want):
            assert all(torch.equal(got[k], b[k]) for k in b)
        del got
    after = ld.stats()["buffers"]
    reused = after["reused"] - before["reused"]
    # a reused buffer is still mapped here: its shipment comes without it
    assert reused > 0
    assert storages[0] - sent <= after["batches"] - before["batches"] - reused + 2
