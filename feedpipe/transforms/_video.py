"""Video clips decoded on CPU with PyAV (the FFmpeg bindings; ``pip install feedpipe[video]``).

:class:`VideoClip` is the transform of a video sample: it reads the container's header (frame
count, frame rate; no frame decoded), draws the clip's start from the plan
(:func:`~feedpipe.plan._clips.clip_start`), seeks to the nearest keyframe before the start and
decodes only up to the clip's last frame, each wanted frame converted to RGB at the asked size
by FFmpeg's scaler. The clip is a ``uint8`` tensor ``[T, C, H, W]`` (frames first, as
``torchvision.transforms.v2`` takes videos).

A frame's number is read from its timestamp at the stream's average frame rate (a constant
frame rate is assumed, as containers of training clips have).

A video shorter than a clip is padded by repeating its last frame, said in a log record (once per
video and process) and in the sample's ``padded`` count. A video that cannot be decoded raises a
:class:`~feedpipe.errors.DecodeError` naming its key and shard (``on_error="skip"``: a
:class:`~feedpipe.errors.SampleSkipped`, which the loader logs and counts).

PyAV is imported when the first clip is decoded, never by ``import feedpipe``.
"""

from __future__ import annotations

import io
import os
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .._helpers.dependency import require
from .._redact import logger
from ..errors import DecodeError, SampleSkipped
from ..format._video_frames import VIDEO_FIELDS
from ..plan._clips import clip_draw, clip_start

log = logger("feedpipe.video")

_padded_logged: set[tuple[Any, Any]] = set()  # (shard, key) said once per process


def say_padded(key: Any, shard: Any, frames: int, padded: int) -> None:
    """Say once a process that the video ``key`` of ``shard`` ends before its clip of
    ``frames`` does (its last frame repeated ``padded`` times)."""
    if padded and (shard, key) not in _padded_logged:
        _padded_logged.add((shard, key))
        log.warning("video %r of %r ends before its clip of %d frames does: its last frame is "
                    "repeated %d times (the rule for short videos)", key, shard, frames, padded)


@dataclass(frozen=True)
class ClipAsked:
    """What the plan asks of a sample's clip (:func:`clip_asked`)."""

    name: str  # the video's field
    key: Any
    shard: Any
    video: int
    clip: int
    draw: float
    clips: int  # clips of this video (VideoClips' per-video count)
    recorded: Any  # the frame count recorded at shard time, or None
    fail: type[Exception]  # SampleSkipped where skips are asked for, else DecodeError


def clip_asked(sample: dict[str, Any], field: str | None, on_error: str,
               clips: int) -> ClipAsked:
    """The clip the plan asks of ``sample``, its video in ``field`` (else the first of
    :data:`VIDEO_FIELDS` it has); a sample without one raises ``SampleSkipped`` where
    ``on_error='skip'``, else ``DecodeError``, naming it."""
    key, shard = sample.get("__key__"), sample.get("__shard__")
    fail = SampleSkipped if on_error == "skip" else DecodeError
    name = field or next((f for f in VIDEO_FIELDS if sample.get(f) is not None), None)
    if name is None or sample.get(name) is None:
        raise fail(f"sample {key!r} of {shard!r} has no video field "
                   f"({field or ', '.join(VIDEO_FIELDS)}); name it with field=")
    video = int(sample.get("__video__", sample.get("__index__", 0)))
    clip = int(sample.get("__clip__", 0))
    draw = clip_draw(sample.get("__seed__", 0), sample.get("__epoch__", 0), video, clip)
    return ClipAsked(name, key, shard, video, clip, draw, int(sample.get("__clips__", clips)),
                     sample.get("__frames__"), fail)


@dataclass(frozen=True)
class VideoInfo:
    """What a video's container header says, read without decoding a frame.

    Attributes:
        frames: frame count (from the header, or duration x frame rate where the container
            does not count them, as WebM and Matroska do not).
        fps: the stream's average frame rate.
        duration: seconds.
        width: frame width in pixels.
        height: frame height in pixels.
    """

    frames: int
    fps: float
    duration: float
    width: int
    height: int


