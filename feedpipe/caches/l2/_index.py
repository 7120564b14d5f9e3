"""The L2 tier: a persistent, content-addressed memo of deterministic per-sample functions.

An entry's key is ``fingerprint(function) + xxh3_128(input bytes)``
(:mod:`feedpipe.caches.l2._record`). The same input anywhere in the dataset (or in another
dataset) is computed and stored once. Changing the function's code or parameters makes its old
entries unreachable, also when the change is made to the wrapped object after ``wrap()``: the
fingerprint is taken again at each pass of a loader and at every call outside one
(:mod:`feedpipe.caches._passes`). A random function is refused, not frozen at its first draw
(:mod:`feedpipe.caches._randomness` says what that check cannot see).

**What the fingerprint cannot see** (:mod:`feedpipe.caches._fingerprint`): it hashes the
function's code and every value it holds or closes over (tensors, arrays, modules, dataclasses
included). It does not see module globals the function reads, files or environment variables
read at call time, nor the code of C extensions it calls. When one of those changes, the old
entries would still be served: give ``wrap(fn, version=...)`` a new value (or clear the index:
``feedpipe cache clear PATH``). Values are stored with the safe codec of
:mod:`feedpipe.caches.l2._codec` (never pickle) behind a checksum; a damaged entry is recomputed.

Concurrency (:mod:`feedpipe.caches.l2._lmdb_env`): LMDB serialises writers across processes and
lets readers run beside them. The environment is opened lazily in each process (after a
DataLoader fork). Writes are batched and committed when ``batch_writes`` accumulate, on
``flush()``, and when a worker process exits. When the map is full it is grown and the write
retried; when the disk is full the index warns once and keeps computing without storing.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._redact import logger
from ...errors import FeedpipeError, UncacheableTransformError
from .._fingerprint import fingerprint
from .._passes import current
from .._randomness import DrawCheck, random_part
from ._lmdb_env import open_env, read, release, share, shared, write
from ._record import content_hash, pack, unpack

if TYPE_CHECKING:
    from .._stats import TierStats

log = logger("feedpipe")


@dataclass
class IndexStats:
    """Per process: ``hits`` (of which ``lru_hits`` from the in-process LRU), ``misses``
    (computed), ``dedup`` (hits on an entry another sample stored), ``damaged`` (records that
    failed their checksum), ``stored`` and ``bytes_stored``; and, from disk, ``entries`` and
    ``db_bytes``."""

    hits: int = 0
    lru_hits: int = 0
    misses: int = 0
    dedup: int = 0
    damaged: int = 0
    stored: int = 0
    bytes_stored: int = 0
    entries: int = 0
    db_bytes: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["hit_ratio"] = self.hit_ratio
        return d


class FunctionIndex:
    """Persistent memoisation of deterministic functions in LMDB at ``path`` (a directory).

    Args:
        path: the index directory (created if missing).
        map_size: initial LMDB map size; grown (doubled) when full.
        lru_items: entries kept decoded in an in-process LRU in front of LMDB.
        batch_writes: entries committed together (a killed process loses at most these).

    Example:
        >>> import tempfile
        >>> idx = FunctionIndex(tempfile.mkdtemp())
        >>> double = idx.wrap(lambda b: bytes(b) * 2)
        >>> double(b"ab"), double(b"ab")
        (b'abab', b'abab')
        >>> s = idx.stats(); (s.misses, s.hits)
        (1, 1)
    """

    def __init__(
        self,
        path: str,
        *,
        map_size: int = 64 << 20,
        lru_items: int = 1024,
        batch_writes: int = 32,
    ) -> None:
        self.path = os.path.abspath(path)
        self.map_size = map_size
        self.lru_items = lru_items
        self.batch_writes = max(1, batch_writes)
        self._reset()

    def _reset(self) -> None:
        self._env: Any = None
        self._pid = -1
        self._lru: OrderedDict[bytes, tuple[Any, str | None]] = OrderedDict()
        self._pending: dict[bytes, bytes] = {}
        self._tally = IndexStats()
        self._store = True
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "map_size": self.map_size, "lru_items": self.lru_items,
                "batch_writes": self.batch_writes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    # -- the environment, opened once per process ---------------------------------------
    def _open(self) -> Any:
        if self._env is not None and self._pid == os.getpid():
            return self._env
        import lmdb

        if self._env is not None:  # inherited through fork: never touch the parent's handle
            self._env = None
            self._lru.clear()
            self._pending.clear()
        os.makedirs(self.path, exist_ok=True)
        env = shared(self.path)
        if env is not None:
            self._env, self._pid = env, os.getpid()
            return env
        try:
            env = open_env(self.path, self.map_size)
        except lmdb.Error as e:
            if isinstance(e, (lmdb.CorruptedError, lmdb.InvalidError, lmdb.VersionMismatchError)):
                broken = f"{self.path}.broken-{os.getpid()}"
                os.rename(self.path, broken)
                warnings.warn(f"{self.path}: function index was damaged ({e}); moved to {broken} "
                              "and started empty", RuntimeWarning, stacklevel=3)
                return self._open()
            raise FeedpipeError(f"{self.path}: cannot open the function index: {e}") from e
        share(self.path, env)
        self._env, self._pid = env, os.getpid()
        import multiprocessing.util as mpu

        # a worker process commits its pending entries when it exits
        mpu.Finalize(self, write, args=(env, self._pending, self), exitpriority=10)
        return env

    # -- lookups and stores --------------------------------------------------------------
    def _lookup(self, key: bytes, origin: str | None) -> tuple[bool, Any]:
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                self._tally.hits += 1
                self._tally.lru_hits += 1
                value, first_origin = self._lru[key]
                if origin is not None and first_origin and first_origin != origin:
                    self._tally.dedup += 1
                return True, value
            raw = self._pending.get(key)
        if raw is None:
            raw = read(self._open(), key)
        if raw is None:
            return False, None
        try:
            value, first_origin = unpack(raw)
        except ValueError:
            self._tally.damaged += 1
            return False, None
        self._tally.hits += 1
        if origin is not None and first_origin and first_origin != origin:
            self._tally.dedup += 1
        self._remember(key, value, first_origin)
        return True, value

    def _remember(self, key: bytes, value: Any, origin: str | None) -> None:
        if self.lru_items <= 0:
            return
        with self._lock:
            self._lru[key] = (value, origin)
            self._lru.move_to_end(key)
            while len(self._lru) > self.lru_items:
                self._lru.popitem(last=False)

    def _put(self, key: bytes, value: Any, origin: str | None) -> None:
        self._remember(key, value, origin)
        if not self._store:
            return
        raw = pack(value, origin)
        with self._lock:
            self._pending[key] = raw
            self._tally.stored += 1
            self._tally.bytes_stored += len(raw)
            if len(self._pending) >= self.batch_writes:
                self.flush()

    def flush(self) -> None:
        """Commit pending entries."""
        with self._lock:
            if not self._pending or not self._store:
                self._pending.clear()
                return
            env = self._open()
            if not write(env, self._pending, self):
                self._store = False

    # -- the public surface ---------------------------------------------------------------
    def wrap(self, fn: Callable[..., Any], *, fields: Sequence[str] | None = None,
             params: Any = None, version: Any = None) -> Memoized:
        """Memoise ``fn`` (a deterministic function of one sample dict or one bytes input).

        Args:
            fn: the function.
            fields: for sample dicts, the fields its result depends on (default: all but
                ``__key__``-style metadata).
            params: extra values that change its result (included in the fingerprint).
            version: any value; change it when something the fingerprint cannot see changed
                (a global the function reads, a file it loads: see the module docstring).

        Raises:
            UncacheableTransformError: ``fn`` holds a part known to draw at random (an
                ``ImagePipeline(train=True)`` anywhere in it); one caught drawing is refused
                on its first misses (neither check sees a function that draws rarely, or by a
                counter or the clock).
        """
        extra = params if version is None else (params, ("version", version))
        return Memoized(self, fn, fields, extra)

    def memoize(self, fn: Callable[..., Any] | None = None, **kw: Any) -> Any:
        """Decorator form of :meth:`wrap`: ``@index.memoize`` or ``@index.memoize(fields=...,
        version=...)``."""
        if fn is None:
            return lambda f: self.wrap(f, **kw)
        return self.wrap(fn, **kw)

    def counts(self) -> tuple[int, int]:
        """This process's ``(hits, misses)``, read without touching the database (cheap enough
        to read after every batch, unlike :meth:`stats`)."""
        return self._tally.hits, self._tally.misses

    def stats(self) -> IndexStats:
        """This process's hits, misses, dedup count, stored bytes, plus the entries on disk."""
        self.flush()
        env = self._open()
        s = IndexStats(**self._tally.__dict__)
        s.entries = env.stat()["entries"]
        s.db_bytes = _dir_bytes(self.path)
        return s

    def tier_stats(self) -> TierStats:
        """This process's hits and misses, the entries and bytes on disk, in the shape every
        cache tier reports (the fields :func:`~feedpipe.cache_stats` lists)."""
        from .._stats import FUNCTION_INDEX, TierStats

        s = self.stats()
        return TierStats(FUNCTION_INDEX, s.hits, s.misses, s.db_bytes, s.entries)

    def clear(self) -> None:
        """Delete every entry."""
        env = self._open()
        with self._lock:
            self._lru.clear()
            self._pending.clear()
            with env.begin(write=True) as txn:
                txn.drop(env.open_db(), delete=False)

    def close(self) -> None:
        """Commit pending entries and release this instance's use of the environment."""
        self.flush()
        if self._env is not None and self._pid == os.getpid():
            release(self.path, self._env)
        self._env = None

    def __enter__(self) -> FunctionIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Memoized:
    """A function memoised in a :class:`FunctionIndex`; picklable into worker processes.

    The function's fingerprint is read again at each pass of a loader in this process, and at
    every call outside one (:mod:`feedpipe.caches._passes`): a change of its state (an
    attribute, a closed-over value) keys new entries, never serves the old ones. A function that
    holds a part known to draw at random is refused when wrapped, one caught drawing on its first
    misses in a process when it runs (:mod:`feedpipe.caches._randomness`).
    """

    def __init__(self, index: FunctionIndex, fn: Callable[..., Any],
                 fields: Sequence[str] | None, extra: Any) -> None:
        self.index, self.fn, self.fields, self.extra = index, fn, fields, extra
        self._pass: int | None = None
        self._told = False  # a change of state was logged
        self._refuse_random()
        self.fp = fingerprint(fn, extra)
        self._draws = DrawCheck("FunctionIndex.wrap()")
        functools_update(self, fn)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pass"] = None  # pass numbers are per process: take the fingerprint again there
        return state

    def __fingerprint__(self) -> Any:  # what it computes; not its bookkeeping, not the index
        return self.fn, self.fields, self.extra

    def _refuse_random(self) -> None:
        found = random_part(self.fn)
        if found is not None:
            raise UncacheableTransformError(
                f"FunctionIndex.wrap() of a random function: {found} draws at random, and the "
                "index would serve its first draw for good. Memoise the deterministic part "
                "(e.g. ImagePipeline(train=False)) and augment after it.")

    def _current(self) -> bytes:
        """The fingerprint of the function's state now (see the class docstring)."""
        n = current()
        if n is None or n != self._pass:
            fp = fingerprint(self.fn, self.extra)
            if fp != self.fp:
                self._refuse_random()
                if not self._told:
                    self._told = True
                    log.warning(
                        "feedpipe: the state of memoised %s changed since it was wrapped: its "
                        "new entries are keyed by the new state. A function whose state changes "
                        "at every call or pass (a counter, a log it appends to) finds none of its "
                        "entries again: keep that out of it, or give its class a "
                        "__fingerprint__() method returning only what decides its outputs.",
                        getattr(self.fn, "__qualname__", type(self.fn).__name__))
                self.fp = fp
                self._draws.rearm()
            self._pass = n
        return self.fp

    def __call__(self, data: Any) -> Any:
        fields, keyed = self.fields, None
        if fields is None and isinstance(data, dict):
            # a function whose output follows the sample's epoch and seed by design (a video
            # clip's start) names the fields that decide it, these included
            keyed = getattr(self.fn, "memo_fields", None)
            fields = None if keyed is None else keyed(data)
        key = self._current() + content_hash(data, fields)
        origin = data.get("__key__") if isinstance(data, dict) else None
        found, value = self.index._lookup(key, origin)
        if found:
            return value
        self.index._tally.misses += 1
        value = self.fn(data)
        if keyed is None:  # keyed by the epoch and seed: another epoch is another entry
            self._draws.check(self.fn, data, value)
        self.index._put(key, value, origin)
        return value


def functools_update(wrapper: Any, fn: Any) -> None:
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(wrapper, attr, getattr(fn, attr))
        except (AttributeError, TypeError):
            pass


def _dir_bytes(path: str) -> int:
    total = 0
    for name in ("data.mdb", "lock.mdb"):
        try:
            total += os.stat(os.path.join(path, name)).st_blocks * 512
        except OSError:
            pass
    return total
