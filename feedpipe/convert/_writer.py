"""Writing shards: tar parts written in parallel, then joined into a shard atomically.

A shard is written as one or more *parts* (runs of complete tar members, no end-of-archive
blocks), each by one worker process. When every part of a shard is done, :func:`finish_shard`
joins them into a hidden temp file and appends the end-of-archive blocks. It hashes the file,
writes the index, and renames: the ``.idx`` first, the ``.tar`` last. A shard is committed
exactly when its ``.tar`` exists under its final name. So a reader never sees half a shard, and
a run killed at any moment resumes by redoing only the uncommitted shards.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._redact import redact_doc
from ..errors import InputError, OutputError
from ..format._image_sizes import record_shard_sizes
from ..format._index import ShardIndex, group_members, write_index
from ..format._manifest import ShardRecord
from ..format._tar import BLOCK, END_OF_ARCHIVE, member_header
from ..format._video_frames import record_shard_frames
from ._sources import NotRegularFileError, SampleSpec, Source

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_ZEROS = bytes(BLOCK)
_JOIN_BELOW = 64 << 10  # members up to this size go out in one write (a copy is cheaper)


@dataclass
class PartResult:
    members: list[tuple[str, int, int]] = field(default_factory=list)  # name, data offset, size
    skipped: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0
    bytes: int = 0


def output_error(e: OSError, path: str) -> OutputError:
    if e.errno in _NO_SPACE:
        return OutputError(e.errno, f"{path}: disk full (or file size limit) while writing: {e}")
    return OutputError(e.errno, f"{path}: cannot write: {e}")


@contextmanager
def removed_on_error(path: str, named: str | None = None) -> Iterator[None]:
    """Remove the file ``path`` if the block fails in any way.

    An ``OSError`` leaves as an :class:`OutputError` naming ``named``: the file the user knows,
    such as the shard a temp file becomes (default ``path``). An ``OutputError`` leaves as it
    is."""
    try:
        yield
    except OutputError:
        unlink_quiet(path)
        raise
    except OSError as e:
        unlink_quiet(path)
        raise output_error(e, named or path) from e
    except BaseException:
        unlink_quiet(path)
        raise


def write_part(source: Source, samples: list[SampleSpec], path: str, on_error: str) -> PartResult:
    """Write the members of ``samples`` to ``path``; a sample with an unreadable file is skipped
    whole (``on_error="skip"``) or raises :class:`InputError` naming the file. A source that
    makes its own members (a ``write_part`` method: the token documents of
    :class:`~feedpipe.convert._token_writer.TokenSource`) writes the part itself, so every
    executor serves it unchanged."""
    own = getattr(source, "write_part", None)
    if own is not None:
        return own(samples, path, on_error)
    result = PartResult()
    pos = 0
    members = result.members
    read = source.read
    with removed_on_error(path), open(path, "wb") as out:
        write = out.write
        for spec in samples:
            blobs: list[tuple[str, bytes]] = []
            failed = None
            for ref in spec.files:
                try:
                    data = read(ref.path, ref.size)
                except NotRegularFileError as e:
                    failed = (ref.path, str(e.strerror))
                    break
                except OSError as e:
                    failed = (ref.path, f"cannot read: {e.strerror or e}")
                    break
                if not data:
                    failed = (ref.path, "zero-byte file")
                    break
                blobs.append((ref.ext, data))
            if failed is not None:
                if on_error == "raise":
                    raise InputError(f"{source.path(failed[0])}: {failed[1]}; fix or remove it, "
                                     "or use --on-error skip to leave it out")
                result.skipped.append(failed)
                continue
            blobs.extend(spec.extras)
            pos, nbytes = write_members(write, spec.key, blobs, pos, members)
            result.bytes += nbytes
            result.files += len(spec.files)
    return result


def write_members(write: Callable[[bytes], Any], key: str, blobs: list[tuple[str, bytes]],
                  pos: int, members: list[tuple[str, int, int]]) -> tuple[int, int]:
    """Write one sample's tar members (``blobs``: ``(ext, data)`` in member order) at ``pos`` of
    a part, appending ``(name, data offset, size)`` to ``members``; the new position and the data
    bytes written."""
    nbytes = 0
    for ext, data in blobs:
        name = f"{key}.{ext}"
        size = len(data)
        header = member_header(name, size)
        members.append((name, pos + len(header), size))
        tail = -size % BLOCK
        if size <= _JOIN_BELOW:  # one write: header, data and padding joined
            write(b"".join((header, data, _ZEROS[:tail])))
        else:
            write(header)
            write(data)
            if tail:
                write(_ZEROS[:tail])
        pos += len(header) + size + tail
        nbytes += size
    return pos, nbytes


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def hidden(out_dir: str, name: str, suffix: str) -> str:
    """A hidden temp path in ``out_dir`` that no shard glob matches."""
    return os.path.join(out_dir, f".{name}{suffix}")


def finish_shard(
    out_dir: str, name: str, parts: list[tuple[str, PartResult]]
) -> tuple[ShardRecord, ShardIndex, list[tuple[str, str]]]:
    """Join parts into ``out_dir/name`` atomically; write its index; return its record."""
    skipped = [s for _, res in parts for s in res.skipped]

    def index(bases: list[int]) -> ShardIndex:
        return group_members((n, base + o, s) for (_, res), base in zip(parts, bases)
                             for n, o, s in res.members)

    rec, idx = join_ranges(out_dir, name, [(path, 0, -1) for path, _ in parts], index, skipped)
    for part_path, _ in parts:
        unlink_quiet(part_path)
    return rec, idx, skipped


def join_ranges(out_dir: str, name: str, ranges: list[tuple[str, int, int]],
                index: Callable[[list[int]], ShardIndex],
                skipped: list[tuple[str, str]]) -> tuple[ShardRecord, ShardIndex]:
    """Join byte ranges of files into the shard ``out_dir/name`` atomically; its record and
    index.

    ``ranges`` are ``(path, start, length)`` (-1: to the end), each a run of whole tar members.
    ``index(bases)`` gives the shard's index from where each range starts in the shard. The
    index and the ``--resume`` record are written first; the ``.tar`` appears by rename last
    (:func:`seal_ranges`, then :func:`commit`)."""
    final = os.path.join(out_dir, name)
    tmp, bases, total, sha256 = seal_ranges(out_dir, name, ranges)
    with removed_on_error(tmp, final):
        idx = index(bases)
        record = commit(out_dir, name, tmp, total, sha256, idx, skipped)
    return record, idx


def range_bases(lengths: list[int]) -> list[int]:
    """Where each of consecutive ranges of ``lengths`` bytes starts in the file they are joined
    into: what :func:`seal_ranges` returns, for a caller that knows the lengths beforehand."""
    bases, at = [], 0
    for n in lengths:
        bases.append(at)
        at += n
    return bases


def seal_ranges(out_dir: str, name: str, ranges: list[tuple[str, int, int]]
                ) -> tuple[str, list[int], int, str]:
    """Join byte ranges of files (as :func:`join_ranges` takes them) into a sealed hidden temp
    file for the shard ``out_dir/name``, synced to disk: its path, where each range starts in
    it, its size and its sha256. The caller commits it (:func:`commit`), or removes it.

    Where each range lands is known before a byte moves, so the bytes are copied by the kernel
    (``os.copy_file_range``, at their offsets, on a helper thread) while this thread reads them
    once more to hash them: the two passes overlap rather than follow each other. The copy asks
    the kernel to start writing each piece back to disk as soon as it is copied, so the writeback
    overlaps the hashing too and the final ``fsync`` has little left to wait for. Neither pass
    counts the ranges in this process's memory (a map of the files would)."""
    final = os.path.join(out_dir, name)
    tmp = hidden(out_dir, name, f".tmp-{os.getpid()}")
    spans = _spans(ranges, final)
    bases = range_bases([end - start for _, start, end in spans])
    at = bases[-1] + spans[-1][2] - spans[-1][1] if spans else 0
    h = hashlib.sha256()
    with removed_on_error(tmp, final):
        with open(tmp, "wb") as out:
            copy = _Copy(out.fileno(), spans, bases, final)
            if at >= _THREAD_FROM:
                copy.start()
                try:
                    _hash_spans(spans, h, final)
                finally:
                    copy.join()
            else:
                copy.run()
                _hash_spans(spans, h, final)
            if copy.error is not None:
                raise copy.error
            out.seek(at)
            total = seal(out, h)
    return tmp, bases, total, h.hexdigest()