def _av() -> Any:
    return require("av", extra="video", purpose="decoding video clips")


def _open(data: Any) -> Any:
    return _av().open(io.BytesIO(data))


def _rate(stream: Any) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate:
        raise ValueError("the video stream states no frame rate")
    return Fraction(rate)


def _header(container: Any) -> tuple[Any, Fraction, int, float]:
    if not container.streams.video:
        raise ValueError("the container holds no video stream")
    stream = container.streams.video[0]
    rate = _rate(stream)
    if stream.duration:
        duration = float(stream.duration * stream.time_base)
    else:
        duration = float(container.duration or 0) / 1_000_000  # AV_TIME_BASE: microseconds
    frames = int(stream.frames) or int(round(duration * rate))
    if frames <= 0:
        raise ValueError("the container states neither a frame count nor a duration")
    return stream, rate, frames, duration


def video_info(data: bytes | memoryview) -> VideoInfo:
    """The :class:`VideoInfo` of a video's bytes, from the container header alone.

    Example:
        >>> video_info(b"not a video")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        av.error.InvalidDataError: ...
    """
    with _open(data) as container:
        stream, rate, frames, duration = _header(container)
        return VideoInfo(frames, float(rate), duration, stream.codec_context.width,
                         stream.codec_context.height)


class VideoClip:
    """The transform that makes a video sample a clip of ``frames`` frames.

    Args:
        frames: frames per clip (``T``).
        stride: frames of the video between two frames of the clip.
        fps: instead of ``stride``, the clip's frame rate (the video's frames nearest to
            every ``1 / fps`` seconds).
        size: ``(height, width)`` every frame is resized to (``None``: the video's own size;
            the videos of a batch must then share it).
        clips: clips drawn from each video per epoch (clip ``c`` starts in the ``c``-th of
            ``clips`` equal segments of the video; :class:`~feedpipe.VideoClips` makes each
            one a sample).
        field: the video field (``None``: the first of ``mp4``, ``webm``, ``mkv``, ``avi``,
            ``mov`` the sample has).
        on_error: ``"raise"`` (:class:`~feedpipe.errors.DecodeError`) or ``"skip"``
            (:class:`~feedpipe.errors.SampleSkipped`) for a video that cannot be decoded or a
            sample without one.

    The output is a dict: ``frames`` (``uint8`` tensor ``[T, 3, H, W]``), ``start`` (the
    video frame the clip starts at), ``video`` and ``clip`` (which clip of which sample),
    ``padded`` (frames repeated past the video's end) and ``__key__``.

    Over a plain :class:`~feedpipe.FeedDataset` it draws one clip per video per epoch (the
    sample's ``__index__`` is the video); :class:`~feedpipe.VideoClips` makes several.

    Example:
        >>> VideoClip(8, stride=2).span(30.0)
        15
    """

    def __init__(self, frames: int, *, stride: int = 1, fps: float | None = None,
                 size: tuple[int, int] | None = None, clips: int = 1,
                 field: str | None = None, on_error: str = "raise") -> None:
        if int(frames) < 1 or int(stride) < 1 or int(clips) < 1:
            raise ValueError(f"VideoClip(frames={frames}, stride={stride}, clips={clips}): "
                             "each must be at least 1")
        if fps is not None and not fps > 0:
            raise ValueError(f"VideoClip(fps={fps}): a frame rate above 0, or None")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"VideoClip(on_error={on_error!r}): 'raise' or 'skip'")
        self.frames, self.stride, self.fps = int(frames), int(stride), fps
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.clips, self.field, self.on_error = int(clips), field, on_error

    def step(self, rate: float) -> float:
        """Video frames from one clip frame to the next, for a video of ``rate`` frames/s."""
        return float(rate) / self.fps if self.fps else float(self.stride)

    def span(self, rate: float) -> int:
        """Video frames one clip covers, first to last."""
        return int(round((self.frames - 1) * self.step(rate))) + 1

    def wanted(self, start: int, rate: float) -> np.ndarray:
        """The video frames of a clip starting at ``start``."""
        return start + np.round(np.arange(self.frames) * self.step(rate)).astype(np.int64)

    def memo_fields(self, sample: dict[str, Any]) -> list[str]:
        """The fields a clip is a function of, for :meth:`FunctionIndex.wrap
        <feedpipe.FunctionIndex.wrap>`: the video's bytes and what draws the clip (seed, epoch,
        video, clip, and the clip count and frame count :class:`~feedpipe.VideoClips` gives),
        so that a memoised clip is served only for the same draw."""
        name = self.field or next((f for f in VIDEO_FIELDS if sample.get(f) is not None), None)
        draw = ("__seed__", "__epoch__", "__video__", "__clip__", "__clips__", "__frames__")
        video = () if "__video__" in sample else ("__index__",)
        return [f for f in (name, *draw, *video) if f is not None and f in sample]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        a = clip_asked(sample, self.field, self.on_error, self.clips)
        try:
            out, start, padded = self._decode(sample[a.name], a.clip, a.draw, a.clips, a.recorded)
        except Exception as e:  # FFmpeg's errors, a missing stream, a clip cut short
            if isinstance(e, ImportError):
                raise
            raise a.fail(f"video {a.name!r} of sample {a.key!r} in {a.shard!r} cannot be "
                         f"decoded: {e} (check the file with ffprobe; on_error='skip' leaves "
                         "such videos out)") from e
        say_padded(a.key, a.shard, self.frames, padded)
        import torch

        return {"frames": torch.from_numpy(out), "start": start, "video": a.video,
                "clip": a.clip, "padded": padded, "__key__": a.key}

    def _decode(self, data: Any, clip: int, draw: float, clips: int,
                recorded: int | None) -> tuple[np.ndarray, int, int]:
        with _open(data) as container:
            stream, rate, total, _ = _header(container)
            total = total if recorded is None else int(recorded)
            start = clip_start(total, self.span(float(rate)), clips, clip, draw)
            want = self.wanted(start, float(rate))
            got = _frames_at(container, stream, rate, want, self.size)
        have = sorted(got)
        if not have or have[0] > want[0]:
            raise ValueError(f"no frame decoded at or after frame {int(want[0])} (the header "
                             f"says {total} frames)")
        last = have[-1]
        missing = [int(i) for i in want if int(i) not in got and int(i) < last]
        if missing:
            raise ValueError(f"frames {missing[:4]} of the clip were not decoded")
        # past the video's last decoded frame: the last frame repeated (the short-video rule)
        rows = [got[int(i)] if int(i) in got else got[last] for i in want]
        padded = int(sum(1 for i in want if int(i) > last))
        return np.ascontiguousarray(np.stack(rows).transpose(0, 3, 1, 2)), start, padded


