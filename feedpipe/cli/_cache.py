"""``feedpipe cache stats|clear [PATH]``: a thin shell over :func:`feedpipe.cache_stats` and
:func:`feedpipe.cache_clear`."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .._helpers.cache_home import cache_home
from .._helpers.sizes import format_size

DESCRIPTION = """\
Show or clear every feedpipe cache tier found under PATH (searched recursively):

  L1 shards          node-local shard cache (FeedDataset cache_dir=): shard entries
  L2 function index  FunctionIndex LMDB directories: memoised entries
  decoded store      memmap stores of transform outputs (FeedDataset decoded_cache=):
                     samples filled of the dataset's samples

stats prints, per tier directory: entries, bytes on disk, and hits/misses where the
tier records them across processes (decoded stores; L1 and L2 count per process only,
see each tier's tier_stats()). With no cache yet under the default root, it says so.

clear never pulls data from under a running job: L1 evicts every shard no process
holds; an L2 index or a decoded store is deleted when no process has it open, else
emptied in place (LMDB entries dropped; decoded records marked unfilled)."""

EPILOG = """\
Exit status: 0 (also when nothing has been cached yet under the default root), or 2
when a PATH given is not a directory.

Examples:
  feedpipe cache stats                      # the default cache root, ~/.cache/feedpipe
  feedpipe cache stats /dev/shm/fp --json
  feedpipe cache clear /scratch/feedpipe-cache"""


def default_root() -> str:
    """``$XDG_CACHE_HOME/feedpipe`` (or ``~/.cache/feedpipe``): where ``cache_dir=True`` and
    ``decoded_cache=True`` put their tiers."""
    return cache_home()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="show or clear the cache tiers (L1 shards, L2 function "
                                     "index, decoded stores) under a directory",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("stats", "clear"),
                   help="stats: describe each tier; clear: empty each tier (see above)")
    p.add_argument("path", metavar="PATH", nargs="?", default=None,
                   help="directory to search (default: $XDG_CACHE_HOME/feedpipe, else "
                        "~/.cache/feedpipe)")
    from ._output import add_json_options

    add_json_options(p, out=True)  # the document: {"path": ..., "tiers": [...]}


def _row(r: Any, root: str) -> list[str]:
    rel = os.path.relpath(r.path, root)
    entries = str(r.entries)
    if "samples" in r.details:
        entries = f"{r.entries}/{r.details['samples']}"
    note = ""
    if r.details.get("leaves"):
        note = ", ".join(r.details["leaves"])
    elif r.details.get("part_bytes"):
        note = f"{format_size(r.details['part_bytes'])} downloading"
    elif r.details.get("in_use"):
        note = "in use"
    return [r.tier, "." if rel == "." else rel, entries, format_size(r.bytes), _count(r.hits),
            _count(r.misses), r.action or "", note]


def _count(v: int | None) -> str:
    return "-" if v is None else str(v)


def run(a: argparse.Namespace) -> int:
    from ..caches._tiers import cache_clear, cache_stats
    from ._output import emit

    root = os.path.abspath(a.path or default_root())
    if a.path is None and not os.path.exists(root):  # a first run: nothing cached yet
        emit(a, {"path": root, "tiers": []},
             f"feedpipe cache {a.action}: {root}\n  no feedpipe cache yet (nothing has been "
             "cached there; FeedDataset(cache_dir=True) and decoded_cache=True put their tiers "
             "there)")
        return 0
    reports = (cache_stats if a.action == "stats" else cache_clear)(root)
    emit(a, {"path": root, "tiers": [r.as_dict() for r in reports]},
         lambda: _table(a.action, root, reports))
    return 0


def _table(action: str, root: str, reports: list[Any]) -> str:
    lines = [f"feedpipe cache {action}: {root}"]
    if not reports:
        return "\n".join([*lines, "  no feedpipe cache found"])
    header = ["tier", "directory", "entries", "on disk", "hits", "misses", "action", "layout/notes"]
    rows = [_row(r, root) for r in reports]
    if action == "stats":
        header, rows = header[:6] + header[7:], [r[:6] + r[7:] for r in rows]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
              for line in [header, *rows]]
    return "\n".join(lines)
