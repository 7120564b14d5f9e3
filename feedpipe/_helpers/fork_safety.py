"""Whether this process runs threads that make a ``fork`` unsafe (DALI's, while a
:class:`~feedpipe.DaliStage`'s pipeline is alive): every :class:`~feedpipe.FeedLoader` of the
process reads it before it forks worker processes. A forked child does not inherit the threads,
so a mark holds only in the process that made it."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

# (reason, whether the threads still run, the pid that marked)
_marks: list[tuple[str, Callable[[], bool], int]] = []


def mark_process_fork_unsafe(reason: str, running: Callable[[], bool] = lambda: True) -> None:
    """Say that this process runs ``reason`` (threads a forked child could deadlock on) for as
    long as ``running()`` is true."""
    pid = os.getpid()
    if not any(r == reason and p == pid for r, _, p in _marks):
        _marks.append((reason, running, pid))


def process_fork_unsafe() -> str | None:
    """What makes forking from this process unsafe now, or ``None``."""
    pid = os.getpid()
    return next((r for r, running, p in _marks if p == pid and running()), None)


def default_start_method() -> str:
    """The start method worker processes get when nobody chose one (without fixing it, as
    ``multiprocessing.get_start_method()`` would): ``fork`` on Linux before Python 3.14,
    ``forkserver`` from 3.14."""
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen if chosen is not None else multiprocessing.get_all_start_methods()[0]
