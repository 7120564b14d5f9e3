"""Whole-file advisory locks (``fcntl.flock``) on lock files that may be deleted.

``flock`` locks belong to an open file description: the kernel releases them when the last
descriptor closes, so a killed process never leaves a lock behind. Deleting a lock file while
others wait on it is safe with one rule, applied by :func:`lock`: after the lock is granted, the
path must still name the locked inode; if an unlinker won the race, lock the new file instead.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any

SHARED, EXCLUSIVE = fcntl.LOCK_SH, fcntl.LOCK_EX


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def lock(path: str, mode: int, block: bool = True,
         opener: Callable[..., Any] = os.open) -> int | None:
    """A descriptor of ``path`` (created if missing) holding ``mode``; ``None`` when ``block`` is
    false and the lock is held elsewhere. Release by closing the descriptor.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "x.lock")
        >>> a = lock(p, SHARED); b = lock(p, SHARED); c = lock(p, EXCLUSIVE, block=False)
        >>> (a is not None, b is not None, c)
        (True, True, None)
        >>> os.close(a); os.close(b)
    """
    while True:
        fd = opener(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, mode | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        if same_file(fd, path):
            return fd
        os.close(fd)  # deleted (and maybe re-created) meanwhile: lock the current file


def relock(fd: int, mode: int) -> None:
    """Change the mode of a held lock. Not atomic: the lock is released in between, so check
    what it protects again afterwards (and :func:`same_file`)."""
    fcntl.flock(fd, mode)


class Lease:
    """A lock held until :meth:`release`, on behalf of ``path`` (what it protects)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            # close, never LOCK_UN: in a forked child the descriptor shares the parent's lock,
            # and closing the child's copy leaves the parent's lock alone
            os.close(fd)
