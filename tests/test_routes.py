"""The route contract: every batch route of FeedLoader, held to the same checks.

Each route is built by ``_routes.make`` over the same shards (the VideoClips cases: over videos
beside them) and compared with the reference route (``samples``, in this process): the same
batches for 1-3 ranks and 0-2 workers where the route takes them; mid-epoch resume in a new
process; elastic resume (2 ranks x 2 workers to 3 x 1 and 1 x 3); a shard truncated during the
epoch raises the named error; stopping early releases threads, shared memory and worker
processes; routes with workers run the transform in distinct worker processes (their pids
checked).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from _routes import (
    APART,
    BATCH,
    CLIPS,
    MIXED,
    ROUTES,
    VIDEOS,
    bucketed,
    data_path,
    dataset,
    digest,
    fill_store,
    ids_of,
    make,
    mixed,
    route_of,
    token_docs,
    video,
)

from feedpipe import FeedDataset, FeedLoader, ShardFormatError
from feedpipe.stream._routes import PREFERENCE, Config, choose, refusal
from feedpipe.stream._routes import ROUTES as ROUTE_TABLE

HERE = os.path.dirname(os.path.abspath(__file__))
ALL = list(ROUTES)


@pytest.fixture(scope="module")
def store(sharded: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The decoded store the gather route reads, filled once."""
    path = str(tmp_path_factory.mktemp("store"))
    fill_store(str(sharded), path)
    return path


def worker_counts(route: str) -> list[int]:
    executor = ROUTES[route][1]
    if executor == "workers":
        return [1, 2]
    if executor == "threads" or route in ("rows", "packed"):
        return [0]
    return [0, 1, 2]  # inline routes that take num_workers and say they leave it unused


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
                and all(same(x, y) for x, y in zip(a, b)))  # type: ignore[call-overload]
    return a == b


# three ranks of worker processes: in the slow run (CI runs it); one and two ranks by default
WORLDS = [pytest.param(w, r, marks=[pytest.mark.slow] if w == 3 and "workers" in r else [],
                       id=f"{w}-{r}") for w in (1, 2, 3) for r in ALL]


@pytest.mark.parametrize(("world", "route"), WORLDS)
def test_same_batches_as_the_reference_route(route: str, world: int, sharded: Path, store: str,
                                             tmp_path: Path) -> None:
    for workers in worker_counts(route):
        for rank in range(world):
            mark = tmp_path / f"pids-{workers}-{rank}"
            mark.mkdir()
            ld = make(route, str(sharded), world=world, rank=rank, workers=workers, store=store,
                      mark=str(mark))
            assert ld.route.name == route_of(route)
            got = list(ld)
            want = list(make(route, str(sharded), world=world, rank=rank, reference=True))
            assert len(got) == len(want) == len(ld)
            for g, w in zip(got, want):
                assert same(g, w), f"{route}: a batch differs from the reference route's"
            stats = ld.stats()
            assert stats["route"] == route_of(route) and stats["batches"] == len(ld)
            ran = {int(p.name) for p in mark.iterdir()}
            if ROUTES[route][1] == "workers":
                pids = set(stats["worker_pids"])
                assert len(pids) == workers and os.getpid() not in pids
                if ROUTES[route][0] in ("img", "fn"):  # the transform itself ran there
                    assert ran == pids
            elif ROUTES[route][0] in ("img", "fn") and route != "gather":
                assert ran == {os.getpid()}


def rank_ids(route: str, path: str, world: int, workers: int, store: str, stop: int | None,
             state: dict | None = None) -> tuple[list[int], dict, list[list[int]]]:
    """Every rank of ``world`` in lockstep for ``stop`` batches (None: the epoch); their ids,
    rank 0's state and each rank's worker pids."""
    loaders = [make(route, path, world=world, rank=r, workers=workers, store=store)
               for r in range(world)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    iters = [iter(ld) for ld in loaders]
    ids: list[int] = []
    steps = 0
    while stop is None or steps < stop:
        try:
            for it in iters:
                ids += ids_of(next(it))
        except StopIteration:
            break
        steps += 1
    return ids, loaders[0].state_dict(), [ld.stats().get("worker_pids", []) for ld in loaders]


@pytest.mark.parametrize("route", ALL)
@pytest.mark.slow
def test_mid_epoch_resume_in_a_new_process(route: str, sharded: Path, store: str) -> None:
    workers = max(worker_counts(route))
    first = make(route, str(sharded), workers=workers, store=store)
    full = [digest(b) for b in make(route, str(sharded), reference=True)]
    it = iter(first)
    seen = [digest(next(it)) for _ in range(3)]
    state = first.state_dict()
    assert state["position"] == 3 * BATCH
    del it
    args = {"case": route, "path": str(sharded), "workers": workers, "store": store,
            "state": state}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_routes.py"), json.dumps(args)],
                          capture_output=True, text=True, timeout=300, cwd=HERE)
    assert proc.returncode == 0, proc.stderr
    rest = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen + rest["digests"] == full
    assert rest["len"] == len(full)  # len() is the whole epoch, also after a restore
    if ROUTES[route][1] == "workers":
        assert len(rest["pids"]) == workers


