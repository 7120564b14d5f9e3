"""An object store behind a simulated link, for the remote benchmarks (and tests) to read.

    python benchmarks/linkstore.py ROOT [--rtt S] [--node-rate BYTES_PER_S]
                                        [--response-rate BYTES_PER_S] [--fail FRACTION]
                                        [--stall FRACTION] [--stall-s S] [--seed N]

or, in a process of your own::

    store = LinkStore(root, rtt=0.05, node_rate=200e6).start()
    url = store.url            # http://127.0.0.1:PORT
    ...
    store.configure(rtt=0.1)   # another link, same store
    store.stats()              # the counters below
    store.close()

Serves the directory ``ROOT`` on 127.0.0.1 in two dialects at once, so every reader meets the
same bytes over the same link:

- plain HTTP: ``GET``/``HEAD`` of ``/PATH`` with a single ``Range: bytes=a-b`` (206) or without
  (200);
- path-style S3, no authentication checked: the first component of the path is the bucket (a
  directory of ``ROOT``), the rest the key. GetObject / HeadObject (with Range), HeadBucket,
  GetBucketLocation, ListObjectsV2 (``prefix``, ``delimiter``, ``max-keys``,
  ``continuation-token``, ``start-after``) and ListObjects v1 (``marker``). Enough for s3fs,
  boto3, obstore (which want an ``ETag`` and a ``Last-Modified``), MosaicML Streaming
  (``S3_ENDPOINT_URL``) and LitData (``storage_options={"endpoint_url": ...}``).

The link, as a distant object store shows it to one node:

- ``rtt``: every response (HEAD, listing, error) waits this long before its first byte;
- ``node_rate``: all bodies share one token bucket of this many bytes/s (the node's bandwidth);
- ``response_rate``: each response is also capped at this rate (object stores serve one stream
  at tens of MB/s); 0 = no cap;
- ``fail``: this fraction of object responses is a 503 SlowDown (after the RTT);
- ``stall``: this fraction waits ``stall_s`` and then closes the connection unanswered (a
  response that timed out);
- ``chunk``: bodies are sent in pieces of this many bytes, each when the buckets allow it.

Counters, from ``GET /__stats__`` (JSON) or :meth:`LinkStore.stats`: ``requests`` (by kind:
get, head, list, other), ``bytes`` (body bytes sent), ``in_flight``/``max_in_flight``
(responses between their request and their last byte, RTT wait included), ``errors``
(503s and stalls injected), ``per_object`` ({path: {"requests", "bytes"}}) and ``timeline``
(``[t, cumulative bytes]`` every ``bin_s`` seconds since the last reset, for a plot of bytes over
time). ``POST /__reset__`` clears them; ``POST /__link__`` with a JSON body of the settings above
changes the link. Prints ``PORT <n>`` once it listens.

Python on both ends of 127.0.0.1 carries a few hundred MB/s on a small machine (see
``--self-check``): keep ``node_rate`` well under what :func:`self_check` reports, or the figures
measure this server rather than the link.
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

CHUNK = 256 << 10  # the send unit: each one waits for its tokens (a setting: ``chunk``)
# How far behind the wall clock the shared bucket may fall before it forgets: a burst of at most
# this many seconds of node bandwidth, so sleep granularity does not cost throughput.
SLACK_S = 0.005


class Link:
    """The link's settings and the shared token bucket (thread-safe)."""

    def __init__(self, rtt: float = 0.0, node_rate: float = 0.0, response_rate: float = 0.0,
                 fail: float = 0.0, stall: float = 0.0, stall_s: float = 30.0,
                 seed: int = 0, chunk: int = CHUNK) -> None:
        self._lock = threading.Lock()
        self.chunk = chunk
        self.rtt = rtt
        self.node_rate = node_rate
        self.response_rate = response_rate
        self.fail = fail
        self.stall = stall
        self.stall_s = stall_s
        self._rng = random.Random(seed)
        self._next_free = 0.0

    def configure(self, **settings: float) -> None:
        with self._lock:
            for k, v in settings.items():
                if k == "seed":
                    self._rng = random.Random(int(v))
                elif k == "chunk":
                    self.chunk = max(1, int(v))
                elif k in ("rtt", "node_rate", "response_rate", "fail", "stall", "stall_s"):
                    setattr(self, k, float(v))
                else:
                    raise ValueError(f"linkstore: no link setting {k!r}")
            self._next_free = 0.0

    def settings(self) -> dict[str, float]:
        return {"rtt": self.rtt, "node_rate": self.node_rate,
                "response_rate": self.response_rate, "fail": self.fail, "stall": self.stall,
                "stall_s": self.stall_s, "chunk": self.chunk}

    def fault(self) -> str | None:
        """``"fail"``, ``"stall"`` or None for the next object response."""
        with self._lock:
            if not (self.fail or self.stall):
                return None
            r = self._rng.random()
        if r < self.fail:
            return "fail"
        if r < self.fail + self.stall:
            return "stall"
        return None

    def node_slot(self, n: int) -> float:
        """Reserve ``n`` bytes of the node's bandwidth; the time they may leave by."""
        rate = self.node_rate
        if rate <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            start = max(self._next_free, now - SLACK_S)
            self._next_free = start + n / rate
            return self._next_free


