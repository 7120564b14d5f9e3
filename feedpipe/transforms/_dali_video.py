"""Video clips decoded by NVIDIA DALI (``pip install 'feedpipe[dali,video]'``), from the same plan
as PyAV's.

``VideoClips(decoder="dali")`` keeps the plan (the clips of each epoch, their order over ranks
and workers, each clip's start), the ledger and the resume points unchanged: its transform only
plans each clip's frame numbers on the host (``DaliClipPlan``: the container header read, no
frame decoded). :class:`DaliVideoStage` then decodes the loader's batches::

    FeedLoader batches (encoded video bytes + each clip's frame numbers, from the plan)
      ──► DALI: fn.external_source ─► fn.decoders.video(frames=...) ─► fn.resize ─► FCHW
      ──► torch: "frames" [B, T, 3, H, W] uint8, the rest of the batch as PyAV's path gives it

**Where it runs.** ``device_id=None``: DALI's CPU decoder (FFmpeg's libavcodec) in this
process; it reads VP8, VP9 and MJPEG only (WebM videos, typically). ``device_id=0``: DALI's
``"mixed"`` decoder (NVDEC on that GPU) reads H.264, H.265, AV1, MPEG-4, VP8, VP9 and MJPEG;
the frames are resized on the GPU and handed out as CUDA tensors. A codec the chosen decoder
cannot read, or a GPU asked for where there is none, is an error naming it, never a fallback.

DALI is imported when the stage first decodes, never at ``import feedpipe``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .._helpers.dependency import require
from .._helpers.fork_safety import mark_process_fork_unsafe
from .._redact import logger
from ..errors import DecodeError, MissingDependencyError
from ._dali_host import BUILT, keep_pipelines_in_forked_children
from ._dali_video_host import CODEC, ENCODED, FRAME_IDS, HOST_FIELDS, SHARD, SIZE

log = logger("feedpipe.video")

# what DALI's CPU video decoder reads (its docs: "supported by both CPU and Mixed backends")
CPU_CODECS = frozenset({"vp8", "vp9", "mjpeg"})


def _column(batch: dict[str, Any], name: str) -> list[Any]:
    v = batch.get(name)
    if v is None:
        raise ValueError(f"DaliVideoStage: the batch has no {name!r}: feed it the batches of a "
                         "FeedLoader over VideoClips(..., decoder='dali')")
    return list(v)


def _ids(column: Any) -> list[np.ndarray]:
    a = column.numpy() if isinstance(column, torch.Tensor) else np.asarray(column)
    return [np.ascontiguousarray(r, dtype=np.int32) for r in a.reshape(len(a), -1)]


class DaliVideoStage:
    """Iterate the batches of a :class:`~feedpipe.FeedLoader` over
    ``VideoClips(..., decoder="dali")`` with each clip decoded by NVIDIA DALI.

    Each batch has the layout of PyAV's path: ``frames`` (``uint8`` ``[B, T, 3, H, W]``, on
    ``cuda:<device_id>`` or the CPU), ``start``, ``video``, ``clip``, ``padded`` and
    ``__key__``. The clips are those of the plan: the same videos' bytes, starts and frame
    numbers as ``decoder="pyav"`` decodes; DALI's YUV conversion and resize give pixels a few
    levels from FFmpeg's scaler's (docs/concepts.md, "Video clips").

    Args:
        batches: a :class:`~feedpipe.FeedLoader` over ``VideoClips(..., decoder="dali")`` (or
            any iterable of its batches).
        batch_size: the largest batch (default: ``batches.batch_size``).
        device_id: the CUDA device whose NVDEC decodes (DALI's ``"mixed"`` decoder);
            ``None``: DALI's CPU decoder, which reads VP8, VP9 and MJPEG only.
        num_threads: DALI's CPU threads.

    Each batch is decoded as it is handed out (DALI prefetches none), so ``state_dict()`` is
    the wrapped loader's and resumes exactly; ``set_epoch`` and ``load_state_dict`` pass
    through. While the stage's pipeline lives, a loader of this process forks no workers
    (``multiprocessing_context="forkserver"`` starts them safely), as with
    :class:`~feedpipe.DaliStage`. A video DALI cannot decode raises a
    :class:`~feedpipe.errors.DecodeError` naming the batch's keys and shards.

    Example:
        >>> from feedpipe import FeedLoader, VideoClips
        >>> clips = VideoClips("clips", frames=8, size=(112, 112), decoder="dali")  # doctest: +SKIP
        >>> stage = DaliVideoStage(FeedLoader(clips, batch_size=4), device_id=0)  # doctest: +SKIP
        >>> next(iter(stage))["frames"].shape                              # doctest: +SKIP
        torch.Size([4, 8, 3, 112, 112])
    """

    def __init__(self, batches: Iterable[Any], *, batch_size: int | None = None,
                 device_id: int | None = 0, num_threads: int = 2) -> None:
        if batch_size is None:
            batch_size = getattr(batches, "batch_size", None)
            if batch_size is None:
                raise TypeError("DaliVideoStage needs batch_size= (the iterable has no "
                                ".batch_size)")
        if batch_size < 1 or num_threads < 1:
            raise ValueError("batch_size and num_threads must be at least 1")
        self.batches, self.batch_size = batches, int(batch_size)
        self.device_id, self.num_threads = device_id, int(num_threads)
        self._pipes: dict[tuple[int, int], Any] = {}  # by the asked size, (0, 0): the videos'

    @property
    def device(self) -> torch.device:
        """The device the stage's frames are on, ``cuda:<device_id>`` (or ``cpu`` with
        ``device_id=None``)."""
        return torch.device("cpu") if self.device_id is None else torch.device(
            "cuda", self.device_id)

    def _check_device(self) -> None:
        if self.device_id is None:
            return
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.device_id >= n:
            raise MissingDependencyError(
                f"DaliVideoStage(device_id={self.device_id}) decodes with DALI's 'mixed' video "
                f"decoder (NVDEC) on CUDA device {self.device_id}, and this process sees "
                f"{n} CUDA device(s) (torch.cuda.device_count()). Run it where that GPU is, "
                "pass device_id=None for DALI's CPU decoder (VP8, VP9, MJPEG videos only), or "
                "decode with VideoClips(decoder='pyav')")

    def _build(self, size: tuple[int, int]) -> Any:
        dali = require("nvidia.dali", extra="dali", purpose="decoding video clips with DALI "
                       "(feedpipe.DaliVideoStage)")
        from nvidia.dali import fn, types

        keep_pipelines_in_forked_children()
        mark_process_fork_unsafe("DALI's threads (a DaliStage runs in this process)",
                                 lambda: len(BUILT) > 0)
        pipe = dali.Pipeline(batch_size=self.batch_size, num_threads=self.num_threads,
                             device_id=self.device_id, prefetch_queue_depth=1)
        BUILT.add(pipe)
        with pipe:
            dt = types.DALIDataType
            encoded = fn.external_source(name="encoded", dtype=dt.UINT8)
            ids = fn.external_source(name="ids", dtype=dt.INT32)
            # a frame number past the frames the video holds (its header said more): its last
            # frame, PyAV's rule for short videos (DALI's default pads black)
            frames: Any = fn.decoders.video(encoded, frames=ids, pad_mode="edge",
                                            device="cpu" if self.device_id is None else "mixed")
            if size != (0, 0):
                frames = fn.resize(frames, size=list(size), antialias=True)
            pipe.set_outputs(fn.transpose(frames, perm=[0, 3, 1, 2]))  # FHWC -> FCHW
        pipe.build()
        return pipe

    def _check_codecs(self, batch: dict[str, Any]) -> None:
        if self.device_id is not None:
            return
        for codec, key, shard in zip(_column(batch, CODEC), batch.get("__key__") or [],
                                     batch.get(SHARD) or []):
            if codec not in CPU_CODECS:
                raise DecodeError(
                    f"video of sample {key!r} in {shard!r} is {codec}, which DALI's CPU video "
                    f"decoder cannot read (it reads {', '.join(sorted(CPU_CODECS))}): decode "
                    "on a GPU (DaliVideoStage(device_id=0)), with VideoClips(decoder='pyav'), "
                    "or re-encode the videos (VP9 WebM)")

    def _to_torch(self, out: Any) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        t = out.as_tensor()
        arr = torch.empty(t.shape(), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        # DALI recycles its buffers at the next run: copied, on torch's stream where on a GPU
        feed_ndarray(t, arr, cuda_stream=stream)
        return arr

    def decode(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One batch of planned clips with its ``frames`` decoded, the host's fields removed."""
        self._check_codecs(batch)
        encoded = [np.frombuffer(b, dtype=np.uint8) for b in _column(batch, ENCODED)]
        sizes = {(int(s[0]), int(s[1])) for s in _column(batch, SIZE)}
        size = sizes.pop() if len(sizes) == 1 else (0, 0)
        if size not in self._pipes:
            self._check_device()
            self._pipes[size] = self._build(size)
        pipe = self._pipes[size]
        pipe.feed_input("encoded", encoded)
        pipe.feed_input("ids", _ids(batch[FRAME_IDS]))
        try:
            (out,) = pipe.run()
            shapes = {tuple(s) for s in out.shape()}
            if len(shapes) > 1:
                raise ValueError(f"the clips' frames differ in size ({sorted(shapes)}): give "
                                 "VideoClips(size=(height, width))")
            frames = self._to_torch(out)
        except RuntimeError as e:
            self._pipes.pop(size)  # DALI stopped it: the next batch builds a new one
            keys = list(zip(batch.get("__key__") or [], batch.get(SHARD) or []))
            raise DecodeError(f"DALI could not decode the videos of a batch ({keys}; "
                              f"(key, shard) each): {e}".rstrip() +
                              " (check the files with ffprobe, or decode them with "
                              "VideoClips(decoder='pyav'), which names the one that fails)"
                              ) from e
        out_batch = {k: v for k, v in batch.items() if k not in HOST_FIELDS}
        out_batch["frames"] = frames
        return out_batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.batches:
            yield self.decode(batch)

    # -- the loader protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s clips from the next pass on (the wrapped loader's ``set_epoch``)."""
        self.batches.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state: after the last batch this stage handed out."""
        return self.batches.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (the wrapped loader resumes there)."""
        self.batches.load_state_dict(state_dict)  # type: ignore[attr-defined]
