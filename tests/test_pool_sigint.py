"""Ctrl-C and conversion pools.

A Ctrl-C that reaches a conversion pool's worker before its initializer has told it to ignore
SIGINT (during the interpreter's start-up, or CPython's fork hooks) must not kill it with a
traceback: the parent holds SIGINT blocked while it starts workers, they inherit the mask, and
the initializer ignores SIGINT before it unblocks it, so an early interrupt is discarded.

In the parent, a Ctrl-C must not raise inside ``concurrent.futures`` (it could leave the pool
unable to shut down, and the process hung): while a pool runs, the interrupt is noted and raised
between parts (``sigint_deferred``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from feedpipe._helpers.pool_context import die_with_parent, sigint_deferred, sigint_held
from feedpipe.convert._synth import make_image_folder


def interrupted_early(parent: int) -> None:
    """The initializer, after a Ctrl-C arrived before it ran."""
    os.kill(os.getpid(), signal.SIGINT)
    die_with_parent(parent)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_interrupt_before_the_initializer_does_not_kill_a_worker(method: str) -> None:
    if method not in mp.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    with ProcessPoolExecutor(1, mp_context=mp.get_context(method), initializer=interrupted_early,
                             initargs=(os.getpid(),)) as pool:
        with sigint_held():
            fut = pool.submit(os.getpid)
        assert fut.result(timeout=120) != os.getpid()


def test_sigint_deferred_notes_a_ctrl_c_and_raises_it_where_the_caller_checks() -> None:
    """Inside the block a SIGINT raises nothing (so none lands inside a pool's internals); the
    check raises it, once; the end of the block raises one noted after the last check; nested
    blocks share the notes, and the handler is Python's default again afterwards."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("needs Python's own SIGINT handler in the main thread")
    with sigint_deferred() as interrupted:
        signal.raise_signal(signal.SIGINT)
        with sigint_deferred() as inner:
            with pytest.raises(KeyboardInterrupt):
                inner()
        interrupted()  # raised once only
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # no pool: raised where it lands
        with sigint_deferred(pool=False):
            signal.raise_signal(signal.SIGINT)
            pytest.fail("not raised where it landed")


def test_sigint_deferred_leaves_a_programs_own_handler_alone() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with sigint_deferred() as interrupted:
            signal.raise_signal(signal.SIGINT)
            interrupted()  # nothing noted: the program's handler took it
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, old)


# `feedpipe shard` with a Ctrl-C that lands inside concurrent.futures.wait(), after it has taken
# the lock of one future and before the others (_AcquireFutures.__enter__ takes one per pending
# future): the window is real but narrow, so the script sends the SIGINT from that exact point
# (a real signal, taken by the real handler)
_WAIT_WINDOW = """
import faulthandler, os, signal, sys
import concurrent.futures._base as base
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)
def enter(self, sent=[]):
    for k, future in enumerate(self.futures):
        future._condition.acquire()
        if k == 0 and len(self.futures) > 1 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
base._AcquireFutures.__enter__ = enter
from feedpipe.cli import main
raise SystemExit(main())
"""


# the same with a Ctrl-C that lands while the main thread joins the pool's manager thread in
# shutdown(): the manager thread sends it once the main thread has said it joins (the main thread
# gives the manager thread the interpreter only when it blocks, in the join), then stays as the
# parts still under way would keep it, until this process exits (or a few seconds, if the main
# thread goes on waiting for it)
_JOIN_WINDOW = """
import atexit, faulthandler, os, signal, sys, threading
import concurrent.futures.process as process
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)
joining, exiting = threading.Event(), threading.Event()
internals = process._ExecutorManagerThread.join_executor_internals
def join_executor_internals(self):
    joining.wait()
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    exiting.wait(3)
    internals(self)
process._ExecutorManagerThread.join_executor_internals = join_executor_internals
join = threading.Thread.join
def joined(self, timeout=None):
    if isinstance(self, process._ExecutorManagerThread):
        joining.set()
    return join(self, timeout)
threading.Thread.join = joined
atexit.register(exiting.set)
from feedpipe.cli import main
raise SystemExit(main())
"""


