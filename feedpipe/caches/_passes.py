"""When a cache re-reads the fingerprint of the transform it keys values by: at each pass.

A transform's state may change between passes (progressive resizing raises an
``ImagePipeline``'s size from one epoch to the next): the L2 function index and the decoded store
must then key by the new state, never serve the old one's values. Fingerprinting walks
everything the transform holds, which costs many times a memo hit for an object transform, so
it is not done per sample while a pass runs. The
batch loop marks each pass of this process (:func:`begin_pass` / :func:`end_pass`, in every
worker process too); a cache re-reads the fingerprint when it first sees a new pass, and on
every call while no pass runs (a memoised function called by hand).

**What this cannot see**: a change made to a transform *during* a pass, in the same process
(the training loop's body runs while its loader's pass is open): until the pass ends, values are
looked up under the state the pass began with. The decoded store finds the change at the pass's
end and empties the records this process wrote in it
(:meth:`~feedpipe.caches.decoded._store.DecodedStore.end_pass`); the function index cannot, and
keeps the entries that process computed after the change under the old state's key. Change a
transform between epochs. Workers hold their own copy of the transform: with
``persistent_workers=True`` they never see a change made in the training process (as with any
DataLoader), and they key by the state they compute with.
"""

from __future__ import annotations

import itertools
import threading

_numbers = itertools.count(1)
_lock = threading.Lock()
_open: list[int] = []  # the passes running in this process, by number


def begin_pass() -> int:
    """Mark the start of a pass in this process; returns its number."""
    with _lock:
        n = next(_numbers)
        _open.append(n)
        return n


def end_pass(n: int) -> None:
    """Mark the end of pass ``n``."""
    with _lock:
        if n in _open:
            _open.remove(n)


def current() -> int | None:
    """The number of the latest pass that is still running in this process, or ``None`` when
    none is (then a cache re-reads a fingerprint at every call)."""
    return _open[-1] if _open else None
