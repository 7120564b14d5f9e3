"""``VideoClips``: the clips of a dataset of videos as the samples of an epoch, each
``(video, clip)`` exactly once over the ranks and workers, resumable mid-epoch.

A source (:class:`~feedpipe.Source`) whose ids are clips: id ``g`` is clip ``g % clips`` of video
(sample) ``g // clips``. Its plan is :class:`~feedpipe.plan._clips.ClipOrder` (a keyed
permutation of the clip ids, a pure function of seed and epoch); its fetch reads each clip's
video from the shards and tags it with the clip; its transform
(:class:`~feedpipe.transforms._video.VideoClip`) draws the clip's start and decodes it, in the
loader's worker processes where it has them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._redact import logger
from ..errors import InputError
from ..format._manifest import load_manifest
from ..format._video_frames import load_frames
from ..plan._clips import ClipOrder, clips_that_fit
from ..plan._order import Split
from ..plan._world import World, detect_world
from ..transforms._video import VideoClip
from ._ledger_kinds import lengths_record
from ._routes import Capabilities
from ._shard_set import ShardSet
from ._source import Source
from ._states import dataset_identity

log = logger("feedpipe.video")

_KIND = "video-clips"


class _Then:
    """``after(first(x))``: the clip decoder, then the user's transform (picklable)."""

    def __init__(self, first: Callable[[Any], Any], after: Callable[[Any], Any]) -> None:
        self.first, self.after = first, after

    def __call__(self, x: Any) -> Any:
        return self.after(self.first(x))


class ReadClips:
    """The fetch of :class:`VideoClips`: each clip id's video sample from the shards, with
    ``__video__``, ``__clip__``, ``__epoch__`` and ``__seed__``; ``__index__`` is the clip id.
    A shard cut since it was opened is named (:meth:`ShardSet.check`)."""

    def __init__(self, source: VideoClips, epoch: int, copy: bool) -> None:
        self.source, self.shards, self.order = source, source.shards, source.plan(epoch)
        self.epoch, self.seed, self.copy = epoch, source.seed, copy
        self.counts, self.frames = source.counts, source.frames

    def __call__(self, ids: np.ndarray) -> list[tuple[int, Any, bool]]:
        ids = np.asarray(ids, dtype=np.int64)
        videos, clips = self.order.locate(ids)
        s_of, i_of = self.shards.locate(videos)
        used = sorted(set(s_of.tolist()))
        with self.shards.hold(used):
            readers = {s: self.shards.reader(s) for s in used}
        self.shards.check(used)
        out, read = [], 0
        for g, v, c, s, i in zip(ids.tolist(), videos.tolist(), clips.tolist(), s_of.tolist(),
                                 i_of.tolist()):
            x = readers[s].sample(i)
            read += sum(len(b) for b in x.values() if isinstance(b, (bytes, memoryview)))
            if self.copy:
                x = {k: bytes(b) if isinstance(b, memoryview) else b for k, b in x.items()}
            x.update(__video__=v, __clip__=c, __index__=g, __epoch__=self.epoch,
                     __seed__=self.seed)
            if self.counts is not None:  # this video's own count of clips
                x["__clips__"] = int(self.counts[v])
            if self.frames is not None and self.frames[v, 0] > 0:  # the count at shard time
                x["__frames__"] = int(self.frames[v, 0])
            out.append((g, x, False))
        # the loader counts bytes per sample id; these ids are clips, so the source counts
        self.source.bytes_read = (self.source.bytes_read or 0) + read
        return out


