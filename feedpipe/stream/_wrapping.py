"""A source made over a dataset describes itself as that dataset: :class:`~feedpipe.Packed`
(rows cut from a dataset of documents) and :class:`~feedpipe.Bucketed` (batches of a dataset's
images) read the shards of ``self.dataset``, so its URL, manifest, shards, world, seed and
direct reader's epoch are theirs, and attaching them attaches it. A new kind of source over a
dataset subclasses :class:`OverDataset` too.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ._source import Source

D = TypeVar("D", bound=Source)


class OverDataset(Source, Generic[D]):
    """A :class:`~feedpipe.Source` made over a dataset (``self.dataset``, set by the
    subclass's constructor), which describes itself as that dataset. The subclass implements
    the rest of :class:`~feedpipe.Source` (its plan, state and fetch)."""

    dataset: D  # what it is made over

    @property
    def url(self) -> str:  # type: ignore[override]
        """The dataset's URL."""
        return self.dataset.url

    @property
    def manifest(self) -> Any:
        """The dataset's manifest."""
        return self.dataset.manifest

    @property
    def shards(self) -> Any:  # type: ignore[override]
        """The dataset's shards."""
        return self.dataset.shards

    @property
    def world(self) -> Any:  # type: ignore[override]
        """The dataset's rank and number of ranks (what rows or batches are dealt to)."""
        return self.dataset.world

    @property
    def seed(self) -> int:  # type: ignore[override]
        """The dataset's seed, the plan's."""
        return self.dataset.seed

    @property
    def epoch(self) -> int:
        """The epoch of the dataset's direct reader (a loader keeps its own)."""
        return self.dataset.epoch

    def attach(self) -> None:
        """Attach the dataset (:meth:`~feedpipe.FeedDataset.attach`)."""
        self.dataset.attach()
