"""Raw batches by reference: fetch=refs and sink=resolve of the batch loop.

With no transform and the default collation, a batch of raw samples is fully described by where
its members lie in the shards. Building the batch from that description skips what the general
path pays per sample: a dict and a ``memoryview`` per field, and collation's walk over every
sample's keys. With DataLoader workers it also skips a pickle of every field's bytes, a pipe and
an unpickle of them in the training process (``benchmarks/bench_read.py`` measures both).

* :class:`RefFetch` runs where the plan is (the training process, or a DataLoader worker). For
  each batch of ids it makes a :class:`BatchRefs`: per sample, its shard, global id and key;
  per field, the member's offset and size (``-1``: the sample lacks that field). That is a few
  kB per batch, whatever the samples' size. When every shard is open here it plans from
  :class:`Columns`, the whole index as arrays over global sample ids (a few array gathers per
  batch); otherwise sample by sample from the shards' indexes. It also asks the kernel to read
  the batch's byte ranges ahead (``MADV_WILLNEED``), so that the process that copies them
  seldom waits on storage.
* :class:`Resolver` runs in the training process. It copies the members out of its own
  read-only maps of the shards (opened through the dataset's :class:`~feedpipe.ShardSet`) into
  ``bytes``. It assembles the batch :func:`~feedpipe.stream._collate.collate_samples` makes
  from the same samples: same keys, same types, every field of the manifest, ``decode=``
  fields decoded.

Only local, uncached shards qualify: both processes must map the same file, and a cached shard
may be evicted once a worker lets go of it (:func:`feedpipe.stream._routes.refusal` says so).
Integrity holds as on the general path. Shards are opened through
:class:`~feedpipe.ShardReader` (size, index and, with ``verify=True``, hash and headers
checked). The resolver checks every member against the end of the file and each shard's size
before it copies, so a shard truncated in between is an error naming it and the offset, never a
short sample or a ``SIGBUS``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from operator import getitem
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ShardFormatError
from ._collate import column

if TYPE_CHECKING:
    from ..format._reader import ShardReader
    from ._collate import Decoder
    from ._shard_set import ShardSet
    from ._source import Source

_PAGE = mmap.PAGESIZE
_HEAD = ("__key__", "__shard__", "__index__")
_TAIL = ("__epoch__", "__seed__")


class BatchRefs:
    """Where one batch's members are. Pickles to a few kB whatever the samples' size."""

    __slots__ = ("shards", "ids", "keys", "fields", "first", "epoch", "seed")

    def __init__(self, shards: np.ndarray, ids: np.ndarray, keys: list[str],
                 fields: dict[str, tuple[np.ndarray, np.ndarray]], first: int, epoch: int,
                 seed: int) -> None:
        self.shards = shards  # int32 per sample: shard number in the manifest
        self.ids = ids  # int64 per sample: global sample id
        self.keys = keys
        self.fields = fields  # ext -> (offsets, sizes), int64 per sample; offset -1: absent
        self.first = first  # the first sample's fields are the first `first` of `fields`
        self.epoch = epoch
        self.seed = seed

    def __len__(self) -> int:
        return len(self.keys)

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)


class Columns:
    """The whole dataset's index as columns over global sample ids, for planning a batch with a
    few array gathers instead of a Python step per sample and member.

    Per field: the member's offset (``-1`` where the sample lacks it) and size; per sample: its
    key, the byte span of its members, and its fields in member order (to order a batch's
    fields as :func:`~feedpipe.stream._collate.collate_samples` does). Built from open readers
    in the training process.
    """

    def __init__(self, readers: Sequence[ShardReader]) -> None:
        indexes = [r.index for r in readers]
        n = sum(len(ix) for ix in indexes)
        # an object array, not a list: a batch's keys are one gather and one tolist in C
        self.keys = np.empty(n, dtype=object)
        self.exts: list[str] = []  # every field, in order of first appearance
        self.offsets: dict[str, np.ndarray] = {}
        self.sizes: dict[str, np.ndarray] = {}
        self.lo = np.zeros(n, dtype=np.int64)  # per sample: where its first member starts
        self.hi = np.zeros(n, dtype=np.int64)  # and where its last ends
        # per sample: which of `layouts` (its fields, in member order) it has; a batch whose
        # samples share one is planned with a gather per field and no per-sample step
        self.layout = np.zeros(n, dtype=np.int32)
        self.layouts: list[tuple[str, ...]] = []
        self._seen: dict[tuple[str, ...], int] = {}
        self._indexes = indexes
        self._base = np.cumsum([0] + [len(ix) for ix in indexes])[:-1]  # per shard: first id
        for ix, base in zip(indexes, self._base.tolist()):
            k = len(ix)
            self.keys[base:base + k] = ix.keys
            starts = np.asarray(ix.starts, dtype=np.int64)
            offs = np.asarray(ix.offsets, dtype=np.int64)
            sizes = np.asarray(ix.sizes, dtype=np.int64)
            counts = np.diff(starts)
            row = _uniform(ix, counts)
            if row is not None:  # every sample has these members, in this order: strided
                c = len(row)
                for p, e in enumerate(row):
                    self._column(e, n)
                    self.offsets[e][base:base + k] = offs[p::c]
                    self.sizes[e][base:base + k] = sizes[p::c]
                self.layout[base:base + k] = self._number(row)
            else:
                sample = np.repeat(np.arange(base, base + k, dtype=np.int64), counts)
                exts = np.asarray(ix.exts, dtype=str)
                for e in dict.fromkeys(ix.exts):
                    self._column(e, n)
                    mask = exts == e
                    self.offsets[e][sample[mask]] = offs[mask]
                    self.sizes[e][sample[mask]] = sizes[mask]
                ex, st = ix.exts, ix.starts
                self.layout[base:base + k] = [
                    self._number(tuple(dict.fromkeys(ex[st[i]:st[i + 1]]))) for i in range(k)]
            has = counts > 0
            if len(offs):
                self.lo[base:base + k][has] = offs[starts[:-1][has]]
                last = starts[1:][has] - 1
                self.hi[base:base + k][has] = offs[last] + sizes[last]

    def _column(self, e: str, n: int) -> None:
        if e not in self.offsets:
            self.exts.append(e)
            self.offsets[e] = np.full(n, -1, dtype=np.int64)
            self.sizes[e] = np.zeros(n, dtype=np.int64)

    def _number(self, fields: tuple[str, ...]) -> int:
        """The number of the layout ``fields`` in :attr:`layouts` (appended when new)."""
        at = self._seen.get(fields)
        if at is None:
            at = self._seen[fields] = len(self.layouts)
            self.layouts.append(fields)
        return at

    def fields_of(self, g: int) -> list[str]:
        """Sample ``g``'s fields, in member order."""
        s = int(np.searchsorted(self._base, g, side="right")) - 1
        ix, i = self._indexes[s], g - int(self._base[s])
        return list(dict.fromkeys(ix.exts[ix.starts[i]:ix.starts[i + 1]]))

    def refs(self, ids: np.ndarray, shards: np.ndarray, epoch: int, seed: int) -> BatchRefs:
        """The :class:`BatchRefs` of one batch of ids (in shards ``shards``)."""
        keys: list[str] = self.keys[ids].tolist()
        lay = self.layout[ids]
        if len(ids) and not (lay != lay[0]).any():  # one layout: each of its fields in all
            fs = self.layouts[int(lay[0])]
            return BatchRefs(shards.astype(np.int32), ids, keys,
                             {e: (self.offsets[e][ids], self.sizes[e][ids]) for e in fs},
                             len(fs), epoch, seed)
        present: list[tuple[int, int, str]] = []  # (first sample with it, rank in it, ext)
        got: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        firsts = self.fields_of(int(ids[0])) if len(ids) else []
        for e in self.exts:
            o = self.offsets[e][ids]
            have = o >= 0
            if not have.any():
                continue
            got[e] = (o, self.sizes[e][ids])
            if e not in firsts:
                j = int(have.argmax())
                present.append((j, self.fields_of(int(ids[j])).index(e), e))
        order = [*firsts, *(e for _, _, e in sorted(present))]
        return BatchRefs(shards.astype(np.int32), ids, keys, {e: got[e] for e in order},
                         len(firsts), epoch, seed)


