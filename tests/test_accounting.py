"""What a pass tells about its time: every route reports seconds per part (fetch, compute, sink,
the training loop's wait for a batch, its step between batches, the wall time) and the part that
bounds the pass. The bounds are set up to be unmistakable: a transform that sleeps far longer
than anything else a pass does bounds at compute, a training step that does bounds at the step,
a server that sends bytes slowly bounds at fetch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from _routes import ROUTES, fill_store, make, route_of
from _servers import python_server

from feedpipe import FeedDataset, FeedLoader

KEYS = {"startup", "fetch", "compute", "sink", "wait", "step", "wall", "parts_in"}
EXAMPLE = Path(__file__).resolve().parent.parent / "shards" / "example"


@pytest.fixture(scope="module")
def store(sharded: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    s = str(tmp_path_factory.mktemp("store"))
    fill_store(str(sharded), s)
    return s


@pytest.mark.parametrize("case", list(ROUTES))
def test_every_route_reports_the_same_time_keys(case: str, sharded: Path, store: str) -> None:
    workers = 2 if ROUTES[case][1] == "workers" else 0
    loader = make(case, str(sharded), workers=workers, store=store)
    before = loader.stats()
    assert before["bound"] is None and set(before["time"]) == KEYS  # no pass yet
    n = sum(1 for _ in loader)
    s = loader.stats()
    assert s["route"] == route_of(case) and s["batches"] == n
    assert set(s["time"]) == KEYS
    assert s["bound"] in {"startup", "fetch", "compute", "sink", "step"}
    t = s["time"]
    assert t["wall"] > 0 and t["wait"] + t["step"] == pytest.approx(t["wall"])
    if not workers:  # the parts run inside the loop's wait for batches
        assert t["startup"] + t["fetch"] + t["compute"] + t["sink"] <= t["wait"] + 1e-6
    else:
        assert "worker processes" in t["parts_in"]
        assert t["fetch"] > 0 and t["compute"] + t["sink"] > 0  # measured in the workers


class Slow:
    """A transform that sleeps ``seconds`` per sample (and keeps the sample's id)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, x: dict[str, Any]) -> int:
        time.sleep(self.seconds)
        return int(x["__index__"])


@pytest.mark.parametrize("route,kw", [("samples", {}),
                                      ("samples-threads", {"transform_threads": 2}),
                                      ("samples-workers", {"num_workers": 2})])
def test_a_slow_transform_bounds_at_compute(route: str, kw: dict[str, Any]) -> None:
    loader = FeedLoader(FeedDataset(str(EXAMPLE), transform=Slow(0.03)), batch_size=4,
                        route=route, **kw)
    assert sorted(i for b in loader for i in b) == list(range(24))
    s = loader.stats()
    assert s["bound"] == "compute", s["time"]
    # every sleep is in it: with threads, the wait for two sleeping at once
    assert s["time"]["compute"] >= 24 * 0.03 * 0.9 / kw.get("transform_threads", 1)


STARTUP = 1.0  # a worker's start-up, far longer than fetching the example's 24 samples


def _slow_start(worker: int) -> None:
    time.sleep(STARTUP)  # what importing a heavy library or opening a session costs


@pytest.mark.parametrize("case", ["samples-workers", "rows-workers", "refs-workers",
                                  "packed-workers"])
def test_worker_start_up_is_its_own_part_and_bounds_when_it_dominates(case: str,
                                                                     sharded: Path) -> None:
    """A pass whose wait was the workers starting said bound == 'fetch' (fetch took a few ms
    of a wait of seconds): start-up was in no part, so the largest of the small ones won."""
    loader = make(case, str(sharded), workers=2, worker_init_fn=_slow_start)
    assert sum(1 for _ in loader) == len(loader)
    s = loader.stats()
    t = s["time"]
    assert s["bound"] == "startup", t
    assert t["startup"] >= 2 * STARTUP * 0.9, t  # each worker's sleep, added up as parts are
    assert t["fetch"] > 0  # the workers' fetches are still counted, apart


def test_start_up_of_persistent_workers_is_paid_once() -> None:
    """The look-alike: a second pass over persistent workers starts nothing; a slow transform
    then bounds it, not the start-up the first pass paid."""
    loader = FeedLoader(FeedDataset(str(EXAMPLE), transform=Slow(0.03)), batch_size=4,
                        num_workers=2, worker_init_fn=_slow_start, persistent_workers=True)
    for _ in range(2):
        assert sorted(i for b in loader for i in b) == list(range(24))
    s = loader.stats()
    assert s["bound"] == "compute", s["time"]
    assert s["time"]["startup"] < STARTUP, s["time"]


def test_a_slow_training_step_bounds_at_the_step() -> None:
    loader = FeedLoader(FeedDataset(str(EXAMPLE)), batch_size=4)
    for _ in loader:
        time.sleep(0.05)  # the model's step
    s = loader.stats()
    assert s["bound"] == "step" and s["time"]["step"] >= 6 * 0.05 * 0.9, s["time"]


@pytest.mark.slow
def test_shards_over_a_slow_server_bound_at_fetch() -> None:
    with python_server(EXAMPLE, "--rate", "40000") as srv:  # 40 kB/s: seconds for the 80 kB
        loader = FeedLoader(FeedDataset(srv.url, decode={"cls": int}), batch_size=4,
                            route="samples")
        assert sorted(i for b in loader for i in b["__index__"].tolist()) == list(range(24))
    s = loader.stats()
    assert s["bound"] == "fetch", s["time"]
    assert s["time"]["fetch"] > 10 * (s["time"]["compute"] + s["time"]["sink"])
