"""A storage backend of one's own: any fsspec filesystem registered under a protocol is read by
feedpipe through that protocol's URLs, with no change to feedpipe (docs/extending.md, "A storage
backend"). ``dirstore://`` keeps each object as a file under one directory, which it takes from
fsspec's configuration, as a backend takes its endpoint and credentials."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.spec import AbstractFileSystem

from feedpipe import FeedDataset, FeedLoader, shard, verify

EXAMPLE = Path(__file__).resolve().parent.parent / "shards" / "example"


class DirStore(AbstractFileSystem):
    """A backend feedpipe has never heard of: ``ls``, ``info`` (from ``ls``) and ``_open`` are
    all it implements; fsspec derives byte ranges, sizes, ``find`` and ``walk`` from them."""

    protocol = ("dirstore",)
    calls: list[str] = []  # what feedpipe asked of the backend

    def __init__(self, root: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = root

    def _local(self, path: str) -> str:
        return os.path.join(self.root, self._strip_protocol(path).strip("/"))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        self.calls.append("ls")
        key = self._strip_protocol(path).strip("/")
        full = self._local(key)
        if os.path.isfile(full):
            found = [(key, full)]
        else:
            found = [(f"{key}/{n}" if key else n, os.path.join(full, n))
                     for n in sorted(os.listdir(full))]  # FileNotFoundError when missing
        out = [{"name": name, "type": "file" if os.path.isfile(f) else "directory",
                "size": os.path.getsize(f) if os.path.isfile(f) else 0} for name, f in found]
        return out if detail else [e["name"] for e in out]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self.calls.append("open")
        return open(self._local(path), mode)


@pytest.fixture
def dirstore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``dirstore://`` registered, its objects under ``tmp_path / "store"``."""
    root = tmp_path / "store"
    root.mkdir()
    fsspec.register_implementation("dirstore", DirStore, clobber=True)
    # the backend's own configuration, as fsspec hands it to the filesystem (no option of
    # feedpipe's names it)
    monkeypatch.setitem(fsspec.config.conf, "dirstore", {"root": str(root)})
    monkeypatch.setattr(DirStore, "calls", [])
    return root


def test_a_dataset_on_a_registered_protocol_reads_as_the_local_one(dirstore: Path) -> None:
    shutil.copytree(EXAMPLE, dirstore / "data" / "example")
    ds = FeedDataset("dirstore://data/example", decode={"cls": int}, shuffle=True, seed=3)
    local = FeedDataset(str(EXAMPLE), decode={"cls": int}, shuffle=True, seed=3)
    assert not ds.shards.local  # read with range requests through the backend
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in local]
    assert ds[5]["jpg"] == local[5]["jpg"]
    got = list(FeedLoader(ds, batch_size=5))
    want = list(FeedLoader(local, batch_size=5))
    assert [b["__key__"] for b in got] == [b["__key__"] for b in want]
    assert all(torch.equal(a["cls"], b["cls"]) for a, b in zip(got, want))
    assert "open" in DirStore.calls
    assert verify("dirstore://data/example").ok


def test_a_tree_on_a_registered_protocol_converts_as_the_local_one(dirstore: Path,
                                                                    tmp_path: Path) -> None:
    tree = dirstore / "tree"
    for i in range(6):
        (tree / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tree / f"c{i % 2}" / f"{i}.txt").write_text(f"sample {i}")
    summary = shard("dirstore://tree", str(tmp_path / "out"))
    local = shard(str(tree), str(tmp_path / "out-local"))
    assert summary.samples == local.samples == 6
    assert "ls" in DirStore.calls
    got = sorted((s["__key__"], bytes(s["txt"])) for s in FeedDataset(str(tmp_path / "out")))
    want = sorted((s["__key__"], bytes(s["txt"])) for s in FeedDataset(str(tmp_path / "out-local")))
    assert got == want


class FlakyStore(DirStore):
    """A backend whose listing of a top directory fails once with a dropped connection before
    it answers."""

    protocol = ("flakystore",)
    failed: set[str] = set()

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        key = self._strip_protocol(path).strip("/")
        if key.count("/") == 0 and key not in self.failed:
            self.failed.add(key)
            raise ConnectionResetError(f"connection reset listing {key}")
        return super().ls(path, detail=detail, **kwargs)


def test_a_listing_that_fails_once_is_retried_as_a_read_is(dirstore: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the converters' listings go through feedpipe._helpers.storage_listing, which retries a
    # transient failure as the reads do (they were called on the filesystem directly, and a
    # dropped connection while listing ended the conversion)
    fsspec.register_implementation("flakystore", FlakyStore, clobber=True)
    monkeypatch.setitem(fsspec.config.conf, "flakystore", {"root": str(dirstore)})
    monkeypatch.setattr(FlakyStore, "failed", set())
    tree = dirstore / "tree"
    for i in range(4):
        (tree / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tree / f"c{i % 2}" / f"{i}.txt").write_text(f"sample {i}")
    summary = shard("flakystore://tree", str(tmp_path / "out"))
    assert summary.samples == 4
    assert "tree" in FlakyStore.failed  # its listing did fail once
