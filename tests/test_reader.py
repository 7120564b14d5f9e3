"""The shard reader: zero-copy samples by index, the scan path, remote byte ranges, and loud
failures on truncated or corrupted shards."""

from __future__ import annotations

import pickle
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from feedpipe.errors import ShardFormatError, SourceNotFoundError
from feedpipe.format._index import parse_index
from feedpipe.format._keys import source_path
from feedpipe.format._manifest import load_manifest
from feedpipe.format._reader import ShardReader, open_shard


def _as_bytes(sample: dict[str, object]) -> dict[str, object]:
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def _all(r: ShardReader) -> list[dict[str, object]]:
    return [_as_bytes(s) for s in r]


def test_samples_equal_source_files(image_folder: Path, sharded: Path) -> None:
    m = load_manifest(str(sharded))
    base = 0
    seen = set()
    for rec in m.shards:
        with ShardReader(str(sharded / rec.name), base=base, expected_bytes=rec.bytes,
                         sha256=rec.sha256, verify=True) as r:
            assert len(r) == rec.samples
            for i, s in enumerate(r):
                assert s["__shard__"] == rec.name
                assert s["__index__"] == base + i
                key = s["__key__"]
                assert isinstance(key, str) and key not in seen
                seen.add(key)
                fields = {k: v for k, v in s.items() if not k.startswith("__")}
                assert {"jpg", "cls"} <= set(fields)
                for ext, view in fields.items():
                    assert isinstance(view, memoryview)  # zero-copy slice of the map
                    assert view.readonly
                    if ext != "cls":
                        assert view == (image_folder / source_path(key, ext)).read_bytes()
        base += rec.samples
    assert base == m.total_samples == 30


def test_random_access_matches_iteration(sharded: Path) -> None:
    path = str(next(iter(sorted(sharded.glob("*.tar")))))
    with open_shard(path, name="custom", base=100) as r:
        in_order = _all(r)
        backwards = [_as_bytes(r.sample(i)) for i in reversed(range(len(r)))]
    assert backwards[::-1] == in_order
    assert [s["__index__"] for s in in_order] == list(range(100, 100 + len(in_order)))
    assert {s["__shard__"] for s in in_order} == {"custom"}


def test_reader_is_not_pickled(sharded: Path) -> None:
    with ShardReader(str(sharded / "data-000000.tar")) as r, pytest.raises(TypeError, match="URL"):
        pickle.dumps(r)


def test_missing_shard(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="nope.tar") as ei:
        ShardReader(str(tmp_path / "nope.tar"))
    assert isinstance(ei.value, FileNotFoundError)


def test_without_index_scan_gives_same_samples(sharded: Path, tmp_path: Path) -> None:
    for tar in sorted(sharded.glob("*.tar")):
        bare = tmp_path / tar.name
        shutil.copyfile(tar, bare)  # no .idx beside it: the reader scans the tar
        with ShardReader(str(tar)) as a, ShardReader(str(bare)) as b:
            assert a.index.offsets == b.index.offsets and a.index.names == b.index.names
            assert _all(a) == _all(b)


# --------------------------------------------------------------------------------------------
# truncation and corruption


def _first_member_past(path: Path, cut: int) -> int:
    idx = parse_index(path.with_suffix(".idx").read_text())
    return next(o for o, s in zip(idx.offsets, idx.sizes) if o + s > cut)


@pytest.fixture
def cut_shard(sharded_copy: Path) -> tuple[Path, int, int]:
    """data-000001.tar of a private copy, cut in the middle of its 4th sample's image."""
    shard = sharded_copy / "data-000001.tar"
    idx = parse_index((sharded_copy / "data-000001.idx").read_text())
    m = idx.starts[3]
    cut = idx.offsets[m] + idx.sizes[m] // 2
    full = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(cut)
    return shard, cut, full


def test_truncated_shard_raises_naming_shard_and_offset(cut_shard: tuple[Path, int, int]) -> None:
    shard, cut, _ = cut_shard
    bad = _first_member_past(shard, cut)
    msg = rf"data-000001\.tar: truncated: a member at offset {bad} "
    with pytest.raises(ShardFormatError, match=msg):
        ShardReader(str(shard))


def test_truncated_shard_against_manifest_size(cut_shard: tuple[Path, int, int]) -> None:
    shard, cut, full = cut_shard
    with pytest.raises(ShardFormatError) as ei:
        ShardReader(str(shard), expected_bytes=full)
    msg = str(ei.value)
    assert str(shard) in msg and "truncated" in msg and f"offset {cut}" in msg


