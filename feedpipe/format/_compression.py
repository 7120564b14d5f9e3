"""Compressed tar shards: how they are recognised (by name and by leading bytes), how gzip ones
are read, and the sentence that refuses the others.

feedpipe reads each sample at its byte offset in a plain tar, which a compressed stream does not
allow. So a gzip shard (``.tar.gz``, ``.tgz``, as WebDataset reads them) is decompressed once:
``feedpipe index`` scans the tar inside it, and a reader decompresses it into the L1 shard cache,
where the index's offsets hold (:mod:`feedpipe.caches.l1._entry`). Other compressions are refused
with the command that converts them.
"""

from __future__ import annotations

import hashlib
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, cast

from ..errors import CompressedShardError, ShardFormatError
from ._tar import damaged

# name suffix -> (compression, the command that undoes it)
SUFFIXES = {".tar.gz": ("gzip", "gunzip"), ".tgz": ("gzip", "gunzip"),
            ".tar.bz2": ("bzip2", "bunzip2"), ".tbz2": ("bzip2", "bunzip2"),
            ".tar.xz": ("xz", "unxz"), ".txz": ("xz", "unxz"),
            ".tar.zst": ("zstd", "unzstd"), ".tzst": ("zstd", "unzstd")}
# leading bytes, compression, the command that undoes it
MAGIC = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"),
         (b"\xfd7zXZ\x00", "xz", "unxz"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"))


READABLE = (".tar.gz", ".tgz")  # the suffixes of shards read as they are (gzip)


def compressed_suffix(name: str) -> str | None:
    """The compressed-tar suffix ``name`` ends with, or None.

    Example:
        >>> compressed_suffix("shards/a.TGZ"), compressed_suffix("a.tar")
        ('.tgz', None)
    """
    low = name.lower()
    return next((s for s in SUFFIXES if low.endswith(s)), None)


def compressed_error(path: str, kind: str | None = None) -> CompressedShardError:
    """The refusal of a compressed shard, saying how to convert it.

    Args:
        path: the shard; a name with a compressed suffix when ``kind`` is None.
        kind: the compression found in the file's leading bytes (under a ``.tar`` name).
    """
    where = path.rsplit("/", 1)[0] if "/" in path else "."
    if kind is None:
        suffix = compressed_suffix(path) or ".tar.gz"
        tool = SUFFIXES[suffix][1]
        plain = path[: len(path) - len(suffix)] + ".tar"
        how, what = f"`{tool} -k {path}` writes {plain}", ""
    else:
        tool = next(t for _, k, t in MAGIC if k == kind)
        how = f"`{tool} < {path} > {path}.plain && mv {path}.plain {path}`"
        what = f" the file is {kind}-compressed, not a plain tar:"
    err = CompressedShardError(
        f"{path}:{what} compressed shards are not supported for random access (feedpipe reads "
        f"each sample at its byte offset in a plain tar). Decompress it ({how}), then run "
        f"`feedpipe index {where}`; or convert the source files with `feedpipe shard SRC OUT`")
    err.shard, err.offset, err.kind = path, 0, "compressed"
    return err


def readable(name: str) -> bool:
    """Whether ``name`` (a path or URL, its query string aside) is a gzip shard, which feedpipe
    reads by decompressing it once.

    Example:
        >>> readable("s/a.tar.gz"), readable("https://h/a.TGZ?token=1"), readable("a.tar.xz")
        (True, True, False)
    """
    from .._helpers.storage import split_query

    return compressed_suffix(split_query(name)[0]) in READABLE


def refuse_unreadable(name: str) -> None:
    """Raise :func:`compressed_error` for a compressed shard name that is not a gzip one."""
    from .._helpers.storage import split_query

    if compressed_suffix(split_query(name)[0]) and not readable(name):
        raise compressed_error(name)


class Gunzip:
    """Incremental gzip decompression of a shard (several gzip members one after the other, as
    ``cat a.gz b.gz`` makes, read as one stream, as ``gunzip`` reads them).

    Args:
        where: the shard, for messages.

    Example:
        >>> import gzip
        >>> g = Gunzip("a.tar.gz")
        >>> raw = gzip.compress(b"ab") + gzip.compress(b"c")
        >>> g.feed(raw[:5]) + g.feed(raw[5:]) + g.end()
        b'abc'
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self._d = zlib.decompressobj(wbits=31)
        self._at = 0  # compressed bytes fed so far

    def feed(self, chunk: bytes) -> bytes:
        """The plain bytes that ``chunk`` (the next compressed bytes) completes."""
        out = []
        while chunk:
            try:
                out.append(self._d.decompress(chunk))
            except zlib.error as e:
                raise self._damaged(f"bad gzip data near compressed offset {self._at} ({e})") from e
            self._at += len(chunk) - len(self._d.unused_data)
            chunk = self._d.unused_data
            if self._d.eof and chunk:
                if not chunk.strip(b"\0"):  # zero padding after the last member, as gunzip
                    break
                self._d = zlib.decompressobj(wbits=31)
        return b"".join(out)

    def end(self) -> bytes:
        """The rest, checking that the stream ended: a gzip stream cut short is an error."""
        tail = self._d.flush()
        if not self._d.eof:
            raise self._damaged(f"the gzip stream ends early (after {self._at} compressed bytes)")
        return tail

    def _damaged(self, what: str) -> ShardFormatError:
        return damaged(self.where, None, "truncated", f"{self.where}: {what}")


def unpack(src: BinaryIO, dst: BinaryIO, where: str, chunk: int = 1 << 22) -> tuple[str, int, int]:
    """Decompress the gzip shard read from ``src`` into ``dst``: the sha256 and size of the
    compressed bytes and the size of the plain tar."""
    g, h, n, plain = Gunzip(where), hashlib.sha256(), 0, 0
    while block := src.read(chunk):
        h.update(block)
        n += len(block)
        out = g.feed(block)
        dst.write(out)
        plain += len(out)
    out = g.end()
    dst.write(out)
    return h.hexdigest(), n, plain + len(out)


@contextmanager
def unpacked(src: BinaryIO, where: str) -> Iterator[tuple[BinaryIO, str, int, int]]:
    """The plain tar of a gzip shard in a temporary file (removed afterwards), for a scan of its
    headers: ``(file, compressed sha256, compressed size, plain size)``."""
    with tempfile.NamedTemporaryFile(prefix="feedpipe-unpack-", suffix=".tar") as named:
        tmp = cast(BinaryIO, named)
        try:
            sha, n, plain = unpack(src, tmp, where)
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError)):
                raise
            raise OSError(e.errno, f"{where}: cannot decompress it into a temporary file in "
                                   f"{tempfile.gettempdir()} ({e.strerror or e}); set TMPDIR to "
                                   "a directory with room for the plain tar") from e
        tmp.seek(0)
        yield tmp, sha, n, plain

