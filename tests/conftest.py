"""Shared fixtures: small deterministic source folders, a sharded copy, and helpers for running the
``feedpipe`` command in a real subprocess and for comparing whole output directories."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from feedpipe.convert._shard import shard
from feedpipe.convert._synth import make_image_folder, make_records
from feedpipe.format._manifest import load_manifest
from feedpipe.format._reader import ShardReader

# a script run by tests/test_fork_after_cuda.py, with no __main__ guard on purpose: importing it
# (as --doctest-modules would) runs it
collect_ignore = ["_fork_script.py"]


# how many slow tests a plain run left out, for its closing lines
_SLOW_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", default=False,
        help="also run the tests marked slow (left out of a plain run; CI runs them: .ci/run)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A plain run leaves out the tests marked ``slow`` and says how many, so that the README's
    command stays short; ``--slow``, a ``-m`` expression that names ``slow``, or a test named by
    its node id (``path::name``) keeps them."""
    if config.getoption("slow") or "slow" in (config.getoption("markexpr") or ""):
        return
    named = tuple(a for a in config.args if "::" in a)
    slow = [it for it in items if it.get_closest_marker("slow") is not None
            and not it.nodeid.startswith(named)]
    if not slow:
        return
    config.hook.pytest_deselected(items=slow)
    left_out = set(map(id, slow))
    items[:] = [it for it in items if id(it) not in left_out]
    config.stash[_SLOW_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    n = config.stash.get(_SLOW_LEFT_OUT, 0)
    if n:
        terminalreporter.write_line(
            f"{n} tests marked slow were left out: run them with --slow (CI does: .ci/run)")


def run_feedpipe(
    *args: object, timeout: float = 120, **kw: object
) -> subprocess.CompletedProcess[str]:
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


_METHOD_LINE = re.compile(rb'\n  "method": "[a-z-]+",')


def dataset_bytes(path: Path) -> dict[str, bytes]:
    """``dir_bytes`` without the one thing the conversion method decides: the manifest's
    ``created_by.method`` (the general and one-pass methods write the same bytes otherwise)."""
    got = dir_bytes(path)
    if "manifest.json" in got:
        got["manifest.json"] = _METHOD_LINE.sub(b"", got["manifest.json"], count=1)
    return got


def method_of(path: Path) -> str:
    """The conversion method recorded in the manifest of the dataset at ``path``."""
    return str(load_manifest(str(path)).created_by["method"])


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
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Shards of ``_data.make_dataset``'s defaults: 25 images in 5 classes, shards of 7.

    Session-scoped and shared: read it only. Modules that need another dataset (or to write
    into it) define their own ``ds_path``, which takes precedence."""
    from _data import make_dataset

    return make_dataset(str(tmp_path_factory.mktemp("ds")))


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


# Source files whose names break naive key rules: dots in the stem, spaces, '%', a literal
# '%2E', unicode, a backslash next to a real directory of the same spelling, a tab, and member
# names longer than the 100-byte ustar name field (one fits the ustar prefix, one needs a GNU
# long-name record).
ODD_NAMES = [
    "a/cat.v2.jpg",
    "a/cat.v2.json",
    "a/cat.jpg",
    "my dir/100% done.txt",
    "my dir/%2E.txt",
    "multi.dot.name.tar.gz",
    "dir.with.dots/file.txt",
    "back\\slash.txt",
    "back/slash.txt",
    "tabs/x\ty.txt",
    "long/" + "d" * 60 + "/" + "n" * 70 + ".bin",
    "long2/" + "x" * 150 + ".bin",
]
UNICODE_NAMES = ["ünïcødé/猫 🙂.png", "ünïcødé/猫 🙂.json"]


def write_tree(root: Path, names: list[str]) -> dict[str, bytes]:
    """Write one small file per relative name (content derived from the name); return them."""
    files = {}
    for i, rel in enumerate(names):
        data = (f"{i}:{rel}\n" * (1 + i % 5)).encode("utf-8")
        p = root.joinpath(*rel.split("/"))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        files[rel] = data
    return files


@pytest.fixture(scope="session")
def odd_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A tree of oddly named files (ASCII and unicode) and their contents by relative path."""
    root = tmp_path_factory.mktemp("odd")
    return root, write_tree(root, ODD_NAMES + UNICODE_NAMES)


@pytest.fixture(scope="session")
def ascii_odd_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """Like ``odd_folder`` without non-ASCII names (GNU tar, hence ``wds2idx``, quotes them)."""
    root = tmp_path_factory.mktemp("ascii_odd")
    return root, write_tree(root, ODD_NAMES)


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
