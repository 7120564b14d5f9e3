"""Keeping a conversion's listing out of the garbage collector's full collections."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen() -> Iterator[None]:
    """Keep the objects alive now out of the cyclic garbage collector's full collections until
    the block ends (``gc.freeze()``).

    A conversion's listing is three objects per input file, none garbage. Every full collection
    that the parent's later allocations trigger would walk them again
    (``benchmarks/bench_convert.py --profile``). Nothing is done when the caller has frozen
    objects itself (this would unfreeze them) or has turned the collector off. The collector is
    process-wide: objects another thread freezes during a conversion are unfrozen with the
    listing at its end. They stay alive either way; only their collection is deferred."""
    global _ours
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _ours = True
    try:
        yield
    finally:
        _ours = False
        gc.unfreeze()


_ours = False  # a frozen() block of this module is under way


def refreeze() -> None:
    """Within :func:`frozen`, freeze what was allocated since: a listing being built grows by
    objects that are none of them garbage, and each full collection while it grows would walk
    all of it again (quadratic in the rows of a table). Outside :func:`frozen`, nothing."""
    if _ours and gc.isenabled():
        gc.freeze()
