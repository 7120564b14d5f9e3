"""Passes a script leaves unfinished are closed at exit, while their modules still exist.

A training script that stops reading mid-epoch and exits holding the iterator (a ``break`` at
module level, an evaluation cut short) leaves a suspended generator whose clean-up (ending the
pass, releasing shards, counting the bytes read) runs when the interpreter tears down. By then
the modules it calls into may have had their names cleared, and each such generator printed an
"Exception ignored" traceback. An ``atexit`` handler runs before that teardown: every pass still
open is closed there, its clean-up complete. Registered on the first pass, never at import.

A ``DataLoader`` worker (the loader's worker routes run in them too) does not close its passes:
it leaves when its parent says or goes, its pass is the parent's to end, and closing it there
could wait on a parent that is gone. Passes a forked child inherited are not its own either.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

from .._redact import logger

log = logger("feedpipe")

It = TypeVar("It", bound=Iterator[Any])

_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # generators
_registered = False
_pid = 0  # the process that registered them


def closed_at_exit(gen: It) -> It:
    """``gen`` (a generator), to be closed at interpreter exit if it is still open then."""
    global _registered, _pid
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:  # a DataLoader worker: see above
        return gen
    if not _registered:
        atexit.register(close_open)
        _registered, _pid = True, os.getpid()
    _OPEN.add(gen)
    return gen


def close_open() -> None:
    """Close every pass still open (the ``atexit`` handler)."""
    if os.getpid() != _pid:  # a fork's copy of another process's passes
        return
    for gen in list(_OPEN):
        try:
            gen.close()
        except ValueError:  # being iterated by another thread right now: it ends with it
            pass
        except Exception as e:  # noqa: BLE001 - exit goes on; the failure is said
            log.warning("feedpipe: closing a pass left unfinished at exit failed: %s: %s",
                        type(e).__name__, e)
