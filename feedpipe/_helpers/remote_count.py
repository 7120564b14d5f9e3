"""The remote requests of this process and the bytes they brought, counted where every remote
call passes (:func:`feedpipe._helpers.retry.call`; a local path or ``file://`` URL read through
fsspec there, as an L1 fill from a local dataset is, is not remote and not counted).

One count per process, not per dataset: a pass's figures are the difference between two reads
(:mod:`feedpipe.stream._io`), so what another dataset of the same process fetched at the same
time is counted with them. Counted per request, never per sample: a request costs a round trip,
against which a locked addition is nothing.
"""

from __future__ import annotations

import threading


class RemoteCount:
    """Requests made (each attempt, failed ones included) and the bytes answered.

    Example:
        >>> c = RemoteCount()
        >>> c.note(b"abc"); c.note(None); c.read()
        (2, 3)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0

    def note(self, answer: object) -> None:
        """One request, answered with ``answer`` (its length counted when it is bytes)."""
        n = len(answer) if isinstance(answer, (bytes, bytearray, memoryview)) else 0
        with self._lock:
            self.requests += 1
            self.bytes += n

    def read(self) -> tuple[int, int]:
        """``(requests, bytes)`` so far in this process."""
        with self._lock:
            return self.requests, self.bytes


REMOTE = RemoteCount()
