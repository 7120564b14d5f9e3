"""The shard format (tar headers, scanner) and ``feedpipe shard`` (Python API and CLI)."""

from __future__ import annotations

import io
import json
import os
import random
import resource
import select
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import (
    dataset_bytes,
    dir_bytes,
    is_root,
    method_of,
    read_dataset,
    run_feedpipe,
    write_tree,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe.convert import _executors as conversion_executor
from feedpipe.convert import _shard_run
from feedpipe.convert._output_dir import STATE_NAME
from feedpipe.convert._sources import SampleSpec, Source
from feedpipe.convert._synth import make_records
from feedpipe.errors import (
    InputError,
    KeyClashError,
    OutputError,
    ShardFormatError,
    SourceNotFoundError,
)
from feedpipe.format._index import parse_index
from feedpipe.format._keys import decode_key, encode_key, source_path
from feedpipe.format._manifest import load_manifest
from feedpipe.format._tar import END_OF_ARCHIVE, Member, member_header, padded
from feedpipe.format._tar_scan import scan

USTAR_MAGIC = b"ustar\x0000"
GNU_MAGIC = b"ustar  \x00"


# --------------------------------------------------------------------------------------------
# tar members


def _archive(members: list[tuple[str, bytes]]) -> tuple[bytes, list[Member]]:
    buf = io.BytesIO()
    expected = []
    for name, data in members:
        buf.write(member_header(name, len(data)))
        expected.append(Member(name, buf.tell(), len(data)))
        buf.write(data)
        buf.write(bytes(padded(len(data)) - len(data)))
    buf.write(END_OF_ARCHIVE)
    return buf.getvalue(), expected


def _headers(raw: bytes) -> list[tuple[int, bytes]]:
    """Every header block of a tar image (extension records included), by offset."""
    out = []
    pos = 0
    while pos + 512 <= len(raw):
        block = raw[pos : pos + 512]
        if block == bytes(512):
            break
        size = int(block[124:136].rstrip(b"\0 ").lstrip(b" ") or b"0", 8)
        out.append((pos, block))
        pos += 512 + padded(size)
    return out


def _assert_no_pax(raw: bytes) -> None:
    heads = _headers(raw)
    assert heads, "no tar headers"
    for pos, block in heads:
        magic = block[257:265]
        assert magic in (USTAR_MAGIC, GNU_MAGIC), f"header at {pos}: magic {magic!r}"
        assert block[156:157] in (b"0", b"L"), f"header at {pos}: type {block[156:157]!r}"


_name_char = st.characters(exclude_categories=("Cs",), exclude_characters="/\0")
_component = st.one_of(
    st.text(_name_char, min_size=1, max_size=10),
    st.text(st.sampled_from("abcdé猫"), min_size=90, max_size=160),  # past the 100-byte field
)
_names = st.tuples(
    st.lists(_component, min_size=1, max_size=3).map("/".join).map(encode_key),
    st.sampled_from(["jpg", "json", "cls", "seg.png", "txt"]),
).map(lambda t: f"{t[0]}.{t[1]}")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_names, st.binary(max_size=1100)), max_size=6,
                unique_by=lambda m: m[0]))
def test_tar_round_trip(members: list[tuple[str, bytes]]) -> None:
    raw, expected = _archive(members)
    assert len(raw) % 512 == 0
    assert list(scan(io.BytesIO(raw), len(raw), "mem.tar")) == expected
    with tarfile.open(fileobj=io.BytesIO(raw), encoding="utf-8") as tf:
        infos = tf.getmembers()
        assert [(i.name, i.offset_data, i.size) for i in infos] == [
            (m.name, m.offset, m.size) for m in expected
        ]
        assert all(not i.pax_headers and i.mtime == 0 and i.mode == 0o644 for i in infos)
        assert [tf.extractfile(i).read() for i in infos] == [d for _, d in members]
    if members:
        _assert_no_pax(raw)


def test_long_names_use_ustar_prefix_or_gnu_long_name() -> None:
    fits_prefix = "p" * 120 + "/" + "n" * 90 + ".bin"  # 215 bytes: prefix/name split works
    needs_gnu = "q/" + "x" * 140 + ".bin"  # last component alone exceeds 100 bytes
    raw, expected = _archive([(fits_prefix, b"one"), (needs_gnu, b"two")])
    heads = _headers(raw)
    assert [h[156:157] for _, h in heads] == [b"0", b"L", b"0"]
    assert heads[0][1][257:265] == USTAR_MAGIC
    assert heads[0][1][345:345 + 120] == b"p" * 120  # the ustar prefix field
    assert heads[1][1][257:265] == GNU_MAGIC
    assert list(scan(io.BytesIO(raw), len(raw), "x")) == expected
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        assert tf.getnames() == [fits_prefix, needs_gnu]


def test_member_header_is_deterministic() -> None:
    assert member_header("a/b.jpg", 10) == member_header("a/b.jpg", 10)
    assert member_header("a/b.jpg", 10) != member_header("a/b.jpg", 11)


