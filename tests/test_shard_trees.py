"""``feedpipe shard`` on trees as people have them: symbolic links to class directories and files
(followed, loops named), output directories inside the source (skipped, never a class), empty
sources (an error)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from conftest import dir_bytes, read_dataset, run_feedpipe, write_tree

import feedpipe
from feedpipe.convert._listing import list_tree_parallel
from feedpipe.convert._sources import list_tree
from feedpipe.errors import InputError


def _classes_tree(root: Path, classes: str = "abc", per: int = 3) -> None:
    write_tree(root, [f"{c}/{i}.jpg" for c in classes for i in range(per)])


def _listing(src: Path, workers: int, **kw: object) -> tuple[list[str], list[tuple[str, str]],
                                                              list[str] | None]:
    if workers == 0:
        got = list_tree(str(src), **kw)  # type: ignore[arg-type]
        return [s.key for s in got.samples], got.problems, got.classes
    with list_tree_parallel(str(src), workers=workers, **kw) as t:  # type: ignore[arg-type]
        return [s.key for s in t], t.problems, t.classes


@pytest.mark.parametrize("workers", [1, 2])
def test_symlinked_class_directories_and_files_are_followed(tmp_path: Path, workers: int) -> None:
    # images/zebra -> elsewhere/zebra (another disk, as in the issue), a linked file, and a
    # linked directory below a class: the same dataset as the tree with real copies
    elsewhere = tmp_path / "elsewhere"
    linked = tmp_path / "linked"
    _classes_tree(linked, "ab")
    _classes_tree(elsewhere, "z")
    write_tree(elsewhere, ["sub/9.jpg"])
    (linked / "z").symlink_to(elsewhere / "z")
    (linked / "a" / "sub").mkdir()
    (linked / "a" / "sub" / "9.jpg").symlink_to(elsewhere / "sub" / "9.jpg")
    shutil.copytree(linked, tmp_path / "real")  # (copies what the links point at)
    assert not any(p.is_symlink() for p in (tmp_path / "real").rglob("*"))
    outs = {}
    for name in ("real", "linked"):
        out = tmp_path / f"out-{name}-{workers}"
        s = feedpipe.shard(str(tmp_path / name), str(out), labels_from_dirs=True,
                           workers=workers)
        assert s.samples == 10 and s.skipped == 0, name
        outs[name] = dir_bytes(out)
        outs[name].pop("manifest.json")  # (it names the source)
    assert outs["linked"] == outs["real"]
    doc = json.loads((tmp_path / f"out-linked-{workers}" / "manifest.json").read_text())
    assert doc["classes"] == ["a", "b", "z"]
    assert _listing(linked, 0, labels_from_dirs=True) == _listing(linked, workers,
                                                                  labels_from_dirs=True)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_link_to_an_ancestor_or_a_cycle_is_a_named_bad_input(tmp_path: Path,
                                                               workers: int) -> None:
    src = tmp_path / "src"
    _classes_tree(src)
    (src / "a" / "up").symlink_to(src)  # a link to an ancestor
    (src / "b" / "to_c").symlink_to(src / "c")  # a cycle: b/to_c -> c, c/to_b -> b
    (src / "c" / "to_b").symlink_to(src / "b")
    (src / "self").symlink_to(src)  # at the root
    keys, problems, _ = _listing(src, workers)
    loops = sorted(p for p, _ in problems)
    assert loops == ["a/up", "b/to_c/to_b", "c/to_b/to_c", "self"]
    assert all("loop" in reason for _, reason in problems)
    # the cycle's directories are reached once through a link each, not forever
    assert sorted(keys) == sorted([f"{c}/{i}" for c in "abc" for i in range(3)]
                                  + [f"b/to_c/{i}" for i in range(3)]
                                  + [f"c/to_b/{i}" for i in range(3)])


def test_link_loops_raise_naming_the_link_or_are_skipped(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _classes_tree(src)
    (src / "a" / "up").symlink_to(src)
    with pytest.raises(InputError, match=r"a/up: symbolic link .* \(a loop\)"):
        feedpipe.shard(str(src), str(tmp_path / "o1"), workers=2)
    r = run_feedpipe("shard", src, tmp_path / "o2", "--workers", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a/up" in r.stderr, r.stderr
    s = feedpipe.shard(str(src), str(tmp_path / "o3"), workers=2, on_error="skip",
                       labels_from_dirs=True)
    assert s.samples == 9 and [x["path"] for x in s.skipped_inputs] == ["a/up"]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_chain_of_links_that_loops_is_named_a_loop(tmp_path: Path, workers: int) -> None:
    """``b -> a/c`` and ``a/c -> ../b``: no directory is ever reached (stat fails with ELOOP), so
    it is not the ancestor case, but it is a loop all the same, not a permission problem."""
    src = tmp_path / "src"
    write_tree(src, ["a/f.txt"])
    (src / "b").symlink_to("a/c")
    (src / "a" / "c").symlink_to("../b")
    keys, problems, _ = _listing(src, workers)
    assert keys == ["a/f"]
    assert [p for p, _ in problems] == ["b", "a/c"]  # (walk order: the root's entries first)
    assert all("symbolic link loop" in reason for _, reason in problems), problems
    r = run_feedpipe("shard", src, tmp_path / "o", "--workers", str(max(workers, 1)))
    assert r.returncode == 2 and "symbolic link loop" in r.stderr, r.stderr
    assert "permission" not in r.stderr


@pytest.mark.parametrize(("workers", "method"), [(1, "general"), (2, "general"), (2, "one-pass")])
def test_two_images_grouped_into_one_sample_are_announced_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int, method: str) -> None:
    """cat/x.jpg and cat/x.png share a stem: one sample with both fields (documented), which an
    ImageFolder would count as two images. Said once per run, with the count; bytes unchanged."""
    src = tmp_path / "src"
    files = write_tree(src, ["cat/x.jpg", "cat/x.png", "cat/y.jpg", "dog/z.webp", "dog/z.jpeg",
                             "dog/w.jpg", "dog/w.json"])
    caplog.set_level(logging.WARNING, logger="feedpipe")
    s = feedpipe.shard(str(src), str(tmp_path / "o"), labels_from_dirs=True, workers=workers,
                       method=method)
    assert s.samples == 4 and s.method == method
    got = {str(x["__key__"]): x for x in read_dataset(tmp_path / "o")}
    assert got["cat/x"]["jpg"] == files["cat/x.jpg"] and got["cat/x"]["png"] == files["cat/x.png"]
    warned = [r for r in caplog.records if "image" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, caplog.messages
    msg = warned[0].getMessage()
    assert "2 samples" in msg and "cat/x" in msg and "jpg" in msg and "png" in msg, msg
    assert "ImagePipeline" in msg and "image_field" in msg, msg
    caplog.clear()
    feedpipe.shard(str(src), str(tmp_path / "again"), workers=workers, max_samples=1)
    assert len([r for r in caplog.records if "image" in r.getMessage()]) == 1


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_an_output_directory_inside_the_source_is_skipped_never_a_class(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int) -> None:
    src = tmp_path / "src"
    _classes_tree(src)
    inside = src / "shards"
    caplog.set_level(logging.WARNING, logger="feedpipe")
    s = feedpipe.shard(str(src), str(inside), labels_from_dirs=True, workers=workers)
    assert s.samples == 9
    ref = tmp_path / "ref"
    feedpipe.shard(str(src), str(ref), labels_from_dirs=True, workers=workers)  # the next run
    assert json.loads((ref / "manifest.json").read_text())["classes"] == ["a", "b", "c"]
    assert [m for m in caplog.messages if "skipped" in m and "shards" in m], caplog.messages
    doc = json.loads((ref / "manifest.json").read_text())
    assert doc["created_by"]["skipped_output_dirs"] == ["shards"]
    # a conversion under way (no manifest yet, only its resume state) is output too
    caplog.clear()
    pending = src / "b" / "pending"
    pending.mkdir()
    (pending / ".feedpipe-shard-state.json").write_text("{}")
    (pending / "data-000000.tar").write_bytes(b"x" * 10)
    again = tmp_path / "again"
    s = feedpipe.shard(str(src), str(again), labels_from_dirs=True, workers=workers)
    assert s.samples == 9 and s.skipped == 0
    assert json.loads((again / "manifest.json").read_text())["created_by"][
        "skipped_output_dirs"] == ["b/pending", "shards"]
    # resuming into the output inside the source skips it, and changes nothing
    shutil.rmtree(pending)
    before = dir_bytes(inside)
    feedpipe.shard(str(src), str(inside), labels_from_dirs=True, workers=workers, resume=True)
    assert dir_bytes(inside) == before
    # a user's own manifest.json (not feedpipe's) is data like any other file
    write_tree(src, ["c/notes/manifest.json"])
    s = feedpipe.shard(str(src), str(tmp_path / "user"), workers=workers)
    assert "c/notes/manifest" in [str(x["__key__"]) for x in read_dataset(tmp_path / "user")]


def test_an_empty_source_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_feedpipe("shard", empty, tmp_path / "o")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert str(empty) in r.stderr and "has no files" in r.stderr
    assert not (tmp_path / "o").exists()
    hidden = tmp_path / "hidden"
    write_tree(hidden, [".DS_Store", "a/.keep", "b/.keep"])
    for workers in (1, 2):
        with pytest.raises(InputError, match=r"has no files to convert \(3 hidden file"):
            feedpipe.shard(str(hidden), str(tmp_path / f"h{workers}"), workers=workers)
        assert not (tmp_path / f"h{workers}").exists()
    r = run_feedpipe("shard", hidden, tmp_path / "p", "--part", "0/2")
    assert r.returncode == 2 and "has no files" in r.stderr, r.stderr
    bad = tmp_path / "bad"
    write_tree(bad, ["a/README"])
    with pytest.raises(InputError, match="has no files to convert.*1 bad input"):
        feedpipe.shard(str(bad), str(tmp_path / "b"), on_error="skip")


def test_part_summary_is_a_whole_sentence(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _classes_tree(src)
    r = run_feedpipe("shard", src, tmp_path / "o", "--part", "0/2", "--workers", "1")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("part"))
    assert line.strip() == (f"part     0/2 done; once all 2 parts are done, run `feedpipe merge "
                            f"{tmp_path / 'o'}` (or give the last part --merge)")


HIDDEN_TREE = ["a/x.jpg", "a/y.jpg", "b/z.jpg", ".DS_Store", "a/.DS_Store", ".git/HEAD",
               ".git/objects/ab/cdef", "b/.ipynb_checkpoints/z-checkpoint.txt",
               "b/.ipynb_checkpoints/.w.txt"]
# what the manifest's "skipped" says of them: each hidden file, each hidden directory once
HIDDEN_SKIPPED = [
    (".DS_Store", "hidden file (its name starts with '.'): left out"),
    (".git/", "hidden directory (its name starts with '.'): its 2 files left out"),
    ("a/.DS_Store", "hidden file (its name starts with '.'): left out"),
    ("b/.ipynb_checkpoints/", "hidden directory (its name starts with '.'): its 2 files left "
                              "out"),
]


@pytest.mark.parametrize("method", ["one-pass", "general"])
def test_hidden_files_are_listed_as_left_out_with_their_reason(tmp_path: Path,
                                                               method: str) -> None:
    """Issue 41: hidden files were left out with only a count in the manifest, unlike every
    other input left out, which is listed with its reason."""
    src = tmp_path / "src"
    write_tree(src, HIDDEN_TREE)
    out = tmp_path / "out"
    r = run_feedpipe("shard", src, out, "--no-progress", "--workers", "2", "--method", method,
                     "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["method"] == method and s["samples"] == 3
    m = json.loads((out / "manifest.json").read_text())
    assert [(x["path"], x["reason"]) for x in m["skipped"]] == HIDDEN_SKIPPED
    assert [(x["path"], x["reason"]) for x in s["skipped_inputs"]] == HIDDEN_SKIPPED
    assert s["skipped"] == m["num_skipped"] == 4
    assert m["created_by"]["ignored_hidden_files"] == 6
    r = run_feedpipe("shard", src, tmp_path / "text", "--no-progress", "--method", method,
                     "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "  skipped           4   (listed in manifest.json)" in r.stdout, r.stdout
    assert "  skipped: .git/: hidden directory (its name starts with '.'): its 2 files left " \
        "out" in r.stdout, r.stdout


def test_hidden_files_are_listed_once_in_a_merged_dataset(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, HIDDEN_TREE)
    out = tmp_path / "out"
    for i in range(2):
        feedpipe.shard(str(src), str(out), part=(i, 2), merge=True, workers=1)
    m = feedpipe.load_manifest(str(out))
    assert [(x["path"], x["reason"]) for x in m.skipped] == HIDDEN_SKIPPED


def test_samples_of_several_images_are_all_named_in_a_merged_dataset(tmp_path: Path) -> None:
    """Issue 41: each part names its own; the merged manifest names every one, once."""
    src = tmp_path / "src"
    write_tree(src, ["a/x.jpg", "a/x.png", "a/w.jpg", "b/y.jpg", "b/y.png", "b/y.json",
                     "c/z.jpg"])
    out = tmp_path / "out"
    for i in range(2):
        feedpipe.shard(str(src), str(out), part=(i, 2), merge=True, workers=1, shuffle=True)
    m = feedpipe.load_manifest(str(out))
    assert m.created_by["several_images"] == [
        {"key": "a/x", "images": ["a/x.jpg", "a/x.png"], "taken": "a/x.jpg"},
        {"key": "b/y", "images": ["b/y.jpg", "b/y.png"], "taken": "b/y.jpg"}]
