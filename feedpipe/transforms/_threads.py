"""Torch's intra-op threads, held to one while per-image work runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_ONE_THREAD_LOCK = threading.Lock()
_one_thread_users = 0
_saved_threads = 0


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
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
    global _one_thread_users, _saved_threads
    if torch.get_num_threads() == 1 and _one_thread_users == 0:
        yield
        return
    with _ONE_THREAD_LOCK:
        if _one_thread_users == 0:
            _saved_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        _one_thread_users += 1
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            _one_thread_users -= 1
            if _one_thread_users == 0:
                torch.set_num_threads(_saved_threads)
