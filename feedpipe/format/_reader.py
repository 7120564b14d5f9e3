"""The shard reader: members sliced by the index, no tar parsing in the hot path.

A local shard is memory-mapped once and each field is a zero-copy ``memoryview`` of the map. A
remote shard (any fsspec URL) is read by byte ranges, one range per sample (a sample's members
are contiguous); transient failures are retried (:mod:`feedpipe._helpers.retry`). Without an
``.idx`` file the shard is scanned once (slow path, strict: see :mod:`feedpipe.format._tar`).

Every read is checked: a shard smaller than its index or manifest says, a member running past
the end of the file, a range request that returns the wrong number of bytes, or (with
``verify=True``) a content hash mismatch raises :class:`ShardFormatError` naming the shard and
the offset.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._helpers.storage import is_local, local_path, read_bytes
from .._helpers.storage_io import RemoteFile
from .._redact import cause
from ..errors import CompressedShardError, ShardFormatError, SourceNotFoundError
from ._compression import readable
from ._index import ShardIndex, group_members, index_path, parse_index
from ._tar import DAMAGED
from ._tar_scan import scan

# madvise(2): fault a range of a map in, in one call (Linux 5.14+; Python 3.11's mmap lacks it)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

# Bytes a shard's map may have mapped, sample by sample, between two MADV_DONTNEED of the whole
# map. Every page touched through a map counts in the process's RSS until unmapped, where a
# loader that read()s its files into buffers shows the same page cache as no RSS at all. So a
# shuffled epoch would grow RSS towards the size of every shard it touched. Dropping the map's
# pages bounds what each open shard adds to RSS: the page cache keeps them, and the next touch
# is a minor fault (peak RSS: benchmarks/bench_peers.py, its memory phase). A touch maps more
# than the sample: the kernel maps the cached pages around a fault too (fault-around, 64 KiB by
# default), and where the page cache holds large folios (a file cached by read() or written on
# ext4 with Linux 6.x), the whole folio, up to about 1 MiB. How much depends on how the file
# came into the page cache, so each reader measures it (:func:`_mapped_bytes`, at its first
# drops, then every _RECHARGE_EVERY drops, or every drop per _RECHARGE_BYTES of map where that
# is rarer: the measure reads 8 bytes per page of the map) and charges each sample its span plus
# what a sample was seen to map beyond it, never less than _FAULT_AROUND_MIN; until it has
# measured, or where it cannot, _FAULT_AROUND. Unmapping is paid per page mapped, and a drop is
# one call: charging the measured figure drops as often as the bound needs, not more. Safe for
# views already handed out: the map is of a file opened read-only, so a dropped page reads back
# the same bytes.
DROP_EVERY = 1 << 20
_FAULT_AROUND = 1 << 20
_FAULT_AROUND_MIN = 64 << 10
_RECHARGE_EVERY = 32
_RECHARGE_BYTES = 8 << 20
_PAGE = mmap.PAGESIZE
ADVISE_GAP = 1 << 16  # byte ranges closer than this are advised as one

Sample = dict[str, Any]


def _load_index(url: str, size: int, open_stream: Any) -> ShardIndex:
    ipath = index_path(url)
    try:
        if is_local(ipath):
            with open(local_path(ipath), "rb") as f:
                text = f.read()  # bytes: parse_index names the .idx if they are not UTF-8
        else:
            text = read_bytes(ipath)
    except FileNotFoundError:
        with open_stream() as f:
            return group_members((m.name, m.offset, m.size) for m in scan(f, size, url))
    return parse_index(text, ipath)


# what a missing shard's message ends with
MISSING = ("re-copy or re-fetch the dataset (or re-create its manifest with `feedpipe index`); "
           "`feedpipe verify DIR` checks every shard")


def map_local(url: str) -> tuple[mmap.mmap | None, int]:
    """A local shard mapped read-only, and its size (no map for an empty file)."""
    fd, mm, size = _open_mapped(url)
    os.close(fd)
    return mm, size


def _open_mapped(url: str) -> tuple[int, mmap.mmap | None, int]:
    """A local shard's open descriptor, its read-only map (none for an empty file) and size."""
    try:
        fd = os.open(local_path(url), os.O_RDONLY)
    except FileNotFoundError as e:
        raise SourceNotFoundError(f"{url}: shard not found; {MISSING}") from cause(e)
    except IsADirectoryError as e:
        raise ShardFormatError(f"{url}: is a directory, not a shard") from cause(e)
    try:
        size = os.fstat(fd).st_size
        return fd, (mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None), size
    except BaseException:
        os.close(fd)
        raise


