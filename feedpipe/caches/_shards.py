"""The L1 file tier: shards fetched once per node into a local directory, read from there with mmap.

**Layout.** Everything is derivable from the directory; there is no index file a crash could
corrupt. An entry is named after the shard's content and file name
(:func:`~feedpipe.caches.l1._entry.entry_key`)::

    <key>.tar   the shard   (the commit point: an entry exists once this name exists)
    <key>.idx   its index   (when the source has one)
    <key>.lock  the entry's lock file (empty)
    <key>.tar.part, <key>.idx.part   a download under way (or left by a killed process)
    manifest-<hash>.json   the manifest of a dataset read through the cache (offline starts,
                           :mod:`feedpipe.caches._manifest_copy`)
    .budget, .reader-*     the node-wide accounting (:mod:`feedpipe.caches.l1._budget`)

**Locks** (``fcntl.flock`` on ``<key>.lock``). The kernel drops the locks of a dead process, so
a crash never leaves a lock that blocks the next run.

- a reader holds ``LOCK_SH`` while it maps the shard: the entry is *in use*;
- a filler holds ``LOCK_EX`` while it downloads: readers of that shard wait for it (one download
  per shard and node), other fillers skip it;
- eviction takes ``LOCK_EX | LOCK_NB`` and skips entries it cannot lock: in-use entries stay.

**Checks** (:mod:`feedpipe.caches.l1._integrity`). Fills write ``.part`` files and check them before
the rename publishes them: the shard's size and sha256 against the manifest, the index against
the manifest's index hash or else the shard's tar headers. A file that fails is fetched again,
up to :data:`~feedpipe.caches.l1._entry.FETCH_ATTEMPTS` fetches in all. Then a
:class:`ShardFormatError` names it, its URL and the cache. A checked file carries a *stamp* in
its mtime (an index's also hashes its content). So a file damaged in the cache directory is
noticed on its next use, checked again and fetched again when wrong: nothing unchecked is ever
served.

**Budget** (``size`` bytes: the apparent size of every file in the directory: entries, downloads
under way, manifest copies, the ledger). Admissions are serialised node-wide, and a download
reserves its full size when it starts; its ranges go out only once it would be admitted
(:meth:`ShardCache._room`), so a refused fill sends for nothing. A fill first makes room: it
evicts unlocked entries, the one needed furthest ahead first
(:mod:`feedpipe.caches.l1._eviction`), and never one the plan reads again before its own shard's
end of use (:func:`~feedpipe.caches.l1._eviction.fill_limit`): that shard is read uncached
instead, its samples' bytes once. Such a plan-aware fill never takes the directory past
``size``. Without the plan (and for a gzip shard, which must be cached), when the entries in
use leave no room, a reader's download (never a prefetch) still goes ahead if the directory then
holds at most ``size + R x`` that shard, ``R`` being the processes reading through the directory
at that moment (every DataLoader worker of every rank is one). Else the shard is read from the
source with range requests, uncached, with a warning once per process. So, at every moment a
download starts::

    bytes in the directory <= size + R x the largest entry (shard + index)   (<= size with a plan)

and ``<= size`` once nothing is in use and :meth:`ShardCache.trim` ran (each iterator runs it
when it ends). A prefetch never exceeds the budget and never evicts a shard needed sooner than
the one it fetches: under pressure it gives up and the reader fetches on demand.

**Disk full** (``ENOSPC``, ``EDQUOT``, ``EFBIG``): the partial files are removed, a warning is
given once per process, and that shard is read from the source with range requests instead.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._helpers.cache_home import cache_home
from .._helpers.file_lock import EXCLUSIVE, SHARED, Lease, lock, relock, same_file
from .._redact import cause, redact
from ..format._manifest import ShardRecord
from .l1._budget import Budget, Ledger, scan
from .l1._entry import PARTS, Entry, NoSpace, Stopped, disk, entry_key
from .l1._eviction import INF, Rank, evict_until, fill_limit, remove_leftovers

if TYPE_CHECKING:
    from ._stats import TierStats


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/feedpipe/shards`` (or ``~/.cache/feedpipe/shards``)."""
    return cache_home("shards")


