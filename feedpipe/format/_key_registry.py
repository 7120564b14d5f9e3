"""Sample keys held by more than one sample of a dataset.

A key names one sample in the whole dataset, not only in its shard: two samples with one key are
a copied shard, or parts whose writers each saw only their own keys, and an epoch reads the
sample twice. ``feedpipe index``, ``feedpipe merge`` and ``feedpipe verify`` find them with the
one :class:`KeyRegistry`, so they refuse (or report) the same datasets.

The registry holds each key's hash (8 bytes, in a NumPy array per shard), not the key, so that
checking a large dataset does not hold a Python string per sample. The keys whose hashes meet
are read again (``keys_of``) and compared as text: a hash collision never reports a clash.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Clash:
    """A key seen again: in shard ``second`` (sample ``index`` of it), first seen in ``first``
    (the same shard when one shard holds the key twice)."""

    key: str
    first: str
    second: str
    index: int


class KeyRegistry:
    """Add each shard's keys in dataset order, then ask for the :meth:`clashes`.

    Example:
        >>> keys = {"a.tar": ["k0", "k1"], "b.tar": ["k2", "k1"]}
        >>> reg = KeyRegistry()
        >>> for shard, shard_keys in keys.items():
        ...     reg.add(shard, shard_keys)
        >>> [(c.key, c.first, c.second) for c in reg.clashes(keys.__getitem__)]
        [('k1', 'a.tar', 'b.tar')]
    """

    def __init__(self) -> None:
        self.shards: list[str] = []
        self._hashes: list[Any] = []  # per shard, its keys' hashes (np.int64)

    def add(self, shard: str, keys: Sequence[str]) -> None:
        """Record the keys of ``shard``, in its sample order (each shard once)."""
        import numpy as np

        self.shards.append(shard)
        self._hashes.append(np.fromiter(map(hash, keys), np.int64, count=len(keys)))

    def clashes(self, keys_of: Callable[[str], Sequence[str]]) -> list[Clash]:
        """Every sample whose key an earlier sample holds, in dataset order.

        Args:
            keys_of: the keys of a shard, as given to :meth:`add`; asked only for shards that
                hold a key whose hash another key has.
        """
        import numpy as np

        if not self._hashes:
            return []
        every = np.concatenate(self._hashes)
        order = np.argsort(every, kind="stable")
        ordered = every[order]
        same = ordered[1:] == ordered[:-1]
        if not same.any():
            return []
        meets = np.zeros(len(every), bool)  # in sorted order: the hash is another key's too
        meets[1:] |= same
        meets[:-1] |= same
        suspects = np.sort(order[meets])  # their positions in the dataset, in dataset order
        starts = np.cumsum([0] + [len(h) for h in self._hashes])
        shard_of = np.searchsorted(starts, suspects, side="right") - 1
        first: dict[str, int] = {}
        loaded: dict[int, Sequence[str]] = {}
        out: list[Clash] = []
        for pos, s in zip(suspects.tolist(), shard_of.tolist()):
            if s not in loaded:
                loaded[s] = keys_of(self.shards[s])
            i = pos - int(starts[s])
            key = loaded[s][i]
            at = first.get(key)
            if at is None:
                first[key] = s
            else:  # (an earlier shard, or earlier in this one)
                out.append(Clash(key, self.shards[at], self.shards[s], i))
        return out
