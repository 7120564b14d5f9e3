"""Shared fixtures: small deterministic source folders, a sharded copy, and helpers for running the
``feedpipe`` command in a real subprocess and for comparing whole output directories."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from feedpipe.convert import shard
from feedpipe.manifest import load_manifest
from feedpipe.reader import ShardReader
from feedpipe.synth import make_image_folder, make_records


def run_feedpipe(*args: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    """``python -m feedpipe ARGS`` in a subprocess (stdout/stderr captured as text)."""
    return subprocess.run(
        [sys.executable, "-m", "feedpipe", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,  # type: ignore[arg-type]
    )


def dir_bytes(path: Path) -> dict[str, bytes]:
    """Every regular file directly in ``path`` (hidden ones included) -> its bytes."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def read_dataset(root: Path) -> list[dict[str, object]]:
    """All samples of a feedpipe dataset, in manifest order, fields as ``bytes``."""
    m = load_manifest(str(root))
    out: list[dict[str, object]] = []
    base = 0
    for rec in m.shards:
        with ShardReader(str(root / rec.name), name=rec.name, base=base,
                         expected_bytes=rec.bytes) as r:
            for s in r:
                out.append({k: (bytes(v) if isinstance(v, memoryview) else v)
                            for k, v in s.items()})
        base += rec.samples
    return out


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image-folder tree: ``cls_00c/000ii.jpg`` with a ``.json`` sidecar on every 3rd image.

    Session-scoped and shared: do not modify it (copy it with ``shutil.copytree``)."""
    root = tmp_path_factory.mktemp("images")
    make_image_folder(str(root), classes=3, per_class=10, sidecar_every=3, min_size=16,
                      max_size=40)
    return root


@pytest.fixture(scope="session")
def sharded(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``image_folder`` sharded with ``--labels-from-dirs``, 7 samples per shard (5 shards).

    Session-scoped and shared: tests that damage shards use ``sharded_copy``."""
    out = tmp_path_factory.mktemp("sharded") / "out"
    shard(str(image_folder), str(out), labels_from_dirs=True, max_samples=7, workers=1)
    return out


@pytest.fixture
def sharded_copy(sharded: Path, tmp_path: Path) -> Path:
    """A private copy of ``sharded`` that a test may damage."""
    return Path(shutil.copytree(sharded, tmp_path / "copy"))


@pytest.fixture(scope="session")
def records_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 binary records of 1500 bytes in ``0000d/000000i.bin`` (4 directories)."""
    root = tmp_path_factory.mktemp("records")
    make_records(str(root), count=400, size=1500, per_dir=100, seed=3)
    return root


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -m feedpipe ...`` in a subprocess."""
    return run_feedpipe


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