@pytest.mark.parametrize("route", ALL)
@pytest.mark.parametrize("world2,workers2", [(3, 1), (1, 3)])
@pytest.mark.slow
def test_elastic_resume_delivers_the_rest_exactly_once(route: str, world2: int, workers2: int,
                                                       sharded: Path, store: str) -> None:
    workers = 2 if ROUTES[route][1] == "workers" else 0
    if workers == 0:
        workers2 = 0
    first, state, pids = rank_ids(route, str(sharded), 2, workers, store, stop=2)
    assert state["position"] == 2 * BATCH * 2
    rest, _, pids2 = rank_ids(route, str(sharded), world2, workers2, store, stop=None,
                              state=state)
    if workers:  # real worker processes on every rank, before and after
        assert [len(p) for p in pids] == [workers] * 2
        assert [len(p) for p in pids2] == [workers2] * world2
    c = Counter(first + rest)
    if ROUTES[route][0] == "tok":  # every token exactly once: padding rows hold none
        assert c == Counter(t for d in token_docs() for t in d.tolist())
        return
    if bucketed(route):  # each image at most once; lost: what the epoch's plan leaves out
        src = dataset(route, str(sharded), seed=11, rank=0, world_size=world2)
        left = src.split_at(state["position"], epoch=0).dropped
        assert max(c.values()) == 1 and set(c) == set(src.plan(0).sample_ids(
            np.arange(src.plan(0).num_samples - left)).tolist())
        return
    n = FeedDataset(str(sharded)).manifest.total_samples
    if video(route):  # each (video, clip) once, by its clip id
        n = VIDEOS * CLIPS
    every = set(range(n))
    if mixed(route):  # each source once an epoch (the default weights)
        every = {k * APART + i for k in range(len(MIXED)) for i in range(n)}
        n *= len(MIXED)
    assert set(c) == every, "a sample was lost"
    assert sum(c.values()) - n == (-(n - state["position"]) % world2), "only padding repeats"


