"""``Packed``: token documents concatenated in plan order and cut into rows of ``seq_len``.

The packing of an epoch is a pure function of the plan's document order and the documents'
lengths: row ``r`` holds tokens ``[r * seq_len, (r + 1) * seq_len)`` of the epoch's
concatenation. Rows are therefore dealt to ranks, batches and worker processes like samples
(the ``packed`` routes of the loader: a Packed reads as a dataset whose samples are rows), and a
reader's place in an epoch is a row position: a state saved mid-document resumes, on any number
of ranks, to exactly the tokens not yet delivered. With several ranks the rows are made a
multiple of the world size with rows of padding only, so every rank gets as many batches.

Where the documents are raw ``.npy`` fields of local shards, no document is read whole: their
lengths come from the headers (:class:`~feedpipe.stream._token_docs.TokenDocs`) and a group of
batches' tokens is copied straight out of the shards' maps.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._helpers.dependency import say_unbuilt
from .._redact import logger
from ..errors import PackedFieldError
from ..plan._order import Plan, Split
from ._collator import shared_empty
from ._dataset import FeedDataset, checked_resume_point
from ._mixture import Mixture
from ._routes import Capabilities
from ._source import Source
from ._token_docs import NotMapped, TokenDocs

if TYPE_CHECKING:
    from ._batch_loop import PartTimes
    from ._worker_rows import ByteRing

try:  # optional C extension (setup.py): the copy of a group's pieces out of the shards
    from .. import _packrows
except ImportError:  # pragma: no cover - where it did not build, numpy copies them
    _packrows = None

log = logger("feedpipe")

IGNORE = -100  # the label of a padding token: ignored by torch's cross entropy
# the batches a reader's fetch makes together (PackedFetch): at most so many tokens and batches
GROUP_TOKENS = 1 << 19
GROUP_BATCHES = 32


def piece_copier() -> str:
    """What copies the token pieces of raw ``.npy`` documents out of the shards: the C
    extension ``feedpipe._packrows`` where it was built, else ``numpy`` (slower: one view
    object per piece, see ``benchmarks/bench_packed.py``)."""
    return "numpy" if _packrows is None else "feedpipe._packrows"


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


class Packed(Source):
    """Token documents of ``dataset`` packed into rows of ``seq_len`` tokens: the dataset of a
    :class:`~feedpipe.FeedLoader` for language-model pre-training.

    Each document is the 1-D integer array in ``field`` of a sample (a ``.npy`` field written by
    ``ShardWriter``/``shard_from``, or what the dataset's transform puts there, such as the ids of
    a tokenised text). Documents are concatenated in the order of the dataset's plan and cut at
    ``seq_len``; a document longer than the room left continues in the next row. A batch is a
    dict of ``input_ids``, ``position_ids`` and ``labels`` (int64 ``[batch, seq_len]``) and
    ``cu_seqlens`` (int32, the boundaries of the pieces in the flattened batch, for
    variable-length attention kernels). ``position_ids`` count from 0 at each piece; ``labels``
    are ``input_ids`` with -100 on padding, which only the epoch's last row has, and with
    several ranks up to ``world_size - 1`` rows of padding only after it: every rank must take
    as many steps (under DDP a rank that runs out of batches first leaves the others waiting in
    a collective that never completes), so the rows are made a multiple of the world size and
    ``len(loader)`` is the same on every rank. ``FeedLoader(..., num_workers=N)`` makes the
    rows in N worker processes (route ``packed-workers``) where they have work: a transform
    making the documents, a decoded field, remote shards. Raw ``.npy`` documents of local
    shards are copied straight out of the shards' maps, in the training process (route
    ``packed``, with a log record saying why; ``route="packed-workers"`` forces the workers);
    ``device=`` works as for any dataset.

    Args:
        dataset: a :class:`~feedpipe.FeedDataset` or a :class:`~feedpipe.Mixture` whose samples
            hold one document each; its rank and world size are the reader's.
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

    def __init__(self, dataset: FeedDataset | Mixture, seq_len: int, field: str = "tokens.npy",
                 pad_id: int = 0) -> None:
        if not isinstance(dataset, (FeedDataset, Mixture)):
            raise TypeError(f"Packed needs a FeedDataset or a Mixture, not "
                            f"{type(dataset).__name__}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        self.dataset = dataset
        self.seq_len = int(seq_len)
        self.field = field
        self.pad_id = int(pad_id)
        self.documents_read = 0
        self.bytes_read = 0  # token bytes copied out of the documents (loader.stats()["io"])
        self._docs: TokenDocs | None | bool = False  # False: not looked at yet; None: read whole
        self._lengths: np.ndarray | None = None  # per global sample id; -1: not known yet
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, order, offsets)
        self._counting = np.zeros(0, dtype=np.int64)  # 0, 1, 2, ...: a token's place in its batch
        # per open shard: its reader, its map as bytes and as elements of each dtype
        self._views: dict[int, tuple[Any, np.ndarray, dict[np.dtype, np.ndarray]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_epoch"] = None  # a worker computes its epoch's order itself
        state["_views"] = {}  # maps are this process's own
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
    def rows(self, epoch: int, rows: np.ndarray) -> dict[str, Any]:
        """The batch of global rows ``rows`` (ascending) of ``epoch``."""
        return self.batches_of(epoch, [rows])[0]

    def batches_of(self, epoch: int, groups: list[np.ndarray]) -> list[dict[str, Any]]:
        """The batches of global rows ``groups`` (each ascending, and ascending from one to the
        next) of ``epoch``, made together: where the pieces of each batch lie is worked out for
        all at once, and their tokens are copied at once."""
        group = self._group(epoch, groups)
        return [group.make(b) for b in range(len(groups))]

    def _group(self, epoch: int, groups: list[np.ndarray]) -> _Group:
        """The batches of global rows ``groups`` (each ascending, and ascending from one to the
        next) of ``epoch``, ready to be made one by one (:meth:`_Group.make`): where the pieces
        of each batch lie is worked out for all at once, and their tokens are copied out of the
        documents now (numpy's per-call costs paid once a group, and a shard cut later cannot
        reach them), while each batch's fields are written only when it is asked for (the
        memory of the batch before, freed by then, is reused while it is still in the cache)."""
        rows = np.concatenate(groups).astype(np.int64, copy=False)
        order, offsets = self._plan(epoch)
        L, total, n = self.seq_len, int(offsets[-1]), len(rows)
        N = n * L
        edges = np.zeros(len(groups) + 1, dtype=np.int64)  # each batch's place in the group
        np.cumsum([len(g) * L for g in groups], out=edges[1:])
        # runs of consecutive rows: each a contiguous range of the epoch's tokens, and the
        # group the runs concatenated (only the epoch's last row can be short, and rows past
        # the epoch's tokens are padding only: they come last)
        real = rows[rows * L < total]
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
        doc, k = doc[keep], k[keep]
        into = a[keep] - offsets[doc]  # where each piece starts in its document
        at = np.cumsum(k) - k  # where each piece starts in the group
        m = int(k.sum())
        # pieces of the positions start at each row, each document start and the padding
        starts = np.unique(np.concatenate([np.arange(n, dtype=np.int64) * L, at[into == 0],
                                           [m] if m < N else []]).astype(np.int64))
        tokens = self._tokens(epoch, order[doc], into, k)
        most = int(np.diff(edges).max(initial=0))  # the tokens of the group's largest batch
        if len(self._counting) < most:
            self._counting = np.arange(most, dtype=np.int64)
        return _Group(tokens, starts, edges, m, L, self.pad_id, self._counting)

    def _tokens(self, epoch: int, docs: np.ndarray, into: np.ndarray,
                k: np.ndarray) -> np.ndarray:
        """Tokens ``[into, into + k)`` of each global document ``docs``, concatenated (in the
        documents' dtype where they share one): copied out of the shards' maps, or out of each
        document read whole."""
        where = self._located()
        if where is None:
            views = []
            last: tuple[int, np.ndarray] | None = None
            for g, off, n in zip(docs.tolist(), into.tolist(), k.tolist()):
                if last is None or last[0] != g:
                    last = (g, self.document(g, epoch))
                views.append(last[1][off:off + n])
            out = np.empty(int(k.sum()), dtype=np.int64)
            if views:
                np.concatenate(views, out=out, casting="unsafe")
            self.bytes_read += sum(v.nbytes for v in views)
            return out
        shard = where.shard[docs]
        kind = where.kind[docs]
        size = where.itemsize[kind]
        byte = where.start[docs] + into * size
        self.bytes_read += int((k * size).sum())
        shards = self.dataset.shards
        used = np.unique(shard).tolist()
        with shards.hold(used):  # opening one closes none this batch reads
            maps = self._maps(used)
            shards.check(used)  # a shard cut since it was opened: an error, not a SIGBUS
        if len(where.dtypes) == 1 and _packrows is not None:  # the common case, in C
            dt = where.dtypes[0]
            out = np.empty(int(k.sum()), dtype=dt)
            _packrows.gather(out, tuple(maps[s] for s in used), np.searchsorted(used, shard),
                             byte, k, dt.itemsize)
            return out
        if len(where.dtypes) == 1 and not (byte % size).any():  # the common case
            say_unbuilt(log, "_packrows", "Packed copies token pieces with numpy",
                        "the batches are the same")
            dt = where.dtypes[0]
            typed = {s: self._typed(s, maps[s], dt) for s in used}
            views = [typed[s][e:e + n] for s, e, n in zip(
                shard.tolist(), (byte // size).tolist(), k.tolist())]
            return np.concatenate(views) if views else np.zeros(0, dtype=dt)
        dtypes = where.dtypes
        views = [maps[s][b:b + n * dtypes[t].itemsize].view(dtypes[t])
                 for s, t, b, n in zip(shard.tolist(), kind.tolist(), byte.tolist(), k.tolist())]
        out = np.empty(int(k.sum()), dtype=np.int64)
        if views:
            np.concatenate(views, out=out, casting="unsafe")
        return out

    def _maps(self, used: list[int]) -> dict[int, np.ndarray]:
        """The maps of shards ``used`` as bytes, kept while their readers stay open (a closed
        reader's view is let go, so its map closes)."""
        shards, kept = self.dataset.shards, self._views
        for s in [s for s, (r, _, _) in kept.items()
                  if not shards.is_open(s) or shards.reader(s) is not r]:
            del kept[s]
        out = {}
        for s in used:
            hit = kept.get(s)
            if hit is None:
                r = shards.reader(s)
                r.populate()  # an epoch reads every document of it: its pages in one call
                hit = kept[s] = (r, np.frombuffer(r.buffer, dtype=np.uint8), {})  # type: ignore[arg-type]
            out[s] = hit[1]
        return out

    def _typed(self, s: int, u8: np.ndarray, dt: np.dtype) -> np.ndarray:
        """Shard ``s``'s map as elements of ``dt`` (kept with its bytes)."""
        views = self._views[s][2]
        v = views.get(dt)
        if v is None:
            v = views[dt] = u8[:len(u8) - len(u8) % dt.itemsize].view(dt)
        return v

    # -- the batch loop's view: rows are its samples ----------------------------------------
    # FeedLoader reads a Packed as it reads a FeedDataset (the ``packed`` routes of
    # feedpipe.stream._routes): its "samples" are the epoch's rows, in order (the shuffle is in
    # the documents' order), dealt to ranks, batches and workers by the same Split.
    bytes_read: int  # token bytes copied out of the documents (set in __init__)
    prefetches = False  # its plan orders rows, not samples: no shard prefetch follows it

    # -- what the routes read (feedpipe.Source) ---------------------------------------------
    def capabilities(self, collate_fn: Any) -> Capabilities:
        """Its rows take a ``packed`` route (``makes_batches``); ``transform``: its documents
        are read whole (a transform makes them, or their field is decoded), where workers have
        work to share."""
        docs = self.dataset
        return Capabilities(transform=docs.transform is not None or self.field in docs.decode
                            or docs.decoded is not None, local=docs.shards.local,
                            makes_batches=True)

    def batch_fetch(self, epoch: int) -> PackedFetch:
        """Its batches of rows, made whole a group of batches at a time."""
        return PackedFetch(self, epoch)

    def ledger_info(self) -> dict[str, Any]:
        """Refused: ``FeedLoader(ledger=)`` proves sample ids exactly once."""
        raise ValueError("FeedLoader over a Packed does not take ledger= yet: the ledger "
                         "proves sample ids (a FeedDataset's or a Mixture's) exactly once, "
                         "and a Packed loader delivers rows of pieces of documents, which it "
                         "does not record; leave ledger out for a Packed")

    @property
    def shards(self) -> Any:  # type: ignore[override]
        """The documents' dataset's shards."""
        return self.dataset.shards

    @property
    def manifest(self) -> Any:
        """The documents' dataset's manifest."""
        return self.dataset.manifest

    @property
    def url(self) -> str:  # type: ignore[override]
        """The documents' dataset's URL."""
        return self.dataset.url

    @property
    def world(self) -> Any:  # type: ignore[override]
        """The rank and world size rows are dealt to (the documents' dataset's)."""
        return self.dataset.world

    @property
    def seed(self) -> int:  # type: ignore[override]
        """The documents' dataset's seed."""
        return self.dataset.seed

    @property
    def transform(self) -> Any:  # type: ignore[override]
        """The documents' dataset's transform (what makes a sample a document)."""
        return self.dataset.transform

    @property
    def decode(self) -> dict[str, Any]:  # type: ignore[override]
        """Empty, as rows are cut from the documents (the dataset's ``decode=`` applies where
        documents are read whole)."""
        return {}

    @property
    def decoded(self) -> None:  # type: ignore[override]
        """Always ``None``, as rows are cut from the documents each epoch (no decoded store)."""
        return None

    @property
    def epoch(self) -> int:
        """The epoch of the dataset's direct reader (a loader keeps its own)."""
        return self.dataset.epoch

    def attach(self) -> None:
        """Attach the documents' dataset (:meth:`~feedpipe.FeedDataset.attach`)."""
        self.dataset.attach()

    def plan(self, epoch: int | None = None) -> Plan:
        """``epoch``'s rows in order: position ``p`` is row ``p``."""
        e = self.dataset.epoch if epoch is None else int(epoch)
        return Plan((self.num_rows(e) + self.world.world_size,), epoch=e, shuffle=False)

    def split_at(self, start: int = 0, whole_batches: bool = False, *,
                 epoch: int | None = None) -> Split:
        """This rank's share of ``epoch``'s rows (``None``: the dataset's direct reader's
        epoch) from row ``start`` on, the rows made a multiple of the world size with rows of
        padding only. The row count is the epoch's own:
        the epochs of a :class:`~feedpipe.Mixture` draw documents of other lengths."""
        w = self.world
        e = self.dataset.epoch if epoch is None else int(epoch)
        return rows_split(self.num_rows(e), int(start), w.world_size, w.rank, whole_batches)

    # -- states ------------------------------------------------------------------------------
    def state_at(self, epoch: int, row: int) -> dict[str, Any]:
        """The resumable state of a reader at global row ``row`` of ``epoch``."""
        state = self.dataset.state_at(epoch, 0)
        state["position"] = int(row)
        state["packed"] = {"seq_len": self.seq_len, "field": self.field}
        return state

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, row)`` a reader loading ``state`` continues from: a state of another
        dataset or packing (no ``packed`` entry, another ``seq_len`` or field), or whose row is
        outside its epoch's rows, is refused (``strict=False``: logged, the saved epoch from
        its start)."""
        return checked_resume_point(state, self.state_mismatch, self.dataset.url, strict)

    def state_mismatch(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot resume this source (a reason to show), or ``None``."""
        # the documents' dataset checks what identifies the order; its position is a row here,
        # checked against the saved epoch's rows (an epoch has more rows than documents where
        # documents are longer than a row)
        why = self.dataset.state_mismatch({**state, "position": 0})
        if why is not None:
            return why
        mine = {"seq_len": self.seq_len, "field": self.field}
        if state.get("packed") != mine:
            return (f"the state was saved with packing {state.get('packed')!r}, this loader "
                    f"packs {mine!r}; its row position would name other tokens")
        row, epoch = state.get("position"), state.get("epoch")
        if not isinstance(epoch, int) or epoch < 0:
            return f"the saved epoch {epoch!r} is not an epoch"
        # a loop that read its last batch saves the next epoch's start: a position mid-epoch
        # is at most the epoch's rows (the rows of padding a world size adds come last)
        rows = self.num_rows(epoch)
        if not isinstance(row, int) or not 0 <= row <= rows:
            return (f"the saved row {row!r} is outside epoch {epoch}, which has {rows} rows "
                    f"of {self.seq_len} tokens")
        return None


class PackedFetch:
    """fetch=packed: a reader's batches of rows made in groups of up to ``GROUP_TOKENS``
    tokens and ``GROUP_BATCHES`` batches (``Packed._group``), so that numpy's per-call
    costs are paid once a group, and each batch of a group written when it is asked for."""

    def __init__(self, packed: Packed, epoch: int) -> None:
        self.packed, self.epoch = packed, epoch
        self.group = max(1, GROUP_TOKENS // packed.seq_len)  # rows made at once

    def __call__(self, rows: np.ndarray) -> dict[str, Any]:
        """The batch of rows ``rows`` on its own."""
        return self.packed.rows(self.epoch, rows)

    def groups(self, batches: Iterator[np.ndarray],
               times: PartTimes | None = None) -> Iterator[tuple[_Group, int]]:
        """Each group of ``batches`` (a reader's batches of rows, in order) and how many
        batches it holds; ``times``: the groups' seconds are added to ``fetch``."""
        packed, epoch, most = self.packed, self.epoch, self.group
        clock = time.perf_counter
        pending: list[np.ndarray] = []
        rows = 0
        size = 1  # the first batch is made on its own: the reader waits for no group
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
            group = packed._group(epoch, pending)
            if times is not None:
                times.fetch += clock() - t0
            yield group, len(pending)
            # the group's tokens go before the next group's are copied: one at a time alive
            pending, rows, group = [], 0, None  # type: ignore[assignment]
            size = GROUP_BATCHES

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
        """:meth:`run`'s batches, each group written into one buffer in shared memory
        (:class:`Shipment`), as worker ``worker`` sends them: a buffer of ``ring`` (its
        :meth:`~feedpipe.stream._worker_rows.ByteRing.ticket` then names it), else a fresh
        one. ``times`` as for :meth:`run`."""
        clock = time.perf_counter
        for group, count in self.groups(batches, times):
            t0 = clock()
            layout = [(group.size[b], group.cu_len(b)) for b in range(count)]
            wide, narrow = Shipment.size(layout)
            size = wide * 8 + narrow * 4
            buf = shared_empty((size,), torch.uint8) if ring is None else ring.buffer(size)
            raw = buf.numpy()
            longs, ints = raw[:wide * 8].view(np.int64), raw[wide * 8:].view(np.int32)
            a = c = 0
            for b, (n, k) in enumerate(layout):
                group.write(b, longs[a:a + 3 * n].reshape(3, n), ints[c:c + k])
                a, c = a + 3 * n, c + k
            if times is not None:
                times.sink += clock() - t0
            del group, raw, longs, ints  # gone before the next group's tokens are copied
            yield Shipment(worker, buf, layout, self.packed.seq_len)


class _Group:
    """The batches of one ``Packed._group`` call, each made when asked (:meth:`make`): the
    group's tokens (``tokens``; the padding starts at ``m``), and where each piece of the
    positions starts (``starts``, ascending: each row, each document and the padding start
    one)."""

    __slots__ = ("tokens", "lo", "size", "full", "at", "local", "counts", "cu", "L", "pad",
                 "count")

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, edges: np.ndarray, m: int,
                 L: int, pad: int, count: np.ndarray) -> None:
        self.tokens, self.L, self.pad, self.count = tokens, L, pad, count
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
        ids, pos, labels = buf
        ids[:full] = self.tokens[lo:lo + full]
        labels[:full] = ids[:full]
        if full < n:  # the epoch's last tokens: padding after them
            ids[full:] = self.pad
            labels[full:] = IGNORE
        # a token's position: its place in the batch less its piece's start (no loop over
        # the pieces)
        np.subtract(self.count[:n], np.repeat(self.local[i:j], self.counts[i:j]), out=pos)
        if cu is not None:
            cu[:] = self.cu[i + b:j + b + 1]


class Shipment:
    """A worker's group of batches written into one shared-memory buffer: what crosses from a
    worker process to the training process in one message (``packed-workers``). Each tensor
    sent through a DataLoader's queue is a shared-memory segment of its own, with its file
    descriptor handed over by a round trip between the two processes; a batch of four fields
    sent as tensors costs four, which is more than making the batch. A shipment costs one for
    a whole group.

    ``worker``: the worker that made it (its batches are that worker's next ones, in order);
    ``layout``: each batch's tokens and ``cu_seqlens`` length; the buffer holds each batch's
    ids, positions and labels (int64), then every batch's ``cu_seqlens`` (int32)."""

    __slots__ = ("worker", "buffer", "layout", "L")

    def __init__(self, worker: int, buffer: torch.Tensor, layout: list[tuple[int, int]],
                 L: int) -> None:
        self.worker, self.buffer, self.layout, self.L = worker, buffer, layout, L

    def __reduce__(self) -> Any:
        return Shipment, (self.worker, self.buffer, self.layout, self.L)

    def __len__(self) -> int:
        return len(self.layout)

    @staticmethod
    def size(layout: list[tuple[int, int]]) -> tuple[int, int]:
        """The int64 elements of ``layout``'s fields, and the int32 elements of its
        ``cu_seqlens`` (after them)."""
        return 3 * sum(n for n, _ in layout), sum(c for _, c in layout)

    def unpacked(self, pin: bool = False) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """The buffer the batches view (``pin``: a copy of it in pinned memory, made once
        for all of them), and the batches."""
        buf = self.buffer.pin_memory() if pin else self.buffer
        wide, _ = self.size(self.layout)
        longs, ints = buf[:wide * 8].view(torch.int64), buf[wide * 8:].view(torch.int32)
        L = self.L
        out = []
        # one call each for every batch's fields and cu_seqlens, and one a batch for its three
        for part, cu in zip(torch.split(longs, [3 * n for n, _ in self.layout]),
                            torch.split(ints, [k for _, k in self.layout])):
            ids, pos, labels = part.view(3, -1, L).unbind(0)
            out.append({"input_ids": ids, "position_ids": pos, "labels": labels,
                        "cu_seqlens": cu})
        return buf, out
