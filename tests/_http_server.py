"""A small HTTP file server for the remote and cache tests, run as its own process.

    python tests/_http_server.py ROOT [--ignore-range] [--fail-first N] [--rate BYTES_PER_S]
                                      [--deny] [--corrupt SUFFIX:N ...] [--cut SUFFIX:N ...]
                                      [--token T] [--delay S] [--fail-rate P]
                                      [--down-after N --down-for S]
                                      [--stall-first N --stall-s S]

Serves ``ROOT`` with ``HEAD`` and ``GET`` (single ``Range: bytes=a-b`` requests answered with
206, unless ``--ignore-range``: then the whole file with 200, as some servers do). Misbehaviour
on demand: ``--fail-first N`` answers the first N requests with 503; ``--rate`` streams bodies
slowly (to kill a client mid-download); ``--deny`` answers every file request with 403;
``--corrupt .idx:2`` flips one byte (to a non-UTF-8 one) in the middle of the first 2 bodies
sent for paths ending in ``.idx``, as a corrupting link or proxy would; ``--cut .json:1`` sends
the first half of the first body for paths ending in ``.json`` (with a Content-Length to match:
damage the transport cannot see); ``--token T`` answers 403 to a file request whose query string
lacks ``token=T`` (a URL that carries its credentials); ``--delay S`` waits S seconds before
answering each file request (a link with a long round trip, as to a distant object store);
``--fail-rate P`` answers a fraction P of file requests (drawn from a seeded generator) with
503; ``--down-after N --down-for S``: after the N-th file request, every request for S seconds
has its connection closed unanswered (a store gone for a while); ``--stall-first N --stall-s S``:
the first N file requests get nothing for S seconds (a response that stalls).
Prints ``PORT <n>`` once it listens on 127.0.0.1.

``GET /__stats__`` returns JSON ``{path: {"requests": n, "bytes": body bytes sent, "errors": n}}``
counting requests as they arrive; ``GET /__link__`` returns ``{"inflight_max": n}``, the most file
requests it was answering at once; ``POST /__reset__`` clears the counters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import unquote, urlsplit

_lock = threading.Lock()
_stats: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "bytes": 0, "errors": 0})
_served = [0]
_inflight = [0, 0]  # now, most
_rng = random.Random(7)
_down: list[float] = []  # when the outage began
_stalled = [0]


class Handler(BaseHTTPRequestHandler):
    root = "."
    ignore_range = False
    fail_first = 0
    rate = 0.0
    deny = False
    corrupt: ClassVar[dict[str, int]] = {}  # path suffix -> bodies still to corrupt
    cut: ClassVar[dict[str, int]] = {}  # path suffix -> bodies still to cut short
    token = ""
    delay = 0.0
    fail_rate = 0.0
    down_after = 0
    down_for = 0.0
    stall_first = 0
    stall_s = 0.0

    def log_message(self, *args: object) -> None:
        pass

    def _count(self, path: str, key: str, n: int = 1) -> None:
        with _lock:
            _stats[path][key] += n

    def _gone(self) -> bool:
        """Whether the store is away now (the connection is then closed unanswered)."""
        if not self.down_for:
            return False
        with _lock:
            if not _down and _served[0] >= self.down_after:
                _down.append(time.monotonic())
            gone = bool(_down) and time.monotonic() - _down[0] < self.down_for
        if gone:
            self._count(urlsplit(self.path).path, "errors")
            self.close_connection = True
        return gone

    def _fail(self) -> bool:
        with _lock:
            _served[0] += 1
            failing = _served[0] <= self.fail_first or (
                self.fail_rate > 0 and _rng.random() < self.fail_rate)
        if failing:
            self._count(urlsplit(self.path).path, "errors")
            self.send_error(503, "flaky on purpose")
        return failing

    def do_POST(self) -> None:  # noqa: N802
        if self.path == "/__reset__":
            with _lock:
                _stats.clear()
                _inflight[1] = _inflight[0]
            self._reply(200, b"{}", "application/json")
        else:
            self.send_error(405)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/__stats__":
            with _lock:
                body = json.dumps(_stats).encode()
            self._reply(200, body, "application/json")
            return
        if self.path == "/__link__":
            with _lock:
                body = json.dumps({"inflight_max": _inflight[1]}).encode()
            self._reply(200, body, "application/json")
            return
        self._serve(body=True)

    def _reply(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _maybe_corrupt(self, path: str, chunk: bytes) -> bytes:
        with _lock:
            suffix = next((s for s, n in self.corrupt.items() if n > 0 and path.endswith(s)), None)
            if suffix is None:
                return chunk
            self.corrupt[suffix] -= 1
        mid = len(chunk) // 2
        return chunk[:mid] + bytes([chunk[mid] ^ 0xFF | 0x80]) + chunk[mid + 1:]

    def _maybe_cut(self, path: str, chunk: bytes) -> bytes:
        with _lock:
            suffix = next((s for s, n in self.cut.items() if n > 0 and path.endswith(s)), None)
            if suffix is None:
                return chunk
            self.cut[suffix] -= 1
        return chunk[: len(chunk) // 2]

    def _serve(self, body: bool) -> None:
        with _lock:
            _inflight[0] += 1
            _inflight[1] = max(_inflight)
        try:
            self._serve_file(body)
        finally:
            with _lock:
                _inflight[0] -= 1

    def _serve_file(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if body:
            self._count(path, "requests")
        if self._gone():
            return
        if self.stall_first:
            with _lock:
                _stalled[0] += 1
                stall = _stalled[0] <= self.stall_first
            if stall:
                self._count(path, "errors")
                time.sleep(self.stall_s)  # a response that stalls, not a test waiting
                self.close_connection = True
                return
        if self.delay:
            time.sleep(self.delay)  # the round trip of a distant store, not a test waiting
        if self._fail():
            return
        if self.deny:
            self.send_error(403, "access denied on purpose")
            return
        if self.token and f"token={self.token}" not in urlsplit(self.path).query.split("&"):
            self._count(path, "errors")
            self.send_error(403, "no token")
            return
        full = os.path.join(self.root, path.lstrip("/"))
        if not os.path.isfile(full):
            self.send_error(404)
            return
        with open(full, "rb") as f:
            data = f.read()
        code, lo, hi = 200, 0, len(data)
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m and not self.ignore_range:
            lo = int(m.group(1))
            hi = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
            code = 206
        chunk = data[lo:hi]
        if body and chunk:
            chunk = self._maybe_cut(path, self._maybe_corrupt(path, chunk))
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(chunk)))
        if code == 206:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
        if not self.ignore_range:
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if not body:
            return
        if self.rate:
            step = max(1, int(self.rate / 50))
            for i in range(0, len(chunk), step):  # a slow link, not a test waiting
                self._count(path, "bytes", len(chunk[i : i + step]))  # before the client has it
                self.wfile.write(chunk[i : i + step])
                self.wfile.flush()
                time.sleep(step / self.rate)
        else:
            self._count(path, "bytes", len(chunk))
            self.wfile.write(chunk)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--ignore-range", action="store_true")
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--deny", action="store_true")
    ap.add_argument("--corrupt", action="append", default=[], metavar="SUFFIX:N")
    ap.add_argument("--cut", action="append", default=[], metavar="SUFFIX:N")
    ap.add_argument("--token", default="")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--fail-rate", type=float, default=0.0)
    ap.add_argument("--down-after", type=int, default=0)
    ap.add_argument("--down-for", type=float, default=0.0)
    ap.add_argument("--stall-first", type=int, default=0)
    ap.add_argument("--stall-s", type=float, default=0.0)
    a = ap.parse_args()
    Handler.root = a.root
    Handler.ignore_range = a.ignore_range
    Handler.fail_first = a.fail_first
    Handler.rate = a.rate
    Handler.deny = a.deny
    Handler.corrupt = {s: int(n) for s, n in (c.rsplit(":", 1) for c in a.corrupt)}
    Handler.cut = {s: int(n) for s, n in (c.rsplit(":", 1) for c in a.cut)}
    Handler.token = a.token
    Handler.delay = a.delay
    Handler.fail_rate = a.fail_rate
    Handler.down_after = a.down_after
    Handler.down_for = a.down_for
    Handler.stall_first = a.stall_first
    Handler.stall_s = a.stall_s
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
