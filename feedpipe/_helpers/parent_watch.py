"""A process that must not outlive the one it works for: a thread that ends it when that one exits.

For DataLoader worker processes. torch's own watchdog looks at the parent only between two tasks,
and then leaves through multiprocessing's exit, which waits for the data queue's feeder thread;
that thread is blocked for good writing a batch larger than the pipe into a pipe nobody reads any
more (raw sample bytes), so the worker would linger, holding its parent's stderr, until killed.
``PR_SET_PDEATHSIG`` is not used: it fires when the parent *thread* that started the worker
ends, which kills persistent workers started from a loader's background thread.
"""

from __future__ import annotations

import os
import threading

from .processes import pid_alive

_watching: tuple[int, frozenset[int]] | None = None  # (this process, the owners it watches)


def exit_with(*owners: int) -> None:
    """End this process (``os._exit``) as soon as one of processes ``owners`` has exited; once
    per process, from a daemon thread that waits on pidfds (Linux), else polls.

    Nothing of this process runs after an owner is gone: no exit handler, no flush. What it
    had not handed over is lost with the owner that would have received it.
    """
    global _watching
    me = os.getpid()
    watched = frozenset(owners) - {me, 0, 1}
    if not watched or _watching == (me, watched):
        return
    _watching = (me, watched)
    fds: list[int] | None = []
    for owner in watched:
        try:
            fds.append(os.pidfd_open(owner))  # type: ignore[union-attr]
        except ProcessLookupError:
            os._exit(1)
        except (AttributeError, OSError):  # not Linux, or a kernel before 5.3: poll
            fds = None
            break
    threading.Thread(target=_watch, args=(watched, fds), name="feedpipe-exit-with-parent",
                     daemon=True).start()


def _watch(owners: frozenset[int], fds: list[int] | None) -> None:
    if fds is not None:
        import select

        select.select(fds, [], [])  # one is readable once its process has exited
    else:
        import time

        while all(pid_alive(owner) for owner in owners):
            time.sleep(0.5)
    os._exit(1)

