"""Interrupt ``feedpipe shard`` as a terminal's Ctrl-C does, many times, and count the outcomes.

Each try converts the same synthetic image folder (12,000 small JPEGs in 8 class directories,
written once under ``--data``) with 2 workers, in a subprocess that leads its own process group,
and sends SIGINT to the whole group after a random delay. A try ends:

- clean: status 130 and one line on stderr, the hint to rerun with ``--resume``;
- finished: status 0, the run was done before the interrupt came (or the interrupt came after
  its manifest was written: then one line says there is nothing to resume; or it was killed by
  it as the interpreter exited, its manifest written: the shell shows no message then);
- traceback: "Traceback" on stderr;
- hang: still running after ``--wait`` seconds. Every thread's stack of the run is printed
  (faulthandler, on SIGUSR1) before it is killed;
- other: anything else (printed).

The delay counts from the start, or with ``--at METHOD`` from the run's first call of that
``ProcessPoolExecutor`` method (``shutdown``: the end of a pool), to reach a phase on purpose::

    python tools/ctrlc_trial.py 120                          # start-up, mid-run, the end
    python tools/ctrlc_trial.py 60 --at shutdown --lo 0 --hi 0.1   # a pool's end, the manifest
    python tools/ctrlc_trial.py 60 --method general
    python tools/ctrlc_trial.py 40 --dask tcp://127.0.0.1:8786   # tasks on a running cluster
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# the run: faulthandler dumps every thread on SIGUSR1; with CTRLC_AT, the first call of that
# ProcessPoolExecutor method writes a byte to the fd CTRLC_FD (the trial times the SIGINT from it)
BOOT = """
import faulthandler, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)
at = os.environ.get("CTRLC_AT")
if at:
    import concurrent.futures.process as process
    fds = [int(os.environ["CTRLC_FD"])]
    original = getattr(process.ProcessPoolExecutor, at)
    def hooked(self, *args, **kwargs):
        while fds:
            fd = fds.pop()
            os.write(fd, b"x")
            os.close(fd)
        return original(self, *args, **kwargs)
    setattr(process.ProcessPoolExecutor, at, hooked)
from feedpipe.cli import main
sys.argv[0] = "feedpipe"
raise SystemExit(main())
"""
HINT = "rerun the same command with --resume"
DONE = "nothing to resume"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tries", type=int)
    ap.add_argument("--lo", type=float, default=0.3, help="shortest delay, s (default 0.3)")
    ap.add_argument("--hi", type=float, default=2.0, help="longest delay, s (default 2.0)")
    ap.add_argument("--at", choices=["submit", "shutdown"], default=None,
                    help="count the delay from the run's first call of this pool method")
    ap.add_argument("--method", default=None, help="feedpipe shard --method")
    ap.add_argument("--max-samples", type=int, default=50, help="per shard (default 50)")
    ap.add_argument("--dask", default=None, help="feedpipe shard --dask ADDRESS (a cluster "
                    "started apart: the Ctrl-C reaches the client only)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--wait", type=float, default=30, help="a hang after this long, s")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "ctrlc-trial-data"))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    img = os.path.join(a.data, "img")
    if not os.path.isdir(img):
        from feedpipe.convert._synth import make_image_folder

        make_image_folder(img + ".tmp", classes=8, per_class=1500)
        os.rename(img + ".tmp", img)
    counts = dict.fromkeys(["clean", "finished", "traceback", "hang", "other"], 0)
    delays: dict[str, list[float]] = {k: [] for k in counts}
    for k in range(a.tries):
        out = os.path.join(a.data, f"out{k}")
        cmd = [sys.executable, "-c", BOOT, "shard", img, out, "--workers", "2",
               "--max-samples", str(a.max_samples), "--no-progress"]
        cmd += ["--method", a.method] if a.method else []
        cmd += ["--dask", a.dask] if a.dask else []
        env = dict(os.environ)
        fds: tuple[int, ...] = ()
        if a.at:
            r, w = os.pipe()
            env.update(CTRLC_AT=a.at, CTRLC_FD=str(w))
            fds = (w,)
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env=env, pass_fds=fds)
        if a.at:
            os.close(w)
            os.read(r, 1)  # the run reached the method (or ended: end of file)
            os.close(r)
        delay = rng.uniform(a.lo, a.hi)
        time.sleep(delay)
        try:
            os.killpg(p.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
        except ProcessLookupError:
            pass
        try:
            err = p.communicate(timeout=a.wait)[1]
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGUSR1)
            try:
                p.communicate(timeout=5)  # collects the dump
            except subprocess.TimeoutExpired:
                pass
            kids = subprocess.run(["ps", "-o", "pid,stat,wchan:24,cmd", "--ppid", str(p.pid)],
                                  capture_output=True, text=True).stdout
            os.killpg(p.pid, signal.SIGKILL)
            err = p.communicate()[1]
            kind = "hang"
            print(f"HANG at try {k} (SIGINT after {delay:.2f}s)\n{kids}\n{err}", flush=True)
        else:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            done = os.path.exists(os.path.join(out, "manifest.json"))
            if "Traceback" in err:
                kind = "traceback"
            elif p.returncode == 130 and len(lines) == 1 and HINT in lines[0]:
                kind = "clean"
            elif done and ((p.returncode == 0 and (not lines or
                                                   (len(lines) == 1 and DONE in lines[0])))
                           or (p.returncode == -signal.SIGINT and not lines)):
                kind = "finished"
            else:
                kind = "other"
            if kind in ("traceback", "other"):
                print(f"{kind.upper()} at try {k} (SIGINT after {delay:.2f}s), status "
                      f"{p.returncode}, manifest written: {done}\n{err[-3000:]}", flush=True)
        counts[kind] += 1
        delays[kind].append(delay)
        shutil.rmtree(out, ignore_errors=True)
        if (k + 1) % 20 == 0:
            print(f"after {k + 1}: {counts}", flush=True)
    print(f"{a.tries} tries: {counts}; load {os.getloadavg()}")
    for kind, ts in delays.items():
        if ts:
            print(f"  {kind}: SIGINT after {min(ts):.2f}-{max(ts):.2f}s")
    return 1 if counts["hang"] or counts["traceback"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
