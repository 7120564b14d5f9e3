"""One entry of the L1 shard cache: its files, how it is checked, fetched, published and removed.

An entry ``<key>`` of a cache directory is ``<key>.tar`` (the shard; its rename is the commit
point), ``<key>.idx`` (its index, when the source has one) and, while a download is under way,
``<key>.tar.part`` / ``<key>.idx.part``. Every method here runs under the entry's ``LOCK_EX``
(held by :class:`~feedpipe.caches._shards.ShardCache`), except :meth:`Entry.valid`, which a reader
calls under ``LOCK_SH``. What is checked: :mod:`feedpipe.caches.l1._integrity`.

A gzip shard (``.tar.gz``, ``.tgz``) is decompressed as it is downloaded: its entry's ``.tar`` is
the plain tar inside (``ShardRecord.tar_bytes`` long), where its index's offsets hold; the
compressed bytes are checked against the manifest's size and sha256 on the way.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..._helpers.storage import Ranges, range_bytes, ranges_of, read_bytes, read_ranges
from ..._redact import cause
from ...errors import OutputError, ShardFormatError, SourceNotFoundError
from ...format._compression import Gunzip
from ...format._index import index_path
from ...format._manifest import ShardRecord
from ._integrity import IDX, TAR, file_sha256, index_problem, stamp
from ._joined import joined

FETCH_ATTEMPTS = 3  # fetches of a file that keeps failing its check before it is named
PARTS = (".tar.part", ".idx.part")
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

Reserve = Callable[[int, "bytes | None"], bool]  # (shard bytes to fetch, index) -> admitted


class NoSpace(Exception):
    """The cache directory is full (``ENOSPC``, ``EDQUOT``, ``EFBIG``)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class Stopped(Exception):
    """A prefetch was cancelled (its iterator closed)."""


class _Damaged(Exception):
    """A gzip shard's download does not decompress to its manifest's plain tar."""


def _packed(rec: Any) -> bool:
    """Whether the record is a gzip shard's (a record is duck-typed, as in ``_integrity``)."""
    return getattr(rec, "tar_bytes", None) is not None


INDEX_ROOM = 128  # bytes an index line may take, about, per sample (a guess on the safe side)


def _plain_size(rec: Any) -> int:
    """The size of the entry's ``.tar``: a gzip shard's plain tar, else the shard's."""
    return int(rec.tar_bytes) if _packed(rec) else int(rec.bytes)


def entry_key(rec: ShardRecord, url: str) -> str:
    """The entry name of a shard: its content hash (else a hash of URL and size) and file name.

    Naming an entry after the shard's content lets two datasets holding the same shard share it,
    and a changed shard never matches a stale entry.

    Example:
        >>> entry_key(ShardRecord("train/data-000001.tar", 10, 4096, "ab" * 32), "s3://b/x")
        'abababababababababab-data-000001'
    """
    ident = rec.sha256 or hashlib.sha256(f"{url}\0{rec.bytes}".encode()).hexdigest()
    base = re.sub(r"[^A-Za-z0-9._-]", "_", rec.name.rsplit("/", 1)[-1])
    base = base.removesuffix(".tar")
    return f"{ident[:20]}-{base}"


