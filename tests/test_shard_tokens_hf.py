"""``feedpipe.shard_tokens`` from a Hugging Face ``datasets.Dataset`` object: a split of a
``DatasetDict``, a ``Dataset`` (in memory, from its cache files, with an index mapping) and an
``IterableDataset`` become token shards holding the ids a real ``tokenizers`` BPE gives each
document one by one, in the dataset's order, read back through ``feedpipe.Packed``; bad records
(``None``, empty, not a string, a missing column) are named by their dataset index and counted;
a process pool, parts merged and a resumed run write the bytes of one uninterrupted run, and a
resume from another dataset is refused.
"""

from __future__ import annotations

import json
import os

import _tokens
import numpy as np
import pytest

import feedpipe
from feedpipe import shard_tokens
from feedpipe.convert._token_writer import lengths_name
from feedpipe.errors import InputError, OutputError

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

EOS = 1


def _texts(n: int = 120) -> list[str]:
    return _tokens.texts(n, seed=11)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A real BPE tokenizer trained on the corpus's words, saved as tokenizers JSON."""
    return _tokens.train_tokenizer(_texts(), str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _expected(tok_path: str, texts: list[str], eos: int | None = EOS) -> list[list[int]]:
    tok = tokenizers.Tokenizer.from_file(tok_path)
    return [tok.encode(t).ids + ([] if eos is None else [eos]) for t in texts]


def _documents(out: str) -> list[list[int]]:
    import io

    return [np.load(io.BytesIO(bytes(s["tokens.npy"]))).tolist()
            for s in feedpipe.FeedDataset(out)]


def _packed_tokens(out: str, seq_len: int = 16) -> list[int]:
    loader = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(out), seq_len),
                                 batch_size=3)
    got: list[int] = []
    for b in loader:
        got += b["input_ids"][b["labels"] != -100].tolist()
    return got


def _tree_bytes(d: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(d)):
        if not name.startswith("."):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    return out


def test_a_dataset_gives_the_ids_of_tokenising_one_by_one(tmp_path, tok_path):
    texts = _texts()
    ds = datasets.Dataset.from_dict({"id": list(range(len(texts))), "body": texts})
    out = str(tmp_path / "out")
    s = shard_tokens(ds, out, tokenizer=tok_path, text_field="body", eos_id=EOS,
                     chunk_bytes=2000, workers=1)
    want = _expected(tok_path, texts)
    assert s.shards > 1 and s.samples == len(texts) and not s.skipped
    assert _documents(out) == want
    assert _packed_tokens(out) == [t for d in want for t in d]
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    lengths = np.concatenate([np.load(os.path.join(out, lengths_name(r["name"])))
                              for r in m["shards"]])
    assert lengths.tolist() == [len(d) for d in want] and s.tokens == int(lengths.sum())
    assert m["created_by"]["options"]["src"].startswith("datasets.Dataset")


def test_a_dataset_with_an_index_mapping_is_read_in_its_own_order(tmp_path, tok_path):
    texts = _texts(90)
    ds = datasets.Dataset.from_dict({"text": texts}).shuffle(seed=4).select(range(60))
    order = ds["text"]
    out = str(tmp_path / "out")
    shard_tokens(ds, out, tokenizer=tok_path, chunk_bytes=1500, workers=1)
    assert _documents(out) == _expected(tok_path, order, eos=None)


def test_a_datasetdict_split_is_chosen_by_name(tmp_path, tok_path):
    texts = _texts(60)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:40]}),
                               "test": datasets.Dataset.from_dict({"text": texts[40:]})})
    with pytest.raises(InputError, match=r"splits \['test', 'train'\]; pass split="):
        shard_tokens(dd, str(tmp_path / "a"), tokenizer=tok_path, workers=1)
    with pytest.raises(InputError, match=r"no split 'valid'"):
        shard_tokens(dd, str(tmp_path / "b"), tokenizer=tok_path, split="valid", workers=1)
    s = shard_tokens(dd, str(tmp_path / "c"), tokenizer=tok_path, split="test", eos_id=EOS,
                     workers=1)
    assert _documents(str(tmp_path / "c")) == _expected(tok_path, texts[40:])
    assert s.samples == 20
    assert s.skipped_inputs == [] and json.loads((tmp_path / "c" / "manifest.json").read_text())[
        "created_by"]["options"]["src"] == "datasets.DatasetDict['test'] (20 rows)"
    with pytest.raises(ValueError, match="split='test' chooses a split of a DatasetDict"):
        shard_tokens(dd["test"], str(tmp_path / "d"), tokenizer=tok_path, split="test")
    with pytest.raises(ValueError, match="is a path: leave split out"):
        shard_tokens(str(tmp_path / "c.jsonl"), str(tmp_path / "e"), tokenizer=tok_path,
                     split="test")


