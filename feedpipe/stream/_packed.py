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

from ..errors import FeedpipeError, StateError
from ._dataset import FeedDataset

log = logging.getLogger("feedpipe")

IGNORE = -100  # the label of a padding token: ignored by torch's cross entropy


class PackedFieldError(FeedpipeError, ValueError):
    """A document of a :class:`Packed` dataset is not a 1-D integer array."""


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
        from ._mixture import Mixture

        if not isinstance(dataset, (FeedDataset, Mixture)):
            raise TypeError(f"Packed needs a FeedDataset or a Mixture, not "
                            f"{type(dataset).__name__}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        self.dataset = dataset
        self.seq_len = int(seq_len)
        self.field = field
        self.pad_id = int(pad_id)
        self._lengths: dict[int, int] = {}  # global sample id -> tokens
        self.documents_read = 0
        self._offsets: tuple[int, np.ndarray] | None = None

    # -- documents ---------------------------------------------------------------------------
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
        self._lengths[int(g)] = len(a)
        return a

    def order(self, epoch: int) -> np.ndarray:
        """Every document of ``epoch`` in plan order (all ranks')."""
        plan = self.dataset.plan(epoch)
        return plan.sample_ids(np.arange(self.dataset.manifest.total_samples))

    def offsets(self, epoch: int) -> np.ndarray:
        """The token prefix sums of ``epoch``'s documents in plan order. Lengths not yet known
        are read once (a document's length is the same in every epoch)."""
        if self._offsets is not None and self._offsets[0] == epoch:
            return self._offsets[1]
        order = self.order(epoch)
        lengths = np.empty(len(order), dtype=np.int64)
        for i, g in enumerate(order.tolist()):
            n = self._lengths.get(g)
            lengths[i] = len(self.document(g, epoch)) if n is None else n
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._offsets = (epoch, offsets)  # state_dict() and len() ask again within the epoch
        return offsets

    def num_rows(self, epoch: int) -> int:
        """Rows of all ranks in ``epoch``."""
        return -(-int(self.offsets(epoch)[-1]) // self.seq_len)

    # -- batches -----------------------------------------------------------------------------
    def batches(self, epoch: int, start: int, batch_size: int) -> Iterator[dict[str, Any]]:
        """This rank's batches of ``epoch`` from global row ``start`` on."""
        offsets = self.offsets(epoch)
        order = self.order(epoch)
        world = self.dataset.world
        rows = -(-int(offsets[-1]) // self.seq_len)
        cached: tuple[int, np.ndarray] | None = None
        for batch_rows in deal_rows(rows, start, world.world_size, world.rank, batch_size):
            n, L = len(batch_rows), self.seq_len
            ids = np.full((n, L), self.pad_id, dtype=np.int64)
            pos = np.zeros((n, L), dtype=np.int64)
            labels = np.full((n, L), IGNORE, dtype=np.int64)
            cu = [0]
            for i, r in enumerate(batch_rows.tolist()):
                at = 0
                for d, off, k in row_pieces(offsets, r, L):
                    if cached is None or cached[0] != d:
                        cached = (d, self.document(int(order[d]), epoch))
                    ids[i, at:at + k] = cached[1][off:off + k]
                    labels[i, at:at + k] = ids[i, at:at + k]
                    pos[i, at:at + k] = np.arange(k)
                    at += k
                    cu.append(i * L + at)
                if at < L:  # padding: a piece of its own, so no real token attends to it
                    pos[i, at:] = np.arange(L - at)
                    cu.append((i + 1) * L)
            yield {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos),
                   "labels": torch.from_numpy(labels),
                   "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}

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
