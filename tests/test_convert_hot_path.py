"""What converting many small files costs per file: a file of unknown size is read in one
``read`` (its size comes with the type check), and records (no images) load no image-decoding
module, while a tree whose samples hold two images each is still told so."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import feedpipe
from feedpipe.convert import _sources

SCRIPT = """
import sys
import pytest

import feedpipe
from feedpipe.convert import _sources
feedpipe.shard(sys.argv[1], sys.argv[2], workers=1, show_progress=False)
print(sorted(m for m in sys.modules if m.startswith("feedpipe.transforms")))
"""


def test_converting_records_loads_no_image_decoder(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"r{i}.bin").write_bytes(bytes([i]) * 10)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_samples_of_two_images_are_still_named(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(b"j")
    (src / "a.png").write_bytes(b"p")
    (src / "b.jpg").write_bytes(b"j")
    with caplog.at_level(logging.WARNING, logger="feedpipe"):
        feedpipe.shard(str(src), str(tmp_path / "out"), workers=1, show_progress=False)
    assert "1 sample holds two or more images" in caplog.text and "a.png" in caplog.text


@pytest.mark.parametrize("size", [0, 1, 1024, 70_000])
def test_a_file_of_unknown_size_is_read_in_one_read(tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                     size: int) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    reads = []
    real = _sources.os.read
    monkeypatch.setattr(_sources.os, "read", lambda fd, n: reads.append(n) or real(fd, n))
    assert _sources.read_local(str(path)) == path.read_bytes()
    assert len(reads) == 1
