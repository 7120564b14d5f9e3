"""What every subcommand shares: size and list arguments, and the text or JSON it prints."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn


def parse_size(text: str) -> int:
    """``"256MB"`` -> 256000000, ``"1GiB"`` -> 1073741824, ``"4096"`` -> 4096."""
    from .._helpers.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


class Parser(argparse.ArgumentParser):
    """argparse with one addition: under ``--json`` a usage error is also a JSON record on
    stdout (``{"error": "UsageError", "message": ...}``), exit status 2 as before."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if Parser.json_errors:
            print_json({"error": "UsageError", "message": f"{self.prog}: {message}"})
        super().error(message)


def add_json_options(p: argparse.ArgumentParser, *, out: bool = False) -> None:
    """Add the machine-readable output options that every subcommand printing a result takes.

    ``--json`` prints one JSON document on stdout instead of the text. An error becomes
    ``{"error": <class name>, "message": ...}``, with the same exit status. With ``out``,
    ``--json-out FILE`` writes the same document to FILE, and the text is still printed."""
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON document on stdout instead of text (an "
                        "error too: {\"error\": CLASS, \"message\": ...}, same exit status)")
    if out:
        p.add_argument("--json-out", metavar="FILE", default=None,
                       help="also write the JSON document to FILE (replaced atomically)")


def print_json(record: Any) -> None:
    sys.stdout.write(json.dumps(record, indent=1, allow_nan=False) + "\n")


def write_json_file(path: str, record: Any) -> None:
    """``record`` as JSON at ``path``: written to a temp file beside it, then renamed."""
    import os
    import tempfile

    from ..errors import OutputError

    where = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".feedpipe-json-", dir=where)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the JSON document ({e.strerror})") from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{path}: cannot write the JSON document ({e.strerror})") from e
        raise


def emit(a: argparse.Namespace, record: Any, text: str | Callable[[], str] | None) -> None:
    """Hand a subcommand's result to the user.

    ``record`` (JSON-serialisable) goes to ``--json-out FILE`` when given, then to stdout as
    JSON under ``--json``. Otherwise ``text`` is printed: a string, or a function making it (for
    text that costs something to build); ``None`` when the command has printed its text
    already."""
    out = getattr(a, "json_out", None)
    if out:
        write_json_file(out, record)
    if getattr(a, "json", False):
        print_json(record)
    elif text is not None:
        print(text() if callable(text) else text)


def size_list(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from e
