"""A node fetches its share, not the dataset: 4 simulated nodes (4 real rank processes, each
with its own L1 cache directory) read one shuffled dataset from a real HTTP server on 127.0.0.1.
Each node fetches its share in whole shards plus at most one shard, the store serves the
dataset plus fewer than one shard per node, and the ranks together read every sample exactly
once; the same with 2 DataLoader worker processes per rank, over two epochs (each epoch its own
pieces), and through a resume on another number of ranks."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _servers import python_server

import feedpipe
from feedpipe import FeedDataset, FeedLoader  # imports torch here, not once per forked rank
from feedpipe.convert._synth import make_records
from feedpipe.format._manifest import load_manifest
from feedpipe.plan._order import node_quotas

CTX = mp.get_context("fork")  # the test process already imported torch: forking is fast
SAMPLES, PER_SHARD = 102, 4  # 26 shards (the last one of 2): the pieces cut shards in two


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nodeshare")
    make_records(str(root / "src"), count=SAMPLES, size=2000, per_dir=1000, seed=4)
    feedpipe.shard(str(root / "src"), str(root / "ds"), max_samples=PER_SHARD, workers=1)
    return root


def _rank(url: str, rank: int, world: int, cache_dir: str, workers: int, epochs: int,
          out: str) -> None:
    """One training rank (one node: its own cache directory), ``epochs`` epochs through a
    FeedLoader with ``workers`` worker processes; the ids of each epoch written to ``out``."""
    ds = FeedDataset(url, shuffle=True, seed=5, rank=rank, world_size=world, cache_dir=cache_dir)
    loader = FeedLoader(ds, batch_size=3, num_workers=workers, collate_fn=list)
    got = []
    for e in range(epochs):
        loader.set_epoch(e)
        got.append([int(s["__index__"]) for b in loader for s in b])
    Path(out).write_text(json.dumps(got))


def _run(data: Path, tmp: Path, world: int, workers: int, epochs: int
         ) -> tuple[dict[int, list[list[int]]], dict[str, dict[str, int]], str]:
    with python_server(data) as server:
        url = f"{server.url}/ds"
        load_manifest(url)  # import the HTTP backend once, before forking the ranks
        server.reset()
        procs = []
        for rank in range(world):
            p = CTX.Process(target=_rank, args=(url, rank, world, str(tmp / f"node{rank}"),
                                                workers, epochs, str(tmp / f"rank{rank}.json")))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(180)
            assert p.exitcode == 0
        stats = server.stats()
    ids = {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)}
    return ids, stats, url


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_each_of_4_nodes_fetches_its_share_plus_at_most_one_shard(
        data: Path, tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the fills' bytes: each reader's first batch read by range besides (up to a batch's bytes
    # per reader and epoch) is counted in tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    world = 4
    epochs = 2 if workers else 1
    m = load_manifest(str(data / "ds"))
    ids, stats, _ = _run(data, tmp_path, world, workers, epochs)
    sizes = {s.name: s.bytes for s in m.shards}
    for e in range(epochs):
        got = [ids[r][e] for r in range(world)]
        seen = Counter(i for x in got for i in x)
        # exactly once, but for the padding that makes the ranks equal (102 = 4 x 26 - 2)
        assert set(seen) == set(range(SAMPLES)) and sum(seen.values()) == SAMPLES + 2
        assert len({len(x) for x in got}) == 1  # equal shares: no DDP hang
    quota = node_quotas(SAMPLES, world, 1)
    fetched_all = 0
    for r in range(world):
        cached = [p.name.split("-", 1)[1] for p in (tmp_path / f"node{r}").glob("*.tar")]
        fetched = sum(sizes[n] for n in cached)  # each cached shard downloaded once (below)
        fetched_all += fetched
        if epochs == 1:
            # its share rounded up to whole shards, plus one shard (the last shard is short:
            # it may be one of them)
            assert len(cached) <= -(-int(quota[r]) // PER_SHARD) + 1, (r, sorted(cached))
            share = sum(sizes.values()) * int(quota[r]) / SAMPLES
            assert fetched <= share + 2 * max(sizes.values())
    # every download was of one node's own piece: the store served each shard to at most two
    # nodes an epoch, the dataset plus at most one shard per node boundary
    total = sum(v["bytes"] for k, v in stats.items() if k.endswith(".tar"))
    assert epochs > 1 or total == fetched_all  # what the nodes cached is what the store sent
    assert total <= epochs * (sum(sizes.values()) + (world - 1) * max(sizes.values()))
    # the reading before this change: every node fetched (nearly) the whole dataset
    assert total < 0.5 * world * epochs * sum(sizes.values())


def test_resume_on_another_world_reads_the_rest_exactly_and_the_next_epoch_is_laid_out_anew(
        data: Path, caplog: pytest.LogCaptureFixture) -> None:
    """4 nodes stop mid-epoch; 3 ranks resume the states (the saved layout kept for the rest of
    that epoch): nothing twice, nothing lost; the next epoch is cut for 3 nodes."""
    url = str(data / "ds")
    caplog.set_level(logging.INFO, logger="feedpipe")
    first: list[int] = []
    states = []
    for r in range(4):
        ds = FeedDataset(url, shuffle=True, seed=5, rank=r, world_size=4, node_local=True)
        loader = FeedLoader(ds, batch_size=3, collate_fn=list)
        loader.set_epoch(2)
        it = iter(loader)
        for _ in range(3):
            first += [int(s["__index__"]) for s in next(it)]
        states.append(loader.state_dict())
        del it
    assert "each of 4 nodes (1 ranks each) reads its own piece" in caplog.text
    assert all(s == states[0] for s in states[1:]) and states[0]["layout"] == [4, 1]
    rest: list[int] = []
    for r in range(3):
        ds = FeedDataset(url, shuffle=True, seed=5, rank=r, world_size=3, node_local=True)
        loader = FeedLoader(ds, batch_size=2, collate_fn=list)
        loader.load_state_dict(states[0])
        rest += [int(s["__index__"]) for b in loader for s in b]
        saved = loader.state_dict()  # the next epoch's start: laid out for this world
        assert (saved["epoch"], saved["position"], saved["layout"]) == (3, 0, [3, 1])
        loader.set_epoch(3)
        plan = loader.dataset.plan(3)
        assert plan.layout == (3, 1)
        nxt = [int(s["__index__"]) for b in loader for s in b]
        shards, _ = plan.shard_of(np.asarray(nxt))
        assert set(shards.tolist()) <= set(plan.node_shards(r).tolist())
    seen = Counter(first + rest)
    assert set(seen) == set(range(SAMPLES))
    assert sum(seen.values()) - SAMPLES < 4 + 3  # padding only: nothing of the first part again
    assert not set(first) & set(rest)  # the rest holds none of the first part


def test_the_default_is_said_remote_shards_by_node_local_ones_globally(
        data: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="feedpipe")
    with python_server(data) as server:
        remote = FeedDataset(f"{server.url}/ds", shuffle=True, rank=1, world_size=4)
        assert remote.plan(0).layout == (4, 1)
    assert "each of 4 nodes (1 ranks each) reads its own piece" in caplog.text
    assert "node_local=None: remote shards" in caplog.text
    caplog.clear()
    local = FeedDataset(str(data / "ds"), shuffle=True, rank=1, world_size=4)
    assert local.plan(0).layout is None and local.split_at(0).pad_own is False
    assert "every rank of 4 nodes reads from all the shards" in caplog.text
    assert "node_local=None: local shards" in caplog.text
    # ranks_per_node groups ranks: 2 nodes of 2; one node is the global order
    assert FeedDataset(str(data / "ds"), shuffle=True, rank=1, world_size=4, node_local=True,
                       ranks_per_node=2).plan(0).layout == (4, 2)
    assert FeedDataset(str(data / "ds"), shuffle=True, rank=1, world_size=4, node_local=True,
                       ranks_per_node=4).plan(0).layout is None


def test_a_node_is_the_launchers_local_world(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE): a node is the
    launcher's LOCAL_WORLD_SIZE consecutive ranks."""
    for k, v in (("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"),
                 ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(k, v)
    ds = FeedDataset(str(data / "ds"), shuffle=True, node_local=True)
    assert (ds.world.rank, ds.world.local_world_size) == (5, 4)
    assert ds.plan(0).layout == (8, 4) and ds.plan(0).nodes == 2
