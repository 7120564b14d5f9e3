"""The host's side of DALI video decoding (:class:`~feedpipe.DaliVideoStage`): the transform
``VideoClips(decoder="dali")`` runs on each clip sample instead of decoding it.

It does what :class:`~feedpipe.VideoClip` does before its first decoded frame, with the same
functions: the video field, the draw of ``(seed, epoch, video, clip)``, the container header
(frame count and rate, :func:`~feedpipe.video_info`; or the frame count recorded at shard time),
the start (:func:`~feedpipe.plan._clips.clip_start`) and the clip's frame numbers
(:meth:`VideoClip.wanted <feedpipe.VideoClip.wanted>`). A frame past the video's last is its
last frame (the short-video rule, counted in ``padded`` and said in a log record). The sample it
gives keeps the video's encoded bytes and those frame numbers; DALI decodes them batch by batch.

PyAV reads the header (no frame is decoded here); DALI is not imported.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from .._helpers.dependency import require
from ..plan._clips import clip_start
from ._video import VideoClip, clip_asked, say_padded, video_info

# the fields a planned clip carries for DALI, taken out of the batch once DALI decoded it
ENCODED, FRAME_IDS, CODEC, SIZE, SHARD = ("__encoded__", "__frame_ids__", "__codec__",
                                          "__size__", "__shard__")
HOST_FIELDS = (ENCODED, FRAME_IDS, CODEC, SIZE, SHARD)



def codec_name(data: Any) -> str:
    """The codec of a video's first video stream, from its container header."""
    av = require("av", extra="video", purpose="reading video headers")
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("the container holds no video stream")
        return str(container.streams.video[0].codec_context.name)


class DaliClipPlan:
    """The transform of a clip sample for DALI: its frame numbers, from the plan, without
    decoding a frame. ``clip``: the :class:`~feedpipe.VideoClip` whose clips these are (its
    frames, stride or rate, size, field and ``on_error``).

    The sample it gives: ``start``, ``video``, ``clip``, ``padded`` and ``__key__`` as
    :class:`~feedpipe.VideoClip` gives them, with the video's encoded bytes, its codec, the
    clip's frame numbers and the asked size in place of ``frames``.

    Example:
        >>> DaliClipPlan(VideoClip(4, stride=2)).clip.span(8.0)
        7
    """

    def __init__(self, clip: VideoClip) -> None:
        self.clip = clip

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        c = self.clip
        a = clip_asked(sample, c.field, c.on_error, c.clips)
        name, key, shard, video, clip, fail = a.name, a.key, a.shard, a.video, a.clip, a.fail
        data = sample[name]
        try:
            info = video_info(data)
            codec = codec_name(data)
        except Exception as e:  # FFmpeg's errors, a missing stream
            if isinstance(e, ImportError):
                raise
            raise fail(f"video {name!r} of sample {key!r} in {shard!r} cannot be read: {e} "
                       "(check the file with ffprobe; on_error='skip' leaves such videos out)"
                       ) from e
        total = info.frames if a.recorded is None else int(a.recorded)
        start = clip_start(total, c.span(info.fps), a.clips, clip, a.draw)
        want = c.wanted(start, info.fps)
        ids = np.minimum(want, total - 1)
        padded = int((want > total - 1).sum())
        say_padded(key, shard, c.frames, padded)
        size = np.array(c.size if c.size is not None else (0, 0), dtype=np.int64)
        raw = bytes(data) if isinstance(data, memoryview) else data
        return {"start": start, "video": video, "clip": clip, "padded": padded, "__key__": key,
                ENCODED: raw, FRAME_IDS: ids.astype(np.int64), CODEC: codec, SIZE: size,
                SHARD: shard}


def host_plan(decoder: str, clip: VideoClip, cache: Any, transform: Any) -> DaliClipPlan:
    """The transform of ``VideoClips(decoder=decoder)`` other than PyAV's: the host's plan of
    each clip for :class:`~feedpipe.DaliVideoStage`. A cache or a per-clip transform is
    refused: the clips are decoded by the stage, batch by batch, after the loader."""
    if decoder != "dali":
        raise ValueError(f"VideoClips(decoder={decoder!r}): 'pyav' (decoded in the loader) or "
                         "'dali' (decoded by feedpipe.DaliVideoStage)")
    if cache is not None:
        raise ValueError("VideoClips(decoder='dali', cache=...): the decoded store keeps clips "
                         "PyAV decoded; with decoder='dali' DALI decodes every batch, so leave "
                         "cache out (or decode with decoder='pyav')")
    if transform is not None:
        raise ValueError("VideoClips(decoder='dali', transform=...): the clips are decoded "
                         "after the loader, by feedpipe.DaliVideoStage; apply the transform to "
                         "the stage's batches instead")
    return DaliClipPlan(clip)
