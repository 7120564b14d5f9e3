"""Worker processes writing batches in place into shared memory they reuse (the
``rows-workers`` route): each worker's :class:`WorkerRing` of batch buffers, the :class:`Ticket`
that travels with a batch, and :class:`RowRelease`, the training process's side that hands a
buffer back once nothing there holds its batch."""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from ._collate import LeftOut
from ._collator import BatchCollator, shared_empty, storage_refs


def writes_into(transform: Any, collator: Any) -> bool:
    """Whether ``transform`` can write its outputs straight into ``collator``'s batch rows: it
    has ``into(sample, out) -> label | None`` and its ``out_shape``/``out_dtype`` are the
    collator's, so a row needs no per-sample tensor and no copy."""
    return (isinstance(collator, BatchCollator) and callable(getattr(transform, "into", None))
            and tuple(getattr(transform, "out_shape", ())) == collator.shape
            and getattr(transform, "out_dtype", None) == collator.dtype)


class WorkerRing:
    """A worker's shared-memory batch buffers, each reused once the training process has let go
    of the batch last sent in it.

    A fresh shared-memory batch costs its worker the kernel's zero-fill and a page fault per
    page, and the training process the freeing of those pages once the batch is dropped; a reused
    one costs neither (``benchmarks/bench_peers.py``, decode phase).

    **Why reuse is safe.** The worker cannot see the training process's references, so that
    process says when a batch is gone. Each buffer has two 64-bit words in a small shared table,
    each with a single writer: ``issued`` (the worker writes a new token each time it fills the
    buffer) and ``released`` (the training process writes the token back once nothing there
    holds the batch, :class:`RowRelease`). The worker refills a buffer only while the two are
    equal. A release that comes late, for a batch of a buffer since replaced, names an old token
    and frees nothing; a batch that never reaches the loop (an epoch stopped early) leaves its
    buffer busy, and the worker allocates another in its place. Each worker process makes its
    own table, sent with its first batch of every epoch, so a release never reaches a later
    worker that took the same worker id. ``depth`` bounds the buffers a worker keeps (the
    DataLoader's ``prefetch_factor`` in flight, one the loop holds, one not yet seen released);
    with all busy, a batch gets a fresh buffer, as without a ring: speed, never correctness.
    """

    def __init__(self, collator: BatchCollator, depth: int) -> None:
        self.collator, self.depth = collator, max(1, int(depth))
        self.key = int.from_bytes(os.urandom(8), "little") >> 1
        self.table = shared_empty((2, self.depth), torch.int64).zero_()
        self._issued, self._released = self.table[0].numpy(), self.table[1].numpy()
        self._slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.depth
        self._next = 0
        self._tokens = itertools.count(1)
        self._last: tuple[int, int, bool] | None = None
        self.send_table = True

    def buffer(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)`` views of the first ``n`` rows of a buffer the training process
        has released (else a new one), as :meth:`BatchCollator.buffer` gives them."""
        c = self.collator
        if not 0 < n <= c.batch_size:
            raise ValueError(f"a buffer of {n} rows from a BatchCollator of batch_size "
                             f"{c.batch_size}")
        slots, depth = self._slots, self.depth
        issued, released = self._issued, self._released
        pick, empty = None, None
        for k in range(depth):
            i = (self._next + k) % depth
            if slots[i] is None:
                if empty is None:
                    empty = i
            elif issued[i] == released[i]:
                pick = i
                break
        reused = pick is not None
        if pick is None:  # an empty slot, else the next one's buffer is left to its holder
            pick = empty if empty is not None else self._next
            slots[pick] = (shared_empty((c.batch_size, *c.shape), c.dtype),
                           shared_empty((c.batch_size,), c.label_dtype))
        self._next = (pick + 1) % depth
        token = next(self._tokens)
        issued[pick] = token  # busy from here until the training process writes it back
        self._last = (pick, token, reused)
        images, labels = slots[pick]  # type: ignore[misc]
        return images[:n], labels[:n]

    def ticket(self) -> Ticket:
        """The ticket of the last buffer handed out, to travel with its batch."""
        assert self._last is not None
        slot, token, reused = self._last
        table, self.send_table = (self.table if self.send_table else None), False
        return Ticket(self.key, slot, token, reused, table)


class ByteRing:
    """A worker's shared-memory byte buffers for the ``packed-workers`` route: the tokens of
    each :class:`~feedpipe.stream._packed.Shipment` (a group of batches) are written into one,
    reused once the training process has made every batch of the shipment last sent in it (the
    batches are memory of their own there), by the protocol of :class:`WorkerRing` (its
    table, tokens and :class:`Ticket`; the training process's side is a :class:`RowRelease`).
    A fresh buffer costs its worker the kernel's zero-fill and a page fault per page, which is
    more than copying the tokens written into it. Shipments differ in size: a buffer too small
    for one is replaced by a larger one, and with every buffer busy a shipment gets a fresh one
    (speed, never correctness)."""

    def __init__(self, depth: int) -> None:
        self.depth = max(1, int(depth))
        self.key = int.from_bytes(os.urandom(8), "little") >> 1
        self.table = shared_empty((2, self.depth), torch.int64).zero_()
        self._issued, self._released = self.table[0].numpy(), self.table[1].numpy()
        self._slots: list[torch.Tensor | None] = [None] * self.depth
        self._next = 0
        self._tokens = itertools.count(1)
        self._last: tuple[int, int, bool] | None = None
        self.send_table = True

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of a buffer the training process has released (else of a
        new one)."""
        slots, depth = self._slots, self.depth
        issued, released = self._issued, self._released
        free = [i for i in ((self._next + k) % depth for k in range(depth))
                if slots[i] is None or issued[i] == released[i]]
        sizes = [0 if t is None else len(t) for t in slots]
        fits = [i for i in free if sizes[i] >= nbytes]
        reused = bool(fits)
        # of the buffers free, the one written last: its pages are the likeliest still in the
        # CPU's cache (going round all of them writes each after the cache has dropped it)
        pick = (max(fits, key=lambda i: issued[i]) if fits else free[0] if free
                else self._next)
        if not reused:  # an empty or too small slot, else the next one's left to its holder
            # sized for the largest shipment yet and then some: shipments of as many rows
            # differ in their tokens (the padding left out), and a new largest one would
            # replace a buffer again
            most = max(nbytes + nbytes // 16, *sizes)
            slots[pick] = shared_empty((most,), torch.uint8)
        self._next = (pick + 1) % depth
        token = next(self._tokens)
        issued[pick] = token  # busy from here until the training process writes it back
        self._last = (pick, token, reused)
        return slots[pick][:nbytes]  # type: ignore[index]

    def known(self) -> bool:
        """Whether the training process has the last buffer handed out mapped already: it was
        reused, so that process had it, and keeps it, since it let go of its last shipment
        (:meth:`RowRelease.mapped`). The shipment then travels without it: a shared-memory
        tensor sent through a queue hands its file descriptor over by a connection to this
        process's resource-sharer thread (a handshake and a wait for this process's GIL), which
        costs more than the writing of the batches in it."""
        return self._last is not None and self._last[2]

    def table_seen(self) -> bool:
        """Whether the training process has this ring's table: it has written to it (a buffer
        handed back), and it keeps it while these workers live."""
        return bool(self._released.any())

    def ticket(self) -> Ticket:
        """The ticket of the last buffer handed out, to travel with its shipment."""
        assert self._last is not None
        slot, token, reused = self._last
        table, self.send_table = (self.table if self.send_table else None), False
        return Ticket(self.key, slot, token, reused, table)


class Ticket:
    """Which worker buffer a batch is in (``key``: the worker process's ring, ``slot``,
    ``token``), whether it was a reused one, and the ring's table when this process may not have
    it yet. Not a tuple, so that the DataLoader's ``pin_memory`` leaves it (and the table in
    shared memory) as it is."""

    __slots__ = ("key", "slot", "token", "reused", "table")

    def __init__(self, key: int, slot: int, token: int, reused: bool,
                 table: torch.Tensor | None) -> None:
        self.key, self.slot, self.token, self.reused, self.table = key, slot, token, reused, table

    def __reduce__(self) -> Any:
        return Ticket, (self.key, self.slot, self.token, self.reused, self.table)


# A tensor that nothing else shares reads this storage use count (the query itself holds one).
_LONE = storage_refs(torch.empty(1))


def sees_holders() -> bool:
    """Whether this torch says how many tensors share a storage (:class:`RowRelease` hands
    buffers back by it)."""
    return _LONE is not None


class RowRelease:
    """The training process's side of the ``rows-workers`` route: hands each worker buffer
    back (its ring's ``released`` word) once nothing in this process still shares the batch's
    storage: not the loop, not a view or storage object of it, not a prefetcher. Checked as a
    batch arrives (:meth:`receive`) and when the loop asks for the next one (:meth:`poll`), with
    torch's storage use count, against a hold taken here (so the count of a batch nobody else
    holds is known exactly). Polling when the loop asks matters: the DataLoader gives a worker
    its next task on receiving a batch, and a buffer handed back only then often came too late
    for that task. A batch that the DataLoader's ``pin_memory`` copied out of shared memory is
    handed back at once. Where torch does not give the use count, the workers allocate every
    batch afresh instead.

    ``stats()``: ``batches`` received, ``reused`` (made in a buffer a worker had back),
    ``released`` (handed back by this process)."""

    def __init__(self, persistent: bool, keep_mapped: bool = False) -> None:
        self.persistent = persistent  # the workers outlive the epoch: hand buffers back to them
        self._tables: dict[int, Any] = {}  # each worker sends its table with its first batch
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor | None, int, int, int]] = []
        # keep_mapped: a buffer handed back stays mapped here, by (worker key, slot), until the
        # worker sends it again: torch then finds it in its cache of shared storages, and the
        # batch reads pages mapped already, instead of a new map whose every page faults on
        # the first read (and whose unmap interrupts the other cores)
        self.keep_mapped = keep_mapped
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}
        self._counts = {"batches": 0, "reused": 0, "released": 0}

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def receive(self, batch: Any, ticket: Ticket | None) -> None:
        """Hold ``batch`` (just received with ``ticket``) until nothing here shares it."""
        self.poll()
        if ticket is None:
            return
        self._counts["batches"] += 1
        self._counts["reused"] += bool(ticket.reused)
        if ticket.table is not None:
            self._tables[ticket.key] = ticket.table[1].numpy()
        if self.keep_mapped:  # the batch maps it now (the same storage, when it was kept)
            self._mapped.pop((ticket.key, ticket.slot), None)
        released = self._tables.get(ticket.key)
        if released is not None:
            self._hold(batch, released, ticket.key, ticket.slot, ticket.token)

    def mapped(self, ticket: Ticket | None, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer ``ticket`` names, which its worker reused and so
        sent without it: this process let go of its last shipment and kept it mapped."""
        full = None if ticket is None else self._mapped.pop((ticket.key, ticket.slot), None)
        if full is None:
            where = "no ticket" if ticket is None else f"ring {ticket.key}, slot {ticket.slot}"
            raise RuntimeError(f"a worker sent a shipment in a buffer this process has not kept "
                               f"({where}): a feedpipe bug, please report it")
        return full[:nbytes]

    def close(self) -> None:
        """The epoch is over (or the loop stopped early): let go of what nothing holds."""
        self.poll()
        if not self.persistent:
            # these workers are gone with the epoch: nothing to hand back to, and the holds
            # would keep the batches' shared memory mapped here (dropping one never frees a
            # buffer for reuse, so it is always safe)
            self._pending.clear()
            self._tables.clear()
            self._mapped.clear()

    def _hold(self, batch: Any, released: Any, key: int, slot: int, token: int) -> None:
        if type(batch) is LeftOut:  # the transform left out every row: nothing holds it
            released[slot] = token
            self._counts["released"] += 1
            return
        images, labels = batch if isinstance(batch, tuple) else (batch, None)
        if not images.is_shared():  # pinned (copied) on the way: the buffer is not held here
            released[slot] = token
            self._counts["released"] += 1
            return
        self._pending.append((released, images.detach(),
                              None if labels is None else labels.detach(), slot, token, key))

    def poll(self) -> None:
        """Hand back every held buffer whose batch nothing here shares any more."""
        keep = []
        for entry in self._pending:
            released, images, labels, slot, token, key = entry
            if storage_refs(images) == _LONE and (labels is None
                                                   or storage_refs(labels) == _LONE):
                released[slot] = token
                self._counts["released"] += 1
                if self.keep_mapped:  # the whole buffer: a later shipment may be larger
                    self._mapped[key, slot] = torch.empty(0, dtype=images.dtype).set_(
                        images.untyped_storage())
            else:
                keep.append(entry)
        self._pending = keep


