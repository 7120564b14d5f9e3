"""The ``feedpipe`` command: a thin shell over the library functions of the same names."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .._redact import redact
from ..errors import FeedpipeError
from ._formats import (
    add_index,
    add_merge,
    add_shard,
    add_verify,
    cmd_index,
    cmd_merge,
    cmd_shard,
    cmd_verify,
)
from ._output import Parser, add_json_options, emit, parse_size, print_json
from ._probe import add_probe, cmd_probe

__all__ = ["build_parser", "main", "parse_size"]


def _cmd_demo(a: argparse.Namespace) -> int:
    from ._demo import demo

    def to_stderr(*x: Any) -> None:  # under --json the running commentary is progress
        print(*x, file=sys.stderr, flush=True)

    r = demo(workdir=a.workdir, keep=a.keep, print_fn=to_stderr if a.json else print)
    emit(a, r, None)
    return 0 if r["exactly_once"] else 1


def _cmd_cache(a: argparse.Namespace) -> int:
    from ._cache import run

    return run(a)


def _cmd_ledger(a: argparse.Namespace) -> int:
    from ._ledger import run

    return run(a)


_DEMO_EXAMPLES = """\
The JSON document: {"workdir", "kept", "samples", "shards", "streamed", "epochs",
"exactly_once", "tiers": {"l1", "decoded", "l2"}, "device"}.

Examples:
  feedpipe demo
  feedpipe demo --workdir ./feedpipe-demo     # keep the images, shards and caches to look at
  feedpipe demo --json | jq .exactly_once     # the figures as JSON; the commentary on stderr"""


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(
        prog="feedpipe",
        description="feedpipe keeps GPUs fed: shard small-file datasets, stream them "
                    "deterministically to every rank and worker, cache, and deliver batches.",
    )
    parser.add_argument("--version", action="version", version=f"feedpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.set_defaults(subcommand_parsers=sub.choices)  # each subcommand's parser, for its usage
    add_shard(sub)
    add_merge(sub)
    add_index(sub)
    add_verify(sub)
    p = sub.add_parser("demo", help="run the whole pipeline on a small synthetic dataset",
                       description="Make a small synthetic image dataset in a temp dir, shard it,\n"
                                   "stream it, and print what happened. Exit status 1 if an\n"
                                   "epoch did not deliver every sample exactly once.",
                       epilog=_DEMO_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None,
                   help="where to work, kept afterwards (default: a temp dir, removed); a "
                        "directory an earlier demo used is reused: its images/, shards/ and "
                        "cache directories are made anew")
    p.add_argument("--keep", action="store_true", help="keep the temp work directory")
    add_json_options(p, out=True)
    add_probe(sub)
    from ._cache import add_parser as _add_cache

    _add_cache(sub)
    from ._ledger import add_parser as _add_ledger

    _add_ledger(sub)
    return parser


_COMMANDS = {"shard": cmd_shard, "merge": cmd_merge, "index": cmd_index, "verify": cmd_verify,
             "demo": _cmd_demo, "probe": cmd_probe, "cache": _cmd_cache,
             "ledger": _cmd_ledger}


# what to do after a Ctrl-C, where there is something to do
_INTERRUPTED = {"shard": "interrupted; the shards committed so far are kept: rerun the same "
                         "command with --resume to finish"}


def _failed(args: argparse.Namespace, e: BaseException, message: str, status: int) -> int:
    """Say what went wrong on stderr and, under ``--json``, as a JSON record on stdout."""
    message = redact(message)  # an error from a library other than feedpipe may quote a URL
    print(f"feedpipe {args.command}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print_json({"error": type(e).__name__, "message": redact(str(e)) or message})
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``feedpipe`` subcommand; returns the exit status.

    0: done; 1: a check found problems (``verify``); 2: bad input or options (the message says
    which); 130: interrupted (a ``shard`` whose manifest was written when the Ctrl-C came is
    finished: 0, and a line saying so). A reader that closes stdout early (``feedpipe ... |
    head``) ends the command quietly with status 141, as a shell reports a process ended by
    SIGPIPE."""
    argv = list(sys.argv[1:] if argv is None else argv)
    Parser.json_errors = "--json" in argv
    try:
        parser = build_parser()
        if not argv:  # `feedpipe` alone: what it can do (a usage error: on stderr, status 2)
            parser.print_help(sys.stderr)
            return 2
        try:
            args, extra = parser.parse_known_args(argv)
            if extra:  # said by the subcommand, with its usage, not the top level's
                commands = getattr(args, "subcommand_parsers", {})
                commands.get(args.command, parser).unrecognized(extra)
        except SystemExit:  # --help, --version or a usage error, already printed
            sys.stdout.flush()
            raise
        try:
            status = _COMMANDS[args.command](args)
        except (FeedpipeError, ValueError) as e:  # ValueError: an option value the library refused
            status = _failed(args, e, f"error: {e}", 2)
        except KeyboardInterrupt as e:
            status = _failed(args, e, _INTERRUPTED.get(args.command, "interrupted"), 130)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        import os

        # the reader is gone: point stdout at /dev/null so that the exit-time flush is silent
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
