"""``feedpipe shard`` on hostile source trees: special files, names that are not UTF-8.

Each conversion that could hang runs in a subprocess with a timeout, so a regression fails the
test instead of stopping the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_dataset, run_feedpipe, write_tree

import feedpipe
from feedpipe.errors import InputError

HANG = 60  # seconds: a conversion of a few files that takes this long has hung


def _leftovers(out: Path) -> list[str]:
    """Temporary files left in ``out`` (none when it was never made)."""
    names = os.listdir(out) if out.exists() else []
    return [n for n in names if ".tmp-" in n or ".part" in n or "-stage" in n]


# a conversion in a subprocess whose reads turn the source file TARGET into a FIFO with no
# writer just before it is read (as a hostile tree would, between listing and reading); it
# prints the summary or the error as one JSON line
_SWAP_SCRIPT = r"""
import json, os, sys
import feedpipe
src, out, target, on_error, method = sys.argv[1:6]

marker = out + ".swapped"  # (outside the source: a later listing must not see it)

def swap(path):
    if path.endswith(target) and not os.path.exists(marker):
        os.unlink(path)
        os.mkfifo(path)
        open(marker, "wb").close()

real_open = os.open

def open_(path, *a, **k):  # (every reader of a source file opens it with os.open)
    if isinstance(path, str):
        swap(path)
    return real_open(path, *a, **k)

os.open = open_

from feedpipe.convert import _stage_dir  # noqa: E402

if _stage_dir._C is not None:  # the C loop of one-pass staging opens files itself: the swap
    real_c = _stage_dir._C     # happens as it is handed them

    class SwapFirst:
        @staticmethod
        def stage(dirfd, out_fd, keys, first, exts, rels, *rest):
            for rel in rels:
                if rel is not None:
                    swap(os.path.join(src, rel))
            return real_c.stage(dirfd, out_fd, keys, first, exts, rels, *rest)

    _stage_dir._C = SwapFirst
try:
    s = feedpipe.shard(src, out, workers=2, on_error=on_error, method=method)
    print(json.dumps({"samples": s.samples, "skipped": s.skipped_inputs}))
except feedpipe.FeedpipeError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def _swap_run(src: Path, out: Path, target: str, on_error: str, method: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", _SWAP_SCRIPT, str(src), str(out), target, on_error,
                        method], capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _two_dir_tree(src: Path) -> None:
    write_tree(src, [f"{d}/{i}.jpg" for d in "abc" for i in range(3)])


@pytest.mark.parametrize("method", ["general", "auto"])  # auto: one pass first, then general
def test_a_source_file_turned_into_a_fifo_during_the_run_never_hangs(
        tmp_path: Path, method: str) -> None:
    for on_error in ("raise", "skip"):
        src = tmp_path / f"src-{on_error}"
        _two_dir_tree(src)
        out = tmp_path / f"out-{on_error}"
        got = _swap_run(src, out, "b/1.jpg", on_error, method)
        if on_error == "raise":
            assert got["error"] == "InputError", got
            assert "b/1.jpg" in str(got["message"]) and "not a regular file" in str(
                got["message"]), got
        else:
            assert got["samples"] == 8, got
            assert [s["path"] for s in got["skipped"]] == ["b/1.jpg"]  # type: ignore[union-attr]
            assert "not a regular file" in got["skipped"][0]["reason"]  # type: ignore[index]
        assert not _leftovers(out)


def test_a_fifo_in_the_tree_is_named_or_skipped(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _two_dir_tree(src)
    os.mkfifo(src / "a" / "pipe.jpg")
    r = run_feedpipe("shard", src, tmp_path / "o1", "--workers", "2", timeout=HANG)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "a/pipe.jpg" in r.stderr and "not a regular file" in r.stderr
    assert "--on-error skip" in r.stderr
    r = run_feedpipe("shard", src, tmp_path / "o2", "--workers", "2", "--on-error", "skip",
                     "--json", timeout=HANG)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["samples"] == 9
    assert [s["path"] for s in summary["skipped_inputs"]] == ["a/pipe.jpg"]


def test_read_local_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    from feedpipe.convert._sources import read_local

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # a writer holding the FIFO open with bytes in it: a reader that does not check the type
    # gets those bytes instead of blocking (so a regression fails here rather than hangs)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(writer, b"not a file")
        with pytest.raises(OSError, match="not a regular file \\(a FIFO\\)"):
            read_local(str(fifo), 10)
    finally:
        os.close(writer)
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError, match="not a regular file \\(a directory\\)"):
        read_local(str(tmp_path / "dir"), 10)


def _bad_name_tree(src: Path) -> bytes:
    """A tree of 6 samples and one file whose name is not UTF-8; that name, as bytes."""
    _two_dir_tree(src)
    bad = os.fsencode(str(src / "a")) + b"/bad\xff name.jpg"
    with open(bad, "wb") as f:
        f.write(b"data")
    return bad


