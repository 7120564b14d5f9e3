"""``feedpipe.Mixture`` read through FeedLoader: the mixture's promises checked on what the
loader delivers (``__source__`` of every sample), for random sources, weights, epoch sizes,
batch sizes and world sizes, and its errors, each naming the source.

The route contract (same batches on every route, resume in a new interpreter, elastic resume,
early stop) is in tests/test_routes.py (the ``:mix`` cases); the plan's own properties in
tests/test_mixture_plan.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedpipe import FeedDataset, FeedLoader, Mixture, MixtureError, StateError, write_samples

SIZES = {"web": 120, "books": 37, "code": 9, "tiny": 2}  # samples per source
PER_SHARD = {"web": 25, "books": 10, "code": 4, "tiny": 2}
FIXTURE = [HealthCheck.function_scoped_fixture]  # the datasets are module-scoped, read only


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One small dataset per name of :data:`SIZES`, each sample's ``txt`` its own name and id."""
    base = tmp_path_factory.mktemp("mix")
    out = {}
    for name, n in SIZES.items():
        path = str(base / name)
        write_samples(({"__key__": f"{name}-{i:05d}", "txt": f"{name} {i}", "cls": i % 3}
                       for i in range(n)), path, max_samples=PER_SHARD[name])
        out[name] = path
    return out


def mixture(roots: dict[str, str], names: list[str], *, rank: int = 0, world: int = 1,
            **kw: Any) -> Mixture:
    return Mixture({n: FeedDataset(roots[n], shuffle=True, seed=3, rank=rank, world_size=world,
                                   decode={"txt": str})
                    for n in names}, **kw)


def delivered(ld: FeedLoader) -> list[tuple[str, int]]:
    """Every sample the loader delivers this epoch, as (source, id in it), checked against its
    own text."""
    out = []
    for b in ld:
        for s, i, txt in zip(b["__source__"], b["__index__"].tolist(), b["txt"]):
            assert txt == f"{s} {i}"  # the sample is the one its source and id name
            out.append((s, i))
    return out


draws = st.fixed_dictionaries({
    "names": st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=4, unique=True),
    "weights": st.lists(st.integers(0, 9), min_size=4, max_size=4),
    "epoch_size": st.one_of(st.none(), st.integers(1, 400)),
    "batch": st.integers(1, 9),
    "world": st.integers(1, 3),
    "seed": st.integers(0, 2**31),
})