def _interrupted_run(tmp_path: Path, script: str, *options: str, finished: bool = False) -> None:
    """Run ``feedpipe shard ... options`` through ``script`` (which sends the SIGINT); it must
    end with the one-line --resume hint, and the --resume finish the dataset. ``finished``: the
    SIGINT comes after the manifest is written: the run ends with status 0 and one line saying
    there is nothing to resume, and the --resume says the dataset is complete."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_image_folder(str(src), classes=4, per_class=10)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    args = ["shard", str(src), str(out), "--workers", "2", "--max-samples", "2"]
    p = subprocess.Popen([sys.executable, "-c", script, *args, *options, "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)  # every thread's stack, for the failure message
        try:
            p.communicate(timeout=5)  # it does not end: this collects the dump meanwhile
        except subprocess.TimeoutExpired:
            pass
        os.killpg(p.pid, signal.SIGKILL)
        stderr = p.communicate()[1]
        pytest.fail(f"the run hung after the Ctrl-C; its threads:\n{stderr}")
    assert p.returncode == (0 if finished else 130), (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert ("nothing to resume" if finished else "--resume") in lines[0], stderr
    again = subprocess.run([sys.executable, "-m", "feedpipe", *args, "--resume"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert finished == ("already holds this conversion, complete" in again.stderr), again.stderr
    assert finished == ("all there already: nothing written" in again.stdout), again.stdout
    verified = subprocess.run([sys.executable, "-m", "feedpipe", "verify", str(out)],
                              capture_output=True, text=True, env=env, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.parametrize("method", ["general", "one-pass"])
def test_ctrl_c_while_a_pool_shuts_down_ends_the_run_instead_of_hanging(
        tmp_path: Path, method: str) -> None:
    """A KeyboardInterrupt raised in that join made CPython take the still-running manager
    thread for finished. At exit multiprocessing closed the pool's call queue (its feeder
    thread stopped) before the manager thread had sent the workers their stop sentinels through
    it: the workers never stopped, and the exit handler and the manager thread waited for them
    forever. Now the Ctrl-C is noted and raised once the pool is shut down.

    The one-pass method shuts its pool down after the manifest is written (the pool joined the
    shards): that Ctrl-C came when the dataset was complete, and the run says it finished."""
    _interrupted_run(tmp_path, _JOIN_WINDOW, "--method", method, finished=method == "one-pass")


def test_ctrl_c_inside_the_pools_wait_ends_the_run_instead_of_hanging(tmp_path: Path) -> None:
    """A KeyboardInterrupt raised there left that future's lock held by the main thread: the
    pool's manager thread waited for it to mark the future running, and the main thread waited
    for the manager thread to end, forever. Now the Ctrl-C is noted and raised between parts:
    the run ends with the one-line --resume hint, and the --resume finishes the dataset."""
    import concurrent.futures._base as base

    if not hasattr(base, "_AcquireFutures"):
        pytest.skip("this Python's concurrent.futures takes the futures' locks otherwise")
    _interrupted_run(tmp_path, _WAIT_WINDOW, "--method", "general")


# `feedpipe shard` with a Ctrl-C that lands the moment the dataset's manifest has been written
# (the end of a run: the pool shut down, the manifest is the commit point): a real SIGINT, sent
# from inside the run right after manifest.json appeared
_AFTER_MANIFEST = """
import os, signal, sys
import feedpipe.convert._output_dir as output_dir
signal.signal(signal.SIGINT, signal.default_int_handler)
write_manifest = output_dir.write_manifest
def written(*args, **kwargs):
    path = write_manifest(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
    return path
output_dir.write_manifest = written
from feedpipe.cli import main
raise SystemExit(main())
"""


def _shards(out: Path) -> dict[str, tuple[int, int]]:
    """Each shard's inode and modification time: a rewritten shard changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.tar")}


def test_a_ctrl_c_after_the_manifest_is_written_reports_a_finished_run(tmp_path: Path) -> None:
    """The dataset is complete once its manifest is written: a Ctrl-C after that point was
    reported as an interrupted conversion (status 130, "rerun with --resume"), and the --resume
    then redid every shard. Now the run says it finished (status 0, its summary, and one line
    saying there is nothing to resume), and a --resume over the finished dataset says it is
    complete and writes nothing."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_image_folder(str(src), classes=4, per_class=10)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    args = ["shard", str(src), str(out), "--workers", "2", "--max-samples", "2",
            "--method", "general", "--no-progress"]
    p = subprocess.run([sys.executable, "-c", _AFTER_MANIFEST, *args], capture_output=True,
                       text=True, env=env, timeout=120, start_new_session=True)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "--resume" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nothing to resume" in lines[0], p.stderr
    assert "shards" in p.stdout, p.stdout  # the summary
    assert (out / "manifest.json").exists()
    assert not [n for n in os.listdir(out) if n.startswith(".feedpipe-shard-state")
                or n.endswith(".record.json")], os.listdir(out)  # tidied up in full
    before = _shards(out)
    assert len(before) == 20
    again = subprocess.run([sys.executable, "-m", "feedpipe", *args, "--resume", "--json"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "already holds this conversion, complete" in again.stderr, again.stderr
    summary = json.loads(again.stdout)
    assert summary["shards"] == summary["reused_shards"] == 20, summary
    assert _shards(out) == before  # nothing rewritten
    verified = subprocess.run([sys.executable, "-m", "feedpipe", "verify", str(out)],
                              capture_output=True, text=True, env=env, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_resume_over_a_finished_dataset_with_a_shard_gone_redoes_it(tmp_path: Path) -> None:
    """The check of a finished dataset is cheap (the manifest's fingerprint, each shard's size):
    a shard missing is said, and the conversion is redone into a whole dataset again."""
    from feedpipe import shard

    src, out = tmp_path / "src", tmp_path / "out"
    make_image_folder(str(src), classes=2, per_class=4)
    shard(str(src), str(out), workers=1, max_samples=2)
    (out / "data-000001.tar").unlink()
    s = shard(str(src), str(out), workers=1, max_samples=2, resume=True)
    assert s.reused_shards == 0 and s.shards == 4
    assert (out / "data-000001.tar").exists()
