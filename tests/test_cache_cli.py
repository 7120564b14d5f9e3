"""``feedpipe cache stats|clear PATH`` in a subprocess over real tiers: an L1 shard cache, an L2
function index and a decoded store made by FeedDataset and FunctionIndex in this process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from _data import make_dataset
from conftest import run_feedpipe

from feedpipe import FeedDataset, FunctionIndex
from feedpipe.transforms._pipeline import ImagePipeline

N = 25


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("ds")))  # 25 samples in 4 shards


def make_tiers(root: Path, ds_path: str) -> FeedDataset:
    """All three tiers under ``root``: the dataset read twice through L1 and a decoded store, and
    a function index holding 3 entries. Returns the dataset (its store still open)."""
    ds = FeedDataset(ds_path, transform=ImagePipeline(8, train=False, mean=None),
                     cache_dir=root / "shards", decoded_cache=root / "decoded")
    for e in (0, 1):
        ds.set_epoch(e)
        assert len(list(ds)) == N
    with FunctionIndex(str(root / "memo")) as idx:
        f = idx.wrap(bytes.upper)
        for b in (b"a", b"b", b"c", b"a"):
            f(b)
    return ds


def stats(root: Path) -> dict[str, Any]:
    out = run_feedpipe("cache", "stats", root, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["path"] == str(root)
    return {t["tier"]: t for t in doc["tiers"]}


def test_stats_finds_every_tier_with_sizes_and_counts(ds_path: str, tmp_path: Path) -> None:
    make_tiers(tmp_path, ds_path)
    tiers = stats(tmp_path)
    assert set(tiers) == {"L1 shards", "L2 function index", "decoded store"}
    l1, l2, dec = tiers["L1 shards"], tiers["L2 function index"], tiers["decoded store"]
    assert l1["path"] == str(tmp_path / "shards") and l1["entries"] == 4 and l1["bytes"] > 0
    assert (l2["entries"], l2["hits"], l2["misses"]) == (3, None, None) and l2["bytes"] > 0
    assert dec["entries"] == N and dec["details"]["samples"] == N
    assert (dec["hits"], dec["misses"]) == (N, N)  # recorded across processes
    assert dec["details"]["leaves"] == ["tensor uint8[3, 8, 8]", "int int64[]"]
    assert dec["bytes"] >= N * dec["details"]["record_bytes"]
    table = run_feedpipe("cache", "stats", tmp_path)
    assert table.returncode == 0, table.stderr
    for text in ("L1 shards", "L2 function index", "decoded store", f"{N}/{N}", "memo",
                 "tensor uint8[3, 8, 8]"):
        assert text in table.stdout


def test_clear_removes_what_no_process_uses(ds_path: str, tmp_path: Path) -> None:
    ds = make_tiers(tmp_path, ds_path)
    ds.decoded.close()  # nothing open any more
    out = run_feedpipe("cache", "clear", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    actions = {t["tier"]: (t["action"], t["entries"]) for t in json.loads(out.stdout)["tiers"]}
    assert actions == {"L1 shards": ("trimmed", 0), "L2 function index": ("removed", 0),
                       "decoded store": ("removed", 0)}
    assert stats(tmp_path) == {}
    assert not list((tmp_path / "shards").iterdir())
    assert "no feedpipe cache found" in run_feedpipe("cache", "stats", tmp_path).stdout


def test_clear_leaves_tiers_in_use_consistent(ds_path: str, tmp_path: Path) -> None:
    """A job still holding an L1 shard and the decoded store open: the shard stays, the store is
    emptied in place, and the job keeps getting correct samples (recomputed, then stored)."""
    ds = make_tiers(tmp_path, ds_path)
    truth = [(x.numpy().tobytes(), y) for x, y in ds]
    lease = ds.cache.acquire(f"{ds_path}/data-000000.tar", ds.manifest.shards[0])
    assert lease is not None
    idx = FunctionIndex(str(tmp_path / "memo"))
    idx.stats()  # holds the LMDB environment open
    out = run_feedpipe("cache", "clear", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    actions = {t["tier"]: (t["action"], t["entries"]) for t in json.loads(out.stdout)["tiers"]}
    assert actions == {"L1 shards": ("trimmed", 1), "L2 function index": ("emptied", 0),
                       "decoded store": ("emptied", 0)}
    assert os.path.exists(lease.path)
    lease.release()
    before = ds.decoded.stats.misses
    assert [(x.numpy().tobytes(), y) for x, y in ds] == truth
    assert ds.decoded.stats.misses - before == N and ds.decoded.complete()
    idx.close()


def test_help_is_complete_and_a_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    top = run_feedpipe("--help")
    assert "cache" in top.stdout
    h = run_feedpipe("cache", "--help")
    assert h.returncode == 0
    for text in ("stats", "clear", "PATH", "--json", "L1", "L2", "decoded", "no process",
                 "~/.cache/feedpipe", "Examples"):
        assert text in h.stdout, text
    bad = run_feedpipe("cache", "stats", tmp_path / "nope")
    assert bad.returncode == 2 and "no such directory" in bad.stderr
    assert str(tmp_path / "nope") in bad.stderr


def test_stats_before_any_cache_exists_says_there_is_none(tmp_path: Path) -> None:
    """A newcomer's first ``feedpipe cache stats``: the default root does not exist yet."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for args in (("stats",), ("stats", "--json"), ("clear",)):
        out = run_feedpipe("cache", *args, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stderr == ""
    table = run_feedpipe("cache", "stats", env=env)
    assert "no feedpipe cache" in table.stdout
    assert str(tmp_path / "xdg" / "feedpipe") in table.stdout
    doc = json.loads(run_feedpipe("cache", "stats", "--json", env=env).stdout)
    assert doc == {"path": str(tmp_path / "xdg" / "feedpipe"), "tiers": []}


def test_stats_into_a_pipe_that_closes_early_ends_quietly(tmp_path: Path) -> None:
    """``feedpipe cache stats --json | head -c1``; the output is larger than a pipe's buffer, so
    the write is certain to meet the closed pipe."""
    for i in range(600):  # 600 L1 directories under the default root, ~150 KB of JSON
        d = tmp_path / "feedpipe" / f"node{i:03d}"
        d.mkdir(parents=True)
        (d / "0123456789abcdef0123-data-000000.lock").touch()
    import subprocess
    import sys

    cmd = f"set -o pipefail; {sys.executable} -m feedpipe cache stats --json | head -c1"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert out.stdout == "{"
    assert out.stderr == ""  # no BrokenPipeError traceback
    assert out.returncode in (0, 141)  # feedpipe.cli._main.main's status for a reader gone early
