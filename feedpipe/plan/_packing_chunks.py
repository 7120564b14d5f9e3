"""Concatenate-and-cut rows of a mixture's epoch, planned a window of documents at a time: the
same rows as :class:`~feedpipe.plan._packing.CutLayout` over the whole epoch, without any array
the size of the epoch.

**Tokens before a position, by formula.** The epoch's concatenation holds, before position
``p``, the tokens of each source's draws before ``p`` (the interleave's
:meth:`~feedpipe.plan._interleave.Interleave.before`, no position drawn). A source's draws are
numbered across epochs and continue cycle after cycle through its permutations, so its first
``K`` draws hold ``(K // n) * T + P(K // n, K % n)`` tokens (``n`` samples of ``T`` tokens in
all; ``P(c, m)`` the tokens of the first ``m`` samples of its ``c``-th permutation, summed from
whichever end of the cycle is nearer). An epoch's token count, and so its row count, follows
from each source's draws at the epoch's start and end alone.

**Rows a window at a time.** The rows of a group are the tokens ``[r * seq_len, ...)`` of the
concatenation: the document holding the group's first token is found by a search over positions
(:meth:`ChunkedCut.locate`: interpolation on the formula, then the lengths of a short run), and
the documents from there are read a block at a time until they cover the group's last token.
The carry-over of the packer across windows is that document's start in the concatenation
(a document cut by a row boundary continues in the next row, whichever window reads it).

**Memory.** A source's lengths are read as a view of the dataset's per-sample lengths, one
source at a time; what is kept is a few cycles' ids and prefix sums of small sources (the
windows read those ids again), the last window and the points of the search:
``O(sources + window)``, whatever the epoch's size.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np

from ._mixture import MixturePlan
from ._packing import CutLayout, Pieces, offsets_of

# positions whose lengths are read at once (a window grows by such blocks)
BLOCK = 1 << 16
# the fewest positions a window reads (a reader's next groups of rows lie in it)
AHEAD = 1 << 14
# below this many positions between two points of known tokens, the search reads the lengths
SPAN = 1 << 12
# a source of at most so many samples keeps its cycles' ids and prefix sums (a few at a time)
CYCLE_CUM = 1 << 16
# the most bytes of kept cycle ids and prefix sums (cleared past them)
KEPT_BYTES = 1 << 24
# the most points of known tokens kept (past them, only the epoch's ends)
MOST_POINTS = 1 << 14


class MixtureTokens:
    """The tokens of epoch ``epoch`` of a mixture's documents, by position, without the epoch.

    Args:
        plan: the mixture's plan.
        epoch: the epoch.
        lengths: every document's token count, in the mixture's numbering (the sources'
            samples one after the other, source ``s`` from ``bases[s]``).
        bases: each source's first sample number.

    Example:
        >>> plan = MixturePlan([(3,), (2, 2)], weights=[2, 1], epoch_size=9, seed=1)
        >>> lengths = np.arange(1, 8)
        >>> t = MixtureTokens(plan, 2, lengths, np.array([0, 3]))
        >>> src, ids = plan.draws(2, np.arange(9))
        >>> whole = offsets_of(lengths[np.array([0, 3])[src] + ids])
        >>> [t.before(p) for p in (0, 4, 9)] == whole[[0, 4, 9]].tolist(), t.total == int(whole[-1])
        (True, True)
    """

    def __init__(self, plan: MixturePlan, epoch: int, lengths: np.ndarray,
                 bases: np.ndarray) -> None:
        self.plan, self.epoch = plan, int(epoch)
        self.lengths = np.asarray(lengths)
        self.bases = np.asarray(bases, dtype=np.int64)
        self.size = plan.epoch_size
        self._n = [int(n) for n in plan.sizes.tolist()]
        self._c = [int(c) for c in plan.counts.tolist()]
        # each source's tokens, a view of its lengths at a time (never a copy of them all)
        self._whole = [int(self._lengths_of(s).sum(dtype=np.int64)) for s in range(len(self._n))]
        self._cums: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._kept = 0
        self._start = [self._drawn(s, self.epoch * c) for s, c in enumerate(self._c)]
        self.total = sum(self._drawn(s, (self.epoch + 1) * c) - a
                         for s, (c, a) in enumerate(zip(self._c, self._start)))

    def _lengths_of(self, s: int) -> np.ndarray:
        """Source ``s``'s lengths, by its sample id (a view)."""
        b = int(self.bases[s])
        return self.lengths[b:b + self._n[s]]

    def _drawn(self, s: int, k: int) -> int:
        """The tokens of source ``s``'s first ``k`` draws ever (across epochs)."""
        n, c = self._n[s], self._c[s]
        if not c or not k:
            return 0
        cycle, m = divmod(int(k), n)
        return cycle * self._whole[s] + self._prefix(s, cycle, m)

    def _prefix(self, s: int, cycle: int, m: int) -> int:
        """The tokens of the first ``m`` samples of source ``s``'s ``cycle``-th permutation."""
        n = self._n[s]
        if not m:
            return 0
        if n <= CYCLE_CUM:
            return int(self._cycle(s, cycle)[1][m])
        if 2 * m <= n:  # from the cycle's start
            return self._sum(s, cycle * n, cycle * n + m)
        return self._whole[s] - self._sum(s, cycle * n + m, cycle * n + n)

    def _cycle(self, s: int, cycle: int) -> tuple[np.ndarray, np.ndarray]:
        """The sample ids of source ``s``'s ``cycle``-th permutation and their tokens' prefix
        sums (a source of at most :data:`CYCLE_CUM` samples; kept: the windows read the ids
        again)."""
        got = self._cums.get((s, cycle))
        if got is None:
            if self._kept > KEPT_BYTES:
                self._cums.clear()
                self._kept = 0
            n = self._n[s]
            ids = self.plan.source_ids(s, cycle * n, cycle * n + n)
            got = self._cums[(s, cycle)] = (ids, offsets_of(self._lengths_of(s)[ids]))
            self._kept += ids.nbytes + got[1].nbytes
        return got

    def _sum(self, s: int, first: int, last: int) -> int:
        """The tokens of source ``s``'s draws ``[first, last)`` (within one cycle), a block of
        ids at a time."""
        own, out = self._lengths_of(s), 0
        for a in range(first, last, BLOCK):
            out += int(own[self.plan.source_ids(s, a, min(a + BLOCK, last))].sum(dtype=np.int64))
        return out

    def before(self, p: int) -> int:
        """The tokens of positions ``[0, p)`` of the epoch (``0 <= p <= size``)."""
        drawn = self.plan.interleave.before(int(p)).tolist()
        return sum(self._drawn(s, self.epoch * c + d) - a
                   for s, (c, d, a) in enumerate(zip(self._c, drawn, self._start)))

    def ids(self, lo: int, hi: int) -> np.ndarray:
        """The documents (in the mixture's numbering) at positions ``[lo, hi)``."""
        pos = np.arange(int(lo), int(hi), dtype=np.int64)
        if not len(pos):
            return pos
        src, draw = self.plan.interleave.at(pos)
        out = np.empty(len(pos), dtype=np.int64)
        present = np.flatnonzero(np.bincount(src, minlength=len(self._n)))  # no sort
        for s in present.tolist():  # a source's draws of a window: one run of them
            at = np.flatnonzero(src == s)
            k = self.epoch * self._c[s] + draw[at]
            out[at] = self.bases[s] + self._source_ids(s, k)
        return out

    def _source_ids(self, s: int, k: np.ndarray) -> np.ndarray:
        """The sample ids of source ``s``'s draws ``k`` (ascending, numbered across epochs):
        those of a small source's permutations kept for the token counts are read from them,
        not drawn again."""
        n = self._n[s]
        if n > CYCLE_CUM:
            first = int(k[0])
            return self.plan.source_ids(s, first, int(k[-1]) + 1)[k - first]
        cycle, at = np.divmod(k, n)
        out = np.empty(len(k), dtype=np.int64)
        for c in range(int(cycle[0]), int(cycle[-1]) + 1):
            sel = cycle == c
            out[sel] = self._cycle(s, c)[0][at[sel]]
        return out


