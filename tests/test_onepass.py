"""The one-pass conversion of local trees (feedpipe.convert._onepass): the general path's output
byte for byte, the general path whenever anything is unusual, and nothing left behind when it
fails."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _staging import stage_both
from conftest import (
    ODD_NAMES,
    UNICODE_NAMES,
    dataset_bytes,
    dir_bytes,
    method_of,
    run_feedpipe,
    write_tree,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe._helpers import dependency
from feedpipe.convert import _onepass as onepass
from feedpipe.convert import _shard as convert
from feedpipe.convert import _shard_run
from feedpipe.convert import _stage_dir as stagedir
from feedpipe.convert import _stage_walk as stagewalk
from feedpipe.errors import FeedpipeError


def _both(src: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[
        dict[str, bytes], dict[str, bytes], bool]:
    """Convert ``src`` with the method chosen by default and with the general method: both
    outputs (but the manifest's method) and whether the default was one pass (the one-pass
    method did the run rather than give it back)."""
    taken = []
    real = convert.stage_tree

    def spy(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(convert, "stage_tree", spy)
    outs = []
    methods = []
    for method in ("auto", "general"):
        out = tmp / f"out-{method}-{len(list(tmp.iterdir()))}"
        s = feedpipe.shard(str(src), str(out), method=method, **kw)
        outs.append(dataset_bytes(out))
        methods.append((s.method, method_of(out)))
    assert methods[1] == ("general", "general")
    assert methods[0] == (("one-pass",) * 2 if taken == [True] else ("general",) * 2)
    return outs[0], outs[1], taken == [True]


def _dir_tree(src: Path, dirs: int, data: Callable[[int, int], bytes]) -> Path:
    """``src`` with top-level directories ``d0``, ``d1``, ... of 5 files each: ``d{d}/{i}.bin``
    holding ``data(d, i)``."""
    for d in range(dirs):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(5):
            (src / f"d{d}" / f"{i}.bin").write_bytes(data(d, i))
    return src


needs_stagefiles = pytest.mark.skipif(
    stagedir.stage_files_with() == "python",
    reason="feedpipe._native._stagefiles did not build (no C compiler at install)")


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("labels", [False, True], ids=["plain", "labels"])
@pytest.mark.parametrize("loop", ["default", "python"])
@pytest.mark.slow
def test_same_bytes_as_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        workers: int, labels: bool, loop: str) -> None:
    # odd names (dots, spaces, %, unicode, long names), sidecars, nested directories, hidden
    # files and a hidden top-level directory; shards that span directories and cut through them;
    # staged by the C loop where it was built, and by the Python loop
    if loop == "python":
        monkeypatch.setattr(stagedir, "_C", None)
    src = tmp_path / "src"
    names = [n for n in ODD_NAMES + UNICODE_NAMES if "/" in n]
    names += [f"z{d}/sub/{i:03d}.bin" for d in range(3) for i in range(7)]
    names += ["z1/sub/000.json", "a/.hidden.jpg", ".git/config.txt", "a/.cache/x.bin"]
    write_tree(src, names)
    work = tmp_path / "w"
    work.mkdir()
    for kw in ({"max_samples": 4}, {"max_bytes": 3000}, {}):
        one, general, taken = _both(src, work, monkeypatch, workers=workers,
                                    labels_from_dirs=labels, **kw)
        assert taken, kw
        assert one == general, kw
        assert not [n for n in one if ".tmp-" in n or "stage" in n]
        m = json.loads(one["manifest.json"])
        assert m["created_by"]["ignored_hidden_files"] == 3
        # issue 41: each listed with its reason, a hidden directory once
        assert [x["path"] for x in m["skipped"] if x["reason"].startswith("hidden")] == [
            ".git/", "a/.cache/", "a/.hidden.jpg"]


_dir = st.sampled_from(["a", "b b", "c.d", "ü", "e%f", "g!h", "0"])
_stem = st.text(alphabet="xy.% é", min_size=1, max_size=4).filter(
    lambda s: not s.startswith(".") and s.strip() == s)
_ext = st.sampled_from(["bin", "jpg", "json", "tar.gz"])


@settings(max_examples=25, deadline=None)
@given(files=st.lists(st.tuples(_dir, st.lists(_dir, max_size=1), _stem, _ext,
                                st.integers(1, 2000)), min_size=1, max_size=25),
       max_samples=st.integers(1, 6))
@pytest.mark.slow
def test_same_bytes_on_random_trees(tmp_path_factory: pytest.TempPathFactory,
                                    files: list[tuple[str, list[str], str, str, int]],
                                    max_samples: int) -> None:
    tmp = tmp_path_factory.mktemp("rand")
    src = tmp / "src"
    for top, sub, stem, ext, size in files:
        p = src.joinpath(top, *sub, f"{stem}.{ext}")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes([size % 251]) * size)
    with pytest.MonkeyPatch.context() as mp:
        one, general, taken = _both(src, tmp, mp, workers=2, max_samples=max_samples)
    assert one == general
    # (a tree of fewer top-level directories than workers goes to the general path)
    assert taken == (len({top for top, *_ in files}) >= 2)


def _tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    write_tree(src, [f"{d}/{i}.jpg" for d in "abc" for i in range(4)])
    return src


@pytest.mark.parametrize("case", ["zero-byte", "no-extension", "root-file", "symlink",
                                  "unreadable", "cls-file", "empty-class"])
@pytest.mark.slow
def test_anything_unusual_goes_to_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   case: str) -> None:
    src = _tree(tmp_path)
    labels = case in ("cls-file", "empty-class")
    if case == "zero-byte":
        (src / "b" / "9.jpg").write_bytes(b"")
    elif case == "no-extension":
        (src / "c" / "README").write_bytes(b"x")
    elif case == "root-file":
        (src / "top.txt").write_bytes(b"x")
    elif case == "symlink":
        os.symlink(src / "a" / "1.jpg", src / "b" / "link.jpg")
    elif case == "unreadable":  # (as root, a chmod would not keep the file from being read)
        # (the C loop opens files itself; its fall-back to this loop at a file it cannot read
        # is test_the_c_loop_leaves_the_unusual_samples_to_the_python_loop's)
        monkeypatch.setattr(stagedir, "_C", None)
        real = os.open

        def open_(path: Any, *a: Any, **k: Any) -> int:
            if str(path).endswith("c/2.jpg"):
                raise PermissionError(13, "Permission denied", path)
            return real(path, *a, **k)

        monkeypatch.setattr(os, "open", open_)
    elif case == "cls-file":
        (src / "a" / "1.cls").write_bytes(b"3")
    elif case == "empty-class":
        (src / "d" / ".keep").parent.mkdir()
        (src / "d" / ".keep").write_bytes(b"")
    got = []
    real_stage = convert.stage_tree
    monkeypatch.setattr(convert, "stage_tree",
                        lambda *a, **k: got.append(real_stage(*a, **k)) or got[-1])
    for on_error in ("raise", "skip"):
        for one_pass in (True, False):
            out = tmp_path / f"o-{on_error}-{one_pass}"
            try:
                s = feedpipe.shard(str(src), str(out), workers=2, on_error=on_error,
                                   labels_from_dirs=labels,
                                   method="auto" if one_pass else "general")
                result: Any = (s.samples, s.skipped, dir_bytes(out))
            except FeedpipeError as e:  # the general path's error, whichever path started
                result = str(e)
            if one_pass:
                first = result
            else:
                assert first == result, (case, on_error)
            # nothing staged is left behind
            left = os.listdir(out) if out.exists() else []
            assert not [n for n in left if "stage" in n or ".tmp-" in n]
    assert got and all(g is None for g in got)


def test_a_failure_while_staging_leaves_nothing_and_resume_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path)
    out = tmp_path / "o"
    real = onepass.stage_dir
    calls = []

    def failing(*a: Any) -> Any:
        calls.append(a[1])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill would, mid-way through the directories
        return real(*a)

    monkeypatch.setattr(onepass, "stage_dir", failing)
    with pytest.raises(KeyboardInterrupt):
        feedpipe.shard(str(src), str(out), workers=1)
    assert [n for n in os.listdir(out) if n.startswith(".data-") or not n.startswith(".")] == []
    monkeypatch.setattr(onepass, "stage_dir", real)
    feedpipe.shard(str(src), str(out), workers=2, resume=True)
    feedpipe.shard(str(src), str(tmp_path / "general"), workers=2, method="general")
    assert dir_bytes(out) == dir_bytes(tmp_path / "general")


def _limit(limit: int) -> Any:
    import resource
    import signal

    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return pre


@pytest.mark.parametrize("limit", [6_000, 21_000], ids=["staging", "joining"])
def test_disk_full_is_one_line_and_resume_completes(tmp_path: Path, limit: int) -> None:
    # 4 directories of 5 records (a staging file of 10,240 bytes), shards of 10 samples (21,504
    # bytes): a limit of 6,000 fails the staging, one of 21,000 the joining of a shard
    src = _dir_tree(tmp_path / "src", 4, lambda d, i: bytes([i]) * 1500)
    out = tmp_path / "o"
    r = run_feedpipe("shard", src, out, "--max-samples", "10", "--workers", "2",
                     preexec_fn=_limit(limit))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "disk full" in r.stderr and str(out) in r.stderr
    left = os.listdir(out)
    assert not [n for n in left if n.endswith(".tar") or ".tmp-" in n or "stage" in n], left
    r = run_feedpipe("shard", src, out, "--max-samples", "10", "--workers", "2", "--resume",
                     "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shards"] == 2
    feedpipe.shard(str(src), str(tmp_path / "again"), max_samples=10, workers=2)
    assert dataset_bytes(out) == dataset_bytes(tmp_path / "again")


def test_each_staging_file_goes_once_its_shards_are_committed(tmp_path: Path) -> None:
    # 4 directories of 5 samples, shards of 5: shard i is cut from directory i alone, so when
    # shard i is committed, the staging files of directories before it are gone
    src = _dir_tree(tmp_path / "src", 4, lambda d, i: bytes([d, i]) * 700)
    out = tmp_path / "o"
    staged = []

    def on_shard(rec: Any) -> None:
        staged.append(sorted(n for n in os.listdir(out) if "-stage" in n))

    feedpipe.shard(str(src), str(out), max_samples=5, workers=2, on_shard=on_shard)
    assert [len(s) for s in staged] == [4, 3, 2, 1]
    assert not [n for n in os.listdir(out) if "-stage" in n]


def test_the_general_paths_errors_come_first_and_out_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path)
    (src / "b" / "9.jpg").write_bytes(b"")
    for method in ("auto", "general"):
        missing = tmp_path / f"missing-{method}"
        with pytest.raises(FeedpipeError, match="zero-byte"):
            feedpipe.shard(str(src), str(missing), workers=2, method=method)
        assert not missing.exists()  # not made for a run that failed on its input
        full = tmp_path / f"full-{method}"
        full.mkdir()
        (full / "x.txt").write_bytes(b"x")
        with pytest.raises(FeedpipeError, match="zero-byte"):  # the input's error first
            feedpipe.shard(str(src), str(full), workers=2, method=method)
    (src / "b" / "9.jpg").unlink()
    # an output inside the source: the walk would list it (made before the walk), so the
    # general path converts, which lists the source before it makes the output
    feedpipe.shard(str(src), str(tmp_path / "outside"), workers=2)
    taken = []
    real = convert.stage_tree
    monkeypatch.setattr(convert, "stage_tree", lambda *a, **k: taken.append(1) or real(*a, **k))
    feedpipe.shard(str(src), str(src / "inside"), workers=2)
    assert not taken and dataset_bytes(src / "inside") == dataset_bytes(tmp_path / "outside")


def test_a_failure_while_joining_leaves_no_half_shard(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the caller's on_shard fails at the first shard while the workers join others: they
    # finish before OUT's temp files are cleaned, so no index is left without its shard
    src = _dir_tree(tmp_path / "src", 8, lambda d, i: bytes([d, i]) * 900)
    out = tmp_path / "o"

    def fail(rec: Any) -> None:
        raise RuntimeError("on_shard failed")

    with pytest.raises(RuntimeError, match="on_shard failed"):
        feedpipe.shard(str(src), str(out), max_samples=5, workers=2, on_shard=fail)
    names = os.listdir(out)
    assert not [n for n in names if ".tmp-" in n or "-stage" in n], names
    tars = {n[:-4] for n in names if n.endswith(".tar")}
    assert {n[:-4] for n in names if n.endswith(".idx")} <= tars
    feedpipe.shard(str(src), str(out), max_samples=5, workers=2, resume=True)
    feedpipe.shard(str(src), str(tmp_path / "general"), max_samples=5, workers=2,
                   method="general")
    assert dir_bytes(out) == dir_bytes(tmp_path / "general")


_PATH_PARTS = st.sampled_from(["a", "b.c", ".h", "x y", "1%", "é", "cls", "d\\e", "", "n" * 99])


@settings(max_examples=400, deadline=None)
@given(st.lists(_PATH_PARTS, min_size=1, max_size=4),
       st.sampled_from(["jpg", "JPEG", "tar.gz", "cls", "json", "", "a b", "%", ".x"]),
       st.booleans())
def test_the_staging_shortcut_keys_files_as_classify_does(parts: list[str], ext: str,
                                                          labels: bool) -> None:
    # stage_dir keys plain files without classify; whatever it keys so, classify keys the same
    # (a hidden top-level directory, a dotted stem, a name to escape: all left to classify)
    rel = "top/" + "/".join(parts) + (f".{ext}" if ext else "")
    for path in (rel, rel[4:]):
        fast = stagewalk._sample_key(path, labels, {})
        if fast is None:
            continue
        got = feedpipe.convert._sources.classify(path, 1, labels_from_dirs=labels)
        assert isinstance(got, tuple), (path, got)
        assert (got[0], got[1].ext) == fast, path
        assert not (labels and fast[1] == "cls")


_NAME_PARTS = st.sampled_from(["a", "b.c", ".h", "x y", "1%", "é", "cls", "d\\e", "", ".",
                               "jpg", "n" * 99, "\n"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_NAME_PARTS, min_size=1, max_size=3).map("".join), min_size=1,
                max_size=5), st.booleans())
def test_a_directorys_names_judged_at_once_as_one_at_a_time(names: list[str],
                                                            labels: bool) -> None:
    # stage_dir judges a directory's names together where all are plain: the same stems and
    # fields as _plain_name gives each, and a directory with one name that is not plain is
    # judged a name at a time
    one = [stagewalk._plain_name(n, labels, {}) for n in names]
    together = stagewalk._plain_names(names, labels, {})
    if any(o is None for o in one):
        assert together is None
    else:
        assert together == ([o[0] for o in one], [o[1] for o in one])  # type: ignore[index]


def test_the_staging_read_gives_a_regular_file_whole_and_nothing_for_anything_else(
        tmp_path: Path) -> None:
    data = bytes(range(256)) * 300
    (tmp_path / "f.bin").write_bytes(data)
    assert stagedir.read_file(str(tmp_path / "f.bin")) == data
    (tmp_path / "empty.bin").write_bytes(b"")
    assert stagedir.read_file(str(tmp_path / "empty.bin")) == b""
    os.mkfifo(tmp_path / "pipe.bin")  # (no writer: a blocking open or read would hang here)
    assert stagedir.read_file(str(tmp_path / "pipe.bin")) == b""
    (tmp_path / "d").mkdir()
    assert stagedir.read_file(str(tmp_path / "d")) == b""
    with pytest.raises(FileNotFoundError):
        stagedir.read_file(str(tmp_path / "missing.bin"))


@pytest.mark.parametrize("delta", [-1, 0, 1, 5000])
def test_the_staging_read_takes_files_around_its_guess_whole(tmp_path: Path, delta: int) -> None:
    # under the guess: one read, no stat; from it on: the stat, and the rest in one more read
    n = stagedir._GUESS + delta
    data = (bytes(range(256)) * (n // 256 + 1))[:n]
    (tmp_path / "f.bin").write_bytes(data)
    assert stagedir.read_file(str(tmp_path / "f.bin")) == data


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs a device that fills a read")
def test_the_staging_read_refuses_a_device_that_fills_its_read() -> None:
    # the walk saw a regular file; a device put in its place is not read as one
    assert stagedir.read_file("/dev/zero") == b""


def test_shards_sealed_before_a_failure_ahead_of_the_join_leave_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the workers seal shards as soon as they are planned, before the plan's state file is
    # written: a failure there leaves none of their temp files in OUT
    src = _dir_tree(tmp_path / "src", 8, lambda d, i: bytes([d, i]) * 900)
    out = tmp_path / "o"
    trees: list[onepass.StagedTree] = []
    start = onepass.StagedTree.start

    def spy(self: onepass.StagedTree, *a: Any) -> None:
        trees.append(self)
        start(self, *a)

    def fail(*a: Any, **k: Any) -> None:
        for fut in trees[0]._futures or []:
            fut.result()  # every shard sealed (and not committed) when the failure comes
        raise RuntimeError("state file failed")

    monkeypatch.setattr(onepass.StagedTree, "start", spy)
    monkeypatch.setattr(_shard_run, "check_state", fail)
    with pytest.raises(RuntimeError, match="state file failed"):
        feedpipe.shard(str(src), str(out), max_samples=5, workers=2)
    assert trees and len(trees[0]._futures or []) == 8
    names = os.listdir(out) if out.exists() else []
    assert not [n for n in names if ".tmp-" in n or "-stage" in n], names


def test_a_top_level_directory_of_feedpipe_output_goes_to_the_general_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the root's directories are not listed ahead for output: the worker's walk finds it
    src = _tree(tmp_path)
    feedpipe.shard(str(_tree(tmp_path / "other")), str(src / "old"), workers=1)
    work = tmp_path / "w"
    work.mkdir()
    one, general, taken = _both(src, work, monkeypatch, workers=2)
    assert not taken
    assert one == general
    assert json.loads(one["manifest.json"])["total_samples"] == 12


@needs_stagefiles
@pytest.mark.parametrize("labels", [False, True], ids=["plain", "labels"])
def test_the_c_loop_stages_what_the_python_loop_stages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, labels: bool) -> None:
    # sizes around a block and around the read's guess (a file that fills it is the Python
    # loop's), names around the ustar name field's 100 bytes (over it: the Python loop's GNU
    # long-name header), unicode names, sidecars, nested directories; samples the C loop hands
    # to the Python loop and back
    g = stagedir._GUESS
    sizes = [1, 2, 511, 512, 513, 1000, 4096, g - 1, g, g + 1, 3 * g, 7]
    src = tmp_path / "src"
    top = src / "t"
    (top / "sub").mkdir(parents=True)
    (src / "other").mkdir()
    for i, n in enumerate(sizes):
        (top / f"{i:02d}.bin").write_bytes(bytes([i + 1]) * n)
    (top / "03.json").write_bytes(b'{"a": 1}')
    (top / "sub" / ("n" * 93 + ".bin")).write_bytes(b"x")  # "t/sub/" + 93 + ".bin": 103 bytes
    (top / "sub" / ("n" * 90 + ".bin")).write_bytes(b"y")  # 100 bytes: the short header
    (top / "sub" / ("m" * 91 + ".js")).write_bytes(b"z")  # 100 bytes, with the ".cls" 101
    (top / "sub" / "é ü.bin").write_bytes("é".encode() * 300)
    work = tmp_path / "w"
    work.mkdir()
    c, py = stage_both(src, "t", 0 if labels else None, work)
    assert c[0] is not None and c == py
    assert len(c[1]) == len(sizes) + 4
    names = c[5]
    assert "t/sub/" + "n" * 93 + ".bin" in names and "t/03.json" in names
    assert ("t/00.cls" in names) == labels


@needs_stagefiles
@pytest.mark.parametrize("case", ["missing", "empty", "directory", "fifo", "fills-the-read",
                                  "long-name"])
def test_the_c_loop_leaves_the_unusual_samples_to_the_python_loop(tmp_path: Path,
                                                                   case: str) -> None:
    # it stops before the sample, having staged those before it whole, and says which: the
    # Python loop then does what it does today (given back, or the slow read or header)
    from feedpipe._native import _stagefiles

    d = tmp_path / "d"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.bin").write_bytes(b"%d" % i * 700)
    odd = "1.bin"
    if case == "missing":
        (d / odd).unlink()
    elif case == "empty":
        (d / odd).write_bytes(b"")
    elif case == "directory":
        (d / odd).unlink()
        (d / odd).mkdir()
    elif case == "fifo":  # (no writer: a blocking open or read would hang here)
        (d / odd).unlink()
        os.mkfifo(d / odd)
    elif case == "fills-the-read":
        (d / odd).write_bytes(b"x" * stagedir._GUESS)
    else:
        odd = "l" * 97 + ".bin"
        (d / "1.bin").rename(d / odd)
    keys = ["0", odd.split(".")[0], "2"]
    exts, rels = ["bin"] * 3, ["0.bin", odd, "2.bin"]
    lists: list[list[Any]] = [[], [], [], [], []]
    fd = os.open(d, os.O_RDONLY)
    try:
        with open(tmp_path / "stage", "wb") as out:
            got = _stagefiles.stage(fd, out.fileno(), keys, [0, 1, 2, 3], exts, rels, b"",
                                    stagedir._TEMPLATE, 0, 0, stagedir._GUESS,
                                    feedpipe.convert._sources.READ_FLAGS, *lists)
            assert got == (1, 512 + 1024)
            # it takes up again after the sample the Python loop staged
            assert _stagefiles.stage(fd, out.fileno(), keys, [0, 1, 2, 3], exts, rels, b"",
                                     stagedir._TEMPLATE, 2, 5000, stagedir._GUESS,
                                     feedpipe.convert._sources.READ_FLAGS,
                                     *lists) == (3, 5000 + 512 + 1024)
    finally:
        os.close(fd)
    starts, names, offsets, sizes, rows = lists
    assert (starts, names, offsets, sizes) == ([0, 5000], ["0.bin", "2.bin"], [512, 5512],
                                               [700, 700])
    assert rows == [("0", [("bin", "0.bin", 700)]), ("2", [("bin", "2.bin", 700)])]
    staged = (tmp_path / "stage").read_bytes()
    assert staged[:512] == feedpipe.format._tar.member_header("0.bin", 700)
    assert staged[512:1212] == b"0" * 700 and staged[1212:1536] == bytes(324)
    assert staged[1536:2048] == feedpipe.format._tar.member_header("2.bin", 700)


def test_the_python_loop_says_once_that_the_c_loop_was_not_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    src = _tree(tmp_path)
    monkeypatch.setattr(stagedir, "_C", None)
    monkeypatch.setattr(dependency, "UNBUILT_SAID", set())
    with caplog.at_level(logging.INFO, logger="feedpipe"):
        for i in range(2):
            s = feedpipe.shard(str(src), str(tmp_path / f"o{i}"), workers=2)
            assert s.method == "one-pass" and s.samples == 12
    said = [r for r in caplog.records if "feedpipe._native._stagefiles" in r.getMessage()]
    assert len(said) == 1 and "Python loop" in said[0].getMessage()
