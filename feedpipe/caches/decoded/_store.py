"""The decoded store: a node-local memmap of a deterministic transform's fixed-shape outputs.

``FeedDataset(url, transform=t, decoded_cache=ROOT)`` keeps ``t(sample)`` (e.g. a ``uint8`` CHW
image after a deterministic resize, and its label) for every sample in one record per sample.
The first epoch fills it, whichever worker or rank of the node computes a sample; later epochs
read records directly, without opening a shard or calling the transform.

**Layout** (:mod:`feedpipe.caches.decoded._files`). A store is the directory ``ROOT/<fp>``,
``fp`` the fingerprint of the transform and of the dataset: changing either selects another,
empty store, also when the transform object's state changes after the store is filled
(progressive resizing): the fingerprint is taken again at the start of every pass
(:meth:`DecodedStore.complete`), and a move to another store is logged. It holds one record
file and one file of state words, mapped shared by every process. The first sample stored fixes
the record layout; a sample of another shape or dtype is a :class:`DecodedStoreError` naming its
key.

**Concurrency and crashes.** A writer copies the record into the shared mapping, then stores its
checksum in the sample's state word (one aligned 8-byte store). A reader copies the record and
serves it only when its checksum equals the state word, else recomputes it. So a process killed
mid-write leaves its sample empty; concurrent writers of the same sample (any number of workers,
ranks, jobs) write the same bytes; a torn or damaged record (power loss, a non-deterministic
transform) is recomputed, never served. Creation takes ``create.lock``; the kernel drops the locks
of a dead process.

**Disk full.** The files are preallocated (``posix_fallocate``) when the store is created; when
that fails (``ENOSPC``, ``EDQUOT``, ``EFBIG``) the store warns once and the dataset keeps
computing without storing, so no write into a mapping can hit a full disk later.

The transform must be deterministic per sample: a random augmentation would be frozen at the draw
of the epoch that stored it. One is refused (:class:`~feedpipe.errors.UncacheableTransformError`)
when it holds a known random part or is caught drawing on the first samples a process stores
(:mod:`feedpipe.caches._randomness` says what those checks cannot see). Put augmentation after
the store (on the batch or on the device).

**What the fingerprint cannot see** (:mod:`feedpipe.caches._fingerprint`): the transform's code
and every value it holds are hashed (tensors, arrays, ``nn.Module`` parameters and buffers,
dataclass fields included). Module globals it reads, files or environment variables read at call
time, and the code of C extensions are not. When one of those changes, change a value the
fingerprint sees: a ``version`` attribute on the transform object (``t.version = 2``; on a plain
function too), or ``DecodedStore.for_transform(..., version=)``; or clear the store
(``feedpipe cache clear``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..._helpers.cache_home import cache_home
from ..._helpers.file_lock import EXCLUSIVE, SHARED, lock
from ..._redact import logger
from ...errors import DecodedStoreError, OutputError, UncacheableTransformError
from .._randomness import DrawCheck, random_part
from ._files import (
    FORMAT,
    FULL,
    VERSION,
    Mapped,
    add_recorded,
    allocate,
    checksum,
    data_files,
    map_shared,
    meta_tmp,
    publish_meta,
    read_meta,
)
from ._layout import Layout, LayoutError, flatten
from ._pool import RecordPool

if TYPE_CHECKING:
    from .._stats import TierStats

log = logger("feedpipe")


def default_decoded_dir() -> str:
    """``$XDG_CACHE_HOME/feedpipe/decoded`` (or ``~/.cache/feedpipe/decoded``)."""
    return cache_home("decoded")


@dataclass
class DecodedStats:
    """Per process: ``hits`` (served from the store), ``misses`` (computed: transform calls),
    ``fills`` (records written), ``damaged`` (records whose checksum failed, recomputed)."""

    hits: int = 0
    misses: int = 0
    fills: int = 0
    damaged: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class DecodedStore:
    """One store directory (see the module docstring) for a dataset of ``samples`` samples.

    Args:
        path: the store directory (``ROOT/<fingerprint>``; see :meth:`for_transform`).
        samples: the dataset's number of samples (sample ids are ``0 .. samples - 1``).
        dataset: a description of the dataset written to ``meta.json`` (for ``feedpipe cache``).

    Example:
        >>> import tempfile
        >>> st = DecodedStore(tempfile.mkdtemp(), samples=4)
        >>> st.get(2) is None
        True
        >>> out = st.put(2, (np.arange(3, dtype=np.uint8), 1), key="k2", shard="s.tar")
        >>> got = st.get(2); got[0].tolist(), got[1], st.filled()
        ([0, 1, 2], 1, 1)
    """

    def __init__(self, path: str | os.PathLike[str], samples: int, *,
                 dataset: dict[str, Any] | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.samples = int(samples)
        self.dataset = dataset or {}
        self._reset()

    @classmethod
    def for_transform(cls, root: str | os.PathLike[str], transform: Any,
                      manifest: Any, *, version: Any = None) -> DecodedStore:
        """The store of ``transform`` over the dataset of ``manifest`` under ``root``.

        The store follows the transform's state: :meth:`complete`, asked at the start of every
        pass, reads its fingerprint again and moves to the store of the new state when it
        changed. A transform holding a part known to draw at random is refused (here and
        then), one caught drawing on the first samples a process stores too (a transform that
        draws rarely, or by a counter or the clock, is not seen: keep augmentation after the
        store).

        Args:
            root: the directory holding the stores.
            transform: the deterministic transform whose outputs are stored.
            manifest: the dataset's manifest.
            version: any value; change it when something the fingerprint cannot see changed
                (see the module docstring).
        """
        from .._fingerprint import fingerprint

        ident = [[s.name, s.samples, s.sha256 or s.bytes] for s in manifest.shards]
        params = (FORMAT, VERSION, ident) if version is None else (FORMAT, VERSION, ident, version)
        store = cls(os.path.join(os.fspath(root), "unset"), manifest.total_samples,
                    dataset={"shards": len(ident), "samples": manifest.total_samples,
                             "transform": repr(transform)[:200]})
        store._follow = _Follow(os.fspath(root), transform, fingerprint(None, params))
        store.path = store._follow.path()
        return store

    _follow: _Follow | None = None  # the transform whose state selects the store

    def _reset(self) -> None:
        self.stats = DecodedStats()
        self._recorded = DecodedStats()
        self._pid = -1
        self._use: int | None = None
        self._maps: list[Any] = []
        self._m: Mapped | None = None
        self._disabled = False
        self._pool = RecordPool()
        self._written: np.ndarray | None = None  # records this process wrote in this pass

    def __getstate__(self) -> dict[str, Any]:  # maps and locks do not cross processes
        return {"path": self.path, "samples": self.samples, "dataset": self.dataset,
                "_follow": self._follow}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def refresh(self) -> bool:
        """Read the transform's fingerprint again; when its state changed, move to the store of
        the new state (closing this one) and return ``True``. A store made without a transform
        (the constructor) stays where it is."""
        if self._follow is None:
            return False
        path = self._follow.path()
        if path == self.path:
            return False
        if self._pid not in (-1, os.getpid()):  # inherited through fork: nothing of it is ours
            self.path = path
            return True
        stats = self.stats
        self.close()  # records this process's counters in the old store
        self.path = path
        self._reset()
        self.stats = stats  # this process's figures go on; the new store records what follows
        self._recorded = DecodedStats(**stats.as_dict())
        return True

    # -- files ---------------------------------------------------------------------------------
    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _attach(self) -> bool:
        """Open the store in this process (after a fork too); True when it has a layout."""
        if self._pid != os.getpid():
            stats, disabled = (DecodedStats(), False) if self._pid != -1 else (self.stats,
                                                                                self._disabled)
            self._reset()
            self.stats, self._disabled = stats, disabled
            self._pid = os.getpid()
        if self._m is not None:
            return True
        if self._disabled or not os.path.exists(self._p("meta.json")):
            return False
        return self._map(read_meta(self.path, self.samples))

    def _mark_in_use(self) -> None:
        if self._use is None:
            self._use = lock(self._p("use.lock"), SHARED)

    def _map(self, layout: Layout | None) -> bool:
        if layout is None:
            return False
        data, state = data_files(self.path, layout)
        try:
            if (os.path.getsize(data) != self.samples * layout.record
                    or os.path.getsize(state) != self.samples * 8):
                return False
            self._mark_in_use()
            maps = map_shared((data, state))
        except FileNotFoundError:
            return False
        self._maps = maps
        self._m = Mapped(layout, np.frombuffer(maps[0], dtype=np.uint8).reshape(
            self.samples, layout.record), np.frombuffer(maps[1], dtype=np.uint64))
        return True

    def _create(self, layout: Layout) -> None:
        """Make the store's files for ``layout`` (or adopt the ones another process made)."""
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = cast(int, lock(self._p("create.lock"), EXCLUSIVE))
        except OSError as e:
            if e.errno in FULL:
                return self._degrade(e)
            raise OutputError(e.errno, f"{self.path}: cannot create the decoded store "
                                       f"({e.strerror}); pass decoded_cache= a writable "
                                       "directory") from e
        try:
            if self._map(read_meta(self.path, self.samples)):
                return None
            data, state = data_files(self.path, layout)
            try:
                for name, size in ((data, self.samples * layout.record),
                                   (state, self.samples * 8)):
                    allocate(name, size)
                publish_meta(self.path, self.samples, layout, self.dataset)
            except OSError as e:
                for name in (data, state, meta_tmp(self.path)):
                    if os.path.exists(name):
                        os.unlink(name)
                if e.errno in FULL:
                    return self._degrade(e)
                raise OutputError(e.errno, f"{self.path}: cannot write the decoded store "
                                           f"({e.strerror})") from e
            self._map(layout)
        finally:
            os.close(fd)
        return None

    def _degrade(self, error: OSError) -> None:
        self._disabled = True
        warnings.warn(
            f"{self.path}: no room for the decoded store ({error.strerror}); samples are "
            "computed every epoch instead of stored. Free space there or point decoded_cache= "
            "elsewhere.", RuntimeWarning, stacklevel=4)

    # -- samples -------------------------------------------------------------------------------
    def get(self, index: int) -> Any:
        """The stored output of sample ``index``, or ``None`` (not stored yet, or damaged)."""
        m = self._m if self._pid == os.getpid() else None
        if m is None:
            m = self._m if self._attach() else None
            if m is None:
                self.stats.misses += 1
                return None
        check = int(m.state[index])
        if check == 0:
            self.stats.misses += 1
            return None
        # served from the copy the checksum is taken of, into a recycled buffer
        rec = self._pool.copy_of(m.records[index])
        if checksum(rec) != check:
            self.stats.damaged += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return m.layout.unpack(rec)

    def put(self, index: int, out: Any, *, key: str, shard: str, sample: Any = None) -> Any:
        """Store the output of sample ``index`` (key and shard name errors); returns the output
        as a hit returns it (same types, copies of the arrays). ``sample``: the transform's
        input, run through it again on the first samples a process stores, to catch a
        transform that draws at random."""
        where = f"sample {key!r} of {shard!r}"
        if sample is not None and self._follow is not None:
            self._follow.draws.check(self._follow.transform, sample, out)
        try:
            tree, leaves = flatten(out)
        except LayoutError as e:
            raise DecodedStoreError(f"{where}: the transform's {e}; decoded_cache= cannot keep "
                                    "it (drop decoded_cache=, or return arrays)") from e
        m = self._m if self._pid == os.getpid() else None
        if m is None:
            if not self._attach() and not self._disabled:
                self._create(Layout.of(tree, leaves))
            m = self._m
            if m is None:  # no room: disabled
                return out
        problem = m.layout.mismatch(tree, leaves)
        if problem is not None:
            raise DecodedStoreError(
                f"{where}: the transform returned {problem} (fixed by the first sample stored in "
                f"{self.path}). The decoded store needs one fixed shape and dtype for every "
                "sample: resize or crop to a fixed size in the transform. If the transform "
                f"itself changed, clear the store: feedpipe cache clear {self.path}")
        rec = m.records[index]
        m.layout.pack(rec, leaves)
        m.state[index] = checksum(rec)  # the commit point: after the whole record
        self.stats.fills += 1
        if self._written is None:
            self._written = np.zeros(self.samples, dtype=bool)
        self._written[index] = True
        return m.layout.unpack(rec.copy())

    def layout(self) -> Layout | None:
        """The record layout, once a first output fixed it (``None`` before)."""
        return self._m.layout if self._attach() and self._m is not None else None

    def gather(self, ids: np.ndarray, head: np.ndarray, tail: np.ndarray) -> np.ndarray:
        """Copy the records of samples ``ids``, each split at ``h = head.shape[1]`` bytes, into
        rows of ``head`` (bytes ``[0, h)``) and ``tail`` (the rest), and return the positions
        whose record must be recomputed: never stored, or the checksum of the copied bytes fails
        (counted as :meth:`get` counts them). The state words are read before the records, as
        :meth:`get` reads them. Call :meth:`layout` first.

        The split lets a caller copy an image straight into its batch buffer and the small rest
        (a label) aside, and still check exactly the bytes it serves."""
        m = self._m
        if m is None:
            raise RuntimeError("gather() before the store is open here: call layout() first")
        checks = m.state[ids].tolist()  # a copy, taken before the records
        records, h = m.records, head.shape[1]
        bad = []
        for j, (g, c) in enumerate(zip(ids.tolist(), checks)):
            rec = records[g]
            np.copyto(head[j], rec[:h])  # row by row: np.take copies byte by byte
            np.copyto(tail[j], rec[h:])
            if c == 0 or checksum(head[j], tail[j]) != c:
                bad.append(j)
        damaged = sum(1 for j in bad if checks[j] != 0)
        self.stats.hits += len(checks) - len(bad)
        self.stats.misses += len(bad)
        self.stats.damaged += damaged
        return np.asarray(bad, dtype=np.intp)

    def filled(self) -> int:
        """Samples stored (checksums present; damage shows only when a record is read)."""
        if not self._attach():
            return 0
        return int(np.count_nonzero(self._m.state)) if self._m is not None else 0

    def tier_stats(self) -> TierStats:
        """This process's hits and misses, the samples stored and the store's bytes on disk, in
        the shape every cache tier reports (the fields :func:`~feedpipe.cache_stats` lists)."""
        from .._stats import DECODED, TierStats

        size = 0
        if os.path.isdir(self.path):
            for name in os.listdir(self.path):
                try:
                    size += os.stat(self._p(name)).st_blocks * 512
                except FileNotFoundError:
                    pass
        return TierStats(DECODED, self.stats.hits, self.stats.misses, size, self.filled())

    def complete(self) -> bool:
        """Every sample is stored: an epoch needs no shard. Asked at the start of every pass, so
        it first follows the transform's state (:meth:`refresh`)."""
        self.refresh()
        return self.filled() == self.samples

    # -- counters ------------------------------------------------------------------------------
    def end_pass(self) -> None:
        """The end of a pass in this process: when the transform's state changed *during* the
        pass, the records this process wrote in it may hold the new state's outputs under the
        old state's name: they are emptied (recomputed when next read), with a warning. Then
        the counters are recorded (:meth:`record`)."""
        written, self._written = self._written, None
        if (written is not None and self._follow is not None and self._m is not None
                and self._pid == os.getpid() and self._changed()):
            self._m.state[written] = 0
            log.warning(
                "feedpipe: decoded_cache=: the transform's state changed during a pass; the %d "
                "records this process stored in it were emptied in %s (they may hold outputs "
                "of the new state) and will be recomputed. Change a transform between epochs.",
                int(np.count_nonzero(written)), self.path)
        self.record()

    def _changed(self) -> bool:
        try:
            return self._follow is not None and self._follow.path() != self.path
        except UncacheableTransformError:  # refused at the next pass; its records are suspect
            return True

    def record(self) -> None:
        """Add this process's counters since the last call to ``stats.json`` (for
        ``feedpipe cache stats``; a store that was never created records nothing)."""
        delta = {k: v - getattr(self._recorded, k) for k, v in self.stats.as_dict().items()}
        if not any(delta.values()) or not os.path.exists(self._p("meta.json")):
            return
        try:
            fd = cast(int, lock(self._p("create.lock"), EXCLUSIVE))
        except OSError:
            return
        try:
            add_recorded(self.path, delta)
            self._recorded = DecodedStats(**self.stats.as_dict())
        except OSError:
            pass  # counters are a courtesy: never fail a training run over them
        finally:
            os.close(fd)

    def close(self) -> None:
        """Record the counters and release this process's maps and in-use lock."""
        self.record()
        self._m = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a served array still views it: leave it to the GC
                pass
        self._maps = []
        if self._use is not None and self._pid == os.getpid():
            os.close(self._use)
        self._use = None


