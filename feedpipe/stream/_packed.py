"""``Packed``: token documents concatenated in plan order and cut into rows of ``seq_len``.

The packing of an epoch is a pure function of the plan's document order and the documents'
lengths: row ``r`` holds tokens ``[r * seq_len, (r + 1) * seq_len)`` of the epoch's
concatenation. Rows are therefore dealt to ranks and batches like samples, and a reader's place
in an epoch is a row position: a state saved mid-document resumes, on any number of ranks, to
exactly the tokens not yet delivered.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..errors import StateError
from ._dataset import FeedDataset
from ._token_docs import NotMapped, PackedFieldError, TokenDocs

log = logging.getLogger("feedpipe")

IGNORE = -100  # the label of a padding token: ignored by torch's cross entropy


def row_pieces(offsets: np.ndarray, row: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The pieces of row ``row``: ``(document index, start in document, length)``.

    ``offsets`` are the documents' token prefix sums (``offsets[0] == 0``, ``offsets[-1]`` the
    epoch's tokens).

    Example:
        >>> row_pieces(np.array([0, 3, 10]), 1, 4)
        [(1, 1, 4)]
        >>> row_pieces(np.array([0, 3, 10]), 0, 4)
        [(0, 0, 3), (1, 0, 1)]
    """
    lo = row * seq_len
    hi = min(lo + seq_len, int(offsets[-1]))
    out = []
    d = int(np.searchsorted(offsets, lo, side="right")) - 1
    while lo < hi:
        end = min(int(offsets[d + 1]), hi)
        if end > lo:
            out.append((d, lo - int(offsets[d]), end - lo))
        lo = end
        d += 1
    return out


def deal_rows(num_rows: int, start: int, world_size: int, rank: int,
              batch_size: int) -> list[np.ndarray]:
    """The batches of rows rank ``rank`` of ``world_size`` reads from global row ``start`` on:
    each step gives ``batch_size`` consecutive rows to each rank in rank order.

    Example:
        >>> [b.tolist() for b in deal_rows(7, 0, 2, 1, 2)]
        [[2, 3], [6]]
    """
    out = []
    step = world_size * batch_size
    for base in range(start, num_rows, step):
        lo = base + rank * batch_size
        hi = min(lo + batch_size, num_rows)
        if lo < hi:
            out.append(np.arange(lo, hi))
    return out


