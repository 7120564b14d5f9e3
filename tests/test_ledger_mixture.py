"""The delivery ledger over a :class:`~feedpipe.Mixture` (``FeedLoader(mixture, ledger=DIR)``):
an epoch must deliver each (source, id) as many times as the mixture's plan draws it that epoch
(a source drawn more than its size repeats samples by design, one drawn less leaves some out), and
every fault is named per source: a batch dropped or repeated by a resume point moved, an epoch
left early. A real FeedLoader over a real mixture of two datasets, the truth taken from what the
loop received."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import run_feedpipe

from feedpipe import FeedDataset, FeedLoader, Mixture, check_ledger, write_samples

SIZES = {"web": 30, "code": 7}
# web drawn 20 of its 30 an epoch, code 20 of its 7 (each of its samples two or three times)
WEIGHTS = {"web": 1, "code": 1}
EPOCH = 40
BATCH = 4


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("mixledger")
    out = {}
    for name, n in SIZES.items():
        out[name] = str(base / name)
        write_samples(({"__key__": f"{name}-{i:04d}", "cls": i} for i in range(n)), out[name],
                      max_samples=5)
    return out


def loader(roots: dict[str, str], ledger: Path, **kw: Any) -> FeedLoader:
    mix = Mixture({n: FeedDataset(roots[n], shuffle=True, seed=3, decode={"cls": int})
                   for n in SIZES}, weights=WEIGHTS, epoch_size=EPOCH, seed=5)
    return FeedLoader(mix, batch_size=BATCH, ledger=ledger, **kw)


def pairs(batch: dict[str, Any]) -> list[tuple[str, int]]:
    return list(zip(batch["__source__"], batch["__index__"].tolist()))


def plan_of(roots: dict[str, str], tmp_path: Path, epoch: int) -> Counter[tuple[str, int]]:
    """What the epoch draws, as a plain pass of a ledger-less loader delivers it."""
    mix = Mixture({n: FeedDataset(roots[n], shuffle=True, seed=3, decode={"cls": int})
                   for n in SIZES}, weights=WEIGHTS, epoch_size=EPOCH, seed=5)
    ld = FeedLoader(mix, batch_size=BATCH)
    ld.set_epoch(epoch)
    return Counter(p for b in ld for p in pairs(b))


def by_source(findings: dict[str, Any]) -> Counter[tuple[str, int]]:
    return Counter((s, i) for s, ids in findings["sources"].items() for i in ids)


def test_whole_epochs_of_a_mixture_are_exactly_once(roots: dict[str, str],
                                                    tmp_path: Path) -> None:
    ld = loader(roots, tmp_path / "l")
    for e in range(2):
        got = Counter(p for b in ld for p in pairs(b))
        assert got == plan_of(roots, tmp_path, e)
        assert max(got[("code", i)] for i in range(SIZES["code"])) > 1  # drawn again by design
    r = check_ledger(tmp_path / "l")
    assert r["ok"] and [e["epoch"] for e in r["epochs"]] == [0, 1]
    assert r["mixture"]["sources"] == ["web", "code"] and r["mixture"]["epoch_size"] == EPOCH
    assert all(e["finished"] and e["exactly_once"] and e["delivered"] == EPOCH
               and e["expected"] == EPOCH for e in r["epochs"])
    out = run_feedpipe("ledger", tmp_path / "l")
    assert out.returncode == 0 and "OK: every finished epoch exactly once" in out.stdout
    assert "40 of 40 delivered" in out.stdout
    assert "web (30 samples, 20 drawn an epoch)" in out.stdout


def test_an_epoch_left_early_names_its_losses_per_source(roots: dict[str, str],
                                                         tmp_path: Path) -> None:
    ld = loader(roots, tmp_path / "l")
    it = iter(ld)
    got = Counter(p for _ in range(3) for p in pairs(next(it)))
    it.close()
    ld.set_epoch(1)  # the loop moves on: the rest of epoch 0 is lost
    for _ in ld:
        pass
    r = check_ledger(tmp_path / "l")
    e0 = r["epochs"][0]
    assert not r["ok"] and e0["finished"] and not e0["exactly_once"]
    want = plan_of(roots, tmp_path, 0) - got
    assert by_source(e0["losses"]) == want and sum(want.values()) == EPOCH - 3 * BATCH
    assert e0["losses"]["count"] == len(want)  # ids, each named once in "ids"
    assert r["epochs"][1]["exactly_once"]
    out = run_feedpipe("ledger", tmp_path / "l")
    assert out.returncode == 1 and "NOT exactly once" in out.stdout
    assert "losses, web ids" in out.stdout and "code ids" in out.stdout


@pytest.mark.parametrize("delta", [0, BATCH, -BATCH])
def test_a_resume_is_exactly_once_and_a_moved_resume_point_is_named(
        roots: dict[str, str], tmp_path: Path, delta: int) -> None:
    """A state resumed as saved: exactly once. Moved one batch on (``+``): that batch is lost;
    one batch back (``-``): it is repeated."""
    first = loader(roots, tmp_path / "l")
    it = iter(first)
    got = Counter(p for _ in range(4) for p in pairs(next(it)))
    state = copy.deepcopy(first.state_dict())
    it.close()
    state["position"] += delta
    second = loader(roots, tmp_path / "l")
    second.load_state_dict(state)
    got += Counter(p for b in second for p in pairs(b))
    plan = plan_of(roots, tmp_path, 0)
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert e["finished"] and e["delivered"] == sum(got.values())
    assert by_source(e["losses"]) == plan - got
    assert by_source(e["repeats"]) == got - plan
    assert r["ok"] == (delta == 0) == e["exactly_once"]
    assert sum((plan - got).values()) == max(delta, 0)  # the batch skipped over
    assert sum((got - plan).values()) == max(-delta, 0)  # the batch delivered again


def test_a_ledger_of_a_mixture_is_refused_for_another_mixture(roots: dict[str, str],
                                                               tmp_path: Path) -> None:
    from feedpipe import StateError

    loader(roots, tmp_path / "l")
    other = Mixture({n: FeedDataset(roots[n], shuffle=True, seed=3) for n in SIZES},
                    weights={"web": 2, "code": 1}, epoch_size=EPOCH, seed=5)
    with pytest.raises(StateError, match="another dataset or order"):
        FeedLoader(other, batch_size=BATCH, ledger=tmp_path / "l")


def test_the_help_names_every_key_of_a_mixtures_json_document(roots: dict[str, str],
                                                              tmp_path: Path) -> None:
    import json

    ld = loader(roots, tmp_path / "l")
    it = iter(ld)
    next(it)
    it.close()
    ld.set_epoch(1)  # epoch 0 left early: its losses hold the per-source key
    for _ in ld:
        pass
    doc = json.loads(run_feedpipe("ledger", tmp_path / "l", "--json").stdout)
    text = " ".join(run_feedpipe("ledger", "--help").stdout.split())
    keys = (set(doc) | set(doc["mixture"]) | set(doc["epochs"][0])
            | set(doc["epochs"][0]["losses"]))
    assert "sources" in doc["epochs"][0]["losses"]
    assert {k for k in keys if f'"{k}"' not in text} == set()


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_of_a_mixture_with_padding_or_drops_are_exactly_once(
        roots: dict[str, str], tmp_path: Path, drop_last: bool) -> None:
    """40 positions over 3 ranks: 2 repeated as padding (``drop_last=False``) or 1 left out
    by design (``True``): neither is a repeat or a loss. The ranks step in lockstep."""
    lds = [FeedLoader(Mixture({n: FeedDataset(roots[n], shuffle=True, seed=3, rank=r,
                                              world_size=3, decode={"cls": int})
                               for n in SIZES}, weights=WEIGHTS, epoch_size=EPOCH, seed=5,
                              drop_last=drop_last), batch_size=BATCH, ledger=tmp_path / "l")
           for r in range(3)]
    got: Counter[tuple[str, int]] = Counter()
    for batches in zip(*lds):
        for b in batches:
            got.update(pairs(b))
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert r["ok"] and e["finished"] and e["exactly_once"]
    assert sum(got.values()) == e["delivered"] + e["padding"] == EPOCH - e["dropped"] + e["padding"]
    assert (e["padding"], e["dropped"]) == ((0, 1) if drop_last else (2, 0))


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_a_sources_transform_skipped_are_named_in_that_source(
        roots: dict[str, str], tmp_path: Path, workers: int) -> None:
    """A skip is one of the draws of its (source, id): counted apart, neither delivered nor
    lost; the same id of the other source is untouched. In this process and in workers."""
    from feedpipe import SampleSkipped

    def skip_3(x: dict[str, Any]) -> dict[str, Any]:
        if x["__index__"] == 3:
            raise SampleSkipped(f"sample {x['__key__']} left out")
        return x

    mix = Mixture({"web": FeedDataset(roots["web"], shuffle=True, seed=3, decode={"cls": int}),
                   "code": FeedDataset(roots["code"], shuffle=True, seed=3,
                                       decode={"cls": int}, transform=skip_3)},
                  weights=WEIGHTS, epoch_size=EPOCH, seed=5)
    ld = FeedLoader(mix, batch_size=BATCH, num_workers=workers, ledger=tmp_path / "l")
    got = Counter(p for b in ld for p in pairs(b))
    plan = plan_of(roots, tmp_path, 0)
    assert ("code", 3) not in got and plan[("code", 3)] >= 2
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert r["ok"] and e["exactly_once"] and e["delivered"] == EPOCH - plan[("code", 3)]
    assert e["skipped"]["count"] == plan[("code", 3)]
    assert set(e["skipped"]["ids"]) == {SIZES["web"] + 3}  # code's id 3, after web's samples


def test_a_ledger_written_with_the_earlier_interleave_is_refused_naming_it(
        roots: dict[str, str], tmp_path: Path) -> None:
    """A ledger whose record names no interleave was written by a feedpipe that ordered the
    sources by float ideal times: its positions name other samples under today's plan, so it
    is refused with the reason, not reported as losses and repeats."""
    import json

    from feedpipe import StateError

    ld = loader(roots, tmp_path / "l")
    for _ in ld:
        pass
    assert check_ledger(tmp_path / "l")["ok"]
    record = tmp_path / "l" / "ledger.json"
    doc = json.loads(record.read_text())
    found = [d for d in _dicts(doc) if d.get("kind") == "mixture"]
    assert found and all(d["interleave"] == 2 for d in found)
    for d in found:
        del d["interleave"]
    record.write_text(json.dumps(doc))
    with pytest.raises(StateError, match="interleaves the sources otherwise"):
        check_ledger(tmp_path / "l")


def _dicts(x: Any) -> list[dict[str, Any]]:
    """Every dict inside a JSON document."""
    if isinstance(x, dict):
        return [x, *(d for v in x.values() for d in _dicts(v))]
    if isinstance(x, list):
        return [d for v in x for d in _dicts(v)]
    return []
