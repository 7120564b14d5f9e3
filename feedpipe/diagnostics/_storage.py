"""The storage half of ``feedpipe probe``: sequential read MB/s over block sizes and thread
counts, small-file open+read rate, random read latency; cold (pages dropped first) and warm.

Every measurement is a loop that stops at its own deadline. A cell ends once its in-flight reads
return, so it can overrun by one block per thread. Local files are read with ``os.preadv`` into
one preallocated page-aligned buffer per thread, as ``fio --ioengine=psync`` does: no allocation
in the timed loop, and the GIL released during the read. Other URLs are read by byte ranges, one
request each (:class:`~feedpipe._helpers.storage_probe.RawStore`: no retry inside the timing),
where no local page cache applies.

Sequential reads treat the files as one concatenation: thread ``t`` of ``T`` reads the ``t``-th
``1/T`` of it, block by block (fio's ``numjobs`` with ``offset_increment``). Cold cells drop the
files' pages first and stop at the end of their region. Warm cells read a window that was read
(warmed) beforehand, and wrap around in it.
"""

from __future__ import annotations

import bisect
import mmap
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._helpers.storage_probe import RawStore
from ..errors import AccessDeniedError, InputError
from . import _pagecache as pagecache

MB = 1e6
FOLIO = 2 << 20  # the largest page-cache folio on common kernels (x86-64 PMD)


@dataclass(frozen=True)
class FileSet:
    """Files read as one concatenation: ``paths[i]`` holds ``sizes[i]`` bytes. ``store`` is the
    store of remote paths, ``None`` for local ones."""

    paths: tuple[str, ...]
    sizes: tuple[int, ...]
    store: RawStore | None = None

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def local(self) -> bool:
        return self.store is None

    def pairs(self) -> list[tuple[str, int]]:
        return list(zip(self.paths, self.sizes))


class _Open:
    """The open files of a :class:`FileSet`, addressed by an offset in the concatenation."""

    def __init__(self, files: FileSet) -> None:
        self.files = files
        self.starts = [0]
        for s in files.sizes:
            self.starts.append(self.starts[-1] + s)
        self.fds: list[int] = []
        if files.local:
            try:
                for p in files.paths:
                    self.fds.append(os.open(p, os.O_RDONLY))
            except PermissionError as e:
                self.close()
                raise AccessDeniedError(
                    f"{e.filename}: permission denied: the probe cannot read it") from e
            except OSError as e:
                self.close()
                raise InputError(f"{e.filename}: cannot open: {e.strerror}") from e

    def locate(self, pos: int) -> tuple[int, int]:
        i = bisect.bisect_right(self.starts, pos) - 1
        return i, pos - self.starts[i]

    def read_into(self, i: int, offset: int, buf: memoryview) -> int:
        if self.fds:
            return os.preadv(self.fds[i], [buf], offset)
        assert self.files.store is not None
        data = self.files.store.read(self.files.paths[i], offset, offset + len(buf))
        buf[: len(data)] = data
        return len(data)

    def drop(self) -> bool:
        """Drop the cached pages of every file; whether it could be done."""
        return bool(self.fds) and all(pagecache.drop_fd(fd) for fd in self.fds)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __enter__(self) -> _Open:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buffer(n: int) -> memoryview:
    """A page-aligned read buffer (anonymous mmap).

    Alignment matters: the kernel copies from the page cache into an unaligned buffer more
    slowly, and that cost is not the storage's (``benchmarks/bench_probe_fio.py`` runs fio with
    ``--iomem_align`` for the same reason)."""
    return memoryview(mmap.mmap(-1, n))


