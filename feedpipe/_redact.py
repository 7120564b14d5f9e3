"""What a URL may say to a human: the secrets it carries are replaced before any text leaves
feedpipe (an error message, a log record, a warning, a JSON document, a file written for people).

A URL's query values (``?token=...``, a signature, a SAS) and fragment values, and its user
information (``user:password@``), are replaced by ``<redacted>``; the keys and the rest of the URL
are kept, so the text still says which object and which kind of credential. Local paths are left
alone (``?`` is a file name character there). The URLs feedpipe fetches are never changed: only
the text made from them.
"""

from __future__ import annotations

import logging
import re
from typing import Any

MARK = "<redacted>"

# scheme://authority[path][?query][#fragment], up to a character that ends a URL in prose, a
# repr or JSON (whitespace, a quote, an angle bracket, a backslash)
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s'\"<>`\\]+)")


def _values(part: str) -> str:
    """``a=1&b&c=`` -> ``a=<redacted>&b=<redacted>&c=`` (a bare item may itself be a token, so it
    is replaced too; an empty value is kept, which also leaves text redacted before as it is)."""
    out = []
    for item in part.split("&"):
        key, eq, value = item.partition("=")
        if not item or (eq and not value):
            out.append(item)
        elif eq:
            out.append(key + "=" + MARK)
        else:
            out.append(MARK)
    return "&".join(out)


def _one(m: re.Match[str]) -> str:
    scheme, rest = m.group(1), m.group(2)
    if scheme.lower() == "file://":
        return m.group(0)
    # a trailing full stop, comma, colon, semicolon or closing bracket belongs to the sentence
    tail = ""
    while rest and rest[-1] in ".,;:)]}":
        tail, rest = rest[-1] + tail, rest[:-1]
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
              default=len(rest))
    authority, after = rest[:cut], rest[cut:]
    if "@" in authority:
        authority = MARK + "@" + authority.rsplit("@", 1)[1]
    after, hash_, fragment = after.partition("#")
    path, mark, query = after.partition("?")
    return (scheme + authority + path + (mark and mark + _values(query))
            + (hash_ and hash_ + _values(fragment)) + tail)


def redact(text: str) -> str:
    """``text`` with the secrets of every URL in it replaced by ``<redacted>``: query and
    fragment values (their keys kept) and user information.

    Example:
        >>> redact("https://u:pw@h/d/manifest.json?token=abc&sig=1: no such object")
        'https://<redacted>@h/d/manifest.json?token=<redacted>&sig=<redacted>: no such object'
        >>> redact("s3://bucket/shards and ./local?name.tar")
        's3://bucket/shards and ./local?name.tar'
    """
    if "://" not in text:
        return text
    return _URL.sub(_one, text)


def redact_doc(doc: Any) -> Any:
    """A JSON-like document (dicts, lists, strings, numbers) with every string redacted as in
    :func:`redact`, keys included; the document given is left as it is.

    Example:
        >>> redact_doc({"url": "https://h/d?token=abc", "n": [1, "s3://b/k"]})
        {'url': 'https://h/d?token=<redacted>', 'n': [1, 's3://b/k']}
    """
    if isinstance(doc, str):
        return redact(doc)
    if isinstance(doc, dict):
        return {redact_doc(k): redact_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return type(doc)(redact_doc(v) for v in doc)
    return doc


def redact_query(query: str) -> str:
    """A query string or fragment on its own (``"?token=1#x"``), redacted as in :func:`redact`.

    Example:
        >>> redact_query("?token=1&versionId=3")
        '?token=<redacted>&versionId=<redacted>'
    """
    out = ""
    for i, part in enumerate(re.split(r"([?#])", query)):
        out += part if i % 2 or not part else _values(part)
    return out


class RemoteCause(Exception):  # noqa: N818 - it stands in for another exception, not a kind
    """Stands in for an exception a storage library raised (aiohttp, botocore, fsspec) as the
    cause of a feedpipe error, when that exception's text holds a URL with secrets: its type and
    its text, redacted, so a printed traceback says what failed and holds no token. The
    exception itself is ``original`` (for a program; it is never printed, and not sent to another
    process); ``status`` is its HTTP status where it had one."""

    def __init__(self, original: BaseException) -> None:
        kind = type(original)
        super().__init__(f"{kind.__module__}.{kind.__qualname__}: {redact(str(original))}")
        self.original: BaseException | None = original
        self.status = getattr(original, "status", None)

    def __reduce__(self) -> tuple[Any, ...]:
        # sent to another process as its text (the original may not pickle, and is not needed)
        return _remote_cause, (self.args[0], self.status)


def _remote_cause(text: str, status: Any) -> RemoteCause:
    made = RemoteCause.__new__(RemoteCause)
    Exception.__init__(made, text)
    made.original, made.status = None, status
    return made


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not x for x in out):
        out.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def cause(e: BaseException) -> BaseException:
    """``e`` itself when nothing in its printed chain (its text, its causes' texts) holds a
    secret; otherwise a :class:`RemoteCause` chain standing in for it. For ``raise ... from
    cause(e)`` where ``e`` came from a storage library and may quote the URL it was given.

    Example:
        >>> c = cause(OSError("GET https://h/x?token=abc failed"))
        >>> str(c), type(c.original).__name__
        ('builtins.OSError: GET https://h/x?token=<redacted> failed', 'OSError')
        >>> e = KeyError("k")
        >>> cause(e) is e
        True
    """
    chain = _chain(e)
    if all(redact(str(x)) == str(x) and redact(repr(x)) == repr(x) for x in chain):
        return e
    stand_ins = [RemoteCause(x) for x in chain]
    for a, b in zip(stand_ins, stand_ins[1:]):
        a.__cause__ = b
    return stand_ins[0]


class _RedactRecords(logging.Filter):
    """Replaces a record's message by its redacted text when it holds a secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


_FILTER = _RedactRecords()


def logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` whose records never hold a URL's secrets (a filter on the
    logger itself, so it holds for every handler a user attaches).

    Example:
        >>> import logging
        >>> logger("feedpipe.example").filters[-1].filter(
        ...     rec := logging.LogRecord("x", 30, "f", 1, "%s: gone", ("http://h/x?t=1",), None))
        True
        >>> rec.getMessage()
        'http://h/x?t=<redacted>: gone'
    """
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log