def test_scan_names_offset_of_corrupted_header_mid_archive() -> None:
    raw, expected = _archive([("a.txt", b"1" * 700), ("b.txt", b"2"), ("c.txt", b"3")])
    bad_at = expected[1].offset - 512
    broken = bytearray(raw)
    broken[bad_at + 3] ^= 0x20  # flip one bit of the second member's name: checksum breaks
    msg = rf"shard\.tar: corrupted tar header at offset {bad_at}\b"
    with pytest.raises(ShardFormatError, match=msg):
        list(scan(io.BytesIO(bytes(broken)), len(broken), "shard.tar"))
    # the standard library silently stops there instead; feedpipe must not
    with tarfile.open(fileobj=io.BytesIO(bytes(broken))) as tf:
        assert tf.getnames() == ["a.txt"]


def test_scan_detects_truncated_data_and_header() -> None:
    raw, expected = _archive([("a.txt", b"1" * 700), ("b.txt", b"2" * 900)])
    cut = expected[1].offset + 100  # inside b.txt's data
    header = expected[1].offset - 512
    with pytest.raises(ShardFormatError, match=rf"t\.tar: truncated: member at offset {header}"):
        list(scan(io.BytesIO(raw[:cut]), cut, "t.tar"))
    cut = header + 200  # inside b.txt's header
    with pytest.raises(ShardFormatError, match=rf"t\.tar: truncated tar header at offset {header}"):
        list(scan(io.BytesIO(raw[:cut]), cut, "t.tar"))


# --------------------------------------------------------------------------------------------
# feedpipe shard: layouts and names


def _source_files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def _fields(sample: dict[str, object]) -> dict[str, bytes]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}  # type: ignore[misc]


def test_folder_tree_grouping_and_labels(image_folder: Path, sharded: Path) -> None:
    m = load_manifest(str(sharded))
    samples = read_dataset(sharded)
    src = _source_files(image_folder)
    assert m.total_samples == len(samples) == 30
    assert [s["__index__"] for s in samples] == list(range(30))
    assert m.classes == ["cls_000", "cls_001", "cls_002"]
    assert m.fields == ["cls", "jpg", "json"]
    assert [r.samples for r in m.shards] == [7, 7, 7, 7, 2]
    rebuilt: dict[str, bytes] = {}
    for s in samples:
        fields = _fields(s)
        key = str(s["__key__"])
        # cls_001/00003.jpg + cls_001/00003.json form one sample
        expected_exts = {"jpg", "cls"} | ({"json"} if int(key[-5:]) % 3 == 0 else set())
        assert set(fields) == expected_exts, key
        assert fields["cls"] == str(m.classes.index(decode_key(key).split("/")[0])).encode()
        for ext, data in fields.items():
            if ext != "cls":
                rebuilt[source_path(key, ext)] = data
    assert rebuilt == src


def test_plain_tree_has_no_cls_field(image_folder: Path, tmp_path: Path) -> None:
    s = feedpipe.shard(str(image_folder), str(tmp_path / "o"), workers=1)
    m = load_manifest(str(tmp_path / "o"))
    assert s.samples == 30 and s.files == len(_source_files(image_folder))
    assert m.fields == ["jpg", "json"] and m.classes is None


def test_odd_names_stay_one_sample_and_paths_are_recoverable(
    odd_folder: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, files = odd_folder
    out = tmp_path / "o"
    feedpipe.shard(str(root), str(out), workers=1)
    samples = read_dataset(out)
    by_key = {decode_key(str(s["__key__"])): _fields(s) for s in samples}
    # a/cat.v2.jpg + a/cat.v2.json are one sample with fields jpg and json, not a "v2.jpg" field
    assert set(by_key["a/cat.v2"]) == {"jpg", "json"}
    assert set(by_key["a/cat"]) == {"jpg"}
    assert set(by_key["multi.dot.name.tar"]) == {"gz"}
    # backslash and slash are different files, hence different samples
    assert by_key["back\\slash"]["txt"] != by_key["back/slash"]["txt"]
    rebuilt = {
        source_path(str(s["__key__"]), ext): data
        for s in samples
        for ext, data in _fields(s).items()
    }
    assert rebuilt == files
    for s in samples:
        assert not any(c.isspace() for c in str(s["__key__"]))
    for tar in sorted(out.glob("*.tar")):
        _assert_no_pax(tar.read_bytes())


def test_manifest_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["imgs/a.jpg", "imgs/b.jpg", "caps/b.caption", "imgs/c.v2.png"])
    rows = [
        {"key": "first sample", "path": "imgs/a.jpg", "label": 3, "meta": {"x": [1, 2]}},
        {"path": "imgs/b.jpg", "txt_path": "caps/b.caption", "label": 0},
        {"path": "imgs/c.v2.png", "note": "héllo"},
        {},  # an empty row is ignored
    ]
    mf = tmp_path / "rows.jsonl"
    mf.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    feedpipe.shard(str(src), str(tmp_path / "o"), manifest=str(mf), workers=1)
    by_key = {decode_key(str(s["__key__"])): _fields(s) for s in read_dataset(tmp_path / "o")}
    assert set(by_key) == {"first sample", "imgs/b", "imgs/c.v2"}
    assert by_key["first sample"] == {
        "jpg": (src / "imgs/a.jpg").read_bytes(), "label": b"3", "meta": b'{"x": [1, 2]}'
    }
    assert by_key["imgs/b"] == {
        "jpg": (src / "imgs/b.jpg").read_bytes(),
        "txt": (src / "caps/b.caption").read_bytes(),
        "label": b"0",
    }
    assert by_key["imgs/c.v2"] == {"png": (src / "imgs/c.v2.png").read_bytes(),
                                   "note": "héllo".encode()}
    fields = load_manifest(str(tmp_path / "o")).fields
    assert fields == ["jpg", "label", "meta", "note", "png", "txt"]


