"""Each video's frame count, frame rate and duration, kept beside its shard so that planning
clips (:class:`~feedpipe.VideoClips`) never opens a video.

``feedpipe shard`` (and :class:`~feedpipe.ShardWriter`) write ``<stem>.frames.npy`` beside each
shard holding videos: a ``float64`` array of shape ``(samples, 3)``, each sample's ``(frames,
fps, duration)`` of its first video field (:data:`VIDEO_FIELDS` order), ``(-1, -1, -1)`` where
the sample has no video or the video cannot be read. The frame count is the video stream's
packets counted by demuxing (no frame is decoded), the count a decoder gives, also for
containers whose header states none (WebM, Matroska); the rate is the stream's average rate.
A dataset sharded before the counts were recorded gets them once from
:func:`record_video_frames`.

PyAV (``pip install feedpipe[video]``) reads the containers; where it is missing at shard time
no counts are written and a log record says so (a reader then reads each video's header when it
decodes a clip).
"""

from __future__ import annotations

import io
import os
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._helpers.storage import is_local, local_path, open_binary
from .._redact import logger
from ..errors import InputError
from ._index import index_path, parse_index
from ._manifest import join
from ._sidecars import (
    new_rows,
    read_mapped,
    read_sidecar,
    record_beside,
    sidecar_path,
    write_sidecar,
)

if TYPE_CHECKING:
    import numpy as np

log = logger("feedpipe.video")

VIDEO_FIELDS: tuple[str, ...] = ("mp4", "webm", "mkv", "avi", "mov")
"""The extensions read as videos, in the order a sample's video field is looked for."""

NO_FRAMES = (-1.0, -1.0, -1.0)


def frames_path(shard_path: str) -> str:
    """``.../data-000000.tar`` -> ``.../data-000000.frames.npy``."""
    return sidecar_path(shard_path, ".frames.npy")


def video_member(exts: Sequence[str]) -> int | None:
    """Which of a sample's member extensions is its video (:data:`VIDEO_FIELDS` order, any
    case), or ``None``.

    Example:
        >>> video_member(["json", "webm", "mp4"])
        2
    """
    lowered = [e.lower() for e in exts]
    return next((lowered.index(f) for f in VIDEO_FIELDS if f in lowered), None)