@dataclass
class CacheStats:
    """Per process: ``hits`` (a reader found its shard cached before this process fetched it),
    ``misses`` (it did not: it fetched the shard, read it uncached, or found it filled by this
    process's own prefetch: that fill was made for this read, so it is no hit), ``fills``
    (downloads, of which ``prefetched`` by background threads), ``waits`` (another thread or
    process held the entry), ``evictions``, ``refetched`` (damaged or mismatched files
    discarded), ``degraded`` (read uncached: disk full), ``over_budget`` (read uncached: the
    budget was taken by shards in use), ``early`` (samples of a first batch read by their own
    range requests before their shards had arrived: :mod:`feedpipe.caches._early`)."""

    hits: int = 0
    misses: int = 0
    fills: int = 0
    prefetched: int = 0
    waits: int = 0
    evictions: int = 0
    refetched: int = 0
    degraded: int = 0
    over_budget: int = 0
    bytes_fetched: int = 0
    early: int = 0


class ShardCache:
    """A node-local shard cache directory with a byte budget (see the module docstring).

    Args:
        path: the directory (created on first use; ``/dev/shm/...`` works too).
        size: the byte budget, bytes or a string like ``"20GB"`` (``None``: unbounded).
        prefetch: shards each reader fetches ahead in background threads (0: none; ``None``:
            as many as the download threads).
        threads: download threads per reader (``None``: enough shards at once to keep the
            process's concurrent range requests busy, ``FEEDPIPE_REMOTE_STREAMS`` over a mean
            shard's ranges, 2 to 16). Each download reads its shard in concurrent ranges too.

    Example:
        >>> c = ShardCache("/tmp/fp-doc-cache", size=10**9)
        >>> c.usage()["bytes"] >= 0
        True
    """

    def __init__(self, path: str | os.PathLike[str], size: int | str | None = None, *,
                 prefetch: int | None = None, threads: int | None = None) -> None:
        from .._helpers.sizes import parse_size

        self.path = os.path.abspath(os.fspath(path))
        self.size = None if size is None else parse_size(size)
        self.prefetch = prefetch
        self.threads = threads
        self.stats = CacheStats()
        self._warned: set[str] = set()
        # entries this process's prefetch filled that no reader here has acquired yet: their
        # first acquisition is a miss (set operations are atomic under the GIL: the prefetch
        # threads add, the reader removes)
        self._prefilled: set[str] = set()
        self._made = False
        self._budget = Budget(self.path)
        # the shard bytes :meth:`_room` let this process's fills send for before their
        # reservation: other fills' room checks count them as taken
        self._promised: dict[str, int] = {}
        self._promise_lock = threading.Lock()
        self._promise_pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["stats"] = CacheStats()  # counters are per process
        state["_warned"] = set()
        state["_prefilled"] = set()
        state["_promised"] = {}
        state["_promise_lock"] = None
        state["_promise_pid"] = -1  # made anew in the process that unpickles it
        return state

    def _promises(self) -> threading.Lock:
        """The promises' lock of this process: a forked child (a DataLoader worker) starts
        with none, and never with a lock that a thread of its parent held at the fork."""
        if self._promise_pid != os.getpid():
            self._promised, self._promise_lock = {}, threading.Lock()
            self._promise_pid = os.getpid()
        return self._promise_lock

    # -- files and locks -------------------------------------------------------------------
    def _entry(self, url: str, rec: ShardRecord) -> Entry:
        return Entry(self.path, entry_key(rec, url), url, rec, self.stats)

    def _p(self, key: str, suffix: str) -> str:
        return os.path.join(self.path, key + suffix)

    def _ensure_dir(self) -> None:
        if self._made:
            return
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            from ..errors import OutputError

            raise OutputError(
                e.errno, f"{self.path}: cannot create the shard cache directory: {e.strerror}; "
                "pass cache_dir= a writable directory"
            ) from cause(e)
        self._made = True

    def _lock(self, key: str, mode: int, block: bool = True) -> int | None:
        return lock(self._p(key, ".lock"), mode, block, opener=self._open_lock)

    def _open_lock(self, *args: Any) -> int:
        return int(disk(self.path, os.open, *args))

    def _scan(self) -> tuple[dict[str, int], int, int]:
        return scan(self.path)

    def usage(self) -> dict[str, int]:
        """Bytes on disk (every file), complete entries, bytes of downloads under way, the
        budget (-1: none), and the largest size a download took the directory to
        (``peak_bytes``) with the most processes seen reading at once (``peak_readers``)."""
        entries, parts, other = self._scan()
        peak, readers = self._budget.peak()
        return {"bytes": sum(entries.values()) + parts + other, "entries": len(entries),
                "part_bytes": parts, "budget": -1 if self.size is None else self.size,
                "peak_bytes": peak, "peak_readers": readers}

    def tier_stats(self) -> TierStats:
        """This process's hits and misses, and the directory's bytes and entries."""
        from ._stats import SHARDS, TierStats

        u = self.usage()
        return TierStats(SHARDS, self.stats.hits, self.stats.misses, u["bytes"], u["entries"])

    def ready(self, url: str, rec: ShardRecord) -> bool:
        """Whether the shard's entry is complete and checked now: a reader would acquire it
        without waiting for a download."""
        return self._entry(url, rec).valid()

    # -- eviction ------------------------------------------------------------------------
    def _evict(self, key: str) -> int | None:
        """Remove an entry nobody uses; ``None`` when it is in use."""
        fd = self._lock(key, EXCLUSIVE, block=False)
        if fd is None:
            return None
        freed = 0
        try:
            freed = Entry(self.path, key, "", ShardRecord("", 0, 0), self.stats).remove(
                (".tar", ".idx", *PARTS))
            os.unlink(self._p(key, ".lock"))  # under LOCK_EX: lockers re-check the inode
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
        self.stats.evictions += 1
        return freed

    def trim(self, rank: Rank | None = None) -> int:
        """Evict unused entries (furthest next use first) until the budget holds, remove
        downloads and temporary files abandoned by killed processes, and stop counting this
        process among the readers. Returns the bytes on disk afterwards."""
        rank = rank or (lambda k: INF)
        self._budget.unregister()
        remove_leftovers(self.path, lambda key: self._lock(key, EXCLUSIVE, block=False))
        entries, parts, other = self._scan()
        total = sum(entries.values()) + parts + other
        if self.size is not None:
            total = evict_until(self.size, entries, total, rank, self._evict) or 0
        return total

    # -- filling -------------------------------------------------------------------------
    def _room(self, entry: Entry, tar_bytes: int, rank: Rank, until: Rank | None,
              demand: bool) -> bool:
        """Whether :meth:`_reserve` would admit the shard now, asked before its ranges go out
        (a refused fill must not have sent for bytes it throws away); if so, its bytes are
        promised. Evicts nothing: an entry counts as evictable when its lock can be taken."""
        if self.size is None:
            return True
        # under the ledger's lock, as a reservation is made: none is half made meanwhile
        with self._budget.admission(self._open_lock), self._promises():
            entries, parts, other = self._scan()
            total = sum(entries.values()) + parts + other + sum(self._promised.values())
            left = evict_until(self.size - tar_bytes, entries, total, rank,
                               lambda k: entries[k] if self._unused(k) else None, keep=entry.key,
                               before=fill_limit(rank(entry.key), until, entry.key, demand))
            slack = demand and until is None  # see _admit
            room = self.size + (max(1, self._budget.readers()) * tar_bytes if slack else 0)
            if left is None or left + tar_bytes > room:
                return False
            self._promised[entry.key] = tar_bytes
        return True

    def _unused(self, key: str) -> bool:
        fd = self._lock(key, EXCLUSIVE, block=False)
        if fd is not None:
            os.close(fd)
        return fd is not None

    def _unpromise(self, key: str) -> None:
        with self._promises():
            self._promised.pop(key, None)

    def _reserve(self, entry: Entry, tar_bytes: int, idx: bytes | None, rank: Rank,
                 demand: bool, until: Rank | None = None) -> bool:
        """Admit a download (see the module docstring): make room, then create its ``.part``
        files at their full size. False: no room without evicting an entry needed sooner
        (:meth:`_before`), or a reader's download would take the directory past
        ``size + readers x`` this download."""
        incoming = tar_bytes + (len(idx) if idx is not None else 0)
        with self._budget.admission(self._open_lock) as ledger:
            try:
                return self._admit(entry, tar_bytes, idx, incoming, rank, demand, until, ledger)
            finally:
                self._unpromise(entry.key)  # its reservation (or refusal) takes its place

    def _admit(self, entry: Entry, tar_bytes: int, idx: bytes | None, incoming: int,
               rank: Rank, demand: bool, until: Rank | None, ledger: Ledger) -> bool:
        entries, parts, other = self._scan()
        own = sum(_size(entry.p(s)) for s in PARTS)  # replaced by this reservation
        with self._promises():  # the bytes other fills of this process were let send for
            promised = sum(v for k, v in self._promised.items() if k != entry.key)
        total = sum(entries.values()) + parts + other - own + promised
        readers = self._budget.readers()
        if self.size is not None and total + incoming > self.size:
            left = evict_until(self.size - incoming, entries, total, rank, self._evict,
                               keep=entry.key,
                               before=fill_limit(rank(entry.key), until, entry.key, demand))
            if left is None:
                return False
            total = left
            # a reader's fill may pass the budget by a shard per reader, unless the plan says what
            # to keep (``until``): a shard read uncached then costs its samples' bytes, once
            slack = demand and until is None
            if total + incoming > self.size + (readers * incoming if slack else 0):
                return False
        entry.write_parts(tar_bytes, idx)
        ledger.note(total - promised + incoming, readers)
        return True

    def _fill(self, entry: Entry, rank: Rank, demand: bool,
              stop: threading.Event | None, until: Rank | None = None) -> str:
        """Under ``LOCK_EX``: ``"valid"`` (the entry was already there), ``"ok"`` (fetched),
        ``"refused"`` (no room within the budget's rules), ``"degraded"`` (the disk is full)."""
        try:
            status = entry.fill(
                lambda b, idx: self._reserve(entry, b, idx, rank, demand, until), stop,
                lambda: self._budget.admission(self._open_lock),
                room=lambda b: self._room(entry, b, rank, until, demand))
        except NoSpace as e:
            self._degrade(entry.url, e.error)
            return "degraded"
        finally:
            self._unpromise(entry.key)
        if status == "ok":
            self.stats.fills += 1
            self.stats.bytes_fetched += entry.fetched
        return status

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(redact(message), RuntimeWarning, stacklevel=5)

    def _degrade(self, url: str, error: OSError) -> None:
        self.stats.degraded += 1
        self._warn("full", f"{self.path}: the shard cache directory is full ({error.strerror}) "
                           f"while caching {url}; reading such shards directly from the source "
                           "instead (uncached range reads). Free space there or lower cache_size.")

    def _over_budget(self, url: str, planned: bool) -> None:
        self.stats.over_budget += 1
        if planned:
            self._warn("budget", (
                f"{self.path}: cache_size ({self.size} bytes) is taken by shards that the plan "
                f"reads again before it is done with {url}; reading such shards uncached (a "
                "range request per sample, each sample's bytes once) rather than evict one "
                "that would be fetched again. Raise cache_size to cache more of the dataset."))
            return
        self._warn("budget", (
            f"{self.path}: cache_size ({self.size} bytes) is taken by shards that the "
            f"{self._budget.readers()} processes reading through this cache hold in use; "
            f"reading {url} uncached (range requests) rather than exceed the budget by more than "
            "one shard per reader. Raise cache_size, or lower max_open_shards / shuffle_window "
            "so that each reader holds fewer shards at once."))

    def prefetch_one(self, url: str, rec: ShardRecord, rank: Rank,
                     stop: threading.Event | None = None, until: Rank | None = None) -> str:
        """Fill an entry in the background: ``"ok"``, ``"busy"`` (someone else is filling it),
        ``"skipped"`` (no room without evicting a shard needed sooner, or, with ``until``,
        needed while this one is still read) or ``"degraded"``. Never waits for a lock."""
        self._ensure_dir()
        entry = self._entry(url, rec)
        try:
            fd = self._lock(entry.key, EXCLUSIVE, block=False)
        except NoSpace as e:
            self._degrade(url, e.error)
            return "degraded"
        if fd is None:
            return "busy"
        try:
            if entry.valid():
                return "ok"
            status = self._fill(entry, rank, demand=False, stop=stop, until=until)
            if status == "ok":  # before the lock goes: a reader waits for it, then looks
                self._prefilled.add(entry.key)
        except Stopped:
            return "skipped"
        finally:
            os.close(fd)
        if status == "ok":
            self.stats.prefetched += 1
        return {"valid": "ok", "refused": "skipped"}.get(status, status)

    def acquire(self, url: str, rec: ShardRecord, rank: Rank | None = None, *,
                quiet: bool = False, until: Rank | None = None) -> Lease | None:
        """The cached shard, filled first if needed, held in use until the lease is released;
        ``None`` when it cannot be cached now (the directory is full, or the budget is taken by
        shards in use: see the module docstring): read ``url`` directly then. ``quiet``: a
        refusal for the budget is neither warned of nor counted (a caller that frees entries
        it holds and asks again). ``until``: an entry's end of use from its next use on (from
        the plan, as the prefetcher knows it): the fill evicts no entry needed before its
        shard's end of use, and reads the shard uncached instead.

        Waits while another thread or process fills the same entry (one download per node).
        Counts this process among the cache's readers until :meth:`trim`.
        """
        self._ensure_dir()
        try:
            disk(self.path, self._budget.register)
            return self._acquire(self._entry(url, rec), rank or (lambda k: INF), quiet, until)
        except NoSpace as e:  # not even a lock file fits
            self._degrade(url, e.error)
            return None

    def _acquire(self, entry: Entry, rank: Rank, quiet: bool = False,
                 until: Rank | None = None) -> Lease | None:
        tar, lockfile = entry.p(".tar"), entry.p(".lock")
        wait = threading.Event()
        for attempt in range(200):
            fd = self._lock(entry.key, SHARED)  # blocks while a filler holds LOCK_EX
            if fd is not None and entry.valid():
                if entry.key in self._prefilled:
                    self._prefilled.discard(entry.key)
                    self.stats.misses += 1
                else:
                    self.stats.hits += 1
                return Lease(tar, fd)
            if fd is not None:
                os.close(fd)
            fd = self._lock(entry.key, EXCLUSIVE, block=False)
            if fd is None:  # a filler or a momentary reader: look again once it is done
                self.stats.waits += 1
                wait.wait(min(0.05, 0.0005 * 2 ** min(attempt, 7)))
                continue
            try:
                status = self._fill(entry, rank, demand=True, stop=None, until=until)
                if status in ("degraded", "refused"):
                    os.close(fd)
                    if status == "refused" and quiet:
                        return None
                    self.stats.misses += 1
                    if status == "refused":
                        self._over_budget(entry.url, until is not None)
                    return None
                relock(fd, SHARED)  # not atomic: re-check what we hold
            except BaseException:
                os.close(fd)
                raise
            if same_file(fd, lockfile) and entry.valid():
                hit = status == "valid" and entry.key not in self._prefilled
                self._prefilled.discard(entry.key)
                self.stats.misses += not hit
                self.stats.hits += hit
                return Lease(tar, fd)
            os.close(fd)
        warnings.warn(f"{self.path}: could not settle the cache entry of {redact(entry.url)}; "
                      "reading it uncached", RuntimeWarning, stacklevel=2)
        self.stats.degraded += 1
        self.stats.misses += 1
        return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def cache_dir_path(cache_dir: Any) -> str:
    """The directory a ``cache_dir=`` value names (``True``/``"auto"``: the default)."""
    if isinstance(cache_dir, ShardCache):
        return cache_dir.path
    if cache_dir is True or cache_dir == "auto":
        return default_cache_dir()
    return os.path.abspath(os.fspath(cache_dir))