def test_manifest_csv(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["x/1.jpg", "x/2.jpg", "t/2.txt"])
    mf = tmp_path / "rows.csv"
    mf.write_text("key,path,txt_path,label\nk1,x/1.jpg,,5\n,x/2.jpg,t/2.txt,7\n", encoding="utf-8")
    feedpipe.shard(str(src), str(tmp_path / "o"), manifest=str(mf), workers=1)
    by_key = {decode_key(str(s["__key__"])): _fields(s) for s in read_dataset(tmp_path / "o")}
    assert by_key == {
        "k1": {"jpg": (src / "x/1.jpg").read_bytes(), "label": b"5"},
        "x/2": {"jpg": (src / "x/2.jpg").read_bytes(), "txt": (src / "t/2.txt").read_bytes(),
                "label": b"7"},
    }


def test_manifest_csv_with_byte_order_mark(tmp_path: Path) -> None:
    """Spreadsheets save CSV with a BOM; the first column must still be 'key'."""
    src = tmp_path / "src"
    write_tree(src, ["x/1.jpg"])
    mf = tmp_path / "rows.csv"
    mf.write_bytes("key,path\nmine,x/1.jpg\n".encode("utf-8-sig"))
    feedpipe.shard(str(src), str(tmp_path / "o"), manifest=str(mf), workers=1)
    (s,) = read_dataset(tmp_path / "o")
    assert s["__key__"] == "mine" and set(_fields(s)) == {"jpg"}


def test_manifest_missing_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["x/1.jpg"])
    mf = tmp_path / "rows.jsonl"
    mf.write_text('{"path": "x/1.jpg"}\n{"path": "x/gone.jpg", "label": 1}\n')
    with pytest.raises(InputError, match=r"x/gone\.jpg: .*rows\.jsonl:2: file not found"):
        feedpipe.shard(str(src), str(tmp_path / "o1"), manifest=str(mf), workers=1)
    s = feedpipe.shard(str(src), str(tmp_path / "o2"), manifest=str(mf), workers=1,
                       on_error="skip")
    assert s.samples == 1 and s.skipped == 1 and s.skipped_inputs[0]["path"] == "x/gone.jpg"


def test_manifest_key_clash_names_both_sources(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["a/one.jpg", "b/two.jpg"])
    mf = tmp_path / "rows.jsonl"
    mf.write_text('{"key": "k", "path": "a/one.jpg"}\n{"key": "k", "path": "b/two.jpg"}\n')
    with pytest.raises(KeyClashError) as ei:
        feedpipe.shard(str(src), str(tmp_path / "o"), manifest=str(mf), workers=1)
    msg = str(ei.value)
    assert "a/one.jpg" in msg and "b/two.jpg" in msg
    assert "rows.jsonl:1" in msg and "rows.jsonl:2" in msg
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    r = run_feedpipe("shard", src, tmp_path / "o2", "--manifest", mf)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "a/one.jpg" in r.stderr and "b/two.jpg" in r.stderr


def test_manifest_key_clash_between_explicit_and_derived_key(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["d/x.jpg", "e/y.jpg"])
    mf = tmp_path / "rows.jsonl"
    mf.write_text('{"path": "d/x.jpg"}\n{"key": "d/x", "path": "e/y.jpg"}\n')
    with pytest.raises(KeyClashError, match=r"d/x\.jpg.*e/y\.jpg|e/y\.jpg.*d/x\.jpg"):
        feedpipe.shard(str(src), str(tmp_path / "o"), manifest=str(mf), workers=1)


def test_labels_from_dirs_refuses_existing_cls_file(tmp_path: Path) -> None:
    write_tree(tmp_path / "src", ["c/1.jpg", "c/1.cls"])
    with pytest.raises(KeyClashError, match=r"c/1"):
        feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "o"), labels_from_dirs=True, workers=1)


def test_hidden_files_and_directories_are_ignored(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["a/1.jpg", "a/.DS_Store", ".git/HEAD", ".git/objects/ab/cdef",
                     "a/.ipynb_checkpoints/1-checkpoint.jpg", ".hidden.jpg"])
    s = feedpipe.shard(str(src), str(tmp_path / "o"), workers=1)
    # left out, and (issue 41) each listed with its reason, a hidden directory once
    assert s.samples == 1 and s.skipped == 4
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["created_by"]["ignored_hidden_files"] == 5
    assert [x["path"] for x in m["skipped"]] == [".git/", ".hidden.jpg", "a/.DS_Store",
                                                 "a/.ipynb_checkpoints/"]


