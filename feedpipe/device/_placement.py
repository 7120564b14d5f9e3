"""Where batches go: the device resolved from a request, and a batch's tensors mapped."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; a CUDA request on a machine without CUDA becomes the CPU
    (the documented fallback of the device tier). Touches CUDA only when CUDA was asked for.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    d = torch.device("cuda" if device is None else device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it; containers keep their type and order
    (tuples, named tuples, lists, mappings), anything else passes through unchanged.

    Example:
        >>> import torch
        >>> map_tensors(lambda t: t + 1, {"x": torch.zeros(2), "n": [torch.ones(1)], "s": "a"})
        {'x': tensor([1., 1.]), 'n': [tensor([2.])], 's': 'a'}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        out = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        try:
            return type(obj)(out)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict (defaultdict)
            return out
    if isinstance(obj, tuple):
        items = [map_tensors(fn, v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_tensors(fn, v) for v in obj]
    return obj
