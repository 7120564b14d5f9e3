"""The plan of packed rows (:class:`~feedpipe.Packed`): which pieces of which documents make each
row of an epoch, and which rows each rank reads. Pure functions of (the documents' lengths in the
epoch's order, ``seq_len``, the world) only, so the reader, its worker processes and the ledger's
checker (``feedpipe ledger``) compute the same rows.

**Packing.** A *packing strategy* turns the documents of an epoch, in plan order, into rows of
``seq_len`` tokens: its :meth:`~Packing.layout` gives a :class:`Layout`, which says how many rows
the epoch has and which pieces ``(document, start, length)`` fill a group of them. A document is
named by its place in the epoch's order. :class:`ConcatenateAndCut` (the default, ``"concatenate"``)
concatenates the documents and cuts the concatenation every ``seq_len`` tokens: every row is
full but the epoch's last, and a document longer than the room left continues in the next row.
:class:`BestFit` (``"best-fit"``) keeps each document no longer than a row whole, in the fullest
row it fits, leaving padding in rows (:attr:`Layout.fill`). A strategy of one's own is any object
with a ``name`` and a ``layout(lengths, seq_len)`` giving a :class:`Layout`.

**Ranks.** An epoch's rows are dealt round-robin to the ranks from a start row (0, or the row a
state saved mid-epoch resumes at) by :func:`rows_split`: the rows are made a multiple of the
world size with rows of padding only, so every rank reads as many rows and no token twice.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ._order import Split


@dataclass(frozen=True)
class Pieces:
    """The pieces of a group of rows, in row order and within a row in order: ``row`` (the
    index of the piece's row in the group asked for), ``doc`` (the document's place in the
    epoch's order), ``start`` (where the piece starts in its document) and ``length``."""

    row: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.doc)


class Layout(Protocol):
    """An epoch's rows as one packing strategy laid them out."""

    @property
    def num_rows(self) -> int:
        """Rows of the epoch (all ranks'), padding rows of a world size not counted."""
        ...

    @property
    def contiguous(self) -> bool:
        """Whether row ``r`` holds tokens ``[r * seq_len, (r + 1) * seq_len)`` of the documents'
        concatenation (only the last row short): a reader then copies runs of rows at once."""
        ...

    @property
    def fill(self) -> float:
        """The share of the rows' tokens that are documents' (the rest is padding)."""
        ...

    def pieces(self, rows: np.ndarray) -> Pieces:
        """The pieces of global rows ``rows`` (ascending); a row past :attr:`num_rows` has
        none (padding)."""
        ...


