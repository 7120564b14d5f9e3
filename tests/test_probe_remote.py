"""The probe over remote URLs: what it measures of the link, what it predicts, what it advises,
and that a slow server does not break its loader stage."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from _servers import python_server

from feedpipe import ShardWriter
from feedpipe.diagnostics._probe import probe


def _jpeg(w: int, h: int) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (w, h), (w, h, 7)).save(b, "JPEG")
    return b.getvalue()


@pytest.fixture(scope="module")
def sizes_change_later(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JPEGs all 16x16 for the first 4 samples, then every other one 32x24."""
    out = tmp_path_factory.mktemp("later") / "ds"
    with ShardWriter(str(out), max_samples=8) as w:
        for i in range(48):
            size = (16, 16) if i < 4 or i % 2 else (24, 32)
            w.write({"__key__": f"k{i:03d}", "jpg": _jpeg(*size), "cls": i % 3})
    return out


def test_a_slow_server_that_shows_one_image_size_first_does_not_break_the_loader_stage(
        sizes_change_later: Path) -> None:
    """Over a server with a long round trip the read stage sees only the first few samples, all
    of one size, so batches were stacked as they are; the loader stage then met images of
    another size and failed in every run: "stack expects each tensor to be equal size" in the
    process, "Trying to resize storage that is not resizable" in a DataLoader worker."""
    with python_server(sizes_change_later, "--delay", "0.3") as srv:
        doc = probe(srv.url, duration=1.0, batch_size=2, workers=2, block_sizes=[64 << 10],
                    threads=[1], show_progress=False).to_dict()
    read = doc["pipeline"]["read"]
    assert read["samples"] < 48  # the slow link let it see only part of the data
    loader = doc["pipeline"]["loader"]
    assert [r["workers"] for r in loader] == [0, 1, 2]
    for run in loader:
        assert "error" not in run, run["error"]
        assert run["startup_s"] is not None  # batches came
    assert doc["pipeline"]["batch"]["tensors"]["jpg"] == "uint8[2, 16, 16, 3]"
