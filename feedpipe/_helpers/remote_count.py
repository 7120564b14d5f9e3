"""The remote requests of this process and the bytes they brought, counted where every remote
call passes (:func:`feedpipe._helpers.retry.call`; a local path or ``file://`` URL read through
fsspec there, as an L1 fill from a local dataset is, is not remote and not counted).

One count per process, not per dataset: a pass's figures are the difference between two reads
(:mod:`feedpipe.stream._io`), so what another dataset of the same process fetched at the same
time is counted with them. Counted per request, never per sample: a request costs a round trip,
against which a locked addition is nothing.

Besides requests and bytes: the retries (attempts after a failed one), the most requests in
flight at once, and the time integral of the requests in flight over the time any was in flight
(``busy``): their ratio is the mean number in flight, and bytes over ``busy`` is what the link
gave this process while it was used.
"""

from __future__ import annotations

import os
import threading
import time


class RemoteCount:
    """Requests made (each attempt, failed ones included), the bytes answered, retries and what
    was in flight.

    Example:
        >>> c = RemoteCount()
        >>> c.note(b"abc"); c.note(None); c.read()
        (2, 3)
        >>> c.begin(); c.begin(); c.end(b"xy", retry=True); c.end(None); c.inflight_max
        2
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0
        self.retries = 0
        self.inflight = 0
        self.inflight_max = 0
        self.busy_ns = 0  # time with at least one request in flight
        self.area_ns = 0  # integral of the requests in flight over time
        self._since = 0

    def _tick(self, now: int) -> None:
        if self.inflight:
            self.busy_ns += now - self._since
            self.area_ns += (now - self._since) * self.inflight
        self._since = now

    def begin(self) -> None:
        """A request leaves."""
        with self._lock:
            self._tick(time.monotonic_ns())
            self.inflight += 1
            self.inflight_max = max(self.inflight_max, self.inflight)

    def end(self, answer: object, *, retry: bool = False) -> None:
        """The request that :meth:`begin` counted came back with ``answer`` (``None``: it
        failed); ``retry``: it was an attempt after a failed one."""
        n = len(answer) if isinstance(answer, (bytes, bytearray, memoryview)) else 0
        with self._lock:
            self._tick(time.monotonic_ns())
            self.inflight = max(0, self.inflight - 1)
            self.requests += 1
            self.bytes += n
            self.retries += retry

    def retried(self) -> None:
        """A request counted on its own came after a failed one counted elsewhere (a range
        that failed among others, asked again alone): a retry."""
        with self._lock:
            self.retries += 1

    def note(self, answer: object) -> None:
        """One request, answered with ``answer`` (its length counted when it is bytes)."""
        n = len(answer) if isinstance(answer, (bytes, bytearray, memoryview)) else 0
        with self._lock:
            self.requests += 1
            self.bytes += n

    def mark(self) -> None:
        """Count the most in flight afresh from now (a new pass)."""
        with self._lock:
            self.inflight_max = self.inflight

    def read(self) -> tuple[int, int]:
        """``(requests, bytes)`` so far in this process."""
        with self._lock:
            return self.requests, self.bytes

    def link(self) -> tuple[int, int, int, int]:
        """``(retries, most in flight, busy ns, in-flight ns)`` so far in this process (the
        time under way counted up to now)."""
        with self._lock:
            self._tick(time.monotonic_ns())
            return self.retries, self.inflight_max, self.busy_ns, self.area_ns


REMOTE = RemoteCount()


def _after_fork() -> None:
    # a forked child inherits the parent's requests under way (their threads did not come with
    # it) and maybe a held lock: it counts its own from here
    REMOTE._lock = threading.Lock()
    REMOTE.inflight = 0
    REMOTE._since = time.monotonic_ns()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