def test_truncated_shard_without_index(cut_shard: tuple[Path, int, int]) -> None:
    shard, cut, _ = cut_shard
    shard.with_suffix(".idx").unlink()
    header = _first_member_past_header(shard, cut)
    msg = rf"data-000001\.tar: truncated: member at offset {header} "
    with pytest.raises(ShardFormatError, match=msg):
        ShardReader(str(shard))


def _first_member_past_header(shard: Path, cut: int) -> int:
    # the index is gone; find the header of the member holding byte `cut` by walking headers
    raw = shard.read_bytes()
    pos = 0
    while True:
        size = int(raw[pos + 124 : pos + 136].rstrip(b"\0 ") or b"0", 8)
        end = pos + 512 + (size + 511) // 512 * 512
        if pos + 512 + size > cut:
            return pos
        pos = end


def test_larger_than_manifest_says(sharded_copy: Path) -> None:
    shard = sharded_copy / "data-000000.tar"
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(ShardFormatError, match="larger than expected"):
        ShardReader(str(shard), expected_bytes=size)


def test_corrupted_bytes_detected_with_verify(sharded_copy: Path) -> None:
    m = load_manifest(str(sharded_copy))
    rec = m.shards[2]
    shard = sharded_copy / rec.name
    idx = parse_index(shard.with_suffix(".idx").read_text())
    where = idx.offsets[0] + 10  # inside the first image's data
    raw = bytearray(shard.read_bytes())
    raw[where] ^= 0xFF
    shard.write_bytes(raw)
    with pytest.raises(ShardFormatError, match=rf"{rec.name}: content hash mismatch"):
        ShardReader(str(shard), expected_bytes=rec.bytes, sha256=rec.sha256, verify=True)
    # the damage is in member data, which only the hash can see: without verify it reads
    with ShardReader(str(shard), expected_bytes=rec.bytes) as r:
        assert r.sample(0)["jpg"][10] == raw[where]


def test_corrupted_header_without_index(sharded_copy: Path) -> None:
    shard = sharded_copy / "data-000003.tar"
    idx = parse_index(shard.with_suffix(".idx").read_text())
    header = idx.offsets[idx.starts[2]] - 512  # the header of the 3rd sample's first member
    raw = bytearray(shard.read_bytes())
    raw[header + 1] ^= 0x01
    shard.write_bytes(raw)
    shard.with_suffix(".idx").unlink()
    msg = rf"data-000003\.tar: corrupted tar header at offset {header}\b"
    with pytest.raises(ShardFormatError, match=msg):
        ShardReader(str(shard))


# --------------------------------------------------------------------------------------------
# remote shards through fsspec


@pytest.fixture
def memory_root() -> Iterator[str]:
    fs = fsspec.filesystem("memory")
    root = f"/feedpipe-test-{uuid.uuid4().hex}"
    try:
        yield root
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _upload(root: str, files: dict[str, bytes]) -> None:
    fs = fsspec.filesystem("memory")
    for name, data in files.items():
        fs.pipe_file(f"{root}/{name}", data)


@pytest.mark.parametrize("with_index", [True, False], ids=["indexed", "scanned"])
def test_memory_url_gives_same_samples(sharded: Path, memory_root: str, with_index: bool) -> None:
    for tar in sorted(sharded.glob("*.tar")):
        files = {tar.name: tar.read_bytes()}
        if with_index:
            files[tar.with_suffix(".idx").name] = tar.with_suffix(".idx").read_bytes()
        _upload(memory_root, files)
        url = f"memory://{memory_root}/{tar.name}"
        with ShardReader(str(tar)) as local:
            expected = _all(local)
        remote = ShardReader(url, expected_bytes=tar.stat().st_size)
        got = list(remote)
        assert all(isinstance(v, memoryview) for s in got for k, v in s.items()
                   if not k.startswith("__"))
        assert [_as_bytes(s) for s in got] == expected


