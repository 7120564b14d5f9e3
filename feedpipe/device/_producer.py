"""The producer thread of a :class:`~feedpipe.DeviceLoader` pass and the queue it fills."""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ._pass_stats import PassStats

END = object()
"""What the queue holds after the source's last batch."""


class _Failure:
    """An exception raised in the producer thread, carried to the consumer."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _produce(source: Iterator[Any], stage: Callable[[Any], Any] | None, q: queue.Queue,
             stop: threading.Event) -> None:
    """The producer thread: fill ``q`` until the source ends, fails, or ``stop`` is set.

    After the consumer sets ``stop`` it empties the queue once. The one ``put`` this loop may
    still make then finds room, and the loop sees ``stop`` right after: no timeout polling.
    """
    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                q.put(END)
                return
            q.put(batch if stage is None else stage(batch))
            del batch
    except BaseException as e:  # noqa: BLE001 - everything goes to the consumer
        if not stop.is_set():
            q.put(_Failure(e))
    finally:
        close = getattr(source, "close", None)
        if close is not None:  # a generator runs its finally blocks in the thread that ran it
            try:
                close()
            except Exception:  # noqa: BLE001 - the pass is over; nothing is left to report to
                pass


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


class Producer:
    """One pass: the producer thread and its queue of ``depth`` entries.

    Args:
        source: the batches' iterator (created on the caller's thread).
        stage: what the thread does to each batch before queueing it (the
            :class:`~feedpipe.device._stager.PinnedStager` on CUDA); ``None``: nothing.
        depth: batches queued ahead of the consumer.
    """

    def __init__(self, source: Iterator[Any], stage: Callable[[Any], Any] | None,
                 depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=_produce, args=(source, stage, self.queue, self.stop),
                                       name="feedpipe-DeviceLoader", daemon=True)
        self.thread.start()

    def get(self, stats: PassStats) -> Any:
        """The next queued item (:data:`END` after the last batch), the wait counted in
        ``stats``. An exception of the producer is raised here, the same object."""
        if self.closed:
            raise RuntimeError("this DeviceLoader pass was closed (a new pass was started, or "
                               "close() was called)")
        t0 = time.perf_counter()
        item = self.queue.get()
        if item is not END:  # waiting for the end of the source is not waiting for data
            stats.waited(t0, time.perf_counter())
        if isinstance(item, _Failure):
            exc = item.exc
            if hasattr(exc, "add_note"):
                exc.add_note("(raised in the DeviceLoader producer thread while reading the "
                             "source)")
            raise exc  # the same object: its type, message and the producer's traceback
        return item

    def close(self, timeout: float) -> bool:
        """Stop the producer and drop prefetched batches. True when the thread has ended."""
        self.closed = True
        self.stop.set()
        _drain(self.queue)
        self.thread.join(timeout)
        _drain(self.queue)
        if self.thread.is_alive():
            warnings.warn(f"the DeviceLoader producer is still inside the source's next() after "
                          f"{timeout:.0f}s; it is a daemon thread and stops when that returns",
                          RuntimeWarning, stacklevel=3)
            return False
        return True
