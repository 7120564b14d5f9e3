"""``manifest.json`` that is wrong (issue 23, defects 5 and 15), paths that are not a dataset
(issue 25), and what ``feedpipe verify`` did not check (issue 23): each refused or reported with
the file, the field and what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_feedpipe

import feedpipe
from feedpipe.errors import (
    CompressedShardError,
    ManifestError,
    PlanError,
    SourceNotFoundError,
)
from feedpipe.format._manifest import load_manifest


def _edit(root: Path, change: Any) -> None:
    doc = json.loads((root / "manifest.json").read_text())
    change(doc)
    (root / "manifest.json").write_text(json.dumps(doc))


# -- defect 5: a shard listed twice -------------------------------------------------------------
def test_manifest_listing_a_shard_twice_is_refused(sharded_copy: Path) -> None:
    def dup(doc: dict[str, Any]) -> None:
        doc["shards"].append(dict(doc["shards"][0]))
        doc["total_samples"] += doc["shards"][0]["samples"]

    _edit(sharded_copy, dup)
    msg = (r"manifest\.json: shard 'data-000000\.tar' is listed twice "
           r"\(shards\[0\] and shards\[5\]\)")
    with pytest.raises(ManifestError, match=msg):
        load_manifest(str(sharded_copy))
    with pytest.raises(ManifestError, match=msg):
        feedpipe.FeedDataset(str(sharded_copy))
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 2 and "listed twice" in r.stderr and "Traceback" not in r.stderr


# -- defect 15: wrong types and values ----------------------------------------------------------
@pytest.mark.parametrize("path,value,field", [
    (("shards", 0, "samples"), "50", r"shards\[0\]\.samples"),
    (("shards", 0, "samples"), -1, r"shards\[0\]\.samples"),
    (("shards", 1, "samples"), True, r"shards\[1\]\.samples"),
    (("shards", 2, "bytes"), 1.5, r"shards\[2\]\.bytes"),
    (("shards", 2, "bytes"), -5, r"shards\[2\]\.bytes"),
    (("shards", 3, "sha256"), 5, r"shards\[3\]\.sha256"),
    (("shards", 3, "sha256"), "abc", r"shards\[3\]\.sha256"),
    (("shards", 4, "name"), 3, r"shards\[4\]\.name"),
    (("shards", 4, "name"), "/abs/x.tar", r"shards\[4\]\.name"),
    (("shards", 4, "name"), "../x.tar", r"shards\[4\]\.name"),
    (("shards", 4, "name"), "", r"shards\[4\]\.name"),
    (("shards", 4, "color"), "red", r"shards\[4\]: unknown key 'color'"),
    (("shards", 1), "data-000001.tar", r"shards\[1\]"),
    (("shards",), {"a": 1}, r"\"shards\""),
    (("fields",), "jpg", r"\"fields\""),
    (("classes",), "cat", r"\"classes\""),
    (("classes",), [1, 2], r"\"classes\""),
    (("total_samples",), "30", r"\"total_samples\""),
    (("skipped",), 3, r"\"skipped\""),
    (("created_by",), [], r"\"created_by\""),
])
def test_manifest_with_wrong_types_names_the_field(
    sharded_copy: Path, path: tuple[Any, ...], value: Any, field: str
) -> None:
    def change(doc: dict[str, Any]) -> None:
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    _edit(sharded_copy, change)
    with pytest.raises(ManifestError, match=rf"manifest\.json: .*{field}"):
        load_manifest(str(sharded_copy))


def test_wrong_types_through_dataset_and_verify(sharded_copy: Path) -> None:
    _edit(sharded_copy, lambda doc: doc["shards"][0].update(samples="50"))
    with pytest.raises(ManifestError, match=r"manifest\.json: shards\[0\]\.samples must be"):
        feedpipe.FeedDataset(str(sharded_copy))
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "manifest.json" in r.stderr and "shards[0].samples" in r.stderr


def test_a_manifest_of_no_samples_is_still_a_plan_error(sharded_copy: Path) -> None:
    _edit(sharded_copy, lambda doc: doc.update(shards=[], total_samples=0))
    with pytest.raises(PlanError, match="holds no samples"):
        feedpipe.FeedDataset(str(sharded_copy))


# -- issue 34: a shard counted 0 --------------------------------------------------------------
def test_a_shard_counted_zero_is_refused_everywhere(sharded_copy: Path) -> None:
    """Edited to 0, a shard's samples were left out in silence by FeedDataset iteration (the plan
    gives such a shard no ids) while FeedLoader and verify refused it: refused alike at open."""
    import torch

    def zero(doc: dict[str, Any]) -> None:
        doc["total_samples"] -= doc["shards"][1]["samples"]
        doc["shards"][1]["samples"] = 0

    _edit(sharded_copy, zero)
    msg = (r"manifest\.json: shards\[1\]\.samples is 0 for shard 'data-000001\.tar'.*"
           rf"feedpipe index {sharded_copy}")
    with pytest.raises(ManifestError, match=msg):
        list(torch.utils.data.DataLoader(feedpipe.FeedDataset(str(sharded_copy)),
                                         batch_size=None))
    with pytest.raises(ManifestError, match=msg):
        feedpipe.FeedLoader(feedpipe.FeedDataset(str(sharded_copy)), batch_size=2)
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "shards[1].samples is 0" in r.stderr and "data-000001.tar" in r.stderr


# -- issue 25: a path that is not a dataset -----------------------------------------------------
def test_a_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match=r"shardz: does not exist"):
        feedpipe.FeedDataset(str(tmp_path / "shardz"))


def test_a_source_tree_is_told_to_shard(image_folder: Path) -> None:
    with pytest.raises(SourceNotFoundError) as ei:
        feedpipe.FeedDataset(str(image_folder))
    msg = str(ei.value)
    assert "no manifest.json" in msg and "source" in msg
    assert f"feedpipe shard {image_folder} OUT" in msg


def test_a_directory_of_tars_without_manifest_is_told_to_index(
    sharded: Path, tmp_path: Path
) -> None:
    d = tmp_path / "tars"
    d.mkdir()
    for t in sharded.glob("*.tar"):
        shutil.copy(t, d)
    with pytest.raises(SourceNotFoundError, match=rf"no manifest\.json.*5 \.tar.*`feedpipe index "
                                                  rf"{d}`"):
        feedpipe.FeedDataset(str(d))


def test_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match=r"is empty"):
        feedpipe.FeedDataset(str(tmp_path))


def test_a_single_shard_is_told_to_pass_its_directory(sharded: Path) -> None:
    with pytest.raises(SourceNotFoundError) as ei:
        feedpipe.FeedDataset(str(sharded / "data-000000.tar"))
    msg = str(ei.value)
    assert "is a shard, not a dataset" in msg and f"manifest.json, {sharded} (" in msg
    # the same words fit `feedpipe verify`: a fix in Python syntax does not
    assert "FeedDataset(" not in msg


def test_a_compressed_shard_or_directory_of_them(tmp_path: Path) -> None:
    xz = tmp_path / "data.tar.xz"
    xz.write_bytes(b"\xfd7zXZ\x00")
    with pytest.raises(CompressedShardError, match=r"data\.tar\.xz: compressed shards.*unxz"):
        feedpipe.FeedDataset(str(xz))
    with pytest.raises(CompressedShardError, match=r"data\.tar\.xz: compressed shards"):
        feedpipe.FeedDataset(str(tmp_path))
    # gzip shards are read once indexed: the sentence says so
    xz.unlink()
    gz = tmp_path / "data.tar.gz"
    gz.write_bytes(b"\x1f\x8b\x08\0")
    with pytest.raises(SourceNotFoundError, match=r"data\.tar\.gz: is a shard, not a dataset"):
        feedpipe.FeedDataset(str(gz))
    with pytest.raises(SourceNotFoundError,
                       match=rf"but 1 \.tar shard .*feedpipe index {tmp_path}"):
        feedpipe.FeedDataset(str(tmp_path))


def test_verify_and_cli_give_the_same_sentence(image_folder: Path, tmp_path: Path) -> None:
    r = run_feedpipe("verify", image_folder)
    assert r.returncode == 2 and "feedpipe shard" in r.stderr and r.stderr.count("\n") == 1
    r = run_feedpipe("verify", tmp_path / "nope")
    assert r.returncode == 2 and "does not exist" in r.stderr


# -- verify says what it did not check ----------------------------------------------------------
def test_verify_warns_about_a_shard_without_hash(sharded_copy: Path) -> None:
    _edit(sharded_copy, lambda doc: doc["shards"][2].update(sha256=None))
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 0
    assert "WARNING" in r.stdout and "data-000002.tar" in r.stdout and "sha256" in r.stdout
    assert ": OK\n" not in r.stdout and "1 warning" in r.stdout
    doc = json.loads(run_feedpipe("verify", sharded_copy, "--json").stdout)
    assert doc["ok"] is True and doc["problems"] == []
    assert [(w["kind"], w["shard"].rsplit("/", 1)[-1]) for w in doc["warnings"]] == [
        ("unchecked", "data-000002.tar")]


def test_verify_warns_about_an_unlisted_tar(sharded_copy: Path) -> None:
    shutil.copy(sharded_copy / "data-000000.tar", sharded_copy / "extra.tar")
    report = feedpipe.verify(str(sharded_copy))
    assert report.ok and [(w.kind, Path(w.shard).name) for w in report.warnings] == [
        ("unlisted", "extra.tar")]
    r = run_feedpipe("verify", sharded_copy)
    assert r.returncode == 0 and "extra.tar" in r.stdout and "not listed" in r.stdout
    assert ": OK\n" not in r.stdout


def test_verify_warns_about_an_unlisted_tar_in_a_subdirectory(sharded_copy: Path) -> None:
    (sharded_copy / "old" / "deeper").mkdir(parents=True)
    shutil.copy(sharded_copy / "data-000000.tar", sharded_copy / "old" / "deeper" / "x.tar")
    (sharded_copy / "other").mkdir()  # another dataset below this one: its shards are its own
    shutil.copy(sharded_copy / "data-000000.tar", sharded_copy / "other" / "y.tar")
    shutil.copy(sharded_copy / "manifest.json", sharded_copy / "other" / "manifest.json")
    report = feedpipe.verify(str(sharded_copy))
    assert report.ok and [(w.kind, w.shard) for w in report.warnings] == [
        ("unlisted", str(sharded_copy / "old" / "deeper" / "x.tar"))]
    doc = json.loads(run_feedpipe("verify", sharded_copy, "--json").stdout)
    assert [w["shard"] for w in doc["warnings"]] == [str(sharded_copy / "old/deeper/x.tar")]


def test_a_directory_named_like_a_shard_is_not_counted_as_one(tmp_path: Path) -> None:
    (tmp_path / "data.tar").mkdir()
    with pytest.raises(SourceNotFoundError) as ei:
        feedpipe.FeedDataset(str(tmp_path))
    msg = str(ei.value)
    assert "no .tar shards" in msg and "feedpipe index" not in msg and "'data.tar/'" in msg, msg
    (tmp_path / "a.tar").write_bytes(b"")
    with pytest.raises(SourceNotFoundError, match=r"but 1 \.tar shard \("):
        feedpipe.FeedDataset(str(tmp_path))


# -- errors that say what to do ------------------------------------------------------------------
def test_a_bad_shard_record_says_to_re_create_the_manifest(sharded_copy: Path) -> None:
    _edit(sharded_copy, lambda doc: doc["shards"][0].update(samples="50"))
    with pytest.raises(ManifestError, match=r"shards\[0\]\.samples must be a non-negative "
                                            r"integer, not '50' .*`feedpipe index"):
        load_manifest(str(sharded_copy))


def test_a_missing_or_cut_shard_says_what_to_do(sharded_copy: Path) -> None:
    from feedpipe.errors import ShardFormatError
    from feedpipe.format._reader import ShardReader

    (sharded_copy / "data-000004.tar").unlink()
    with pytest.raises(SourceNotFoundError, match=r"data-000004\.tar: shard not found.*"
                                                  r"re-copy.*`feedpipe verify"):
        ShardReader(str(sharded_copy / "data-000004.tar"))
    shard = sharded_copy / "data-000001.tar"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 512)
    with pytest.raises(ShardFormatError, match=r"shard is truncated: .*the manifest says "
                                               rf"{size} .*re-copy.*`feedpipe verify"):
        ShardReader(str(shard), expected_bytes=size)
    r = run_feedpipe("index", sharded_copy / "nosuch.tar")
    assert r.returncode == 2 and "shard not found" in r.stderr and "check the path" in r.stderr