class Counters:
    def __init__(self, bin_s: float = 0.05) -> None:
        self._lock = threading.Lock()
        self.bin_s = bin_s
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.t0 = time.monotonic()
            self.requests = {"get": 0, "head": 0, "list": 0, "other": 0}
            self.bytes = 0
            self.in_flight = 0
            self.max_in_flight = 0
            self.errors = {"fail": 0, "stall": 0}
            self.per_object: dict[str, dict[str, int]] = {}
            self._bins: list[int] = []
            # every request in the order it arrived: [method, path, range, start s, end s]
            # (seconds from the reset; end None while it is under way)
            self.log: list[list[Any]] = []

    def begin(self, kind: str, path: str | None, method: str = "GET", raw_path: str = "",
              rng: str | None = None) -> list[Any]:
        with self._lock:
            entry = [method, raw_path or path or "", rng, round(time.monotonic() - self.t0, 4),
                     None]
            self.log.append(entry)
            self.requests[kind] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if path is not None:
                self.per_object.setdefault(path, {"requests": 0, "bytes": 0})["requests"] += 1
            return entry

    def end(self, entry: list[Any] | None = None) -> None:
        with self._lock:
            self.in_flight -= 1
            if entry is not None:
                entry[4] = round(time.monotonic() - self.t0, 4)

    def sent(self, path: str | None, n: int) -> None:
        with self._lock:
            self.bytes += n
            if path is not None:
                self.per_object.setdefault(path, {"requests": 0, "bytes": 0})["bytes"] += n
            i = int((time.monotonic() - self.t0) / self.bin_s)
            if i >= len(self._bins):
                self._bins.extend([0] * (i + 1 - len(self._bins)))
            self._bins[i] += n

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            cum, timeline = 0, []
            for i, b in enumerate(self._bins):
                cum += b
                timeline.append([round((i + 1) * self.bin_s, 4), cum])
            return {"requests": dict(self.requests), "requests_total": sum(self.requests.values()),
                    "bytes": self.bytes, "in_flight": self.in_flight,
                    "max_in_flight": self.max_in_flight, "errors": dict(self.errors),
                    "per_object": {k: dict(v) for k, v in self.per_object.items()},
                    "bin_s": self.bin_s, "timeline": timeline,
                    "log": [list(e) for e in self.log]}


def _http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


