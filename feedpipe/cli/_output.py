"""What every subcommand shares: size and list arguments, and the text or JSON it prints."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .._redact import redact, redact_doc


def parse_size(text: str) -> int:
    """``"256MB"`` -> 256000000, ``"1GiB"`` -> 1073741824, ``"4096"`` -> 4096."""
    from .._helpers.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


class Parser(argparse.ArgumentParser):
    """argparse with two additions: under ``--json`` a usage error is also a JSON record on
    stdout (``{"error": "UsageError", "message": ...}``), exit status 2 as before; and no
    abbreviated options (``--max-sample`` is not silently taken for ``--max-samples``, and an
    option added later cannot change what an abbreviation in a script meant)."""

    json_errors = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def unrecognized(self, extra: list[str]) -> NoReturn:
        """Refuse arguments this (sub)command does not take, with its usage and the option
        meant where one is close ("did you mean --max-samples?")."""
        import difflib

        options = [o for a in self._actions for o in a.option_strings]
        hints = []
        for arg in extra:
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
                if close:
                    hints.append(f"did you mean {close[0]}?")
        message = f"unrecognized arguments: {' '.join(extra)}"
        self.error(f"{message}; {' '.join(hints)}" if hints else message)

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
        # mkstemp makes the file 0600; the document is a report for teammates and CI, so it gets
        # the permissions any file this user writes gets (0666 less the umask)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
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
    already. Neither carries a URL's secrets (:mod:`feedpipe._redact`)."""
    record = redact_doc(record)
    out = getattr(a, "json_out", None)
    if out:
        write_json_file(out, record)
    if getattr(a, "json", False):
        print_json(record)
    elif text is not None:
        print(redact(text() if callable(text) else text))


def size_list(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from e
