"""The worker processes of a conversion: how they start and that they die with their parent."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def pool_context() -> Any:
    """The multiprocessing context of conversion pools: ``fork`` where there is one (workers
    inherit the plan instead of unpickling it), else ``spawn``."""
    import multiprocessing as mp

    return mp.get_context("fork" if os.name == "posix" and "fork" in mp.get_all_start_methods()
                          else "spawn")


@contextmanager
def sigint_held() -> Iterator[None]:
    """Hold SIGINT blocked in this thread while the block starts a pool's worker processes: they
    inherit the mask (across fork, and across the exec of spawn), so a Ctrl-C that reaches one
    before its initializer (:func:`die_with_parent`) has made it ignore SIGINT stays pending
    and is then discarded, instead of killing it with a traceback during start-up. This
    process takes the interrupt when the block ends."""
    import signal
    import threading

    if not hasattr(signal, "pthread_sigmask") or \
            threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def die_with_parent(parent: int) -> None:
    """Pool initializer: a worker must not outlive a killed parent, or it would go on writing
    parts into OUT behind the back of a resumed run (and linger forever on its task queue).

    It also ignores SIGINT. A terminal's Ctrl-C reaches the whole process group: a worker that
    took it would print its own KeyboardInterrupt traceback, and could die holding the lock of
    the pool's shared result queue, so that the other workers, and the parent shutting the pool
    down, wait on it forever. The parent alone handles the interrupt: it cancels what has not
    started, lets the running tasks finish (each writes a temp file, so nothing half-done is
    ever visible) and exits."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # started under sigint_held: a pending one is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
