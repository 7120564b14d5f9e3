"""The parallel, streamed listing (:mod:`feedpipe.convert._listing`) equals the one-process
listing exactly: samples, order, problems, classes, hidden files; locally with worker processes
and over fsspec."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
from conftest import is_root, write_tree

from feedpipe.convert._listing import list_tree_parallel
from feedpipe.convert._sources import list_tree

EXTRA = [".hidden/x.txt", "sub/.git/config.txt", "noext", "z/bad ext.a b", "top.txt",
         "z/y/deep.bin", "a b/c.txt", "a-b/c.txt", "a.b/c.txt"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import ODD_NAMES, UNICODE_NAMES

    root = tmp_path_factory.mktemp("listing")
    write_tree(root, ODD_NAMES + UNICODE_NAMES + EXTRA)
    (root / "z" / "empty.txt").write_bytes(b"")
    return root


@pytest.mark.parametrize("workers", [1, 2])
def test_parallel_listing_equals_list_tree(tree: Path, workers: int) -> None:
    want = list_tree(str(tree))
    with list_tree_parallel(str(tree), workers=workers) as got:
        assert got.samples == len(want.samples)
        assert got.files == sum(len(s.files) for s in want.samples)
        assert len(got.chunks) == 1 + sum(1 for p in tree.iterdir() if p.is_dir())
        assert got.to_listing() == want
    assert want.problems and want.ignored == 2  # the fixture does exercise both


def test_labels_from_dirs_and_streaming(image_folder: Path) -> None:
    want = list_tree(str(image_folder), labels_from_dirs=True)
    t = list_tree_parallel(str(image_folder), labels_from_dirs=True, workers=2)
    try:
        assert t.classes == want.classes == ["cls_000", "cls_001", "cls_002"]
        stream = iter(t)
        assert next(stream) == want.samples[0]  # a generator over the chunk files
        assert [next(stream) for _ in range(3)] == want.samples[1:4]
    finally:
        t.close()
    assert not os.path.exists(t._tmp)  # the chunks are gone once closed


@pytest.mark.skipif(is_root(), reason="root reads any directory")
def test_unlistable_directory_is_the_same_problem(tree: Path, tmp_path: Path) -> None:
    import shutil

    src = Path(shutil.copytree(tree, tmp_path / "src"))
    (src / "z" / "y").chmod(0)
    try:
        with list_tree_parallel(str(src), workers=2) as got:
            assert got.to_listing() == list_tree(str(src))
            assert ("z/y", "cannot stat or list it (permission or broken link)") in got.problems
    finally:
        (src / "z" / "y").chmod(0o755)


def test_fsspec_listing_in_threads_equals_list_tree(tree: Path) -> None:
    fs = fsspec.filesystem("memory")
    for p in sorted(tree.rglob("*")):
        if p.is_file():
            fs.pipe(f"/listing-test/{p.relative_to(tree).as_posix()}", p.read_bytes())
    try:
        url = "memory:///listing-test"
        with list_tree_parallel(url, workers=3) as got:
            assert got.to_listing() == list_tree(url)
    finally:
        fs.rm("/listing-test", recursive=True)


def test_progress_bar_counts_directories(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with list_tree_parallel(str(tree), workers=1, show_progress=True):
        pass
    err = capsys.readouterr().err
    n = sum(1 for p in tree.iterdir() if p.is_dir())
    assert "list: 100%" in err and f"{n}.0/{n}.0" in err and "files" in err


def test_chunks_of_several_records_and_the_collector_left_as_it_was(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    from feedpipe.convert import _listing as listing

    monkeypatch.setattr(listing, "CHUNK_ROWS", 2)  # every chunk file holds several records
    want = list_tree(str(tree))
    with list_tree_parallel(str(tree), workers=1) as got:
        assert got.to_listing() == want and gc.isenabled()
        gc.disable()
        try:
            assert got.to_listing() == want and not gc.isenabled()
        finally:
            gc.enable()
