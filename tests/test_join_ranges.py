"""Joining byte ranges of staged files into a shard: the kernel's copy and the buffered one, on a
thread beside the hashing or before it, write the same bytes and hash, and a range past a file's
end is an error naming the file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from feedpipe.convert import _writer
from feedpipe.errors import OutputError
from feedpipe.format._index import ShardIndex
from feedpipe.format._tar import END_OF_ARCHIVE


def _index(bases: list[int]) -> ShardIndex:
    return ShardIndex([], [0], [], [], [], [])


@pytest.mark.parametrize("step", [8 << 20, 1000], ids=["one-piece", "pieces"])
@pytest.mark.parametrize("threaded", [True, False], ids=["copy-beside-hash", "copy-then-hash"])
@pytest.mark.parametrize("kernel", [True, False])
def test_ranges_join_to_the_same_bytes_by_either_copy(tmp_path: Path, kernel: bool,
                                                      threaded: bool, step: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_writer, "_KERNEL_COPY", kernel)
    monkeypatch.setattr(_writer, "_THREAD_FROM", 0 if threaded else 1 << 40)
    monkeypatch.setattr(_writer, "_WRITEBACK_STEP", step)
    a, b = tmp_path / ".a", tmp_path / ".b"
    a.write_bytes(bytes(range(256)) * 40)
    b.write_bytes(b"xyz" * 5000)
    out = tmp_path / "out"
    out.mkdir()
    ranges = [(str(a), 512, 4096), (str(b), 0, -1), (str(a), 0, 0), (str(a), 9728, -1)]
    rec, _ = _writer.join_ranges(str(out), "s.tar", ranges, _index, [])
    want = (a.read_bytes()[512:4608] + b.read_bytes() + a.read_bytes()[9728:]
            + END_OF_ARCHIVE)
    assert (out / "s.tar").read_bytes() == want
    assert (rec.bytes, rec.sha256) == (len(want), hashlib.sha256(want).hexdigest())


def test_a_range_past_the_end_names_the_file_and_leaves_no_shard(tmp_path: Path) -> None:
    a = tmp_path / ".a"
    a.write_bytes(b"q" * 1000)
    with pytest.raises(OutputError, match=r"\.a: ends 24 bytes early at 1000 while joining"):
        _writer.join_ranges(str(tmp_path), "s.tar", [(str(a), 512, 512)], _index, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a"]


@pytest.mark.parametrize("kernel", [True, False])
def test_the_join_starts_the_writeback_of_every_byte_it_copies(
        tmp_path: Path, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # the final fsync then finds the shard's bytes already on their way to disk
    monkeypatch.setattr(_writer, "_KERNEL_COPY", kernel)
    monkeypatch.setattr(_writer, "_WRITEBACK_STEP", 1000)
    started: list[tuple[int, int]] = []
    real = _writer.start_writeback

    def note(fd: int, offset: int, length: int) -> None:
        started.append((offset, length))
        real(fd, offset, length)  # the real call, on a real file: it must not fail

    monkeypatch.setattr(_writer, "start_writeback", note)
    a = tmp_path / ".a"
    a.write_bytes(bytes(range(256)) * 20)
    ranges = [(str(a), 512, 2048), (str(a), 0, -1)]
    tmp, bases, total, _ = _writer.seal_ranges(str(tmp_path), "s.tar", ranges)
    assert bases == [0, 2048]
    covered = sorted(started)
    assert covered[0][0] == 0
    assert all(o + n == o2 for (o, n), (o2, _) in zip(covered, covered[1:]))  # no gap
    assert covered[-1][0] + covered[-1][1] == total - len(END_OF_ARCHIVE)
    assert Path(tmp).read_bytes() == (a.read_bytes()[512:2560] + a.read_bytes()
                                      + END_OF_ARCHIVE)
