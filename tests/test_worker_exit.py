"""A loader's worker processes exit with the training process (feedpipe._helpers.parent_watch).

A real training script with ``num_workers=2`` on each ``workers`` route is stopped by SIGTERM in
the middle of a long step, while its workers hold batches it has not read: every worker process is
gone soon after, repeatedly. Raw samples make batches larger than a pipe, the case where a worker
that saw its parent go still waited forever on its queue's feeder thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import feedpipe
from feedpipe.convert._synth import make_image_folder

TRIALS = 3
GONE_WITHIN = 30.0  # seconds: a bound, not a timing (they go at once; before, never)

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from feedpipe import BatchCollator, FeedDataset, FeedLoader, ImagePipeline

    path, route = sys.argv[1], sys.argv[2]
    if route == "rows-workers":
        ds = FeedDataset(path, shuffle=True, seed=1,
                         transform=ImagePipeline(64, train=False, mean=None))
        kw = {"collate_fn": BatchCollator(16, (3, 64, 64), torch.uint8)}
    else:  # raw samples: batches of image bytes, larger than a pipe
        ds, kw = FeedDataset(path, shuffle=True, seed=1), {}
    loader = FeedLoader(ds, batch_size=16, num_workers=2, route=route, **kw)
    for batch in loader:
        print("READY", flush=True)
        time.sleep(3600)  # a long training step: the workers fill their queue meanwhile
""")


@pytest.fixture(scope="module")
def big_samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("exit")
    src, out = root / "src", root / "shards"
    make_image_folder(str(src), classes=2, per_class=40, min_size=300, max_size=400, seed=1)
    feedpipe.shard(str(src), str(out), max_samples=20, labels_from_dirs=True, workers=1,
                   show_progress=False)
    script = root / "train.py"
    script.write_text(SCRIPT)
    return str(out), str(script)


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid, state = _stat(int(name))
            if ppid == pid and state != "Z":
                out.append(int(name))
    return out


def _stat(pid: int) -> tuple[int, str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone
        return -1, "X"
    return int(fields[1]), fields[0]


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if _stat(p)[1] not in ("X", "Z")]


def left_behind(script: str, path: str, route: str, stderr: Path) -> list[int]:
    """Run training ``script`` until its first batch, end it with SIGTERM, and give the pids
    of its worker processes still alive ``GONE_WITHIN`` seconds later."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(feedpipe.__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    with stderr.open("w+") as err:
        p = subprocess.Popen([sys.executable, script, path, route], stdout=subprocess.PIPE,
                             stderr=err, text=True, env=env)
        try:
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("READY"), (err.seek(0), err.read())
            workers = children(p.pid)
            assert len(workers) >= 2, workers
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait()
            p.stdout.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + GONE_WITHIN
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the pids
    return alive(workers)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("route", ["samples-workers", "refs-workers", "rows-workers"])
def test_workers_exit_with_a_terminated_training_process(
        route: str, big_samples: tuple[str, str], tmp_path: Path) -> None:
    path, script = big_samples
    lingering: list[int] = []
    try:
        for trial in range(TRIALS):
            lingering += left_behind(script, path, route, tmp_path / f"stderr-{trial}")
            assert not lingering, f"trial {trial}: workers {lingering} outlived the training " \
                                  "process"
    finally:
        for pid in alive(lingering):
            os.kill(pid, signal.SIGKILL)


LATE = textwrap.dedent("""
    import os, sys, time
    from feedpipe import FeedDataset, FeedLoader

    path, route = sys.argv[1], sys.argv[2]
    parent = os.getpid()

    def late(worker_id):  # worker 1 starts its share only once the training process is gone
        if worker_id == 1:
            while os.getppid() == parent:
                time.sleep(0.02)  # polling for the parent's exit

    loader = FeedLoader(FeedDataset(path, shuffle=True, seed=1), batch_size=16, num_workers=2,
                        route=route, worker_init_fn=late, multiprocessing_context="fork")
    for batch in loader:
        print("READY", flush=True)
        time.sleep(3600)
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("route", ["samples-workers", "refs-workers"])
def test_a_worker_that_starts_after_the_training_process_ended_exits(
        route: str, big_samples: tuple[str, str], tmp_path: Path) -> None:
    """A forked worker slow to start (a loaded machine) that begins its share only after the
    training process has gone: it exits too, instead of making a batch larger than the pipe
    and waiting forever to hand it over. It watched only the parent it saw then (init, once
    its parent was gone), not the training process that forked it."""
    path, _ = big_samples
    script = tmp_path / "late.py"
    script.write_text(LATE)
    lingering = left_behind(str(script), path, route, tmp_path / "stderr")
    for pid in lingering:
        os.kill(pid, signal.SIGKILL)
    assert not lingering, f"workers {lingering} outlived the training process"


