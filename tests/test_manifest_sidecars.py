"""The manifest names the sidecar files beside the shards (issue 45): the video frame counts
(``.frames.npy``) and image sizes (``.sizes.npy``) ``feedpipe shard`` writes are listed with
their shard, size and SHA-256 as the shards are; a manifest written before lists none and still
reads; ``feedpipe verify`` reports a listed sidecar that is missing or changed; recording the
counts later lists them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from _videos import make_video  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe.format._video_frames import load_frames  # noqa: E402


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    """Two shards: videos (frames sidecars) and, in the first, a PNG image (sizes sidecar)."""
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    Image.new("RGB", (5, 3)).save(src / "i0.png")
    for i, n in enumerate([12, 9, 10]):  # sorted after the image: [i0, v0], [v1, v2]
        (src / f"v{i}.mp4").write_bytes(make_video(n))
    feedpipe.shard(str(src), str(tmp_path / "ds"), max_samples=2, workers=1)
    return tmp_path / "ds"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_shard_lists_the_frames_files_with_size_and_hash(dataset: Path) -> None:
    m = feedpipe.load_manifest(str(dataset))
    shards = [s.name for s in m.shards]
    a, b = (n[:-4] for n in shards)
    assert [s["name"] for s in m.sidecars] == [f"{a}.sizes.npy", f"{a}.frames.npy",
                                               f"{b}.frames.npy"]
    for s in m.sidecars:
        p = dataset / s["name"]
        assert s["shard"] in shards and s["name"].startswith(s["shard"][:-4])
        assert (s["bytes"], s["sha256"]) == (p.stat().st_size, _sha(p))
    doc = json.loads((dataset / "manifest.json").read_text())
    assert doc["sidecars"] == m.sidecars  # in the file, not only in memory


def test_a_manifest_without_the_entry_still_reads(dataset: Path) -> None:
    path = dataset / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["sidecars"]  # as feedpipe wrote manifests before
    path.write_text(json.dumps(doc))
    m = feedpipe.load_manifest(str(dataset))
    assert m.sidecars == [] and "sidecars" not in json.loads(m.to_json())
    frames = load_frames(str(dataset), m)  # the files are still found beside the shards
    assert frames is not None and frames[:, 0].tolist() == [-1, 12, 9, 10]
    assert feedpipe.verify(str(dataset), show_progress=False).ok


def test_an_edited_sidecars_entry_is_named(dataset: Path) -> None:
    path = dataset / "manifest.json"
    doc = json.loads(path.read_text())
    doc["sidecars"][0]["sha256"] = "nope"
    path.write_text(json.dumps(doc))
    with pytest.raises(feedpipe.ManifestError, match=r"sidecars\[0\]\.sha256"):
        feedpipe.load_manifest(str(dataset))


def test_verify_reports_a_missing_or_changed_sidecar(dataset: Path) -> None:
    assert feedpipe.verify(str(dataset), show_progress=False).ok
    first, second = sorted(dataset.glob("*.sizes.npy")) + sorted(dataset.glob("*.frames.npy"))[1:]
    first.unlink()
    a = second.read_bytes()
    second.write_bytes(a[:-8] + np.float64(99).tobytes())  # same size, another duration
    report = feedpipe.verify(str(dataset), show_progress=False)
    assert not report.ok
    found = {(Path(p.shard).name, p.kind) for p in report.problems}
    assert found == {(first.name, "sidecar"), (second.name, "sidecar")}
    msgs = " ".join(p.message for p in report.problems)
    assert "missing" in msgs and "sha256 mismatch" in msgs
    cli = subprocess.run([sys.executable, "-m", "feedpipe", "verify", str(dataset)],
                         capture_output=True, text=True)
    assert cli.returncode != 0 and first.name in cli.stdout + cli.stderr


def test_recording_the_counts_later_lists_them(dataset: Path) -> None:
    for p in dataset.glob("*.frames.npy"):
        p.unlink()
    path = dataset / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["sidecars"]
    path.write_text(json.dumps(doc))
    feedpipe.record_video_frames(str(dataset))
    m = feedpipe.load_manifest(str(dataset))
    assert len(m.sidecars) == 3 and feedpipe.verify(str(dataset), show_progress=False).ok


def test_token_lengths_files_are_listed(tmp_path: Path) -> None:
    with feedpipe.ShardWriter(str(tmp_path / "ds"), max_samples=2) as w:
        for i in range(3):
            w.write({"__key__": f"d{i}", "tokens.npy": np.arange(i + 3, dtype=np.uint16)})
    m = feedpipe.load_manifest(str(tmp_path / "ds"))
    assert [s["name"] for s in m.sidecars] == ["data-000000.lengths.npy",
                                               "data-000001.lengths.npy"]
    (tmp_path / "ds" / "data-000001.lengths.npy").unlink()
    report = feedpipe.verify(str(tmp_path / "ds"), show_progress=False)
    assert [(Path(p.shard).name, p.kind) for p in report.problems] == [
        ("data-000001.lengths.npy", "sidecar")]