def test_memory_url_truncated_object(sharded: Path, memory_root: str) -> None:
    tar = sharded / "data-000000.tar"
    raw = tar.read_bytes()
    _upload(memory_root, {tar.name: raw[: len(raw) // 2],
                          "data-000000.idx": tar.with_suffix(".idx").read_bytes()})
    url = f"memory://{memory_root}/data-000000.tar"
    msg = r"data-000000\.tar: truncated: a member at offset \d+"
    with pytest.raises(ShardFormatError, match=msg):
        ShardReader(url)
    with pytest.raises(ShardFormatError, match=rf"offset {len(raw) // 2}"):
        ShardReader(url, expected_bytes=len(raw))


def test_range_read_of_wrong_length_raises(sharded: Path, memory_root: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tar = sharded / "data-000000.tar"
    _upload(memory_root, {tar.name: tar.read_bytes(),
                          "data-000000.idx": tar.with_suffix(".idx").read_bytes()})
    r = ShardReader(f"memory://{memory_root}/data-000000.tar")
    assert r.sample(1)["jpg"]  # sound before the server misbehaves
    fs = fsspec.filesystem("memory")  # the instance the reader reads through (fsspec caches it)
    real = fs.cat_file

    def short(path: str, start: int | None = None, end: int | None = None, **kw: object) -> bytes:
        return real(path, start=start, end=end, **kw)[:-1]

    monkeypatch.setattr(fs, "cat_file", short)
    ix = r.index
    lo = ix.offsets[ix.starts[1]]
    n = ix.offsets[ix.starts[2] - 1] + ix.sizes[ix.starts[2] - 1] - lo
    msg = rf"data-000000\.tar: .*read at offset {lo} returned {n - 1} bytes instead of {n}\b"
    with pytest.raises(ShardFormatError, match=msg):
        r.sample(1)


# -- the index parser: column-wise fast path and the line loop agree ------------------------
def _loop_only(text: str) -> object:
    import importlib

    index_mod = importlib.import_module("feedpipe.format._index")
    saved = index_mod._parse_columns
    index_mod._parse_columns = lambda body: None  # type: ignore[assignment]
    try:
        return parse_index(text, "x.idx")
    finally:
        index_mod._parse_columns = saved


def test_column_parse_equals_the_line_loop() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from feedpipe.format._index import ShardIndex, format_index

    stem = st.text(st.characters(blacklist_characters=" \n\r\t\x0b\x0c./", codec="utf-8"),
                   min_size=1, max_size=8)
    ext = st.text("abcdejpgsonx.", min_size=1, max_size=7).filter(lambda e: e[0] != ".")

    @st.composite
    def indexes(draw: st.DrawFn) -> ShardIndex:
        idx = ShardIndex([], [0], [], [], [], [])
        pos = 512
        for i in range(draw(st.integers(0, 12))):
            folder = draw(st.sampled_from(["", "a/", "d.ir/x/", "é/"]))
            key = f"{folder}{draw(stem)}{i}"
            idx.keys.append(key)
            for e in draw(st.lists(ext, min_size=1, max_size=3, unique=True)):
                size = draw(st.integers(0, 5000))
                idx.exts.append(e)
                idx.offsets.append(pos)
                idx.sizes.append(size)
                idx.names.append(f"{key}.{e}")
                pos += 512 + size
            idx.starts.append(len(idx.exts))
        return idx

    @settings(max_examples=200, deadline=None)
    @given(indexes(), st.booleans())
    def check(idx: ShardIndex, trailing_blank: bool) -> None:
        text = format_index(idx) + ("\n" if trailing_blank else "")
        assert parse_index(text) == _loop_only(text) == idx

    check()


@pytest.mark.parametrize("line,error", [
    ("jpg 512 10 a.jpg cls", r"x\.idx:3: malformed index line"),
    ("jpg 512 ten a.jpg", r"x\.idx:3: bad offset/size"),
    ("jpg  512 10 a.jpg", r"x\.idx:3: (malformed index line|bad offset/size)"),
    ("jpg 512 10 ", None),  # no member name: the sample is named after its line
])
def test_a_bad_line_is_named_by_number(line: str, error: str | None) -> None:
    text = f"v1.2 2\njpg 0 5 z.jpg\n{line}\n"
    if error is None:
        idx = parse_index(text, "x.idx")
        assert idx == _loop_only(text) and idx.keys == ["z", "1"] and idx.names[1] == "1.jpg"
        return
    with pytest.raises(ShardFormatError, match=error):
        parse_index(text, "x.idx")


def _mapped_rss(path: str) -> int | None:
    """Bytes of ``path``'s mappings resident in this process (``/proc/self/smaps``)."""
    try:
        text = open("/proc/self/smaps", encoding="utf-8").read()
    except OSError:
        return None
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
            inside = len(head) == 6 and head[5] == path
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("drop_every", [256 << 10, 1 << 40])
def test_pages_served_from_a_map_are_dropped_as_reading_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop_every: int) -> None:
    """A shard read sample by sample adds at most about DROP_EVERY to RSS (the control, with no
    drop, holds the whole shard), and the views handed out before a drop still read right."""
    import os
    import zlib

    import feedpipe
    from feedpipe.format import _reader as reader_mod

    src = tmp_path / "src"
    src.mkdir()
    blobs = {f"s{i:03d}": os.urandom(64 << 10) for i in range(200)}
    for k, v in blobs.items():
        (src / f"{k}.bin").write_bytes(v)
    feedpipe.shard(str(src), str(tmp_path / "out"), show_progress=False)
    shard = next((tmp_path / "out").glob("*.tar"))
    if _mapped_rss(str(shard)) is None:
        pytest.skip("needs /proc/self/smaps")
    monkeypatch.setattr(reader_mod, "DROP_EVERY", drop_every)
    r = ShardReader(str(shard))
    held = []
    for i in range(len(r)):  # each sample read through its view, as a transform reads it
        held.append(r.sample(i))
        assert zlib.crc32(held[-1]["bin"]) == zlib.crc32(blobs[held[-1]["__key__"]])
    rss = _mapped_rss(str(shard))
    assert rss is not None
    if drop_every < shard.stat().st_size:
        # what was served since the last drop, plus the kernel's fault-around: not the shard
        assert rss <= 8 * drop_every < shard.stat().st_size // 6, rss
    else:
        assert rss >= 200 * (64 << 10), rss  # the control: every page served is still mapped
    assert {s["__key__"]: bytes(s["bin"]) for s in held} == blobs


def _large_shard(tmp_path: Path, n: int, size: int) -> tuple[Path, dict[str, bytes]]:
    import os

    import feedpipe

    src = tmp_path / "src"
    src.mkdir()
    blobs = {f"s{i:05d}": os.urandom(size) for i in range(n)}
    for k, v in blobs.items():
        (src / f"{k}.bin").write_bytes(v)
    feedpipe.shard(str(src), str(tmp_path / "out"), show_progress=False)
    return next((tmp_path / "out").glob("*.tar")), blobs


@pytest.mark.parametrize("cached_by", ["read", "map", "read, pagemap unreadable"])
@pytest.mark.slow
def test_what_a_sample_maps_is_measured_so_rss_stays_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached_by: str) -> None:
    """How much one touch of a map maps depends on how its file came into the page cache: a
    file cached by read() can hold large folios, mapped whole (hundreds of KiB a touch, Linux
    6.x), one faulted in through a map only the kernel's fault-around. Each reader measures it,
    so a shuffled pass over a shard keeps about DROP_EVERY of it mapped either way; where
    /proc/self/pagemap cannot be read, a fixed charge for the largest folios keeps the bound."""
    import os
    import random

    from feedpipe.format import _reader as reader_mod

    shard, blobs = _large_shard(tmp_path, 6000, 4 << 10)  # small samples: the touch is what maps
    if _mapped_rss(str(shard)) is None or reader_mod._mapped_bytes(memoryview(b"x")) is None:
        pytest.skip("needs /proc/self/smaps and /proc/self/pagemap")
    fd = os.open(shard, os.O_RDONLY)
    try:  # out of the page cache, then back in the way the case says
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached_by.startswith("read"):
            while os.read(fd, 1 << 20):
                pass
    finally:
        os.close(fd)
    monkeypatch.setattr(reader_mod, "DROP_EVERY", 2 << 20)
    if "unreadable" in cached_by:
        monkeypatch.setattr(reader_mod, "_mapped_bytes", lambda view: None)
    r = ShardReader(str(shard))
    order = list(range(len(r)))
    random.Random(0).shuffle(order)
    most = 0
    for k, i in enumerate(order):
        s = r.sample(i)
        assert bytes(s["bin"]) == blobs[s["__key__"]]  # every page of it touched
        if k % 16 == 15:
            rss = _mapped_rss(str(shard))
            assert rss is not None
            most = max(most, rss)
    r.close()
    # what was served since the last drop (DROP_EVERY, charged as measured) and the last
    # sample's folio: not the 27 MB shard, nor what a fixed fault-around charge lets through
    assert most <= 2 * (2 << 20) + (1 << 20), most


def _mapped_kb(path: str) -> int | None:
    """Resident KB of this process's map of ``path`` (Linux), else None."""
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total, current = 0, False
    for line in lines:
        parts = line.split()
        if parts and "-" in parts[0] and ":" not in parts[0]:
            current = len(parts) > 5 and parts[5] == path
        elif current and parts[0] == "Rss:":
            total += int(parts[1])
    return total


def test_drop_pages_unmaps_what_was_read_and_views_stay_valid(sharded: Path) -> None:
    # (the rows routes drop the maps' pages while a batch is decoded: the samples of a
    # whole batch are handed out before any is read)
    m = load_manifest(str(sharded))
    path = str(sharded / m.shards[0].name)
    with ShardReader(path) as r:
        samples = [r.sample(i) for i in range(len(r))]
        before = [{k: bytes(v) for k, v in s.items() if isinstance(v, memoryview)}
                  for s in samples]  # every page read
        mapped = _mapped_kb(path)
        r.drop_pages()
        after = _mapped_kb(path)
        if mapped is not None:
            assert mapped > 0 and after == 0
        assert [{k: bytes(v) for k, v in s.items() if isinstance(v, memoryview)}
                for s in samples] == before