def _spans(ranges: list[tuple[str, int, int]], final: str) -> list[tuple[str, int, int]]:
    """``ranges`` as ``(path, start, end)``, each checked against its file's size."""
    out = []
    for path, start, length in ranges:
        size = os.stat(path).st_size
        end = size if length < 0 else start + length
        if end > size:
            raise OutputError(f"{path}: ends {end - size} bytes early at {size} while joining "
                              f"{final}")
        out.append((path, start, max(start, end)))
    return out


def _hash_spans(spans: list[tuple[str, int, int]], h: Any, final: str) -> None:
    """Hash the bytes of ``spans`` into ``h``, in order, through one small reused buffer."""
    buf = memoryview(bytearray(_HASH_BUFFER))
    for path, start, end in spans:
        if end <= start:
            continue
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            pos = start
            while pos < end:
                n = f.readinto(buf[:min(end - pos, len(buf))])
                if not n:
                    raise OutputError(f"{path}: ends {end - pos} bytes early at {pos} while "
                                      f"joining {final}")
                h.update(buf[:n])
                pos += n


class _Copy(threading.Thread):
    """Copies ``spans`` to the file ``dst_fd`` at ``bases`` (by the kernel where it can, else
    through a buffer); a failure is kept in ``error`` for the joining thread to raise."""

    def __init__(self, dst_fd: int, spans: list[tuple[str, int, int]], bases: list[int],
                 final: str) -> None:
        super().__init__(name="feedpipe-join-copy", daemon=True)
        self.dst_fd, self.spans, self.bases, self.final = dst_fd, spans, bases, final
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for (path, start, end), base in zip(self.spans, self.bases):
                if end > start:
                    self._copy(path, start, end, base)
        except BaseException as e:  # raised by the joining thread
            self.error = e

    def _copy(self, path: str, start: int, end: int, dst: int) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            pos = start
            while pos < end and _KERNEL_COPY:
                try:
                    n = os.copy_file_range(fd, self.dst_fd, min(end - pos, _WRITEBACK_STEP),
                                           pos, dst)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP,
                                       errno.EINVAL):
                        raise
                    break  # (the bytes copied so far stay; the rest goes through a buffer)
                if n == 0:
                    raise OutputError(f"{path}: ends {end - pos} bytes early at {pos} while "
                                      f"joining {self.final}")
                start_writeback(self.dst_fd, dst, n)
                pos += n
                dst += n
            while pos < end:
                chunk = os.pread(fd, min(end - pos, 1 << 22), pos)
                if not chunk:
                    raise OutputError(f"{path}: ends {end - pos} bytes early at {pos} while "
                                      f"joining {self.final}")
                written = 0
                while written < len(chunk):
                    written += os.pwrite(self.dst_fd, chunk[written:], dst + written)
                start_writeback(self.dst_fd, dst, len(chunk))
                pos += len(chunk)
                dst += len(chunk)
        finally:
            os.close(fd)