class ChunkedCut:
    """The rows of :class:`~feedpipe.plan._packing.ConcatenateAndCut` over an epoch whose
    tokens are known by formula (:class:`MixtureTokens`): the same :attr:`num_rows`,
    :meth:`spans` and :meth:`pieces` as a :class:`~feedpipe.plan._packing.CutLayout` of the
    whole epoch, each group of rows planned over the window of documents it covers (a
    document is named by its position in the epoch, as there). :attr:`order` gives the
    documents at any positions.

    Example:
        >>> plan = MixturePlan([(3,), (2, 2)], weights=[2, 1], epoch_size=9, seed=1)
        >>> lengths = np.arange(1, 8)
        >>> t = MixtureTokens(plan, 0, lengths, np.array([0, 3]))
        >>> whole = CutLayout(offsets_of(lengths[t.ids(0, 9)]), 4)
        >>> lay = ChunkedCut(t, 4)
        >>> lay.num_rows == whole.num_rows, lay.row_pieces(3) == whole.row_pieces(3)
        (True, True)
    """

    contiguous = True

    def __init__(self, tokens: MixtureTokens, seq_len: int) -> None:
        self.source = tokens
        self.seq_len = int(seq_len)
        self.tokens = int(tokens.total)
        self.num_rows = -(-self.tokens // self.seq_len)
        self.order = WindowOrder(self)
        # points of known tokens: positions (ascending) and the tokens before each
        self._at = [0, tokens.size]
        self._before = [0, self.tokens]
        self._ahead = 16  # the fewest positions the next window reads
        # the last window: its first position, its documents and their prefix sums
        self.window: tuple[int, np.ndarray, np.ndarray] = (
            0, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.num_rows * self.seq_len)

    def _know(self, p: int, t: int) -> None:
        i = bisect_right(self._at, p)
        if self._at[i - 1] == p:
            return
        if len(self._at) > MOST_POINTS:  # a long run's search points: the ends kept
            self._at, self._before = [0, self.source.size], [0, self.tokens]
            i = 1
        self._at.insert(i, p)
        self._before.insert(i, t)

    def _tokens_at(self, p: int) -> int:
        i = bisect_right(self._at, p) - 1
        if self._at[i] == p:
            return self._before[i]
        t = self.source.before(p)
        self._know(p, t)
        return t

    def locate(self, t: int) -> int:
        """The position of the document holding token ``t`` of the concatenation
        (``0 <= t < tokens``): the last position with at most ``t`` tokens before it."""
        return self._find(t)[0]

    def _find(self, t: int) -> tuple[int, int]:
        """:meth:`locate` and the tokens before that position."""
        first, _, offs = self.window
        if offs[0] <= t < offs[-1]:
            i = int(np.searchsorted(offs, t, side="right")) - 1
            return first + i, int(offs[i])
        i = bisect_right(self._before, t)  # the known points around t
        lo, hi = self._at[i - 1], self._at[i]
        tlo, thi = self._before[i - 1], self._before[i]
        step, g = 0, lo
        while hi - lo > SPAN:
            if step % 3 == 0:  # where the tokens' rate between the points puts t
                g = lo + (t - tlo) * (hi - lo) // max(1, thi - tlo)
            elif step % 3 == 1:  # a short step past the last guess, toward t
                g = g + SPAN // 2 if g == lo else g - SPAN // 2
            else:  # halving: the search ends whatever the lengths
                g = (lo + hi) // 2
            g = min(max(g, lo + 1), hi - 1)
            tg = self._tokens_at(g)
            if tg <= t:
                lo, tlo = g, tg
            else:
                hi, thi = g, tg
            step += 1
        run = tlo + offsets_of(self._lengths(lo, hi)[1])
        i = int(np.searchsorted(run, t, side="right")) - 1
        return lo + i, int(run[i])

    def _lengths(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.source.ids(lo, hi)
        return ids, np.asarray(self.source.lengths[ids], dtype=np.int64)

    def _read(self, tlo: int, thi: int) -> tuple[int, np.ndarray]:
        """The window of documents holding tokens ``[tlo, thi)``: its first position and its
        documents' prefix sums (kept as :attr:`window`, with their ids)."""
        first, _, have = self.window
        if not (have[0] <= tlo and thi <= have[-1] and len(have) > 1):
            a, end = self._find(tlo)
            ids: list[np.ndarray] = []
            offs = [np.array([end], dtype=np.int64)]
            b = a
            while end < thi and b < self.source.size:
                mean = max(1.0, (self.tokens - end) / max(1, self.source.size - b))
                # more than the group needs, up to AHEAD positions as the reader goes on:
                # its next groups are read from the window (the first read only what it needs)
                want = max(self._ahead, int((thi - end) / mean * 1.1) + 16)
                c = min(self.source.size, b + min(BLOCK, want))
                i, k = self._lengths(b, c)
                ids.append(i)
                offs.append(end + np.cumsum(k))
                end, b = int(offs[-1][-1]), c
            self._know(b, end)
            self._ahead = min(AHEAD, 2 * self._ahead)
            self.window = (a, np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64),
                           np.concatenate(offs))
        return self.window[0], self.window[2]

    def _local(self, rows: np.ndarray) -> tuple[int, CutLayout]:
        """The window covering the real ones of ``rows`` as a layout of its own documents."""
        L = self.seq_len
        real = rows[rows * L < self.tokens]
        if not len(real):
            return 0, CutLayout(np.zeros(1, dtype=np.int64), L, tokens=self.tokens)
        first, offs = self._read(int(real[0]) * L, min(int(real[-1]) * L + L, self.tokens))
        return first, CutLayout(offs, L, tokens=self.tokens)

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`CutLayout.spans <feedpipe.plan._packing.CutLayout.spans>`."""
        rows = np.asarray(rows, dtype=np.int64)
        first, local = self._local(rows)
        doc, into, k = local.spans(rows)
        return doc + first, into, k

    def pieces(self, rows: np.ndarray) -> Pieces:
        """As :meth:`CutLayout.pieces <feedpipe.plan._packing.CutLayout.pieces>`."""
        rows = np.asarray(rows, dtype=np.int64)
        first, local = self._local(rows)
        p = local.pieces(rows)
        return Pieces(p.row, p.doc + first, p.start, p.length)

    def row_pieces(self, row: int) -> list[tuple[int, int, int]]:
        """The pieces ``(document, start, length)`` of row ``row``."""
        p = self.pieces(np.array([row], dtype=np.int64))
        return list(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))


class WindowOrder:
    """The documents at any positions of a :class:`ChunkedCut`'s epoch (``order[positions]``):
    from its last window where they lie in it, else by the plan."""

    def __init__(self, layout: ChunkedCut) -> None:
        self.layout = layout

    def __len__(self) -> int:
        return int(self.layout.source.size)

    def __getitem__(self, positions: Any) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        first, ids, _ = self.layout.window
        if pos.size and first <= int(pos.min()) and int(pos.max()) < first + len(ids):
            return ids[pos - first]
        src, got = self.layout.source.plan.draws(self.layout.source.epoch, pos.ravel())
        return np.asarray(self.layout.source.bases[src] + got, dtype=np.int64).reshape(pos.shape)