def test_fsspec_source_url(image_folder: Path, sharded: Path, tmp_path: Path) -> None:
    """SRC may be any fsspec URL: a copy in the memory filesystem gives the same shards."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/feedpipe-src-{os.getpid()}-{id(tmp_path)}"
    try:
        for rel, data in _source_files(image_folder).items():
            fs.pipe_file(f"{root}/{rel}", data)
        out = tmp_path / "o"
        feedpipe.shard(f"memory://{root}", str(out), labels_from_dirs=True, max_samples=7,
                       workers=1)
    finally:
        fs.rm(root, recursive=True)
    got, want = dir_bytes(out), dir_bytes(sharded)
    assert sorted(got) == sorted(want)
    assert {k: v for k, v in got.items() if not k.endswith(".json")} == {
        k: v for k, v in want.items() if not k.endswith(".json")
    }
    assert load_manifest(str(out)).shards == load_manifest(str(sharded)).shards


def test_prefix(image_folder: Path, tmp_path: Path) -> None:
    feedpipe.shard(str(image_folder), str(tmp_path / "o"), prefix="train", max_samples=20,
                   workers=1)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "manifest.json", "train-000000.idx", "train-000000.sizes.npy", "train-000000.tar",
        "train-000001.idx", "train-000001.sizes.npy", "train-000001.tar", "wids.json",
    ]
    with pytest.raises(ValueError, match="prefix"):
        feedpipe.shard(str(image_folder), str(tmp_path / "p"), prefix="a/b")


# --------------------------------------------------------------------------------------------
# determinism and sizes


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_same_bytes_whatever_workers(
    records_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    # small parts so that shards are joined from several parts written by different processes
    # (the general method: this tree would take the one-pass method, tests/test_onepass.py)
    monkeypatch.setattr(_shard_run, "PART_SAMPLES", 16)
    outs = {}
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        s = feedpipe.shard(str(records_folder), str(out), max_samples=60, workers=w,
                           shuffle=shuffle, seed=7, method="general")
        assert s.shards == 7 and s.samples == 400
        outs[w] = dir_bytes(out)
    assert outs[1] == outs[2]
    assert sorted(outs[1]) == sorted(
        [f"data-{i:06d}.{e}" for i in range(7) for e in ("tar", "idx")]
        + ["manifest.json", "wids.json"]
    )


def test_pool_workers_inherit_the_plan_or_get_it_pickled(
    records_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked workers read their parts from the inherited plan (nothing pickled per sample);
    where processes are spawned, parts travel pickled. Same bytes either way, and the plan is
    dropped from the parent once the run ends."""
    import pickle

    monkeypatch.setattr(_shard_run, "PART_SAMPLES", 16)
    pickled_specs = []
    real_reduce = SampleSpec.__reduce_ex__

    def counting_reduce(self: object, proto: int) -> object:
        pickled_specs.append(1)
        return real_reduce(self, proto)  # type: ignore[arg-type]

    monkeypatch.setattr(SampleSpec, "__reduce_ex__", counting_reduce, raising=False)
    assert pickle.loads(pickle.dumps(SampleSpec("k"))).key == "k" and pickled_specs
    outs = {}
    for method in ("fork", "spawn"):
        pickled_specs.clear()
        out = tmp_path / method
        s = feedpipe.shard(str(records_folder), str(out), max_samples=60, workers=2,
                           method="general", start_method=method)  # the general method's pool
        assert s.samples == 400 and s.executor == "process pool, 2 workers"
        outs[method] = dir_bytes(out)
        assert (len(pickled_specs) == 0) == (method == "fork"), method
    assert outs["fork"] == outs["spawn"]
    assert conversion_executor._FORK_PLANS == {}
    with pytest.raises(RuntimeError, match="not forked from"):
        conversion_executor._write_inherited(10**9, 0, 0, Source(str(records_folder)),
                                             str(tmp_path / "x"), "raise")


def test_shuffle_mixes_order_deterministically(records_folder: Path, tmp_path: Path) -> None:
    def keys(**kw: object) -> list[str]:
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        feedpipe.shard(str(records_folder), str(out), max_samples=100, workers=1, **kw)
        return [str(s["__key__"]) for s in read_dataset(out)]

    plain = keys()
    a, b, c = keys(shuffle=True, seed=1), keys(shuffle=True, seed=1), keys(shuffle=True, seed=2)
    assert plain == sorted(plain)
    assert a == b
    assert a != plain and a != c
    assert sorted(a) == sorted(c) == plain


def test_max_samples_and_max_bytes_respected(records_folder: Path, tmp_path: Path) -> None:
    s = feedpipe.shard(str(records_folder), str(tmp_path / "n"), max_samples=33, workers=1)
    m = load_manifest(str(tmp_path / "n"))
    assert [r.samples for r in m.shards] == [33] * 12 + [4] and s.shards == 13
    # each record takes 512 (header) + 1536 (padded data) bytes
    limit = 20_000
    feedpipe.shard(str(records_folder), str(tmp_path / "b"), max_bytes=limit, workers=1)
    m = load_manifest(str(tmp_path / "b"))
    for r in m.shards:
        assert r.bytes == os.path.getsize(tmp_path / "b" / r.name)
        assert r.bytes <= limit
    # greedy: a shard is cut only when the next sample would not fit
    assert all(r.bytes + 2048 > limit for r in m.shards[:-1])
    assert m.total_samples == 400


