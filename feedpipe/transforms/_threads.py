"""Torch's intra-op threads, held to one while per-image work runs."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager

import torch

_ONE_THREAD_LOCK = threading.Lock()
_one_thread_users = 0
_saved_threads = 0


_HELD = threading.local()  # .counted: this thread is inside a counted one_thread() context


class _OneThread:
    """:func:`one_thread`'s context manager: a class, not a generator, since it wraps every
    image, and a generator-based one costs more to enter and leave.

    Inside a context of the same thread that holds the count, a context does nothing: the
    outer one keeps torch at one thread until it ends, after the inner one (contexts of one
    thread nest). So a caller that enters it once for a batch makes each image's own entry
    nearly free."""

    __slots__ = ("counted",)

    def __enter__(self) -> None:
        global _one_thread_users, _saved_threads
        if _one_thread_users == 0 and torch.get_num_threads() == 1:  # nothing to hold
            self.counted = False
            return
        if getattr(_HELD, "counted", False):  # held by an outer context of this thread
            self.counted = False
            return
        self.counted = True
        with _ONE_THREAD_LOCK:
            if _one_thread_users == 0:
                _saved_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            _one_thread_users += 1
        _HELD.counted = True

    def __exit__(self, *exc: object) -> None:
        global _one_thread_users
        if not self.counted:
            return
        _HELD.counted = False
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
