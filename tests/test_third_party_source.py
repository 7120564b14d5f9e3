"""A source written outside feedpipe (tests/_third_party.py: a folder of tar shards in an order
of its own) plugs into FeedLoader through :class:`feedpipe.Source` alone: its capabilities
choose the route, its fetch runs in real worker processes, its state resumes mid-epoch in a new
loader, and what it cannot do is refused with the reason. The route contract runs over it too
(tests/test_routes.py, the ``:third`` cases)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _third_party import TarFolder, index_and_pid

import feedpipe
from feedpipe import FeedDataset, FeedLoader, StateError


def test_it_is_read_by_worker_processes_and_resumes_mid_epoch(sharded: Path) -> None:
    n = FeedDataset(str(sharded)).manifest.total_samples
    src = TarFolder(str(sharded), seed=3, transform=index_and_pid)
    loader = FeedLoader(src, batch_size=4, num_workers=2)
    assert loader.route.name == "samples-workers"  # a transform to share: workers run it
    batches = list(loader)
    ids = [i for b in batches for i in b["id"].tolist()]
    assert ids == [(p + 3) % n for p in range(n)]  # its own order, each sample once
    stats = loader.stats()
    assert stats["parts"]["fetch"] == "tar-folder"  # its fetch, named as it names it
    pids = set(stats["worker_pids"])
    assert len(pids) == 2 and os.getpid() not in pids
    assert {p for b in batches for p in b["pid"].tolist()} == pids  # the transform ran there

    # mid-epoch: a new loader over a new source object continues with exactly the rest
    loader = FeedLoader(src, batch_size=4, num_workers=2)
    it = iter(loader)
    first = [i for _ in range(2) for i in next(it)["id"].tolist()]
    state = loader.state_dict()
    assert state["kind"] == "tar-folder" and state["position"] == 8
    it.close()
    again = FeedLoader(TarFolder(str(sharded), seed=3, transform=index_and_pid), batch_size=4,
                       num_workers=2)
    again.load_state_dict(state)
    rest = [i for b in again for i in b["id"].tolist()]
    assert first + rest == ids
    nxt = [i for b in again for i in b["id"].tolist()]  # the next epoch: rotated further
    assert nxt == [(p + 3 + 7) % n for p in range(n)]


def test_its_capabilities_choose_the_route_and_what_it_cannot_do_is_refused(
        sharded: Path) -> None:
    src = TarFolder(str(sharded))
    assert isinstance(src, feedpipe.Source)
    # raw samples of local shards: read by reference, planned from the index
    assert FeedLoader(src, batch_size=4).route.name == "refs"
    with pytest.raises(ValueError, match="the source makes samples"):
        FeedLoader(src, route="packed")
    with pytest.raises(ValueError, match="ledger"):
        FeedLoader(src, ledger=str(sharded.parent / "ledger"))
    with pytest.raises(StateError, match="tar-folder"):
        FeedLoader(src).load_state_dict(FeedLoader(FeedDataset(str(sharded))).state_dict())