UNFINISHED = textwrap.dedent("""
    import sys
    import numpy as np
    import feedpipe

    out = sys.argv[1]
    feedpipe.write_samples(({"__key__": f"d{i:03d}", "tokens.npy": np.arange(40 + i)}
                            for i in range(60)), out, max_samples=10)
    ds = feedpipe.FeedDataset(out, shuffle=True, seed=0)
    # module globals, as a script keeps them; the interpreter clears them at exit
    it = iter(feedpipe.FeedLoader(feedpipe.Packed(ds, 64), batch_size=2))
    it2 = iter(feedpipe.FeedLoader(ds, batch_size=4))                   # refs, in this process
    it3 = iter(feedpipe.FeedLoader(ds, batch_size=4, route="samples"))
    it4 = iter(feedpipe.FeedLoader(ds, batch_size=4, num_workers=1, route="samples-workers"))
    it5 = iter(ds)                                                  # the DataLoader way
    it6 = iter(feedpipe.Mixture({"a": ds, "b": feedpipe.FeedDataset(out, seed=1)}))
    kept = (next(it), next(it2), next(it3), next(it4), next(it5), next(it6))
    print("left", len(kept), "iterators unfinished")
""")



def test_iterators_left_unfinished_at_exit_close_quietly(tmp_path: Path) -> None:
    """A script that stops reading mid-epoch and exits while holding its iterators (a
    ``break`` at module level, an evaluation loop cut short) ends with exit status 0 and
    nothing on stderr: the iterators close before the interpreter tears its modules down,
    where their clean-up found the modules' names already gone and printed tracebacks."""
    r = subprocess.run([sys.executable, "-c", UNFINISHED, str(tmp_path / "docs")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "left 6 iterators unfinished" in r.stdout
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


class FailsAt:
    """A transform that raises at one sample: an error from inside a worker process."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, sample: dict) -> int:
        if sample["__index__"] == self.at:
            raise ValueError(f"no sample {self.at} today")
        return 0


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_that_raised_leaves_no_worker_process_behind(sharded: Path,
                                                              persistent: bool) -> None:
    """The error leaves the loop with the DataLoader iterator still referenced from its
    traceback, until the garbage collector breaks the cycle. Until then its workers lived on,
    and torch's SIGCHLD handler kept watching them: a worker that had died (a shard cut under
    its map, SIGBUS) made the next child process to exit raise "DataLoader worker is killed by
    signal" in whatever the training process, or pytest, was doing then. The loader now shuts
    its workers down as the error leaves it."""
    import gc
    import multiprocessing

    ld = feedpipe.FeedLoader(feedpipe.FeedDataset(str(sharded), transform=FailsAt(5)),
                             batch_size=2, num_workers=2, route="samples-workers",
                             persistent_workers=persistent)
    gc.disable()  # what the collector would do some time later is not the loader's doing
    try:
        with pytest.raises(ValueError, match="no sample 5 today") as e:
            list(ld)
        assert multiprocessing.active_children() == [], e.value
    finally:
        gc.enable()
