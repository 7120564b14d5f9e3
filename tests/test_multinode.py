"""Training on many nodes, simulated: 2 "nodes" (2 L1 cache directories) x 2 ranks each = 4 real
processes reading one dataset from a real HTTP server on 127.0.0.1. Each node's cache fetches only
the shards its own ranks read, once per node (not once per rank), and the 4 ranks together read
every sample exactly once."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _servers import python_server

import feedpipe
from feedpipe import FeedDataset  # imports torch here, not once per forked rank
from feedpipe.convert._synth import make_records
from feedpipe.format._manifest import load_manifest

CTX = mp.get_context("fork")  # the test process already imported torch: forking is fast
NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ds``: 48 records of 300 bytes in 24 shards of 2 samples."""
    root = tmp_path_factory.mktemp("multinode")
    make_records(str(root / "src"), count=48, size=300, per_dir=1000, seed=9)
    feedpipe.shard(str(root / "src"), str(root / "ds"), max_samples=2, workers=1)
    return root


def _rank(url: str, rank: int, cache_dir: str, shuffle: bool, out: str) -> None:
    """One training rank: one epoch through the node's shard cache, ids written to ``out``."""
    ds = FeedDataset(url, shuffle=shuffle, seed=3, rank=rank, world_size=WORLD,
                     cache_dir=cache_dir)
    ds.set_epoch(1)
    ids = [int(s["__index__"]) for s in ds]
    Path(out).write_text(json.dumps(ids))


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_node_fetches_only_its_ranks_shards_once_and_the_union_is_exact(
        data: Path, tmp_path: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # the fills' bytes: each reader's first batch read by range besides is counted in
    # tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    m = load_manifest(str(data / "ds"))
    ends = np.cumsum([s.samples for s in m.shards])
    with python_server(data) as server:
        url = f"{server.url}/ds"
        load_manifest(url)  # import the HTTP backend once, before forking the ranks
        server.reset()
        procs = []
        for rank in range(WORLD):
            node = rank // RANKS_PER_NODE
            p = CTX.Process(target=_rank, args=(url, rank, str(tmp_path / f"node{node}"),
                                                shuffle, str(tmp_path / f"rank{rank}.json")))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        stats = server.stats()

    ids = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    assert Counter(i for r in ids for i in ids[r]) == Counter(range(48))  # exactly once
    assert len({len(v) for v in ids.values()}) == 1  # equal shares: no DDP hang

    def shard_of(i: int) -> str:
        return m.shards[int(np.searchsorted(ends, i, side="right"))].name

    needed = {n: {shard_of(i) for r in range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)
                  for i in ids[r]} for n in range(NODES)}
    for n in range(NODES):
        cached = {p.name.split("-", 1)[1] for p in (tmp_path / f"node{n}").glob("*.tar")}
        assert cached == needed[n], f"node {n} cached other shards than its ranks read"
    assert set().union(*needed.values()) == {s.name for s in m.shards}
    if not shuffle:  # manifest order dealt round-robin: 2-sample shards fall to one node each
        assert not needed[0] & needed[1]
    for s in m.shards:  # one download per shard and node that needs it, whatever its ranks
        got = stats.get(f"/ds/{s.name}", {"bytes": 0})
        nodes = sum(s.name in needed[n] for n in range(NODES))
        assert got["bytes"] == s.bytes * nodes, s.name


def test_launch_scripts_are_valid_shell() -> None:
    import subprocess

    launch = Path(__file__).resolve().parent.parent / "tools" / "launch"
    scripts = sorted(launch.iterdir())
    assert {p.name for p in scripts} >= {"torchrun_single_node.sh", "torchrun_multi_node.sh",
                                         "slurm_train.sbatch", "slurm_shard_array.sbatch"}
    for p in scripts:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"
        assert os.access(p, os.X_OK), p.name