class Packing(Protocol):
    """A packing strategy: a named, pure function from an epoch's document lengths (in plan
    order) and ``seq_len`` to its :class:`Layout`."""

    name: str

    def layout(self, lengths: np.ndarray, seq_len: int) -> Layout:
        """The rows of an epoch whose documents, in order, have ``lengths`` tokens."""
        ...


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """The token prefix sums of documents of ``lengths`` (``[0, l0, l0 + l1, ...]``)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    return offsets


class CutLayout:
    """The rows of :class:`ConcatenateAndCut`: row ``r`` is tokens ``[r * seq_len,
    (r + 1) * seq_len)`` of the concatenation whose document prefix sums are ``offsets``."""

    contiguous = True

    def __init__(self, offsets: np.ndarray, seq_len: int, tokens: int | None = None) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.seq_len = int(seq_len)
        # the concatenation's tokens: the last offset, or more where ``offsets`` are a window
        # of a longer epoch's (feedpipe.plan._packing_chunks), which rows past it come from
        self.tokens = int(self.offsets[-1]) if tokens is None else int(tokens)
        self.num_rows = -(-self.tokens // self.seq_len)

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.num_rows * self.seq_len)

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pieces of global rows ``rows`` (ascending) as :meth:`pieces` gives them, but a
        document's pieces in consecutive rows joined: ``(doc, start, length)``, in order (what
        a reader copies: a run of consecutive rows is one range of the concatenation)."""
        rows = np.asarray(rows, dtype=np.int64)
        offsets, L, total = self.offsets, self.seq_len, self.tokens
        real = rows[rows * L < total]  # rows past the tokens are padding only
        # runs of consecutive rows: each a contiguous range of the concatenation
        new = np.ones(len(real), dtype=bool)
        new[1:] = real[1:] != real[:-1] + 1
        first = np.flatnonzero(new)
        tlo = real[first] * L
        thi = np.minimum(np.append(real[first[1:] - 1], real[-1:]) * L + L, total)
        d0 = np.searchsorted(offsets, tlo, side="right") - 1
        cnt = np.searchsorted(offsets, thi, side="left") - d0
        run = np.repeat(np.arange(len(first)), cnt)
        doc = np.arange(len(run)) + np.repeat(d0 - (np.cumsum(cnt) - cnt), cnt)
        a = np.maximum(offsets[doc], tlo[run])
        k = np.minimum(offsets[doc + 1], thi[run]) - a
        keep = k > 0  # documents without tokens are no piece
        doc = doc[keep]
        return doc, a[keep] - offsets[doc], k[keep]

    def pieces(self, rows: np.ndarray) -> Pieces:
        rows = np.asarray(rows, dtype=np.int64)
        offsets, L = self.offsets, self.seq_len
        doc, into, k = self.spans(rows)
        a = offsets[doc] + into  # where each span starts in the concatenation
        # a span crossing a row boundary is cut there: each piece lies in one row
        r0 = a // L
        parts = (a + k - 1) // L - r0 + 1
        which = np.repeat(np.arange(len(doc)), parts)
        row = np.repeat(r0, parts) + (np.arange(len(which)) - np.repeat(np.cumsum(parts) - parts,
                                                                        parts))
        lo = np.maximum(a[which], row * L)
        hi = np.minimum(a[which] + k[which], row * L + L)
        doc = doc[which]
        index = np.flatnonzero(rows * L < self.tokens)
        group_row = index[np.searchsorted(rows[index], row)]
        return Pieces(group_row, doc, lo - offsets[doc], hi - lo)

    def row_pieces(self, row: int) -> list[tuple[int, int, int]]:
        """The pieces ``(document, start, length)`` of row ``row``."""
        p = self.pieces(np.array([row], dtype=np.int64))
        return list(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))


class ConcatenateAndCut:
    """The documents concatenated in plan order and cut every ``seq_len`` tokens (the default
    packing of :class:`~feedpipe.Packed`): no padding but in the epoch's last row; a document
    longer than the room left in a row continues in the next.

    Example:
        >>> lay = ConcatenateAndCut().layout(np.array([3, 7]), 4)
        >>> lay.num_rows, lay.row_pieces(0), lay.row_pieces(2)
        (3, [(0, 0, 3), (1, 0, 1)], [(1, 5, 2)])
    """

    name = "concatenate"

    def layout(self, lengths: np.ndarray, seq_len: int) -> Layout:
        """The rows of an epoch whose documents, in order, have ``lengths`` tokens."""
        return CutLayout(offsets_of(lengths), seq_len)

    def __repr__(self) -> str:
        return "ConcatenateAndCut()"


CONCATENATE = ConcatenateAndCut()


