"""Record-sized buffers that a decoded store serves its hits from, reused once nothing holds them.

A sample's arrays are views of its record buffer; they die once the batch is collated. A fresh
record-sized allocation per hit is an ``mmap`` of fresh pages, or heap that glibc trims back after
every batch: either way the copy page-faults on every page it writes. Reusing the buffers of
samples already collated avoids those faults (benchmarks/bench_tiers.py, the ``l1+decoded``
system's second epoch).
"""

from __future__ import annotations

import sys

import numpy as np


class RecordPool:
    """Buffers for copies of records, recycled once only the pool refers to them.

    Example:
        >>> pool = RecordPool()
        >>> a = pool.copy_of(np.arange(4, dtype=np.uint8)); a.tolist()
        [0, 1, 2, 3]
        >>> del a  # the sample is gone: its buffer serves the next hit
        >>> pool.copy_of(np.ones(4, np.uint8)).tolist()
        [1, 1, 1, 1]
    """

    _CAP = 256 << 20  # bytes kept at most; beyond that, hits allocate fresh buffers

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = []
        self._at = 0
        probe = [np.empty(1, np.uint8)]
        self._free = sys.getrefcount(probe[0])  # a buffer only the list refers to

    def copy_of(self, src: np.ndarray) -> np.ndarray:
        """A copy of ``src`` in a free buffer of its shape, or in a new one."""
        bufs, n = self._bufs, len(self._bufs)
        for k in range(min(n, 4)):  # from where the last was found: hits die in order
            i = (self._at + k) % n
            # more references than the list's: a sample still holds a view of it
            if sys.getrefcount(bufs[i]) == self._free and bufs[i].shape == src.shape:
                self._at = i + 1
                np.copyto(bufs[i], src)
                return bufs[i]
        out = src.copy()
        if out.nbytes and (n + 1) * out.nbytes <= self._CAP:
            bufs.append(out)
        return out
