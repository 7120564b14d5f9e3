"""``feedpipe ledger DIR``: check a training run's delivery ledger (``FeedLoader(ledger=DIR)``)."""

from __future__ import annotations

import argparse
from typing import Any

from ._output import add_json_options, emit

_EXAMPLES = """\
Exit status 0 when every finished epoch delivered every sample exactly once (padding,
drop_last's drops and samples the transform skipped aside), every part is readable and no
rank's part is missing; 1 otherwise; 2 when DIR holds no ledger. An epoch is finished when every
rank reached the end of its share, or when the job went on to a later epoch (a loop that left it
early, a resume followed by set_epoch of a later epoch): what it did not deliver is lost. A
restart from an older checkpoint than one saved since (or from one whose save never completed)
is a rollback: named under "replays", it fails nothing. A Mixture's epoch holds each sample of a
source as many times as its plan draws it (a source drawn more than its size repeats samples, one
drawn less leaves some out): a repeat is a delivery beyond that, a loss one short of it, and both
are also named per source. A Packed's ids are its epoch's rows, recomputed from the documents'
lengths the ledger holds: a lost or repeated row is named by the pieces of documents it holds,
so every token of the epoch is proved once (padding rows count as padding). A VideoClips' ids
are its epoch's clips (video * clips_per_video + clip), each once: a lost or repeated one is
named by its (video, clip).

The JSON document (--json; every id is listed, the text shows the first 5):
  "ledger": DIR, "samples": samples the dataset has (a mixture's sources together),
  "ok": the verdict, "mixture" (a Mixture's ledger only): {"sources", "sizes", "draws": each
      source's samples an epoch, "epoch_size"}, "packed" (a Packed's ledger only): {"seq_len",
      "packing": the strategy's name, "field", "documents", "tokens"}, "clips" (a VideoClips'
      ledger only): {"videos", "clips_per_video", "frames", "stride", "fps"},
  "runs": [{"run", "host", "pid", "rank", "lineage", "resumed_from": the state's mark or null,
            "marks": [[epoch, position] of each state saved]}],
  "replays": [{"origin", "runs": [saved the later state, restarted], "why"}],
  "unreadable": [{"part", "why"}], "missing": [{"lineage", "why"}]: parts lost (a gap in a
      run's numbered parts, a resumed state no part here recorded saving), "notes": [sentences
      that fail nothing],
  "epochs": [{"epoch", "finished", "why_finished", "parts", "delivered", "distinct",
      "expected": deliveries the epoch holds, "skipped": {"count", "ids"}, "rolled_back",
      "padding", "dropped", "repeats": {"count", "ids", "parts"}, "losses": {"count", "ids",
      "parts"} or null (an epoch under way); a mixture's findings add "sources": {name: ids
      within that source, one found twice (two draws lost) listed twice}; a Packed's (ids are
      rows) add "pieces": [[document, start, length] of each row's tokens] and "tokens"; a
      VideoClips' add "clips": [[video, clip] of each id, a repeat as often as found],
      "missing": [{"rank", "world_size", "lineage", "runs", "why"}],
      "exactly_once"}]

Examples:
  feedpipe ledger runs/ledger
  feedpipe ledger runs/ledger --json | jq '.epochs[] | {epoch, exactly_once}'
  feedpipe ledger runs/ledger --json-out ledger-report.json"""


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
