"""How a clip is decoded (issue 45): frames the clip does not keep and that no other frame
refers to are not decoded (FFmpeg's ``skip_frame``, packet by packet), and the clip is still
exactly what plain PyAV decoding of every frame gives, for videos with B-frames (H.264 with
B-pyramids: some B-frames are references, some are not), short videos included."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

av = pytest.importorskip("av")

from _videos import make_video, reference_frames  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe import FeedLoader, VideoClips  # noqa: E402
from feedpipe.transforms import _video  # noqa: E402

SIZE = (24, 32)




def test_frames_no_one_refers_to_are_skipped_and_the_kept_ones_are_the_same() -> None:
    data = make_video(40, gop=20, bframes=3)
    with av.open(io.BytesIO(data)) as c:
        types = [int(f.pict_type) for f in c.decode(video=0)]
    # the encoder made B-frames, so there is something to skip
    assert int(av.video.frame.PictureType.B) in types
    ref = reference_frames(data, SIZE).transpose(0, 2, 3, 1)
    for want in ([0, 3, 6, 9], [22, 26, 30, 34], [5, 6, 7, 8], [33, 37, 41, 45]):
        with av.open(io.BytesIO(data)) as c:
            s = c.streams.video[0]
            plain = _video._frames_at(c, s, Fraction(s.average_rate), np.array(want), SIZE,
                                      skip=False)
        with av.open(io.BytesIO(data)) as c:
            s = c.streams.video[0]
            skipped = _video._frames_at(c, s, Fraction(s.average_rate), np.array(want), SIZE)
        assert sorted(plain) == sorted(skipped), want
        for i in plain:
            assert np.array_equal(skipped[i], plain[i]) and np.array_equal(plain[i], ref[i])


def test_clips_of_videos_with_b_frames_match_plain_decoding(tmp_path: Path) -> None:
    lengths = [40, 33, 7]  # the last is shorter than a clip: its last frame repeated
    data = {f"b{i}": make_video(n, gop=16, bframes=3) for i, n in enumerate(lengths)}
    with feedpipe.ShardWriter(str(tmp_path / "ds"), max_samples=2) as w:
        for k, b in data.items():
            w.write({"__key__": k, "mp4": b})
    src = VideoClips(str(tmp_path / "ds"), frames=4, stride=3, clips_per_video=3, size=SIZE,
                     seed=2)
    n = 0
    for b in FeedLoader(src, batch_size=4):
        for j in range(len(b["video"])):
            ref = reference_frames(data[b["__key__"][j]], SIZE)
            start = int(b["start"][j])
            want = [min(start + t * 3, len(ref) - 1) for t in range(4)]
            assert np.array_equal(b["frames"][j].numpy(), ref[want]), (b["__key__"][j], start)
            n += 1
    assert n == 9


@given(pts=st.integers(-10**9, 10**12), t0=st.integers(-10**6, 10**6),
       tb=st.fractions(min_value=Fraction(1, 10**6), max_value=1),
       rate=st.fractions(min_value=Fraction(1, 1001), max_value=240))
def test_frame_numbers_in_integers_are_the_rounded_fraction(pts: int, t0: int, tb: Fraction,
                                                           rate: Fraction) -> None:
    step = tb * rate
    assert _video._index(pts, t0, (step.numerator, step.denominator)) == int(
        round((pts - t0) * tb * rate))  # half to even, as round() of a Fraction
