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


def py_spy_summary(raw_path: str, top: int = 25) -> str:
    """Reduce py-spy ``--format raw`` output (``frame;frame;... count`` per line, outermost
    frame first) to self and inclusive sample shares per function, per process."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    per_proc: Counter[str] = Counter()
    total = 0
    with open(raw_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            frames = stack.split(";")
            proc = frames[0] if frames[0].startswith("process ") else ""
            if proc:
                frames = frames[1:]
                per_proc[proc.split(":")[0]] += n
            total += n
            if frames:
                self_c[_short(frames[-1])] += n
            for fr in set(_short(x) for x in frames):
                incl_c[fr] += n
    buf = io.StringIO()
    buf.write(f"== py-spy {os.path.basename(raw_path)}: {total} samples\n")
    if per_proc:
        buf.write("samples per process: " + ", ".join(f"{p}: {c}" for p, c in
                                                      per_proc.most_common()) + "\n")
    buf.write("-- self (leaf) time\n")
    for fr, c in self_c.most_common(top):
        buf.write(f"{100 * c / max(total, 1):6.1f}%  {fr}\n")
    buf.write("-- inclusive time\n")
    for fr, c in incl_c.most_common(top):
        buf.write(f"{100 * c / max(total, 1):6.1f}%  {fr}\n")
    return buf.getvalue()