class _Follow:
    """The transform of a store and the fingerprint of the rest (format, dataset, version): the
    path of the store of the transform's state now, refusing a transform that draws."""

    def __init__(self, root: str, transform: Any, rest: bytes) -> None:
        self.root, self.transform, self.rest = root, transform, rest
        self.draws = DrawCheck("decoded_cache=")
        self._fp: str | None = None

    def path(self) -> str:
        from .._fingerprint import fingerprint

        fp = fingerprint(self.transform, self.rest).hex()[:24]
        if fp != self._fp:
            found = random_part(self.transform)
            if found is not None:
                raise UncacheableTransformError(
                    f"decoded_cache= with a random transform: {found} would have its random "
                    "crops and flips frozen at the first epoch's draw; cache a deterministic "
                    "one (train=False) and augment after it")
            if self._fp is not None:
                log.warning(
                    "feedpipe: decoded_cache=: the transform's state changed since its store was "
                    "chosen; its outputs now go to %s (the old state's store stays in %s until "
                    "`feedpipe cache clear`). A transform whose attributes change at every pass "
                    "(a counter, a cache) gets a new store each time: give its class a "
                    "__fingerprint__() method returning only what decides its outputs.",
                    fp, self.root)
            self._fp = fp
            self.draws.rearm()
        return os.path.join(self.root, fp)


def open_decoded_store(decoded_cache: Any, transform: Any, manifest: Any) -> DecodedStore | None:
    """The store of ``FeedDataset(decoded_cache=..., transform=...)``: ``None``/``False``: none;
    ``True``/``"auto"``: under :func:`default_decoded_dir`; else under the given directory."""
    if decoded_cache is None or decoded_cache is False:
        return None
    if transform is None:
        raise ValueError("decoded_cache= stores the transform's outputs: give a transform= too")
    root = default_decoded_dir() if decoded_cache is True or decoded_cache == "auto" \
        else decoded_cache
    return DecodedStore.for_transform(root, transform, manifest)
