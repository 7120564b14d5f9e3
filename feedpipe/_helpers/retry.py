"""Retrying remote calls: transient failures are retried with exponential backoff a bounded number
of times, permanent ones fail at once with a message that names the URL and what to do.

The classification looks at the exception and its causes (fsspec often wraps the transport error,
e.g. HTTP ``info`` turns any failure into ``FileNotFoundError`` raised *from* the real one):

- transient: connection reset/refused/aborted, timeouts, HTTP 5xx, 408 and 429, payload and
  disconnection errors of aiohttp and botocore -> retried, then :class:`RemoteError`;
- denied: ``PermissionError``, HTTP 401/403 or no credentials at all -> :class:`AccessDeniedError`
  at once;
- missing: ``FileNotFoundError`` or HTTP 404/410 -> :class:`SourceNotFoundError` at once;
- unresolved: a host name that does not resolve -> :class:`RemoteError` at once (a resolver
  that answers "try again" is transient);
- anything else is not ours to judge and propagates unchanged.

No transport library is imported here: errors are recognised by type name and status attributes.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from .._redact import cause
from ..errors import AccessDeniedError, FeedpipeError, RemoteError, SourceNotFoundError
from .remote_count import REMOTE

T = TypeVar("T")

TRANSIENT, DENIED, MISSING, UNRESOLVED, OTHER = (
    "transient", "denied", "missing", "unresolved", "other")

# Transport errors by class name (aiohttp, botocore, urllib3, fsspec), so none is imported.
_TRANSIENT_NAMES = frozenset({
    "ClientConnectionError", "ClientConnectorError", "ClientOSError", "ServerDisconnectedError",
    "ServerTimeoutError", "ClientPayloadError", "ContentLengthError", "FSTimeoutError",
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "IncompleteReadError", "ResponseStreamingError", "ProtocolError", "IncompleteRead",
    "HTTPClientError",
})
_DENIED_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError"})  # botocore


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure.

    Args:
        attempts: calls in all (the first one included).
        base_delay: seconds before the first retry; doubled for each further one.
        max_delay: cap on a single wait.

    Example:
        >>> list(RetryPolicy(attempts=4, base_delay=0.5, max_delay=1.5).delays())
        [0.5, 1.0, 1.5]
    """

    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delays(self) -> Iterator[float]:
        for i in range(max(0, self.attempts - 1)):
            yield min(self.max_delay, self.base_delay * (2**i))


DEFAULT_POLICY = RetryPolicy()


def status_of(e: BaseException) -> int | None:
    status = getattr(e, "status", None) or getattr(e, "code", None)
    if isinstance(status, int):
        return status
    response = getattr(e, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def error_chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def classify(e: BaseException) -> str:
    """How a remote call's exception is handled: ``"transient"``, ``"denied"``, ``"missing"``,
    ``"unresolved"`` or ``"other"``.

    Example:
        >>> classify(ConnectionResetError()), classify(PermissionError()), classify(KeyError())
        ('transient', 'denied', 'other')
    """
    if isinstance(e, FeedpipeError):
        return OTHER  # already judged (and worded) by feedpipe
    dns = _name_resolution(e)
    if dns is not None:
        return dns
    kinds = []
    for x in error_chain(e):
        status = status_of(x)
        if status is not None and (status >= 500 or status in (408, 429)):
            return TRANSIENT
        if isinstance(x, (ConnectionError, TimeoutError)) or type(x).__name__ in _TRANSIENT_NAMES:
            return TRANSIENT
        if isinstance(x, PermissionError) or status in (401, 403) \
                or type(x).__name__ in _DENIED_NAMES:
            kinds.append(DENIED)
        elif isinstance(x, FileNotFoundError) or status in (404, 410):
            kinds.append(MISSING)
    return kinds[0] if kinds else OTHER


def _name_resolution(e: BaseException) -> str | None:
    """``UNRESOLVED`` when a host name does not resolve, ``TRANSIENT`` when the resolver said to
    try again (``EAI_AGAIN``), ``None`` when name resolution is not what failed."""
    for x in error_chain(e):
        found = x if isinstance(x, socket.gaierror) else getattr(x, "os_error", None)
        if isinstance(found, socket.gaierror):
            return TRANSIENT if found.errno == socket.EAI_AGAIN else UNRESOLVED
        if type(x).__name__ == "ClientConnectorDNSError":  # aiohttp, its cause elsewhere
            return UNRESOLVED
    return None


def call(
    url: str,
    fn: Callable[[], T],
    *,
    policy: RetryPolicy | None = None,
    stop: threading.Event | None = None,
) -> T:
    """``fn()``, retried on transient failures; errors reworded to name ``url``.

    ``stop`` (set by a closing prefetcher) cuts a backoff wait short and ends the retries.

    Example:
        >>> call("memory://x", lambda: 42)
        42
    """
    policy = policy or DEFAULT_POLICY
    delays = policy.delays()
    tries = 0
    counted = "://" in url and not url.startswith("file://")  # remote: see remote_count
    while True:
        tries += 1
        if counted:
            REMOTE.begin()
        try:
            answer = fn()
        except Exception as e:
            if counted:
                REMOTE.end(None, retry=tries > 1)  # a failed attempt was a request too
            kind = classify(e)
            if kind == MISSING:
                raise SourceNotFoundError(
                    f"{url}: no such object ({type(e).__name__}: {e}); check the URL and that the "
                    "dataset was uploaded completely"
                ) from cause(e)
            if kind == UNRESOLVED:
                raise RemoteError(
                    f"{url}: the host name does not resolve ({type(e).__name__}: {e}); check the "
                    "host in the URL (for s3:// the endpoint, AWS_ENDPOINT_URL_S3) and the "
                    "machine's DNS settings"
                ) from cause(e)
            if kind == DENIED:
                raise AccessDeniedError(
                    f"{url}: access denied ({type(e).__name__}: {e}); check the credentials "
                    "(for s3:// the AWS_* variables or ~/.aws, for gs:// GOOGLE_APPLICATION_"
                    "CREDENTIALS) and that they grant read access to this object"
                ) from cause(e)
            if kind != TRANSIENT:
                raise
            delay = next(delays, None)
            if delay is None or (stop is not None and stop.is_set()):
                raise RemoteError(
                    f"{url}: still failing after {tries} attempt(s) ({type(e).__name__}: {e}); "
                    "the storage service is unreachable or overloaded: check the network and "
                    "the endpoint, then run again"
                ) from cause(e)
            if stop is not None:
                stop.wait(delay)
            else:
                threading.Event().wait(delay)
            continue
        if counted:
            REMOTE.end(answer, retry=tries > 1)
        return answer
