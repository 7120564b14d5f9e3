"""``DeviceLoader``: batches from any iterable, prefetched by a background thread and handed to the
training loop already on the device, with the time the loop waited for data measured.

How a batch travels on CUDA:

1. The producer thread takes batch ``n`` from the source. The source iterator itself was created
   on the caller's thread (``iter(source)``), so a ``DataLoader`` forks its workers there, before
   this loader starts a thread or touches CUDA.
2. Each CPU tensor of the batch (any nesting of tuples, lists, dicts; other values pass through)
   is copied by the CPU into slot ``n % depth`` of a pinned staging ring. A slot holds one
   page-locked buffer per tensor position in the batch, allocated once and reused for every later
   batch (grown only when a larger tensor arrives). Before it overwrites a slot, the producer
   waits for the event of the copy that last read it; that host wait happens in the producer
   thread, never in the loop.
   A tensor that is already pinned (``DataLoader(pin_memory=True)``, a pinned
   :class:`~feedpipe.BatchCollator` ring) is copied from directly. The loader keeps it
   referenced until that slot's event shows the copy finished: its owner may refill a buffer as
   soon as nobody references it, and must not do so under an asynchronous copy.
3. The staged tensors are copied with ``non_blocking=True`` on a dedicated side stream into device
   tensors allocated on that stream, and an event is recorded after the batch's last copy. The
   (batch, event) pair goes into a queue of ``depth`` entries: with the batch in the loop, up to
   ``depth + 1`` device batches exist at once, and the caching allocator keeps reusing the same
   blocks for them once it has warmed up.
4. The loop's ``next()`` takes the pair (the time it blocks here is the *host wait*), makes its
   current stream wait for the event on the GPU (``wait_event``: no host synchronisation) and
   calls ``record_stream`` on the device tensors (see ``_hand_off``).

Without CUDA (``device="cpu"``, or no CUDA device present) the same thread prefetches ``depth``
batches ahead and yields them as they are, on the CPU.

Steps 1 and 4 are here, steps 2 and 3 in :mod:`feedpipe.device._stager`, the thread and its
queue in :mod:`feedpipe.device._producer`.

What "waiting" means: ``wait_s`` is host time blocked in ``next()``. On CUDA the host usually runs
ahead of the GPU, so a GPU-bound loop shows little host wait even when the GPU stalls on a copy;
``time_gpu=True`` measures that stall on the GPU itself. The producer is not throttled to the GPU:
like any prefetcher, a loop that queues kernels far ahead (no ``.item()`` for many steps) holds one
device batch per queued step, bounded by CUDA's launch queue and returned to the caching allocator
as the GPU catches up.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ._pass_stats import PassStats
from ._placement import resolve_device
from ._producer import END, Producer
from ._stager import PinnedStager


class DeviceLoader:
    """Prefetch batches from ``iterable`` in a background thread and deliver them on ``device``.

    On CUDA, host tensors go through pinned buffers allocated once and reused, are copied on a side
    stream with ``non_blocking=True``, and are handed over with events: the loop's stream waits for
    the copy on the GPU, the host never synchronises in the loop. Without CUDA it still prefetches
    ``depth`` batches in the background and yields CPU tensors. Batches may be tensors or any
    nesting of tuples, lists and dicts; other values pass through.

    One pass at a time: starting a new ``iter()`` stops the previous pass. Breaking out of the loop,
    ``close()``, leaving a ``with`` block or garbage collection stops the producer thread and drops
    prefetched batches; an exception in the source is raised again in the loop, same object, with
    the producer's traceback.

    Args:
        iterable: the batches (a ``DataLoader``, a generator, a list, ...).
        device: where batches go. ``"cuda"`` (the default) falls back to the CPU where no CUDA
            device exists.
        depth: batches prefetched ahead of the loop (and pinned staging slots), at least 1.
        time_gpu: on CUDA, also time how long the loop's stream waited for each copy with CUDA
            events (read without synchronising in the loop; ``stats()["gpu_wait_s"]``).
        shutdown_timeout: seconds to wait for the producer to leave the source's ``next()``.

    Example:
        >>> import torch
        >>> loader = DeviceLoader(({"x": torch.full((2,), i)} for i in range(3)), device="cpu")
        >>> [b["x"].tolist() for b in loader]
        [[0, 0], [1, 1], [2, 2]]
        >>> s = loader.stats()
        >>> s["steps"], 0.0 <= s["starvation"] <= 1.0
        (3, True)
    """

    def __init__(self, iterable: Iterable[Any], device: str | torch.device = "cuda", depth: int = 2,
                 *, time_gpu: bool = False, shutdown_timeout: float = 30.0) -> None:
        if int(depth) < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.iterable = iterable
        self.depth = int(depth)
        self.time_gpu = time_gpu
        self.shutdown_timeout = shutdown_timeout
        self._requested = device
        self._device: torch.device | None = None  # resolved on first use: no CUDA call here
        self._stager: PinnedStager | None = None
        self._run: Producer | None = None
        self._stats = PassStats()

    @property
    def device(self) -> torch.device:
        """The device batches are delivered on (resolved on first use)."""
        if self._device is None:
            self._device = resolve_device(self._requested)
        return self._device

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._stop_run()
        source = iter(self.iterable)  # on the caller's thread: DataLoader workers fork here
        device = self.device
        cuda = device.type == "cuda"
        if cuda and self._stager is None:
            self._stager = PinnedStager(device, self.depth)
        stats = self._stats = PassStats()
        run = self._run = Producer(source, self._stager if cuda else None, self.depth)
        del source  # the producer thread owns it now; it is freed when that thread ends
        try:
            while True:
                item = run.get(stats)
                if item is END:
                    return
                batch = self._hand_off(item, stats) if cuda else item
                del item
                stats.steps += 1
                stats.t_last = time.perf_counter()
                yield batch
        finally:
            self._close_run(run)

    def _hand_off(self, item: tuple[Any, torch.cuda.Event, list[torch.Tensor]],
                  stats: PassStats) -> Any:
        batch, event, fresh = item
        stream = torch.cuda.current_stream(self.device)
        if self.time_gpu:
            before = torch.cuda.Event(enable_timing=True)
            before.record(stream)
        stream.wait_event(event)  # the GPU waits for the copy; the host goes on
        if self.time_gpu:
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            stats.gpu_pending.append((before, after))
            while stats.gpu_pending and stats.gpu_pending[0][1].query():  # non-blocking
                b, a = stats.gpu_pending.popleft()
                stats.gpu_wait_ms += b.elapsed_time(a)
        # The device tensors were allocated on the side stream, and the caching allocator knows
        # only that stream. When the loop drops a batch, the allocator would hand its memory to
        # the next allocation on the side stream at once, and the next copy could overwrite it
        # while kernels queued on the loop's stream still read it. record_stream makes the
        # allocator wait for the work queued on the loop's stream before reusing the memory.
        for t in fresh:
            t.record_stream(stream)
        return batch

    def _close_run(self, run: Producer) -> None:
        if not run.close(self.shutdown_timeout) and self._run is run:
            self._stager = None  # the stuck thread may still write into it: never reuse it
        if self._run is run:
            self._run = None

    def _stop_run(self) -> None:
        if self._run is not None:
            self._close_run(self._run)

    def close(self) -> None:
        """Stop the current pass (if any) and release the pinned buffers and the side stream."""
        self._stop_run()
        if self._stager is not None:
            self._stager.release()
            self._stager = None

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn modules down
            pass

    def stats(self) -> dict[str, Any]:
        """Figures of the current (or last) pass.

        ``steps``: batches handed out; ``wait_s``: seconds the loop spent blocked in ``next()``
        waiting for data (``first_wait_s`` of it for the first batch, ``max_wait_s`` the longest);
        ``wall_s``: from entering the first ``next()`` to handing out the last batch;
        ``starvation``: ``wait_s / wall_s`` (0: data always ready, 1: the loop only waited);
        ``steady_starvation``: the same without the first batch (start-up excluded);
        ``gpu_wait_s``: with ``time_gpu=True`` on CUDA, time the loop's stream waited for copies
        (this call waits for the GPU to reach the last step; None otherwise); pinned buffer figures
        count the staging ring (0 on the CPU).
        """
        s = self._stats
        last = s.t_last if s.t_last is not None else 0.0  # set with the first step
        wall = (last - s.t_start) if s.steps and s.t_start is not None else 0.0
        steady = (last - s.t_first) if s.steps > 1 and s.t_first is not None else 0.0
        gpu_wait_s = None
        if self.time_gpu and self._device is not None and self._device.type == "cuda":
            while s.gpu_pending:
                b, a = s.gpu_pending.popleft()
                a.synchronize()
                s.gpu_wait_ms += b.elapsed_time(a)
            gpu_wait_s = s.gpu_wait_ms / 1e3
        st = self._stager
        return {
            "device": str(self._device) if self._device is not None else str(self._requested),
            "depth": self.depth,
            "steps": s.steps,
            "wait_s": s.wait_s,
            "first_wait_s": s.first_wait_s,
            "max_wait_s": s.max_wait_s,
            "mean_wait_s": s.wait_s / s.steps if s.steps else 0.0,
            "wall_s": wall,
            "starvation": min(1.0, s.wait_s / wall) if wall > 0 else 0.0,
            "steady_starvation": (min(1.0, (s.wait_s - s.first_wait_s) / steady)
                                  if steady > 0 else 0.0),
            "gpu_wait_s": gpu_wait_s,
            "pinned_buffers": sum(len(x) for x in st.slots) if st is not None else 0,
            "pinned_bytes": st.pinned_bytes if st is not None else 0,
            "pinned_allocs": st.pinned_allocs if st is not None else 0,
        }
