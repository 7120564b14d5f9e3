"""``feedpipe shard --tokenizer``: text corpora into token shards.

Every format's documents come out as the ids a real ``tokenizers`` tokenizer (trained here on the
fly) gives them one by one, in input order, read back through ``feedpipe.Packed`` token for
token; bad records are named and counted; workers, parts and a resume after SIGKILL give the same
bytes as one uninterrupted run in one process.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap

import _tokens
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe import shard_tokens
from feedpipe.cli import main
from feedpipe.convert._text_inputs import list_units, read_unit
from feedpipe.convert._token_shard import lengths_name
from feedpipe.errors import InputError
from feedpipe.transforms._tokenizer import dtype_for

tokenizers = pytest.importorskip("tokenizers")

EOS = 1


def _texts(n: int = 120) -> list[str]:
    return _tokens.texts(n, seed=7)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A real BPE tokenizer trained on the corpus's words, saved as tokenizers JSON."""
    return _tokens.train_tokenizer(_texts(), str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _expected(tok_path: str, texts: list[str], eos: int | None = EOS) -> list[list[int]]:
    tok = tokenizers.Tokenizer.from_file(tok_path)
    return [tok.encode(t).ids + ([] if eos is None else [eos]) for t in texts]


def _documents(out: str) -> list[list[int]]:
    """Every document of the dataset in sample order, read through FeedDataset."""
    ds = feedpipe.FeedDataset(out)
    return [np.load(__import__("io").BytesIO(bytes(s["tokens.npy"]))).tolist() for s in ds]


def _packed_tokens(out: str, seq_len: int = 16) -> list[int]:
    loader = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(out), seq_len),
                                 batch_size=3)
    got: list[int] = []
    for b in loader:
        got += b["input_ids"][b["labels"] != -100].tolist()
    return got


def _write_jsonl(path, texts, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")


def _tree_bytes(d: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(d)):
        if not name.startswith(".") or name.startswith(".feedpipe-part"):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "tree"])
def test_every_format_gives_the_ids_of_tokenising_one_by_one(tmp_path, tok_path, fmt):
    texts = _texts()
    src = tmp_path / "src"
    src.mkdir()
    if fmt == "jsonl":
        _write_jsonl(src / "a.jsonl", texts[:70])
        _write_jsonl(src / "b.jsonl", texts[70:])
    elif fmt == "jsonl.gz":  # a compressed file is one unit: two files, two shards
        _write_jsonl(src / "a.jsonl.gz", texts[:50], gzip.open)
        _write_jsonl(src / "b.jsonl.gz", texts[50:], gzip.open)
    elif fmt == "jsonl.zst":
        zstd = pytest.importorskip("zstandard")
        for name, part in (("a", texts[:50]), ("b", texts[50:])):
            raw = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
            (src / f"{name}.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(raw))
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}),
                       str(src / "a.parquet"), row_group_size=25)
    elif fmt == "arrow":  # the Hugging Face datasets cache: an Arrow IPC stream
        pa = pytest.importorskip("pyarrow")
        for k, part in enumerate((texts[:50], texts[50:])):
            table = pa.table({"text": part})
            with pa.OSFile(str(src / f"data-0000{k}-of-00002.arrow"), "wb") as f, \
                    pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(table)
    else:
        for i, t in enumerate(texts):
            (src / f"{i // 50}").mkdir(exist_ok=True)
            (src / f"{i // 50}" / f"f{i:04d}.md").write_text(t, encoding="utf-8")
    out = str(tmp_path / "out")
    s = shard_tokens(str(src), out, tokenizer=tok_path, eos_id=EOS, chunk_bytes=2000, workers=1)
    want = _expected(tok_path, texts)
    assert s.shards > 1  # the corpus was cut into several units
    assert _documents(out) == want
    assert _packed_tokens(out) == [t for d in want for t in d]
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    lengths = np.concatenate([np.load(os.path.join(out, lengths_name(r["name"])))
                              for r in m["shards"]])
    assert lengths.tolist() == [len(d) for d in want]
    assert m["created_by"]["tokens"]["dtype"] == "uint16"
    assert s.samples == len(texts) and s.tokens == int(lengths.sum()) and not s.skipped


