"""``Packed``: token documents packed in plan order into rows of ``seq_len``.

The packing of an epoch is a pure function of the plan's document order and the documents'
lengths (:mod:`feedpipe.plan._packing`; by default concatenate and cut: row ``r`` holds tokens
``[r * seq_len, (r + 1) * seq_len)`` of the epoch's concatenation). Rows are therefore dealt to
ranks, batches and worker processes like samples (the ``packed`` routes of the loader: a Packed
reads as a dataset whose samples are rows), and a reader's place in an epoch is a row position:
a state saved mid-document resumes, on any number of ranks, to exactly the tokens not yet
delivered. With several ranks the rows are made a multiple of the world size with rows of
padding only, so every rank gets as many batches.

Where the documents are raw ``.npy`` fields of local shards, no document is read whole: their
lengths come from the headers (:class:`~feedpipe.stream._token_docs.TokenDocs`) and a group of
batches' tokens is copied straight out of the shards' maps.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._helpers.dependency import say_unbuilt
from .._redact import logger
from ..errors import PackedFieldError
from ..plan._order import Plan, Split
from ..plan._packing import (
    CONCATENATE,
    ConcatenateAndCut,
    CutLayout,
    Layout,
    Packing,
    offsets_of,
    rows_split,
)
from ..plan._packing import row_pieces as row_pieces  # the plan's, named here as before
from ..plan._packing_chunks import ChunkedCut, MixtureTokens
from ._dataset import FeedDataset
from ._ledger_kinds import lengths_record
from ._mixture import Mixture
from ._packed_batches import IGNORE as IGNORE  # the label of a padding token
from ._packed_batches import Group, placed
from ._packed_batches import PackedFetch as PackedFetch  # the packed routes' fetch
from ._packed_batches import Shipment as Shipment  # what a worker sends
from ._routes import Capabilities
from ._shared_order import MOST_DOCUMENTS, SharedOrder
from ._source import Source
from ._states import checked_resume_point, packed_mismatch
from ._token_docs import NotMapped, TokenDocs
from ._wrapping import OverDataset

try:  # optional C extension (setup.py): the copy of a group's pieces out of the shards
    from .._native import _packrows
except ImportError:  # pragma: no cover - where it did not build, numpy copies them
    _packrows = None

log = logger("feedpipe")

# where make_group puts the tokens it copies out of the shards: (count, dtype) -> array
Alloc = Callable[[int, np.dtype], np.ndarray]

# the batches a reader's fetch makes together (PackedFetch): at most so many tokens and batches
GROUP_TOKENS = 1 << 19
GROUP_BATCHES = 32


def piece_copier() -> str:
    """What copies the token pieces of raw ``.npy`` documents out of the shards: the C
    extension ``feedpipe._native._packrows`` where it was built, else ``numpy`` (slower: one view
    object per piece, see ``benchmarks/bench_packed.py``)."""
    return "numpy" if _packrows is None else "feedpipe._native._packrows"


class Packed(OverDataset[FeedDataset | Mixture], Source):
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
        pad_id: the token id of padding (the epoch's last row, the rows of padding only).
        packing: the packing strategy (a :class:`~feedpipe.Packing`), which lays an epoch's
            documents out in rows; the default, :class:`~feedpipe.ConcatenateAndCut`
            (``"concatenate"``), is the concatenation cut every ``seq_len`` tokens described
            above. :class:`~feedpipe.BestFit` (``"best-fit"``) keeps each document no longer
            than a row whole, in the fullest row it fits, with padding (label -100, its own
            piece in ``cu_seqlens``) left in rows: :meth:`fill` and a log record per epoch say
            how much of the rows is documents'.

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
                 pad_id: int = 0, packing: Packing = CONCATENATE) -> None:
        if not isinstance(dataset, (FeedDataset, Mixture)):
            raise TypeError(f"Packed needs a FeedDataset or a Mixture, not "
                            f"{type(dataset).__name__}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        self.dataset = dataset
        self.seq_len = int(seq_len)
        self.field = field
        self.pad_id = int(pad_id)
        if not callable(getattr(packing, "layout", None)) or not isinstance(
                getattr(packing, "name", None), str):
            raise TypeError(f"packing= takes a packing strategy (a `name` and a `layout(lengths, "
                            f"seq_len)`, see feedpipe.plan._packing), not {packing!r}")
        self.packing = packing
        self.documents_read = 0
        self.bytes_read = 0  # token bytes copied out of the documents (loader.stats()["io"])
        self._docs: TokenDocs | None | bool = False  # False: not looked at yet; None: read whole
        self._lengths: np.ndarray | None = None  # per global sample id; -1: not known yet
        self._epoch: tuple[int, Any, Layout] | None = None  # (epoch, order, rows)
        self._board: SharedOrder | None = None  # the epoch's order, for the worker processes
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
            # by sample number: a mixture's manifest counts its epoch's positions instead
            self._lengths = np.full(self.dataset.shards.num_samples, -1, dtype=np.int64)
        missing = np.flatnonzero(self._lengths < 0)
        for g in missing.tolist():
            self.document(g, epoch)
        return self._lengths

    def order(self, epoch: int) -> np.ndarray:
        """Every document of ``epoch`` in plan order (all ranks'): an array of the epoch's
        size (the rows themselves are planned without it)."""
        order = self._plan(epoch)[0]
        return order if isinstance(order, np.ndarray) else order[np.arange(len(order))]

    def offsets(self, epoch: int) -> np.ndarray:
        """The token prefix sums of ``epoch``'s documents in plan order."""
        return offsets_of(self.lengths(epoch)[self.order(epoch)])

    def layout(self, epoch: int) -> Layout:
        """``epoch``'s rows as the packing strategy lays them out: a piece's document is its
        place in :meth:`order`."""
        return self._plan(epoch)[1]

    def _plan(self, epoch: int) -> tuple[Any, Layout]:
        """``epoch``'s document order (an array, or where a mixture's is planned by windows,
        what gives the documents at any positions) and rows (kept: every batch asks)."""
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1], self._epoch[2]
        ds = self.dataset
        if isinstance(ds, Mixture) and isinstance(self.packing, ConcatenateAndCut):
            # a mixture's epoch can be far longer than its sources: its rows come a window of
            # documents at a time, its token count by formula (plan/_packing_chunks.py)
            chunked = ChunkedCut(MixtureTokens(ds.mixture_plan, epoch, self.lengths(epoch),
                                               ds.shards.bases), self.seq_len)
            self._epoch = (epoch, chunked.order, chunked)
            return chunked.order, chunked
        order = None if self._board is None else self._board.read(epoch)  # the trainer's
        if order is None:
            plan = self.dataset.plan(epoch)
            if isinstance(plan, Plan) and plan.nodes > 1:  # rows are dealt here: documents in
                plan = dataclasses.replace(plan, layout=None)  # global order, whatever the world
            order = plan.sample_ids(np.arange(self.dataset.manifest.total_samples))
            if self._board is None and len(order) <= MOST_DOCUMENTS:  # made before workers are
                self._board = SharedOrder(len(order))
            if self._board is not None:
                self._board.publish(epoch, order)
        layout = self.packing.layout(self.lengths(epoch)[order], self.seq_len)
        if not layout.contiguous:  # the padding a strategy leaves in rows is said
            log.info("Packed epoch %d: %d rows of %d tokens packed by %r, %.1f%% of them "
                     "documents' tokens (the rest padding)", epoch, layout.num_rows,
                     self.seq_len, self.packing.name, 100 * layout.fill)
        self._epoch = (epoch, order, layout)
        return order, layout

    def fill(self, epoch: int) -> float:
        """The share of ``epoch``'s row tokens that are documents' (1.0 but for the last row
        with the default packing; what :class:`~feedpipe.BestFit` leaves as
        padding inside rows is the rest)."""
        return float(self.layout(epoch).fill)

    def num_rows(self, epoch: int) -> int:
        """Rows of all ranks in ``epoch``."""
        return int(self.layout(epoch).num_rows)

    # -- batches -----------------------------------------------------------------------------
    def rows(self, epoch: int, rows: np.ndarray) -> dict[str, Any]:
        """The batch of global rows ``rows`` (ascending) of ``epoch``."""
        return self.batches_of(epoch, [rows])[0]

    def batches_of(self, epoch: int, groups: list[np.ndarray]) -> list[dict[str, Any]]:
        """The batches of global rows ``groups`` (each ascending, and ascending from one to the
        next) of ``epoch``, made together: where the pieces of each batch lie is worked out for
        all at once, and their tokens are copied at once."""
        group = self.make_group(epoch, groups)
        return [group.make(b) for b in range(len(groups))]

    def group_sizes(self) -> tuple[int, int]:
        """The most tokens and batches a reader's fetch makes together (the packed routes)."""
        return GROUP_TOKENS, GROUP_BATCHES

    def make_group(self, epoch: int, groups: list[np.ndarray],
                   alloc: Alloc | None = None) -> Group:
        """The batches of global rows ``groups`` (each ascending, and ascending from one to the
        next) of ``epoch``, ready to be made one by one (``Group.make``): where the pieces
        of each batch lie is worked out for all at once, and their tokens are copied out of the
        documents now (numpy's per-call costs paid once a group, and a shard cut later cannot
        reach them), while each batch's fields are written only when it is asked for (the
        memory of the batch before, freed by then, is reused while it is still in the cache).
        ``alloc(n, dtype)``: where the tokens copied straight out of the shards go (a worker's
        shared memory), where they are not copied again after."""
        rows = np.concatenate(groups).astype(np.int64, copy=False)
        order, layout = self._plan(epoch)
        L, n = self.seq_len, len(rows)
        N = n * L
        edges = np.zeros(len(groups) + 1, dtype=np.int64)  # each batch's place in the group
        np.cumsum([len(g) * L for g in groups], out=edges[1:])
        # the pieces of the rows, in order (only the epoch's last row can be short, and rows
        # past the epoch's tokens are padding only: they come last)
        if isinstance(layout, (CutLayout, ChunkedCut)):  # a run of rows is one range: at once
            doc, into, k = layout.spans(rows)
        else:
            p = layout.pieces(rows)
            doc, into, k = p.doc, p.start, p.length
        at = np.cumsum(k) - k  # where each piece starts in the group
        m = int(k.sum())
        tokens = self._tokens(epoch, order[doc], into, k,
                              alloc if layout.contiguous else None)
        real = None
        if layout.contiguous:
            # pieces of the positions start at each row, each document start and the padding
            starts = np.unique(np.concatenate([np.arange(n, dtype=np.int64) * L, at[into == 0],
                                               [m] if m < N else []]).astype(np.int64))
        else:  # padding inside rows: each piece is put in its place, the rest is padding
            tokens, real, starts = placed(tokens, p.row, k, at, n, L, self.pad_id)
            m = N
        most = int(np.diff(edges).max(initial=0))  # the tokens of the group's largest batch
        if len(self._counting) < most:
            self._counting = np.arange(most, dtype=np.int64)
        return Group(tokens, starts, edges, m, L, self.pad_id, self._counting, real)

    def _tokens(self, epoch: int, docs: np.ndarray, into: np.ndarray,
                k: np.ndarray, alloc: Alloc | None = None) -> np.ndarray:
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
            out = (np.empty if alloc is None else alloc)(int(k.sum()), dt)
            _packrows.gather(out, tuple(maps[s] for s in used), np.searchsorted(used, shard),
                             byte, k, dt.itemsize)
            return out
        if len(where.dtypes) == 1 and not (byte % size).any():  # the common case
            say_unbuilt(log, "_native._packrows", "Packed copies token pieces with numpy",
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

    # its url, manifest, shards, world, seed and epoch are the documents' dataset's (OverDataset)
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

    def ledger_info(self) -> dict[str, Any]:
        """What ``FeedLoader(ledger=)`` records of this Packed in ``ledger.json``: the documents'
        dataset (its own record), ``seq_len``, the field, the packing strategy and every
        document's length with a digest, from which ``feedpipe ledger`` recomputes each
        epoch's rows."""
        ds = self.dataset
        inner = ds.ledger_info()
        e = ds.epoch
        return {"kind": "packed", "digest": inner["digest"], "inner": inner,
                "counts": inner["counts"], "seq_len": self.seq_len, "field": self.field,
                "packing": self.packing.name, "lengths": lengths_record(self.lengths(e)),
                "drop_last": False}

    # -- states ------------------------------------------------------------------------------
    def state_at(self, epoch: int, row: int) -> dict[str, Any]:
        """The resumable state of a reader at global row ``row`` of ``epoch``."""
        state = self.dataset.state_at(epoch, 0)
        state["position"] = int(row)
        state["packed"] = self._packed_entry()
        return state

    def _packed_entry(self) -> dict[str, Any]:
        """What a state records of the packing: a row position names other tokens under
        another ``seq_len``, field or strategy (the default strategy is not named, so states
        saved before strategies were named still resume)."""
        entry: dict[str, Any] = {"seq_len": self.seq_len, "field": self.field}
        if self.packing.name != CONCATENATE.name:
            entry["packing"] = self.packing.name
        return entry

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
        return packed_mismatch(state, self._packed_entry(), self.num_rows, self.seq_len)