def row_pieces(offsets: np.ndarray, row: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The pieces of row ``row`` of concatenate-and-cut: ``(document index, start in document,
    length)``. ``offsets`` are the documents' token prefix sums (``offsets[0] == 0``,
    ``offsets[-1]`` the epoch's tokens).

    Example:
        >>> row_pieces(np.array([0, 3, 10]), 1, 4)
        [(1, 1, 4)]
        >>> row_pieces(np.array([0, 3, 10]), 0, 4)
        [(0, 0, 3), (1, 0, 1)]
    """
    return CutLayout(offsets, seq_len).row_pieces(row)


def rows_split(num_rows: int, start: int, world_size: int, rank: int,
               whole_batches: bool = False) -> Split:
    """Rank ``rank``'s share of an epoch's ``num_rows`` rows from row ``start`` on: the rows
    are made a multiple of ``world_size`` from ``start`` with rows of padding only (rows past
    the epoch's tokens), so every rank gets as many rows and no token is dealt twice.

    Example:
        >>> s = rows_split(7, 0, 2, 1)
        >>> s.num_samples, s.positions(0, s.length).tolist()
        (8, [1, 3, 5, 7])
    """
    end = start + -(-max(num_rows - start, 0) // world_size) * world_size
    return Split(end, world_size, rank, int(start), False, bool(whole_batches))


class PieceLayout:
    """Rows given piece by piece (``row``, ``doc``, ``start``, ``length`` of each piece, rows
    numbered from 0): what a strategy that leaves room in rows lays out."""

    contiguous = False

    def __init__(self, row: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray,
                 num_rows: int, seq_len: int) -> None:
        by = np.argsort(np.asarray(row, dtype=np.int64), kind="stable")  # in order within a row
        self.row, self.doc = np.asarray(row, dtype=np.int64)[by], np.asarray(doc)[by]
        self.start, self.length = np.asarray(start)[by], np.asarray(length)[by]
        self.num_rows, self.seq_len = int(num_rows), int(seq_len)
        self.tokens = int(self.length.sum())
        self.ptr = np.searchsorted(self.row, np.arange(self.num_rows + 1, dtype=np.int64))

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.num_rows * self.seq_len)

    def pieces(self, rows: np.ndarray) -> Pieces:
        rows = np.asarray(rows, dtype=np.int64)
        index = np.flatnonzero(rows < self.num_rows)  # rows past the epoch's are padding only
        lo, hi = self.ptr[rows[index]], self.ptr[rows[index] + 1]
        cnt = hi - lo
        sel = np.repeat(lo - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
        return Pieces(np.repeat(index, cnt), self.doc[sel], self.start[sel], self.length[sel])


class BestFit:
    """Each document whole in the fullest row it fits (best fit, rows kept open all epoch, as
    Grain's and Megatron-Energon's packers offer): a document no longer than ``seq_len`` is
    never split, so fewer documents start mid-context, at the cost of padding left in rows
    (:attr:`Layout.fill <feedpipe.Layout.fill>` says how much). A document longer than a row
    fills rows of its own, ``seq_len`` tokens each, and its rest is placed like a document.
    Rows are numbered in the order they are opened, and a row's pieces are in plan order. The
    layout is made in one pass over the epoch's documents, a Python loop (each process reading
    the epoch makes it once).

    Example:
        >>> lay = BestFit().layout(np.array([5, 4, 3, 1]), 6)
        >>> lay.num_rows, [lay.pieces(np.array([r])).doc.tolist() for r in range(2)]
        (3, [[0, 3], [1]])
    """

    name = "best-fit"

    def layout(self, lengths: np.ndarray, seq_len: int) -> Layout:
        """The rows of an epoch whose documents, in order, have ``lengths`` tokens."""
        L = int(seq_len)
        rows: list[int] = []
        docs: list[int] = []
        starts: list[int] = []
        sizes: list[int] = []
        open_rows: dict[int, deque[int]] = {}  # room left: the rows with that room, oldest first
        rooms: list[int] = []  # the rooms of open rows, ascending, each once
        count = 0
        for d, n in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
            at = 0
            while n - at > L:  # a document longer than a row: whole rows of its own
                rows.append(count)
                docs.append(d)
                starts.append(at)
                sizes.append(L)
                count += 1
                at += L
            k = n - at
            if k <= 0:
                continue
            i = bisect_left(rooms, k)
            if i < len(rooms):  # the fullest open row it fits in
                room = rooms[i]
                bucket = open_rows[room]
                r = bucket.popleft()
                if not bucket:
                    del open_rows[room]
                    del rooms[i]
            else:
                r, room = count, L
                count += 1
            rows.append(r)
            docs.append(d)
            starts.append(at)
            sizes.append(k)
            room -= k
            if room:
                if room not in open_rows:
                    open_rows[room] = deque()
                    insort(rooms, room)
                open_rows[room].append(r)
        return PieceLayout(np.array(rows, dtype=np.int64), np.array(docs, dtype=np.int64),
                           np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64),
                           count, L)

    def __repr__(self) -> str:
        return "BestFit()"


PACKINGS: dict[str, Packing] = {CONCATENATE.name: CONCATENATE, BestFit.name: BestFit()}


def packing_named(name: str) -> Packing:
    """The packing strategy of feedpipe named ``name`` (what a ledger records); a strategy of
    one's own is not known by name here (``KeyError``)."""
    return PACKINGS[name]
