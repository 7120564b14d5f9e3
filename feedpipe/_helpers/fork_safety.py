"""Whether this process runs threads that make a ``fork`` unsafe (DALI's, once a
:class:`~feedpipe.DaliStage` has built its pipeline): every :class:`~feedpipe.FeedLoader` of the
process reads it before it forks worker processes. A forked child does not inherit the threads,
so the mark holds only in the process that made it."""

from __future__ import annotations

import multiprocessing
import os

_reason: str | None = None
_pid = 0


def mark_process_fork_unsafe(reason: str) -> None:
    """Say that this process now runs ``reason`` (threads a forked child could deadlock on)."""
    global _reason, _pid
    _reason, _pid = reason, os.getpid()


def process_fork_unsafe() -> str | None:
    """What makes forking from this process unsafe, or ``None``."""
    return _reason if _pid == os.getpid() else None


def default_start_method() -> str:
    """The start method worker processes get when nobody chose one (without fixing it, as
    ``multiprocessing.get_start_method()`` would): ``fork`` on Linux before Python 3.14,
    ``forkserver`` from 3.14."""
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen if chosen is not None else multiprocessing.get_all_start_methods()[0]