_scalers: dict[int, Any] = {}  # one FFmpeg scaler per thread (its context is reused)
_scaling = threading.Lock()  # guards the dict, not the scaling


def _drop_scalers() -> None:
    """Before a fork: free the scalers in the process that made them (a child that freed an
    inherited one could wait on threads the fork did not copy)."""
    with _scaling:
        _scalers.clear()


os.register_at_fork(before=_drop_scalers)


def _reformatter() -> Any:
    """This thread's FFmpeg scaler, one slice thread each: a clip's frames are small, and
    ``transform_threads=`` already gives each thread a frame of its own. A scaler is reused
    because making one is most of the cost of a small frame's conversion. It is freed before
    the process forks (:func:`_drop_scalers`), and no frame keeps it: a scaler left in a frame
    and freed in a forked worker hung it (tests/test_video.py, the worker-process test)."""
    me = threading.get_ident()
    scaler = _scalers.get(me)
    if scaler is None:
        from av.video.reformatter import VideoReformatter

        with _scaling:
            scaler = _scalers[me] = VideoReformatter()
    return scaler


def _rgb(frame: Any, w: int | None, h: int | None) -> np.ndarray:
    """``frame`` in RGB at ``(w, h)`` (``None``: its own size): conversion and resize in one
    pass of FFmpeg's scaler (bilinear)."""
    out = _reformatter().reformat(frame, width=w, height=h, format="rgb24", threads=1)
    return out.to_ndarray()


