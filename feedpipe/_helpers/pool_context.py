"""The worker processes of a conversion: how they start and that they die with their parent."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
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


class _Recorder:
    """The SIGINT handler of :func:`sigint_deferred`: it notes the interrupt, and raises nothing."""

    def __init__(self) -> None:
        self.interrupted = False

    def __call__(self, signum: int, frame: object) -> None:
        self.interrupted = True

    def check(self) -> None:
        """Raise the interrupt noted since the last check, if any."""
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt


@contextmanager
def sigint_deferred(pool: bool = True) -> Iterator[Callable[[], None]]:
    """Within the block, a Ctrl-C is only noted; the function it gives raises it, at a point the
    caller chooses (between two parts, not inside the pool's internals), and the end of the
    block raises one noted since the last check, unless an exception is already on its way.

    A KeyboardInterrupt raised inside ``concurrent.futures`` can leave the pool unable to shut
    down: in ``wait()`` it can leave futures' locks held by this thread, which the pool's manager
    thread then waits for; in the join of ``shutdown()`` CPython takes the still-running manager
    thread for finished. Either way the process hangs after the Ctrl-C instead of exiting.

    Nothing changes with ``pool=False`` (work done in this process stops where the Ctrl-C
    lands), outside the main thread (it gets no signals), or where SIGINT has a handler other
    than Python's default (the program's own, or ignored): the check then does nothing. Blocks
    nest: an inner one shares the outer one's notes."""
    import signal
    import threading

    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, _Recorder):  # nested: the outer block restores and raises
        yield current.check
        return
    if not pool or threading.current_thread() is not threading.main_thread() or \
            current is not signal.default_int_handler:
        yield lambda: None
        return
    recorder = _Recorder()
    signal.signal(signal.SIGINT, recorder)
    try:
        yield recorder.check
    finally:
        signal.signal(signal.SIGINT, current)
    if sys.exc_info()[1] is None:  # not while an exception is handled: the run stops anyway
        recorder.check()


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


class InterruptedAfterCommit(KeyboardInterrupt):
    """A Ctrl-C that came after the work reached its commit point (:class:`CommitPoint`): the
    work is complete and nothing is to be resumed. ``result`` is what the work returned, where
    it got that far (else ``None``)."""

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class CommitPoint:
    """Used as ``with CommitPoint(what) as cp:``. Until :meth:`reached` a Ctrl-C raises where it
    lands, as usual; from the call on (the moment the work is complete, e.g. just before its
    manifest is written) it is only noted, and the end of the block raises a noted one as
    :class:`InterruptedAfterCommit` carrying ``cp.result`` and ``what`` in its message.

    So a Ctrl-C that comes while a finished conversion writes its manifest, tidies up, releases
    its lock or prints its summary is not reported as an interrupted conversion (which would
    send the user to redo it). Nothing is deferred outside the main thread, or where SIGINT has
    a handler other than Python's default (the program's own, or ignored); blocks nest (an inner
    one does nothing)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.result: Any = None
        self._recorder: _Recorder | None = None
        self._old: Any = None

    def __enter__(self) -> CommitPoint:
        return self

    def reached(self) -> None:
        """From now on the work is complete: a Ctrl-C is noted, not raised."""
        import signal
        import threading

        if self._recorder is not None or \
                threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        if current is not signal.default_int_handler:  # (a _Recorder: an outer block defers)
            return
        self._recorder = _Recorder()
        self._old = signal.signal(signal.SIGINT, self._recorder)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        import signal

        if self._recorder is None:
            return
        signal.signal(signal.SIGINT, self._old)
        noted, self._recorder = self._recorder.interrupted, None
        if noted and exc is None:
            raise InterruptedAfterCommit(f"{self.what} was complete when the Ctrl-C came: "
                                         "nothing to resume", self.result)
