"""A loader state names the dataset and shard layout it belongs to (issue 23, defect 1)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest

import feedpipe
from feedpipe import FeedDataset, FeedLoader, StateError
from feedpipe.convert._synth import make_records


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same 203 files sharded at 20 and at 50 samples per shard, and 203 other files."""
    root = tmp_path_factory.mktemp("layouts")
    make_records(str(root / "src-a"), count=203, size=64, per_dir=70, seed=1)
    make_records(str(root / "src-b"), count=203, size=64, per_dir=70, seed=2)
    out = {}
    for name, src, n in (("at20", "src-a", 20), ("at50", "src-a", 50), ("other", "src-b", 20)):
        out[name] = str(root / name)
        feedpipe.shard(str(root / src), out[name], max_samples=n, workers=1,
                       show_progress=False)
    return out


def consume(path: str, batches: int) -> tuple[list[int], dict]:
    ld = FeedLoader(FeedDataset(path, shuffle=True, seed=4), batch_size=8)
    it = iter(ld)
    ids = [i for _ in range(batches) for i in next(it)["__index__"].tolist()]
    return ids, ld.state_dict()


@pytest.mark.parametrize("other", ["at50", "other"])
def test_a_state_is_refused_by_another_layout_or_dataset(layouts: dict[str, str],
                                                         other: str) -> None:
    _, state = consume(layouts["at20"], 5)
    ld = FeedLoader(FeedDataset(layouts[other], shuffle=True, seed=4), batch_size=8)
    what = "another shard layout" if other == "at50" else r"other shards \(their names"
    with pytest.raises(StateError, match=f"saved on {what}.*11 shards, 203 samples"):
        ld.load_state_dict(state)


def test_a_state_resumes_its_own_dataset_exactly(layouts: dict[str, str]) -> None:
    seen, state = consume(layouts["at20"], 5)
    ld = FeedLoader(FeedDataset(layouts["at20"], shuffle=True, seed=4), batch_size=8)
    ld.load_state_dict(state)
    rest = [i for b in ld for i in b["__index__"].tolist()]
    assert Counter(seen + rest) == Counter(range(203))


def test_strict_false_starts_the_saved_epoch_afresh_and_says_so(layouts: dict[str, str],
                                                                caplog) -> None:  # type: ignore[no-untyped-def]
    _, state = consume(layouts["at20"], 5)
    ld = FeedLoader(FeedDataset(layouts["at50"], shuffle=True, seed=4), batch_size=8)
    with caplog.at_level(logging.WARNING, logger="feedpipe"):
        ld.load_state_dict(state, strict=False)
    assert "starting epoch 0 afresh" in caplog.text
    assert sorted(i for b in ld for i in b["__index__"].tolist()) == list(range(203))


def test_a_state_without_an_identity_is_refused(layouts: dict[str, str]) -> None:
    _, state = consume(layouts["at20"], 1)
    old = {k: v for k, v in state.items() if k != "dataset"}
    old["version"] = 1
    ld = FeedLoader(FeedDataset(layouts["at20"], shuffle=True, seed=4), batch_size=8)
    with pytest.raises(StateError, match="version 1"):
        ld.load_state_dict(old)


def test_the_identity_follows_the_manifest(layouts: dict[str, str], tmp_path: Path) -> None:
    a = FeedDataset(layouts["at20"]).state_dict()["dataset"]
    assert a == FeedDataset(layouts["at20"]).state_dict()["dataset"]
    assert a["digest"] != FeedDataset(layouts["at50"]).state_dict()["dataset"]["digest"]
