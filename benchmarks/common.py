"""Shared plumbing for the benchmark scripts: environment capture, one subprocess per measured
system-pass, medians, JSON results and a plain-text table.

Benchmarks are not tests (STYLE.md, habit 9): they compare feedpipe with its peers *in the same
run*, as ratios of medians over several alternating passes, because this kind of machine is noisy.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
RESULT_TAG = "BENCH-RESULT "


def default_root(name: str) -> str:
    """Where a benchmark keeps its generated data unless ``--root`` says otherwise: a directory
    named after it under the system temp dir (never a path of one machine)."""
    return os.path.join(tempfile.gettempdir(), f"feedpipe-bench-{name}")


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001 - a missing package is just "None" here
        return None


def _cmd_first_line(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        return out.splitlines()[0] if out else None
    except Exception:  # noqa: BLE001
        return None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable", "Cached"):
                    out[k + "_bytes"] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                               timeout=10)
            return r.stdout.strip() if r.returncode == 0 else None
        except Exception:  # noqa: BLE001
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"revision": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None
            else None, "dirty_files": status.splitlines() if status else []}


def _jpeg_window_decoder() -> str | None:
    try:
        from feedpipe.diagnostics._env import jpeg_window_decoder
    except ImportError:  # a feedpipe from before the C extension
        return None
    return jpeg_window_decoder()


def environment(data_dir: str | None = None) -> dict[str, Any]:
    """What the figures were measured on."""
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory": _meminfo(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "versions": {m: _version(m) for m in ("feedpipe", "torch", "webdataset", "numpy",
                                               "simplejpeg", "fsspec")},
        "jpeg_window_decoder": _jpeg_window_decoder(),
        "tar": _cmd_first_line(["tar", "--version"]),
        "cat": _cmd_first_line(["cat", "--version"]),
        "git": _git(),
    }
    if data_dir is not None:
        env["data_dir"] = data_dir
        try:
            du = shutil.disk_usage(data_dir)
            env["data_dir_disk"] = {"total_bytes": du.total, "free_bytes": du.free}
        except OSError:
            pass
        try:
            df = subprocess.run(["df", "--output=source,fstype", data_dir], capture_output=True,
                                text=True, timeout=10).stdout.split()
            env["data_dir_fs"] = " ".join(df[2:]) or None
        except Exception:  # noqa: BLE001
            env["data_dir_fs"] = None
    return env


def run_worker(script: str, spec: dict[str, Any], timeout: float = 600,
               wrap: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``script --worker SPEC`` in a fresh interpreter; return its result dict.

    The worker prints one ``BENCH-RESULT {json}`` line. A crash, a timeout or a missing result
    comes back as ``{"error": ...}`` with the tail of stderr, so one broken system does not hide
    the others; callers print it loudly and exit non-zero at the end.
    """
    text = json.dumps(spec)
    spec_file = None
    if len(text) > 64 << 10:  # one argv string may not pass 128 KiB (Linux MAX_ARG_STRLEN)
        fd, spec_file = tempfile.mkstemp(prefix="bench-spec-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        text = "@" + spec_file
    cmd = [*wrap, sys.executable, script, "--worker", text]
    # In a session of its own, so that a timeout or an interrupt of this harness also ends what
    # the worker started (LitData's optimize() leaves worker processes that otherwise go on
    # writing into the next run's output directory).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=HERE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return {"error": f"timeout after {timeout:.0f}s", "stderr_tail": _tail(err)}
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if spec_file is not None:
            os.unlink(spec_file)
    _kill_group(proc)  # anything the worker left running
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
            if r.returncode != 0:
                res.setdefault("error", f"exit status {r.returncode}")
                res["stderr_tail"] = _tail(r.stderr)
            return res
    return {"error": f"exit status {r.returncode}, no result", "stderr_tail": _tail(r.stderr),
            "command": " ".join(cmd)}


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the worker's whole process group (it leads its own session)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        proc.wait()


def load_spec(arg: str) -> dict[str, Any]:
    """A worker's spec from its ``--worker`` argument: the JSON itself, or ``@file`` holding it
    (what :func:`run_worker` passes when the JSON is too long for one argument)."""
    if arg.startswith("@"):
        with open(arg[1:], encoding="utf-8") as f:
            return json.load(f)
    return json.loads(arg)


def _tail(text: str | bytes | None, n: int = 3000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text[-n:]


def emit(result: dict[str, Any]) -> None:
    """Worker side: hand the result to the parent."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def alternating(systems: Sequence[str], p: int) -> list[str]:
    """Pass ``p``'s order: forward on even passes, backward on odd ones, rotated by ``p // 2``,
    so no system always runs first, last or right after the same neighbour."""
    order = list(systems) if p % 2 == 0 else list(reversed(systems))
    k = (p // 2) % len(order)
    return order[k:] + order[:k]


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs: Iterable[float]) -> list[float] | None:
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def sync_disk() -> None:
    """Flush dirty pages so one system's writeback does not land in the next one's timing."""
    try:
        os.sync()
    except AttributeError:
        subprocess.run(["sync"], check=False)


def warm_files(paths: Iterable[str]) -> int:
    """Read every file once (untimed) so the page cache is warm; returns bytes read."""
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                n += len(chunk)
    return n


def walk_files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        out.extend(os.path.join(dirpath, n) for n in sorted(filenames) if not n.startswith("."))
    return out


def write_results(name: str, doc: dict[str, Any]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def finish(name: str, doc: dict[str, Any], text_out: list[str], profiles: list[str],
           failed: bool, t_start: float) -> int:
    """The end of a benchmark run: the summary text, profiles beside the results, the JSON, and
    the exit status (1 when a run failed)."""
    import time

    doc["elapsed_seconds"] = time.perf_counter() - t_start
    doc["summary_text"] = "".join(text_out)
    if profiles:
        ppath = os.path.join(RESULTS, f"{name}-profile.txt")
        os.makedirs(RESULTS, exist_ok=True)
        with open(ppath, "w", encoding="utf-8") as f:
            f.write("\n\n".join(profiles))
        doc["profile_file"] = os.path.relpath(ppath, REPO)
        print(f"profile written to {ppath}")
    path = write_results(name, doc)
    print(f"results written to {path} ({doc['elapsed_seconds']:.0f}s)")
    if failed:
        print("SOME RUNS FAILED (see above and the JSON 'errors')", file=sys.stderr)
        return 1
    return 0


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    if digits == 0:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])
