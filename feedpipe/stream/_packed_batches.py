"""The batches of a :class:`~feedpipe.Packed` reader: made in groups (:class:`PackedFetch`),
a group of them made at once (:class:`Group`), and a worker's group sent with its tokens in one
shared-memory buffer (:class:`Shipment`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._collator import shared_empty

try:  # optional C extension (setup.py): a batch's fields written in one pass
    from .._native import _packrows
except ImportError:  # pragma: no cover - where it did not build, numpy writes them
    _packrows = None
# the token dtypes _packrows.fill reads
_FILLS = frozenset(np.dtype(t) for t in ("int16", "uint16", "int32", "uint32", "int64"))

if TYPE_CHECKING:
    from ._batch_loop import PartTimes
    from ._packed import Packed
    from ._worker_rows import ByteRing

IGNORE = -100  # the label of a padding token: ignored by torch's cross entropy

# a worker's shipment (one message to the training process) holds this many of the reader's
# groups' tokens and batches: each message costs both processes a queue round trip (a feeder
# thread woken, a pickle, a pipe write and read, the DataLoader's bookkeeping), which is more
# than writing a group's batches; larger shipments pay it less often, for a ring buffer of
# this many groups' batches per shipment a worker holds
SHIP_GROUPS = 2


class PackedFetch:
    """fetch=packed: a reader's batches of rows made in groups of up to
    :meth:`~feedpipe.stream._packed.Packed.group_sizes` tokens and batches
    (``Packed.make_group``), so that numpy's per-call costs are paid once a group, and each batch
    of a group written when it is asked for."""

    def __init__(self, packed: Packed, epoch: int) -> None:
        self.packed, self.epoch = packed, epoch
        tokens, self.most = packed.group_sizes()
        self.group = max(1, tokens // packed.seq_len)  # rows made at once

    def __call__(self, rows: np.ndarray) -> dict[str, Any]:
        """The batch of rows ``rows`` on its own."""
        return self.packed.rows(self.epoch, rows)

    def groups(self, batches: Iterator[np.ndarray], times: PartTimes | None = None,
               scale: int = 1, alloc: Any = None) -> Iterator[tuple[Group, int]]:
        """Each group of ``batches`` (a reader's batches of rows, in order) and how many
        batches it holds; ``times``: the groups' seconds are added to ``fetch``; ``scale``:
        groups after the second of so many times the usual tokens and batches (the first
        two as without it); ``alloc``: ``Packed.make_group``'s."""
        packed, epoch, most = self.packed, self.epoch, self.group
        clock = time.perf_counter
        pending: list[np.ndarray] = []
        rows = 0
        size = 1  # the first batch is made on its own: the reader waits for no group
        made = 0
        end = object()
        it = iter(batches)
        while True:
            ids = next(it, end)
            if ids is not end:
                pending.append(ids)  # type: ignore[arg-type]
                rows += len(ids)  # type: ignore[arg-type]
                if rows < most and len(pending) < size:
                    continue
            if not pending:
                return
            t0 = clock()
            group = (packed.make_group(epoch, pending) if alloc is None
                     else packed.make_group(epoch, pending, alloc))
            if times is not None:
                times.fetch += clock() - t0
            yield group, len(pending)
            # the group's tokens go before the next group's are copied: one at a time alive
            pending, rows, group = [], 0, None  # type: ignore[assignment]
            made += 1
            grow = scale if made > 1 else 1
            size, most = self.most * grow, self.group * grow

    def run(self, batches: Iterator[np.ndarray],
            times: PartTimes | None = None) -> Iterator[dict[str, Any]]:
        """The batch of each of ``batches`` (a reader's batches of rows, in order).
        ``times``: the groups' seconds are added to ``fetch``, the batches' to ``sink``."""
        clock = time.perf_counter
        for group, n in self.groups(batches, times):
            for b in range(n):
                t0 = clock()
                batch = group.make(b)
                if times is not None:
                    times.sink += clock() - t0
                yield batch
            del group  # gone before the next group's tokens are copied

    def ship(self, batches: Iterator[np.ndarray], worker: int, ring: ByteRing | None = None,
             times: PartTimes | None = None) -> Iterator[Shipment]:
        """:meth:`run`'s batches as worker ``worker`` sends them: each group
        (:meth:`groups`, :data:`SHIP_GROUPS` times as large) as a :class:`Shipment`, its
        tokens in a buffer of ``ring`` (its
        :meth:`~feedpipe.stream._worker_rows.ByteRing.ticket` then names it), else in a fresh
        one: copied there straight out of the shards' maps, or after they were read whole or
        put in rows with padding. ``times`` as for :meth:`run`."""
        clock = time.perf_counter
        given: list[torch.Tensor] = []  # the buffer make_group copied the tokens into, if any

        def alloc(n: int, dtype: np.dtype) -> np.ndarray:
            # (a group of padding rows only has no tokens: a buffer of none is not mapped)
            nbytes = n * np.dtype(dtype).itemsize
            room = max(nbytes, 8)
            buf = shared_empty((room,), torch.uint8) if ring is None else ring.buffer(room)
            given.append(buf[:nbytes])
            return buf.numpy()[:nbytes].view(dtype)

        for group, count in self.groups(batches, times, SHIP_GROUPS, alloc):
            t0 = clock()
            tokens = group.tokens
            if given:  # copied into shared memory already
                buf = given.pop()
            else:  # read whole (a transform), or put in rows with padding
                alloc(len(tokens), tokens.dtype)
                buf = given.pop()
                np.copyto(buf.numpy(), tokens.reshape(-1).view(np.uint8))
            if times is not None:
                times.sink += clock() - t0
            # a reused buffer is mapped in the training process already: only its ticket goes
            yield Shipment(worker, None if ring is not None and ring.known() else buf,
                           tokens.dtype.str, len(tokens), group.parts(), count)
            del group, tokens  # gone before the next group's tokens are copied


class Group:
    """The batches of one ``Packed.make_group`` call, each made when asked (:meth:`make`): the
    group's tokens (``tokens``; the padding starts at ``m``), and where each piece of the
    positions starts (``starts``, ascending: each row, each document and the padding start
    one)."""

    __slots__ = ("tokens", "lo", "size", "full", "at", "local", "counts", "cu", "L", "pad",
                 "count", "real", "made")

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, edges: np.ndarray, m: int,
                 L: int, pad: int, count: np.ndarray, real: np.ndarray | None = None) -> None:
        self.tokens, self.L, self.pad, self.count = tokens, L, pad, count
        self.real = real  # which tokens are documents' where rows hold padding inside
        self.made = (starts, edges, m)  # what it was made of (parts)
        lo, size = edges[:-1], np.diff(edges)
        self.lo, self.size = lo.tolist(), size.tolist()
        self.full = np.clip(m - lo, 0, size).tolist()  # each batch's tokens before the padding
        # batch b's pieces are starts[at[b]:at[b + 1]] (each batch's first row starts one)
        at = np.searchsorted(starts, edges)
        self.at = at.tolist()
        per = np.diff(at)
        self.local = starts - np.repeat(lo, per)  # where each piece starts in its batch
        self.counts = np.diff(np.append(starts, edges[-1:]))  # each piece's tokens
        # each batch's cu_seqlens: its pieces' starts, then its size (b's are cu[at[b] + b:
        # at[b + 1] + b + 1])
        self.cu = np.insert(self.local, at[1:], size).astype(np.int32)

    def parts(self) -> tuple[Any, ...]:
        """What :meth:`rebuilt` needs besides the tokens and ``count`` (what a
        :class:`Shipment` sends beside its buffer: a number per piece, a few per batch)."""
        starts, edges, m = self.made
        if len(starts) and int(starts[-1]) < 2 ** 31:  # half the bytes to send
            starts = starts.astype(np.int32)
        return starts, edges, m, self.L, self.pad, self.real

    @classmethod
    def rebuilt(cls, tokens: np.ndarray, parts: tuple[Any, ...], count: np.ndarray) -> Group:
        """The group of :meth:`parts` over ``tokens``, with ``count`` (``0, 1, 2, ...``, at
        least as many as its largest batch's tokens) for the positions."""
        starts, edges, m, L, pad, real = parts
        return cls(tokens, starts, edges, m, L, pad, count, real)

    def __len__(self) -> int:
        return len(self.size)

    def make(self, b: int) -> dict[str, Any]:
        """Batch ``b`` of the group, in memory of its own."""
        n = self.size[b]
        buf = np.empty((3, n), dtype=np.int64)  # ids, positions, labels
        self.write(b, buf)
        i, j, L = self.at[b], self.at[b + 1], self.L
        ids, pos, labels = buf
        return {"input_ids": torch.from_numpy(ids.reshape(-1, L)),
                "position_ids": torch.from_numpy(pos.reshape(-1, L)),
                "labels": torch.from_numpy(labels.reshape(-1, L)),
                "cu_seqlens": torch.from_numpy(self.cu[i + b:j + b + 1])}

    def cu_len(self, b: int) -> int:
        """The length of batch ``b``'s ``cu_seqlens``."""
        return self.at[b + 1] - self.at[b] + 1

    def write(self, b: int, buf: np.ndarray, cu: np.ndarray | None = None) -> None:
        """Batch ``b``'s ids, positions and labels into ``buf`` (int64 ``[3, tokens]``), and
        its ``cu_seqlens`` into ``cu`` where given."""
        lo, n, full = self.lo[b], self.size[b], self.full[b]
        i, j = self.at[b], self.at[b + 1]
        if (full == n and self.real is None and _packrows is not None
                and self.tokens.dtype in _FILLS):  # the common case: no padding, in C
            _packrows.fill(buf, self.tokens[lo:lo + n], self.counts[i:j])
            if cu is not None:
                cu[:] = self.cu[i + b:j + b + 1]
            return
        ids, pos, labels = buf
        ids[:full] = self.tokens[lo:lo + full]
        labels[:full] = ids[:full]
        if full < n:  # the epoch's last tokens: padding after them
            ids[full:] = self.pad
            labels[full:] = IGNORE
        if self.real is not None:  # padding inside rows (already pad ids in the tokens)
            labels[:n][~self.real[lo:lo + n]] = IGNORE
        # a token's position: its place in the batch less its piece's start (no loop over
        # the pieces)
        np.subtract(self.count[:n], np.repeat(self.local[i:j], self.counts[i:j]), out=pos)
        if cu is not None:
            cu[:] = self.cu[i + b:j + b + 1]


