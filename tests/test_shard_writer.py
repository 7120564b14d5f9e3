"""``feedpipe.ShardWriter``: in-memory samples written in ``feedpipe shard``'s format (the same
bytes for the same samples), values encoded without pickle, bad samples refused with a sentence,
nothing half-written, and parallel writing by parts from a process pool and a Dask bag."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from conftest import read_dataset, run_feedpipe, write_tree

import feedpipe
from feedpipe.convert._shard_writer import ShardWriter, write_samples
from feedpipe.errors import FieldTypeError, InputError, KeyClashError, OutputError
from feedpipe.format._index import parse_index
from feedpipe.format._keys import decode_key, encode_key
from feedpipe.format._manifest import load_manifest


def _fields(s: dict[str, object]) -> dict[str, bytes]:
    return {k: v for k, v in s.items() if not k.startswith("__")}  # type: ignore[misc]


def _shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".idx")}


@pytest.mark.parametrize(("max_samples", "max_bytes"), [(3, None), (None, 5000), (None, None)])
def test_same_shards_and_indexes_as_feedpipe_shard(tmp_path: Path, max_samples: int | None,
                                                   max_bytes: int | None) -> None:
    # a tree (with odd names and a class layout) and the same samples as dicts
    names = [f"{c}/{i:02d}.{ext}" for c in ("cat", "dog") for i in range(5)
             for ext in ("jpg", "json")] + ["cat/x.v2.jpg", "dog/" + "n" * 120 + ".jpg"]
    files = write_tree(tmp_path / "src", names)
    size = {} if max_bytes is None else {"max_bytes": max_bytes}
    feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "tree"), labels_from_dirs=True,
                   max_samples=max_samples, workers=1, **size)
    samples: dict[str, dict[str, Any]] = {}
    for rel in sorted(files):
        stem, ext = rel.rsplit(".", 1)
        samples.setdefault(stem, {"__key__": stem})[ext] = files[rel]
    with ShardWriter(str(tmp_path / "mem"), max_samples=max_samples, classes=["cat", "dog"],
                     **size) as w:
        for key in sorted(samples, key=encode_key):  # feedpipe shard's order
            s = samples[key]
            w.write({**s, "cls": ["cat", "dog"].index(key.split("/")[0])})
    assert _shard_files(tmp_path / "mem") == _shard_files(tmp_path / "tree")
    tree = json.loads((tmp_path / "tree" / "manifest.json").read_text())
    mem = json.loads((tmp_path / "mem" / "manifest.json").read_text())
    for k in ("shards", "total_samples", "fields", "classes", "skipped"):
        assert mem[k] == tree[k], k
    assert mem["created_by"]["tool"] == "feedpipe.ShardWriter"
    assert json.loads((tmp_path / "mem" / "wids.json").read_text())["shardlist"][0]["nsamples"]


def test_values_are_encoded_without_pickle_and_read_back(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = tmp_path / "o"
    with ShardWriter(str(out)) as w:
        key = w.write({"__key__": "a/cat.v2", "jpg": memoryview(b"\xff\xd8jpeg"), "txt": "chat é",
                       "cls": 3, "score": 0.25, "npy": arr, "n": np.int64(7),
                       "__shard__": "ignored", "none": None})
        w.write({"__key__": "b", "bin": bytearray(b"\x00\x01")})
    assert key == "a/cat%2Ev2" and decode_key(key) == "a/cat.v2"
    got = read_dataset(out)
    assert [s["__key__"] for s in got] == ["a/cat%2Ev2", "b"]
    fields = _fields(got[0])
    assert set(fields) == {"jpg", "txt", "cls", "score", "npy", "n"}
    assert fields["jpg"] == b"\xff\xd8jpeg" and fields["txt"] == "chat é".encode()
    assert fields["cls"] == b"3" and fields["score"] == b"0.25" and fields["n"] == b"7"
    back = np.load(io.BytesIO(fields["npy"]), allow_pickle=False)
    assert back.dtype == np.float32 and (back == arr).all()
    # the webdataset library, the oracle, reads the same samples
    urls = [str(out / r.name) for r in load_manifest(str(out)).shards]
    theirs = [(s["__key__"], _fields(s)) for s in wds.WebDataset(urls, shardshuffle=False)]
    assert theirs == [(str(s["__key__"]), _fields(s)) for s in got]
    # and every index entry points at its member's data, as tarfile sees it
    for rec in load_manifest(str(out)).shards:
        idx = parse_index((out / rec.name).with_suffix(".idx").read_text(), rec.name)
        with tarfile.open(out / rec.name) as t:
            data = {m.name: (m.offset_data, m.size) for m in t.getmembers()}
        assert {n: (o, s) for n, o, s in zip(idx.names, idx.offsets, idx.sizes)} == data


def test_anything_else_is_refused_with_a_sentence_unless_an_encoder_is_given(
        tmp_path: Path) -> None:
    w = ShardWriter(str(tmp_path / "o"), encoders={"json": lambda v: json.dumps(v).encode()})
    with pytest.raises(FieldTypeError, match=r"sample #0 \('k'\): field 'meta': cannot store a "
                                             r"builtins.dict without a codec.*encoders="):
        w.write({"__key__": "k", "meta": {"a": 1}})
    assert isinstance(FieldTypeError("x"), TypeError)
    w.write({"__key__": "k", "json": {"a": [1, 2]}})
    for bad, match in [({"x": np.array([object()])}, "needs pickle"),
                       ({"flag": True}, "bool is ambiguous"),
                       ({"t": object()}, "cannot store a builtins.object")]:
        with pytest.raises(FieldTypeError, match=match):
            w.write({"__key__": "other", **bad})
    m = w.close()
    assert m.total_samples == 1 and m.fields == ["json"]
    assert read_dataset(tmp_path / "o")[0]["json"] == b'{"a": [1, 2]}'


@pytest.mark.parametrize(("sample", "error", "match"), [
    ({"jpg": b"x"}, InputError, "no '__key__'"),
    ({"__key__": 7, "jpg": b"x"}, InputError, "must be a str"),
    ({"__key__": "../up", "jpg": b"x"}, InputError, "not a relative path"),
    ({"__key__": "/abs", "jpg": b"x"}, InputError, "not a relative path"),
    ({"__key__": "a//b", "jpg": b"x"}, InputError, "not a relative path"),
    ({"__key__": "k", "my field": b"x"}, InputError, "cannot be a tar member extension"),
    ({"__key__": "k", "none": None}, InputError, "no field to store"),
    # issue 41: said only "every value is None" of a sample whose fields were all metadata
    ({"__key__": "k", "__index_level_0__": 3}, InputError,
     "'__index_level_0__': a name between double underscores is metadata"),
    ({"__key__": "k", "cls": 2}, InputError, "cls 2 is not an index into the 2 classes"),
])
def test_bad_samples_are_refused_and_nothing_is_written(
        tmp_path: Path, sample: dict[str, Any], error: type, match: str) -> None:
    out = tmp_path / "o"
    with pytest.raises(error, match=match), ShardWriter(str(out), classes=["a", "b"]) as w:
        w.write({"__key__": "fine", "jpg": b"ok"})
        w.write(sample)
    assert os.listdir(out) == []  # the committed part removed too: no dataset, no temp file


def test_a_class_name_as_cls_is_stored_as_its_index_or_refused(tmp_path: Path) -> None:
    """With ``classes`` given, a str ``cls`` is a class name: stored as its index (what the
    manifest's classes say cls values are), or refused; it used to be stored as text."""
    with ShardWriter(str(tmp_path / "o"), classes=["a", "b"]) as w:
        w.write({"__key__": "k0", "cls": "b"})
        w.write({"__key__": "k1", "cls": 0})
        with pytest.raises(InputError, match=r"'k2'.*cls 'c' is not one of the 2 classes "
                                             r"\['a', 'b'\]"):
            w.write({"__key__": "k2", "cls": "c"})
        with pytest.raises(InputError, match=r"cls -1 is not an index into the 2 classes"):
            w.write({"__key__": "k3", "cls": np.int64(-1)})
    assert [s["cls"] for s in read_dataset(tmp_path / "o")] == [b"1", b"0"]
    with ShardWriter(str(tmp_path / "free")) as w:  # no classes: a str is text, as before
        w.write({"__key__": "k", "cls": "b"})
    assert read_dataset(tmp_path / "free")[0]["cls"] == b"b"


def test_shard_from_an_iterable_of_dicts_points_to_write_samples(tmp_path: Path) -> None:
    """shard_from takes a Hugging Face dataset; sample dicts go through write_samples (a plain
    sentence, before the datasets extra is asked for)."""
    samples = ({"__key__": str(i), "txt": "x"} for i in range(2))
    for given, name in [(samples, "generator"), ([{"__key__": "0", "txt": "x"}], "list")]:
        with pytest.raises(TypeError, match=rf"shard_from takes a Hugging Face datasets\.Dataset"
                                            rf".*not a {name}.*feedpipe\.write_samples"):
            feedpipe.shard_from(given, str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_duplicate_keys_are_refused_naming_both(tmp_path: Path) -> None:
    with ShardWriter(str(tmp_path / "o"), max_samples=1) as w:
        w.write({"__key__": "a.b", "jpg": b"1"})
        w.write({"__key__": "c", "jpg": b"2"})
        with pytest.raises(KeyClashError, match=r"'a%2Eb': sample #2 and sample #0"):
            w.write({"__key__": "a.b", "txt": "3"})
        w.write({"__key__": "d", "jpg": b"4"})  # the writer goes on
    assert [s["__key__"] for s in read_dataset(tmp_path / "o")] == ["a%2Eb", "c", "d"]


def test_a_failure_midway_leaves_no_shard_and_no_temp_file(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(str(out), max_samples=2) as w:
        for i in range(5):
            w.write({"__key__": str(i), "bin": b"x" * 600})
        assert len([n for n in os.listdir(out) if n.endswith(".tar")]) == 2
        raise RuntimeError("boom")
    assert os.listdir(out) == []
    with pytest.raises(OutputError, match="not empty"):
        (out / "keep.txt").write_text("x")
        ShardWriter(str(out))
    with pytest.raises(InputError, match="no sample was written"), \
            ShardWriter(str(tmp_path / "empty")):
        pass


# -------------------------------------------------------------------------------------------
# parallel writing: parts, then merge


def make_sample(i: int) -> dict[str, Any]:
    """Sample ``i`` of the parallel tests (a top-level function: workers get it by name)."""
    return {"__key__": f"{i:05d}", "jpg": bytes([i % 256]) * (100 + i), "cls": i % 3,
            "txt": f"sample {i}"}


def _samples(root: Path) -> list[tuple[object, dict[str, bytes]]]:
    """(key, fields) of every sample in dataset order (shard names differ between parts)."""
    return [(s["__key__"], _fields(s)) for s in read_dataset(root)]


def _serial(tmp_path: Path, n: int) -> list[tuple[object, dict[str, bytes]]]:
    write_samples((make_sample(i) for i in range(n)), str(tmp_path / "serial"), max_samples=4,
                  classes=["a", "b", "c"])
    return _samples(tmp_path / "serial")


def test_parts_from_a_process_pool_then_merge(tmp_path: Path) -> None:
    n, parts = 30, 3
    out = tmp_path / "parts"
    with ProcessPoolExecutor(2) as pool:
        futs = [pool.submit(write_samples, [make_sample(i) for i in range(k * 10, k * 10 + 10)],
                            str(out), part=(k, parts), max_samples=4, classes=["a", "b", "c"])
                for k in range(parts)]
        assert [f.result().created_by["part"] for f in futs] == ["0/3", "1/3", "2/3"]
    assert not (out / "manifest.json").exists()
    m = feedpipe.merge(str(out))
    assert m.total_samples == n and m.classes == ["a", "b", "c"]
    assert m.created_by["tool"] == "feedpipe.ShardWriter parts + feedpipe merge"
    assert _samples(out) == _serial(tmp_path, n)
    assert feedpipe.verify(str(out)).ok


def test_parts_from_a_dask_bag_then_merge(tmp_path: Path) -> None:
    dask = pytest.importorskip("dask", reason="the dask extra is not installed")
    import dask.bag as db
    cloudpickle = pytest.importorskip("cloudpickle")

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    n = 30
    out = tmp_path / "dask"
    bag = db.from_sequence(range(n), npartitions=3).map(make_sample)
    chunks = bag.to_delayed()
    tasks = [dask.delayed(write_samples)(c, str(out), part=(i, len(chunks)), max_samples=4,
                                         classes=["a", "b", "c"], merge=True)
             for i, c in enumerate(chunks)]
    dask.compute(*tasks, scheduler="processes", num_workers=2)
    assert (out / "manifest.json").exists()  # the last part to finish merged
    assert _samples(out) == _serial(tmp_path, n)


def test_parts_of_different_options_are_not_merged(tmp_path: Path) -> None:
    out = tmp_path / "o"
    write_samples([make_sample(0)], str(out), part=(0, 2), max_samples=4)
    write_samples([make_sample(1)], str(out), part=(1, 2), max_samples=5)
    with pytest.raises(feedpipe.PartsError, match="other inputs or options"):
        feedpipe.merge(str(out))


def _copied_parts(out: Path, *, merge: bool = False) -> list[Any]:
    """Two parts that each wrote keys 0000..0004 (each writer sees only its own keys)."""
    return [write_samples(({"__key__": f"{j:04d}", "txt": "x"} for j in range(5)), str(out),
                          part=(i, 2), merge=merge) for i in (0, 1)]


def test_merge_refuses_a_key_written_by_two_parts(tmp_path: Path) -> None:
    out = tmp_path / "par"
    _copied_parts(out)
    with pytest.raises(feedpipe.PartsError) as ei:
        feedpipe.merge(str(out))
    msg = str(ei.value)
    assert "'0000'" in msg and "data-p00000of00002-000000.tar" in msg, msg
    assert "data-p00001of00002-000000.tar" in msg and "distinct keys" in msg, msg
    assert not (out / "manifest.json").exists()
    r = run_feedpipe("merge", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'0000'" in r.stderr
    # merge=True: the last writer's merge refuses; both parts stay committed, no temp file
    other = tmp_path / "auto"
    with pytest.raises(feedpipe.PartsError, match="'0000'"):
        _copied_parts(other, merge=True)
    names = sorted(os.listdir(other))
    assert "manifest.json" not in names and not [n for n in names if ".tmp" in n]
    assert len([n for n in names if n.endswith(".tar")]) == 2


@pytest.mark.dali
def test_dali_reads_shardwriter_output_with_its_indexes(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed (the dali extra)")
    from nvidia.dali import fn, pipeline_def, types

    out = tmp_path / "o"
    write_samples((make_sample(i) for i in range(7)), str(out), max_samples=3)
    m = load_manifest(str(out))
    tars = [str(out / r.name) for r in m.shards]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
    def pipe():  # type: ignore[no-untyped-def]
        return tuple(fn.readers.webdataset(
            paths=tars, index_paths=[t[:-4] + ".idx" for t in tars], ext=m.fields,
            random_shuffle=False, name="reader", dtypes=[types.UINT8] * len(m.fields)))

    p = pipe()
    p.build()
    assert p.epoch_size("reader") == 7
    for _key, fields in _samples(out):
        outs = p.run()
        assert {e: bytes(memoryview(outs[i].at(0))) for i, e in enumerate(m.fields)} == fields


def test_every_numeric_form_of_cls_is_checked_and_stored_as_an_integer(tmp_path: Path) -> None:
    """cls=7 was refused with 2 classes but 7.0 or a NumPy float was stored as "7.0", unchecked,
    to fail at training time."""
    with ShardWriter(str(tmp_path / "o"), classes=["a", "b"]) as w:
        for i, v in enumerate([1.0, np.float64(1.0), np.int64(1), np.array(1), np.float32(0)]):
            w.write({"__key__": f"ok{i}", "cls": v})
        for i, v in enumerate([7.0, np.float64(7.0), np.float32(2), np.int64(7), np.array(2)]):
            with pytest.raises(InputError, match=rf"'bad{i}'.*cls 7|'bad{i}'.*cls 2 "):
                w.write({"__key__": f"bad{i}", "cls": v})
        for i, v in enumerate([0.5, np.float64(1.5), float("nan")]):
            with pytest.raises(InputError, match=rf"'half{i}'.*is not an integer"):
                w.write({"__key__": f"half{i}", "cls": v})
    assert [s["cls"] for s in read_dataset(tmp_path / "o")] == [b"1", b"1", b"1", b"1", b"0"]
    with ShardWriter(str(tmp_path / "free")) as w:  # no classes: still an integer or refused
        w.write({"__key__": "k", "cls": np.float64(7.0)})
        with pytest.raises(InputError, match=r"'j'.*cls 2\.5 is not an integer"):
            w.write({"__key__": "j", "cls": 2.5})
    assert read_dataset(tmp_path / "free")[0]["cls"] == b"7"


def test_fields_equal_but_for_case_are_refused_naming_the_sample(tmp_path: Path) -> None:
    """webdataset lower-cases extensions: a sample of 'jpg' and 'JPG' made an unreadable shard."""
    with pytest.raises(InputError, match=r"'k'.*fields 'jpg' and 'JPG' differ only in case"), \
            ShardWriter(str(tmp_path / "o")) as w:
        w.write({"__key__": "k", "jpg": b"1", "JPG": b"2"})


@pytest.mark.parametrize("sample, match", [
    ({"__key__": "a/b\udcff", "txt": "x"}, r"sample #0 \('a/b\\udcff'\).*key 'a/b\\xff'.*UTF-8"),
    ({"__key__": "k", "t\udcffxt": "x"}, r"sample #0 \('k'\).*field 't\\xffxt'.*UTF-8"),
    ({"__key__": "k", 1: "x"}, r"sample #0 \('k'\).*field name 1 is a int, not a str"),
])
def test_an_unwritable_key_or_field_name_is_an_input_error_naming_the_sample(
        tmp_path: Path, sample: dict[Any, Any], match: str) -> None:
    """A surrogate (os.fsdecode of bytes that are not UTF-8) or a non-str field name raised a
    raw UnicodeEncodeError or AttributeError."""
    with pytest.raises(InputError, match=match), ShardWriter(str(tmp_path / "o")) as w:
        w.write(sample)
