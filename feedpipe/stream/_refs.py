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
    from ._dataset import FeedDataset
    from ._shard_set import ShardSet

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
        self.keys: list[str] = []
        self.exts: list[str] = []  # every field, in order of first appearance
        self.offsets: dict[str, np.ndarray] = {}
        self.sizes: dict[str, np.ndarray] = {}
        self.lo = np.zeros(n, dtype=np.int64)  # per sample: where its first member starts
        self.hi = np.zeros(n, dtype=np.int64)  # and where its last ends
        self._indexes = indexes
        self._base = np.cumsum([0] + [len(ix) for ix in indexes])[:-1]  # per shard: first id
        for ix, base in zip(indexes, self._base.tolist()):
            k = len(ix)
            self.keys.extend(ix.keys)
            starts = np.asarray(ix.starts, dtype=np.int64)
            offs = np.asarray(ix.offsets, dtype=np.int64)
            sizes = np.asarray(ix.sizes, dtype=np.int64)
            counts = np.diff(starts)
            sample = np.repeat(np.arange(base, base + k, dtype=np.int64), counts)
            exts = np.asarray(ix.exts, dtype=str)
            for e in dict.fromkeys(ix.exts):
                if e not in self.offsets:
                    self.exts.append(e)
                    self.offsets[e] = np.full(n, -1, dtype=np.int64)
                    self.sizes[e] = np.zeros(n, dtype=np.int64)
                mask = exts == e
                self.offsets[e][sample[mask]] = offs[mask]
                self.sizes[e][sample[mask]] = sizes[mask]
            has = counts > 0
            if len(offs):
                self.lo[base:base + k][has] = offs[starts[:-1][has]]
                last = starts[1:][has] - 1
                self.hi[base:base + k][has] = offs[last] + sizes[last]

    def fields_of(self, g: int) -> list[str]:
        """Sample ``g``'s fields, in member order."""
        s = int(np.searchsorted(self._base, g, side="right")) - 1
        ix, i = self._indexes[s], g - int(self._base[s])
        return list(dict.fromkeys(ix.exts[ix.starts[i]:ix.starts[i + 1]]))

    def refs(self, ids: np.ndarray, shards: np.ndarray, epoch: int, seed: int) -> BatchRefs:
        """The :class:`BatchRefs` of one batch of ids (in shards ``shards``)."""
        keys = list(map(self.keys.__getitem__, ids.tolist()))
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
                lo, hi = cols.lo[ids], cols.hi[ids]
                for s in dict.fromkeys(s_of.tolist()):
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

    def __init__(self, dataset: FeedDataset, *, pin_memory: bool = False) -> None:
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
        self._tag = getattr(dataset, "tag_batch", None)

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
        shards = refs.shards.tolist()
        used = dict.fromkeys(shards)
        with self.shards.hold(used):
            return self._resolve(refs, shards, used)

    def _resolve(self, refs: BatchRefs, shards: list[int],
                 used: dict[int, None]) -> dict[str, Any]:
        n = len(refs)
        names = self.names
        readers = {s: self.shards.reader(s, index=False) for s in used}
        maps = {s: self._map(r) for s, r in readers.items()}  # opened (and checked) once
        for r in readers.values():  # a truncation since opening: an error, not a SIGBUS
            r.check()
        limit = self._bytes[refs.shards]
        fields = list(refs.fields.items())
        order = self._order_of(refs, fields)
        if self._populate and not all(r.populated for r in readers.values()):
            self._prefault(refs, fields, maps)
        one = maps[shards[0]] if len(maps) == 1 else None
        per_sample = None if one is not None else [maps[s] for s in shards]
        cols: dict[str, Any] = {}
        for e, (offs, sizes) in fields:
            ends = offs + sizes
            present = offs >= 0
            bad = np.flatnonzero(present & (ends > limit))
            if len(bad):
                j = int(bad[0])
                raise ShardFormatError(
                    f"{self.shards.url(shards[j])}: truncated: member {refs.keys[j]}.{e} "
                    f"at offset {int(offs[j])} runs past the end of the file")
            # copies out of the maps in C loops (map/slice), the common single-shard batch and
            # every-sample-has-it field without a Python-level step per sample
            if present.all():
                spans = map(slice, offs.tolist(), ends.tolist())
                if one is not None:
                    cols[e] = list(map(one.__getitem__, spans))
                else:
                    cols[e] = list(map(getitem, per_sample, spans))  # type: ignore[arg-type]
            else:
                col: list[Any] = [None] * n
                for j in np.flatnonzero(present).tolist():
                    col[j] = maps[shards[j]][int(offs[j]):int(ends[j])]
                cols[e] = col
        for e, fn in self.decode.items():
            if e in cols:
                cols[e] = column([None if v is None else self._decoded(fn, v, refs, j, e)
                                  for j, v in enumerate(cols[e])])
        ids = torch.from_numpy(refs.ids)
        out: dict[str, Any] = {}
        for k in order:
            if k == "__key__":
                out[k] = refs.keys
            elif k == "__shard__":
                out[k] = [names[s] for s in shards]
            elif k == "__index__":
                out[k] = ids
            elif k == "__epoch__":
                out[k] = torch.full((n,), refs.epoch, dtype=torch.int64)
            elif k == "__seed__":
                out[k] = torch.full((n,), refs.seed, dtype=torch.int64)
            else:
                out[k] = cols.get(k, [None] * n)
        if self._tag is not None:
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