def test_workers_and_a_pool_write_the_bytes_of_one_process(tmp_path, tok_path):
    texts = _texts(300)
    _write_jsonl(tmp_path / "c.jsonl", texts)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    shard_tokens(str(tmp_path / "c.jsonl"), one, tokenizer=tok_path, chunk_bytes=3000, workers=1)
    s = shard_tokens(str(tmp_path / "c.jsonl"), two, tokenizer=tok_path, chunk_bytes=3000,
                     workers=2)
    assert s.executor == "process pool, 2 workers"
    assert _tree_bytes(one) == _tree_bytes(two)
    assert _documents(two) == _expected(tok_path, texts, eos=None)


def test_parts_merged_hold_the_documents_of_one_run(tmp_path, tok_path):
    texts = _texts(200)
    _write_jsonl(tmp_path / "c.jsonl", texts)
    out = str(tmp_path / "out")
    for i in range(3):
        s = shard_tokens(str(tmp_path / "c.jsonl"), out, tokenizer=tok_path, eos_id=EOS,
                         chunk_bytes=2000, workers=1, part=(i, 3), merge=True)
    assert s.merged
    assert _documents(out) == _expected(tok_path, texts)


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.text(alphabet="ab \n\u00e9", max_size=12).map(
    lambda t: json.dumps({"text": t.replace("\n", " ") or "x"})), min_size=1, max_size=30),
       chunk=st.integers(1, 80))
def test_byte_ranges_of_a_jsonl_file_read_every_line_once_in_order(tmp_path_factory, lines,
                                                                   chunk):
    d = tmp_path_factory.mktemp("r")
    (d / "c.jsonl").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    units = list_units(str(d), ["c.jsonl"], chunk)
    got = [t for u in units for _, t in read_unit(str(d), u, "text")]
    assert got == [json.loads(x)["text"] for x in lines]


def _bad_corpus(tmp_path) -> str:
    good = json.dumps({"text": "alpha beta"}).encode()
    lines = [good, json.dumps({"text": ""}).encode(), json.dumps({"body": "x"}).encode(),
             json.dumps({"text": 5}).encode(), b'{"text": "caf\xe9"}', b"{not json", good]
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    return str(p)


def test_a_bad_record_raises_naming_its_line(tmp_path, tok_path):
    src = _bad_corpus(tmp_path)
    with pytest.raises(InputError, match=r"bad\.jsonl:2: bad record \(empty text\)"):
        shard_tokens(src, str(tmp_path / "out"), tokenizer=tok_path, workers=1)


def test_skipped_bad_records_are_named_and_counted(tmp_path, tok_path, capsys):
    src = _bad_corpus(tmp_path)
    out = str(tmp_path / "out")
    assert main(["shard", src, out, "--tokenizer", tok_path, "--on-error", "skip",
                 "--no-progress", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["samples"] == 2 and s["skipped"] == 5
    assert s["bad_records"] == {"empty text": 1, "invalid UTF-8": 1, "missing field": 1,
                                "not JSON": 1, "not a string": 1}
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [e["path"] for e in m["skipped"]] == [f"bad.jsonl:{i}" for i in (2, 3, 4, 5, 6)]
    assert m["num_skipped"] == 5
    assert "invalid UTF-8 at byte 13" in m["skipped"][3]["reason"]


def test_a_missing_column_of_a_table_is_named_for_each_row(tmp_path, tok_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), str(tmp_path / "t.parquet"))
    with pytest.raises(InputError, match=r"t\.parquet row 0: bad record \(missing field\): "
                                         r"no column 'text' \(it has \['body'\]\)"):
        shard_tokens(str(tmp_path / "t.parquet"), str(tmp_path / "out"), tokenizer=tok_path,
                     workers=1)


def test_the_dtype_is_the_smallest_that_holds_the_vocabulary_and_any_callable_tokenizes(
        tmp_path):
    _write_jsonl(tmp_path / "c.jsonl", ["héllo", "wörld"])

    def by_bytes(texts):  # the hook: any callable from texts to ids
        return [list(t.encode()) for t in texts]

    out = str(tmp_path / "out")
    s = shard_tokens(str(tmp_path / "c.jsonl"), out, tokenizer=by_bytes, vocab_size=256,
                     eos_id=0, workers=1)
    docs = _documents(out)
    assert docs == [list("héllo".encode()) + [0], list("wörld".encode()) + [0]]
    assert s.tokens == sum(map(len, docs))
    assert np.load(os.path.join(out, "data-000000.lengths.npy")).tolist() == [7, 7]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())[
        "created_by"]["tokens"]["dtype"] == "uint8"
    assert [str(dtype_for(n)) for n in (2, 256, 257, 65536, 65537, 2**32 + 1)] == [
        "uint8", "uint8", "uint16", "uint16", "uint32", "int64"]
    with pytest.raises(ValueError, match="outside its vocabulary of 100"):
        shard_tokens(str(tmp_path / "c.jsonl"), str(tmp_path / "o2"), tokenizer=by_bytes,
                     vocab_size=100, workers=1)


