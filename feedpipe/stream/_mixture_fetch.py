"""A :class:`~feedpipe.Mixture`'s own parts of a route: the ``mixture`` fetch, which reads
each sample through its source, and the transform that sends each sample to its source's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._batch_loop import Item, SampleFetch

if TYPE_CHECKING:
    from ._source import Source


class BySource:
    """The transform of a mixture: each sample through its own source's transform (its
    ``__source__`` says which); a source without one passes its samples as they are."""

    def __init__(self, names: Sequence[str], transforms: Sequence[Any]) -> None:
        self.transforms = dict(zip(names, transforms))

    def __call__(self, x: dict[str, Any]) -> Any:
        name = x["__source__"]
        fn = self.transforms[name]
        if fn is None:
            return x
        out = fn(x)
        if type(out) is dict:  # a dict output says its source too
            out.setdefault("__source__", name)
        return out


class BySourceInto(BySource):
    """:class:`BySource` whose sources' transforms all write into a collator's rows, with the
    same ``out_shape`` and ``out_dtype``."""

    def __init__(self, names: Sequence[str], transforms: Sequence[Any]) -> None:
        super().__init__(names, transforms)
        self.out_shape = tuple(transforms[0].out_shape)
        self.out_dtype = transforms[0].out_dtype

    def into(self, x: dict[str, Any], out: torch.Tensor) -> Any:
        return self.transforms[x["__source__"]].into(x, out)


class MixtureFetch:
    """fetch=mixture: each number's sample read through its own source (the source's
    :class:`~feedpipe.stream._batch_loop.SampleFetch`: its shards, ``decode=`` and seed), marked
    with ``__source__``, in the batch's order."""

    def __init__(self, names: Sequence[str], bases: np.ndarray, sources: Sequence[Source],
                 epoch: int, *, copy: bool = False) -> None:
        self.names = names
        self.bases = bases  # each source's first number
        self.fetches = [SampleFetch(ds, epoch, stored=False, copy=copy) for ds in sources]

    def __call__(self, ids: np.ndarray) -> list[Item]:
        src = np.searchsorted(self.bases, ids, side="right") - 1
        got: list[Item] = []
        where: list[np.ndarray] = []
        for s in np.unique(src).tolist():
            at = np.flatnonzero(src == s)
            name, base = self.names[s], int(self.bases[s])
            for g, x, done in self.fetches[s](ids[at] - base):
                x["__source__"] = name
                got.append((base + g, x, done))
            where.append(at)
        if len(where) <= 1:
            return got
        # each source's samples were read together: put them back in the batch's order
        pos = np.empty(len(ids), dtype=np.int64)
        pos[np.concatenate(where)] = np.arange(len(ids))
        return list(map(got.__getitem__, pos.tolist()))
