"""One GET for a small object that two readers of one process ask for at the same moment.

A shard's index is wanted twice at the start of a remote epoch: by the fill that caches the
shard (:meth:`feedpipe.caches.l1._entry.Entry.fill`) and by the first batch's reads by byte range
(:mod:`feedpipe.caches._early`), which need its offsets. :func:`joined` lets the second caller
wait for the first one's request rather than send its own. Only requests *under way* are
shared: once one is answered it is forgotten, so nothing read earlier (perhaps from an object
since replaced) is ever handed out, and a caller that must see the object anew (a fill fetching
an index again after its check failed) calls the fetch itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_under_way: dict[str, Future[object]] = {}


def _forked() -> None:
    """A forked child has none of its parent's threads: nothing of theirs is under way here,
    and the lock may have been copied held."""
    global _lock
    _lock = threading.Lock()
    _under_way.clear()


os.register_at_fork(after_in_child=_forked)


def joined(key: str, fetch: Callable[[], T]) -> T:
    """``fetch()``, or the result (or error) of the same ``key``'s fetch already under way in
    another thread of this process.

    Example:
        >>> joined("https://h/a.idx", lambda: b"1")
        b'1'
    """
    with _lock:
        theirs = _under_way.get(key)
        if theirs is None:
            mine: Future[object] = Future()
            _under_way[key] = mine
    if theirs is not None:
        return theirs.result()  # type: ignore[return-value]
    try:
        value = fetch()
    except BaseException as e:
        mine.set_exception(e)
        raise
    else:
        mine.set_result(value)
        return value
    finally:
        with _lock:
            if _under_way.get(key) is mine:
                del _under_way[key]
