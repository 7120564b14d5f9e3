"""bench_versions ``--counter instructions``: instructions per sample of each phase's timed part,
counted by valgrind's callgrind, for the two versions.

A wall-clock or CPU-time ratio on a shared 2-core machine moves by tens of percent for identical
code; the number of instructions a version executes for the same samples hardly moves (what
remains: a wait loop's turns, the order in which threads take the GIL, hash seeds). It is no
measure of time: cache misses, memory bandwidth, page faults, I/O and waiting are not in it, and
an instruction of a vector loop counts as much as a division. It stands beside the CPU-time
ratio, not for it.

Each version runs every phase once, in order, in one interpreter under ``valgrind
--tool=callgrind --trace-children=yes`` with ``PYTHONMALLOC=malloc`` (one import of torch under
callgrind takes minutes). The phase code is bench_versions' own; where its clock starts and stops
(``bench_versions._timed``) the worker calls ``os.getsid`` and ``os.getpgid``, and callgrind dumps
its counts on entering them (``--dump-before``). It also dumps before every ``fork``, so that a
forked worker starts from zero instead of carrying its parent's counts. A phase's count is the
sum of the main process's parts from its start mark to its end mark, and the totals of every
process whose pid was handed out in between (``/proc/sys/kernel/ns_last_pid`` read at each mark):
the loader's worker processes and the converter's pool, which end inside the timed part.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import emit, fmt, median, run_worker, table

BAR = 0.97
VALGRIND = ("valgrind", "-q", "--tool=callgrind", "--trace-children=yes",
            "--dump-before=*fork", "--dump-before=getsid", "--dump-before=getpgid",
            "--dump-line=no", "--compress-strings=yes")


def _last_pid() -> int:
    with open("/proc/sys/kernel/ns_last_pid", encoding="ascii") as f:
        return int(f.read())


def count_worker(spec: dict[str, Any], run_phase: Callable[..., Any],
                 marks: list[Any]) -> None:
    """In the process under callgrind: every phase in ``spec["count"]`` in turn, with the
    marks around each timed part; emits each phase's samples and its pid window."""
    windows: list[int] = []

    def mark(at: str) -> None:
        (os.getsid if at == "start" else os.getpgid)(0)  # callgrind dumps on entering these
        windows.append(_last_pid())

    marks.append(mark)
    phases: dict[str, Any] = {}
    for phase, data in spec["count"]:
        seen = len(windows)
        n = run_phase({**data, "phase": phase, "epochs": spec["epochs"], "ledger": False})[0]
        if len(windows) != seen + 2:
            raise RuntimeError(f"phase {phase}: {len(windows) - seen} marks, not 2")
        phases[phase] = {"samples": n, "pids": windows[-2:]}
    emit({"phases": phases, "pid": os.getpid()})


def _header(path: str) -> dict[str, Any]:
    """pid, part, trigger and totals of one callgrind output file."""
    got: dict[str, Any] = {"trigger": ""}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(": ")
            if key in ("pid", "part", "totals"):
                got[key] = int(value.split()[0])
            elif line.startswith("desc: Trigger:"):
                got["trigger"] = value.strip()
    return got


def _between(pid: int, lo: int, hi: int) -> bool:
    """Whether ``pid`` was handed out after ``lo`` and up to ``hi`` (pids wrap at pid_max)."""
    return lo < pid <= hi if lo <= hi else pid > lo or pid <= hi


def tally(out_dir: str, main_pid: int, phases: dict[str, Any]) -> dict[str, Any]:
    """Instructions of each phase's timed part from the files callgrind wrote in ``out_dir``."""
    files = [_header(p) for p in glob.glob(os.path.join(out_dir, "cg.*"))]
    main = sorted((f for f in files if f["pid"] == main_pid), key=lambda f: f.get("part", 0))
    starts = [i for i, f in enumerate(main) if f["trigger"].endswith("getsid")]
    ends = [i for i, f in enumerate(main) if f["trigger"].endswith("getpgid")]
    got = {}
    for k, (phase, info) in enumerate(phases.items()):
        own = sum(f.get("totals", 0) for f in main[starts[k] + 1:ends[k] + 1])
        lo, hi = info["pids"]
        kids = [f for f in files if f["pid"] != main_pid and _between(f["pid"], lo, hi)]
        total = own + sum(f.get("totals", 0) for f in kids)
        got[phase] = {"samples": info["samples"], "main_instructions": own,
                      "child_instructions": total - own,
                      "child_processes": len({f["pid"] for f in kids}),
                      "instructions": total, "per_sample": total / max(1, info["samples"])}
    return got