class Packed:
    """Token documents of ``dataset`` packed into rows of ``seq_len`` tokens: the dataset of a
    :class:`~feedpipe.FeedLoader` for language-model pre-training.

    Each document is the 1-D integer array in ``field`` of a sample (a ``.npy`` field written by
    ``ShardWriter``/``shard_from``, or what the dataset's transform puts there, such as the ids of
    a tokenised text). Documents are concatenated in the order of the dataset's plan and cut at
    ``seq_len``; a document longer than the room left continues in the next row. A batch is a
    dict of ``input_ids``, ``position_ids`` and ``labels`` (int64 ``[batch, seq_len]``) and
    ``cu_seqlens`` (int32, the boundaries of the pieces in the flattened batch, for
    variable-length attention kernels). ``position_ids`` count from 0 at each piece; ``labels``
    are ``input_ids`` with -100 on padding, which only the epoch's last row has.

    Args:
        dataset: a FeedDataset whose samples hold one document each; its rank and world size
            are the reader's.
        seq_len: tokens per row.
        field: the sample field holding the document.
        pad_id: the token id that fills the epoch's last row.

    Example:
        >>> import feedpipe, numpy as np
        >>> ds = feedpipe.FeedDataset("shards/example", transform=lambda s: {
        ...     "tokens.npy": np.arange(int(s["__key__"][-1]) + 1)})
        >>> loader = feedpipe.FeedLoader(feedpipe.Packed(ds, seq_len=8), batch_size=2)
        >>> batch = next(iter(loader))
        >>> batch["input_ids"].shape, batch["labels"].dtype
        (torch.Size([2, 8]), torch.int64)
    """

    def __init__(self, dataset: FeedDataset, seq_len: int, field: str = "tokens.npy",
                 pad_id: int = 0) -> None:
        if not isinstance(dataset, FeedDataset):
            raise TypeError(f"Packed needs a FeedDataset, not {type(dataset).__name__}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        self.dataset = dataset
        self.seq_len = int(seq_len)
        self.field = field
        self.pad_id = int(pad_id)
        self.documents_read = 0
        self._docs: TokenDocs | None | bool = False  # False: not looked at yet; None: read whole
        self._lengths: np.ndarray | None = None  # per global sample id; -1: not known yet
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, order, offsets)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_epoch"] = None  # a worker computes its epoch's order itself
        return state

    # -- documents ---------------------------------------------------------------------------
    def _located(self) -> TokenDocs | None:
        """Where each document lies in the shards, when the documents are the raw ``.npy``
        fields of local shards (no transform, no ``decode=`` of the field); ``None`` where each
        document must be read whole (through the transform, or from a remote shard)."""
        if self._docs is False:
            ds = self.dataset
            docs = None
            if ds.transform is None and self.field not in ds.decode and ds.decoded is None:
                try:
                    docs = TokenDocs(ds.shards, self.field, ds.url)
                except NotMapped:
                    docs = None
            self._docs = docs
        return self._docs  # type: ignore[return-value]

    def document(self, g: int, epoch: int) -> np.ndarray:
        """The tokens of sample ``g`` as read in ``epoch`` (through the dataset's transform)."""
        ds = self.dataset
        x: Any = ds.sample(int(g), epoch)
        if ds.transform is not None:
            x = ds.transform(x)
        if not isinstance(x, dict) or self.field not in x:
            have = sorted(x) if isinstance(x, dict) else type(x).__name__
            raise PackedFieldError(
                f"sample {g} of {ds.url} has no field {self.field!r} (it has {have}): pass "
                f"Packed(..., field=) the field holding the token ids, or a transform that "
                f"puts them there")
        v = x[self.field]
        if isinstance(v, (bytes, bytearray, memoryview)):
            v = np.load(io.BytesIO(bytes(v)), allow_pickle=False)
        a = np.asarray(v.numpy() if isinstance(v, torch.Tensor) else v)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise PackedFieldError(
                f"sample {g} of {ds.url}: field {self.field!r} is a {a.dtype} array of shape "
                f"{a.shape}; Packed needs a 1-D integer array of token ids per document")
        self.documents_read += 1
        if self._lengths is not None:
            self._lengths[int(g)] = len(a)
        return a

    def lengths(self, epoch: int) -> np.ndarray:
        """Every document's token count, by global sample id: from the ``.npy`` headers where
        the documents are raw fields of local shards, else by reading (once) each document not
        read yet (a document's length is the same in every epoch)."""
        docs = self._located()
        if docs is not None:
            return docs.length
        if self._lengths is None:
            self._lengths = np.full(self.dataset.manifest.total_samples, -1, dtype=np.int64)
        missing = np.flatnonzero(self._lengths < 0)
        for g in missing.tolist():
            self.document(g, epoch)
        return self._lengths

    def order(self, epoch: int) -> np.ndarray:
        """Every document of ``epoch`` in plan order (all ranks')."""
        return self._plan(epoch)[0]

    def offsets(self, epoch: int) -> np.ndarray:
        """The token prefix sums of ``epoch``'s documents in plan order."""
        return self._plan(epoch)[1]

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``epoch``'s document order and token prefix sums (kept: every batch asks)."""
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1], self._epoch[2]
        order = self.dataset.plan(epoch).sample_ids(
            np.arange(self.dataset.manifest.total_samples))
        offsets = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.lengths(epoch)[order], out=offsets[1:])
        self._epoch = (epoch, order, offsets)
        return order, offsets

    def num_rows(self, epoch: int) -> int:
        """Rows of all ranks in ``epoch``."""
        return -(-int(self.offsets(epoch)[-1]) // self.seq_len)

    # -- batches -----------------------------------------------------------------------------
    def batches(self, epoch: int, start: int, batch_size: int) -> Iterator[dict[str, Any]]:
        """This rank's batches of ``epoch`` from global row ``start`` on."""
        world = self.dataset.world
        rows = self.num_rows(epoch)
        for batch_rows in deal_rows(rows, start, world.world_size, world.rank, batch_size):
            yield self.rows(epoch, batch_rows)

    def rows(self, epoch: int, rows: np.ndarray) -> dict[str, Any]:
        """The batch of global rows ``rows`` (ascending) of ``epoch``."""
        order, offsets = self._plan(epoch)
        L, total = self.seq_len, int(offsets[-1])
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        lo = rows * L
        hi = np.minimum(lo + L, total)
        # runs of consecutive rows: one contiguous range of the epoch's tokens each
        cut = np.flatnonzero(np.diff(rows) != 1) + 1
        firsts = np.concatenate([[0], cut]).tolist()
        lasts = np.concatenate([cut, [n]]).tolist()
        pieces: list[tuple[int, int, int, int]] = []  # (doc, start in doc, tokens, at in batch)
        bounds = [np.arange(n, dtype=np.int64) * L]  # piece starts in the flattened batch
        for f, e in zip(firsts, lasts):
            tlo, thi = int(lo[f]), int(hi[e - 1])
            d0 = int(np.searchsorted(offsets, tlo, side="right")) - 1
            d1 = int(np.searchsorted(offsets, thi, side="left"))
            inner = offsets[d0 + 1:d1]
            bounds.append(inner - tlo + f * L)
            at = f * L - tlo
            for d, (a, b) in enumerate(zip(offsets[d0:d1].tolist(),
                                           offsets[d0 + 1:d1 + 1].tolist()), d0):
                a, b = max(a, tlo), min(b, thi)
                if b > a:
                    pieces.append((d, a - int(offsets[d]), b - a, a + at))
        ids = np.empty(n * L, dtype=np.int64)
        self._copy(epoch, order, pieces, ids)
        short = np.flatnonzero(hi - lo < L)  # the epoch's last row, when it is not full
        pad = (short * L + (hi - lo)[short]).tolist()
        labels = ids.copy()
        for i, p in zip(short.tolist(), pad):
            ids[p:(i + 1) * L] = self.pad_id
            labels[p:(i + 1) * L] = IGNORE
        bounds.append(np.asarray(pad, dtype=np.int64))
        starts = np.unique(np.concatenate(bounds))
        pos = np.arange(n * L, dtype=np.int64) - np.repeat(starts, np.diff(
            np.append(starts, n * L)))
        cu = np.append(starts, n * L).astype(np.int32)
        return {"input_ids": torch.from_numpy(ids.reshape(n, L)),
                "position_ids": torch.from_numpy(pos.reshape(n, L)),
                "labels": torch.from_numpy(labels.reshape(n, L)),
                "cu_seqlens": torch.from_numpy(cu)}

    def _copy(self, epoch: int, order: np.ndarray, pieces: list[tuple[int, int, int, int]],
              out: np.ndarray) -> None:
        """The tokens of ``pieces`` into ``out``: sliced out of the shards' maps, or out of each
        document read whole."""
        docs = self._located()
        if docs is None:
            last: tuple[int, np.ndarray] | None = None
            for d, off, k, at in pieces:
                if last is None or last[0] != d:
                    last = (d, self.document(int(order[d]), epoch))
                out[at:at + k] = last[1][off:off + k]
            return
        g = order[[p[0] for p in pieces]]
        shard = docs.shard[g].tolist()
        start = docs.start[g].tolist()
        kind = docs.kind[g].tolist()
        dtypes = docs.dtypes
        shards = self.dataset.shards
        maps: dict[int, np.ndarray] = {}
        with shards.hold(set(shard)):  # opening one closes none this batch reads
            for s in set(shard):
                maps[s] = np.frombuffer(shards.reader(s).buffer,  # type: ignore[arg-type]
                                        dtype=np.uint8)
            shards.check(maps)  # a shard cut since it was opened: an error, not a SIGBUS
            for (_, off, k, at), s, b, t in zip(pieces, shard, start, kind):
                dt = dtypes[t]
                b += off * dt.itemsize
                out[at:at + k] = maps[s][b:b + k * dt.itemsize].view(dt)

    # -- states ------------------------------------------------------------------------------
    def state_at(self, epoch: int, row: int) -> dict[str, Any]:
        """The resumable state of a reader at global row ``row`` of ``epoch``."""
        state = self.dataset.state_at(epoch, 0)
        state["position"] = int(row)
        state["packed"] = {"seq_len": self.seq_len, "field": self.field}
        return state

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, row)`` a reader loading ``state`` continues from; a state of another
        packing (no ``packed`` entry, another ``seq_len`` or field) is refused."""
        epoch, row = self.dataset.resume_point(state, strict=strict)
        mine = {"seq_len": self.seq_len, "field": self.field}
        if state.get("packed") != mine:
            why = (f"the state was saved with packing {state.get('packed')!r}, this loader "
                   f"packs {mine!r}; its row position would name other tokens")
            if strict:
                raise StateError(f"cannot resume {self.dataset.url}: {why} (strict=False "
                                 "starts the saved epoch afresh)")
            log.warning("feedpipe: %s: %s; starting epoch %d afresh", self.dataset.url, why,
                        epoch)
            return epoch, 0
        return epoch, row


class PackedLoader:
    """What :class:`~feedpipe.FeedLoader` is over a :class:`Packed` dataset: batches of packed
    rows read in this process, its own epoch and row position."""

    def __init__(self, dataset: Packed, *, batch_size: int = 1, num_workers: int = 0,
                 drop_last: bool = False, **kwargs: Any) -> None:
        if int(num_workers) > 0 or kwargs:
            given = {"num_workers": num_workers, **kwargs} if num_workers else kwargs
            raise ValueError(f"FeedLoader over Packed reads rows in this process; it does not "
                             f"take {', '.join(f'{k}=' for k in given)} (leave them out)")
        if drop_last:
            raise ValueError("FeedLoader over Packed: drop_last=True is not supported; every "
                             "row but the epoch's last is full (leave drop_last out)")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self._epoch = 0
        self._start = 0
        self._batches = 0
        self._finished = False
        self._chosen = False

    @property
    def epoch(self) -> int:
        """The epoch of this loader's current (or next) pass."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch`` for the next pass, from its start unless a resume point of this same
        epoch was loaded."""
        if epoch != self._epoch or self._finished:
            self._epoch, self._start = int(epoch), 0
        self._batches, self._finished, self._chosen = 0, False, True

    def _step(self) -> int:
        world = self.dataset.dataset.world
        return world.world_size * self.batch_size

    def __len__(self) -> int:
        """Batches of this rank in a whole epoch."""
        return len(deal_rows(self.dataset.num_rows(self._epoch), 0,
                             self.dataset.dataset.world.world_size,
                             self.dataset.dataset.world.rank, self.batch_size))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.dataset.dataset.attach()
        if self._finished and not self._chosen:
            self._epoch, self._start = self._epoch + 1, 0
        self._chosen = False
        self._batches, self._finished = 0, False
        for batch in self.dataset.batches(self._epoch, self._start, self.batch_size):
            self._batches += 1
            yield batch
        self._finished = True

    @property
    def position(self) -> int:
        """The global row the training loop has reached in this epoch."""
        rows = self.dataset.num_rows(self._epoch)
        if self._finished:
            return rows
        return min(self._start + self._batches * self._step(), rows)

    def state_dict(self) -> dict[str, Any]:
        """What the loop consumed: the epoch and global row position."""
        if self._finished:
            return self.dataset.state_at(self._epoch + 1, 0)
        return self.dataset.state_at(self._epoch, self.position)

    def load_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> None:
        """Continue exactly after the rows the saved loop consumed, on any number of ranks."""
        self._epoch, self._start = self.dataset.resume_point(state_dict, strict=strict)
        self._batches, self._finished, self._chosen = 0, False, True

    def stats(self) -> dict[str, Any]:
        return {"route": "packed", "batches": self._batches,
                "documents_read": self.dataset.documents_read}
