"""What a DeviceCache reads of a dataset is a declared interface (WarmupSource), not a guess
from the attributes an object happens to have."""

from __future__ import annotations

from typing import Any

import numpy as np

from feedpipe import FeedDataset
from feedpipe.device._epoch_ids import epoch_ids
from feedpipe.device._fallback import DatasetFallback, WarmupSource, is_dataset


class _Manifest:
    total_samples = 4


class Squares(WarmupSource):
    """A third-party source a cache can warm up from: sample g holds g * g."""

    manifest = _Manifest()

    def in_order(self, transform: Any) -> Any:
        return [transform(self.sample(g)) for g in range(4)]

    def sample_ids(self, epoch: int | None = None) -> np.ndarray:
        return np.array([3, 1, 2, 0])

    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        return {"__index__": g, "x": np.float32(g * g)}


class LooksLikeOne:
    """Offers the same names without declaring the interface (a list of ids could, too)."""

    manifest = _Manifest()
    sample = in_order = sample_ids = None


def test_a_feed_dataset_and_a_declared_source_are_read_as_datasets() -> None:
    assert is_dataset(FeedDataset("shards/example"))
    assert is_dataset(Squares())
    assert epoch_ids(Squares(), 4).tolist() == [3, 1, 2, 0]
    out = DatasetFallback(Squares(), lambda s: {"x": s["x"]})(np.array([2, 3]))
    assert out["x"].tolist() == [4.0, 9.0]


def test_an_object_that_only_has_the_names_is_not_taken_for_a_dataset() -> None:
    assert not is_dataset(LooksLikeOne())
    assert not is_dataset(np.arange(4))
