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