def _etag(st: os.stat_result) -> str:
    return '"' + hashlib.md5(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode(),
                             usedforsecurity=False).hexdigest() + '"'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections as with a real store
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    # -- plumbing ---------------------------------------------------------------------------
    def _path_query(self) -> tuple[str, dict[str, str]]:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        return unquote(parts.path), query

    def _send(self, code: int, body: bytes, ctype: str = "application/xml",
              headers: dict[str, str] | None = None, with_body: bool = True) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", "linkstore")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if with_body and body:
            self.wfile.write(body)

    def _s3_error(self, code: int, name: str, message: str, resource: str,
                  with_body: bool = True) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{name}</Code>'
                f"<Message>{escape(message)}</Message><Resource>{escape(resource)}</Resource>"
                "<RequestId>linkstore</RequestId></Error>").encode()
        self._send(code, body, headers={"Connection": "close"} if code == 503 else None,
                   with_body=with_body)

    def _local(self, path: str) -> str | None:
        """The file or directory ``path`` names under the root, or None outside it."""
        root = self.server.root
        full = os.path.realpath(os.path.join(root, path.lstrip("/")))
        if full != root and not full.startswith(root + os.sep):
            return None
        return full

    # -- verbs ------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        self._handle(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle(body=False)

    def do_POST(self) -> None:  # noqa: N802
        path, _ = self._path_query()
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        if path == "/__reset__":
            self.server.counters.reset()
            self._send(200, b"{}", "application/json")
        elif path == "/__link__":
            try:
                self.server.link.configure(**json.loads(data or b"{}"))
            except (ValueError, TypeError) as e:
                self._send(400, str(e).encode(), "text/plain")
                return
            self._send(200, json.dumps(self.server.link.settings()).encode(), "application/json")
        else:
            self._s3_error(405, "MethodNotAllowed", "this store is read-only", path)

    def _handle(self, body: bool) -> None:
        path, query = self._path_query()
        if path == "/__stats__":
            self._send(200, json.dumps(self.server.counters.snapshot()).encode(),
                       "application/json")
            return
        local = self._local(path)
        is_file = local is not None and os.path.isfile(local)
        kind = ("get" if body else "head") if is_file else (
            "list" if "list-type" in query or "prefix" in query or "delimiter" in query
            else "other")
        counters = self.server.counters
        entry = counters.begin(kind, path if is_file else None, self.command, self.path,
                               self.headers.get("Range"))
        try:
            link = self.server.link
            if link.rtt:
                time.sleep(link.rtt)  # the round trip to a distant store, before the first byte
            if is_file:
                fault = link.fault()
                if fault == "fail":
                    counters.error("fail")
                    self._s3_error(503, "SlowDown", "injected fault: please reduce your "
                                   "request rate", path, with_body=body)
                    return
                if fault == "stall":
                    counters.error("stall")
                    time.sleep(link.stall_s)
                    self.close_connection = True
                    return
                assert local is not None
                self._object(path, local, body)
            else:
                self._bucket_or_missing(path, local, query, body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            counters.end(entry)

    def _object(self, path: str, local: str, body: bool) -> None:
        st = os.stat(local)
        size = st.st_size
        start, end = 0, size - 1
        code = 200
        rng = self.headers.get("Range")
        headers = {"ETag": _etag(st), "Last-Modified": _http_date(st.st_mtime),
                   "Accept-Ranges": "bytes"}
        if rng:
            try:
                unit, spec = rng.split("=", 1)
                a, b = spec.split(",")[0].strip().split("-", 1)
                if unit.strip() != "bytes":
                    raise ValueError(unit)
                if a == "":  # the last b bytes
                    start, end = max(0, size - int(b)), size - 1
                else:
                    start = int(a)
                    end = min(int(b), size - 1) if b else size - 1
            except ValueError:
                self._s3_error(400, "InvalidArgument", f"bad Range {rng!r}", path, with_body=body)
                return
            if start >= size or start > end:
                headers["Content-Range"] = f"bytes */{size}"
                self._s3_error(416, "InvalidRange", "the requested range is not satisfiable",
                               path, with_body=body)
                return
            code = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = end - start + 1
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("x-amz-request-id", "linkstore")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if not body:
            return
        self._stream(path, local, start, length)

    def _stream(self, path: str, local: str, start: int, length: int) -> None:
        link, counters = self.server.link, self.server.counters
        cap = link.response_rate
        t_resp = time.monotonic()
        sent = 0
        with open(local, "rb") as f:
            f.seek(start)
            while sent < length:
                chunk = f.read(min(link.chunk, length - sent))
                if not chunk:
                    raise OSError(f"linkstore: {local} shrank while being served")
                due = link.node_slot(len(chunk))
                if cap > 0:
                    due = max(due, t_resp + (sent + len(chunk)) / cap)
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.wfile.write(chunk)
                sent += len(chunk)
                counters.sent(path, len(chunk))

    def _bucket_or_missing(self, path: str, local: str | None, query: dict[str, str],
                           body: bool) -> None:
        parts = path.strip("/").split("/", 1)
        bucket = parts[0]
        bucket_dir = self._local("/" + bucket) if bucket else None
        if bucket_dir is None or not os.path.isdir(bucket_dir):
            self._s3_error(404, "NoSuchBucket", "the bucket does not exist", path,
                           with_body=body)
            return
        if len(parts) == 1 or parts[1] == "":
            if "location" in query:
                self._send(200, b'<?xml version="1.0" encoding="UTF-8"?>\n<LocationConstraint '
                           b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>')
                return
            if not body:  # HeadBucket
                self._send(200, b"", headers={"x-amz-bucket-region": "us-east-1"},
                           with_body=False)
                return
            self._list(bucket, bucket_dir, query)
            return
        self._s3_error(404, "NoSuchKey", "the specified key does not exist", path,
                       with_body=body)

    def _list(self, bucket: str, bucket_dir: str, query: dict[str, str]) -> None:
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = int(query.get("max-keys") or 1000)
        v2 = query.get("list-type") == "2"
        after = (query.get("continuation-token") or query.get("start-after") or "") if v2 \
            else query.get("marker", "")
        keys: list[tuple[str, os.stat_result]] = []
        for dirpath, dirnames, filenames in os.walk(bucket_dir):
            dirnames.sort()
            rel = os.path.relpath(dirpath, bucket_dir)
            for name in filenames:
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    keys.append((key, os.stat(os.path.join(dirpath, name))))
        keys.sort()
        entries: list[tuple[str, os.stat_result | None]] = []  # (key or common prefix, stat)
        seen_prefixes: set[str] = set()
        for key, st in keys:
            if delimiter:
                cut = key.find(delimiter, len(prefix))
                if cut >= 0:
                    common = key[: cut + len(delimiter)]
                    if common not in seen_prefixes:
                        seen_prefixes.add(common)
                        entries.append((common, None))
                    continue
            entries.append((key, st))
        entries = [e for e in entries if e[0] > after]
        page, truncated = entries[:max_keys], len(entries) > max_keys
        out = ['<?xml version="1.0" encoding="UTF-8"?>',
               '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
               f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
               f"<MaxKeys>{max_keys}</MaxKeys>",
               f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delimiter:
            out.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if v2:
            out.append(f"<KeyCount>{len(page)}</KeyCount>")
            if truncated:
                out.append(f"<NextContinuationToken>{escape(page[-1][0])}"
                           "</NextContinuationToken>")
        elif truncated:
            out.append(f"<NextMarker>{escape(page[-1][0])}</NextMarker>")
        for key, st in page:
            if st is None:
                out.append(f"<CommonPrefixes><Prefix>{escape(key)}</Prefix></CommonPrefixes>")
            else:
                out.append(f"<Contents><Key>{escape(key)}</Key>"
                           f"<LastModified>{_iso(st.st_mtime)}</LastModified>"
                           f"<ETag>{escape(_etag(st))}</ETag><Size>{st.st_size}</Size>"
                           "<StorageClass>STANDARD</StorageClass></Contents>")
        out.append("</ListBucketResult>")
        self._send(200, "".join(out).encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, root: str, link: Link, counters: Counters) -> None:
        self.root = os.path.realpath(root)
        self.link = link
        self.counters = counters
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client that hung up (a keep-alive connection closed): not the store's fault
        super().handle_error(request, client_address)

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().server_bind()


class LinkStore:
    """The store, served from a thread of this process (see the module docstring)."""

    def __init__(self, root: str, *, rtt: float = 0.0, node_rate: float = 0.0,
                 response_rate: float = 0.0, fail: float = 0.0, stall: float = 0.0,
                 stall_s: float = 30.0, seed: int = 0, bin_s: float = 0.05) -> None:
        self.link = Link(rtt, node_rate, response_rate, fail, stall, stall_s, seed)
        self.counters = Counters(bin_s)
        self._server = _Server(root, self.link, self.counters)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LinkStore:
        self._thread = threading.Thread(target=self._server.serve_forever, name="linkstore",
                                        daemon=True)
        self._thread.start()
        return self

    def configure(self, **settings: float) -> None:
        self.link.configure(**settings)

    def reset(self) -> None:
        self.counters.reset()

    def stats(self) -> dict[str, Any]:
        return self.counters.snapshot()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LinkStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def self_check(root: str, size: int = 64 << 20,
               streams: tuple[int, ...] = (1, 4)) -> dict[str, float]:
    """MB/s that an unthrottled store carries to Python clients (urllib) on this machine, for
    1 and several concurrent whole-object GETs: the ceiling for ``node_rate``."""
    os.makedirs(os.path.join(root, "selfcheck"), exist_ok=True)
    path = os.path.join(root, "selfcheck", "blob")
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    out: dict[str, float] = {}
    with LinkStore(root) as store:
        url = f"{store.url}/selfcheck/blob"
        for n in streams:
            def get() -> None:
                with urllib.request.urlopen(url) as r:
                    while r.read(1 << 20):
                        pass
            threads = [threading.Thread(target=get) for _ in range(n)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            out[f"{n}_streams_MBps"] = round(n * size / (time.perf_counter() - t) / 1e6, 1)
    os.unlink(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--rtt", type=float, default=0.0, help="seconds before each first byte")
    ap.add_argument("--node-rate", type=float, default=0.0, help="bytes/s shared (0: no limit)")
    ap.add_argument("--response-rate", type=float, default=0.0, help="bytes/s per response")
    ap.add_argument("--fail", type=float, default=0.0, help="fraction of responses that are 503")
    ap.add_argument("--stall", type=float, default=0.0, help="fraction that stall and close")
    ap.add_argument("--stall-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-check", action="store_true",
                    help="print what Python on both ends carries here, and exit")
    a = ap.parse_args(argv)
    if a.self_check:
        print(json.dumps(self_check(a.root)))
        return 0
    store = LinkStore(a.root, rtt=a.rtt, node_rate=a.node_rate, response_rate=a.response_rate,
                      fail=a.fail, stall=a.stall, stall_s=a.stall_s, seed=a.seed).start()
    print(f"PORT {store.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