class RefFetch:
    """fetch=refs: the :class:`BatchRefs` of a batch of ids, planned from ``columns`` when given
    (every shard open here), else sample by sample from the shards' indexes; the batch's byte
    ranges advised to the kernel (``advise``) so that they are read ahead of the copy."""

    def __init__(self, shards: ShardSet, epoch: int, seed: int, *,
                 columns: Columns | None = None, advise: bool = True) -> None:
        self.shards, self.epoch, self.seed = shards, epoch, seed
        self.columns, self.advise = columns, advise

    def __call__(self, ids: np.ndarray) -> BatchRefs:
        shards = self.shards
        s_of, i_of = shards.locate(ids)
        cols = self.columns
        if cols is not None:
            refs = cols.refs(ids, s_of, self.epoch, self.seed)
            if self.advise:
                # a shard whose map is populated has every page in: nothing to read ahead
                cold = [s for s in _shards_of(s_of) if not shards.reader(s).populated]
                if cold:
                    lo, hi = cols.lo[ids], cols.hi[ids]
                    for s in cold:
                        sel = s_of == s
                        shards.reader(s).advise(list(zip(lo[sel].tolist(), hi[sel].tolist())))
            return refs
        n = len(ids)
        keys: list[str] = [""] * n
        offsets: dict[str, list[int]] = {}
        sizes: dict[str, list[int]] = {}
        spans: dict[int, list[tuple[int, int]]] = {}
        first = 0
        for j, (s, i) in enumerate(zip(s_of.tolist(), i_of.tolist())):
            ix = shards.reader(s).index
            a, b = ix.starts[i], ix.starts[i + 1]
            keys[j] = ix.keys[i]
            exts, offs, szs = ix.exts, ix.offsets, ix.sizes
            for m in range(a, b):
                e = exts[m]
                col = offsets.get(e)
                if col is None:
                    col = offsets[e] = [-1] * n
                    sizes[e] = [0] * n
                col[j] = offs[m]
                sizes[e][j] = szs[m]
            if j == 0:
                first = len(offsets)
            if self.advise and b > a:
                spans.setdefault(s, []).append((offs[a], offs[b - 1] + szs[b - 1]))
        for s, ranges in spans.items():
            shards.reader(s).advise(ranges)
        fields = {e: (np.array(offsets[e], dtype=np.int64), np.array(sizes[e], dtype=np.int64))
                  for e in offsets}
        return BatchRefs(s_of.astype(np.int32), ids, keys, fields, first, self.epoch, self.seed)