_KERNEL_COPY = hasattr(os, "copy_file_range")
# a join copies this much at a time, then starts that piece's writeback
_WRITEBACK_STEP = 8 << 20


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` back to disk,
    without waiting for it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the
    ``fsync`` sealing the file later finds them written. Durability still rests on that
    ``fsync``: where the call is missing (another OS, a libc without it) or fails, nothing is
    lost but the overlap."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; (a failure: the fsync does it all)


_SFR: list[Any] = []  # [the libc function or None], looked up on first use


def _sync_file_range() -> Any:
    if not _SFR:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _SFR.append(fn)
    return _SFR[0]
_HASH_BUFFER = 1 << 20
# a join smaller than this copies, then hashes, in one thread (a thread would only add its start)
_THREAD_FROM = 4 << 20


def seal(f: Any, h: Any) -> int:
    """End the shard being written to the file object ``f`` (its bytes hashed into ``h`` so far):
    the end-of-archive blocks, flushed and synced to disk; its size."""
    f.write(END_OF_ARCHIVE)
    h.update(END_OF_ARCHIVE)
    f.flush()
    os.fsync(f.fileno())
    return int(f.tell())


def commit(out_dir: str, name: str, tmp: str, total: int, sha256: str, idx: ShardIndex,
           skipped: list[tuple[str, str]], *, keep_record: bool = True,
           index_text: str | None = None) -> ShardRecord:
    """Commit the sealed shard ``tmp`` as ``out_dir/name``: its index first, then (for
    ``--resume``, unless ``keep_record`` is false) its record, and the ``.tar`` by rename last.
    ``index_text``: the index file's text, where the caller formatted it already. The caller
    removes ``tmp`` if this fails."""
    record = ShardRecord(name, len(idx), total, sha256)
    stem = name[:-4] if name.endswith(".tar") else name
    write_index(os.path.join(out_dir, stem + ".idx"), idx, index_text)
    record_shard_sizes(out_dir, name, tmp, idx)  # planning by shape decodes no image
    record_shard_frames(out_dir, name, tmp, idx)  # planning clips opens no video
    if keep_record:
        save_record(out_dir, record, skipped, idx.fields())
    os.replace(tmp, os.path.join(out_dir, name))
    return record


def record_path(out_dir: str, name: str) -> str:
    return hidden(out_dir, name, ".record.json")


def save_record(
    out_dir: str, record: ShardRecord, skipped: list[tuple[str, str]], fields: set[str]
) -> None:
    """Keep what the manifest needs about a committed shard, for ``--resume``."""
    path = record_path(out_dir, record.name)
    tmp = path + f".tmp-{os.getpid()}"
    doc = {
        "record": record.__dict__,
        "skipped": [redact_doc(list(s)) for s in skipped],
        "fields": sorted(fields),
    }
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_record(
    out_dir: str, name: str
) -> tuple[ShardRecord, list[tuple[str, str]], set[str]] | None:
    """The saved record of a committed shard, or None if the shard must be redone."""
    if not os.path.exists(os.path.join(out_dir, name)):
        return None
    try:
        with open(record_path(out_dir, name), encoding="utf-8") as f:
            doc = json.load(f)
        rec = ShardRecord(**doc["record"])
        if os.path.getsize(os.path.join(out_dir, name)) != rec.bytes:
            return None
        return rec, [(a, b) for a, b in doc["skipped"]], set(doc["fields"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
