"""The arguments of :class:`~feedpipe.FeedLoader`, checked before anything is made: each refusal
says which argument, what was wrong and what to pass instead."""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral
from typing import Any

from ._collator import BatchCollator
from ._routes import ROUTES

# DataLoader arguments that would choose the order, which the source's plan decides
_REFUSED = ("shuffle", "sampler", "batch_sampler")


def check_arguments(batch_size: Any, num_workers: int, transform_threads: int, collate_fn: Any,
                    route: str, loader_kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError``/``ValueError`` for an argument of FeedLoader that cannot work."""
    for bad in _REFUSED:
        if bad in loader_kwargs:
            raise TypeError(f"FeedLoader does not take {bad}=: the FeedDataset's plan decides "
                            "the order (pass shuffle=/seed= to FeedDataset)")
    if isinstance(transform_threads, bool) or int(transform_threads) < 0:
        raise ValueError(f"transform_threads must be 0 or more, not {transform_threads!r}")
    if int(num_workers) < 0:
        raise ValueError(f"num_workers must be 0 or more, not {num_workers!r}")
    if batch_size is None:
        raise TypeError("FeedLoader always makes batches: batch_size=None (the DataLoader's "
                        "one sample at a time, uncollated) is iterating the FeedDataset "
                        "itself, `for sample in dataset`; give FeedLoader an integer "
                        "batch_size of 1 or more")
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral) or int(batch_size) < 1:
        raise ValueError(f"batch_size must be an integer of 1 or more, not {batch_size!r}")
    if isinstance(collate_fn, BatchCollator) and int(batch_size) > collate_fn.batch_size:
        raise ValueError(
            f"FeedLoader(batch_size={batch_size}) with a BatchCollator of batch_size "
            f"{collate_fn.batch_size}: a batch of {batch_size} samples does not fit its "
            f"{collate_fn.batch_size} rows; give both the same size, e.g. "
            f"FeedLoader(ds, batch_size={batch_size}, collate_fn=BatchCollator("
            f"{batch_size}, ...))")
    if route != "auto" and route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; the routes are "
                         f"{', '.join(['auto', *ROUTES])}")
