"""What the L1 shard cache checks before it serves a file, and the stamps that mark a checked one.

- a ``.tar`` must have the manifest's size and, when the manifest records one, its sha256;
- a ``.idx`` must be UTF-8 text in DALI's index format listing the manifest's number of samples,
  and must match the manifest's index hash when it records one (``ShardRecord.index_sha256``),
  else the shard's own tar headers, entry by entry (member name, data offset, size), as
  ``feedpipe verify`` checks it.

A checked file carries a *stamp* in its mtime: a value derived from its entry key (and, for an
index, from a hash of its content). Writing to a file changes its mtime, and an index is small
enough to hash each time it is served, so a file damaged in the cache directory is noticed on the
next use and checked again, never served as it is.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ...errors import ShardFormatError
from ...format._index import index_from_tar, parse_index

STAMP_BASE = 1_000_000_000  # seconds; a checked file's mtime is this plus an even offset

TAR, IDX = "tar", "idx"  # which file a problem is in


def stamp(key: str, content: bytes | None = None) -> int:
    """The mtime of a checked entry file: from its key, and the content for an index.

    Whole, even seconds survive filesystems with coarse timestamps.

    Example:
        >>> stamp("k") == stamp("k"), stamp("k", b"a") == stamp("k", b"b")
        (True, False)
    """
    h = hashlib.sha256(key.encode())
    if content is not None:
        h.update(hashlib.blake2b(content, digest_size=16).digest())
    return STAMP_BASE + 2 * int(h.hexdigest()[:6], 16)


def file_sha256(path: str) -> str:
    """The sha256 of a local file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def index_hash(rec: Any) -> str | None:
    """The sha256 of the shard's index as the manifest records it, when it records one."""
    value = getattr(rec, "index_sha256", None)
    return value if isinstance(value, str) and value else None


def index_problem(data: bytes, rec: Any, tar_path: str, where: str,
                  tar_where: str) -> tuple[str, str] | None:
    """What is wrong with index bytes ``data`` of the shard at ``tar_path`` (a local file whose
    size and hash were checked already), as ``(TAR or IDX, message)``; ``None`` when sound. The
    message names the file (``where`` or ``tar_where``) and what is wrong; the checks are
    ``feedpipe verify``'s (:func:`feedpipe.format._verify.index_problems`, one tar parser).

    Args:
        data: the index file's bytes.
        rec: the shard's manifest record (``samples``, ``sha256``, ``index_sha256``).
        tar_path: the local shard file the index must describe.
        where, tar_where: the index's and the shard's names for messages (their URLs).
    """
    from ...format._verify import index_problems

    try:
        idx = parse_index(data, where)
    except ShardFormatError as e:
        return IDX, str(e)
    if len(idx) != rec.samples:
        return IDX, f"{where}: lists {len(idx)} samples, the manifest {rec.samples}"
    recorded = index_hash(rec)
    if recorded is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != recorded:
            return IDX, (f"{where}: sha256 {got[:16]}... differs from the manifest's index hash "
                         f"{recorded[:16]}...")
        return None
    try:
        with open(tar_path, "rb") as f:
            tar = index_from_tar(f, os.fstat(f.fileno()).st_size, tar_where)
    except ShardFormatError as e:
        return TAR, str(e)
    problems = index_problems(idx, tar, tar_where, where)
    return (IDX, problems[0].message) if problems else None