@pytest.mark.parametrize("route", ALL)
def test_a_shard_truncated_during_the_epoch_is_the_named_error(route: str, sharded_copy: Path,
                                                               tmp_path: Path) -> None:
    path = str(sharded_copy)
    store = str(tmp_path / "store")
    if route == "gather":
        fill_store(path, store)
    workers = max(worker_counts(route))
    ld = make(route, path, workers=workers, store=store)
    data_path(route, path)  # written before the loop starts
    want = [digest(b) for b in make(route, path, reference=True)] if route == "gather" else []
    it = iter(ld)
    got = [digest(next(it))]
    for tar in Path(data_path(route, path)).glob("*.tar"):  # every shard cut in place, under
        # the open maps
        os.truncate(tar, tar.stat().st_size // 2)
    if route == "gather":  # it reads no shard: the store's batches come through unchanged
        got += [digest(b) for b in it]
        assert got == want
        return
    with pytest.raises(ShardFormatError, match=r"data-\d+\.tar"):
        for _ in it:
            pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def shared_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("/torch_" in line for line in f)


@pytest.mark.parametrize("route", ALL)
@pytest.mark.slow
def test_stopping_early_releases_threads_memory_and_workers(route: str, sharded: Path,
                                                            store: str) -> None:
    workers = max(worker_counts(route))
    ld = make(route, str(sharded), workers=workers, store=store)
    before_threads = {t.ident for t in threading.enumerate()}
    before_shm = shared_segments()  # the dataset's own shared state is mapped already
    it = iter(ld)
    batch = next(it)
    pids = ld.stats().get("worker_pids", [])
    it.close()
    del it, batch
    gc.collect()
    assert all(not alive(p) for p in pids), "a worker process outlived the loop"
    extra = [t for t in threading.enumerate() if t.ident not in before_threads]
    for t in extra:  # a closed multiprocessing queue's feeder thread ends by itself, soon
        t.join(timeout=30)
    alive_threads = [t.name for t in extra if t.is_alive()]
    assert not alive_threads, f"threads left running: {alive_threads}"
    assert shared_segments() <= before_shm, "shared memory still mapped"


@pytest.mark.parametrize("route", [r for r in ALL if ROUTES[r][0] == "raw"])
def test_every_raw_batch_carries_every_field_of_the_manifest(route: str, sharded: Path) -> None:
    fields = FeedDataset(str(sharded)).manifest.fields
    assert "json" in fields  # on every third sample only
    ld = make(route, str(sharded), workers=max(worker_counts(route)))
    batches = list(FeedLoader(ld.dataset, batch_size=2, route=route_of(route),
                              num_workers=ld.num_workers))
    assert any(all(v is None for v in b["json"]) for b in batches)  # the case that matters
    for b in batches:
        assert set(fields) <= set(b), f"batch keys {sorted(b)} lack some of {fields}"


def test_a_forced_route_that_cannot_serve_is_refused_with_the_reason(sharded: Path) -> None:
    ds = FeedDataset(str(sharded))
    with pytest.raises(ValueError, match="num_workers is 0"):
        FeedLoader(ds, route="samples-workers")
    with pytest.raises(ValueError, match="the store is missing"):
        FeedLoader(ds, route="gather")
    with pytest.raises(ValueError, match="unknown route 'fast'"):
        FeedLoader(ds, route="fast")


def test_an_inline_choice_with_workers_asked_is_logged_once(sharded: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    ld = FeedLoader(FeedDataset(str(sharded)), batch_size=4, num_workers=2)
    with caplog.at_level("WARNING", logger="feedpipe"):
        list(ld)
        list(ld)
    notes = [r.getMessage() for r in caplog.records if "num_workers=2" in r.getMessage()]
    assert len(notes) == 1 and "route 'refs' runs in the training process" in notes[0]
    assert ld.stats()["route"] == "refs" and ld.stats()["parts"]["executor"] == "inline"


def _configs() -> list[Config]:
    """Every configuration a loader can have (over a few worker and thread counts)."""
    out = []
    for w, t, transform, into, collator, local, store, gatherable, fit, mix in itertools.product(
            (0, 2), (0, 2), *([(False, True)] * 4), ("none", "partial", "complete"),
            (False, True), (False, True), ("no", "agree", "differ")):
        if (into and not (transform and collator)) or (gatherable and not (
                store == "complete" and collator)):
            continue  # writes_into and gatherable() need a collator (and a transform, a store)
        if mix != "no" and store != "none":
            continue  # a Mixture has no decoded store
        out.append(Config(num_workers=w, threads=t, transform=transform, into=into,
                          collator=collator, default_collate=not collator, local=local,
                          store=store, gatherable=gatherable, shards_fit=fit,
                          fetch="samples" if mix == "no" else "mixture",
                          decodes_agree=mix != "differ"))
    for w, t, transform, local in itertools.product((0, 2), (0, 2), (False, True),
                                                    (False, True)):
        out.append(Config(num_workers=w, threads=t, transform=transform, local=local,
                          makes_batches=True))
    return out


def test_the_auto_choice_is_the_first_preferred_route_the_table_lets_serve() -> None:
    """One table of parts gives the refusals and, through them, the choice: what "auto" picks
    a forced name would accept, and no route of an earlier row of the preference could serve."""
    chosen = Counter()
    for config in _configs():
        try:
            route, _ = choose(config)
        except ValueError as e:
            assert config.threads and "no route serves this loader" in str(e), config
            assert all(refusal(ROUTE_TABLE[n], config) for n in ("rows-threads",
                                                                  "samples-threads"))
            continue
        chosen[route.name] += 1
        assert refusal(route, config) is None
        # a mixture's samples are fetched through its sources
        assert (route.fetch == "mixture") == (config.fetch == "mixture" and route.fetch != "refs")
        assert choose(config, route.name)[0] == route
        earlier = []
        for when, names, _ in PREFERENCE:
            if route.name in names:
                break
            if when(config):
                earlier += names
        assert all(refusal(ROUTE_TABLE[n], config) for n in earlier), (config, route.name)
    assert set(chosen) == set(ROUTE_TABLE)  # every route is some configuration's choice
