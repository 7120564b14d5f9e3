"""Video clips (issue 45): video members kept whole by ``feedpipe shard``, clips of K frames at a
stride drawn by the plan and decoded with PyAV, compared frame by frame with decoding each file
plainly with PyAV one frame after the other; every (video, clip) once per epoch over ranks and
real worker processes; mid-epoch resume; short and corrupt videos named."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from _videos import make_video, reference_frames  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe import DecodeError, FeedDataset, FeedLoader, VideoClip, VideoClips  # noqa: E402

SIZE = (24, 32)  # (height, width) the clips are resized to
LENGTHS = [32, 32, 20, 32, 6]  # v4 is shorter than a clip: padded


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """Five mp4 videos (one of 6 frames) sharded 2 per shard: (dataset, bytes by key)."""
    root = tmp_path_factory.mktemp("videos")
    src = root / "src"
    src.mkdir()
    data = {f"v{i}": make_video(n) for i, n in enumerate(LENGTHS)}
    for k, b in data.items():
        (src / f"{k}.mp4").write_bytes(b)
    feedpipe.shard(str(src), str(root / "out"), max_samples=2, workers=1)
    return root / "out", data


def _clips(loader: FeedLoader) -> list[dict]:
    out = []
    for b in loader:
        for j in range(len(b["video"])):
            out.append({k: b[k][j] for k in ("frames", "video", "clip", "start", "padded",
                                                "__key__")})
    return out


def _check_against_reference(clips: list[dict], data: dict[str, bytes], stride: int,
                             frames: int) -> None:
    refs = {k: reference_frames(b, SIZE) for k, b in data.items()}
    for c in clips:
        ref = refs[c["__key__"]]
        start = int(c["start"])
        want = [min(start + t * stride, len(ref) - 1) for t in range(frames)]
        assert np.array_equal(c["frames"].numpy(), ref[want]), (c["__key__"], start)
        # frame i is red 7 i: the clip holds the frames it says, not merely the same pixels
        red = c["frames"][:, 0].float().mean(dim=(1, 2)).numpy()
        assert np.allclose(red, [7 * w for w in want], atol=4)
        assert int(c["padded"]) == sum(start + t * stride > len(ref) - 1 for t in range(frames))


def test_shard_keeps_video_members_whole_and_the_reader_hands_their_bytes(
        tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    made = {ext: make_video(8, ext) for ext in ("mp4", "webm", "mkv")}
    for ext, b in made.items():
        (src / f"clip_{ext}.{ext}").write_bytes(b)
    feedpipe.shard(str(src), str(tmp_path / "out"), workers=1)
    m = feedpipe.load_manifest(str(tmp_path / "out"))
    assert set(m.fields) == {"mp4", "webm", "mkv"}
    got = {}
    for x in FeedDataset(str(tmp_path / "out"), shuffle=False):
        (ext,) = [f for f in ("mp4", "webm", "mkv") if x.get(f) is not None]
        got[ext] = bytes(x[ext])
    assert got == made  # the bytes as written: nothing decoded or re-encoded at shard time
    for b in made.values():
        info = feedpipe.video_info(b)  # the header alone says the frame count, also for WebM
        assert (info.frames, info.fps, info.width, info.height) == (8, 8.0, 64, 48)


def test_clips_match_plain_pyav_decoding_inline(videos: tuple[Path, dict[str, bytes]]) -> None:
    out, data = videos
    src = VideoClips(str(out), frames=4, stride=3, clips_per_video=2, size=SIZE, seed=5)
    loader = FeedLoader(src, batch_size=3)
    assert len(src) == 10 and loader.route.fetch == "video-clips"
    clips = _clips(loader)
    assert sorted((int(c["video"]), int(c["clip"])) for c in clips) == [
        (v, c) for v in range(5) for c in range(2)]  # every (video, clip) exactly once
    assert str(clips[0]["frames"].dtype) == "torch.uint8"
    assert tuple(clips[0]["frames"].shape) == (4, 3, *SIZE)  # [T, C, H, W]
    _check_against_reference(clips, data, stride=3, frames=4)
    # clip c of a video starts in the c-th half of its possible starts
    for c in clips:
        n = LENGTHS[int(c["video"])]
        starts = max(1, n - 10 + 1)
        lo, hi = starts * int(c["clip"]) // 2, max(1, starts * (int(c["clip"]) + 1) // 2)
        assert lo <= int(c["start"]) < max(lo + 1, hi)


def test_clips_in_two_worker_processes_are_the_inline_clips(
        videos: tuple[Path, dict[str, bytes]]) -> None:
    out, data = videos
    inline = _clips(FeedLoader(VideoClips(str(out), frames=4, stride=3, clips_per_video=2,
                                          size=SIZE, seed=5), batch_size=3))
    loader = FeedLoader(VideoClips(str(out), frames=4, stride=3, clips_per_video=2, size=SIZE,
                                   seed=5), batch_size=3, num_workers=2)
    assert loader.route.name == "samples-workers"
    clips = _clips(loader)
    pids = set(loader.stats()["worker_pids"])
    assert len(pids) == 2 and os.getpid() not in pids  # real worker processes decoded them
    by = {(int(c["video"]), int(c["clip"])): c for c in clips}
    assert len(by) == len(clips) == 10
    for c in inline:  # the same clip (same start, same frames) on any worker
        d = by[(int(c["video"]), int(c["clip"]))]
        assert int(d["start"]) == int(c["start"])
        assert np.array_equal(d["frames"].numpy(), c["frames"].numpy())
    _check_against_reference(clips, data, stride=3, frames=4)


def test_epochs_differ_and_ranks_share_each_epoch_exactly_once(
        videos: tuple[Path, dict[str, bytes]]) -> None:
    out, _ = videos

    def epoch_of(rank: int, world: int, epoch: int) -> list[tuple[int, int, int]]:
        loader = FeedLoader(VideoClips(str(out), frames=2, stride=2, clips_per_video=2,
                                       size=(12, 16), seed=1, rank=rank, world_size=world),
                            batch_size=5)
        loader.set_epoch(epoch)
        return [(int(c["video"]), int(c["clip"]), int(c["start"])) for c in _clips(loader)]

    one = epoch_of(0, 1, 0)
    two = epoch_of(0, 2, 0) + epoch_of(1, 2, 0)
    assert len(two) == 10 and sorted(two) == sorted(one)  # same clips, each once over ranks
    other = epoch_of(0, 1, 1)
    assert sorted((v, c) for v, c, _ in other) == sorted((v, c) for v, c, _ in one)
    assert [(v, c) for v, c, _ in other] != [(v, c) for v, c, _ in one]  # another order
    assert sorted(other) != sorted(one)  # and other starts


def test_resume_mid_epoch_gives_exactly_the_rest(videos: tuple[Path, dict[str, bytes]]) -> None:
    out, _ = videos

    def make() -> FeedLoader:
        return FeedLoader(VideoClips(str(out), frames=3, stride=2, clips_per_video=2,
                                     size=(12, 16), seed=9), batch_size=3)

    full = [(int(c["video"]), int(c["clip"]), int(c["start"])) for c in _clips(make())]
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    state = loader.state_dict()
    it.close()
    assert state["kind"] == "video-clips" and state["position"] == 6
    again = make()
    again.load_state_dict(state)
    seen = [(int(v), int(c), int(s)) for b in first
            for v, c, s in zip(b["video"], b["clip"], b["start"])]
    rest = [(int(c["video"]), int(c["clip"]), int(c["start"])) for c in _clips(again)]
    assert seen + rest == full
    with pytest.raises(feedpipe.StateError, match="video-clips"):
        FeedLoader(VideoClips(str(out), frames=4, clips_per_video=2)).load_state_dict(state)


def test_a_short_video_is_padded_with_its_last_frame_and_said(
        videos: tuple[Path, dict[str, bytes]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    out, data = videos
    ds = FeedDataset(str(out), shuffle=False,
                     transform=VideoClip(4, stride=3, size=SIZE))  # one clip per video
    clips = [x for x in ds]
    short = [c for c in clips if c["__key__"] == "v4"]
    assert len(clips) == 5 and int(short[0]["padded"]) == 2  # frames 6 and 9 of 6 frames
    _check_against_reference(clips, data, stride=3, frames=4)
    with feedpipe.ShardWriter(str(tmp_path / "short")) as w:  # a key not logged before
        w.write({"__key__": "tiny", "mp4": make_video(3)})
    with caplog.at_level(logging.WARNING, logger="feedpipe.video"):
        (x,) = list(FeedDataset(str(tmp_path / "short"), transform=VideoClip(4)))
    assert int(x["padded"]) == 1
    assert any("'tiny'" in r.getMessage() and "repeated 1 times" in r.getMessage()
               for r in caplog.records)


def test_a_clip_at_a_frame_rate_takes_the_nearest_frames(
        videos: tuple[Path, dict[str, bytes]]) -> None:
    out, data = videos
    clips = _clips(FeedLoader(VideoClips(str(out), frames=3, fps=4, size=SIZE), batch_size=5))
    _check_against_reference(clips, data, stride=2, frames=3)  # 8 frames/s at 4: every other


def test_a_video_that_cannot_be_decoded_is_named_or_skipped(tmp_path: Path) -> None:
    w_dir = tmp_path / "bad"
    with feedpipe.ShardWriter(str(w_dir)) as w:
        w.write({"__key__": "good", "mp4": make_video(8)})
        w.write({"__key__": "broken", "mp4": b"\x00\x00\x00\x18ftypmp42 not a video"})
    with pytest.raises(DecodeError, match=r"'broken'.*\.tar"):
        list(FeedLoader(VideoClips(str(w_dir), frames=2, size=(12, 16)), batch_size=2))
    loader = FeedLoader(VideoClips(str(w_dir), frames=2, size=(12, 16), on_error="skip"),
                        batch_size=2)
    keys = [k for b in loader for k in b["__key__"]]
    assert keys == ["good"] and loader.stats()["skipped"] == 1


def test_resume_mid_epoch_in_worker_processes_gives_exactly_the_rest(
        videos: tuple[Path, dict[str, bytes]]) -> None:
    out, _ = videos

    def make() -> FeedLoader:
        return FeedLoader(VideoClips(str(out), frames=2, stride=4, clips_per_video=3,
                                     size=(12, 16), seed=2), batch_size=2, num_workers=2)

    full = [(int(c["video"]), int(c["clip"]), int(c["start"])) for c in _clips(make())]
    assert sorted((v, c) for v, c, _ in full) == [(v, c) for v in range(5) for c in range(3)]
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    it.close()
    again = make()
    again.load_state_dict(state)
    seen = [(int(v), int(c), int(s)) for b in first
            for v, c, s in zip(b["video"], b["clip"], b["start"])]
    rest = [(int(c["video"]), int(c["clip"]), int(c["start"])) for c in _clips(again)]
    assert len(seen) == 6 and seen + rest == full  # the same clips, in the same order
