"""``feedpipe ledger DIR``: check a training run's delivery ledger (``FeedLoader(ledger=DIR)``)."""

from __future__ import annotations

import argparse
from typing import Any

from ._output import add_json_options, emit

_EXAMPLES = """\
Exit status 0 when every finished epoch delivered every sample exactly once (padding and
drop_last's drops aside) and no checkpoint was resumed twice; 1 otherwise; 2 when DIR holds no
ledger. The JSON document: {"ledger", "samples", "ok", "runs", "replays", "unreadable",
"epochs": [{"epoch", "finished", "delivered", "distinct", "rolled_back", "padding", "dropped",
"repeats": {"count", "ids", "parts"}, "losses": {...} or null, "exactly_once"}]}.

Examples:
  feedpipe ledger runs/ledger
  feedpipe ledger runs/ledger --json | jq '.epochs[] | {epoch, exactly_once}'"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ledger", help="prove a training run exactly-once from its delivery ledger",
        description="Read the ledger FeedLoader(ledger=DIR) wrote over every run, stop and\n"
                    "resume of a training job, and say for each epoch which sample ids were\n"
                    "delivered twice and, for finished epochs, which were never delivered.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="the directory given as FeedLoader(ledger=DIR)")
    add_json_options(p, out=True)


def run(a: argparse.Namespace) -> int:
    from ..stream._ledger_check import check_ledger, ledger_text

    report = check_ledger(a.dir)
    emit(a, report, lambda: ledger_text(report))
    return 0 if report["ok"] else 1
