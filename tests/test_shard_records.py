"""The ``--resume`` records of committed shards (``.NAME.tar.record.json``): one lost, empty or
torn (a disk fault, a power cut, a hand) has its shard redone by a resume, never trusted, and
the resume still finishes the same bytes as a clean run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import feedpipe
from feedpipe.convert._synth import make_image_folder


def test_a_lost_empty_or_torn_record_has_its_shard_redone(tmp_path: Path) -> None:
    src, out, clean = tmp_path / "src", tmp_path / "out", tmp_path / "clean"
    make_image_folder(str(src), classes=2, per_class=10)
    seen: list[str] = []

    def stop_after_five(rec: Any) -> None:
        seen.append(rec.name)
        if len(seen) == 5:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        feedpipe.shard(str(src), str(out), workers=1, max_samples=2, method="general",
                       on_shard=stop_after_five)
    records = sorted(out.glob(".*.tar.record.json"))
    assert len(records) == 5
    records[0].unlink()  # lost
    records[1].write_text("")  # empty
    text = records[2].read_text()
    records[2].write_text(text[: len(text) // 2])  # torn
    s = feedpipe.shard(str(src), str(out), workers=1, max_samples=2, method="general",
                       resume=True)
    assert s.reused_shards == 2 and s.shards == 10
    feedpipe.shard(str(src), str(clean), workers=1, max_samples=2, method="general")
    for p in clean.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
