"""``feedpipe index`` (adopting shards written by other tools), ``feedpipe verify``, and the
``.idx`` format against DALI's own ``wds2idx``."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from conftest import run_feedpipe

import feedpipe
from feedpipe.errors import InputError, KeyClashError, ShardFormatError
from feedpipe.format._index import parse_index
from feedpipe.format._keys import split_member
from feedpipe.format._manifest import load_manifest
from feedpipe.format._reader import ShardReader
from feedpipe.format._tar import member_header


def _wds_samples(n: int, start: int = 0) -> list[dict[str, object]]:
    out = []
    for i in range(start, start + n):
        s: dict[str, object] = {
            "__key__": f"part{i % 3}/sample{i:04d}",
            "txt": f"caption {i}".encode(),
            "bin": bytes((i * 7 + j) % 256 for j in range(100 + 37 * i)),
        }
        if i % 4 == 0:
            s["json"] = json.dumps({"i": i}).encode()
        out.append(s)
    return out


@pytest.fixture
def wds_dir(tmp_path: Path) -> Path:
    """25 samples written by ``webdataset.ShardWriter`` into 3 shards (PAX headers and all)."""
    d = tmp_path / "wds"
    d.mkdir()
    with wds.ShardWriter(str(d / "shard-%06d.tar"), maxcount=10, verbose=0) as sink:
        for s in _wds_samples(25):
            sink.write(s)
    return d


def _wds_read(paths: list[Path]) -> list[tuple[str, dict[str, bytes]]]:
    ds = wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False)
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in ds]


def _feedpipe_read(paths: list[Path]) -> list[tuple[str, dict[str, bytes]]]:
    out = []
    for p in paths:
        with ShardReader(str(p)) as r:
            for s in r:
                out.append((s["__key__"], {k: bytes(v) for k, v in s.items()
                                           if not k.startswith("__")}))
    return out


def test_index_adopts_webdataset_shards(wds_dir: Path) -> None:
    tars = sorted(wds_dir.glob("*.tar"))
    assert len(tars) == 3
    oracle = _wds_read(tars)
    assert len(oracle) == 25
    # without an index feedpipe scans (PAX 'x' records included) and agrees already
    assert _feedpipe_read(tars) == oracle

    r = run_feedpipe("index", wds_dir)
    assert r.returncode == 0, r.stderr
    assert "3 shards, 25 samples" in r.stdout
    m = load_manifest(str(wds_dir))
    assert [s.name for s in m.shards] == [t.name for t in tars]
    assert [s.samples for s in m.shards] == [10, 10, 5]
    assert [s.bytes for s in m.shards] == [t.stat().st_size for t in tars]
    assert m.fields == ["bin", "json", "txt"]
    assert all(t.with_suffix(".idx").exists() for t in tars)
    assert _feedpipe_read(tars) == oracle
    assert feedpipe.verify(str(wds_dir)).ok


def test_index_python_api_and_json(wds_dir: Path, tmp_path: Path) -> None:
    m = feedpipe.index([str(wds_dir / "shard-*.tar")], show_progress=False)
    assert m.total_samples == 25
    r = run_feedpipe("index", wds_dir / "shard-000000.tar", wds_dir / "shard-000001.tar", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # one result record: what was written where
    assert doc["total_samples"] == 20 and doc["root"] == str(wds_dir)
    assert doc["manifest"] == str(wds_dir / "manifest.json") and doc["classes"] is None
    assert [(s["name"], s["samples"], s["index"]) for s in doc["shards"]] == [
        ("shard-000000.tar", 10, str(wds_dir / "shard-000000.idx")),
        ("shard-000001.tar", 10, str(wds_dir / "shard-000001.idx"))]
    r = run_feedpipe("index", wds_dir / "nothing.tar", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["error"] == "SourceNotFoundError"


def test_index_takes_a_path_as_every_entry_point_does(wds_dir: Path, tmp_path: Path) -> None:
    """A str, an os.PathLike or a list of them names shards (issue 41: a str was iterated
    character by character and an absolute path ended in "/: directory holds no .tar shards")."""
    for given in (str(wds_dir), wds_dir, [wds_dir], str(wds_dir / "shard-*.tar"),
                  [str(wds_dir / "shard-000000.tar"), wds_dir / "shard-000001.tar"]):
        for p in wds_dir.glob("*.idx"):
            p.unlink()
        m = feedpipe.index(given, show_progress=False)  # type: ignore[arg-type]
        two = isinstance(given, list) and len(given) == 2
        assert m.total_samples == (20 if two else 25), given
        assert len(list(wds_dir.glob("*.idx"))) == (2 if two else 3), given
    with pytest.raises(TypeError, match="shard paths"):
        feedpipe.index(3, show_progress=False)  # type: ignore[arg-type]


def test_index_records_class_names(wds_dir: Path, tmp_path: Path) -> None:
    """``--classes`` as ``feedpipe shard --labels-from-dirs`` records them (issue 22)."""
    r = run_feedpipe("index", wds_dir, "--classes", "cat, dog,zebra")
    assert r.returncode == 0, r.stderr
    assert load_manifest(str(wds_dir)).classes == ["cat", "dog", "zebra"]
    assert "classes  3 from the comma-separated list: cat, dog, zebra" in r.stdout
    names = tmp_path / "classes.txt"
    names.write_text("ant\nbee\n\n")
    m = feedpipe.index([str(wds_dir)], classes=str(names), show_progress=False)
    assert m.classes == ["ant", "bee"] == load_manifest(str(wds_dir)).classes
    doc = json.loads(run_feedpipe("index", wds_dir, "--classes", names, "--json").stdout)
    assert doc["classes"] == ["ant", "bee"] and doc["classes_from"] == str(names)
    r = run_feedpipe("index", wds_dir, "--classes", "a,,b")
    assert r.returncode == 2 and "empty class name" in r.stderr
    r = run_feedpipe("index", wds_dir, "--classes", "a,b,a")
    assert r.returncode == 2 and "repeated class name(s) ['a']" in r.stderr


@pytest.mark.parametrize("command", ["index", "verify"])
def test_help_ends_with_examples(command: str) -> None:
    r = run_feedpipe(command, "--help")
    assert r.returncode == 0
    tail = r.stdout[r.stdout.rindex("Examples:"):].splitlines()
    assert len(tail) >= 3 and all(ln.startswith(f"  feedpipe {command} ") or "feedpipe "
                                  f"{command} " in ln for ln in tail[1:])


def test_index_duplicate_keys_across_shards(tmp_path: Path) -> None:
    d = tmp_path / "dups"
    d.mkdir()
    for name, start in (("a.tar", 0), ("b.tar", 3)):
        with wds.TarWriter(str(d / name)) as sink:
            for s in _wds_samples(5, start):
                sink.write(s)
    # a holds samples 0..4, b holds 3..7: part0/sample0003 is in both
    with pytest.raises(KeyClashError) as ei:
        feedpipe.index([str(d)], show_progress=False)
    msg = str(ei.value)
    assert "part0/sample0003" in msg and "a.tar" in msg and "b.tar" in msg
    r = run_feedpipe("index", d)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "a.tar" in r.stderr and "b.tar" in r.stderr
    assert not (d / "manifest.json").exists()


def test_index_checks_classes_against_the_labels(tmp_path: Path) -> None:
    """``--classes`` must cover every ``cls`` value, and a missing file is not a class name."""
    d = tmp_path / "labelled"
    d.mkdir()
    with wds.TarWriter(str(d / "a.tar")) as sink:
        for i in range(8):
            sink.write({"__key__": f"s{i}", "txt": b"x", "cls": str(i % 4).encode()})
    with pytest.raises(InputError) as ei:
        feedpipe.index([str(d)], classes="a,b", show_progress=False)
    msg = str(ei.value)
    assert "cls 2" in msg and "'s2'" in msg and "a.tar" in msg and "2 classes" in msg, msg
    r = run_feedpipe("index", d, "--classes", "a,b")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cls 2" in r.stderr
    assert not (d / "manifest.json").exists() and not (d / "a.idx").exists()
    r = run_feedpipe("index", d, "--classes", tmp_path / "nosuch.txt")
    assert r.returncode == 2 and "nosuch.txt" in r.stderr and "no such file" in r.stderr
    assert "--classes cat,dog" in r.stderr, r.stderr
    assert not (d / "manifest.json").exists()
    with pytest.raises(InputError, match="no such file"):
        feedpipe.index([str(d)], classes="nosuch.txt", show_progress=False)
    m = feedpipe.index([str(d)], classes="a,b,c,d", show_progress=False)
    assert m.classes == ["a", "b", "c", "d"]
    with wds.TarWriter(str(d / "a.tar")) as sink:  # a name where an index belongs
        sink.write({"__key__": "t", "txt": b"x", "cls": b"cat"})
    with pytest.raises(InputError, match=r"a\.tar: sample 't': cls 'cat' is not an integer"):
        feedpipe.index([str(d)], classes="cat,dog", show_progress=False)


def test_index_refuses_member_names_with_whitespace(tmp_path: Path) -> None:
    """The DALI index is space-separated: a foreign shard whose names hold spaces is refused with
    advice rather than indexed wrongly."""
    with wds.TarWriter(str(tmp_path / "s.tar")) as sink:
        sink.write({"__key__": "a b", "txt": b"x"})
    msg = r"s\.tar: member name 'a b\.txt' contains whitespace"
    with pytest.raises(ShardFormatError, match=msg):
        feedpipe.index([str(tmp_path / "s.tar")], show_progress=False)
    assert not (tmp_path / "s.idx").exists()


def test_index_refuses_missing_and_empty(tmp_path: Path) -> None:
    r = run_feedpipe("index", tmp_path / "none.tar")
    assert r.returncode == 2 and "none.tar" in r.stderr and r.stderr.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_feedpipe("index", empty)
    assert r.returncode == 2 and "no .tar shards" in r.stderr


# --------------------------------------------------------------------------------------------
# verify


def test_verify_sound_dataset(sharded: Path) -> None:
    r = run_feedpipe("verify", sharded)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 shards, 30 samples: OK" in r.stdout
    r = run_feedpipe("verify", sharded, "--json")
    assert json.loads(r.stdout) == {"ok": True, "root": str(sharded), "shards": 5, "samples": 30,
                                    "problems": [], "warnings": []}


def test_verify_truncated_shard(sharded_copy: Path) -> None:
    shard = sharded_copy / "data-000002.tar"
    size = shard.stat().st_size
    cut = size // 2 + 100
    with open(shard, "r+b") as f:
        f.truncate(cut)
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 1
    assert f"{shard}: size {cut} bytes, the manifest says {size}" in r.stdout
    assert f"offset {cut}" in r.stdout
    assert "data-000000.tar" not in r.stdout  # only the damaged shard is named
    report = feedpipe.verify(str(sharded_copy))
    assert not report.ok and all("data-000002.tar" in str(p) for p in report.problems)


def test_verify_corrupted_header(sharded_copy: Path) -> None:
    shard = sharded_copy / "data-000001.tar"
    idx = parse_index(shard.with_suffix(".idx").read_text())
    header = idx.offsets[idx.starts[4]] - 512
    raw = bytearray(shard.read_bytes())
    raw[header + 5] ^= 0x04
    shard.write_bytes(raw)
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 1
    assert f"{shard}: corrupted tar header at offset {header} " in r.stdout
    assert f"{shard}: sha256 mismatch" in r.stdout
    doc = json.loads(run_feedpipe("verify", sharded_copy, "--json").stdout)
    assert doc["ok"] is False
    assert [(p["shard"], p["kind"], p["offset"]) for p in doc["problems"]] == [
        (str(shard), "sha256", None), (str(shard), "header", header)]


def test_verify_damaged_index(sharded_copy: Path) -> None:
    idxf = sharded_copy / "data-000000.idx"
    lines = idxf.read_text().splitlines(keepends=True)
    parts = lines[2].split(" ")
    parts[1] = str(int(parts[1]) + 512)  # point an entry at the wrong offset
    lines[2] = " ".join(parts)
    idxf.write_text("".join(lines))
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 1
    assert f"index entry {parts[3]!r} at offset {parts[1]}" in r.stdout
    doc = json.loads(run_feedpipe("verify", sharded_copy, "--json").stdout)
    key = parts[3].split(".")[0]
    assert [(p["kind"], p["offset"], p["key"]) for p in doc["problems"]] == [
        ("index-entry", int(parts[1]), key)]
    (sharded_copy / "data-000003.idx").unlink()
    problems = feedpipe.verify(str(sharded_copy)).problems
    assert any("data-000003.idx: index is missing" in str(p) for p in problems)


def test_verify_missing_shard(sharded_copy: Path) -> None:
    (sharded_copy / "data-000004.tar").unlink()
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 1 and "data-000004.tar: shard is missing" in r.stdout


def test_verify_reports_a_key_in_two_shards(tmp_path: Path) -> None:
    """Two parts that wrote the same keys, under one manifest (as `feedpipe merge` wrote it before
    it checked keys): each sample would be read twice an epoch."""
    from feedpipe.convert._shard_writer import write_samples
    from feedpipe.format._index import format_index
    from feedpipe.format._indexer import _scan
    from feedpipe.format._manifest import Manifest, ShardRecord, write_manifest

    out = tmp_path / "par"
    parts = [write_samples(({"__key__": f"{j:04d}", "txt": "x"} for j in range(5)), str(out),
                           part=(i, 2)) for i in (0, 1)]
    write_manifest(str(out), Manifest(parts[0].shards + parts[1].shards, fields=["txt"]))
    first, second = (str(out / rec.name) for p in parts for rec in p.shards)
    report = feedpipe.verify(str(out))
    assert not report.ok
    assert [(p.kind, p.shard, p.key) for p in report.problems] == [
        ("duplicate-key", second, "0000")]
    assert first in str(report.problems[0]) and "5 sample keys" in str(report.problems[0])
    r = run_feedpipe("verify", out)
    assert r.returncode == 1 and "PROBLEM" in r.stdout and "'0000'" in r.stdout, r.stdout
    doc = json.loads(run_feedpipe("verify", out, "--json").stdout)
    assert doc["ok"] is False and [(p["kind"], p["shard"], p["key"]) for p in doc["problems"]] \
        == [("duplicate-key", second, "0000")]
    # a key twice in one shard (not consecutive: two samples)
    d = tmp_path / "one"
    d.mkdir()
    with wds.TarWriter(str(d / "s.tar")) as sink:
        for key in ("a", "b", "a"):
            sink.write({"__key__": key, "txt": b"x"})
    with pytest.raises(KeyClashError, match=r"'a'"):
        feedpipe.index([str(d)], show_progress=False)
    idx, size, sha = _scan(str(d / "s.tar"))
    write_manifest(str(d), Manifest([ShardRecord("s.tar", 3, size, sha)]))
    (d / "s.idx").write_text(format_index(idx))
    report = feedpipe.verify(str(d))
    assert [(p.kind, Path(p.shard).name, p.key) for p in report.problems] == [
        ("duplicate-key", "s.tar", "a")]


def test_verify_remote_dataset(sharded: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/feedpipe-verify-{id(sharded)}"
    try:
        for p in sharded.iterdir():
            fs.pipe_file(f"{root}/{p.name}", p.read_bytes())
        report = feedpipe.verify(f"memory://{root}")
        assert report.ok and report.shards == 5 and report.samples == 30
        raw = (sharded / "data-000001.tar").read_bytes()
        fs.pipe_file(f"{root}/data-000001.tar", raw[:-2048])
        report = feedpipe.verify(f"memory://{root}")
        assert not report.ok
        assert any(f"memory://{root}/data-000001.tar: size" in str(p) for p in report.problems)
    finally:
        fs.rm(root, recursive=True)


def test_verify_not_a_dataset(tmp_path: Path) -> None:
    r = run_feedpipe("verify", tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "manifest.json" in r.stderr


def test_index_of_truncated_foreign_shard(wds_dir: Path) -> None:
    shard = wds_dir / "shard-000001.tar"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2 + 7)
    with pytest.raises(ShardFormatError, match=r"shard-000001\.tar: truncated"):
        feedpipe.index([str(wds_dir)], show_progress=False)


# --------------------------------------------------------------------------------------------
# byte-identical to DALI's wds2idx


def _wds2idx_available() -> bool:
    return importlib.util.find_spec("wds2idx") is not None and shutil.which("tar") is not None


def _wds2idx(tar: Path, out: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "wds2idx", str(tar), str(out)], check=True,
                   capture_output=True, timeout=60)
    return out.read_bytes()


def _true_index_line(tar: Path, names: list[str]) -> str:
    """An index line built from the standard library's own idea of where member data starts."""
    with tarfile.open(tar) as tf:
        info = {m.name: m for m in tf.getmembers()}
    return " ".join(f"{split_member(n)[1]} {info[n].offset_data} {info[n].size} {n}"
                    for n in names) + "\n"