def test_sample_larger_than_max_bytes_gets_its_own_shard(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i, n in enumerate([100, 5000, 100, 100]):
        (src / f"{i}.bin").write_bytes(bytes([i]) * n)
    feedpipe.shard(str(src), str(tmp_path / "o"), max_bytes=4000, workers=1)
    m = load_manifest(str(tmp_path / "o"))
    assert [r.samples for r in m.shards] == [1, 1, 2]
    assert m.shards[1].bytes > 4000


def test_index_offsets_point_at_member_data(sharded: Path) -> None:
    for idxf in sorted(sharded.glob("*.idx")):
        raw = idxf.with_suffix(".tar").read_bytes()
        idx = parse_index(idxf.read_text(), str(idxf))
        for name, off, size in zip(idx.names, idx.offsets, idx.sizes):
            head = raw[off - 512 : off]
            assert head[257:265] == USTAR_MAGIC and head[156:157] == b"0"
            assert head[:100].rstrip(b"\0").decode() == name
            assert int(head[124:136].rstrip(b"\0 "), 8) == size
        assert raw.endswith(END_OF_ARCHIVE)
        _assert_no_pax(raw)


# --------------------------------------------------------------------------------------------
# the CLI


def test_cli_json_summary_and_same_output_as_python(image_folder: Path, sharded: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "o"
    r = run_feedpipe("shard", image_folder, out, "--labels-from-dirs", "--max-samples", "7",
                     "--workers", "2", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["shards"] == 5 and summary["samples"] == 30 and summary["skipped"] == 0
    assert summary["files"] == len(_source_files(image_folder))
    assert summary["bytes"] == sum(p.stat().st_size for p in out.glob("*.tar"))
    assert dir_bytes(out) == dir_bytes(sharded)


def test_cli_human_summary(image_folder: Path, tmp_path: Path) -> None:
    r = run_feedpipe("shard", image_folder, tmp_path / "o", "--max-samples", "10", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert "samples" in r.stdout and " 30" in r.stdout
    assert r.stderr == ""  # no progress bar when stderr is not a terminal


def test_cli_bad_option_value_is_one_line(image_folder: Path, tmp_path: Path) -> None:
    r = run_feedpipe("shard", image_folder, tmp_path / "o", "--max-bytes", "100")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "max_bytes" in r.stderr and "Traceback" not in r.stderr
    r = run_feedpipe("shard", image_folder, tmp_path / "o", "--max-bytes", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr


# --------------------------------------------------------------------------------------------
# bad inputs


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("feedpipe shard: error: ")
    assert r.stderr.count("\n") == 1, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def test_src_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SourceNotFoundError, match="does not exist") as ei:
        feedpipe.shard(str(missing), str(tmp_path / "o"))
    assert isinstance(ei.value, FileNotFoundError) and str(missing) in str(ei.value)
    _one_line_error(run_feedpipe("shard", missing, tmp_path / "o"), str(missing), "does not exist")
    assert not (tmp_path / "o").exists()


def test_src_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(SourceNotFoundError, match="not a directory"):
        feedpipe.shard(str(f), str(tmp_path / "o"))
    _one_line_error(run_feedpipe("shard", f, tmp_path / "o"), str(f), "not a directory")


def test_out_not_empty_without_resume(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty"):
        feedpipe.shard(str(image_folder), str(out), workers=1)
    r = run_feedpipe("shard", image_folder, out)
    _one_line_error(r, str(out), "not empty (1 entry, e.g. 'keep.txt')", "new or empty directory")
    assert "--resume" not in r.stderr  # nothing was interrupted: it would write into keep.txt's
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_out_is_a_file(image_folder: Path, tmp_path: Path) -> None:
    f = tmp_path / "o"
    f.write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        feedpipe.shard(str(image_folder), str(f), workers=1)


def _tree_with_bad(tmp_path: Path, bad: str, content: bytes | None) -> Path:
    src = tmp_path / "src"
    write_tree(src, ["a/1.jpg", "a/2.jpg", "b/3.jpg"])
    if content is not None:
        (src / bad).parent.mkdir(parents=True, exist_ok=True)
        (src / bad).write_bytes(content)
    return src


@pytest.mark.parametrize(
    ("bad", "content", "reason"),
    [("a/empty.jpg", b"", "zero-byte file"), ("b/README", b"text", "no extension")],
    ids=["zero-byte", "no-extension"],
)
def test_bad_file_raise_or_skip(tmp_path: Path, bad: str, content: bytes, reason: str) -> None:
    src = _tree_with_bad(tmp_path, bad, content)
    with pytest.raises(InputError, match=reason) as ei:
        feedpipe.shard(str(src), str(tmp_path / "o1"), workers=1)
    assert bad in str(ei.value)
    _one_line_error(run_feedpipe("shard", src, tmp_path / "o2"), bad, reason)
    s = feedpipe.shard(str(src), str(tmp_path / "o3"), workers=1, on_error="skip")
    assert s.skipped == 1 and s.samples == 3
    assert s.skipped_inputs == [{"path": bad, "reason": s.skipped_inputs[0]["reason"]}]
    doc = json.loads((tmp_path / "o3" / "manifest.json").read_text())
    assert doc["num_skipped"] == 1
    assert doc["skipped"][0]["path"] == bad and reason in doc["skipped"][0]["reason"]
    assert doc["total_samples"] == 3


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree_with_bad(tmp_path, "a/locked.jpg", b"secret")
    locked = src / "a" / "locked.jpg"
    # a read failing after the listing: the general method (the one-pass method gives such a
    # tree back to it, tests/test_onepass.py)
    if is_root():
        # root reads through chmod 000: make the read itself fail the way it would for a user
        real_read = Source.read

        def read(self: Source, rel: str, size: int = -1) -> bytes:
            if rel == "a/locked.jpg":
                raise PermissionError(13, "Permission denied", self.path(rel))
            return real_read(self, rel, size)

        monkeypatch.setattr(Source, "read", read)
    else:
        locked.chmod(0)
    try:
        with pytest.raises(InputError, match="cannot read") as ei:
            feedpipe.shard(str(src), str(tmp_path / "o1"), workers=1, method="general")
        assert str(locked) in str(ei.value)
        left = [p.name for p in (tmp_path / "o1").iterdir()]
        # nothing half-written, no temp file; only the hidden state kept for --resume
        assert left == [STATE_NAME]
        s = feedpipe.shard(str(src), str(tmp_path / "o2"), workers=1, on_error="skip",
                           method="general")
        assert s.skipped == 1 and s.samples == 3
        doc = json.loads((tmp_path / "o2" / "manifest.json").read_text())
        assert doc["skipped"] == [{"path": "a/locked.jpg", "reason": doc["skipped"][0]["reason"]}]
        assert "Permission denied" in doc["skipped"][0]["reason"]
    finally:
        locked.chmod(0o644)


def test_dangling_symlink_is_a_bad_input(tmp_path: Path) -> None:
    src = _tree_with_bad(tmp_path, "x", None)
    (src / "a" / "gone.jpg").symlink_to(tmp_path / "does-not-exist.jpg")
    with pytest.raises(InputError, match=r"a/gone\.jpg: cannot stat"):
        feedpipe.shard(str(src), str(tmp_path / "o1"), workers=1)
    _one_line_error(run_feedpipe("shard", src, tmp_path / "o2"), "a/gone.jpg")
    s = feedpipe.shard(str(src), str(tmp_path / "o3"), workers=1, on_error="skip")
    assert s.skipped == 1 and s.skipped_inputs[0]["path"] == "a/gone.jpg"


def test_file_vanishing_after_listing_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file listed but gone by the time it is read (another real read failure)."""
    src = _tree_with_bad(tmp_path, "x", None)
    real_read = Source.read

    def read(self: Source, rel: str, size: int = -1) -> bytes:
        if rel == "b/3.jpg":
            os.unlink(self.path(rel))
        return real_read(self, rel, size)

    monkeypatch.setattr(Source, "read", read)
    with pytest.raises(InputError, match=r"b/3\.jpg: cannot read"):  # read after the listing
        feedpipe.shard(str(src), str(tmp_path / "o"), workers=1, method="general")
    assert [p.name for p in (tmp_path / "o").iterdir() if not p.name.startswith(".")] == []
    assert not [p for p in (tmp_path / "o").iterdir() if ".tmp-" in p.name or ".part" in p.name]


def _limit_file_size(limit: int) -> Callable[[], None]:
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return pre


@pytest.mark.parametrize("workers", ["1", "2"])
def test_disk_full(records_folder: Path, tmp_path: Path, workers: str) -> None:
    out = tmp_path / "o"
    # 30 samples of 2048 bytes per shard (61 KB) against a 40 KB file size limit
    r = run_feedpipe("shard", records_folder, out, "--max-samples", "30", "--workers", workers,
                     preexec_fn=_limit_file_size(40_000))
    _one_line_error(r, str(out), "disk full")
    visible = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    assert not [n for n in visible if n.endswith(".tar")], visible
    assert "manifest.json" not in visible
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".part" in p.name]


def test_disk_full_while_joining_a_shard(records_folder: Path, tmp_path: Path) -> None:
    """The parts fit but the joined shard does not: no shard appears; a resume without the limit
    completes the run."""
    # the general path (a file at the root of the tree: the one-pass path gives it back; its
    # own disk-full cases are in tests/test_onepass.py)
    src = tmp_path / "src"
    make_records(str(src), count=400, size=1500, per_dir=100, seed=3)
    (src / "0.bin").write_bytes(b"x" * 1500)
    out = tmp_path / "o"
    r = run_feedpipe("shard", src, out, "--max-samples", "10", "--workers", "1",
                     preexec_fn=_limit_file_size(21_000))  # part 20,480 bytes, shard 21,504
    _one_line_error(r, str(out / "data-000000.tar"), "disk full")
    assert not list(out.glob("*.tar")) and not (out / "manifest.json").exists()
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".part" in p.name]
    r = run_feedpipe("shard", src, out, "--max-samples", "10", "--workers", "1",
                     "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shards"] == 41


# --------------------------------------------------------------------------------------------
# resume


def _visible_tars(out: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(out) if n.endswith(".tar") and not n.startswith("."))
    except FileNotFoundError:
        return []


def test_resume_after_interruption_and_changed_options(
    records_folder: Path, tmp_path: Path
) -> None:
    ref = tmp_path / "ref"
    feedpipe.shard(str(records_folder), str(ref), max_samples=50, workers=1)
    out = tmp_path / "o"

    class Stop(Exception):
        pass

    committed = []

    def stop_after_two(rec: object) -> None:
        committed.append(rec)
        if len(committed) == 2:
            raise Stop

    with pytest.raises(Stop):
        feedpipe.shard(str(records_folder), str(out), max_samples=50, workers=1,
                       on_shard=stop_after_two)
    assert _visible_tars(out) == ["data-000000.tar", "data-000001.tar"]
    with pytest.raises(OutputError, match="not empty"):
        feedpipe.shard(str(records_folder), str(out), max_samples=50, workers=1)
    with pytest.raises(OutputError, match="cannot resume"):
        feedpipe.shard(str(records_folder), str(out), max_samples=49, workers=1, resume=True)
    r = run_feedpipe("shard", records_folder, out, "--max-samples", "50", "--shuffle", "--resume")
    _one_line_error(r, "cannot resume")
    s = feedpipe.shard(str(records_folder), str(out), max_samples=50, workers=2, resume=True)
    assert s.reused_shards == 2 and s.shards == 8
    # the interrupted run was one pass, the resumed one general: the same bytes
    assert (method_of(ref), s.method) == ("one-pass", "general")
    assert dataset_bytes(out) == dataset_bytes(ref)
    # a finished dataset: resuming with the same options changes nothing, other options refuse
    feedpipe.shard(str(records_folder), str(out), max_samples=50, workers=1, resume=True)
    assert dataset_bytes(out) == dataset_bytes(ref)
    with pytest.raises(OutputError, match="cannot resume"):
        feedpipe.shard(str(records_folder), str(out), max_samples=51, workers=1, resume=True)


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            alive.append(int(d))
    return alive


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until the processes ``pids`` have exited (each a pidfd that becomes readable when
    its process ends); those still running after ``timeout`` seconds."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = set(fds)
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                left.discard(fd)
                poller.unregister(fd)
        return [fds[fd] for fd in left]
    finally:
        for fd in fds:
            os.close(fd)


# ``feedpipe shard`` with a kill point: at WHAT (``part``: a part or a directory's staging
# written, by a worker or the main process; ``shard``: the K-th shard committed; ``manifest``:
# manifest.json written) the process writes a byte to the fd NOTIFY and stops there until it is
# killed. The hooks replace the functions wherever feedpipe's modules hold them.
_KILL_POINT = r"""
import os, signal, sys
import feedpipe.cli._main, feedpipe.convert._shard, feedpipe.format._manifest
import feedpipe.convert._onepass, feedpipe.convert._writer
what, k, notify = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
calls = []

def hold():
    os.write(notify, b"!")
    while True:
        signal.pause()

def on_shard(rec):
    calls.append(rec)
    if what == "shard" and len(calls) == k:
        hold()

# module-level, so that a pool pickles them by name (its forked workers hold this module)
def write_part_hook(*a, **kw):
    got = REAL["write_part"](*a, **kw)
    if what == "part":
        hold()
    return got

def stage_dir_hook(*a, **kw):
    got = REAL["stage_dir"](*a, **kw)
    if what == "part":
        hold()
    return got

def write_manifest_hook(*a, **kw):
    got = REAL["write_manifest"](*a, **kw)
    if what == "manifest":
        hold()
    return got

REAL = {"write_part": feedpipe.convert._writer.write_part,
        "stage_dir": feedpipe.convert._onepass.stage_dir,
        "write_manifest": feedpipe.format._manifest.write_manifest}
for name, real in REAL.items():
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("feedpipe") and getattr(mod, name, None) is real:
            setattr(mod, name, globals()[name + "_hook"])
real_shard = feedpipe.convert._shard.shard
feedpipe.convert._shard.shard = lambda *a, **kw: real_shard(*a, on_shard=on_shard, **kw)
sys.exit(feedpipe.cli._main.main(["shard", *sys.argv[4:]]))
"""


def _kill_at(args: list[str], what: str, k: int, log: Path) -> bool:
    """Run ``feedpipe shard ARGS``, SIGKILL its main process at the kill point ``what``
    (see ``_KILL_POINT``); whether it was killed mid-run (a run that ends first is not).

    Then waits until its worker processes are gone too: they must not outlive the parent and
    write behind the back of the resumed run. (stderr goes to a file, not a pipe: a pipe held
    open by a stray worker would block.)"""
    read, write = os.pipe()
    try:
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", _KILL_POINT, what, str(k), str(write), *args],
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, pass_fds=(write,))
    finally:
        os.close(write)
    try:
        with os.fdopen(read, "rb") as notes:
            killed = notes.read(1) == b"!"  # (b"" once every holder of the fd has ended)
            if killed:
                os.kill(proc.pid, signal.SIGKILL)
            rc = proc.wait(timeout=60)
        assert rc == (-signal.SIGKILL if killed else 0), log.read_text()
        assert not _wait_gone(_group_alive(proc.pid), 30), \
            "worker processes outlived the killed parent"
        return killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _group_alive(proc.pid):  # only processes this test started (its session)
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_then_resume_is_identical(records_folder: Path, tmp_path: Path) -> None:
    opts = ["--max-samples", "16", "--workers", "2"]  # 25 shards
    ref = tmp_path / "ref"
    feedpipe.shard(str(records_folder), str(ref), max_samples=16, workers=1)
    expected = dataset_bytes(ref)  # (one pass; every resume is general)
    nshards = len(load_manifest(str(ref)).shards)
    assert nshards == 25
    rng = random.Random(20240611)

    # name -> the kill points of successive runs; a last --resume run then completes
    scenarios: dict[str, list[tuple[str, int]]] = {
        "first-part": [("part", 0)],
        "first-shard": [("shard", 1)],
        "manifest": [("manifest", 0)],
    }
    for n in range(3):
        ks = sorted(rng.sample(range(1, nshards), 2))
        scenarios[f"random{n}"] = [("shard", k) for k in ks][: 1 + n % 2]

    mid_run_kills = 0
    for name, points in scenarios.items():
        out = tmp_path / name
        for i, (what, k) in enumerate(points):
            args = [str(records_folder), str(out), *opts] + (["--resume"] if i else [])
            mid_run_kills += _kill_at(args, what, k, tmp_path / "stderr.txt")
        if name == "first-shard":
            r = run_feedpipe("shard", records_folder, out, "--max-samples", "15", "--resume")
            _one_line_error(r, "cannot resume")
        committed = _visible_tars(out)
        had_manifest = (out / "manifest.json").exists()
        r = run_feedpipe("shard", records_folder, out, *opts, "--resume", "--json")
        assert r.returncode == 0, (name, points, r.stderr)
        if not had_manifest:
            assert json.loads(r.stdout)["reused_shards"] == len(committed), (name, points)
        # the same bytes, and no hidden file left over
        assert dataset_bytes(out) == expected, (name, points)
    assert mid_run_kills >= 6  # every scenario's first kill point is reached


@pytest.mark.parametrize("actual", [0, 1, 1023, 1024, 1025, 70_000, 3_000_000])
@pytest.mark.parametrize("hint", ["exact", "smaller", "larger", "unknown"])
def test_read_local_returns_the_whole_file_whatever_the_size_hint(
        tmp_path: Path, actual: int, hint: str) -> None:
    from feedpipe.convert._sources import read_local

    data = bytes((i * 7 + 3) % 256 for i in range(actual))
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    size = {"exact": actual, "smaller": max(0, actual - 5), "larger": actual + 5,
            "unknown": -1}[hint]
    assert read_local(str(p), size) == data
    with pytest.raises(FileNotFoundError):
        read_local(str(tmp_path / "missing.bin"), 10)


def test_the_listing_is_kept_out_of_full_collections_only_while_sharding(
    records_folder: Path, tmp_path: Path
) -> None:
    import gc

    seen: list[int] = []
    assert gc.get_freeze_count() == 0
    feedpipe.shard(str(records_folder), str(tmp_path / "a"), max_samples=100, workers=1,
                   on_shard=lambda rec: seen.append(gc.get_freeze_count()))
    assert len(seen) == 4 and min(seen) > 0  # frozen while the shards were written
    assert gc.get_freeze_count() == 0 and gc.isenabled()  # and given back
    # a caller's own frozen objects stay frozen, and a disabled collector stays off
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        feedpipe.shard(str(records_folder), str(tmp_path / "b"), max_samples=100, workers=1)
        # not unfrozen (0), nor frozen more; frozen objects that died in between leave the count
        assert 0.9 * before < gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        feedpipe.shard(str(records_folder), str(tmp_path / "c"), max_samples=100, workers=1)
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b") == dir_bytes(tmp_path / "c")


def test_a_bad_input_in_a_later_shard_stops_the_pool_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # shards are joined as their parts arrive: a failing part of a later shard still stops the
    # run with the file named, no part or temporary file stays behind, the shards committed
    # before are whole, and --resume finishes the same bytes as a clean run
    monkeypatch.setattr(_shard_run, "PART_SAMPLES", 8)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(200):
        (src / f"{i:04d}.bin").write_bytes(b"x" * (100 + i))
    real_read = Source.read

    def read(self: Source, rel: str, size: int = -1) -> bytes:
        if rel == "0170.bin":  # gone after the listing (the pool's workers are forked)
            os.unlink(self.path(rel))
        return real_read(self, rel, size)

    monkeypatch.setattr(Source, "read", read)
    out = tmp_path / "o"
    with pytest.raises(InputError, match=r"0170\.bin: cannot read"):
        feedpipe.shard(str(src), str(out), max_samples=40, workers=2)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name or ".part" in p.name]
    kept = sorted(p.name for p in out.iterdir() if p.suffix == ".tar")
    assert set(kept) <= {f"data-{i:06d}.tar" for i in range(4)}  # not shard 4, the bad one's
    for name in kept:
        with tarfile.open(out / name) as t:
            assert len(t.getnames()) == 40
    monkeypatch.undo()
    (src / "0170.bin").write_bytes(b"x" * 270)
    feedpipe.shard(str(src), str(out), max_samples=40, workers=2, resume=True)
    feedpipe.shard(str(src), str(tmp_path / "clean"), max_samples=40, workers=2)
    assert dir_bytes(out) == dir_bytes(tmp_path / "clean")
