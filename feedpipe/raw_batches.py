"""Raw batches built from the shard index, by reference.

With no transform and the default collation, a batch of raw samples is fully described by where
its members lie in the shards. Building the batch from that description skips what the general
path pays per sample: a dict and a ``memoryview`` per field, collation's walk over every sample's
keys and, with DataLoader workers, a pickle of every field's bytes, a pipe and an unpickle of them
in the training process (measured: ``benchmarks/bench_read.py``, ``fp-loader-dl2``).

* :func:`batch_refs` runs where the plan is (a DataLoader worker, or this process): for each of a
  worker's planned batches, a :class:`BatchRefs` holding, per sample, its shard, global id and key
  and, per field, the member's offset and size (``-1``: the sample lacks that field). A few kB for
  256 samples, whatever their size. It also asks the kernel to read the batch's byte ranges ahead
  (``MADV_WILLNEED``), so that the process that copies them seldom waits on storage: the workers'
  share of the work is planning, index lookups and I/O.
* :class:`BatchResolver` runs in the training process: it copies the members out of its own
  read-only maps of the shards into ``bytes`` and assembles the batch :func:`collate_samples
  <feedpipe.loader.collate_samples>` makes from the same samples at ``num_workers=0`` (same keys
  in the same order, same types).

When every shard fits in ``max_open_shards``, :class:`RefBatches` opens them all in the training
process once and plans there from :class:`Columns`, the index as arrays over global sample ids,
whatever ``num_workers`` is: a batch's plan is then a few array gathers, and worker processes
would add only their start-up and a pipe. The per-sample planner serves datasets with more
shards, in the workers or in-process.

Only local shards qualify (both processes must map the same file) and only uncached datasets (a
cached shard may be evicted once the worker lets go of it); :func:`eligible` decides, and
:class:`~feedpipe.loader.FeedLoader` uses this path by itself when it applies. Integrity holds as
on the general path: workers open shards through :class:`~feedpipe.reader.ShardReader` (size and
index checked), and the resolver checks each shard's size against the manifest and every member
against the end of the file, so a shard truncated in between is an error naming it and the
offset, never a short sample.
"""

from __future__ import annotations

import mmap
from operator import getitem
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .errors import ShardFormatError
from .manifest import join
from .plan import distinct, iter_ids
from .reader import MADV_POPULATE_READ, check_size, map_local
from .storage import is_local

if TYPE_CHECKING:
    from .dataset import FeedDataset

_PAGE = mmap.PAGESIZE
_GAP = 1 << 16  # byte ranges closer than this are advised as one
_HEAD = ("__key__", "__shard__", "__index__")
_TAIL = ("__epoch__", "__seed__")


def eligible(dataset: FeedDataset) -> bool:
    """Whether ``dataset``'s batches can be built by reference: local, uncached, untransformed."""
    return (dataset.transform is None and dataset.decoded is None and dataset.cache is None
            and is_local(dataset.url))


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
    fields as :func:`~feedpipe.loader.collate_samples` does). Built from open readers in the
    training process; forked workers inherit it.
    """

    def __init__(self, readers: list[Any]) -> None:
        n = sum(len(r) for r in readers)
        self.keys: list[str] = []
        self.exts: list[str] = []  # every field, in order of first appearance
        self.offsets: dict[str, np.ndarray] = {}
        self.sizes: dict[str, np.ndarray] = {}
        self.lo = np.zeros(n, dtype=np.int64)  # per sample: where its first member starts
        self.hi = np.zeros(n, dtype=np.int64)  # and where its last ends
        self._readers = readers
        self._base = np.cumsum([0] + [len(r) for r in readers])[:-1]  # per shard: first id
        for r, base in zip(readers, self._base.tolist()):
            k = len(r)
            self.keys.extend(r._keys)
            starts = np.asarray(r._starts, dtype=np.int64)
            offs = np.asarray(r._offs, dtype=np.int64)
            sizes = np.asarray(r._sizes, dtype=np.int64)
            counts = np.diff(starts)
            sample = np.repeat(np.arange(base, base + k, dtype=np.int64), counts)
            exts = np.asarray(r._exts, dtype=str)
            for e in dict.fromkeys(r._exts):
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
        r, i = self._readers[s], g - int(self._base[s])
        return list(dict.fromkeys(r._exts[r._starts[i]:r._starts[i + 1]]))


def columns(dataset: FeedDataset) -> Columns | None:
    """The dataset's :class:`Columns`, built (once) when all its shards are open here."""
    cols = dataset.__dict__.get("_columns")
    if cols is None and len(dataset._readers) == len(dataset.manifest.shards):
        cols = dataset._columns = Columns([dataset._readers[s]
                                           for s in range(len(dataset.manifest.shards))])
    return cols


