"""Where the cache tiers live by default: the one place that reads ``XDG_CACHE_HOME``."""

from __future__ import annotations

import os


def cache_home(*parts: str) -> str:
    """``$XDG_CACHE_HOME/feedpipe/<parts>`` (or ``~/.cache/feedpipe/<parts>``), read when called.

    Example:
        >>> cache_home("shards").endswith(os.path.join("feedpipe", "shards"))
        True
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "feedpipe", *parts)
