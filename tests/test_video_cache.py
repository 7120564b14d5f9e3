"""Decoded clips memoised by a FunctionIndex: each clip is keyed by its video's bytes AND what
draws it (seed, epoch, video, clip), so a memoised VideoClip serves the clip the plan asks for,
never another clip of the same video; a second run of the same epochs decodes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from _videos import make_video  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe import FeedDataset, FeedLoader, FunctionIndex, VideoClip, VideoClips  # noqa: E402


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("cached-videos")
    with feedpipe.ShardWriter(str(root / "out"), max_samples=2) as w:
        for i in range(4):
            w.write({"__key__": f"v{i}", "mp4": make_video(24 + i, width=32, height=24)})
    return str(root / "out")


def _clips(loader: FeedLoader) -> list[tuple[int, int, int, bytes]]:
    return sorted((int(v), int(c), int(s), f.numpy().tobytes()) for b in loader
                  for v, c, s, f in zip(b["video"], b["clip"], b["start"], b["frames"]))


def test_a_memoised_video_clip_serves_each_epochs_own_clip(videos: str, tmp_path: Path) -> None:
    """A memoised VideoClip was refused (UncacheableTransformError: its output follows the
    epoch); keyed by its draw, each epoch's clips are its own, as without the index."""
    plain = FeedLoader(FeedDataset(videos, transform=VideoClip(3, stride=2, size=(12, 16))),
                       batch_size=2)
    index = FunctionIndex(str(tmp_path / "memo"))
    memo = FeedLoader(FeedDataset(videos, transform=index.wrap(VideoClip(3, stride=2,
                                                                         size=(12, 16)))),
                      batch_size=2)
    for e in range(2):
        plain.set_epoch(e)
        memo.set_epoch(e)
        assert _clips(memo) == _clips(plain), f"epoch {e}"
    assert index.counts() == (0, 8)


def test_video_clips_with_a_cache_decode_nothing_the_second_time(videos: str,
                                                                 tmp_path: Path) -> None:
    def run(workers: int) -> tuple[list, FunctionIndex]:
        index = FunctionIndex(str(tmp_path / "memo"))
        src = VideoClips(videos, frames=3, stride=2, clips_per_video=2, size=(12, 16), seed=3,
                         cache=index)
        ld = FeedLoader(src, batch_size=3, num_workers=workers)
        got = []
        for e in range(2):
            ld.set_epoch(e)
            got.append(_clips(ld))
        index.flush()
        return got, index

    want = [_clips(FeedLoader(VideoClips(videos, frames=3, stride=2, clips_per_video=2,
                                         size=(12, 16), seed=3), batch_size=3))]
    first, index = run(2)  # filled from two worker processes
    assert first[0] == want[0] and first[0] != first[1]
    stats = index.stats()
    assert stats.entries == 16  # 4 videos x 2 clips x 2 epochs, each its own entry
    again, index = run(0)
    assert again == first and index.counts() == (16, 0)  # served, none decoded
    assert np.frombuffer(again[0][0][3], np.uint8).size == 3 * 3 * 12 * 16