class Resolver:
    """sink=resolve: turns :class:`BatchRefs` into batches, copying members out of this
    process's maps of the shards (the dataset's :class:`~feedpipe.ShardSet`).

    Args:
        dataset: the dataset the references point into.
        pin_memory: pin the batch's tensors (when CUDA is available), as the DataLoader's
            ``pin_memory=True`` would.
    """

    def __init__(self, dataset: Source, *, pin_memory: bool = False) -> None:
        self.shards = dataset.shards
        self.root = dataset.url
        self.names = list(self.shards.names)
        self.fields = list(dataset.manifest.fields)
        self.decode: dict[str, Decoder] = dict(dataset.decode)
        self.pin = bool(pin_memory and torch.cuda.is_available())
        self._bytes = np.array([r.bytes for r in dataset.manifest.shards], dtype=np.int64)
        # one rank reads every sample of every shard each epoch: whole shards are worth mapping
        self._whole = dataset.world.world_size == 1
        self._orders: dict[tuple[tuple[str, ...], int], list[str]] = {}
        self._populate = hasattr(mmap.mmap, "madvise")
        # a Mixture's batches say each sample's source, as its samples do
        self._tag = dataset.tag_batch  # what the source's samples carry besides their fields

    def _map(self, r: ShardReader) -> mmap.mmap:
        mm = r.buffer
        if mm is None:
            raise ShardFormatError(f"{r.url}: the shard is empty but its index lists samples")
        if self._whole and self._populate and not r.populated:
            # this process copies every member of the shard this epoch: map all its pages in one
            # call, once; the map outlives the epoch, so later epochs fault nothing
            self._populate = r.populate()
        return mm

    def _prefault(self, refs: BatchRefs, fields: list[tuple[str, tuple[np.ndarray, np.ndarray]]],
                  maps: dict[int, mmap.mmap]) -> None:
        """Map the pages a batch copies from in one call per shard (``MADV_POPULATE_READ``)
        instead of a page fault per 64 KiB (``benchmarks/bench_read.py``). Only where the batch's
        members lie close together in a shard (sequential or shard-local order); a scattered
        batch would map far more than it reads."""
        from ..format._reader import MADV_POPULATE_READ

        offs = np.concatenate([o for _, (o, _) in fields])
        sizes = np.concatenate([z for _, (_, z) in fields])
        shards = np.tile(refs.shards, len(fields))
        keep = offs >= 0
        offs, sizes, shards = offs[keep], sizes[keep], shards[keep]
        for s, mm in maps.items():
            sel = shards == s if len(maps) > 1 else slice(None)
            o, z = offs[sel], sizes[sel]
            if not len(o):
                continue
            lo, hi = int(o.min()), int((o + z).max())
            if hi - lo > 2 * int(z.sum()) + (1 << 20):
                continue
            lo -= lo % _PAGE
            try:
                mm.madvise(MADV_POPULATE_READ, lo, hi - lo)
            except (OSError, ValueError):  # kernels before 5.14: page faults do it, slower
                self._populate = False
                return

    def start(self, refs: BatchRefs, pool: Any = None) -> BatchRefs:
        return refs

    def finish(self, refs: BatchRefs) -> dict[str, Any]:
        return self(refs)

    def __call__(self, refs: BatchRefs) -> dict[str, Any]:
        used = _shards_of(refs.shards)
        with self.shards.hold(used):
            return self._resolve(refs, used)

    def _resolve(self, refs: BatchRefs, used: list[int]) -> dict[str, Any]:
        n = len(refs)
        readers = {s: self.shards.reader(s, index=False) for s in used}
        maps = {s: self._map(r) for s, r in readers.items()}  # opened (and checked) once
        for r in readers.values():  # a truncation since opening: an error, not a SIGBUS
            r.check()
        fields = list(refs.fields.items())
        order = self._order_of(refs, fields)
        if self._populate and not all(r.populated for r in readers.values()):
            self._prefault(refs, fields, maps)
        # the common batch from one shard: its maps, names and sizes looked up once, not once
        # a sample; from several, looked up in C loops (map), not Python ones
        one = maps[used[0]] if len(used) == 1 else None
        shards: list[int] | None = None if one is not None else refs.shards.tolist()
        per_sample: list[mmap.mmap] | None = None
        limit = self._bytes[used[0]] if one is not None else self._bytes[refs.shards]
        cols: dict[str, Any] = {}
        for e, (offs, sizes) in fields:
            ends = offs + sizes
            every = bool(n) and int(offs.min()) >= 0
            past = ends > limit
            if past.any() and (every or (past & (offs >= 0)).any()):
                j = int(np.flatnonzero(past & (offs >= 0))[0])
                raise ShardFormatError(
                    f"{self.shards.url(int(refs.shards[j]))}: truncated: member "
                    f"{refs.keys[j]}.{e} at offset {int(offs[j])} runs past the end of the file")
            # copies out of the maps in C loops (map/slice), the common single-shard batch and
            # every-sample-has-it field without a Python-level step per sample
            if every and not (sizes != sizes[0]).any():  # one size: numpy's gather
                size = int(sizes[0])
                if one is not None:
                    cols[e] = _gather(one, offs, size)
                else:
                    cols[e] = _gather_shards(maps, used, refs.shards, offs, size)
            elif every:
                spans = map(slice, offs.tolist(), ends.tolist())
                if one is not None:
                    cols[e] = list(map(one.__getitem__, spans))
                else:
                    if per_sample is None:
                        per_sample = list(map(maps.__getitem__, shards or ()))
                    cols[e] = list(map(getitem, per_sample, spans))  # type: ignore[arg-type]
            else:
                col: list[Any] = [None] * n
                for j in np.flatnonzero(offs >= 0).tolist():
                    col[j] = maps[int(refs.shards[j])][int(offs[j]):int(ends[j])]
                cols[e] = col
        for e, fn in self.decode.items():
            if e in cols:
                cols[e] = column([None if v is None else self._decoded(fn, v, refs, j, e)
                                  for j, v in enumerate(cols[e])])
        return self._batch(refs, order, cols, used, shards)

    def _batch(self, refs: BatchRefs, order: list[str], cols: dict[str, Any], used: list[int],
               shards: list[int] | None) -> dict[str, Any]:
        """The batch's dict in ``order``: the fields' columns ``cols`` and the samples'
        ``__key__``, ``__shard__`` (``shards``: each sample's, ``None`` where all are
        ``used[0]``), ``__index__``, ``__epoch__`` and ``__seed__``, as the source tags them."""
        n, names = len(refs), self.names
        ids = torch.from_numpy(refs.ids)
        out: dict[str, Any] = {}
        for k in order:
            if k == "__key__":
                out[k] = refs.keys
            elif k == "__shard__":
                out[k] = [names[used[0]]] * n if shards is None else list(
                    map(names.__getitem__, shards))
            elif k == "__index__":
                out[k] = ids
            elif k == "__epoch__":
                out[k] = torch.full((n,), refs.epoch, dtype=torch.int64)
            elif k == "__seed__":
                out[k] = torch.full((n,), refs.seed, dtype=torch.int64)
            else:
                out[k] = cols.get(k, [None] * n)
        self._tag(out, refs.shards)
        if self.pin:
            for k, v in out.items():
                if isinstance(v, torch.Tensor):
                    out[k] = v.pin_memory()
        return out

    def _order_of(self, refs: BatchRefs, fields: list[Any]) -> list[str]:
        """A batch's keys, in the order the other routes give them, then the manifest's fields
        the batch lacks (one list per layout of fields: most batches share one)."""
        key = (tuple(refs.fields), refs.first)
        order = self._orders.get(key)
        if order is None:
            order = [*_HEAD, *(e for e, _ in fields[: refs.first]), *_TAIL,
                     *(e for e, _ in fields[refs.first:])]
            order += [f for f in self.fields if f not in refs.fields]
            self._orders[key] = order
        return order

    def _decoded(self, fn: Decoder, v: bytes, refs: BatchRefs, j: int, e: str) -> Any:
        try:
            return fn(v)
        except Exception as err:
            from ..errors import DecodeError

            raise DecodeError(f"sample {refs.keys[j]!r} of {self.names[int(refs.shards[j])]!r}: "
                              f"field {e!r} does not decode with {fn!r}: {err}") from err


