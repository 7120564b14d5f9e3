"""Profile summaries for the benchmark scripts: cProfile stats and py-spy raw stacks reduced to
"where does the time go" tables (self time and inclusive time per function)."""

from __future__ import annotations

import io
import os
import pstats
import re
import shutil
from collections import Counter


def cprofile_summary(stats_path: str, top: int = 25) -> str:
    """Top functions by internal (self) time and by cumulative time."""
    out = io.StringIO()
    st = pstats.Stats(stats_path, stream=out)
    st.strip_dirs()
    out.write(f"== cProfile {os.path.basename(stats_path)}: by self time (tottime)\n")
    st.sort_stats("tottime").print_stats(top)
    out.write("== by cumulative time\n")
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def have_py_spy() -> str | None:
    return shutil.which("py-spy")


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    f = m.group("file")
    for marker in ("site-packages/", "lib/python3", "/feedpipe/", "/benchmarks/"):
        i = f.find(marker)
        if i >= 0:
            f = f[i + (len(marker) if marker.startswith("site") or marker.startswith("lib")
                       else 1):]
            break
    return f"{m.group('func')} ({f})"


def py_spy_summary(raw_path: str, top: int = 20, rate: int | None = None) -> str:
    """Reduce py-spy ``--format raw`` output (``frame;frame;... count`` per line, outermost
    frame first; with ``--subprocesses`` each stack starts with ``process PID:"cmdline"``
    frames, parent first) to self and inclusive sample shares per function, per process."""
    procs: dict[str, dict[str, Counter[str]]] = {}
    totals: Counter[str] = Counter()
    with open(raw_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            frames = stack.split(";")
            proc = "process ?"
            depth = 0
            while frames and frames[0].startswith("process "):
                proc = frames.pop(0).split(":", 1)[0]
                depth += 1
            role = f"{proc} ({'parent' if depth <= 1 else 'pool worker'})"
            c = procs.setdefault(role, {"self": Counter(), "incl": Counter()})
            totals[role] += n
            if frames:
                c["self"][_short(frames[-1])] += n
            for fr in {_short(x) for x in frames}:
                c["incl"][fr] += n
    buf = io.StringIO()
    grand = sum(totals.values())
    buf.write(f"== py-spy {os.path.basename(raw_path)}: {grand} samples")
    buf.write(f" at {rate}/s (= {grand / rate:.2f} CPU-seconds)\n" if rate else "\n")
    for role, n in totals.most_common():
        c = procs[role]
        secs = f", {n / rate:.2f}s" if rate else ""
        buf.write(f"-- {role}: {n} samples ({100 * n / max(grand, 1):.0f}% of all{secs})\n")
        buf.write("   self (leaf) time:\n")
        for fr, k in c["self"].most_common(top):
            buf.write(f"   {100 * k / n:6.1f}%  {fr}\n")
        buf.write("   inclusive time (feedpipe functions):\n")
        incl = [(fr, k) for fr, k in c["incl"].most_common() if "(feedpipe/" in fr]
        for fr, k in incl[:top]:
            buf.write(f"   {100 * k / n:6.1f}%  {fr}\n")
    return buf.getvalue()