def disk(where: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A local file operation in the cache directory ``where``: a full disk becomes
    :class:`NoSpace`, other failures a clear :class:`OutputError` (remote errors never pass
    through here)."""
    try:
        return fn(*args)
    except OSError as e:
        if e.errno in _FULL:
            raise NoSpace(e) from cause(e)
        raise OutputError(
            e.errno, f"{where}: cannot write to the shard cache ({e.strerror}); pass cache_dir= a "
            "writable directory with free space"
        ) from cause(e)


class Entry:
    """The files of one shard's entry in the cache directory ``root``.

    Args:
        root: the cache directory.
        key: the entry's name (:func:`entry_key`).
        url: where the shard comes from; its index is
            :func:`~feedpipe.format._index.index_path` of it.
        rec: the shard's manifest record.
        stats: the cache's counters (``refetched`` is counted here).
    """

    def __init__(self, root: str, key: str, url: str, rec: ShardRecord, stats: Any) -> None:
        self.root, self.key, self.url, self.rec, self.stats = root, key, url, rec, stats
        self.fetched = 0  # bytes downloaded by the last fill

    def p(self, suffix: str) -> str:
        return os.path.join(self.root, self.key + suffix)

    def _disk(self, fn: Callable[..., Any], *args: Any) -> Any:
        return disk(self.root, fn, *args)

    def remove(self, suffixes: tuple[str, ...]) -> int:
        """Delete these files of the entry; the bytes freed."""
        freed = 0
        for suffix in suffixes:
            try:
                p = self.p(suffix)
                freed += os.path.getsize(p)
                os.unlink(p)
            except FileNotFoundError:
                pass
        return freed

    # -- state ---------------------------------------------------------------------------------
    def valid(self) -> bool:
        """Complete and unchanged since it was checked (size and stamps; the index hashed)."""
        try:
            st = os.stat(self.p(".tar"))
        except FileNotFoundError:
            return False
        if st.st_size != _plain_size(self.rec) or int(st.st_mtime) != stamp(self.key):
            return False
        try:
            with open(self.p(".idx"), "rb") as f:
                data, mtime = f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return True  # the source has no index: the reader scans the shard
        return int(mtime) == stamp(self.key, data)

    def check(self) -> str:
        """Check again an entry whose stamps do not match: ``"valid"`` (restamped), ``"idx"`` (the
        shard is sound, its index must be fetched) or ``"all"`` (nothing kept)."""
        key, rec, tar = self.key, self.rec, self.p(".tar")
        try:
            st = os.stat(tar)
        except FileNotFoundError:
            self.remove((".idx",))
            return "all"
        if st.st_size != _plain_size(rec) or int(st.st_mtime) != stamp(key):
            # (a gzip shard's hash is of its compressed bytes: its plain tar is fetched again)
            if (rec.sha256 is None or _packed(rec) or st.st_size != rec.bytes
                    or file_sha256(tar) != rec.sha256):
                self.stats.refetched += 1
                self.remove((".tar", ".idx"))
                return "all"
            os.utime(tar, (stamp(key), stamp(key)))
        try:
            with open(self.p(".idx"), "rb") as f:
                data, mtime = f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return "valid"
        if int(mtime) == stamp(key, data):
            return "valid"
        problem = index_problem(data, rec, tar, index_path(self.url), self.url)
        if problem is None:
            os.utime(self.p(".idx"), (stamp(key, data), stamp(key, data)))
            return "valid"
        self.stats.refetched += 1
        if problem[0] == TAR:
            self.remove((".tar", ".idx"))
            return "all"
        self.remove((".idx",))
        return "idx"

    # -- filling -------------------------------------------------------------------------------
    def fill(self, reserve: Reserve, stop: threading.Event | None,
             publishing: Callable[[], AbstractContextManager[Any]],
             room: Callable[[int], bool] | None = None) -> str:
        """Fetch what :meth:`check` found missing, check it, publish it: ``"valid"`` (nothing was
        missing), ``"ok"``, or ``"refused"`` (``reserve`` found no room). A file that keeps
        failing its check is fetched :data:`FETCH_ATTEMPTS` times, then named in a
        :class:`ShardFormatError`. Raises :class:`NoSpace` when the disk is full; leaves no
        ``.part`` file behind.

        Args:
            reserve: admits the download (``(shard bytes, index bytes) -> bool``).
            stop: set to abandon a prefetch.
            publishing: held while the checked files are renamed into place (the budget's
                lock: a directory scan racing a rename could miss the file under both names).
            room: whether ``reserve`` would admit the shard's bytes now: only then do its first
                ranges go out before the index and the reservation (a refused fill sends for
                nothing of the shard).
        """
        state = self.check()
        if state == "valid":
            return "valid"
        rec, url, iurl = self.rec, self.url, index_path(self.url)
        need_tar = state == "all"
        problem = (url, "")
        # the shard's first ranges are asked for at once: they travel while the index does
        # (the index is not here yet: room for a generous one, so that a check that says yes
        # is not refused by the reservation over the index's bytes)
        ahead = need_tar and (room is None or room(_plain_size(rec) + INDEX_ROOM * rec.samples))
        early = self._ranges(stop) if ahead else None
        try:
            for attempt in range(FETCH_ATTEMPTS):
                idx = self._fetch_index(stop, again=attempt > 0)
                if not reserve(_plain_size(rec) if need_tar else 0, idx):
                    self.remove(PARTS)
                    return "refused"
                if need_tar:
                    try:
                        blobs, early = early, None  # used once: a fetch again asks anew
                        digest = self._download(stop, blobs)
                    except _Damaged as e:
                        problem = (url, str(e))
                        self.stats.refetched += 1
                        continue
                    if rec.sha256 is not None and digest != rec.sha256:
                        what = (f"{url}: content hash mismatch while caching (sha256 "
                                f"{digest[:16]}..., the manifest says {rec.sha256[:16]}...)")
                        problem = (url, what)
                        self.stats.refetched += 1
                        continue
                found = None if idx is None else index_problem(
                    idx, rec, self.p(".tar.part" if need_tar else ".tar"), iurl, url)
                if found is not None:
                    problem = (iurl if found[0] == IDX else url, found[1])
                    self.stats.refetched += 1
                    # without the shard's hash a mismatch may be the shard's fault: both again
                    if not need_tar and (found[0] == TAR or rec.sha256 is None):
                        need_tar = True
                        self.remove((".tar",))
                    continue
                with publishing():
                    self._commit(idx, need_tar)
                self.fetched = (rec.bytes if need_tar else 0) + len(idx or b"")
                return "ok"
            raise self._named(problem)
        finally:
            if early is not None:
                early.close()
            self.remove(PARTS)  # nothing when committed: the renames took them

    def write_parts(self, tar_bytes: int, idx: bytes | None) -> None:
        """Create the download's files at their full size (its reservation)."""
        if tar_bytes:
            fd = self._disk(os.open, self.p(".tar.part"),
                            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                self._disk(os.ftruncate, fd, tar_bytes)
            finally:
                os.close(fd)
        if idx is not None:
            self._write(self.p(".idx.part"), idx)

    def _named(self, problem: tuple[str, str]) -> ShardFormatError:
        """``problem``: (the file at fault, a message that names it)."""
        where, what = problem
        if where == self.url:
            cause, fix = "the shard at the source is damaged", "upload it again"
        else:
            cause = f"the index at the source is damaged or does not belong to {self.url}"
            fix = "rebuild it (`feedpipe index`)"
        return ShardFormatError(
            f"{what}. The same on each of {FETCH_ATTEMPTS} fetches into the shard cache "
            f"{self.root}: {cause}; {fix}, then check the dataset with `feedpipe verify`")

    def _commit(self, idx: bytes | None, tar: bool) -> None:
        """Stamp and publish the checked files: the index first, the shard (the commit point of a
        new entry) last."""
        if idx is not None:
            self._disk(os.utime, self.p(".idx.part"), (stamp(self.key, idx),) * 2)
            self._disk(os.replace, self.p(".idx.part"), self.p(".idx"))
        else:
            self.remove((".idx",))
        if tar:
            self._disk(os.utime, self.p(".tar.part"), (stamp(self.key),) * 2)
            self._disk(os.replace, self.p(".tar.part"), self.p(".tar"))

    def _ranges(self, stop: threading.Event | None) -> Ranges:
        """The shard's ranges, under way (a server that ignores Range sends the whole object
        on the first: it is kept, see :func:`~feedpipe._helpers.storage.read_ranges`)."""
        total = self.rec.bytes
        return read_ranges(self.url, ranges_of(0, total, range_bytes(total)), stop=stop,
                           size=total)

    def _download(self, stop: threading.Event | None, early: Ranges | None = None) -> str:
        """The shard into its reserved ``.tar.part`` (synced; a gzip shard decompressed); the
        sha256 of the bytes fetched. :class:`_Damaged`: a gzip stream that is broken or does not
        hold ``tar_bytes``."""
        url, total = self.url, self.rec.bytes
        h = hashlib.sha256()
        fd = self._disk(os.open, self.p(".tar.part"), os.O_WRONLY | os.O_CLOEXEC)
        gunzip = Gunzip(url) if _packed(self.rec) else None
        written = 0

        def unpack(blob: bytes, last: bool = False) -> bytes:
            if gunzip is None:
                return blob
            try:
                return gunzip.end() if last else gunzip.feed(blob)
            except ShardFormatError as e:
                raise _Damaged(str(e)) from cause(e)

        blobs = early if early is not None else self._ranges(stop)
        try:
            lo = 0
            for blob in blobs:
                if stop is not None and stop.is_set():
                    raise Stopped
                h.update(blob)
                lo += len(blob)
                written += self._write_fd(fd, unpack(blob))
                if gunzip is not None and written > _plain_size(self.rec):
                    break
            if gunzip is not None:
                written += self._write_fd(fd, unpack(b"", last=True)) if lo == total else 0
                if written != _plain_size(self.rec):
                    raise _Damaged(f"{url}: the tar inside is {'more than ' * (lo < total)}"
                                   f"{written} bytes, the manifest says {_plain_size(self.rec)} "
                                   "(tar_bytes)")
            self._disk(os.fsync, fd)  # data on disk before the rename publishes it
        finally:
            blobs.close()  # the ranges not yet under way are cancelled
            os.close(fd)
        return h.hexdigest()

    def _write_fd(self, fd: int, data: bytes) -> int:
        view = memoryview(data)
        while view:
            view = view[self._disk(os.write, fd, view):]
        return len(data)

    def _write(self, path: str, data: bytes) -> None:
        fd = self._disk(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[self._disk(os.write, fd, view):]
            self._disk(os.fsync, fd)
        finally:
            os.close(fd)

    def _fetch_index(self, stop: threading.Event | None, again: bool = False) -> bytes | None:
        """The shard's index from the source (``None``: it has none). The first fetch joins the
        same GET under way for the first batch's reads by range (:mod:`._joined`); a fetch
        ``again`` (the last one failed its check) asks the source anew."""
        iurl = index_path(self.url)
        try:
            if again:
                return read_bytes(iurl, stop=stop)
            return joined(iurl, lambda: read_bytes(iurl, stop=stop))
        except SourceNotFoundError:
            return None
