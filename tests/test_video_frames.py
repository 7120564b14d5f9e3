"""Video frame counts recorded at shard time (``<stem>.frames.npy``), checked against the count
PyAV's own decoder gives for each video, for MP4, WebM (whose header states no count) and
Matroska; recorded later for older datasets; a sample without a readable video marked -1."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from _videos import make_video  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe.format._video_frames import frames_path, load_frames  # noqa: E402

# (key, ext, frames, rate): lengths that are not a multiple of the keyframe interval
VIDEOS = [("a", "mp4", 13, 8), ("b", "webm", 21, 10), ("c", "mkv", 9, 25), ("d", "mp4", 1, 8),
          ("e", "webm", 30, 24)]


def decoded_count(data: bytes) -> int:
    """The frames PyAV's decoder gives, one after the other."""
    with av.open(io.BytesIO(data)) as c:
        return sum(1 for _ in c.decode(video=0))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("frames")
    src = root / "src"
    src.mkdir()
    made = {}
    for key, ext, n, rate in VIDEOS:
        made[key] = make_video(n, ext, rate=rate, width=32, height=24)
        (src / f"{key}.{ext}").write_bytes(made[key])
    (src / "f.webm").write_bytes(b"\x1a\x45\xdf\xa3 not a video")  # unreadable: -1
    (src / "g.txt").write_text("no video here")  # no video member: -1
    feedpipe.shard(str(src), str(root / "out"), max_samples=3, workers=1)
    return root / "out", made


def _expected(out: Path, made: dict[str, bytes]) -> np.ndarray:
    rates = {k: r for k, _, _, r in VIDEOS}
    rows = []
    for x in feedpipe.FeedDataset(str(out), shuffle=False):
        k = x["__key__"]
        if k in made:
            n = decoded_count(made[k])
            rows.append((n, rates[k], n / rates[k]))
        else:
            rows.append((-1, -1, -1))
    return np.array(rows, dtype=np.float64)


def test_shard_records_each_videos_frames_as_pyavs_decoder_counts_them(
        dataset: tuple[Path, dict[str, bytes]]) -> None:
    out, made = dataset
    m = feedpipe.load_manifest(str(out))
    files = [frames_path(str(out / rec.name)) for rec in m.shards]
    # one file beside each shard holding videos, its samples' rows; the last holds none
    assert [os.path.exists(f) for f in files] == [True] * (len(files) - 1) + [False]
    for rec, f in zip(m.shards[:-1], files):
        assert np.load(f).shape == (rec.samples, 3)
    got = load_frames(str(out), m)
    want = _expected(out, made)
    assert got is not None and np.array_equal(got[:, 0], want[:, 0])
    assert np.allclose(got[:, 1:], want[:, 1:])
    assert sorted(int(n) for n in got[:, 0] if n >= 0) == sorted(n for _, _, n, _ in VIDEOS)


def test_an_older_dataset_gets_its_counts_once_and_without_them_none_is_said(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    import shutil

    out, made = dataset
    old = Path(shutil.copytree(out, tmp_path / "old"))
    for f in old.glob("*.frames.npy"):
        os.unlink(f)
    m = feedpipe.load_manifest(str(old))
    assert load_frames(str(old), m) is None
    r = feedpipe.record_video_frames(str(old))
    assert r == {"shards": len(m.shards), "videos": len(VIDEOS), "unread": 1}
    assert np.array_equal(load_frames(str(old), m), load_frames(str(out), m))
    assert feedpipe.record_video_frames(str(old))["shards"] == 0  # kept unless overwrite


def test_all_clips_that_fit_are_planned_from_the_recorded_counts_each_once(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    """``clips_per_video="all"``: each video gives ``frames // span`` clips (at least one),
    counted from the frames files (no video opened to plan); each (video, clip) once an epoch,
    over 2 ranks too; the frames are those plain PyAV decoding gives; the ledger proves it."""
    from _videos import reference_frames

    out, made = dataset
    keys = [x["__key__"] for x in feedpipe.FeedDataset(str(out), shuffle=False)]
    span = 2 * 3 + 1  # 3 frames at stride 3
    fit = {k: max(1, decoded_count(made[k]) // span) if k in made else 1 for k in keys}
    src = feedpipe.VideoClips(str(out), frames=3, stride=3, clips_per_video="all",
                              size=(12, 16), seed=2, on_error="skip")
    assert len(src) == sum(fit.values()) and src.counts.tolist() == [fit[k] for k in keys]
    want = sorted((v, c) for v, k in enumerate(keys) if k in made for c in range(fit[k]))
    loader = feedpipe.FeedLoader(src, batch_size=4, ledger=tmp_path / "l")
    got = [(int(v), int(c), int(s), k, fr) for b in loader
           for v, c, s, k, fr in zip(b["video"], b["clip"], b["start"], b["__key__"],
                                     b["frames"])]
    assert sorted((v, c) for v, c, *_ in got) == want  # the unreadable ones skipped, counted
    assert loader.stats()["skipped"] == sum(1 for k in keys if k not in made)
    for _, c, s, k, fr in got:
        n = decoded_count(made[k])
        starts = max(1, n - span + 1)  # clip c starts in the c-th of fit[k] segments
        lo = starts * c // fit[k]
        assert lo <= s < max(lo + 1, starts * (c + 1) // fit[k])
        ref = reference_frames(made[k], (12, 16))
        assert np.array_equal(fr.numpy(), ref[[min(s + 3 * t, n - 1) for t in range(3)]])
    r = feedpipe.check_ledger(tmp_path / "l")
    assert r["ok"] and r["clips"]["clips_per_video"] == "all"
    assert r["epochs"][0]["expected"] == len(src)
    halves = [feedpipe.FeedLoader(feedpipe.VideoClips(
        str(out), frames=3, stride=3, clips_per_video="all", size=(12, 16), seed=2,
        on_error="skip", rank=r, world_size=2), batch_size=4) for r in (0, 1)]
    two = sorted((int(v), int(c)) for ld in halves for b in ld
                 for v, c in zip(b["video"], b["clip"]))
    assert two == want


def test_all_clips_without_recorded_counts_is_refused_by_name(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    import shutil

    out, _ = dataset
    old = Path(shutil.copytree(out, tmp_path / "old"))
    for f in old.glob("*.frames.npy"):
        os.unlink(f)
    with pytest.raises(feedpipe.InputError, match="record_video_frames"):
        feedpipe.VideoClips(str(old), frames=2, clips_per_video="all")
    assert len(feedpipe.VideoClips(str(old), frames=2, clips_per_video=2)) == 2 * 7


def test_without_pyav_at_shard_time_no_counts_are_written_and_it_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from feedpipe._helpers import dependency
    from feedpipe.errors import MissingDependencyError
    from feedpipe.format import _video_frames

    def missing(name: str, **kw: object) -> None:
        raise MissingDependencyError(f"{name} is not installed: pip install feedpipe[video]")

    monkeypatch.setattr(dependency, "require", missing)
    monkeypatch.setattr(_video_frames, "_said_no_av", [])
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.mp4").write_bytes(make_video(4, width=32, height=24))
    with caplog.at_level(logging.WARNING, logger="feedpipe.video"):
        feedpipe.shard(str(src), str(tmp_path / "out"), workers=1)
    assert not list((tmp_path / "out").glob("*.frames.npy"))
    assert load_frames(str(tmp_path / "out"), feedpipe.load_manifest(str(tmp_path / "out"))) \
        is None
    assert [r for r in caplog.records if "frame counts not recorded (PyAV is not installed"
            in r.getMessage()]
