"""The plan of video clips: which (video, clip) each position of an epoch holds, and where each
clip starts, as pure functions of ``(seed, epoch, video, clip)`` (no video is opened to plan).

An epoch of ``videos`` videos with ``clips`` clips each has ``videos * clips`` positions; id
``g`` is clip ``g % clips`` of video ``g // clips``. With each video's own count of clips (all
the clips that fit it, :func:`clips_that_fit`, from the frame counts recorded at shard time) the
ids of a video's clips follow the previous video's. The order is a keyed permutation of the
ids (:func:`~feedpipe.plan._order.feistel`), so every (video, clip) comes exactly once per
epoch, on any machine, and the epochs differ.

A clip's start frame is drawn from its own hash of ``(seed, epoch, video, clip)``: clip ``c`` of
``clips`` starts in the ``c``-th of ``clips`` equal segments of the video's possible starts, so
the clips of one video spread over it and move every epoch.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ._order import feistel, round_keys

_CLIP_STREAM = 0x636C6970  # "clip": the clip order's keys differ from the sample order's


class ClipOrder:
    """The order of an epoch's clips: ``sample_ids(positions)`` gives the clip ids
    (``video * clips + clip``) the positions hold. ``counts``: instead of ``clips`` for every
    video, each video's own number of clips (its clip ids follow the previous video's).

    Example:
        >>> o = ClipOrder(videos=3, clips=2, seed=0, epoch=0)
        >>> sorted(o.sample_ids(np.arange(6)).tolist())
        [0, 1, 2, 3, 4, 5]
    """

    def __init__(self, videos: int, clips: int, seed: int, epoch: int,
                 counts: np.ndarray | None = None) -> None:
        self.videos, self.clips = int(videos), int(clips)
        self.seed, self.epoch = int(seed), int(epoch)
        self.counts = None if counts is None else np.asarray(counts, dtype=np.int64)
        if self.counts is None:
            self.num_samples = self.videos * self.clips
        else:
            self.num_samples = int(self.counts.sum())
            self._firsts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._keys = round_keys(self.seed, self.epoch, _CLIP_STREAM)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``(video, clip)`` of each clip id.

        Example:
            >>> o = ClipOrder(videos=3, clips=0, seed=0, epoch=0, counts=np.array([2, 0, 3]))
            >>> [a.tolist() for a in o.locate(np.array([0, 1, 2, 4]))]
            [[0, 0, 2, 2], [0, 1, 0, 2]]
        """
        ids = np.asarray(ids, dtype=np.int64)
        if self.counts is None:
            return ids // self.clips, ids % self.clips
        videos = np.searchsorted(self._firsts, ids, side="right") - 1
        return videos, ids - self._firsts[videos]

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """The clip id at each of ``positions`` (each in ``[0, num_samples)``)."""
        x = np.asarray(positions, dtype=np.int64).astype(np.uint64)
        return feistel(x, self.num_samples, self._keys).astype(np.int64)

    def first_ids(self) -> np.ndarray:
        """Every clip id of the epoch, in order."""
        return self.sample_ids(np.arange(self.num_samples))


def clip_draw(seed: int, epoch: int, video: int, clip: int) -> float:
    """A number in ``[0, 1)`` that is a pure function of ``(seed, epoch, video, clip)``: the
    same on every rank and worker, different (as a hash differs) for each epoch.

    Example:
        >>> clip_draw(0, 0, 5, 1) == clip_draw(0, 0, 5, 1) != clip_draw(0, 1, 5, 1)
        True
    """
    text = f"feedpipe-clip\0{int(seed)}\0{int(epoch)}\0{int(video)}\0{int(clip)}"
    h = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def clips_that_fit(frames: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """How many clips of ``spans`` frames fit one after the other in videos of ``frames``
    frames: ``frames // span``, at least 1 (a video shorter than a clip, or of an unknown
    count, ``-1``, gives one clip).

    Example:
        >>> clips_that_fit(np.array([32, 31, 5, -1]), np.array([8, 8, 8, 8])).tolist()
        [4, 3, 1, 1]
    """
    frames = np.asarray(frames, dtype=np.int64)
    return np.maximum(1, frames // np.maximum(1, np.asarray(spans, dtype=np.int64)))


def clip_start(frames: int, span: int, clips: int, clip: int, draw: float) -> int:
    """The first frame of clip ``clip`` of ``clips`` covering ``span`` frames of a video of
    ``frames`` frames, ``draw`` in ``[0, 1)``: uniform in the ``clip``-th of ``clips`` equal
    segments of the possible starts ``0 .. frames - span`` (0 where the video is shorter than
    the clip).

    Example:
        >>> [clip_start(32, 8, 2, c, 0.0) for c in (0, 1)], clip_start(5, 8, 1, 0, 0.9)
        ([0, 12], 0)
    """
    starts = int(frames) - int(span) + 1  # how many starts fit the whole clip
    if starts <= 1:
        return 0
    lo = starts * clip // clips
    hi = max(lo + 1, starts * (clip + 1) // clips)
    return lo + min(hi - lo - 1, int(draw * (hi - lo)))