def _bad_dataset():
    return datasets.Dataset.from_dict({"text": ["alpha beta", None, "", "gamma", None]})


def test_a_bad_record_raises_naming_its_dataset_index(tmp_path, tok_path):
    with pytest.raises(InputError, match=r"dataset\[1\]: bad record \(missing field\)"):
        shard_tokens(_bad_dataset(), str(tmp_path / "out"), tokenizer=tok_path, workers=1)


def test_bad_records_left_out_are_named_by_index_and_counted(tmp_path, tok_path):
    out = str(tmp_path / "out")
    s = shard_tokens(_bad_dataset(), out, tokenizer=tok_path, on_error="skip", workers=1)
    assert s.samples == 2 and s.skipped == 3
    assert s.bad_records == {"empty text": 1, "missing field": 2}
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [e["path"] for e in m["skipped"]] == ["dataset[1]", "dataset[2]", "dataset[4]"]
    assert _documents(out) == _expected(tok_path, ["alpha beta", "gamma"], eos=None)
    nums = datasets.Dataset.from_dict({"text": [1, 2]})
    with pytest.raises(InputError, match=r"dataset\[0\]: bad record \(not a string\)"):
        shard_tokens(nums, str(tmp_path / "n"), tokenizer=tok_path, workers=1)
    with pytest.raises(InputError, match=r"dataset\[0\]: bad record \(missing field\): no "
                                         r"column 'text' \(it has \['body'\]\)"):
        shard_tokens(datasets.Dataset.from_dict({"body": ["x"]}), str(tmp_path / "m"),
                     tokenizer=tok_path, workers=1)


def test_a_pool_parts_and_a_resume_write_the_bytes_of_one_process(tmp_path, tok_path):
    texts = _texts(200)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    ds = datasets.load_from_disk(str(tmp_path / "saved"))  # pickled as its cache files
    one = str(tmp_path / "one")
    kw = {"tokenizer": tok_path, "eos_id": EOS, "chunk_bytes": 2500}
    shard_tokens(ds, one, workers=1, **kw)
    pool = str(tmp_path / "pool")
    s = shard_tokens(ds, pool, workers=2, **kw)
    assert s.executor == "process pool, 2 workers"
    assert _tree_bytes(one) == _tree_bytes(pool)
    parts = str(tmp_path / "parts")
    for i in range(3):
        s = shard_tokens(ds, parts, workers=1, part=(i, 3), merge=True, **kw)
    assert s.merged and _documents(parts) == _expected(tok_path, texts)

    tok = tokenizers.Tokenizer.from_file(tok_path)

    class Failing:  # the third unit's tokenising fails: two shards are committed by then
        vocab_size = tok.get_vocab_size()
        calls = 0

        def __call__(self, batch):
            Failing.calls += 1
            if Failing.calls == 3:
                raise RuntimeError("interrupted")
            return [e.ids for e in tok.encode_batch(batch)]

    resumed = str(tmp_path / "resumed")
    kw["tokenizer"] = Failing()
    with pytest.raises(RuntimeError, match="interrupted"):
        shard_tokens(ds, resumed, workers=1, **kw)
    assert "data-000001.tar" in os.listdir(resumed)
    datasets.Dataset.from_dict({"text": texts[::-1]}).save_to_disk(str(tmp_path / "other"))
    other = datasets.load_from_disk(str(tmp_path / "other"))  # as long, other files
    with pytest.raises(OutputError, match="cannot resume: .*dataset"):
        shard_tokens(other, resumed, workers=1, resume=True, **kw)
    s = shard_tokens(ds, resumed, workers=1, resume=True, **kw)
    assert s.reused_shards == 2
    got, want = _tree_bytes(resumed), _tree_bytes(one)
    del got["manifest.json"], want["manifest.json"]  # (which names the tokenizer)
    assert got == want and len(got) > 6
    assert _documents(resumed) == _expected(tok_path, texts)


def test_an_iterable_dataset_is_cut_by_its_shards(tmp_path, tok_path):
    texts = _texts(90)
    rows = texts[:30] + [None] + texts[30:]
    it = datasets.Dataset.from_dict({"text": rows}).to_iterable_dataset(num_shards=3)
    out = str(tmp_path / "out")
    s = shard_tokens(it, out, tokenizer=tok_path, eos_id=EOS, on_error="skip", workers=1)
    assert s.shards == 3 and s.samples == 90
    assert [e["path"] for e in s.skipped_inputs] == ["dataset shard 0 of 3, record 30"]
    assert _documents(out) == _expected(tok_path, texts)
    pool = str(tmp_path / "pool")
    shard_tokens(it, pool, tokenizer=tok_path, eos_id=EOS, on_error="skip", workers=2)
    assert _tree_bytes(out) == _tree_bytes(pool)