def _one(script: str, version: str, tree: str, phases: list[tuple[str, dict[str, Any]]],
         scratch: str, epochs: int) -> dict[str, Any]:
    out_dir = os.path.join(scratch, f"callgrind-{version}")
    os.makedirs(out_dir, exist_ok=True)
    r = run_worker(script, {"count": phases, "epochs": epochs}, timeout=6 * 3600,
                   wrap=("env", f"PYTHONPATH={tree}", "PYTHONMALLOC=malloc", *VALGRIND,
                         f"--callgrind-out-file={out_dir}/cg.%p"))
    if "error" in r:
        return {"error": f"{version}: {r['error']}\n{r.get('stderr_tail')}"}
    got = tally(out_dir, r["pid"], r["phases"])
    print(f"{version}: " + json.dumps(got), flush=True)
    return got


def count(script: str, trees: dict[str, str], phases: list[tuple[str, dict[str, Any]]],
          scratch: str, epochs: int = 1) -> dict[str, Any]:
    """Each version's phases under callgrind, the two at once (the counts do not depend on
    the load); the ratios and the table."""
    with ThreadPoolExecutor(len(trees)) as pool:
        done = {v: pool.submit(_one, script, v, tree, phases, scratch, epochs)
                for v, tree in trees.items()}
        counts = {v: f.result() for v, f in done.items()}
    errors = [c["error"] for c in counts.values() if "error" in c]
    counts = {v: c for v, c in counts.items() if "error" not in c}
    return {**ratios(counts, [p for p, _ in phases]), "counts": counts, "errors": errors}


def ratios(counts: dict[str, Any], phases: list[str]) -> dict[str, Any]:
    """Per phase, the ref's instructions per sample over the tree's (>= 1: no more work)."""
    rows, bars = [], {}
    for phase in phases:
        b, a = (counts.get(v, {}).get(phase) for v in ("before", "after"))
        ratio = b["per_sample"] / a["per_sample"] if a and b else None
        bars[phase] = {"instruction_ratio": ratio, "met": ratio is not None and ratio >= BAR,
                       "bar_on": "instructions"}
        rows.append([phase, fmt(b and b["per_sample"]), fmt(a and a["per_sample"]),
                     fmt(ratio, 4), str(a and a["child_processes"]),
                     "met" if bars[phase]["met"] else "NOT MET"])
    text = table(rows, ["phase", "ref instr/sample", "tree instr/sample", "ratio (ref/tree)",
                        "child processes", f"bar {BAR}"])
    summary = {p: {v: {"instructions_per_sample": counts[v][p]["per_sample"]}
                   for v in counts if p in counts[v]} for p in phases}
    return {"bars": bars, "text": text, "summary": summary,
            "median_ratio": median(b["instruction_ratio"] for b in bars.values()
                                   if b["instruction_ratio"] is not None)}


def markdown(path: str, head: dict[str, Any], out: dict[str, Any]) -> None:
    env = head["env"]
    git = env.get("git") or {}
    doc = re.sub(r"\s+", " ", __doc__ or "").strip()
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {head['before']} against the working tree: instructions per sample\n\n")
        f.write(f"`{head['command']}`, {env.get('date_utc', '?')}, working tree at "
                f"{str(git.get('revision', '?'))[:7]}{' (dirty)' if git.get('dirty') else ''}, "
                f"load average {head['load']} (it does not "
                "change the counts).\n\n```\n" + out["text"] + "\n```\n\n" + doc + "\n")