def test_options_a_token_conversion_cannot_apply_are_refused(tmp_path, tok_path, capsys):
    _write_jsonl(tmp_path / "c.jsonl", ["a"])
    assert main(["shard", str(tmp_path / "c.jsonl"), str(tmp_path / "o"), "--tokenizer",
                 tok_path, "--shuffle"]) != 0
    assert "--shuffle cannot apply with --tokenizer" in capsys.readouterr().err


_KILLED_RUN = textwrap.dedent("""
    import os, sys
    from tokenizers import Tokenizer
    from feedpipe.convert._token_shard import shard_tokens

    src, out, tok_path, block = sys.argv[1:5]
    tok = Tokenizer.from_file(tok_path)

    class Tok:
        vocab_size = tok.get_vocab_size()
        calls = 0

        def __call__(self, texts):
            Tok.calls += 1
            if block == "block" and Tok.calls == 3:  # two shards are committed by now
                os.write(1, b"R")
                os.read(0, 1)  # never answered: the parent kills this process here
            return [e.ids for e in tok.encode_batch(texts)]

    shard_tokens(src, out, tokenizer=Tok(), eos_id=1, chunk_bytes=2000, workers=1,
                 resume=block == "resume", show_progress=False)
""")


def test_a_conversion_killed_mid_way_resumes_to_the_bytes_of_an_uninterrupted_run(
        tmp_path, tok_path):
    texts = _texts(200)
    _write_jsonl(tmp_path / "c.jsonl", texts)
    script = tmp_path / "run.py"
    script.write_text(_KILLED_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    src, killed, whole = str(tmp_path / "c.jsonl"), str(tmp_path / "k"), str(tmp_path / "w")
    p = subprocess.Popen([sys.executable, str(script), src, killed, tok_path, "block"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.read(1) == b"R"  # tokenising its third shard
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait()
    names = os.listdir(killed)
    assert "data-000001.tar" in names and "manifest.json" not in names
    assert any(n.startswith(".data-000002.tar.part") for n in names)  # killed while writing
    subprocess.run([sys.executable, str(script), src, killed, tok_path, "resume"], check=True,
                   env=env)
    subprocess.run([sys.executable, str(script), src, whole, tok_path, "plain"], check=True,
                   env=env)
    assert _tree_bytes(killed) == _tree_bytes(whole)
    assert _documents(killed) == _expected(tok_path, texts)


def test_a_dask_cluster_writes_the_bytes_of_one_process(tmp_path, tok_path):
    distributed = pytest.importorskip("distributed")
    texts = _texts(200)
    _write_jsonl(tmp_path / "c.jsonl", texts)
    one, on_dask = str(tmp_path / "one"), str(tmp_path / "dask")
    shard_tokens(str(tmp_path / "c.jsonl"), one, tokenizer=tok_path, eos_id=EOS,
                 chunk_bytes=3000, workers=1)
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  host="127.0.0.1", dashboard_address=None) as cluster, \
            distributed.Client(cluster.scheduler_address) as client:
        s = shard_tokens(str(tmp_path / "c.jsonl"), on_dask, tokenizer=tok_path, eos_id=EOS,
                         chunk_bytes=3000, dask=client)
    assert s.executor == "tasks on the Dask cluster at a dask.distributed Client"
    assert _tree_bytes(one) == _tree_bytes(on_dask)
    assert _documents(on_dask) == _expected(tok_path, texts)


def _rows(out: str, seq_len: int = 16) -> list[list[int]]:
    loader = feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(out, shuffle=True, seed=3),
                                                 seq_len), batch_size=4)
    return [row for b in loader for row in b["input_ids"].tolist()]