@pytest.mark.dali
@pytest.mark.skipif(not _wds2idx_available(), reason="DALI's wds2idx (or GNU tar) not installed")
def test_idx_identical_to_wds2idx_on_feedpipe_shards(
    sharded: Path, ascii_odd_folder: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    odd = tmp_path / "odd"
    feedpipe.shard(str(ascii_odd_folder[0]), str(odd), max_samples=4, workers=1)
    tars = sorted(sharded.glob("*.tar")) + sorted(odd.glob("*.tar"))
    assert len(tars) >= 8
    long_named = 0
    for tar in tars:
        ours = tar.with_suffix(".idx").read_text().splitlines(keepends=True)
        dali = _wds2idx(tar, tmp_path / "dali.idx").decode().splitlines(keepends=True)
        assert len(ours) == len(dali) and ours[0] == dali[0], tar
        for mine, theirs in zip(ours[1:], dali[1:]):
            names = mine.split()[3::4]
            if any(len(member_header(n, 0)) > 512 for n in names):
                # A member name that needs a GNU long-name record: GNU tar reports the block of
                # that record, so wds2idx's offset points at the name, not the data. feedpipe's
                # offset is where the data starts.
                long_named += 1
                assert mine == _true_index_line(tar, names), tar
            else:
                assert mine == theirs, tar
    assert long_named == 1  # "long2/xxx...x.bin"; everything else is byte-identical


@pytest.mark.dali
@pytest.mark.skipif(not _wds2idx_available(), reason="DALI's wds2idx (or GNU tar) not installed")
def test_idx_identical_to_wds2idx_on_webdataset_shards(wds_dir: Path, tmp_path: Path) -> None:
    feedpipe.index([str(wds_dir)], show_progress=False)
    for tar in sorted(wds_dir.glob("*.tar")):
        assert _wds2idx(tar, tmp_path / "dali.idx") == tar.with_suffix(".idx").read_bytes(), tar


# --------------------------------------------------------------------------------------------
# check_index: an index against the tar headers of the shard's bytes (FeedDataset(verify=True))


def test_check_index_against_the_shard_bytes(sharded_copy: Path) -> None:
    import mmap

    from feedpipe.format._verify import check_index

    shard = sharded_copy / "data-000000.tar"
    data = shard.read_bytes()
    good = (sharded_copy / "data-000000.idx").read_bytes()
    check_index(parse_index(good), data, str(shard))  # sound: no error
    with open(shard, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        check_index(parse_index(good), mm, str(shard))  # a map works as well as bytes
    # another shard's index copied over this one's (issue 23, defect 2)
    other = parse_index((sharded_copy / "data-000001.idx").read_bytes())
    with pytest.raises(ShardFormatError, match=r"data-000000\.tar: .*data-000000\.idx") as ei:
        check_index(other, data, str(shard))
    assert ei.value.kind == "index-entry" and ei.value.offset == other.offsets[0]
    # every offset moved by one block
    shifted = parse_index(good)
    shifted.offsets = [o + 512 for o in shifted.offsets]
    with pytest.raises(ShardFormatError, match=rf"index entry {shifted.names[0]!r} at offset "
                                               rf"{shifted.offsets[0]} .* matches no tar member"):
        check_index(shifted, data, str(shard))
    # one sample fewer than the tar holds
    short = parse_index(good)
    short.keys, short.starts = short.keys[:-1], short.starts[:-1]
    n = short.starts[-1]
    short.exts, short.offsets, short.sizes, short.names = (
        short.exts[:n], short.offsets[:n], short.sizes[:n], short.names[:n])
    with pytest.raises(ShardFormatError, match=r"data-000000\.idx: lists .* the tar .* holds"):
        check_index(short, data, str(shard))
    # a damaged header in the bytes is the tar parser's error
    header = parse_index(good).offsets[1] - 512  # the second member's header
    broken = bytearray(data)
    broken[header + 3] ^= 0x01
    with pytest.raises(ShardFormatError, match=rf"data-000000\.tar: corrupted tar header at "
                                               rf"offset {header}"):
        check_index(parse_index(good), bytes(broken), str(shard))


# --------------------------------------------------------------------------------------------
# members that are not plain files, in other tools' tars (issue 41: dot-files, hard links and
# symbolic links vanished with no record)


def _odd_members_tar(path: Path, fmt: int) -> dict[str, bytes]:
    """A tar by the standard library in ``fmt`` holding directories, dot-files, a hard link, a
    symbolic link, a hard link to nothing before it and a FIFO beside plain files; the plain
    files' bytes by name."""
    files = {"a.txt": b"alpha", "a.json": b'{"a": 1}', "dir/b.txt": b"bravo",
             ".gitignore": b"*.pyc\n", "dir/.hidden": b"secret"}
    with tarfile.open(path, "w", format=fmt) as tf:
        def add(name: str, kind: bytes, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname, info.mtime = kind, len(data), link, 0
            tf.addfile(info, io.BytesIO(data) if data else None)

        add("dir", tarfile.DIRTYPE)
        for name, data in files.items():
            add(name, tarfile.REGTYPE, data)
        add("c.txt", tarfile.LNKTYPE, link="a.txt")  # tarfile reads it as a.txt's bytes
        add("dir/e.txt", tarfile.LNKTYPE, link="dir/b.txt")
        add("./g.txt", tarfile.LNKTYPE, link="dir//b.txt")  # names compared normalised
        add("d.txt", tarfile.SYMTYPE, link="a.txt")
        add("f.txt", tarfile.LNKTYPE, link="later.txt")  # its target comes after it
        add("later.txt", tarfile.REGTYPE, b"later")
        add("pipe", tarfile.FIFOTYPE)
    return files


def _nothing_vanishes(tars: list[Path], root: Path) -> list[dict[str, str]]:
    """Every member :mod:`tarfile` reads bytes of (a regular file, or a link it resolves) is
    served with tarfile's bytes by the reader through the ``.idx``, or listed in the manifest's
    ``skipped`` with a reason; every member tarfile lists that is not a directory is one or the
    other. The list of members left out."""
    skipped = load_manifest(str(root)).skipped
    left = {(s["shard"], s["path"]): s["reason"] for s in skipped}
    assert all(left.values()) and len(left) == len(skipped)
    for tar in tars:
        shard = tar.relative_to(root).as_posix()
        raw = tar.read_bytes()
        served: dict[str, bytes] = {}
        with ShardReader(str(tar)) as r:
            idx = r.index
            for i in range(len(r)):
                sample = r.sample(i)
                for m in range(idx.starts[i], idx.starts[i + 1]):
                    data = raw[idx.offsets[m]:idx.offsets[m] + idx.sizes[m]]
                    assert bytes(sample[idx.exts[m]]) == data
                    served[idx.names[m]] = data
        with tarfile.open(tar) as tf:
            for member in tf.getmembers():
                if member.isdir():
                    assert (shard, member.name) not in left
                    continue
                try:
                    f = tf.extractfile(member)
                except KeyError:  # a link to nothing tarfile finds
                    f = None
                if member.name in served:
                    assert f is not None and served.pop(member.name) == f.read(), member.name
                else:
                    assert (shard, member.name) in left, f"{member.name} vanished"
        assert served == {}, served  # nothing served that tarfile does not read
    return skipped


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT],
                         ids=["gnu", "ustar", "pax"])
def test_index_reads_hard_links_and_lists_every_member_left_out(tmp_path: Path, fmt: int) -> None:
    tar = tmp_path / "odd.tar"
    files = _odd_members_tar(tar, fmt)
    r = run_feedpipe("index", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    skipped = _nothing_vanishes([tar], tmp_path)
    assert doc["left_out"] == skipped and doc["num_left_out"] == 5
    reasons = {s["path"]: s["reason"] for s in skipped}
    assert sorted(reasons) == [".gitignore", "d.txt", "dir/.hidden", "f.txt", "pipe"]
    assert reasons[".gitignore"].startswith("hidden file: its WebDataset key")
    assert reasons["dir/.hidden"].startswith("hidden file: its WebDataset key (the name up to "
                                             "the first dot of its file name) is only its "
                                             "directory 'dir/'")
    assert reasons["d.txt"].startswith("symbolic link to 'a.txt'")
    assert reasons["f.txt"] == "hard link to 'later.txt', which the tar does not hold before it"
    assert reasons["pipe"] == "FIFO: it holds no bytes"
    with ShardReader(str(tar)) as reader:  # the hard links: their own keys, their targets' bytes
        got = {s["__key__"]: bytes(s["txt"]) for s in reader if "txt" in s}
    assert got == {"a": b"alpha", "dir/b": b"bravo", "c": b"alpha", "dir/e": b"bravo",
                   "./g": b"bravo", "later": b"later"}
    assert files["a.txt"] == got["c"]
    # webdataset reads only tarfile's isreg() members: it drops the hard links (and the rest)
    # in silence, and makes dir/.hidden a sample keyed "dir/", which feedpipe lists as left out
    theirs = dict(_wds_read([tar]))
    assert theirs.pop("dir/") == {"hidden": b"secret"}
    ours = dict(_feedpipe_read([tar]))
    assert {k: v for k, v in ours.items() if k not in ("c", "dir/e", "./g")} == theirs
    assert ours["c"] == {"txt": b"alpha"} and ours["dir/e"] == ours["./g"] == {"txt": b"bravo"}
    assert feedpipe.verify(str(tmp_path), show_progress=False).ok
    text = run_feedpipe("index", tmp_path)
    assert text.returncode == 0, text.stderr
    assert "left out 5 member(s) that make no sample" in text.stdout
    for s in skipped:
        assert f"    odd.tar: {s['path']} ({s['reason']})" in text.stdout


def test_the_python_api_says_what_it_left_out(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    _odd_members_tar(tmp_path / "odd.tar", tarfile.GNU_FORMAT)
    with caplog.at_level("WARNING", logger="feedpipe.index"):
        m = feedpipe.index(tmp_path, show_progress=False)
    said = [r.getMessage() for r in caplog.records if r.name == "feedpipe.index"]
    assert len(said) == 1 and said[0].startswith("5 member(s) of the shards make no sample")
    assert all(f"odd.tar: {s['path']} ({s['reason']})" in said[0] for s in m.skipped)
    assert m.total_samples == 6 and len(m.skipped) == 5  # a, dir/b, c, dir/e, ./g, later


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs a tar command")
@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar", "v7", "oldgnu"])
def test_index_of_a_system_tar_of_a_folder_with_links(tmp_path: Path, fmt: int) -> None:
    """``tar cf`` of a folder (GNU tar or bsdtar, in every format it writes) with dot-files, a
    hard link, symbolic links (to a file, to a directory, dangling) and an empty directory."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "one.txt").write_bytes(b"one")
    (src / "sub" / "two.bin").write_bytes(bytes(range(256)) * 5)
    (src / ".gitignore").write_text("*.o\n")
    (src / "sub" / ".env").write_text("A=1\n")
    os.link(src / "one.txt", src / "three.txt")
    os.symlink("one.txt", src / "four.txt")
    os.symlink("sub", src / "five")
    os.symlink("nowhere.txt", src / "six.txt")
    out = tmp_path / "out"
    out.mkdir()
    made = subprocess.run(["tar", f"--format={fmt}", "-cf", str(out / "s.tar"), "-C", str(src),
                           "."], capture_output=True, text=True)
    if made.returncode and "format" in made.stderr:
        pytest.skip(f"this tar writes no {fmt} format: {made.stderr.strip()}")
    assert made.returncode == 0, made.stderr
    m = feedpipe.index(out, show_progress=False)
    skipped = _nothing_vanishes([out / "s.tar"], out)
    reasons = {s["path"].removeprefix("./"): s["reason"].split(":")[0] for s in skipped}
    assert reasons == {".gitignore": "hidden file", "sub/.env": "hidden file",
                       "four.txt": "symbolic link to 'one.txt'", "five": "symbolic link to 'sub'",
                       "six.txt": "symbolic link to 'nowhere.txt'"}
    assert m.total_samples == 3  # one, sub/two and three (whichever of one/three is the link)
