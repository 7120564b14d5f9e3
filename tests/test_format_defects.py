"""Malformed and unusual tar shards and indexes (issue 23, defects 6, 7, 8, 11, 13, 14, 16; issue
22, compressed shards): ``feedpipe index``, ``feedpipe verify`` and the reader's scan agree with
``tarfile`` where the bytes are sound, and otherwise refuse with the named error naming the file
and leave nothing half-written behind."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from _tars import END, base256, header, member, pad, pax, pax_record, tarfile_members
from conftest import run_feedpipe

import feedpipe
from feedpipe.errors import CompressedShardError, ShardFormatError
from feedpipe.format._index import parse_index
from feedpipe.format._reader import ShardReader
from feedpipe.format._verify import verify_shard


def _shard(tmp_path: Path, raw: bytes, name: str = "s.tar") -> Path:
    d = tmp_path / "ds"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_bytes(raw)
    return p


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp-" in p.name)


def _read(p: Path) -> list[tuple[str, bytes]]:
    """``(member name, bytes)`` of every member, as the reader serves them."""
    with ShardReader(str(p)) as r:
        out = []
        for i in range(len(r)):
            s = r.sample(i)
            a, b = r.index.starts[i], r.index.starts[i + 1]
            out += [(r.index.names[m], bytes(s[r.index.exts[m]])) for m in range(a, b)]
        return out


# -- defect 6: base-256 numeric fields --------------------------------------------------------
def test_base256_size_is_read_as_gnu_tar_and_tarfile_read_it(tmp_path: Path) -> None:
    data = bytes(range(256))
    raw = header("a.bin", 0, size_field=base256(256)) + pad(data) + member("b.txt", b"hi") + END
    assert tarfile_members(raw) == [("a.bin", data), ("b.txt", b"hi")]
    p = _shard(tmp_path, raw)
    assert _read(p) == [("a.bin", data), ("b.txt", b"hi")]  # the scan, no index yet
    feedpipe.index([str(p)], show_progress=False)
    assert parse_index(p.with_suffix(".idx").read_text()).sizes == [256, 2]
    assert _read(p) == [("a.bin", data), ("b.txt", b"hi")]  # through the index
    assert feedpipe.verify(str(p.parent)).ok


def test_negative_base256_size_is_refused(tmp_path: Path) -> None:
    raw = header("a.bin", 0, size_field=b"\xff" * 12) + member("b.txt", b"hi") + END
    p = _shard(tmp_path, raw)
    with pytest.raises(ShardFormatError, match=r"s\.tar: .*offset 0.*size"):
        feedpipe.index([str(p)], show_progress=False)


# -- defect 7: a file cut inside a member's padding ---------------------------------------------
def test_tar_cut_inside_padding_is_truncated_everywhere(tmp_path: Path) -> None:
    from _tars import build

    raw = build([(f"s{i}.txt", b"x" * 10) for i in range(6)])[:700]
    p = _shard(tmp_path, raw)
    with pytest.raises(ShardFormatError, match=r"s\.tar: truncated.* offset 0"):
        feedpipe.index([str(p)], show_progress=False)
    assert not p.with_suffix(".idx").exists() and not (p.parent / "manifest.json").exists()
    with pytest.raises(ShardFormatError, match=r"s\.tar: truncated"):
        ShardReader(str(p))  # the reader's scan (no index)
    problems = verify_shard(str(p), None, 700, None)
    assert [x.kind for x in problems] == ["truncated"] and problems[0].offset == 0
    r = run_feedpipe("index", p)
    assert r.returncode == 2 and "truncated" in r.stderr and "Traceback" not in r.stderr


# -- defects 8 and 16: PAX records --------------------------------------------------------------
def test_zero_length_pax_record_does_not_spin(tmp_path: Path) -> None:
    p = _shard(tmp_path, pax(b"0 path=x\n") + member("a.txt", b"hi") + END)
    r = run_feedpipe("index", p, timeout=30)
    assert r.returncode == 2, r.stdout
    assert f"{p}: malformed PAX record at offset 0" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("records", [
    b"0 path=x\n",  # zero length
    b"3 a\n",  # shorter than its own text
    b"x path=y\n",  # length not a number
    b"+9 path=y\n",  # a sign is not a digit
    b"99 path=y\n",  # runs past the header's data
    b"9 path=yZ",  # not ended by a newline
    b"8 pathy\n",  # no '='
    b"6 =xy\n",  # empty keyword
])
def test_malformed_pax_records_are_refused(tmp_path: Path, records: bytes) -> None:
    p = _shard(tmp_path, pax(records) + member("a.txt", b"hi") + END)
    with pytest.raises(ShardFormatError, match=r"s\.tar: malformed PAX record at offset 0"):
        feedpipe.index([str(p)], show_progress=False)
    with pytest.raises(ShardFormatError, match=r"malformed PAX record"):
        ShardReader(str(p))
    assert [x.kind for x in verify_shard(str(p), None, None, None)] == ["header"]


def test_pax_size_beyond_the_file_is_truncation(tmp_path: Path) -> None:
    p = _shard(tmp_path, pax(pax_record("size", "9999999999")) + member("a.txt", b"x") + END)
    with pytest.raises(ShardFormatError, match=r"s\.tar: truncated: member at offset 1024 needs "
                                               r"9999999999 bytes"):
        feedpipe.index([str(p)], show_progress=False)
    assert [x.kind for x in verify_shard(str(p), None, None, None)] == ["truncated"]


def test_pax_size_and_path_are_applied(tmp_path: Path) -> None:
    data = b"y" * 700
    raw = (pax(pax_record("size", "700") + pax_record("path", "dir/long.name.txt"))
           + header("short", 3) + pad(data) + member("b.txt", b"z") + END)
    assert tarfile_members(raw) == [("dir/long.name.txt", data), ("b.txt", b"z")]
    p = _shard(tmp_path, raw)
    feedpipe.index([str(p)], show_progress=False)
    assert _read(p) == tarfile_members(raw)


@pytest.mark.parametrize(("raw", "what"), [
    (header("a.bin", 0, size_field=b"\xff" * 12) + END, "corrupted tar header at offset 0"),
    (header("a.bin", 100), "truncated: member at offset 0 needs 100 bytes"),
    (pax(b"3 a\n") + member("a.txt", b"hi") + END, "malformed PAX record at offset 0"),
], ids=["bad-size", "cut-member", "bad-pax"])
def test_a_damaged_shard_says_what_to_do(tmp_path: Path, raw: bytes, what: str) -> None:
    p = _shard(tmp_path, raw)
    with pytest.raises(ShardFormatError) as ei:
        feedpipe.index([str(p)], show_progress=False)
    msg = str(ei.value)
    assert f"{p}: {what}" in msg and "re-copy" in msg and "`feedpipe verify" in msg, msg


# -- defects 11 and 13: named errors, nothing left behind ---------------------------------------
def test_index_of_a_directory_named_like_a_shard(tmp_path: Path) -> None:
    p = _shard(tmp_path, member("a.txt", b"hi") + END, "a.tar")
    (p.parent / "data.tar").mkdir()
    r = run_feedpipe("index", p.parent)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "data.tar" in r.stderr and "directory" in r.stderr
    r = run_feedpipe("index", p.parent / "*.tar")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "data.tar" in r.stderr


@pytest.mark.parametrize("raw", [
    member(b"caf\xe9.txt", b"x") + END,
    pax(pax_record("path", b"caf\xe9.txt")) + member("a.txt", b"x") + END,
    pax(pax_record("size", "abc")) + member("a.txt", b"x") + END,
    pax(pax_record("size", " 12")) + member("a.txt", b"x") + END,
], ids=["latin1-name", "latin1-pax-path", "pax-size-abc", "pax-size-space"])
def test_bad_names_and_pax_sizes_are_named(tmp_path: Path, raw: bytes) -> None:
    p = _shard(tmp_path, raw)
    r = run_feedpipe("index", p)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and f"{p}: " in r.stderr and "offset 0" in r.stderr
    assert _leftovers(p.parent) == [] and not p.with_suffix(".idx").exists()
    with pytest.raises(ShardFormatError, match=r"s\.tar: "):
        ShardReader(str(p))


# -- defect 14: a garbage .idx ------------------------------------------------------------------
def test_garbage_index_is_named(sharded_copy: Path) -> None:
    idxf = sharded_copy / "data-000001.idx"
    idxf.write_bytes(b"\xff\xfe\x00garbage\x80\n" * 3)
    with pytest.raises(ShardFormatError, match=r"data-000001\.idx: not a webdataset index"):
        ShardReader(str(sharded_copy / "data-000001.tar"))
    with pytest.raises(ShardFormatError, match=r"x\.idx: not a webdataset index: not UTF-8 text"):
        parse_index(idxf.read_bytes(), "x.idx")
    with pytest.raises(ShardFormatError, match=r"data-000001\.idx"):
        list(feedpipe.FeedDataset(str(sharded_copy)))
    report = feedpipe.verify(str(sharded_copy))
    assert [(p.kind, p.shard) for p in report.problems] == [
        ("index", str(sharded_copy / "data-000001.tar"))]
    assert "data-000001.idx" in str(report.problems[0])
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "data-000001.idx" in r.stdout


def test_index_with_negative_offsets_is_refused() -> None:
    with pytest.raises(ShardFormatError, match=r"x\.idx:2: bad offset/size"):
        parse_index("v1.2 1\njpg -512 10 a.jpg\n", "x.idx")


# -- compressed shards (issue 22; gzip ones are read since issue 34: test_compressed_shards.py) --
def test_compressed_shards_are_refused_with_the_way_to_convert(tmp_path: Path) -> None:
    import lzma

    raw = member("a.txt", b"hi") + END
    xz = _shard(tmp_path, lzma.compress(raw), "s.tar.xz")
    for target in (xz, xz.parent):
        r = run_feedpipe("index", target)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "compressed" in r.stderr and "unxz" in r.stderr and "feedpipe shard" in r.stderr
    with pytest.raises(CompressedShardError, match=r"s\.tar\.xz: compressed shards"):
        feedpipe.index([str(xz)], show_progress=False)
    # gzip bytes under a .tar name: the same sentence, not "corrupted tar header"
    disguised = _shard(tmp_path, gzip.compress(raw), "t.tar")
    with pytest.raises(CompressedShardError, match=r"t\.tar: .*gzip-compressed"):
        feedpipe.index([str(disguised)], show_progress=False)
    with pytest.raises(CompressedShardError):
        ShardReader(str(disguised))


def test_manifest_pointing_at_compressed_shards(sharded_copy: Path) -> None:
    doc = json.loads((sharded_copy / "manifest.json").read_text())
    doc["shards"][1]["name"] = "data-000001.tar.xz"
    (sharded_copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CompressedShardError, match=r"data-000001\.tar\.xz: compressed shards"):
        feedpipe.FeedDataset(str(sharded_copy))
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 2 and "compressed shards" in r.stderr and "Traceback" not in r.stderr


def test_index_that_cannot_be_written_leaves_no_temporary_file(tmp_path: Path) -> None:
    p = _shard(tmp_path, member("a.txt", b"hi") + END)
    p.with_suffix(".idx").mkdir()  # the rename onto it fails, as on a read-only directory
    r = run_feedpipe("index", p)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "s.idx" in r.stderr, r.stderr
    assert _leftovers(p.parent) == [] and not (p.parent / "manifest.json").exists()


def test_data_after_the_end_of_archive_is_refused(tmp_path: Path) -> None:
    """A header zeroed in the middle of a shard looks like the end of the archive to every tar
    reader (tarfile silently lists only the members before it): refused, not half-indexed."""
    from _tars import build

    raw = bytearray(build([(f"s{i}.txt", b"x" * 10) for i in range(4)]))
    raw[2048:2560] = bytes(512)  # the third member's header
    assert [n for n, _ in tarfile_members(bytes(raw))] == ["s0.txt", "s1.txt"]
    p = _shard(tmp_path, bytes(raw))
    with pytest.raises(ShardFormatError, match=r"s\.tar: data after the end-of-archive block at "
                                               r"offset 2048 \(a non-zero byte at 2560; a tar "
                                               r"header at offset 3072\)"):
        feedpipe.index([str(p)], show_progress=False)
    with pytest.raises(ShardFormatError, match="end-of-archive"):
        ShardReader(str(p))
    # zeros after the end (GNU tar pads archives to whole records) are fine
    p.write_bytes(build([("a.txt", b"1")]) + bytes(10240))
    feedpipe.index([str(p)], show_progress=False)
    assert _read(p) == [("a.txt", b"1")]


def test_junk_after_the_end_of_archive_is_read_with_a_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Non-zero bytes after the end-of-archive blocks that hold no tar header (a copy tool's or a
    writer's leftovers): GNU tar and tarfile read the archive, and so does feedpipe, saying so;
    "re-copy or re-fetch" could not have helped."""
    import logging
    import shutil
    import subprocess

    from _tars import build

    members = [(f"s{i}.txt", b"x" * (300 * i + 1)) for i in range(3)]
    good = build(members)
    junk = b"trailer written by some tool\n" + bytes(range(256)) * 5
    p = _shard(tmp_path, good + junk)
    assert tarfile_members(good + junk) == members
    if shutil.which("tar"):
        listed = subprocess.run(["tar", "-tf", str(p)], capture_output=True, text=True)
        assert listed.returncode == 0 and listed.stdout.split() == [n for n, _ in members]
    with caplog.at_level(logging.WARNING, logger="feedpipe.format"):
        m = feedpipe.index([str(p)], show_progress=False)
    assert m.total_samples == 3
    note = [r.getMessage() for r in caplog.records if r.name == "feedpipe.format"]
    assert note and "s.tar" in note[0] and f"the first non-zero at {len(good)})" in note[0], note
    assert "hold no tar header: ignored" in note[0]
    assert _read(p) == members  # through the index
    assert feedpipe.verify(str(p.parent), show_progress=False).ok
    p.with_suffix(".idx").unlink()
    assert _read(p) == members  # the reader's own scan
    # a member after the junk, at a block boundary: hidden from every tar reader, refused
    hidden = build([("late.txt", b"y")])
    cut = len(junk) + (-len(junk)) % 512
    p.write_bytes(good + junk.ljust(cut, b"j") + hidden)
    with pytest.raises(ShardFormatError, match=rf"s\.tar: data after the end-of-archive block at "
                                               r"offset 3584 .*a tar header at "
                                               rf"offset {len(good) + cut}\)"):
        feedpipe.index([str(p)], show_progress=False)
