"""Torch's intra-op threads, held to one while per-image work runs."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager

import torch

_ONE_THREAD_LOCK = threading.Lock()
_one_thread_users = 0
_saved_threads = 0


class _OneThread:
    """:func:`one_thread`'s context manager: a class, not a generator, since it wraps every
    image, and a generator-based one costs more to enter and leave."""

    __slots__ = ("counted",)

    def __enter__(self) -> None:
        global _one_thread_users, _saved_threads
        self.counted = not (torch.get_num_threads() == 1 and _one_thread_users == 0)
        if not self.counted:
            return
        with _ONE_THREAD_LOCK:
            if _one_thread_users == 0:
                _saved_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            _one_thread_users += 1

    def __exit__(self, *exc: object) -> None:
        global _one_thread_users
        if not self.counted:
            return
        with _ONE_THREAD_LOCK:
            _one_thread_users -= 1
            if _one_thread_users == 0:
                torch.set_num_threads(_saved_threads)


def one_thread() -> AbstractContextManager[None]:
    """Run torch ops on the calling thread only, for the duration.

    One image is too little work to split over torch's intra-op threads. With
    ``num_workers=0`` they only add fork-join overhead. On a busy machine (more runnable threads
    than cores) their barriers slow the image pipeline down several times
    (``benchmarks/bench_peers.py``). DataLoader workers already run with one thread; this is a
    no-op there. The setting is process-wide, so nested and concurrent users (a DeviceLoader
    thread, probe threads) are counted: the first sets one thread, the last restores the count
    it found.

    Example:
        >>> import torch
        >>> with one_thread():
        ...     torch.get_num_threads()
        1
    """
    return _OneThread()