def _refs_from_columns(cols: Columns, ids: np.ndarray, shards: np.ndarray, epoch: int,
                       seed: int) -> BatchRefs:
    keys = list(map(cols.keys.__getitem__, ids.tolist()))
    present: list[tuple[int, int, str]] = []  # (first sample with it, rank in that sample, ext)
    got: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    firsts = cols.fields_of(int(ids[0])) if len(ids) else []
    for e in cols.exts:
        o = cols.offsets[e][ids]
        have = o >= 0
        if not have.any():
            continue
        got[e] = (o, cols.sizes[e][ids])
        if e not in firsts:
            j = int(have.argmax())
            present.append((j, cols.fields_of(int(ids[j])).index(e), e))
    order = [*firsts, *(e for _, _, e in sorted(present))]
    return BatchRefs(shards.astype(np.int32), ids, keys, {e: got[e] for e in order},
                     len(firsts), epoch, seed)


def batch_refs(dataset: FeedDataset, worker: int, workers: int, *,
               advise: bool = True) -> Iterator[BatchRefs]:
    """The :class:`BatchRefs` of ``worker``'s batches (of ``workers``) in the current epoch,
    in the order the DataLoader deals them; the same batches as iterating the dataset itself."""
    plan, split = dataset.plan(), dataset.split()
    epoch, seed = plan.epoch, dataset.seed
    cols = dataset.__dict__.get("_columns")  # built by RefBatches before the workers start
    if cols is not None:  # gathers from the columns
        open_readers = dataset._readers
        for ids in iter_ids(plan, split, dataset.batch_size, worker, workers):
            shards, _ = plan.shard_of(ids)
            refs = _refs_from_columns(cols, ids, shards, epoch, seed)
            if advise:
                lo, hi = cols.lo[ids], cols.hi[ids]
                for s in distinct(shards)[0].tolist():
                    sel = shards == s
                    _advise(open_readers.get(s),
                            list(zip(lo[sel].tolist(), hi[sel].tolist())))
            yield refs
        return
    open_readers, get_reader = dataset._readers, dataset._reader
    for ids in iter_ids(plan, split, dataset.batch_size, worker, workers):
        shards, local = plan.shard_of(ids)
        n = len(ids)
        keys: list[str] = [""] * n
        offsets: dict[str, list[int]] = {}
        sizes: dict[str, list[int]] = {}
        spans: dict[int, list[tuple[int, int]]] = {}
        first = 0
        for j, (s, i) in enumerate(zip(shards.tolist(), local.tolist())):
            r = open_readers.get(s)
            if r is None:
                r = get_reader(s)
            a, b = r._starts[i], r._starts[i + 1]
            keys[j] = r._keys[i]
            exts, offs, szs = r._exts, r._offs, r._sizes
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
            if advise and b > a:
                spans.setdefault(s, []).append((offs[a], offs[b - 1] + szs[b - 1]))
        if advise:
            for s, ranges in spans.items():
                _advise(open_readers.get(s), ranges)
        fields = {e: (np.array(offsets[e], dtype=np.int64), np.array(sizes[e], dtype=np.int64))
                  for e in offsets}
        yield BatchRefs(shards.astype(np.int32), ids, keys, fields, first, epoch, seed)