def _args(d: dict[str, Any]) -> tuple[list[str], dict[str, int] | None]:
    names = d["names"]
    weights = dict(zip(names, d["weights"]))
    if sum(weights.values()) == 0 or d["epoch_size"] is None:
        return names, None
    return names, weights


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURE)
@given(draws)
def test_every_world_delivers_the_exact_counts_of_each_source(roots, d) -> None:  # type: ignore[no-untyped-def]
    """Each epoch holds ``weights[s] * epoch_size`` samples of source ``s`` (largest remainder),
    whatever the number of ranks: the ranks' deliveries together are the one-rank epoch's
    multiset plus the padding, equal batches on every rank, and ``stats()['sources']`` says
    what each rank received."""
    names, weights = _args(d)
    size = d["epoch_size"] if weights is not None else None
    one = delivered(FeedLoader(mixture(roots, names, weights=weights, epoch_size=size,
                                       seed=d["seed"]), batch_size=d["batch"]))
    n = len(one)
    counts = Counter(s for s, _ in one)
    if weights is None:
        assert counts == {s: SIZES[s] for s in names}
    else:
        total = sum(weights.values())
        for s in names:
            quota = weights[s] / total * n
            assert np.floor(quota) <= counts.get(s, 0) <= np.floor(quota) + 1, (s, counts)
    world = d["world"]
    got: Counter[tuple[str, int]] = Counter()
    lengths = set()
    for rank in range(world):
        ld = FeedLoader(mixture(roots, names, rank=rank, world=world, weights=weights,
                                epoch_size=size, seed=d["seed"]), batch_size=d["batch"])
        mine = delivered(ld)
        got.update(mine)
        lengths.add(ld.stats()["batches"])
        assert ld.stats()["sources"] == {s: c for s, c in
                                         Counter(s for s, _ in mine).items()} | {
            s: 0 for s in names if s not in {x for x, _ in mine}}
    assert len(lengths) == 1  # equal batches on every rank
    assert not Counter(one) - got  # nothing lost
    assert sum((got - Counter(one)).values()) == -n % world  # only the padding repeats


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURE)
@given(draws)
def test_no_sample_of_a_source_repeats_before_the_source_was_delivered_whole(roots, d) -> None:  # type: ignore[no-untyped-def]
    """Over three epochs delivered by the loader, each source's draws are whole permutations one
    after the other: no repeat before every sample of the source came once."""
    names, weights = _args(d)
    size = d["epoch_size"] if weights is not None else None
    ld = FeedLoader(mixture(roots, names, weights=weights, epoch_size=size, seed=d["seed"]),
                    batch_size=d["batch"])
    per: dict[str, list[int]] = {s: [] for s in names}
    for _ in range(3):  # each pass after a complete one is the next epoch
        for s, i in delivered(ld):
            per[s].append(i)
    for s, ids in per.items():
        for at in range(0, len(ids), SIZES[s]):
            block = ids[at:at + SIZES[s]]
            assert len(set(block)) == len(block), f"{s} repeats within {block}"
            if len(block) == SIZES[s]:
                assert sorted(block) == list(range(SIZES[s]))


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURE)
@given(st.lists(st.integers(1, 9), min_size=3, max_size=3), st.integers(100, 600),
       st.integers(0, 2**31))
def test_every_window_of_100_delivered_holds_each_weight_within_5_points(roots, w, size,
                                                                          seed) -> None:  # type: ignore[no-untyped-def]
    names = ["web", "books", "code"]
    ld = FeedLoader(mixture(roots, names, weights=dict(zip(names, w)), epoch_size=size,
                            seed=seed), batch_size=7)
    src = [names.index(s) for s, _ in delivered(ld)]
    onehot = np.asarray(src)[:, None] == np.arange(3)[None, :]
    runs = np.cumsum(np.vstack([np.zeros((1, 3)), onehot]), axis=0)
    window = (runs[100:] - runs[:-100]) / 100
    share = np.asarray(w) / sum(w)
    assert np.abs(window - share[None, :]).max() <= 0.05


def test_a_mid_epoch_state_resumes_on_another_world_to_exactly_the_rest(roots) -> None:  # type: ignore[no-untyped-def]
    names = ["web", "books", "code"]
    kw = {"weights": {"web": 5, "books": 3, "code": 2}, "epoch_size": 150, "seed": 4}
    whole = Counter(delivered(FeedLoader(mixture(roots, names, **kw), batch_size=5)))
    loaders = [FeedLoader(mixture(roots, names, rank=r, world=2, **kw), batch_size=5)
               for r in range(2)]
    its = [iter(ld) for ld in loaders]
    first: Counter[tuple[str, int]] = Counter()
    for _ in range(4):
        for it in its:
            b = next(it)
            first.update(zip(b["__source__"], b["__index__"].tolist()))
    state = loaders[0].state_dict()
    assert state["position"] == 40
    rest: Counter[tuple[str, int]] = Counter()
    for r in range(3):
        ld = FeedLoader(mixture(roots, names, rank=r, world=3, **kw), batch_size=5)
        ld.load_state_dict(state)
        rest.update(delivered(ld))
    assert sum(rest.values()) == 111  # 110 positions left, 3 ranks of 37
    assert not whole - (first + rest)  # nothing lost
    assert sum((first + rest - whole).values()) == 1  # the one padding repeat


