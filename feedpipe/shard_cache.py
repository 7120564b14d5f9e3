"""The L1 file tier: shards fetched once per node into a local directory, read from there with mmap.

**Layout.** Everything is derivable from the directory; there is no index file a crash could
corrupt. An entry is named after the shard's content (its manifest sha256) and file name, so two
datasets holding the same shard share it and a changed shard never matches a stale entry::

    <key>.tar   the shard   (the commit point: an entry exists once this name exists)
    <key>.idx   its index   (when the source has one)
    <key>.lock  the entry's lock file (empty)
    <key>.tar.part, <key>.idx.part   a download under way (or left by a killed process)

**Locks** (``fcntl.flock`` on ``<key>.lock``; the kernel drops the locks of a dead process, so a
crash never leaves a lock that blocks the next run):

- a reader holds ``LOCK_SH`` while it maps the shard: the entry is *in use*;
- a filler holds ``LOCK_EX`` while it downloads: readers of that shard wait for it (one download
  per shard and node), other fillers skip it;
- eviction takes ``LOCK_EX | LOCK_NB`` and skips entries it cannot lock: in-use entries stay.

Fills write ``.part`` files, check size and sha256 against the manifest, ``fsync`` and rename:
readers never see a partial file. A verified entry carries a *stamp* in its mtime (a value derived
from its key); writing to the file afterwards changes the mtime, so a damaged entry (truncated,
overwritten) is noticed on open, re-hashed, and discarded and fetched again when it is wrong.

**Budget** (``size`` bytes, apparent file sizes, ``.part`` files included). A fill first makes
room: it evicts unlocked entries, the one whose next use in the plan lies furthest ahead first
(entries the plan never uses, e.g. of other datasets, before all others), until the entries, the
downloads under way and the incoming shard fit. Entries in use cannot be evicted, so the directory
exceeds the budget only when in-use entries alone leave no room. The rule, as tested: bytes on
disk <= ``size + readers x (max_open_shards + prefetch threads) x largest entry`` at any moment
(a reader closes its oldest map before it opens the next, and releases a shard as soon as the plan
says it is done with it this epoch, so a shard being fetched for it counts among its
``max_open_shards``), and <= ``size`` once nothing is in use and :meth:`ShardCache.trim` ran (each
iterator runs it when it ends). A prefetch never evicts a shard needed sooner than the one it
fetches: under pressure it gives up and the reader fetches on demand.

**Disk full** (``ENOSPC``, ``EDQUOT``, ``EFBIG``): the partial files are removed, a warning is
given once per process, and that shard is read from the source with range reads instead.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import OutputError, ShardFormatError, SourceNotFoundError
from .file_lock import EXCLUSIVE, SHARED, Lease, lock, relock, same_file
from .index import index_path
from .manifest import ShardRecord
from .storage import filesystem, read_range

INF = float("inf")
CHUNK = 16 << 20  # bytes per ranged GET when filling
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_STAMP_BASE = 1_000_000_000  # seconds; a verified entry's mtime is this plus an even offset

Rank = Callable[[str], float]  # entry key -> next use (INF when unknown)


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/feedpipe/shards`` (or ``~/.cache/feedpipe/shards``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "feedpipe", "shards")


def entry_key(rec: ShardRecord, url: str) -> str:
    """The entry name of a shard: its content hash (else a hash of URL and size) and file name."""
    ident = rec.sha256 or hashlib.sha256(f"{url}\0{rec.bytes}".encode()).hexdigest()
    base = re.sub(r"[^A-Za-z0-9._-]", "_", rec.name.rsplit("/", 1)[-1])
    base = base[:-4] if base.endswith(".tar") else base
    return f"{ident[:20]}-{base}"


def _stamp(key: str) -> int:
    # whole, even seconds survive filesystems with coarse timestamps
    return _STAMP_BASE + 2 * int(hashlib.sha256(key.encode()).hexdigest()[:6], 16)


@dataclass
class CacheStats:
    """Per process: ``hits`` (a reader found its shard cached), ``fills`` (downloads, of which
    ``prefetched`` by background threads), ``waits`` (another thread or process held the entry),
    ``evictions``, ``refetched`` (damaged entries discarded), ``degraded`` (read uncached)."""

    hits: int = 0
    fills: int = 0
    prefetched: int = 0
    waits: int = 0
    evictions: int = 0
    refetched: int = 0
    degraded: int = 0
    bytes_fetched: int = 0


class ShardCache:
    """A node-local shard cache directory with a byte budget (see the module docstring).

    Args:
        path: the directory (created on first use; ``/dev/shm/...`` works too).
        size: the byte budget, bytes or a string like ``"20GB"`` (``None``: unbounded).
        prefetch: shards each reader fetches ahead in background threads (0: none).
        threads: download threads per reader.

    Example:
        >>> c = ShardCache("/tmp/fp-doc-cache", size=10**9)
        >>> c.usage()["bytes"] >= 0
        True
    """

    def __init__(self, path: str | os.PathLike[str], size: int | str | None = None, *,
                 prefetch: int = 2, threads: int = 2) -> None:
        from .sizes import parse_size

        self.path = os.path.abspath(os.fspath(path))
        self.size = None if size is None else parse_size(size)
        self.prefetch = prefetch
        self.threads = threads
        self.stats = CacheStats()
        self._warned = False
        self._made = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["stats"] = CacheStats()  # counters are per process
        return state

    # -- file names and locks ------------------------------------------------------------
    def _p(self, key: str, suffix: str) -> str:
        return os.path.join(self.path, key + suffix)

    def _ensure_dir(self) -> None:
        if self._made:
            return
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise OutputError(
                e.errno, f"{self.path}: cannot create the shard cache directory: {e.strerror}; "
                "pass cache_dir= a writable directory"
            ) from e
        self._made = True

    def _lock(self, key: str, mode: int, block: bool = True) -> int | None:
        return lock(self._p(key, ".lock"), mode, block, opener=self._open_lock)

    def _open_lock(self, *args: Any) -> int:
        return int(self._disk(os.open, *args))

    # -- entry state ---------------------------------------------------------------------
    def _valid(self, key: str, rec: ShardRecord) -> bool:
        """The entry is complete and unchanged since it was verified (size and stamp)."""
        stamp = _stamp(key)
        try:
            st = os.stat(self._p(key, ".tar"))
        except FileNotFoundError:
            return False
        if st.st_size != rec.bytes or int(st.st_mtime) != stamp:
            return False
        try:
            return int(os.stat(self._p(key, ".idx")).st_mtime) == stamp
        except FileNotFoundError:
            return True  # the source has no index: the reader scans the shard

    def _repair_or_discard(self, key: str, rec: ShardRecord) -> bool:
        """Under ``LOCK_EX``: keep an entry whose content still hashes right (restamped), else
        remove it. True when a valid entry remains."""
        tar = self._p(key, ".tar")
        if not os.path.exists(tar):
            return False
        if self._valid(key, rec):
            return True
        ok = rec.sha256 is not None and os.path.getsize(tar) == rec.bytes
        if ok:
            h = hashlib.sha256()
            with open(tar, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            ok = h.hexdigest() == rec.sha256
        if ok:
            for suffix in (".tar", ".idx"):
                if os.path.exists(self._p(key, suffix)):
                    os.utime(self._p(key, suffix), (_stamp(key), _stamp(key)))
            return True
        self.stats.refetched += 1
        self._remove(key, (".tar", ".idx"))
        return False

    def _remove(self, key: str, suffixes: tuple[str, ...]) -> int:
        freed = 0
        for suffix in suffixes:
            try:
                p = self._p(key, suffix)
                freed += os.path.getsize(p)
                os.unlink(p)
            except FileNotFoundError:
                pass
        return freed

    def _scan(self) -> tuple[dict[str, int], int]:
        """``({key: bytes of .tar + .idx}, bytes of .part files)``."""
        entries: dict[str, int] = {}
        parts = 0
        try:
            it = os.scandir(self.path)
        except FileNotFoundError:
            return entries, 0
        with it:
            for e in it:
                name = e.name
                try:
                    size = e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # evicted meanwhile
                if name.endswith(".part"):
                    parts += size
                elif name.endswith((".tar", ".idx")):
                    key = name[:-4]
                    entries[key] = entries.get(key, 0) + size
        return entries, parts

    def usage(self) -> dict[str, int]:
        """Bytes on disk (entries and downloads under way), complete entries, budget."""
        entries, parts = self._scan()
        return {"bytes": sum(entries.values()) + parts, "entries": len(entries),
                "part_bytes": parts, "budget": -1 if self.size is None else self.size}

    # -- eviction ------------------------------------------------------------------------
    def _evict(self, key: str) -> int | None:
        """Remove an entry nobody uses; ``None`` when it is in use."""
        fd = self._lock(key, EXCLUSIVE, block=False)
        if fd is None:
            return None
        try:
            freed = self._remove(key, (".tar", ".idx", ".tar.part", ".idx.part"))
            os.unlink(self._p(key, ".lock"))  # under LOCK_EX: lockers re-check the inode
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
        self.stats.evictions += 1
        return freed

    def _make_room(self, key: str, incoming: int, rank: Rank, demand: bool) -> bool:
        """Evict until ``incoming`` more bytes fit (see the module docstring). A prefetch
        (``demand=False``) gives up rather than evict a shard needed before this one."""
        if self.size is None:
            return True
        entries, parts = self._scan()
        total = sum(entries.values()) + parts
        if total + incoming <= self.size:
            return True
        mine = rank(key)
        victims = sorted((k for k in entries if k != key), key=lambda k: (-rank(k), k))
        for k in victims:
            if total + incoming <= self.size:
                break
            if not demand and rank(k) <= mine:
                return False
            if self._evict(k) is not None:
                total -= entries[k]
        return demand or total + incoming <= self.size

    def trim(self, rank: Rank | None = None) -> int:
        """Evict unused entries (furthest next use first) until the budget holds, and remove
        downloads abandoned by killed processes. Returns the bytes on disk afterwards."""
        rank = rank or (lambda k: INF)
        entries, parts = self._scan()
        for name in os.listdir(self.path) if os.path.isdir(self.path) else ():
            key = name[: -len(".tar.part")] if name.endswith(".tar.part") else None
            key = key or (name[: -len(".idx.part")] if name.endswith(".idx.part") else None)
            if key is None:
                continue
            fd = self._lock(key, EXCLUSIVE, block=False)
            if fd is not None:  # nobody is filling it: a leftover
                parts -= self._remove(key, (".tar.part", ".idx.part"))
                os.close(fd)
        total = sum(entries.values()) + parts
        if self.size is not None:
            for k in sorted(entries, key=lambda k: (-rank(k), k)):
                if total <= self.size:
                    break
                if self._evict(k) is not None:
                    total -= entries[k]
        return total

    # -- filling -------------------------------------------------------------------------
    def _fill(self, key: str, url: str, rec: ShardRecord, rank: Rank, demand: bool,
              stop: threading.Event | None) -> str:
        """Under ``LOCK_EX``: ``"valid"`` (the entry was already there), ``"ok"`` (fetched),
        ``"skipped"`` (a prefetch found no room), ``"degraded"`` (the cache directory is full)."""
        if self._repair_or_discard(key, rec):
            return "valid"
        if not self._make_room(key, rec.bytes, rank, demand):
            return "skipped"
        fs, path = filesystem(url)
        h = hashlib.sha256()

        def chunks() -> Any:  # remote reads: their errors propagate as they are
            for lo in range(0, rec.bytes, CHUNK):
                if stop is not None and stop.is_set():
                    raise _Stopped
                hi = min(rec.bytes, lo + CHUNK)
                blob = read_range(fs, path, url, lo, hi, whole=hi - lo == rec.bytes, stop=stop)
                h.update(blob)
                yield blob

        stamp = _stamp(key)
        try:
            idx = self._fetch_index(url, stop)
            self._write_part(self._p(key, ".tar.part"), chunks())
            if rec.sha256 is not None and h.hexdigest() != rec.sha256:
                raise ShardFormatError(
                    f"{url}: content hash mismatch while caching (sha256 {h.hexdigest()[:16]}..., "
                    f"the manifest says {rec.sha256[:16]}...): the source shard is corrupted or "
                    "was replaced; run `feedpipe verify` on the dataset"
                )
            if idx is not None:
                self._write_part(self._p(key, ".idx.part"), iter((idx,)))
                self._disk(os.utime, self._p(key, ".idx.part"), (stamp, stamp))
                self._disk(os.replace, self._p(key, ".idx.part"), self._p(key, ".idx"))
            self._disk(os.utime, self._p(key, ".tar.part"), (stamp, stamp))
            self._disk(os.replace, self._p(key, ".tar.part"), self._p(key, ".tar"))  # commit
        except _NoSpace as e:
            self._remove(key, (".tar.part", ".idx.part", ".idx"))
            self._degrade(url, e.error)
            return "degraded"
        except BaseException:
            self._remove(key, (".tar.part", ".idx.part"))
            raise
        self.stats.fills += 1
        self.stats.bytes_fetched += rec.bytes + (len(idx) if idx is not None else 0)
        return "ok"

    def _degrade(self, url: str, error: OSError) -> None:
        self.stats.degraded += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.path}: the shard cache directory is full ({error.strerror}) while "
                f"caching {url}; reading such shards directly from the source instead "
                "(uncached range reads). Free space there or lower cache_size.",
                RuntimeWarning, stacklevel=5,
            )

    def _disk(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A local file operation: a full disk becomes ``_NoSpace``, other failures a clear
        :class:`OutputError` (remote errors never pass through here)."""
        try:
            return fn(*args)
        except OSError as e:
            if e.errno in _FULL:
                raise _NoSpace(e) from e
            raise OutputError(
                e.errno, f"{self.path}: cannot write to the shard cache ({e.strerror}); pass "
                "cache_dir= a writable directory with free space"
            ) from e

    def _write_part(self, part: str, blobs: Any) -> None:
        fd = self._disk(os.open, part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            for blob in blobs:
                view = memoryview(blob)
                while view:
                    view = view[self._disk(os.write, fd, view):]
            self._disk(os.fsync, fd)  # data on disk before the rename publishes it
        finally:
            os.close(fd)

    def _fetch_index(self, url: str, stop: threading.Event | None) -> bytes | None:
        from . import retry

        iurl = index_path(url)
        fs, ipath = filesystem(iurl)
        try:
            return retry.call(iurl, lambda: fs.cat_file(ipath), stop=stop)
        except SourceNotFoundError:
            return None

    def prefetch_one(self, url: str, rec: ShardRecord, rank: Rank,
                     stop: threading.Event | None = None) -> str:
        """Fill an entry in the background: ``"ok"``, ``"busy"`` (someone else is filling it),
        ``"skipped"`` or ``"degraded"``. Never waits for a lock."""
        self._ensure_dir()
        key = entry_key(rec, url)
        try:
            fd = self._lock(key, EXCLUSIVE, block=False)
        except _NoSpace as e:
            self._degrade(url, e.error)
            return "degraded"
        if fd is None:
            return "busy"
        try:
            if self._valid(key, rec):
                return "ok"
            status = self._fill(key, url, rec, rank, demand=False, stop=stop)
        except _Stopped:
            return "skipped"
        finally:
            os.close(fd)
        if status == "ok":
            self.stats.prefetched += 1
        return "ok" if status == "valid" else status

    def acquire(self, url: str, rec: ShardRecord, rank: Rank | None = None) -> Lease | None:
        """The cached shard, filled first if needed, held in use until the lease is released;
        ``None`` when the cache directory is full (read ``url`` directly then).

        Waits while another thread or process fills the same entry (one download per node).
        """
        self._ensure_dir()
        try:
            return self._acquire(url, rec, rank or (lambda k: INF))
        except _NoSpace as e:  # not even a lock file fits
            self._degrade(url, e.error)
            return None

    def _acquire(self, url: str, rec: ShardRecord, rank: Rank) -> Lease | None:
        key = entry_key(rec, url)
        tar = self._p(key, ".tar")
        wait = threading.Event()
        for attempt in range(200):
            fd = self._lock(key, SHARED)  # blocks while a filler holds LOCK_EX
            if fd is not None and self._valid(key, rec):
                self.stats.hits += 1
                return Lease(tar, fd)
            if fd is not None:
                os.close(fd)
            fd = self._lock(key, EXCLUSIVE, block=False)
            if fd is None:  # a filler or a momentary reader: look again once it is done
                self.stats.waits += 1
                wait.wait(min(0.05, 0.0005 * 2 ** min(attempt, 7)))
                continue
            try:
                status = self._fill(key, url, rec, rank, demand=True, stop=None)
                if status == "degraded":
                    return None
                relock(fd, SHARED)  # not atomic: re-check what we hold
            except BaseException:
                os.close(fd)
                raise
            if same_file(fd, self._p(key, ".lock")) and self._valid(key, rec):
                return Lease(tar, fd)
            os.close(fd)
        warnings.warn(f"{self.path}: could not settle the cache entry of {url}; reading it "
                      "uncached", RuntimeWarning, stacklevel=2)
        self.stats.degraded += 1
        return None


class _Stopped(Exception):
    """A prefetch was cancelled (its iterator closed)."""


class _NoSpace(Exception):
    """The cache directory is full (``ENOSPC``, ``EDQUOT``, ``EFBIG``)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def make_cache(cache_dir: Any, cache_size: Any) -> ShardCache | None:
    """The cache of ``FeedDataset(cache_dir=..., cache_size=...)``: ``None``/``False``: none;
    ``True`` or ``"auto"``: :func:`default_cache_dir`; a path; or a :class:`ShardCache`."""
    if cache_dir is None or cache_dir is False:
        if cache_size is not None:
            raise ValueError("cache_size= needs cache_dir= (a directory, or True for the default)")
        return None
    if isinstance(cache_dir, ShardCache):
        if cache_size is not None:
            raise ValueError("give the byte budget to the ShardCache, not cache_size=")
        return cache_dir
    path = default_cache_dir() if cache_dir is True or cache_dir == "auto" else cache_dir
    return ShardCache(path, cache_size)