def count_frames(data: Any) -> tuple[int, float, float]:
    """``(frames, fps, duration)`` of a video's bytes: its first video stream's packets counted
    by demuxing (none decoded), its average frame rate, and frames / fps seconds.

    Raises:
        ImportError: PyAV is not installed.
        av.error.FFmpegError, ValueError: the bytes are not a video PyAV reads.
    """
    from .._helpers.dependency import require

    av = require("av", extra="video", purpose="counting video frames")
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("the container holds no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate:
            raise ValueError("the video stream states no frame rate")
        frames = sum(1 for p in container.demux(stream) if p.size)
    fps = float(rate)  # a Fraction (PyAV's rates are)
    return frames, fps, frames / fps


def index_frames(buffer: Any, idx: Any) -> tuple[array, int]:
    """Each sample's ``(frames, fps, duration)`` in a shard mapped as ``buffer`` whose index is
    ``idx``, flat (``float64``, three values a sample), and how many videos could not be
    read."""
    n = len(idx)
    out = new_rows("d", n, 3, -1.0)
    buf = memoryview(buffer)
    unread = 0
    for i in range(n):
        a, b = idx.starts[i], idx.starts[i + 1]
        k = video_member(idx.exts[a:b])
        if k is None:
            continue
        off, size = idx.offsets[a + k], idx.sizes[a + k]
        try:
            out[3 * i:3 * i + 3] = array("d", count_frames(bytes(buf[off:off + size])))
        except ImportError:
            raise
        except Exception:  # noqa: BLE001 (any video FFmpeg cannot read: no count, said)
            unread += 1
    return out, unread


def has_videos(idx: Any) -> bool:
    """Whether any member of the shard indexed by ``idx`` is a video."""
    return any(e.lower() in VIDEO_FIELDS for e in idx.fields())


def frames_of_file(tar_path: str, idx: Any) -> tuple[array, int]:
    """:func:`index_frames` of the local shard file ``tar_path``.

    Raises:
        ImportError: PyAV is not installed (asked before the shard is mapped: a view of the map
            held by the error's traceback would keep it from closing).
    """
    if not len(idx):
        return new_rows("d", 0, 3, -1.0), 0
    from .._helpers.dependency import require

    require("av", extra="video", purpose="counting video frames")
    return read_mapped(tar_path, index_frames, idx)


def write_frames(path: str, frames: array) -> None:
    """Write a frames file (:func:`index_frames`' rows) atomically (a reader never sees half of
    one)."""
    write_sidecar(path, frames, 3)


_said_no_av: list[bool] = []


def record_shard_frames(out_dir: str, name: str, tar_path: str, idx: Any) -> None:
    """At shard time: write ``name``'s frames file in ``out_dir`` (the sealed shard still at
    ``tar_path``), where the shard holds videos. Without PyAV, or for a video FFmpeg cannot read,
    a log record says what is not recorded."""
    if not has_videos(idx):
        return
    try:
        frames, unread = frames_of_file(tar_path, idx)
    except ImportError:
        if not _said_no_av:
            _said_no_av.append(True)
            log.warning("%s: video frame counts not recorded (PyAV is not installed: pip install "
                        "feedpipe[video]); VideoClips will read each video's header when it "
                        "decodes, and clips_per_video='all' needs them "
                        "(feedpipe.record_video_frames)", os.path.join(out_dir, name))
        return
    if unread:
        log.warning("%s: %d video(s) FFmpeg cannot read have no recorded frame count (-1 in %s)",
                    os.path.join(out_dir, name), unread, os.path.basename(frames_path(name)))
    write_frames(frames_path(os.path.join(out_dir, name)), frames)


def record_video_frames(root: str, *, overwrite: bool = False) -> dict[str, int]:
    """Record each video's frame count, rate and duration beside the shards of the local
    dataset ``root`` that were sharded before ``feedpipe shard`` recorded them (the videos are
    demuxed, not decoded). A shard whose frames file exists is left as it is unless
    ``overwrite``.

    Returns ``{"shards": shards scanned, "videos": counts recorded, "unread": videos that could
    not be read}``; what it did is said in a log record.

    Raises:
        InputError: ``root`` is not a local directory (the counts are written beside the shards).
    """
    if not is_local(root):
        raise InputError(f"{root}: video frame counts are recorded beside the shards, in a "
                         "local directory; record them where the dataset is written, then copy "
                         "it")
    root = local_path(root)
    scanned, videos, unread = record_beside(root, ".frames.npy", 3, frames_of_file,
                                            overwrite=overwrite)
    log.info("%s: recorded the frame counts of %d shard(s) (%d videos, %d unread) beside them "
             "as <shard>.frames.npy", root, scanned, videos, unread)
    return {"shards": scanned, "videos": videos, "unread": unread}


def _shard_has_videos(root: str, name: str) -> bool:
    """Whether shard ``name`` of ``root`` holds a video, by its index (``True`` where the index
    cannot be read: its counts are then unknown)."""
    path = join(root, index_path(name))
    try:
        if is_local(path):
            with open(local_path(path), "rb") as f:
                raw = f.read()
        else:
            with open_binary(path) as f:
                raw = f.read()
        return has_videos(parse_index(raw, path))
    except (OSError, ValueError):
        return True


def load_frames(root: str, manifest: Any) -> np.ndarray | None:
    """Every sample's ``(frames, fps, duration)`` of a dataset (local or remote), in global id
    order (``float64``, shape ``(total_samples, 3)``, ``-1`` where unknown); ``None`` where a
    shard holding videos has no frames file (sharded before they were recorded, or without
    PyAV).

    Raises:
        InputError: a frames file of another length than its shard's samples (the message says
            to run :func:`record_video_frames` again).
    """
    import numpy as np

    parts = []
    for rec in manifest.shards:
        path = join(root, frames_path(rec.name))
        try:
            a = read_sidecar(path)
        except (OSError, ValueError):
            if _shard_has_videos(root, rec.name):
                return None
            a = np.full((rec.samples, 3), -1.0)  # a shard without videos has no frames file
        if a.shape != (rec.samples, 3):
            raise InputError(f"{path}: {a.shape[0] if a.ndim else 0} frame counts for the "
                             f"{rec.samples} samples of {rec.name}; run "
                             "feedpipe.record_video_frames(dataset, overwrite=True)")
        parts.append(a.astype(np.float64, copy=False))
    if not parts:
        return np.zeros((0, 3), dtype=np.float64)
    return np.concatenate(parts)