def test_each_source_keeps_its_own_transform_and_decode(roots) -> None:  # type: ignore[no-untyped-def]
    web = FeedDataset(roots["web"], decode={"cls": int}, transform=lambda x: {"v": x["cls"]})
    code = FeedDataset(roots["code"], decode={"cls": int},
                       transform=lambda x: {"v": 100 + x["cls"]})
    ld = FeedLoader(Mixture({"web": web, "code": code}, seed=1), batch_size=8)
    assert ld.route.name == "samples" and ld.route.fetch == "mixture"
    for b in ld:
        assert isinstance(b["v"], __import__("torch").Tensor)
    vs = [v for b in FeedLoader(Mixture({"web": web, "code": code}, seed=1), batch_size=200)
          for v in b["v"].tolist()]
    assert sum(v >= 100 for v in vs) == SIZES["code"] and len(vs) == 129


def test_iterated_directly_each_sample_says_its_source(roots) -> None:  # type: ignore[no-untyped-def]
    mix = mixture(roots, ["books", "tiny"], weights={"books": 1, "tiny": 1}, epoch_size=10)
    got = [(s["__source__"], s["__index__"]) for s in mix]
    assert Counter(s for s, _ in got) == {"books": 5, "tiny": 5}
    assert len(mix) == 10


def test_a_state_of_another_mixture_or_a_dataset_is_refused(roots) -> None:  # type: ignore[no-untyped-def]
    a = FeedLoader(mixture(roots, ["web", "code"], weights=[1, 1], epoch_size=20), batch_size=4)
    b = FeedLoader(mixture(roots, ["web", "code"], weights=[1, 2], epoch_size=20), batch_size=4)
    with pytest.raises(StateError, match="another mixture"):
        b.load_state_dict(a.state_dict())
    one = FeedLoader(FeedDataset(roots["web"]), batch_size=4)
    with pytest.raises(StateError, match="not a Mixture's"):
        a.load_state_dict(one.state_dict())


def test_a_mid_epoch_state_of_the_earlier_interleave_is_refused_and_its_epoch_ends_resume(
        roots) -> None:  # type: ignore[no-untyped-def]
    """A state saved by the feedpipe whose plan interleaved the sources by float ideal times
    (version 1): mid-epoch its position names other samples now, refused with the reason; at an
    epoch's start it still resumes."""
    ld = FeedLoader(mixture(roots, ["web", "code"], weights=[1, 1], epoch_size=20), batch_size=4)
    it = iter(ld)
    next(it)
    old = {**ld.state_dict(), "version": 1}
    assert 0 < old["position"] < 20
    with pytest.raises(StateError, match="interleaved the sources otherwise"):
        ld.load_state_dict(old)
    ld.load_state_dict({**old, "position": 0, "epoch": 2})
    assert ld.state_dict()["epoch"] == 2 and len(list(ld)) == 5