def test_packed_plans_a_token_dataset_from_its_lengths_without_reading_a_header(
        tmp_path, tok_path, monkeypatch):
    texts = _texts(150)
    _write_jsonl(tmp_path / "c.jsonl", texts)
    out = str(tmp_path / "out")
    shard_tokens(str(tmp_path / "c.jsonl"), out, tokenizer=tok_path, eos_id=EOS,
                 chunk_bytes=2500, workers=1)
    from feedpipe.stream._token_docs import TokenDocs

    def no_scan(*_a, **_k):
        raise AssertionError("a header scan: the lengths files were not used")

    with monkeypatch.context() as m:
        m.setattr(TokenDocs, "_scan", no_scan)
        fast = _rows(out)
        assert _packed_tokens(out) == [t for d in _expected(tok_path, texts) for t in d]
    for name in os.listdir(out):  # the same rows planned from the .npy headers
        if name.endswith(".lengths.npy"):
            os.unlink(os.path.join(out, name))
    assert fast == _rows(out)


def test_a_lengths_file_that_does_not_fit_its_shard_is_not_trusted(tmp_path, tok_path):
    texts = _texts(150)
    _write_jsonl(tmp_path / "c.jsonl", texts)
    out = str(tmp_path / "out")
    shard_tokens(str(tmp_path / "c.jsonl"), out, tokenizer=tok_path, chunk_bytes=2500,
                 workers=1)
    right = _rows(out)
    a, b = (os.path.join(out, f"data-00000{i}.lengths.npy") for i in (0, 1))
    la, lb = np.load(a), np.load(b)
    np.save(a, lb[:len(la)] if len(lb) >= len(la) else np.resize(lb, len(la)))  # wrong counts
    np.save(b, lb[:-1])  # one entry short
    assert _rows(out) == right


def test_the_progress_bar_counts_tokens(tmp_path, tok_path, capsys):
    _write_jsonl(tmp_path / "c.jsonl", _texts(50))
    s = shard_tokens(str(tmp_path / "c.jsonl"), str(tmp_path / "out"), tokenizer=tok_path,
                     workers=1, show_progress=True)
    err = capsys.readouterr().err
    assert "tok/s" in err and f"tokenize: {s.tokens / 1000:.2f}ktok" in err, err


def test_a_mixture_of_token_datasets_packs_the_same_rows_from_the_lengths(tmp_path, tok_path,
                                                                         monkeypatch):
    outs = []
    for name, texts in (("a", _texts(80)), ("b", _texts(40)[::-1])):
        _write_jsonl(tmp_path / f"{name}.jsonl", texts)
        outs.append(str(tmp_path / name))
        shard_tokens(str(tmp_path / f"{name}.jsonl"), outs[-1], tokenizer=tok_path,
                     eos_id=EOS, chunk_bytes=1500, workers=1)

    def rows() -> list[list[int]]:
        mix = feedpipe.Mixture({"a": feedpipe.FeedDataset(outs[0], shuffle=True),
                                "b": feedpipe.FeedDataset(outs[1], shuffle=True)},
                               weights={"a": 2, "b": 1}, epoch_size=90, seed=1)
        loader = feedpipe.FeedLoader(feedpipe.Packed(mix, 32), batch_size=2)
        return [r for b in loader for r in b["input_ids"].tolist()]

    from feedpipe.stream._token_docs import TokenDocs

    def no_scan(*_a, **_k):
        raise AssertionError("a header scan: the lengths files were not used")

    with monkeypatch.context() as m:
        m.setattr(TokenDocs, "_scan", no_scan)
        fast = rows()
    for out in outs:
        for name in os.listdir(out):
            if name.endswith(".lengths.npy"):
                os.unlink(os.path.join(out, name))
    assert fast == rows()
