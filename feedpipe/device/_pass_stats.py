"""The consumer-side timings of one :class:`~feedpipe.DeviceLoader` pass."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class PassStats:
    """Consumer-side timings of one pass. Host clock only; the loader reads the GPU events of
    ``gpu_pending`` in its ``stats()``."""

    steps: int = 0
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    max_wait_s: float = 0.0
    t_start: float | None = None  # the first next() was entered
    t_first: float | None = None  # the first batch was handed out
    t_last: float | None = None  # the last batch was handed out
    gpu_wait_ms: float = 0.0
    gpu_pending: collections.deque = field(default_factory=collections.deque)

    def waited(self, t0: float, t1: float) -> None:
        """The loop waited for data from ``t0`` to ``t1``."""
        w = t1 - t0
        if self.t_start is None:
            self.t_start, self.t_first, self.first_wait_s = t0, t1, w
        self.wait_s += w
        self.max_wait_s = max(self.max_wait_s, w)