class Shipment:
    """A worker's group of batches (a :class:`Group`): what crosses from a worker process to
    the training process in one message (``packed-workers``). Only the group's tokens cross,
    in the documents' dtype, in one shared-memory buffer, with a few numbers per piece beside
    them; the training process writes each batch's ids, positions and labels out of them when
    the loop asks for it, in memory of the batch's own, as the in-process route does. The
    batch fields would be three int64 words a token, several times the tokens' bytes, written
    by the worker and read again by the training process after the CPU's cache had let them
    go; and a batch the loop holds views nothing that a worker writes again.

    ``worker``: the worker that made it (its batches are that worker's next ones, in order);
    ``buffer``: the tokens' bytes, ``None`` where the worker wrote into a ring buffer the
    training process keeps mapped (its ticket names it,
    :meth:`~feedpipe.stream._worker_rows.RowRelease.mapped`): then nothing but the numbers and
    the ticket cross."""

    __slots__ = ("worker", "buffer", "dtype", "ntokens", "parts", "count")

    def __init__(self, worker: int, buffer: torch.Tensor | None, dtype: str, ntokens: int,
                 parts: tuple[Any, ...], count: int) -> None:
        self.worker, self.buffer, self.dtype, self.ntokens = worker, buffer, dtype, ntokens
        self.parts, self.count = parts, count

    def __reduce__(self) -> Any:
        return Shipment, (self.worker, self.buffer, self.dtype, self.ntokens, self.parts,
                          self.count)

    def __len__(self) -> int:
        return self.count

    def nbytes(self) -> int:
        """The bytes of its tokens in the buffer."""
        return np.dtype(self.dtype).itemsize * self.ntokens

    def group(self, shared: torch.Tensor | None = None) -> Group:
        """Its batches, made when asked (:meth:`Group.make`), over its buffer's tokens (which
        the group holds until it goes). ``shared``: the buffer where the shipment came without
        it (kept mapped in this process)."""
        shared = self.buffer if shared is None else shared
        if shared is None:
            raise ValueError("a shipment sent without its buffer needs it passed as shared=")
        tokens = shared[:self.nbytes()].numpy().view(np.dtype(self.dtype))
        most = int(np.diff(self.parts[1]).max(initial=0))  # the tokens of its largest batch
        return Group.rebuilt(tokens, self.parts, counting(most))


