"""A :class:`~feedpipe.DeviceCache`'s dataset side: the samples it warms up from and the
fallback that reads again, from the dataset, the samples that are not resident."""

from __future__ import annotations

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


def is_dataset(x: Any) -> bool:
    """Whether ``x`` is a :class:`~feedpipe.FeedDataset`, told by what it offers: this layer
    sits below the streaming one and does not import it."""
    return all(hasattr(x, a) for a in ("sample", "in_order", "sample_ids", "manifest"))


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
