"""Each image's (width, height) is recorded beside its shard at shard time, read from the
image's header (never decoded), and a dataset sharded without them gets them from a one-time
scan; Pillow's decoded size is the reference."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe.format._image_sizes import header_size, load_sizes, sizes_path

Image = pytest.importorskip("PIL.Image")

FORMATS = [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {}), ("WEBP", {}),
           ("WEBP", {"lossless": True}), ("GIF", {}), ("BMP", {}), ("TIFF", {})]


def encoded(w: int, h: int, fmt: str, **kw: object) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (w, h), (w % 255, h % 255, 7)).save(b, fmt, **kw)
    return b.getvalue()


@settings(max_examples=40, deadline=None)
@given(w=st.integers(1, 700), h=st.integers(1, 700), k=st.integers(0, len(FORMATS) - 1))
def test_the_header_size_is_the_size_pillow_decodes(w: int, h: int, k: int) -> None:
    fmt, kw = FORMATS[k]
    data = encoded(w, h, fmt, **kw)
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        assert header_size(data) == im.size == (w, h)


def test_a_jpeg_with_a_large_exif_segment_before_its_frame_is_sized() -> None:
    data = encoded(321, 123, "JPEG", exif=b"Exif\0\0" + bytes(60000))
    assert header_size(data) == (321, 123)


def test_bytes_that_are_no_image_have_no_size() -> None:
    assert header_size(b"not an image at all, just text") is None
    assert header_size(b"\xff\xd8\xff") is None  # a JPEG cut before its frame header


def _samples() -> list[dict[str, object]]:
    out: list[dict[str, object]] = [
        {"__key__": f"k{i:02d}", "jpg": encoded(20 + 3 * i, 40 - i, "JPEG"), "cls": i}
        for i in range(9)]
    out.append({"__key__": "p", "png": encoded(33, 7, "PNG")})
    out.append({"__key__": "t", "txt": "no image here"})
    out.append({"__key__": "z", "jpg": b"\xff\xd8 broken"})
    return out


def test_sharding_records_every_samples_size_beside_its_shard(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    out = str(tmp_path / "ds")
    with caplog.at_level(logging.INFO, "feedpipe.sizes"):
        feedpipe.write_samples(_samples(), out, max_samples=5)
    m = feedpipe.load_manifest(out)
    assert all(os.path.exists(sizes_path(os.path.join(out, r.name))) for r in m.shards)
    want = [[20 + 3 * i, 40 - i] for i in range(9)] + [[33, 7], [-1, -1], [-1, -1]]
    assert load_sizes(out, m).tolist() == want
    # the broken header is said, not silently left without a size
    assert any("1 image(s)" in r.getMessage() for r in caplog.records)


def test_without_the_c_extension_python_records_the_same_sizes_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from feedpipe._helpers import dependency
    from feedpipe.format import _image_sizes

    feedpipe.write_samples(_samples(), str(tmp_path / "c"), max_samples=5)
    monkeypatch.setattr(_image_sizes, "_C", None)
    monkeypatch.setattr(dependency, "UNBUILT_SAID", set())
    with caplog.at_level(logging.INFO, "feedpipe"):
        for name in ("p1", "p2"):
            feedpipe.write_samples(_samples(), str(tmp_path / name), max_samples=5)
    for name in ("c", "p1", "p2"):
        out = str(tmp_path / name)
        assert load_sizes(out, feedpipe.load_manifest(out)).tolist() == (
            [[20 + 3 * i, 40 - i] for i in range(9)] + [[33, 7], [-1, -1], [-1, -1]])
    said = [r for r in caplog.records if "feedpipe._native._stagefiles" in r.getMessage()]
    assert len(said) == 1 and "read from their headers by Python" in said[0].getMessage()
    assert sum("1 image(s)" in r.getMessage() for r in caplog.records) == 2


def test_the_cli_shard_of_an_image_folder_records_sizes(tmp_path: Path) -> None:
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(3):
        (src / f"{i}.jpg").write_bytes(encoded(50 + i, 30, "JPEG"))
    feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "out"), labels_from_dirs=True,
                   show_progress=False)
    m = feedpipe.load_manifest(str(tmp_path / "out"))
    assert sorted(load_sizes(str(tmp_path / "out"), m).tolist()) == [[50, 30], [51, 30],
                                                                      [52, 30]]


def test_shards_without_sizes_get_them_from_a_one_time_scan(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = str(tmp_path / "ds")
    feedpipe.write_samples(_samples(), out, max_samples=5)
    m = feedpipe.load_manifest(out)
    want = load_sizes(out, m)
    for r in m.shards:
        os.remove(sizes_path(os.path.join(out, r.name)))
    with pytest.raises(feedpipe.InputError, match="record_image_sizes"):
        load_sizes(out, m)
    with caplog.at_level(logging.INFO, "feedpipe.sizes"):
        got = feedpipe.record_image_sizes(out)
    assert got == {"shards": 3, "images": 10, "unread": 1}
    assert any("recorded the image sizes of 3 shard(s)" in r.getMessage()
               for r in caplog.records)
    assert np.array_equal(load_sizes(out, m), want)
    assert feedpipe.record_image_sizes(out)["shards"] == 0  # done once


RSS_SCRIPT = """
import resource, sys
from feedpipe.format._image_sizes import sizes_of_file
from feedpipe.format._sidecars import local_index
idx = local_index(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sizes, unread = sizes_of_file(sys.argv[1], idx)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, sizes[:2].tolist(), unread)
"""


def test_reading_a_shards_image_sizes_does_not_bring_the_shard_into_memory(
        tmp_path: Path) -> None:
    """The sizes recorded at shard time were read through a map of the whole shard, and the
    kernel mapped most of it on the way (a touch maps a page's whole large folio): converting
    bench_versions' 36 MB of small images peaked at 64 MB of RSS against 28 MB on the tree before
    sizes were recorded (its convert phase: 70 MB against 32 MB). Each run of samples' pages is
    now let go once their headers are read."""
    import subprocess
    import sys

    from feedpipe import ShardWriter

    head = encoded(48, 32, "JPEG")
    out = tmp_path / "ds"
    with ShardWriter(str(out), max_samples=10_000) as w:  # 400 samples of 100 KB: one 40 MB shard
        for i in range(400):
            w.write({"__key__": f"s{i:04d}", "jpg": head + os.urandom(100_000)})
    (tar,) = sorted(out.glob("*.tar"))
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tar)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew_kb, first, unread = proc.stdout.split(" ", 1)[0], *proc.stdout.split(" ", 1)[1].rsplit(
        " ", 1)
    assert first.strip() == "[48, 32]" and int(unread) == 0
    assert int(grew_kb) < 8 * 1024, f"peak RSS grew {int(grew_kb) // 1024} MB over a 40 MB shard"
