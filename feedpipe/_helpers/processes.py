"""Whether a process is still there: the one check behind stale locks, orphaned temp files and
a worker's watch of its parent."""

from __future__ import annotations

import os
from typing import Any


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as existing); ``False`` for
    anything that is not a positive int (``os.kill(0, ...)`` would test this process group)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