def _regions(window: int, threads: int) -> list[tuple[int, int]]:
    step = window // threads
    starts = [min(window, (t * step) // 4096 * 4096) for t in range(threads)]
    ends = starts[1:] + [window]
    return list(zip(starts, ends))


def _sequential_cell(opened: _Open, block: int, threads: int, seconds: float, window: int,
                     wrap: bool) -> dict[str, Any]:
    regions = _regions(window, threads)
    done = [0] * threads
    began = [0.0] * threads
    ended = [0.0] * threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def run(t: int) -> None:
        start, end = regions[t]
        buf = _buffer(block)
        pos, n = start, 0
        barrier.wait()
        began[t] = time.perf_counter()
        deadline = began[t] + seconds
        try:
            while pos < end:
                i, lo = opened.locate(pos)
                want = min(block, opened.files.sizes[i] - lo, end - pos)
                got = opened.read_into(i, lo, buf if want == block else buf[:want])
                if got <= 0:
                    raise OSError(f"{opened.files.paths[i]}: read at offset {lo} returned nothing "
                                  "(the file shrank while it was probed?)")
                n += got
                pos += got
                if pos >= end and wrap:
                    pos = start
                if time.perf_counter() >= deadline:
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)
        ended[t] = time.perf_counter()
        done[t] = n

    workers = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise InputError(f"reading failed: {errors[0]}") from errors[0]
    seconds_taken = max(ended) - min(began)
    total = sum(done)
    return {"block_bytes": block, "threads": threads, "bytes": total,
            "seconds": round(seconds_taken, 6),
            "mb_per_s": total / MB / seconds_taken if seconds_taken > 0 else None}


def warm_up(files: FileSet, window: int, seconds: float) -> int:
    """Read ``[0, window)`` of the concatenation once so that it is in the page cache; stop at the
    deadline. Returns the size of the warmed prefix (whole 16 MiB blocks)."""
    block = 16 << 20
    deadline = time.perf_counter() + seconds
    with _Open(files) as opened:
        buf = _buffer(block)
        pos = 0
        while pos < window and time.perf_counter() < deadline:
            i, lo = opened.locate(pos)
            want = min(block, files.sizes[i] - lo, window - pos)
            got = opened.read_into(i, lo, buf[:want])
            if got <= 0:
                break
            pos += got
    return pos


def sequential_sweep(files: FileSet, blocks: Sequence[int], threads: Sequence[int],
                     seconds: float, *, cold: bool,
                     window: int | None = None) -> list[dict[str, Any]]:
    """One cell per (block size, thread count), ``seconds`` shared among them. ``cold``: the
    files' pages are dropped before each cell and each thread reads its region once; otherwise
    each thread wraps around in its region of ``[0, window)``, which should be warm."""
    window = files.total if window is None or cold else min(window, files.total)
    cells = [(b, t) for b in blocks for t in threads]
    per_cell = seconds / len(cells)
    out = []
    with _Open(files) as opened:
        for block, nthreads in cells:
            if cold:
                opened.drop()
            cell = _sequential_cell(opened, block, nthreads, per_cell, window, wrap=not cold)
            cell["cache"] = ("cold" if cold else "warm") if files.local else "remote"
            out.append(cell)
    return out


def _read_files(files: FileSet, paths: Sequence[str], deadline: float, cold: bool) -> list[Any]:
    """One thread's loop of :func:`small_files`: ``[files, bytes, errors, first error]``."""
    n = nbytes = errors = 0
    first_error = ""
    buf = _buffer(1 << 20)
    remote = files.store
    k = 0
    while paths:
        path = paths[k % len(paths)]
        k += 1
        try:
            if remote is not None:
                nbytes += len(remote.read(path))
            else:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if cold:
                        pagecache.drop_fd(fd)
                    while (got := os.readv(fd, [buf])) > 0:
                        nbytes += got
                finally:
                    os.close(fd)
            n += 1
        except OSError as e:
            errors += 1
            first_error = first_error or f"{path}: {e.strerror or e}"
        if time.perf_counter() >= deadline or (n == 0 and errors >= len(paths)):
            break
    return [n, nbytes, errors, first_error]


def small_files(files: FileSet, seconds: float, *, cold: bool, threads: int = 1) -> dict[str, Any]:
    """Open, read whole and close one file after another, cycling through ``files`` until the
    deadline; ``threads`` threads take every ``threads``-th file each.

    ``cold``: each file's pages are dropped between open and read, inside the timing (an
    fadvise is a small part of a file's open and read). Directory entries and inodes stay
    cached."""
    threads = max(1, min(threads, len(files.paths)))
    results: list[list[Any]] = [[0, 0, 0, ""] for _ in range(threads)]
    t0 = time.perf_counter()
    deadline = t0 + seconds

    def run(i: int) -> None:
        results[i] = _read_files(files, files.paths[i::threads], deadline, cold)

    if threads == 1:
        run(0)
    else:
        pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for w in pool:
            w.start()
        for w in pool:
            w.join()
    elapsed = time.perf_counter() - t0
    n = sum(r[0] for r in results)
    nbytes = sum(r[1] for r in results)
    errors = sum(r[2] for r in results)
    if n == 0:
        first = next((r[3] for r in results if r[3]), "")
        raise InputError(f"no file could be read ({errors} failed; first: {first})")
    return {"cache": ("cold" if cold else "warm") if files.local else "remote",
            "threads": threads, "files": n, "bytes": nbytes, "seconds": round(elapsed, 6),
            "files_per_s": n / elapsed, "mb_per_s": nbytes / MB / elapsed,
            "mean_file_bytes": nbytes / n, "errors": errors}


def random_reads(files: FileSet, block: int, seconds: float, *, cold: bool,
                 window: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Single-threaded reads of ``block`` bytes at random block-aligned offsets (queue depth 1),
    each timed alone.

    ``cold``: readahead is off, and the 2 MiB-aligned span around each read is dropped just
    before the read (outside the timing). Otherwise reads stay in ``[0, window)``, which should
    be warm."""
    import numpy as np

    window = files.total if window is None or cold else min(window, files.total)
    rng = random.Random(seed)
    lat: list[float] = []
    nbytes = 0
    buf = _buffer(block)
    perf = time.perf_counter
    with _Open(files) as opened:
        for fd in opened.fds:
            pagecache.advise_random(fd, True)
        try:
            deadline = perf() + seconds
            while perf() < deadline and len(lat) < 1_000_000:
                i, lo = opened.locate(rng.randrange(window))
                lo = lo // block * block  # aligned within its file, as a reader's records are
                want = min(block, files.sizes[i] - lo)
                if cold and opened.fds:
                    # whole folios, or the kernel drops nothing: the page cache holds large
                    # folios of up to 2 MiB (PMD size), and a partly covered one stays
                    first = lo // FOLIO * FOLIO
                    span = -(-(lo + want) // FOLIO) * FOLIO - first
                    pagecache.drop_fd(opened.fds[i], first, span)
                t = perf()
                got = opened.read_into(i, lo, buf[:want])
                lat.append(perf() - t)
                nbytes += got
        finally:
            for fd in opened.fds:
                pagecache.advise_random(fd, False)
    ms = np.asarray(lat) * 1e3
    return {"cache": ("cold" if cold else "warm") if files.local else "remote",
            "block_bytes": block, "reads": len(lat), "bytes": nbytes,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "max_ms": float(ms.max())}


def best(cells: Sequence[dict[str, Any]], max_threads: int | None = None) -> dict[str, Any] | None:
    """The fastest cell, among those with at most ``max_threads`` threads when given."""
    ok = [c for c in cells if c.get("mb_per_s") is not None
          and (max_threads is None or c["threads"] <= max_threads)]
    return max(ok, key=lambda c: c["mb_per_s"]) if ok else None
