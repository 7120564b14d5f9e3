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


NUMPY_SCRIPT = """
import sys

import feedpipe
feedpipe.shard(sys.argv[1], sys.argv[2], workers=1, show_progress=False)
print("numpy" in sys.modules)
"""


@pytest.mark.parametrize("kind", ["records", "images"])
def test_converting_loads_no_numpy_and_the_sizes_read_back(tmp_path: Path, kind: str) -> None:
    """The sidecar files a conversion writes (image sizes, video frame counts) were written
    with numpy, whose import cost a small conversion more than its writing
    (benchmarks/bench_versions.py's convert phases, counted in instructions). They are written
    from the standard library now, and numpy reads them back as before."""
    import numpy as np
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    sizes = [(16 + 3 * i, 9 + i) for i in range(5)]
    for i, (w, h) in enumerate(sizes):
        if kind == "images":
            ext = "png" if i % 2 else "jpg"
            Image.new("RGB", (w, h), (i, 2 * i, 3 * i)).save(src / f"s{i}.{ext}")
        else:
            (src / f"r{i}.bin").write_bytes(bytes([i]) * 10)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", NUMPY_SCRIPT, str(src), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
    written = sorted(out.glob("*.sizes.npy"))
    if kind == "records":
        assert written == []
        return
    assert len(written) == 1
    got = np.load(written[0], allow_pickle=False)
    assert got.dtype == np.int32 and got.shape == (5, 2)
    keys = [s["__key__"] for s in feedpipe.FeedDataset(str(out))]
    assert {k: tuple(r) for k, r in zip(keys, got.tolist())} == {
        f"s{i}": wh for i, wh in enumerate(sizes)}