class VideoClips(Source):
    """The clips of the videos in ``url``'s shards: ``clips_per_video`` clips of ``frames``
    frames from each video every epoch, each clip one sample.

    Every ``(video, clip)`` comes exactly once per epoch over all ranks and workers, in an order
    that is a pure function of ``(seed, epoch)``; each clip's start is drawn from
    ``(seed, epoch, video, clip)`` (:class:`~feedpipe.VideoClip`), so a clip is the same on any
    rank or worker and moves from one epoch to the next. ``FeedLoader.state_dict()`` resumes
    mid-epoch to exactly the clips not yet delivered.

    Args:
        url: the dataset (a folder of shards with a manifest) holding one video per sample.
        frames: frames per clip.
        stride: video frames between two frames of a clip.
        fps: instead of ``stride``, the clip's frame rate.
        clips_per_video: clips drawn from each video per epoch, or ``"all"``: as many as fit
            one after the other in each video (``frames // span``, at least one), counted
            from the frame counts ``feedpipe shard`` records beside the shards (no video is
            opened to plan; :func:`~feedpipe.record_video_frames` for older shards).
        size: ``(height, width)`` the frames are resized to (``None``: the videos' own).
        field: the video field (``None``: the first of ``mp4``, ``webm``, ``mkv``, ``avi``,
            ``mov`` present).
        seed: the seed of the order and of the clips' starts.
        transform: applied to each decoded clip (the dict :class:`~feedpipe.VideoClip` makes).
        on_error: ``"raise"`` or ``"skip"`` for a video that cannot be decoded.
        rank, world_size: this process's rank and the number of ranks (default: detected).
        drop_last: make the ranks equal by leaving clips out rather than repeating some.
        cache: a :class:`~feedpipe.FunctionIndex` memoising the decoded clips, each keyed by its
            video's bytes and its draw (seed, epoch, video, clip): a run that reads the same
            epochs again (a restart, another job over the same clips) decodes none of them.
        decoder: ``"pyav"`` (each clip decoded in the loader) or ``"dali"``: each clip's frame
            numbers planned in the loader, its frames decoded by NVIDIA DALI batch by batch
            (:class:`~feedpipe.DaliVideoStage`); the same clips either way.

    Example:
        >>> import feedpipe
        >>> issubclass(feedpipe.VideoClips, feedpipe.Source)
        True
    """

    prefetches = False  # its plan is of clips, not of the shards' samples

    def __init__(self, url: str, *, frames: int, stride: int = 1, fps: float | None = None,
                 clips_per_video: int | str = 1, size: tuple[int, int] | None = None,
                 field: str | None = None, seed: int = 0,
                 transform: Callable[[Any], Any] | None = None, on_error: str = "raise",
                 rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, max_open_shards: int = 64,
                 cache: Any = None, decoder: str = "pyav") -> None:
        self.url = str(url)
        self.manifest = load_manifest(self.url)
        self.seed = int(seed)
        every = clips_per_video == "all"
        if not every and not isinstance(clips_per_video, int):
            raise ValueError(f"VideoClips(clips_per_video={clips_per_video!r}): a number of "
                             "clips, or 'all'")
        self.clip = VideoClip(frames, stride=stride, fps=fps, size=size,
                              clips=1 if every else int(clips_per_video), field=field,
                              on_error=on_error)
        decode = self.clip if cache is None else cache.wrap(self.clip)
        if decoder != "pyav":  # the clips' frame numbers only: DaliVideoStage decodes them
            from ..transforms._dali_video_host import host_plan

            decode, transform = host_plan(decoder, self.clip, cache, transform), None
        self.transform = decode if transform is None else _Then(decode, transform)
        self.decode: dict[str, Any] = {}
        self.decoded = None
        self.world = (World(rank, world_size) if rank is not None and world_size
                      else detect_world())
        self.drop_last = bool(drop_last)
        self.max_open_shards = int(max_open_shards)
        self.shards = ShardSet(self.url, self.manifest, max_open=self.max_open_shards)
        self.videos = int(self.manifest.total_samples)
        self.clips = self.clip.clips
        # each video's (frames, fps, duration) as recorded at shard time, or None
        self.frames = load_frames(self.url, self.manifest)
        self.counts = self._all_clips() if every else None
        self.bytes_read = 0  # video bytes read out of the shards (loader.stats()["io"])

    def _all_clips(self) -> np.ndarray:
        """Each video's count of clips that fit it, from the recorded frame counts."""
        if self.frames is None:
            raise InputError(
                f"{self.url}: VideoClips(clips_per_video='all') counts each video's clips from "
                "the frame counts feedpipe shard records beside the shards (<shard>.frames.npy)"
                ", and these shards have none: run feedpipe.record_video_frames(dataset) once, "
                "or give a number of clips")
        frames, fps = self.frames[:, 0], self.frames[:, 1]
        unknown = int((frames < 0).sum())
        if unknown:
            log.warning("%s: %d video(s) have no recorded frame count (unreadable at shard "
                        "time): one clip each is planned", self.url, unknown)
        spans = np.array([self.clip.span(r) if r > 0 else 1 for r in fps.tolist()])
        return clips_that_fit(frames, spans)

    def __len__(self) -> int:
        """The clips of an epoch (over all ranks)."""
        return self.videos * self.clips if self.counts is None else int(self.counts.sum())

    def plan(self, epoch: int | None = None) -> Any:  # a ClipOrder: ids of clips, not samples
        """The order of ``epoch``'s clips: the clip id (``video * clips + clip``, or with
        ``clips_per_video="all"`` the clips of each video after the previous one's) at each
        position."""
        return ClipOrder(self.videos, self.clips, self.seed, epoch or 0, self.counts)

    def split_at(self, start: int = 0, whole_batches: bool = False, *,
                 epoch: int | None = None) -> Split:
        """This rank's share of the epoch's ``videos * clips_per_video`` positions from
        ``start`` on."""
        return Split(len(self), self.world.world_size, self.world.rank, int(start),
                     self.drop_last, bool(whole_batches))

    def _identity(self) -> dict[str, Any]:
        c = self.clip
        clips: Any = self.clips if self.counts is None else ["all", len(self)]
        return {"kind": _KIND, "seed": self.seed, "videos": self.videos, "clips": clips,
                "frames": c.frames, "stride": c.stride, "fps": c.fps}

    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The state at ``position`` of ``epoch``, naming the clips it belongs to."""
        return {**self._identity(), "epoch": int(epoch), "position": int(position)}

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """Where ``state`` continues; a state of other clips (another seed, count, clip
        length) raises :class:`~feedpipe.StateError`."""
        from ..errors import StateError

        mine = self._identity()
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            why = f"{self.url}: the state is of {theirs}, these clips are {mine}"
            if strict:
                raise StateError(why + " (strict=False starts the saved epoch afresh)")
            log.warning("%s: starting epoch %s afresh", why, state.get("epoch", 0))
            return int(state.get("epoch", 0)), 0
        return int(state["epoch"]), int(state["position"])

    def ledger_info(self) -> dict[str, Any]:
        """What ``FeedLoader(ledger=)`` records of these clips in ``ledger.json``: the videos'
        dataset (its digest and shards' counts), the clips per video, the clip's frames, stride
        and rate, and the seed, from which ``feedpipe ledger`` recomputes each epoch's order
        of clips."""
        c = self.clip
        info = {"kind": _KIND, "digest": dataset_identity(self.manifest)["digest"],
                "counts": [int(n) for n in self.shards.counts], "seed": self.seed,
                "clips": self.clips, "frames": c.frames, "stride": c.stride, "fps": c.fps,
                "drop_last": self.drop_last}
        if self.counts is not None:  # each video's own count, as a Packed's lengths
            info.update(clips="all", clip_counts=lengths_record(self.counts))
        return info

    def capabilities(self, collate_fn: Any) -> Capabilities:
        """A transform to share (the decoding), read by its own fetch (``video-clips``)."""
        return Capabilities(transform=True, local=self.shards.local,
                            shards_fit=len(self.shards) <= self.max_open_shards,
                            fetch=_KIND)

    def sample_fetch(self, epoch: int, *, copy: bool) -> ReadClips:
        """Each clip id's video sample, tagged with its video, clip, epoch and seed."""
        return ReadClips(self, epoch, copy)
