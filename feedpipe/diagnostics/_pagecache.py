"""The page cache as the probe sees it: how much of a file is resident, and dropping a file's pages
so that the next read of it is cold.

Both work without privileges. ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops the *clean* cached pages
of a file that any reader may drop; ``mincore(2)`` on a read-only shared mapping reports which pages
of the file are resident. Dirty pages (a file still being written) are not dropped, which is why
the probe measures residency after a drop instead of assuming it. On platforms without these calls
:func:`can_drop` is false and :func:`resident_fraction` returns ``None``: figures are then labelled
as of unknown cache state, never as cold.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from typing import Any

_PROT_READ = 1
_MAP_SHARED = 1
_WINDOW = 1 << 30  # mincore one GiB of mapping at a time: 256 Ki entries of vector
_lib: Any = None


def can_drop() -> bool:
    """Whether this platform can drop a file's pages (``posix_fadvise`` with ``DONTNEED``)."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def drop_fd(fd: int, offset: int = 0, length: int = 0) -> bool:
    """Drop the clean cached pages of ``[offset, offset + length)`` of an open file (``length``
    0: to the end). Returns whether the hint was given."""
    if not can_drop():
        return False
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def advise_random(fd: int, random: bool) -> None:
    """Turn the kernel's readahead off (``random``) or back to normal for ``fd``: a random-read
    latency must not be served by the readahead of the previous read."""
    if hasattr(os, "posix_fadvise"):
        advice = os.POSIX_FADV_RANDOM if random else os.POSIX_FADV_NORMAL
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass


def _libc() -> Any:
    global _lib
    if _lib is None:
        if not sys.platform.startswith("linux"):
            _lib = False
            return _lib
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_ubyte)]
            _lib = lib
        except (OSError, AttributeError):
            _lib = False
    return _lib


def _resident_pages(lib: Any, fd: int, offset: int, length: int) -> int:
    import numpy as np

    addr = lib.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, offset)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
        if lib.mincore(ctypes.c_void_p(addr), length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int((np.ctypeslib.as_array(vec) & 1).sum())
    finally:
        lib.munmap(ctypes.c_void_p(addr), length)


def resident_fraction(
    files: Sequence[tuple[str, int]], *, limit: int | None = 8 << 30
) -> float | None:
    """The fraction of the first ``limit`` bytes of ``files`` (``(path, size)`` pairs, taken in
    order, as one concatenation) that is in the page cache; ``None`` where it cannot be told."""
    lib = _libc()
    if not lib:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    want = resident = 0
    budget = limit if limit is not None else sum(s for _, s in files)
    try:
        for path, size in files:
            if budget <= 0:
                break
            size = min(size, budget)
            if size <= 0:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                for off in range(0, size, _WINDOW):
                    n = min(_WINDOW, size - off)
                    resident += _resident_pages(lib, fd, off, n)
                    want += (n + page - 1) // page
            finally:
                os.close(fd)
            budget -= size
    except OSError:
        return None
    return resident / want if want else None