def check_size(url: str, size: int, expected: int) -> None:
    """Raise :class:`ShardFormatError` naming the shard unless it has the manifest's size."""
    if size != expected:
        what = "truncated" if size < expected else "larger than expected"
        raise ShardFormatError(
            f"{url}: shard is {what}: {size} bytes, the manifest says {expected} "
            f"(difference at offset {min(size, expected)}); {DAMAGED}"
        )


class ShardReader:
    """Random access to the samples of one shard.

    Args:
        url: a local path or fsspec URL of a ``.tar`` shard.
        name: the shard's name for ``__shard__`` (default: its file name).
        base: the global sample id of this shard's first sample (for ``__index__``).
        expected_bytes: the size the manifest records; a different size is an error.
        sha256: the manifest's content hash; checked when ``verify`` is true.
        verify: hash the whole shard on open and compare with ``sha256``, and check every
            index entry against the tar header in front of it.
        samples: the number of samples the manifest records; an index that lists another
            number is an error.
        lazy: read the index when it is first needed (a sample, the length) instead of now,
            for a caller that only copies byte ranges it already knows (as the loader's
            ``refs`` routes do): the shard is mapped and no more.

    Example:
        >>> import feedpipe, glob
        >>> r = ShardReader(sorted(glob.glob("shards/example/*.tar"))[0])
        >>> sorted(k for k in r.sample(0) if not k.startswith("__"))
        ['cls', 'jpg', 'json']
    """

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        base: int = 0,
        expected_bytes: int | None = None,
        sha256: str | None = None,
        verify: bool = False,
        samples: int | None = None,
        lazy: bool = False,
    ) -> None:
        if readable(url):
            err = CompressedShardError(
                f"{url}: a gzip shard: its samples lie at offsets of the plain tar inside, which "
                "a reader maps; read the dataset with FeedDataset, which decompresses each gzip "
                f"shard once into the shard cache, or decompress it (`gunzip -k {url}`)")
            err.shard, err.offset, err.kind = url, 0, "compressed"
            raise err
        self.url = url
        self.name = name if name is not None else url.rsplit("/", 1)[-1]
        self.base = base
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._populated = False  # every page of the map faulted in (see populate)
        self._served = 0  # bytes sample() served from the map since its pages were last dropped
        self._taken = 0  # samples served since then
        self._charge = _FAULT_AROUND  # what a sample is charged beyond its span (DROP_EVERY)
        self._drops = 0
        self._remote: RemoteFile | None = None
        if is_local(url):
            path = local_path(url)
            self._fd, self._mm, self.size = _open_mapped(url)
            if self._mm is not None:
                self._mv = memoryview(self._mm)
            opener = lambda: open(path, "rb")  # noqa: E731
        else:
            remote = self._remote = RemoteFile(url)
            try:
                self.size = remote.size()
            except SourceNotFoundError as e:
                raise SourceNotFoundError(f"{url}: shard not found ({e}); {MISSING}") from cause(e)
            opener = remote.open
        self._opener = opener
        self._samples = samples
        self._index: ShardIndex | None = None
        try:
            if expected_bytes is not None:
                check_size(url, self.size, expected_bytes)
            if verify and sha256 is not None:
                self._verify_hash(sha256)
            if verify or not lazy:
                self._load()
            if verify:
                self._verify_headers(opener)
        except BaseException:
            self.close()
            raise

    @property
    def index(self) -> ShardIndex:
        """The shard's index (its ``.idx`` file, else a scan of the tar), read on first use."""
        if self._index is None:
            self._load()
        return self._index  # type: ignore[return-value]

    def _load(self) -> None:
        index = _load_index(self.url, self.size, self._opener)
        if index.end > self.size:
            bad = next(o for o, s in zip(index.offsets, index.sizes) if o + s > self.size)
            raise ShardFormatError(
                f"{self.url}: truncated: a member at offset {bad} runs past the end of the file "
                f"({self.size} bytes; the index needs {index.end}); {DAMAGED}")
        if self._samples is not None and len(index) != self._samples:
            raise ShardFormatError(
                f"{self.url}: the index lists {len(index)} samples, the manifest "
                f"{self._samples}; `feedpipe verify DIR` says which is wrong")
        self._keys = index.keys
        self._starts = index.starts
        self._exts = index.exts
        self._offs = index.offsets
        self._sizes = index.sizes
        self._index = index

    def _verify_hash(self, want: str) -> None:
        h = hashlib.sha256()
        if self._mv is not None:
            for i in range(0, self.size, 1 << 24):
                h.update(self._mv[i : i + (1 << 24)])
        elif self._remote is not None:
            with self._remote.open() as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        if h.hexdigest() != want:
            raise ShardFormatError(
                f"{self.url}: content hash mismatch (sha256 {h.hexdigest()[:16]}..., the manifest "
                f"says {want[:16]}...): the shard is corrupted; {DAMAGED}"
            )

    def _verify_headers(self, opener: Any) -> None:
        """Every index entry against the tar: the members the tar's own headers give (name, data
        offset, size, grouping) must be the ones the index lists, so that a ``.idx`` copied from
        another shard or shifted is refused before a byte is served (``feedpipe verify``'s own
        check, :func:`feedpipe.format._verify.index_problems`)."""
        from ._index import index_from_tar
        from ._verify import index_problems

        if self._mm is not None:
            from ._index import index_from_buffer

            tar = index_from_buffer(self._mm, self.url)
        else:
            with opener() as f:
                tar = index_from_tar(f, self.size, self.url)
        problems = index_problems(self.index, tar, self.url, index_path(self.url))
        if problems:
            p = problems[0]
            raise ShardFormatError(f"{p.message} (FeedDataset(verify=True): nothing of this "
                                   "shard was served; re-fetch the dataset if it came from a "
                                   "copy)")

    def __len__(self) -> int:
        return len(self.index)

    @property
    def buffer(self) -> mmap.mmap | None:
        """The shard's read-only map (``None`` for a remote or empty shard). Slices of it are the
        members' bytes at the index's offsets."""
        return self._mm

    @property
    def populated(self) -> bool:
        """Whether every page of the map has been faulted in (:meth:`populate`)."""
        return self._populated

    def populate(self) -> bool:
        """Fault every page of the map in, in one call, once (``MADV_POPULATE_READ``), for a
        reader that will copy every member of the shard: later reads fault nothing, and the map
        is kept whole (its pages are not dropped). False where the kernel cannot."""
        if self._mm is None:
            return False
        if not self._populated:
            try:
                self._mm.madvise(MADV_POPULATE_READ, 0, len(self._mm))
            except (OSError, ValueError):  # kernels before 5.14: page faults do it, slower
                return False
            self._populated = True
        return True

    def advise(self, ranges: list[tuple[int, int]]) -> None:
        """Ask the kernel to read these byte ranges of the map ahead (``MADV_WILLNEED``; ranges
        closer than 64 KiB are merged). Advice only: a refusal costs speed."""
        mm = self._mm
        if mm is None or self._populated or not ranges:
            return
        ranges.sort()
        lo, hi = ranges[0]
        for a, b in ranges[1:]:
            if a - hi > ADVISE_GAP:
                _willneed(mm, lo, hi)
                lo = a
            hi = max(hi, b)
        _willneed(mm, lo, hi)

    def check(self) -> None:
        """Raise :class:`ShardFormatError` if the shard's file no longer has the size it was
        opened with (truncated or rewritten in place): reading a map past the new end of its
        file kills the process with ``SIGBUS``, so callers check before a batch reads."""
        if self._fd < 0:
            return
        try:
            size = os.fstat(self._fd).st_size
        except OSError as e:
            raise ShardFormatError(f"{self.url}: cannot check the shard's size: {e}") from cause(e)
        if size != self.size:
            raise ShardFormatError(
                f"{self.url}: the shard changed while it was being read: {size} bytes now, "
                f"{self.size} when it was opened (truncated or rewritten in place); restore it "
                "(or re-fetch the dataset) and resume from the last checkpoint")

    def sample(self, i: int) -> Sample:
        """Sample ``i`` of this shard as a dict of field -> bytes (``memoryview`` when local)."""
        if self._index is None:
            self._load()
        a, b = self._starts[i], self._starts[i + 1]
        d: Sample = {"__key__": self._keys[i], "__shard__": self.name, "__index__": self.base + i}
        offs, sizes, exts = self._offs, self._sizes, self._exts
        mv = self._mv
        if mv is not None:
            for m in range(a, b):
                o = offs[m]
                d[exts[m]] = mv[o : o + sizes[m]]
            if not self._populated:  # a populated map is kept whole on purpose
                if self._served >= DROP_EVERY:  # before this one: the ones served are touched
                    self.drop_pages()
                self._served += offs[b - 1] + sizes[b - 1] - offs[a] + self._charge
                self._taken += 1
            return d
        if self._remote is None:  # an empty local file has no map; its index is empty too
            raise IndexError(i)
        lo = offs[a]
        hi = offs[b - 1] + sizes[b - 1]
        blob = self._remote.read(lo, hi)
        view = memoryview(blob)
        for m in range(a, b):
            o = offs[m] - lo
            d[exts[m]] = view[o : o + sizes[m]]
        return d

    def span(self, i: int) -> tuple[int, int]:
        """The byte range ``[lo, hi)`` of sample ``i``'s members (empty for a sample without)."""
        if self._index is None:
            self._load()
        a, b = self._starts[i], self._starts[i + 1]
        if b <= a:
            return 0, 0
        return self._offs[a], self._offs[b - 1] + self._sizes[b - 1]

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.sample(i)

    def drop_pages(self) -> None:
        """Unmap the pages of the map touched so far (a reader does it itself after each MiB it
        serves), for a caller that
        reads samples some time after :meth:`sample` handed them out (a whole batch fetched,
        then decoded): their touches come too late for the accounting in :meth:`sample`."""
        if self._mm is not None and self._mv is not None and not self._populated:
            self._drops += 1
            d = self._drops
            every = max(_RECHARGE_EVERY, len(self._mv) // _RECHARGE_BYTES)
            if self._taken and (d & (d - 1) == 0 or d % every == 0):
                self._recharge()
            self._served = self._taken = 0
            self._mm.madvise(mmap.MADV_DONTNEED)

    def _recharge(self) -> None:
        """Set what a sample is charged beyond its span from what the map has mapped since the
        last drop (see :data:`DROP_EVERY`)."""
        assert self._mv is not None
        mapped = _mapped_bytes(self._mv)
        if mapped is None:
            return
        spans = self._served - self._taken * self._charge
        seen = (mapped - spans) // self._taken
        # what one touch maps varies with the folios it meets: up at once, down by halves
        charge = seen if seen >= self._charge else (seen + self._charge) // 2
        self._charge = min(DROP_EVERY, max(_FAULT_AROUND_MIN, charge))

    def close(self) -> None:
        """Release the map (views still held by callers keep it alive until they go)."""
        if self._mv is not None:
            try:
                self._mv.release()
            except BufferError:
                pass
            self._mv = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("ShardReader holds a memory map; pass the URL to worker processes instead")


def _willneed(mm: mmap.mmap, lo: int, hi: int) -> None:
    start = lo - lo % mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_WILLNEED, start, hi - start)
    except (OSError, ValueError):  # advice only: a refusal costs speed, never correctness
        pass


def _mapped_bytes(view: memoryview) -> int | None:
    """Bytes of the map behind ``view`` mapped into this process now (its present pages, from
    ``/proc/self/pagemap``), or None where that file cannot be read (not Linux, or locked
    down). Opened anew each time: ``/proc/self`` names the process that opens it, and a
    forked worker reads its own pages."""
    if not len(view):
        return None
    base = np.frombuffer(view, np.uint8, count=1).ctypes.data
    first, last = base // _PAGE, (base + len(view) - 1) // _PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, (last - first + 1) * 8, first * 8)
    except OSError:
        return None
    finally:
        os.close(fd)
    entries = np.frombuffer(raw, np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63))) * _PAGE  # bit 63: page present


def open_shard(url: str, **kwargs: Any) -> ShardReader:
    """Open one shard for random access.

    Args:
        url: a local path or fsspec URL of a ``.tar`` shard.
        **kwargs: :class:`ShardReader`'s keyword arguments (``verify=``, ``expected_bytes=``...).

    Example:
        >>> with open_shard("shards/example/data-000000.tar") as r:
        ...     len(r), bytes(r.sample(0)["cls"])
        (10, b'0')
    """
    return ShardReader(url, **kwargs)