_COUNT = np.zeros(0, dtype=np.int64)


def counting(n: int) -> np.ndarray:
    """``0, 1, 2, ...``: at least ``n`` of them (kept, and grown as needed)."""
    global _COUNT
    if len(_COUNT) < n:
        _COUNT = np.arange(n, dtype=np.int64)
    return _COUNT


def placed(tokens: np.ndarray, row: np.ndarray, k: np.ndarray, at: np.ndarray, n: int, L: int,
            pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A group's ``n`` rows of ``L`` with padding inside them: the pieces' ``tokens`` (pieces of
    ``k`` tokens, starting at ``at`` in ``tokens``, of the group's rows ``row``) put in their
    places, ``pad`` between; which tokens are real; and where the positions' pieces start (each
    row, each piece, each row's padding)."""
    fill = np.bincount(row, weights=k, minlength=n).astype(np.int64)
    within = at - (np.cumsum(fill) - fill)[row]  # where each piece starts in its row
    dest = row * L + within  # where each piece starts in the group
    idx = np.repeat(dest - at, k) + np.arange(len(tokens), dtype=np.int64)
    out = np.full(n * L, pad, dtype=tokens.dtype)
    out[idx] = tokens
    real = np.zeros(n * L, dtype=bool)
    real[idx] = True
    rows = np.arange(n, dtype=np.int64) * L
    gaps = (rows + fill)[fill < L]
    starts = np.unique(np.concatenate([rows, dest, gaps]).astype(np.int64))
    return out, real, starts
