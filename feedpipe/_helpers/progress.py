"""Progress bars: shown on a terminal, silent otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys
from typing import Any


class _Null:
    shown = False  # (a caller may skip counting what it would only hand to update)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int | None, desc: str, unit: str = "it", enabled: bool | None = None) -> Any:
    """A tqdm bar on stderr when it is a terminal (or ``enabled=True``), else a no-op."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _Null()
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: we fork worker processes
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True,
                file=sys.stderr)