@pytest.mark.parametrize("method", ["general", "auto"])
def test_a_file_name_that_is_not_utf8_is_skipped_and_recorded_escaped(
        tmp_path: Path, method: str) -> None:
    src = tmp_path / "src"
    _bad_name_tree(src)
    out = tmp_path / "o"
    r = run_feedpipe("shard", src, out, "--on-error", "skip", "--workers", "2", "--method",
                     method, "--json", timeout=HANG)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert doc["total_samples"] == 9
    assert doc["skipped"] == [{"path": "a/bad\\xff name.jpg",
                               "reason": doc["skipped"][0]["reason"]}]
    assert "not valid UTF-8" in doc["skipped"][0]["reason"]
    assert json.loads(r.stdout)["skipped_inputs"] == doc["skipped"]
    assert not _leftovers(out) and not [n for n in os.listdir(out) if n.startswith(".manifest")]
    assert len(read_dataset(out)) == 9
    # --resume of the finished run, and of a run stopped after its first shard
    r = run_feedpipe("shard", src, out, "--on-error", "skip", "--resume")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "manifest.json").read_text(encoding="utf-8")) == doc
    out2 = tmp_path / "o2"

    class Stop(Exception):
        pass

    def stop(rec: object) -> None:
        raise Stop

    with pytest.raises(Stop):
        feedpipe.shard(str(src), str(out2), on_error="skip", max_samples=4, workers=1,
                       on_shard=stop)
    s = feedpipe.shard(str(src), str(out2), on_error="skip", max_samples=4, workers=1,
                       resume=True)
    assert s.reused_shards == 1 and s.skipped == 1
    assert s.skipped_inputs[0]["path"] == "a/bad\\xff name.jpg"
    assert not _leftovers(out2)


def test_a_file_name_that_is_not_utf8_is_named_under_raise(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _bad_name_tree(src)
    with pytest.raises(InputError, match=r"a/bad\\xff name\.jpg: file name is not valid UTF-8"):
        feedpipe.shard(str(src), str(tmp_path / "o"), workers=1)
    r = run_feedpipe("shard", src, tmp_path / "o2", "--workers", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "a/bad\\xff name.jpg" in r.stderr and "--on-error skip" in r.stderr


def test_a_failure_while_writing_the_manifest_leaves_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from feedpipe.errors import OutputError
    from feedpipe.format._manifest import Manifest

    src = tmp_path / "src"
    _two_dir_tree(src)

    def full(self: Manifest) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Manifest, "to_json", full)
    out = tmp_path / "o"
    with pytest.raises(OutputError, match="manifest.json: disk full"):
        feedpipe.shard(str(src), str(out), workers=1)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    monkeypatch.undo()
    s = feedpipe.shard(str(src), str(out), workers=1, resume=True)
    assert s.samples == 9 and (out / "manifest.json").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_files_whose_extensions_differ_only_in_case_are_refused_naming_both(
        tmp_path: Path, workers: str) -> None:
    """x.jpg and x.JPG made one sample of fields 'jpg' and 'JPG', which webdataset (it takes
    extensions in lower case) cannot read."""
    src = tmp_path / "src"
    write_tree(src, ["a/x.jpg", "a/x.JPG", "b/y.jpg"])
    r = run_feedpipe("shard", src, tmp_path / "o", "--workers", workers)
    assert r.returncode != 0
    assert "a/x.JPG and a/x.jpg make one sample whose fields differ only in case" in r.stderr \
        or "a/x.jpg and a/x.JPG make one sample whose fields differ only in case" in r.stderr, \
        r.stderr
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_a_file_whose_extension_is_the_class_field_but_for_case_is_refused(
        tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, ["a/x.jpg", "a/x.CLS", "b/y.jpg"])
    with pytest.raises(feedpipe.errors.KeyClashError,
                       match=r"a/x\.CLS and the 'cls' field of --labels-from-dirs make one "
                             r"sample whose fields differ only in case"):
        feedpipe.shard(str(src), str(tmp_path / "o"), labels_from_dirs=True, workers=1)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("change", ["grown", "shrunk"])
def test_a_file_whose_size_changed_after_the_listing_is_taken_as_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, change: str) -> None:
    # the general path lists sizes before it reads (the one-pass path takes its sizes from the
    # reads): a file that changes in between is read whole, and the shards, index and manifest
    # hold what was read, a sound dataset
    from feedpipe.convert import _shard_run

    src = tmp_path / "src"
    write_tree(src, [f"{d}/{i}.bin" for d in "ab" for i in range(4)])
    target = src / "a" / "2.bin"
    new = b"x" * (3000 if change == "grown" else 3)
    real_plan = _shard_run.plan_shards

    def plan_then_change(*a, **k):  # type: ignore[no-untyped-def]
        plan = real_plan(*a, **k)
        target.write_bytes(new)  # after the listing took its size, before any read
        return plan

    monkeypatch.setattr(_shard_run, "plan_shards", plan_then_change)
    out = tmp_path / "out"
    s = feedpipe.shard(str(src), str(out), workers=workers, method="general")
    assert s.samples == 8
    got = {r["__key__"]: r["bin"] for r in read_dataset(out)}
    assert got["a/2"] == new
    assert feedpipe.verify(str(out), show_progress=False).ok


def test_the_plan_fingerprint_hashes_each_field_of_each_sample_in_order() -> None:
    # the digest --resume compares: its bytes must not move whichever way they are gathered
    import hashlib

    from feedpipe.convert._shard_plan import plan_fingerprint
    from feedpipe.convert._sources import FileRef, SampleSpec

    one = SampleSpec("a/1", [FileRef("jpg", "a/1.jpg", 10)])
    two = SampleSpec("a/2", [FileRef("jpg", "a/2.jpg", 20), FileRef("json", "a/2.json", 3)])
    cls = SampleSpec("b/1", [FileRef("png", "b/1.png", 7)], [("cls", b"1")])
    plan = [[[one, two]], [[cls], [one]]]
    h = hashlib.sha256(json.dumps({"x": 1}, sort_keys=True).encode())
    for s, parts in enumerate(plan):
        for spec in (spec for part in parts for spec in part):
            h.update(f"{s}\0{spec.key}\0".encode())
            for f in spec.files:
                h.update(f"{f.ext}\0{f.path}\0{f.size}\0".encode())
            for e, b in spec.extras:
                h.update(e.encode() + b"\0" + hashlib.sha256(b).digest())
    assert plan_fingerprint({"x": 1}, plan) == h.hexdigest()
