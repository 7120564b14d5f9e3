"""Tar members: deterministic ustar/GNU headers for writing, what the scanner finds, and the
errors a damaged shard raises.

Writing uses the standard library's header encoder with fixed metadata (mode 0644, uid/gid 0,
mtime 0, no user names), so the same bytes give the same shard on every machine. A member whose
name fits the ustar ``prefix``/``name`` fields gets a plain ustar header (what DALI's
``wds2idx``, GNU tar and every reader understand); a longer one gets a GNU long-name record.
PAX headers are never written (DALI rejects them).

The scanner (:func:`~feedpipe.format._tar_scan.scan`, in :mod:`~feedpipe.format._tar_scan`)
is the only tar parser: ``feedpipe index``,
``feedpipe verify`` and the reader's slow path for shards without an index all use it, so they
accept and refuse the same bytes. It reads what GNU tar and :mod:`tarfile` read: ustar prefixes,
GNU long names, PAX ``path`` and ``size``, GNU base-256 numbers. Wherever tar readers could
disagree or stop early, it raises :class:`~feedpipe.errors.ShardFormatError` naming the shard and
offset: a bad checksum or numeric field, a member or its padding cut short, a malformed PAX
record, a name that is not UTF-8, sparse members, extension headers that contradict each other.
(:mod:`tarfile` silently stops at a corrupted header in the middle of an archive.)
``tests/test_tar_fuzz.py`` checks the agreement on random and mutated archives.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass

from ..errors import ShardFormatError

BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


def padded(size: int) -> int:
    """``size`` rounded up to a whole number of tar blocks."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def _template() -> tuple[bytearray, int]:
    info = tarfile.TarInfo("")
    info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, 0, "", ""
    buf = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8"))
    buf[124:136] = b"\0" * 12  # size: filled per member
    buf[148:156] = b" " * 8  # checksum: computed per member
    return buf, sum(buf)


_TEMPLATE, _TEMPLATE_SUM = _template()
_MAX_FAST_SIZE = 8**11  # ustar's 11 octal digits
# the template around the fields filled per member: name [0:100], size [124:136], chksum [148:156]
_MODE_TO_SIZE = bytes(_TEMPLATE[100:124])
_MTIME = bytes(_TEMPLATE[136:148])
_AFTER_CHKSUM = bytes(_TEMPLATE[156:512])
_NAME_PAD = b"\0" * 100
# what a writer packing short-name headers itself needs (see member_header): the name's padding,
# the template's pieces around the size and checksum fields, the template's byte sum (checksum
# field as spaces), and the largest size the short form takes
SHORT_HEADER = (_NAME_PAD, _MODE_TO_SIZE, _MTIME, _AFTER_CHKSUM, _TEMPLATE_SUM, _MAX_FAST_SIZE)


def member_header(name: str, size: int) -> bytes:
    """Header bytes for a regular-file member; the member data follows them directly.

    Byte-identical to the standard library's ustar header with mode 0644, uid/gid 0 and mtime 0
    (a test checks this), but packed directly for the common short name: ``tarfile`` spends more
    time building a header than we spend copying a small file.

    Example:
        >>> len(member_header("cls/0001.jpg", 10))
        512
        >>> len(member_header("x" * 120 + ".jpg", 10)) > 512  # GNU long-name record
        True
    """
    raw = name.encode("utf-8")
    n = len(raw)
    if n <= 100 and size < _MAX_FAST_SIZE:
        size_field = b"%011o\0" % size
        chksum = _TEMPLATE_SUM + sum(raw) + sum(size_field)
        # one join of the template's pieces and the three fields: cheaper than patching a copy
        # of the template in place (headers weigh most in benchmarks/bench_convert.py's tiny
        # dataset)
        return b"".join((raw, _NAME_PAD[n:], _MODE_TO_SIZE, size_field, _MTIME,
                         b"%06o\0 " % chksum, _AFTER_CHKSUM))
    return _slow_header(name, size)


def _slow_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    try:
        return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")
    except ValueError:
        return info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="strict")


# -- what the scanner finds ------------------------------------------------------------------------

@dataclass(frozen=True)
class Member:
    """One regular-file member found by :func:`~feedpipe.format._tar_scan.scan` (or a hard link
    to one: its name, and its target's data)."""

    name: str
    offset: int  # where the member's data starts
    size: int


@dataclass(frozen=True)
class LeftOut:
    """A member of a tar that makes no sample, and why (a symbolic link, a hard link whose
    target the tar does not hold, a device or FIFO, a member type tar readers do not agree on,
    a hidden file whose WebDataset key is empty). Directories are not listed: they hold no
    bytes, and the files in them are members of their own."""

    name: str
    reason: str


# what a damaged shard's message ends with: what to do about it
DAMAGED = ("re-copy or re-fetch the shard, or re-create it from the source (`feedpipe shard`); "
           "`feedpipe verify DIR` checks every shard")


def damaged(where: str, offset: int | None, kind: str, message: str) -> ShardFormatError:
    """:func:`format_error` for bytes that are damaged (cut short, corrupted), saying what to
    do."""
    return format_error(where, offset, kind, f"{message}; {DAMAGED}")


def format_error(where: str, offset: int | None, kind: str, message: str,
                 cls: type[ShardFormatError] = ShardFormatError) -> ShardFormatError:
    """``cls(message)`` carrying the shard, the offset and the kind of problem (``"truncated"``,
    ``"header"``, ``"unsupported"``, ``"compressed"``), for reports such as ``verify --json``."""
    err = cls(message)
    err.shard, err.offset, err.kind = where, offset, kind
    return err
