"""What a probe measures and for how long."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BLOCKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
DEFAULT_THREADS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ProbeSettings:
    """What to measure and for how long; checked on construction (``ValueError``)."""

    duration: float = 5.0  # seconds per phase
    block_sizes: tuple[int, ...] = DEFAULT_BLOCKS
    threads: tuple[int, ...] = DEFAULT_THREADS
    random_block: int = 4096
    batch_size: int = 64
    workers: int | None = None  # DataLoader workers the verdict plans for (default: CPUs)
    step_time_ms: float | None = None
    # the FeedLoader runs: each route (None: the loader's own choice, as a script gets it)
    routes: tuple[str | None, ...] = (None,)
    price_per_gb: float | None = None  # remote bytes, per 10^9
    price_per_1k_requests: float | None = None

    def __post_init__(self) -> None:
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be a positive number of seconds, not {self.duration}")
        if not self.block_sizes or any(b < 512 for b in self.block_sizes):
            raise ValueError(f"block sizes must be at least 512 bytes: {self.block_sizes}")
        if not self.threads or any(t < 1 or t > 256 for t in self.threads):
            raise ValueError(f"thread counts must be between 1 and 256: {self.threads}")
        if self.random_block < 512:
            raise ValueError(f"random read block must be at least 512 bytes: {self.random_block}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be at least 1, not {self.batch_size}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be 0 or more, not {self.workers}")
        for name, price in (("price per GB", self.price_per_gb),
                            ("price per 1k requests", self.price_per_1k_requests)):
            if price is not None and not (price >= 0 and math.isfinite(price)):
                raise ValueError(f"{name} must be 0 or more, not {price}")
        if self.step_time_ms is not None and not self.step_time_ms > 0:
            raise ValueError(f"step time must be a positive number of ms, not {self.step_time_ms}")
