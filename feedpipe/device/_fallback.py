"""A :class:`~feedpipe.DeviceCache`'s dataset side: the samples it warms up from and the
fallback that reads again, from the dataset, the samples that are not resident."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch


def as_fields(out: Any) -> dict[str, Any] | tuple[Any, ...]:
    """A transform's output as fields: a mapping stays one, a tuple is one, else one field.

    Example:
        >>> as_fields({"x": 1}), as_fields((1, 2)), as_fields(3)
        ({'x': 1}, (1, 2), (3,))
    """
    if isinstance(out, Mapping):
        return dict(out)
    return out if isinstance(out, tuple) else (out,)


class WarmupSource(ABC):
    """What a :class:`~feedpipe.DeviceCache` reads of a dataset, declared: it warms up from
    :meth:`in_order`, reads the samples that are not resident with :meth:`sample`, and takes an
    epoch's ids from :meth:`sample_ids`. :class:`~feedpipe.FeedDataset` implements it (beside
    :class:`~feedpipe.Source`, which this layer, below the streaming one, does not import); a
    source of another kind that implements it warms a cache the same way."""

    manifest: Any  # what holds ``total_samples``: the ids are 0 .. total_samples - 1

    @abstractmethod
    def in_order(self, transform: Callable[[dict[str, Any]], Any] | None) -> Any:
        """Every sample once, in id order, each through ``transform`` (an iterable dataset)."""

    @abstractmethod
    def sample_ids(self, epoch: int | None = None) -> np.ndarray:
        """The ids this rank delivers in ``epoch``, in order."""

    @abstractmethod
    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        """Sample ``g`` (a global id), as the transform sees it."""


def is_dataset(x: Any) -> bool:
    """Whether ``x`` is a dataset a cache reads itself (a :class:`WarmupSource`), not ids or
    batches given to it."""
    return isinstance(x, WarmupSource)


class WithId:
    """Picklable wrapper: a FeedDataset transform whose output keeps the sample's global id.

    Args:
        transform: the sample dict -> tensors function of the warm-up.
    """

    def __init__(self, transform: Callable[[dict[str, Any]], Any]) -> None:
        self.transform = transform

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, ...]:
        out = as_fields(self.transform(sample))
        return (sample["__index__"], out) if isinstance(out, dict) else (sample["__index__"], *out)


class DatasetFallback:
    """Samples by id from a :class:`~feedpipe.FeedDataset` and a transform, read in this
    process, as one batch (the fallback contract of :meth:`~feedpipe.DeviceCache.batches`).

    Args:
        dataset: the dataset the ids refer to.
        transform: the same sample dict -> tensors function the warm-up used.
    """

    def __init__(self, dataset: Any, transform: Callable[[dict[str, Any]], Any]) -> None:
        self.dataset = dataset
        self.transform = transform

    def __call__(self, ids: np.ndarray) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
        ds = self.dataset  # its open shards, random access by id, decode= applied
        rows = [as_fields(self.transform(ds.sample(g)))
                for g in np.asarray(ids, dtype=np.int64).tolist()]
        if isinstance(rows[0], dict):
            dicts = cast(list[dict[str, Any]], rows)  # the transform gives one kind of output
            return {k: torch.stack([torch.as_tensor(r[k]) for r in dicts]) for k in dicts[0]}
        return tuple(torch.stack([torch.as_tensor(v) for v in col]) for col in zip(*rows))