# the decoders that honour ``skip_frame="NONREF"`` packet by packet, leaving the frames they do
# decode as they are (libdav1d does not: AV1 frames went missing, tests/test_corpora_videos.py)
_SKIPS_NONREF = frozenset({"h264", "hevc", "mpeg4", "mpeg2video", "mpeg1video"})


def _index(pts: int, t0: int, scale: tuple[int, int]) -> int:
    """The frame number of timestamp ``pts``: ``(pts - t0) * time_base * rate`` rounded half to
    even (as ``round`` of the :class:`~fractions.Fraction`), in integers: it runs for every
    packet and frame, where Fraction arithmetic cost a measurable share of a clip."""
    q, r = divmod((pts - t0) * scale[0], scale[1])
    return q + 1 if 2 * r > scale[1] or (2 * r == scale[1] and q & 1) else q


def _frames_at(container: Any, stream: Any, rate: Fraction, want: np.ndarray,
               size: tuple[int, int] | None, skip: bool = True) -> dict[int, np.ndarray]:
    """The RGB frames numbered ``want`` (at most), decoding from the keyframe before the
    first up to the last.

    With ``skip``, for the codecs of :data:`_SKIPS_NONREF`, a frame the clip does not keep is
    not decoded where no other frame refers to it (FFmpeg's ``skip_frame="NONREF"``, set packet
    by packet): the frames kept are the
    same, since every frame they are predicted from is still decoded. Where the video ends
    before the clip (its last frame is repeated), the end is decoded again without skipping,
    so the frame repeated is the video's true last frame."""
    t0 = stream.start_time or 0
    tb = stream.time_base
    step = Fraction(tb) * rate
    scale = (step.numerator, step.denominator)
    first, end = int(want[0]), int(want[-1])
    if first > 0 or not skip:  # to the last keyframe at or before the timestamp
        container.seek(t0 + int(Fraction(first) / rate / tb), stream=stream, backward=True,
                       any_frame=False)
    wanted = set(int(i) for i in want)
    h, w = size if size is not None else (None, None)
    got: dict[int, np.ndarray] = {}
    last: tuple[int, Any] | None = None
    ctx, mode, newest = stream.codec_context, "DEFAULT", -1
    skip = skip and ctx.name in _SKIPS_NONREF
    try:
        for packet in container.demux(stream):
            if skip and packet.pts is not None:
                i = _index(packet.pts, t0, scale)
                newest = max(newest, i)
                m = "DEFAULT" if i in wanted else "NONREF"
                if m != mode:
                    ctx.skip_frame = mode = m
            elif mode != "DEFAULT":
                ctx.skip_frame = mode = "DEFAULT"
            for frame in ctx.decode(packet if packet.size else None):
                if frame.pts is None:
                    continue
                i = _index(frame.pts, t0, scale)
                if i in wanted:
                    got[i] = _rgb(frame, w, h)
                if i >= end:
                    return got
                last = (i, frame)
    finally:
        if mode != "DEFAULT":
            ctx.skip_frame = "DEFAULT"
    if skip and (last is None or newest > last[0]):
        # a skipped frame may have been the video's last: decode the end again in full
        return _frames_at(container, stream, rate, want, size, skip=False)
    if last is not None and last[0] >= first and last[0] not in got:
        # the video ended before the clip: its last frame is the one repeated
        got[last[0]] = _rgb(last[1], w, h)
    return got
