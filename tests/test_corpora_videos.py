"""Clips of real videos other projects made (``tests/corpora/torchcodec/``, see its README):
NASA footage in H.264 (an MP4 with two video streams and audio), AV1 in Matroska, HEVC in MP4.
Each is sharded with ``feedpipe shard``, read as clips through :class:`~feedpipe.VideoClips`, and
every clip is compared frame by frame with decoding the same file plainly with PyAV, every frame
one after the other (the first video stream, as feedpipe takes), resized by the same FFmpeg
scaler: the pixels must be equal, and the frame numbers those the clip says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from _corpora import CORPORA, sha256, vendored  # noqa: E402
from _videos import reference_frames  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe import FeedLoader, VideoClips  # noqa: E402

VIDEOS = CORPORA / "torchcodec"
SIZE = (36, 64)  # (height, width)
# what each file's first video stream holds, as ffprobe says (frames, codec)
FILES = {"nasa_13013.mp4": (325, "h264"), "av1_video.mkv": (125, "av1"),
         "h265_video.mp4": (10, "hevc")}


def test_the_vendored_videos_are_the_upstream_bytes() -> None:
    sums = vendored(VIDEOS)
    assert set(sums) == set(FILES)
    for name, digest in sums.items():
        assert sha256(VIDEOS / name) == digest, f"{VIDEOS / name} is not the vendored copy"
    assert (VIDEOS / "LICENSE").is_file()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("real-videos")
    (root / "src").mkdir()
    for name in FILES:  # the videos alone (the folder also holds LICENSE and SHA256SUMS)
        (root / "src" / name).write_bytes((VIDEOS / name).read_bytes())
    feedpipe.shard(str(root / "src"), str(root / "ds"), workers=1, max_samples=2)
    return root / "ds"


def test_real_videos_shard_with_their_frame_counts(dataset: Path) -> None:
    m = feedpipe.load_manifest(str(dataset))
    assert m.total_samples == 3 and set(m.fields) == {"mp4", "mkv"}
    src = VideoClips(str(dataset), frames=4, clips_per_video="all", stride=1)
    keys = [x["__key__"] for x in feedpipe.FeedDataset(str(dataset), shuffle=False)]
    counts = {k: int(n) for k, n in zip(keys, src.frames[:, 0])}
    assert counts == {Path(n).stem: f for n, (f, _) in FILES.items()}


@pytest.mark.parametrize("stride", [1, 5])
def test_clips_of_real_videos_are_plain_pyav_frames(dataset: Path, stride: int) -> None:
    refs = {Path(n).stem: reference_frames((VIDEOS / n).read_bytes(), SIZE) for n in FILES}
    src = VideoClips(str(dataset), frames=6, stride=stride, clips_per_video=3, size=SIZE,
                     seed=stride)
    seen = []
    for b in FeedLoader(src, batch_size=4):
        for j in range(len(b["video"])):
            key, start = b["__key__"][j], int(b["start"][j])
            ref = refs[key]
            want = [min(start + t * stride, len(ref) - 1) for t in range(6)]
            got = b["frames"][j].numpy()
            assert got.shape == (6, 3, *SIZE)
            assert np.array_equal(got, ref[want]), (key, start, stride)
            seen.append((int(b["video"][j]), int(b["clip"][j])))
    assert sorted(seen) == [(v, c) for v in range(3) for c in range(3)]
