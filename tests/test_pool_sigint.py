"""A Ctrl-C that reaches a conversion pool's worker before its initializer has told it to ignore
SIGINT (during the interpreter's start-up, or CPython's fork hooks) must not kill it with a
traceback: the parent holds SIGINT blocked while it starts workers, they inherit the mask, and
the initializer ignores SIGINT before it unblocks it, so an early interrupt is discarded."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from concurrent.futures import ProcessPoolExecutor

import pytest

from feedpipe._helpers.pool_context import die_with_parent, sigint_held


def interrupted_early(parent: int) -> None:
    """The initializer, after a Ctrl-C arrived before it ran."""
    os.kill(os.getpid(), signal.SIGINT)
    die_with_parent(parent)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_interrupt_before_the_initializer_does_not_kill_a_worker(method: str) -> None:
    if method not in mp.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    with ProcessPoolExecutor(1, mp_context=mp.get_context(method), initializer=interrupted_early,
                             initargs=(os.getpid(),)) as pool:
        with sigint_held():
            fut = pool.submit(os.getpid)
        assert fut.result(timeout=120) != os.getpid()
