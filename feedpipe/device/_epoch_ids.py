"""The ids an epoch of a :class:`~feedpipe.DeviceCache` serves, from whatever gives its order."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import DeviceCacheError
from ..plan._order import Plan, Split
from ._fallback import is_dataset


def epoch_ids(order: Any, num_samples: int) -> np.ndarray:
    """The ids an epoch delivers, checked to lie in ``[0, num_samples)``.

    Args:
        order: a :class:`~feedpipe.FeedDataset` (its current epoch and this rank's share,
            resume point included), a :class:`~feedpipe.Plan` (one rank), a ``(Plan, Split)``
            pair, or a sequence (or tensor) of ids.
        num_samples: the dataset's samples.

    Example:
        >>> epoch_ids([3, 1, 2], 4).tolist()
        [3, 1, 2]
    """
    if is_dataset(order):
        ids = order.sample_ids()
    elif isinstance(order, Plan):
        ids = order.sample_ids(np.arange(order.num_samples))
    elif isinstance(order, tuple) and len(order) == 2 and isinstance(order[0], Plan) \
            and isinstance(order[1], Split):
        ids = order[0].sample_ids(order[1].positions(0, order[1].length))
    elif isinstance(order, torch.Tensor):
        ids = order.detach().to("cpu", torch.int64).numpy()
    else:
        ids = np.asarray(order, dtype=np.int64)
    if ids.ndim != 1:
        raise DeviceCacheError(f"an epoch's ids must be one-dimensional, not shape {ids.shape}")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_samples):
        raise DeviceCacheError(f"the epoch asks for ids outside [0, {num_samples}) "
                               f"(min {ids.min()}, max {ids.max()})")
    return ids
