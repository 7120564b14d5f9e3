"""Which source each position of a mixture's epoch holds, by formula: any run of positions, or
any positions, computed from the per-epoch counts alone, never by holding the epoch.

**The order.** Source ``s`` is drawn ``c_s`` times an epoch of ``E = sum(c)`` positions. Its
``j``-th draw has the *cell* ``floor(E * (2j + 1) / (2 c_s))``, the position its ideal time
``(j + 1/2) / c_s`` of the epoch falls on. The epoch is every draw ordered by (cell, source):
each source's draws in order, spread at even steps of ``E / c_s``, and a source holds at most one
draw a cell (``E / c_s >= 1``).

**Reaching any position.** The draws of ``s`` whose cell is below ``t`` number
``n_s(t) = ceil(c_s t / E - 1/2)`` (all integers, exactly), so ``N(t) = sum_s n_s(t)`` lies
within ``S / 2`` of ``t`` (``S`` sources). The draws before position ``a`` are those below the
last cell ``t`` with ``N(t) <= a``, and the first ``a - N(t)`` sources with a draw in cell ``t``.
So the state at any position costs ``O(S log S)``, a run of ``m`` positions ``O(m log m + S)``,
and nothing is ever the size of the epoch.
"""

from __future__ import annotations

import numpy as np

# below these, the products of the formulas fit int64 (2 * c * t <= 2 * E**2 < 2**63); above,
# they are computed on Python integers (exact, slower)
_SMALL = 1 << 31
# a run of positions is made in blocks of at most so many (bounds the memory of one call)
BLOCK = 1 << 17