def _shards_of(shards: np.ndarray) -> list[int]:
    """The distinct shard numbers of a batch, in order of first appearance (one comparison
    over the batch when it comes from one shard, as most do)."""
    if not len(shards):
        return []
    s0 = shards[0]
    if not (shards != s0).any():
        return [int(s0)]
    return list(dict.fromkeys(shards.tolist()))


def _uniform(ix: Any, counts: np.ndarray) -> tuple[str, ...] | None:
    """The fields of every sample of one shard's index ``ix`` (``counts``: its members per
    sample), when all have the same members in the same order, each field once; else None.
    Checked with C-level list and array comparisons, not a step per sample."""
    k = len(counts)
    c = int(counts[0]) if k else 0
    if not c or (counts != c).any():
        return None
    row = tuple(ix.exts[:c])
    if len(set(row)) != c or ix.exts != list(row) * k:
        return None
    return row


def _gather(mm: mmap.mmap, offs: np.ndarray, size: int) -> list[bytes]:
    """The ``size`` bytes at each of ``offs`` in ``mm``, as ``bytes``: one NumPy gather into a
    fresh array and one ``tolist`` make them in C loops, about half the cost of slicing the
    map once a member for small members (``benchmarks/bench_tiny_read.py``). The map is
    viewed as overlapping ``size``-byte items, one starting at every byte; the view is let go
    before returning, so the map stays closable."""
    if size == 0:
        return [b""] * len(offs)
    view: np.ndarray = np.ndarray((len(mm) - size + 1,), dtype=np.dtype((np.void, size)),
                                  buffer=mm, strides=(1,))
    try:
        return view[offs].tolist()
    finally:
        del view


def _gather_shards(maps: dict[int, mmap.mmap], used: list[int], shards: np.ndarray,
                   offs: np.ndarray, size: int) -> list[bytes]:
    """:func:`_gather` for a batch from several shards: one gather per shard, then the
    members put back in the batch's order (a C-level ``map``)."""
    got: list[bytes] = []
    where = []
    for s in used:
        sel = np.flatnonzero(shards == s)
        got.extend(_gather(maps[s], offs[sel], size))
        where.append(sel)
    pos = np.empty(len(offs), dtype=np.int64)
    pos[np.concatenate(where)] = np.arange(len(offs))
    return list(map(got.__getitem__, pos.tolist()))
