"""OpenCV, imported on first use and run on the calling thread."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from typing import Any

_CV2: Any = None  # the cv2 module once looked up; False when it does not import


def opencv() -> Any:
    """The ``cv2`` module, or ``None`` where it does not import; imported on first use.

    OpenCV is switched to run on the calling thread (``cv2.setNumThreads(0)``, process-wide).
    One image is too little work to split, and a thread pool started in the parent is a known
    hazard for the DataLoader workers forked after it.
    """
    global _CV2
    if _CV2 is None:
        try:
            import cv2
        except ImportError:
            _CV2 = False
        else:
            cv2.setNumThreads(0)
            _CV2 = cv2
    return _CV2 or None


# -- stderr while OpenCV decodes ------------------------------------------------------------
# OpenCV's PNG decoder lets libpng print its errors ("libpng error: IDAT: incorrect data
# check") and logs its own warnings, all on the process's stderr, for an image feedpipe then
# reports itself as a DecodeError. Those lines come from C, so only the file descriptor can
# catch them: fd 2 points to a capture file while any thread decodes, and what was written
# there meanwhile goes back to stderr afterwards, all but those decoders' lines (another
# thread's log record, say, is delayed, never lost).
_QUIET = threading.Lock()
_depth = 0
_saved = -1
_capture: tuple[int, Any] | None = None  # (pid, file): a forked child makes its own
_DECODER_LINE = re.compile(rb"^(libpng (error|warning)|\[ ?(WARN|ERROR|INFO|DEBUG):[^\]]*\] "
                           rb"global )")


class _QuietStderr:
    """Keep the decoders' own lines off stderr (fd 2) for the duration (see above); nested and
    concurrent uses share one redirection. A class, not a generator: it wraps every decode."""

    __slots__ = ("quiet",)

    def __enter__(self) -> None:
        global _depth
        with _QUIET:
            self.quiet = _depth > 0 or _redirect()  # False: no fd 2 to redirect, as it is
            if self.quiet:
                _depth += 1

    def __exit__(self, *exc: object) -> None:
        global _depth
        if self.quiet:
            with _QUIET:
                _depth -= 1
                if _depth == 0:
                    _restore()


def quiet_stderr() -> _QuietStderr:
    """A context manager that keeps the decoders' own lines off stderr (see above)."""
    return _QuietStderr()


def _redirect() -> bool:
    global _saved, _capture
    try:
        if _capture is None or _capture[0] != os.getpid():
            _capture = (os.getpid(), tempfile.TemporaryFile())
        sys.stderr.flush()
        _saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        return False
    try:
        os.dup2(_capture[1].fileno(), 2)
    except OSError:
        os.close(_saved)
        return False
    return True


def _restore() -> None:
    global _saved
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    os.dup2(_saved, 2)
    os.close(_saved)
    _saved = -1
    if _capture is None:
        return
    fd = _capture[1].fileno()
    if os.lseek(fd, 0, os.SEEK_END) == 0:
        return
    os.lseek(fd, 0, os.SEEK_SET)
    written = b""
    while chunk := os.read(fd, 1 << 16):
        written += chunk
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    kept = b"".join(_not_the_decoders(written.splitlines(keepends=True)))
    if kept:
        os.write(2, kept)


def _not_the_decoders(lines: list[bytes]) -> list[bytes]:
    """``lines`` without the decoders' own: each line such a message starts with, and the blank
    lines that end it (OpenCV's error messages end in a newline of their own, which its logger
    follows with another)."""
    kept: list[bytes] = []
    theirs = False
    for line in lines:
        if _DECODER_LINE.match(line):
            theirs = True
        elif not (theirs and not line.strip()):
            theirs = False
            kept.append(line)
    return kept