class Interleave:
    """The order of the sources' draws through an epoch (see the module docstring).

    Args:
        counts: draws of each source an epoch (non-negative, summing to at least 1).

    Example:
        >>> iv = Interleave([6, 2])
        >>> src, j = iv.run(0, 8)
        >>> src.tolist(), j.tolist()
        ([0, 0, 1, 0, 0, 0, 1, 0], [0, 1, 0, 2, 3, 4, 1, 5])
        >>> iv.before(3).tolist()
        [2, 1]
    """

    def __init__(self, counts: np.ndarray) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.size = int(self.counts.sum())
        self.small = self.size < _SMALL
        self._c = [int(c) for c in self.counts.tolist()]

    # -- the formulas, on Python integers (exact at any size) -----------------------------
    def _below(self, t: int) -> list[int]:
        """``n_s(t)`` of every source: its draws whose cell is below ``t``."""
        e2 = 2 * self.size
        return [(2 * c * t + self.size - 1) // e2 for c in self._c]

    def before(self, a: int) -> np.ndarray:
        """How many draws of each source lie before position ``a`` (``0 <= a <= E``)."""
        a = int(a)
        half = (len(self._c) + 1) // 2 + 1
        lo, hi = max(0, a - half), min(self.size, a + half)
        while lo < hi:  # the last cell t with N(t) <= a
            mid = (lo + hi + 1) // 2
            if sum(self._below(mid)) <= a:
                lo = mid
            else:
                hi = mid - 1
        at = self._below(lo)
        left = a - sum(at)
        if left:
            nxt = self._below(lo + 1)
            for s, (x, y) in enumerate(zip(at, nxt)):
                if y > x:
                    at[s] += 1
                    left -= 1
                    if not left:
                        break
        return np.array(at, dtype=np.int64)

    def cells(self, src: np.ndarray, j: np.ndarray) -> np.ndarray:
        """The cell of draw ``j`` of source ``src`` (element-wise)."""
        c = self.counts[src]
        if self.small:
            return (self.size * (2 * j + 1)) // (2 * c)
        big = (self.size * (2 * j.astype(object) + 1)) // (2 * c.astype(object))
        return big.astype(np.int64)

    # -- a run of positions ------------------------------------------------------------------
    def run(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The source and its draw number of each position of ``[lo, hi)``."""
        return self.between(self.before(lo), self.before(hi))

    def between(self, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The draws from the state ``first`` (draws of each source before a position) to the
        state ``last``, in order."""
        reps = last - first
        total = int(reps.sum())
        src = np.repeat(np.arange(len(reps), dtype=np.int64), reps)
        j = np.arange(total, dtype=np.int64) + np.repeat(first - (np.cumsum(reps) - reps), reps)
        if not total:
            return src, j
        cell = self.cells(src, j)
        lo = int(cell.min())
        cell -= lo
        # a counting sort by cell: a cell's draws in source order (src is ascending), each
        # source at most once a cell
        at = np.cumsum(np.bincount(cell))
        at[1:] = at[:-1].copy()
        at[0] = 0
        place = np.empty(total, dtype=np.int64)
        ends = np.cumsum(reps)
        for s in np.flatnonzero(reps).tolist():
            c = cell[ends[s] - reps[s]:ends[s]]
            place[ends[s] - reps[s]:ends[s]] = at[c]
            at[c] += 1
        out_src, out_j = np.empty_like(src), np.empty_like(j)
        out_src[place], out_j[place] = src, j
        return out_src, out_j

    # -- any positions -----------------------------------------------------------------------
    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source and its draw number at each of ``positions`` (any order, repeats
        allowed): runs of near positions are made as runs, lone ones found one by one."""
        pos = np.asarray(positions, dtype=np.int64)
        src = np.empty(len(pos), dtype=np.int64)
        j = np.empty(len(pos), dtype=np.int64)
        if not len(pos):
            return src, j
        by = np.argsort(pos, kind="stable")
        q = pos[by]
        gap = max(16, len(self._c))  # a run costs its span, a lone position about S steps
        cuts = np.flatnonzero(np.diff(q) > gap) + 1
        heads, tails = np.r_[0, cuts], np.r_[cuts, len(q)]
        alone = heads + 1 == tails
        if alone.any():
            at = heads[alone]
            src[by[at]], j[by[at]] = self._lone(q[at])
        for a, b in zip(heads[~alone].tolist(), tails[~alone].tolist(), strict=True):
            self._fill(q[a:b], by[a:b], src, j)
        return src, j

    def _fill(self, q: np.ndarray, into: np.ndarray, src: np.ndarray, j: np.ndarray) -> None:
        """Positions ``q`` (ascending, close together) from runs of at most :data:`BLOCK`."""
        lo = int(q[0])
        state = self.before(lo)
        while True:
            hi = min(lo + BLOCK, int(q[-1]) + 1)
            nxt = self.before(hi)
            s, d = self.between(state, nxt)
            a, b = np.searchsorted(q, [lo, hi])
            src[into[a:b]], j[into[a:b]] = s[q[a:b] - lo], d[q[a:b] - lo]
            if b >= len(q):
                return
            lo, state = int(q[b]), (nxt if int(q[b]) == hi else self.before(int(q[b])))

    def _lone(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions one by one, vectorised: each one's cell by a bisection of ``N(t)``
        within ``S / 2`` of it, then its place among the sources with a draw in that cell."""
        if not self.small:
            pairs = [self.run(int(x), int(x) + 1) for x in p.tolist()]
            return (np.array([int(s[0]) for s, _ in pairs], dtype=np.int64),
                    np.array([int(d[0]) for _, d in pairs], dtype=np.int64))
        c = self.counts[None, :]
        e, e2 = self.size, 2 * self.size

        def below(t: np.ndarray) -> np.ndarray:
            return (2 * c * t[:, None] + e - 1) // e2

        half = (len(self._c) + 1) // 2 + 1
        lo, hi = np.maximum(0, p - half), np.minimum(e, p + half)
        while (lo < hi).any():
            mid = (lo + hi + 1) // 2
            ok = below(mid).sum(axis=1) <= p
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
        at = below(lo)
        here = below(lo + 1) > at  # the sources with a draw in cell lo
        k = p - at.sum(axis=1)  # this position's place among them
        s = np.argmax(np.cumsum(here, axis=1) > k[:, None], axis=1)
        return s.astype(np.int64), at[np.arange(len(p)), s]
