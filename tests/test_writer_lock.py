"""One writer per dataset directory, and an interrupted write recognised as such.

A writer holds a lock file in its directory until its manifest is written
(:mod:`feedpipe.format._write_lock`). A second writer is refused while the first lives; a writer
killed with SIGKILL (here a real subprocess) leaves its lock and temp file, and ``verify``,
``index`` and ``FeedDataset`` then say the write was interrupted instead of taking its committed
shards for the dataset."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_feedpipe

import feedpipe
from feedpipe.errors import InterruptedWriteError, OutputError

# a ShardWriter that writes `n` samples, 2 to a shard, says "ready" and waits (stdin) for its end
_WRITER = textwrap.dedent("""
    import sys, feedpipe
    w = feedpipe.ShardWriter(sys.argv[1], max_samples=2)
    for i in range(int(sys.argv[2])):
        w.write({"__key__": f"{i:04d}", "txt": f"sample {i}"})
    print("ready", flush=True)
    sys.stdin.readline()
    w.close()
""")


def _start_writer(out: Path, n: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(out), str(n)], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line == "ready\n", (line, p.stderr.read() if p.stderr else "")
    return p


@pytest.fixture
def writers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _kill(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL


def test_a_second_shardwriter_on_one_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    first = feedpipe.ShardWriter(str(out), max_samples=2)
    first.write({"__key__": "a", "txt": "from the first"})
    with pytest.raises(OutputError, match=f"{out}: another writer.*pid {os.getpid()}"):
        feedpipe.ShardWriter(str(out))
    first.write({"__key__": "b", "txt": "still the first"})
    m = first.close()
    assert m.total_samples == 2
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # lock and temps gone
    assert feedpipe.verify(str(out), show_progress=False).ok
    with feedpipe.ShardWriter(str(tmp_path / "other")) as w:  # after close: free again
        w.write({"__key__": "c", "txt": "x"})


def test_a_live_writer_in_another_process_refuses_writers_and_readers(
        tmp_path: Path, writers: list[subprocess.Popen[str]]) -> None:
    out = tmp_path / "ds"
    p = _start_writer(out, 3)
    writers.append(p)
    with pytest.raises(OutputError, match=f"another writer.*feedpipe.ShardWriter \\(pid {p.pid}"):
        feedpipe.ShardWriter(str(out))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hi")
    r = run_feedpipe("shard", src, out, "--workers", "1")
    assert r.returncode != 0 and f"pid {p.pid}" in r.stderr and str(out) in r.stderr, r.stderr
    with pytest.raises(InterruptedWriteError, match=f"being written now.*pid {p.pid}"):
        feedpipe.FeedDataset(str(out))
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait() == 0
    assert feedpipe.verify(str(out), show_progress=False).ok


def test_a_writer_killed_mid_write_is_an_interrupted_write_not_a_short_dataset(
        tmp_path: Path, writers: list[subprocess.Popen[str]]) -> None:
    out = tmp_path / "ds"
    p = _start_writer(out, 5)  # 2 shards committed, the fifth sample in a temp file
    writers.append(p)
    _kill(p)
    tmp = f".data-000002.tar.tmp-{p.pid}"
    assert tmp in os.listdir(out)
    said = [f"{out}: the write of this dataset was interrupted", f"pid {p.pid}",
            str(out / tmp), "must be redone"]
    r = run_feedpipe("verify", out)
    assert r.returncode != 0 and all(s in r.stderr + r.stdout for s in said), r.stderr
    assert "feedpipe index " + str(out) not in r.stderr  # (the advice that blessed it)
    with pytest.raises(InterruptedWriteError) as ei:
        feedpipe.FeedDataset(str(out))
    assert all(s in str(ei.value) for s in said), ei.value
    r = run_feedpipe("index", out)
    assert r.returncode != 0 and all(s in r.stderr for s in said), r.stderr
    assert "--adopt-interrupted" in r.stderr
    assert not (out / "manifest.json").exists()
    # asked explicitly: the committed shards become the dataset, the leftovers go
    r = run_feedpipe("index", out, "--adopt-interrupted")
    assert r.returncode == 0, r.stderr
    assert "interrupted" in r.stderr and "adopted" in r.stderr
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    assert feedpipe.load_manifest(str(out)).total_samples == 4
    assert feedpipe.verify(str(out), show_progress=False).ok


def test_a_writer_that_never_closes_leaves_an_interrupted_write(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    script = ("import sys, feedpipe\n"
              "w = feedpipe.ShardWriter(sys.argv[1], max_samples=1)\n"
              "for i in range(3): w.write({'__key__': str(i), 'txt': 'x'})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True, timeout=120)
    with pytest.raises(InterruptedWriteError, match="was interrupted.*must be redone"):
        feedpipe.verify(str(out), show_progress=False)


def test_a_dead_writers_lock_is_taken_over_and_its_temp_file_removed(
        tmp_path: Path, writers: list[subprocess.Popen[str]]) -> None:
    out = tmp_path / "ds"
    p = _start_writer(out, 1)  # nothing committed: only the lock and a temp file
    writers.append(p)
    _kill(p)
    assert sorted(os.listdir(out)) == [".data-000000.tar.tmp-" + str(p.pid),
                                       ".feedpipe-writer.lock"]
    with feedpipe.ShardWriter(str(out)) as w:
        w.write({"__key__": "a", "txt": "x"})
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    assert feedpipe.verify(str(out), show_progress=False).ok


def test_feedpipe_shard_resumes_over_its_own_dead_lock(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for d in ("a", "b"):
        (src / d).mkdir(parents=True)
        for i in range(3):
            (src / d / f"{i}.txt").write_text(f"{d}{i}")
    out = tmp_path / "o"
    out.mkdir()
    # what a killed run leaves besides its shards: its resume state and its lock
    (out / ".feedpipe-shard-state.json").write_text('{"plan_fingerprint": "x"}')
    (out / ".feedpipe-writer.lock").write_text('{"pid": 999999999, "tool": "feedpipe shard"}')
    with pytest.raises(InterruptedWriteError, match="pid 999999999.*--resume"):
        feedpipe.load_manifest(str(out))
    assert feedpipe.shard(str(src), str(out), workers=1, max_samples=2).samples == 6
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_adopting_an_interrupted_feedpipe_shard_run_leaves_nothing_hidden(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").mkdir()
    for i in range(6):
        (src / "x" / f"{i}.txt").write_text(str(i))
    (src / "top.txt").write_text("a file at the root: the general method")
    out = tmp_path / "o"

    class Stop(Exception):
        pass

    def stop(rec: object) -> None:
        raise Stop

    with pytest.raises(Stop):
        feedpipe.shard(str(src), str(out), workers=1, max_samples=2, on_shard=stop)
    hidden = sorted(n for n in os.listdir(out) if n.startswith("."))
    assert ".feedpipe-shard-state.json" in hidden and ".data-000000.tar.record.json" in hidden
    with pytest.raises(InterruptedWriteError, match="--resume"):
        feedpipe.index([str(out)], show_progress=False)
    m = feedpipe.index([str(out)], adopt_interrupted=True, show_progress=False)
    assert m.total_samples == 2
    assert not [n for n in os.listdir(out) if n.startswith(".")]