def _advise(reader: Any, ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to read these byte ranges of a mapped shard ahead (merged when close)."""
    mm = getattr(reader, "_mm", None)
    if mm is None or getattr(reader, "_populated", False):  # mapped whole by the parent
        return
    ranges.sort()
    lo, hi = ranges[0]
    for a, b in ranges[1:]:
        if a - hi > _GAP:
            _willneed(mm, lo, hi)
            lo = a
        hi = max(hi, b)
    _willneed(mm, lo, hi)


def _willneed(mm: mmap.mmap, lo: int, hi: int) -> None:
    start = lo - lo % _PAGE
    try:
        mm.madvise(mmap.MADV_WILLNEED, start, hi - start)
    except (OSError, ValueError):  # advice only: a refusal costs speed, never correctness
        pass


class RefSource(IterableDataset):
    """The DataLoader-facing side: each worker yields its batches' :class:`BatchRefs`."""

    def __init__(self, dataset: FeedDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[BatchRefs]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return batch_refs(self.dataset, worker, workers)


class BatchResolver:
    """Turns :class:`BatchRefs` into batches, copying members out of this process's own maps.

    Args:
        dataset: the dataset the references point into (its manifest names and sizes the shards).
        pin_memory: pin the batch's tensors (when CUDA is available), as the DataLoader's
            ``pin_memory=True`` would.
        readers: open readers (shard -> ShardReader) whose maps to copy from instead of
            mapping the shard again; they must stay open while this resolver is used.
    """

    def __init__(self, dataset: FeedDataset, *, pin_memory: bool = False,
                 readers: dict[int, Any] | None = None) -> None:
        self.root = dataset.url
        self.shards = dataset.manifest.shards
        self.names = [r.name for r in self.shards]
        self.max_open = dataset.max_open_shards
        self.pin = bool(pin_memory and torch.cuda.is_available())
        self._bytes = np.array([r.bytes for r in self.shards], dtype=np.int64)
        self._maps: OrderedDict[int, mmap.mmap] = OrderedDict()
        self._readers = readers if readers is not None else {}
        # one rank reads every sample of every shard each epoch: whole shards are worth mapping
        self._whole = dataset.world.world_size == 1
        self._populate = hasattr(mmap.mmap, "madvise")

    def _map(self, s: int) -> mmap.mmap:
        mm = self._maps.get(s)
        if mm is not None:
            self._maps.move_to_end(s)
            return mm
        r = self._readers.get(s)
        if r is not None and r._mm is not None:  # opened and size-checked by the reader
            if self._whole and self._populate and not r._populated:
                # this process copies every member of the shard this epoch: map all its pages
                # in one call, once; the map outlives the epoch, so later epochs fault nothing
                # (and the workers forked from here skip their read-ahead advice)
                try:
                    r._mm.madvise(MADV_POPULATE_READ, 0, len(r._mm))
                    r._populated = True
                except (OSError, ValueError):
                    self._populate = False
            return r._mm
        rec = self.shards[s]
        url = join(self.root, rec.name)
        mm, size = map_local(url)
        check_size(url, size, rec.bytes)
        if mm is None:
            raise ShardFormatError(f"{url}: the shard is empty but its index lists samples")
        self._maps[s] = mm
        return mm

    def _prefault(self, refs: BatchRefs, fields: list[tuple[str, tuple[np.ndarray, np.ndarray]]],
                  maps: dict[int, mmap.mmap]) -> None:
        """Map the pages a batch copies from in one call per shard (``MADV_POPULATE_READ``)
        instead of a page fault per 64 KiB: copying 20,000 16 KB JPEGs out of fresh maps took
        0.15 s instead of 0.25 s. Only where the batch's members lie close together in a shard
        (sequential or shard-local order); a scattered batch would map far more than it reads."""
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

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()

    def __call__(self, refs: BatchRefs) -> dict[str, Any]:
        n = len(refs)
        shards = refs.shards.tolist()
        names = self.names
        maps = {s: self._map(s) for s in dict.fromkeys(shards)}  # opened (and checked) once
        while len(self._maps) > max(self.max_open, len(maps)):  # least recently used first
            self._maps.popitem(last=False)[1].close()
        limit = self._bytes[refs.shards]
        fields = list(refs.fields.items())
        order = ([*_HEAD, *(e for e, _ in fields[: refs.first]), *_TAIL,
                  *(e for e, _ in fields[refs.first:])])
        if self._populate and not all(
                getattr(self._readers.get(s), "_populated", False) for s in maps):
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
                    f"{join(self.root, names[shards[j]])}: truncated: member {refs.keys[j]}.{e} "
                    f"at offset {int(offs[j])} runs past the end of the file")
            # copies out of the maps in C loops (map/slice), the common single-shard batch and
            # every-sample-has-it field without a Python-level step per sample
            if present.all():
                spans = map(slice, offs.tolist(), ends.tolist())
                if one is not None:
                    cols[e] = list(map(one.__getitem__, spans))
                else:
                    cols[e] = list(map(getitem, per_sample, spans))
            else:
                col: list[Any] = [None] * n
                for j in np.flatnonzero(present).tolist():
                    col[j] = maps[shards[j]][int(offs[j]):int(ends[j])]
                cols[e] = col
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
                out[k] = cols[k]
        if self.pin:
            for k, v in out.items():
                if isinstance(v, torch.Tensor):
                    out[k] = v.pin_memory()
        return out


def _ahead(refs: Iterator[BatchRefs], n: int) -> Iterator[BatchRefs]:
    """``refs`` planned (and their read-ahead advised) ``n`` batches before they are used."""
    queue: deque[BatchRefs] = deque()
    for r in refs:
        queue.append(r)
        if len(queue) > n:
            yield queue.popleft()
    while queue:
        yield queue.popleft()


class RefBatches:
    """Batches by reference. When the dataset's shards all fit in ``max_open_shards`` they are
    opened here once and every batch is planned here from :class:`Columns` (a few array gathers
    per batch: worker processes would add only their start-up and a pipe), read-ahead advised
    ``ahead`` batches in advance. Otherwise ``loader``'s workers plan (a DataLoader over a
    :class:`RefSource`) or, with ``loader=None``, this process does, sample by sample."""

    def __init__(self, dataset: FeedDataset, loader: Any = None, *,
                 pin_memory: bool = False) -> None:
        self.dataset, self.loader, self.pin_memory = dataset, loader, pin_memory

    def __iter__(self) -> Iterator[dict[str, Any]]:
        ds = self.dataset
        opened = ds._open_all()  # the resolver copies from these readers' maps, which stay
        resolve = BatchResolver(ds, pin_memory=self.pin_memory,  # mapped between epochs
                                readers=ds._readers if opened else None)
        source: Any
        if opened and columns(ds) is not None:
            ld = self.loader
            ahead = (max(1, (ld.prefetch_factor or 2) * ld.num_workers)
                     if ld is not None and ld.num_workers > 0 else 2)
            source = _ahead(batch_refs(ds, 0, 1, advise=True), ahead)
        elif self.loader is not None:
            source = self.loader
        else:
            source = batch_refs(ds, 0, 1, advise=False)
        try:
            for refs in source:
                yield resolve(refs)
        finally:
            resolve.close()
