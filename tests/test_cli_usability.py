"""The ``feedpipe`` command as a newcomer meets it: what it says with no command, with a typo,
on Ctrl-C, and into a directory that is not empty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feedpipe.cli import main


def _feedpipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, "-m", "feedpipe", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def _tree(root: Path, n: int) -> None:
    for i in range(n):
        d = root / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:05d}.bin").write_bytes(os.urandom(2048))


@pytest.mark.slow
def test_ctrl_c_during_shard_prints_no_traceback_and_says_resume(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole foreground process group (the pool's workers too): the run
    ends with one line naming --resume, no worker's KeyboardInterrupt traceback, and the
    --resume it suggests then finishes the dataset."""
    src, out = tmp_path / "src", tmp_path / "out"
    _tree(src, 6000)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    cmd = [sys.executable, "-m", "feedpipe", "shard", str(src), str(out), "--workers", "2",
           "--max-samples", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True, preexec_fn=_terminal_sigint)
    deadline = time.monotonic() + 120
    # mid-conversion: once the first shard is committed (a condition, polled)
    while not (out.is_dir() and any(n.endswith(".tar") for n in os.listdir(out))):
        assert p.poll() is None, f"finished before it could be interrupted: {p.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert "KeyboardInterrupt" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--resume" in lines[0], stderr
    again = _feedpipe("shard", str(src), str(out), "--max-samples", "4", "--resume")
    assert again.returncode == 0, again.stderr
    assert _feedpipe("verify", str(out)).returncode == 0


def _terminal_sigint() -> None:
    """In the child, before it runs: SIGINT as a terminal's program gets it (the default). A
    suite run in the background (``nohup ... &``, some CI runners) has SIGINT ignored, which a
    child would inherit, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _handler_in_worker() -> object:
    return signal.getsignal(signal.SIGINT)


def test_conversion_pool_workers_leave_ctrl_c_to_the_parent() -> None:
    """A worker that takes SIGINT prints a traceback and may die holding the pool's queue lock
    (the parent then waits forever): every conversion pool's initializer ignores it."""
    from concurrent.futures import ProcessPoolExecutor

    from feedpipe._helpers.pool_context import die_with_parent, pool_context

    before = signal.getsignal(signal.SIGINT)  # Python's handler, or ignored in a background run
    with ProcessPoolExecutor(1, mp_context=pool_context(), initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        assert pool.submit(_handler_in_worker).result() == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is before  # this process: as was


def test_a_directory_an_interrupted_run_left_suggests_resume(tmp_path: Path) -> None:
    """--resume is the advice only where there is a run to resume; a finished dataset and any
    other content get another directory as the advice."""
    src = tmp_path / "src"
    _tree(src, 8)
    interrupted, finished = tmp_path / "interrupted", tmp_path / "finished"
    interrupted.mkdir()
    (interrupted / ".feedpipe-shard-state.json").write_text("{}")
    (interrupted / "data-000000.tar").write_bytes(b"")
    r = _feedpipe("shard", str(src), str(interrupted))
    assert r.returncode == 2 and "interrupted run" in r.stderr and "--resume" in r.stderr
    assert _feedpipe("shard", str(src), str(finished)).returncode == 0
    r = _feedpipe("shard", str(src), str(finished))
    assert r.returncode == 2 and "finished dataset" in r.stderr and "--resume" not in r.stderr
    assert "entries" in r.stderr  # several: plural


def test_feedpipe_alone_lists_the_commands() -> None:
    r = _feedpipe()
    assert r.returncode == 2
    for command in ("shard", "merge", "index", "verify", "demo", "probe", "cache", "ledger"):
        assert f"\n    {command} " in r.stderr, r.stderr


def test_an_unknown_option_says_did_you_mean_with_the_subcommands_usage(tmp_path: Path) -> None:
    r = _feedpipe("shard", str(tmp_path / "src"), str(tmp_path / "out"), "--max-sample", "3")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: feedpipe shard ")
    assert "feedpipe shard: error: unrecognized arguments: --max-sample 3; did you mean " \
           "--max-samples?" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("abbreviated", ["--max-sam", "--label", "--work"])
def test_no_option_is_taken_from_an_abbreviation(abbreviated: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-sam 3`` meant ``--max-samples 3`` silently, and a later option with the same
    start would have changed what a script's abbreviation meant."""
    with pytest.raises(SystemExit) as e:
        main(["shard", str(tmp_path / "src"), str(tmp_path / "out"), abbreviated, "3"])
    assert e.value.code == 2
    assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err


def test_json_out_is_written_with_the_umasks_permissions(tmp_path: Path) -> None:
    """A report for teammates and CI: 0644 under the usual umask 022, not mkstemp's 0600."""
    src, out = tmp_path / "src", tmp_path / "out"
    _tree(src, 8)
    old = os.umask(0o022)
    try:
        assert main(["shard", str(src), str(out), "--json-out", str(tmp_path / "s.json"),
                     "--no-progress"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "s.json").stat().st_mode & 0o777 == 0o644


class _Stop(Exception):
    pass


def test_cannot_resume_names_the_option_that_differs(tmp_path: Path) -> None:
    import feedpipe

    src, out = tmp_path / "src", tmp_path / "out"
    _tree(src, 40)

    def stop(rec: object) -> None:
        raise _Stop

    with pytest.raises(_Stop):
        feedpipe.shard(str(src), str(out), max_samples=4, workers=1, on_shard=stop)
    r = _feedpipe("shard", str(src), str(out), "--max-samples", "5", "--shuffle", "--resume")
    assert r.returncode == 2
    assert "--max-samples was 4, now 5" in r.stderr and "--shuffle was False, now True" in r.stderr
    (src / "c0" / "new.bin").write_bytes(b"more")
    with pytest.raises(feedpipe.OutputError, match="the inputs differ .*files added, removed"):
        feedpipe.shard(str(src), str(out), max_samples=4, workers=1, resume=True)
    (src / "c0" / "new.bin").unlink()
    feedpipe.shard(str(src), str(out), max_samples=4, workers=1, resume=True)
    with pytest.raises(feedpipe.OutputError, match=r"finished dataset, and the options differ "
                                                  r"from those \(--seed was 0, now 3"):
        feedpipe.shard(str(src), str(out), max_samples=4, seed=3, workers=1, resume=True)


def test_a_cli_error_names_a_cli_fix(tmp_path: Path) -> None:
    """`feedpipe verify DIR/data-000000.tar` said to pass ``FeedDataset('DIR')``."""
    example = Path(__file__).resolve().parent.parent / "shards" / "example"
    r = _feedpipe("verify", str(example / "data-000000.tar"))
    assert r.returncode == 2 and "is a shard, not a dataset" in r.stderr
    assert "FeedDataset(" not in r.stderr and f"manifest.json, {example} (" in r.stderr
