"""Peak memory of a process tree: RSS and PSS summed over the process and all its descendants
(DataLoader workers, DALI has none), sampled on a background thread. Peak RSS: at each sample,
the sum over the processes alive then of each one's high-water mark so far (``VmHWM`` in
``/proc/PID/status``, exact and cheap), and the largest such sum; an upper bound on what the
tree held at once (each process's own peak counts even if they did not coincide), but a process
no longer counts once it has exited: a DataLoader without ``persistent_workers`` starts new
workers every epoch, and adding the peaks of every epoch's workers (``rss_hwm_all_bytes``, kept
for comparison) would count processes that never lived at the same time. A process that lives
and dies between two samples (0.25 s) is missed. PSS comes from ``/proc/PID/smaps_rollup`` once
a second only: reading it walks the page tables under the process's mmap lock, which stalls page
faults of an mmap reader (sampling it at 10 Hz made feedpipe's raw read 3x slower, LitData's
1.4x). PSS splits shared pages (the forked workers' copy-on-write torch, mmapped shards) between
the processes that map them, so its sum is what the tree really costs; the RSS sum counts shared
pages once per process."""

from __future__ import annotations

import os
import threading
from typing import Any


def _rollup(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return rss, pss


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children", encoding="ascii") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.result()``: peak summed RSS/PSS, bytes."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self._hwms: dict[int, int] = {}
        self._tick = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self, pss: bool = True) -> None:
        me = os.getpid()
        pids = [me, *_descendants(me)]
        live = 0
        for p in pids:
            h = _hwm(p)  # 0 once the process has gone (between the listing and now)
            self._hwms[p] = max(self._hwms.get(p, 0), h)
            live += self._hwms[p] if h else 0
        self.peak_rss = max(self.peak_rss, live)
        self.peak_procs = max(self.peak_procs, len(pids))
        if pss:
            self.peak_pss = max(self.peak_pss, sum(_rollup(p)[1] for p in pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._tick += 1
            self.sample(pss=self._tick % 4 == 0)

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def result(self) -> dict[str, Any]:
        return {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss,
                "peak_processes": self.peak_procs,
                "rss_hwm_all_bytes": sum(self._hwms.values()), "processes_seen": len(self._hwms)}