def test_bad_arguments_are_refused_naming_the_source(roots, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    web, code = FeedDataset(roots["web"]), FeedDataset(roots["code"])
    with pytest.raises(MixtureError, match="unknown source.*'news'"):
        Mixture({"web": web, "code": code}, weights={"web": 1, "news": 1})
    with pytest.raises(MixtureError, match="no weight for source.*'code'"):
        Mixture({"web": web, "code": code}, weights={"web": 1})
    with pytest.raises(MixtureError, match="source 'code' has weight -1"):
        Mixture({"web": web, "code": code}, weights={"web": 1, "code": -1})
    with pytest.raises(MixtureError, match="source 'code' has weight nan"):
        Mixture({"web": web, "code": code}, weights=[1, float("nan")])
    with pytest.raises(MixtureError, match="all zero"):
        Mixture({"web": web, "code": code}, weights=[0, 0])
    with pytest.raises(MixtureError, match="3 weights for 2 sources"):
        Mixture({"web": web, "code": code}, weights=[1, 1, 1])
    with pytest.raises(MixtureError, match="source 'code' is a str"):
        Mixture({"web": web, "code": roots["code"]})  # type: ignore[dict-item]
    with pytest.raises(MixtureError, match="epoch_size must be at least 1"):
        Mixture({"web": web, "code": code}, epoch_size=0)
    with pytest.raises(MixtureError, match="source 'code' is rank 1 of 2"):
        Mixture({"web": web, "code": FeedDataset(roots["code"], rank=1, world_size=2)})
    stored = FeedDataset(roots["code"], transform=lambda x: x, decoded_cache=str(tmp_path))
    with pytest.raises(MixtureError, match="source 'code' has a decoded_cache") as e:
        Mixture({"web": web, "code": stored})
    # the message says where the store is, why it is refused and what to write instead
    assert str(stored.decoded.path) in str(e.value)
    assert "neither fills nor reads" in str(e.value)
    assert "transform=FunctionIndex(" in str(e.value) and ".wrap(" in str(e.value)


def test_a_source_its_weight_gives_no_sample_an_epoch_is_said(roots, caplog) -> None:  # type: ignore[no-untyped-def]
    web, code = FeedDataset(roots["web"]), FeedDataset(roots["code"])
    with caplog.at_level("WARNING", logger="feedpipe"):
        mix = Mixture({"web": web, "code": code}, weights={"web": 99, "code": 1}, epoch_size=20)
    assert mix.mixture_plan.counts.tolist() == [20, 0]
    assert any("source 'code'" in r.getMessage() and "no sample" in r.getMessage()
               for r in caplog.records)


def test_raw_batches_of_sources_with_other_fields_are_refused_naming_the_source(
        roots, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    other = str(tmp_path / "other")
    write_samples([{"__key__": f"o{i}", "json": f"{{\"i\": {i}}}"} for i in range(5)], other)
    mix = Mixture({"web": FeedDataset(roots["web"]), "other": FeedDataset(other)})
    with pytest.raises(MixtureError, match="source 'other' has fields \\['json'\\], source 'web'"):
        FeedLoader(mix, batch_size=4)
    # with a collate_fn that takes them, they are the user's to collate
    assert sum(len(b) for b in FeedLoader(mix, batch_size=4, collate_fn=list)) == 125


def test_sources_decoding_alike_is_refused_or_said_naming_the_source(roots) -> None:  # type: ignore[no-untyped-def]
    mix = Mixture({"web": FeedDataset(roots["web"], decode={"cls": int}),
                   "code": FeedDataset(roots["code"])})
    with pytest.raises(ValueError, match="sources decode theirs differently"):
        FeedLoader(mix, batch_size=4, route="refs")
    with pytest.raises(MixtureError, match=r"source 'code' decodes \[\], source 'web' \['cls'\]"):
        FeedLoader(mix, batch_size=4)
    ld = FeedLoader(mix, batch_size=4, collate_fn=list)  # the user's collation takes them
    assert ld.route.name == "samples"
    kinds = {(x["__source__"], type(x["cls"]).__name__) for b in ld for x in b}
    assert kinds == {("web", "int"), ("code", "memoryview")}


def test_outputs_that_do_not_collate_are_said_naming_field_and_sources(roots) -> None:  # type: ignore[no-untyped-def]
    web = FeedDataset(roots["web"], transform=lambda x: {"v": 1, "t": "a"})
    code = FeedDataset(roots["code"], transform=lambda x: {"v": "one", "t": "b"})
    ld = FeedLoader(Mixture({"web": web, "code": code}, seed=2), batch_size=64)
    with pytest.raises(MixtureError, match="field 'v' is int in source 'web', str in source "
                                           "'code'"):
        list(ld)


def test_packed_rows_of_a_mixture_resume_on_another_world_to_exactly_the_rest(
        tmp_path: Path) -> None:
    """``Packed(Mixture(...))``: the mixture's documents (drawn by its plan) packed into rows;
    two ranks take a step, one rank resumes from rank 0's state: every token of the epoch's
    documents once."""
    from feedpipe import Packed

    rng = np.random.default_rng(0)
    docs = {name: [rng.integers(1, 1000, size=int(rng.integers(5, 60))) for _ in range(n)]
            for name, n in (("web", 60), ("books", 20))}
    for name, ds in docs.items():
        write_samples(({"__key__": f"{name}{i}", "tokens.npy": a} for i, a in enumerate(ds)),
                      str(tmp_path / name), max_samples=16)

    def loader(rank: int, world: int) -> Any:
        mix = Mixture({n: FeedDataset(str(tmp_path / n), shuffle=True, rank=rank,
                                      world_size=world) for n in docs},
                      weights={"web": 3, "books": 1}, epoch_size=80, seed=3)
        return FeedLoader(Packed(mix, seq_len=32), batch_size=4)

    def tokens(batches: list[Any]) -> Counter[int]:
        return Counter(t for b in batches for t in b["input_ids"][b["labels"] != -100].tolist())

    two = [loader(r, 2) for r in range(2)]
    steps = [next(iter(ld)) for ld in two]
    one = loader(0, 1)
    one.load_state_dict(two[0].state_dict())
    whole = Counter(t for d in docs.values() for a in d for t in a.tolist())  # each once
    assert tokens(steps) + tokens(list(one)) == whole


def test_device_and_workers_give_the_same_batches_as_inline(roots) -> None:  # type: ignore[no-untyped-def]
    names = ["web", "books", "code"]
    kw = {"weights": {"web": 2, "books": 1, "code": 1}, "epoch_size": 60, "seed": 5}
    want = [(b["__source__"], b["__index__"].tolist())
            for b in FeedLoader(mixture(roots, names, **kw), batch_size=8, route="samples")]
    for extra in ({"device": "cpu"}, {"num_workers": 2}, {"num_workers": 2, "device": "cpu"}):
        ld = FeedLoader(mixture(roots, names, **kw), batch_size=8, **extra)
        got = [(b["__source__"], b["__index__"].tolist()) for b in ld]
        assert got == want, extra
        assert ld.stats()["sources"] == {"web": 30, "books": 15, "code": 15}


def test_a_plain_dataloader_with_workers_reads_the_epoch_once(roots) -> None:  # type: ignore[no-untyped-def]
    """As a FeedDataset can be, a Mixture is read by a plain DataLoader: its worker processes
    share the epoch, each sample once."""
    from torch.utils.data import DataLoader

    mix = mixture(roots, ["books", "code", "tiny"], weights=[2, 1, 1], epoch_size=40)
    got = [(x["__source__"], x["__index__"]) for b in DataLoader(
        mix, batch_size=4, num_workers=2, collate_fn=list) for x in b]
    want = [(x["__source__"], x["__index__"]) for x in mix]
    assert sorted(got) == sorted(want) and len(got) == 40
    assert Counter(s for s, _ in got) == {"books": 20, "code": 10, "tiny": 10}


def test_a_source_read_through_its_shard_cache_is_counted_and_said(roots, tmp_path: Path,
                                                                   caplog) -> None:  # type: ignore[no-untyped-def]
    cached = FeedDataset(roots["books"], cache_dir=str(tmp_path / "l1"), shuffle=True)
    with caplog.at_level("WARNING", logger="feedpipe"):
        mix = Mixture({"books": cached, "code": FeedDataset(roots["code"])}, seed=1)
    assert any("'books' reads through its shard cache without prefetching" in r.getMessage()
               for r in caplog.records)
    shards = -(-SIZES["books"] // PER_SHARD["books"])
    for workers in (0, 2, 0):
        ld = FeedLoader(mix, batch_size=5, num_workers=workers)
        got = Counter(s for b in ld for s in b["__source__"])
        assert got == {"books": SIZES["books"], "code": SIZES["code"]}
        l1 = ld.stats()["io"]["l1"]
        if workers:  # each worker opens the shards it reads: every one, once each at least
            assert l1["hits"] >= shards and l1["misses"] == 0
        else:  # the first pass fills the cache, the last finds it filled
            assert l1["hits"] + l1["misses"] == shards
        # the pass let go of every cached shard (its lease in the cache released)
        assert not any(cached.shards.is_open(k) for k in range(shards))
