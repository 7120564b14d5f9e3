"""What a conversion reports when it ends (``feedpipe shard``'s summary, ``--json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ShardSummary:
    """The outcome of :func:`feedpipe.shard` (and :func:`feedpipe.shard_from`).

    ``files`` counts the source files read (for a table source: its rows); ``method`` is the
    conversion method taken (``general``, ``one-pass``, ``table``: see
    :func:`feedpipe.convert._method.choose_method`), ``executor`` what wrote the shards and
    ``why`` why not one pass where it was tried, in words; ``columns`` the column-to-field
    mapping of a table source, one line per column."""

    out: str
    shards: int
    samples: int
    files: int
    bytes: int
    skipped: int
    reused_shards: int
    seconds: float
    files_per_s: float
    mb_per_s: float
    skipped_inputs: list[dict[str, str]] = field(default_factory=list)
    part: str | None = None  # "I/N" of a --part run
    merged: bool = False  # this part found all parts finished and wrote the manifest
    method: str = "general"
    executor: str = ""
    why: str = ""
    columns: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
