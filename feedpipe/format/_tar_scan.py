"""The one strict tar header scanner (:func:`scan`, :func:`scan_buffer`).

``feedpipe index``, ``feedpipe verify`` and the reader's slow path for shards without an index all
use it, so they accept and refuse the same bytes (what it accepts and refuses: see
:mod:`feedpipe.format._tar`). The walk reads one header block at a time: extension headers (GNU
long names, PAX records) are gathered for the member they precede (:class:`_Pending`), each
member's header is checked, and its data skipped.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .._redact import logger
from ..errors import ShardFormatError
from ._compression import MAGIC, compressed_error
from ._tar import BLOCK, LeftOut, Member, damaged, format_error, padded

log = logger("feedpipe.format")

_ZERO = bytes(BLOCK)
_OCTAL = b"01234567"
_HIGH = bytes(range(128))  # deleted by translate: what is left are the bytes > 127
_FIELDS = (("mode", 100, 108), ("uid", 108, 116), ("gid", 116, 124), ("mtime", 136, 148),
           ("devmajor", 329, 337), ("devminor", 337, 345))
_REGULAR = (b"0", b"7")  # and b"\0" unless its name ends with "/" (an old-style directory)
_NO_DATA = {b"1": "hard link", b"2": "symlink", b"3": "character device",
            b"4": "block device", b"5": "directory", b"6": "FIFO"}
_HARD_LINK, _SYMLINK, _DIRECTORY = b"1", b"2", b"5"
_EXTENSIONS = (b"L", b"K", b"x", b"X", b"g")


def _number(raw: bytes) -> int | None:
    """A numeric header field as GNU tar reads it (octal digits, or GNU base-256 when the first
    byte is 0x80 or 0xff), or None when it is neither."""
    lead = raw[0]
    if lead == 0x80:
        return int.from_bytes(raw[1:], "big")
    if lead == 0xFF:
        return int.from_bytes(raw[1:], "big") - (1 << (8 * (len(raw) - 1)))
    cut = raw.find(b"\0")
    digits = (raw if cut < 0 else raw[:cut]).strip()
    if not digits:
        return 0
    if digits.translate(None, _OCTAL):
        return None
    return int(digits, 8)


def _checksum_ok(block: bytes) -> bool:
    """The stored checksum equals the sum of the header's bytes (unsigned, or signed as some old
    writers summed them; :mod:`tarfile` and GNU tar accept both)."""
    want = _number(block[148:156])
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32
    if want == unsigned:
        return True
    high = len(block[:148].translate(None, _HIGH)) + len(block[156:].translate(None, _HIGH))
    return want == unsigned - 256 * high


def _cstr(raw: bytes) -> bytes:
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


def _text(raw: bytes, where: str, pos: int, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise format_error(
            where, pos, "header",
            f"{where}: {what} {raw!r} at offset {pos} is not UTF-8 (byte {e.start}): feedpipe "
            "keys are text; rename the member, or convert the source files with `feedpipe shard`"
        ) from e


def _pax_records(data: bytes, size: int, where: str, pos: int) -> dict[str, bytes]:
    """The ``"<length> <key>=<value>\\n"`` records of a PAX header's ``size`` bytes of data
    (``data`` holds them and the padding); anything else is refused rather than guessed at."""
    def bad(why: str) -> ShardFormatError:
        return damaged(where, pos, "header",
                       f"{where}: malformed PAX record at offset {pos} ({why})")

    out: dict[str, bytes] = {}
    body = data[:size]
    i = 0
    while i < size:
        if body[i] == 0:  # NULs to the end of the data: readers stop there too
            if body[i:].strip(b"\0"):
                raise bad(f"a NUL byte at {i} before more records")
            break
        sp = body.find(b" ", i, i + 20)
        digits = body[i:sp] if sp > i else b""
        if not digits.isdigit():
            raise bad(f"record at {i} does not start with its decimal length")
        end = i + int(digits)
        if end <= sp + 2 or end > size:
            raise bad(f"record at {i} has length {int(digits)}, "
                      f"{'past the end of the header data' if end > size else 'too short'}")
        if body[end - 1] != 0x0A:
            raise bad(f"record at {i} does not end with a newline")
        key, eq, value = body[sp + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise bad(f"record at {i} is not keyword=value")
        out[_text(key, where, pos, "PAX keyword")] = value
        i = end
    if size < len(data) and data[size] != 0:  # tarfile would read records from the padding
        raise bad("non-zero bytes after the records")
    return out


def _long_name(data: bytes, size: int, where: str, pos: int) -> bytes:
    body = data[:size]
    cut = body.find(b"\0")
    if cut >= 0:
        return body[:cut]
    if size < len(data) and data[size] != 0:  # readers would run on into the padding
        raise damaged(where, pos, "header",
                      f"{where}: malformed GNU long-name record at offset {pos} "
                      "(the name is not NUL-terminated)")
    return body


def scan(f: BinaryIO, total_size: int, where: str,
         left_out: list[LeftOut] | None = None) -> Iterator[Member]:
    """Yield every regular-file member of a tar file, and every hard link to one before it (as
    :mod:`tarfile` reads a hard link: the name of the link, the bytes of its target).

    Args:
        f: a seekable binary file object of the archive.
        total_size: the byte size of the archive, to detect truncated member data.
        where: a name for messages (the shard path or URL).
        left_out: where to append the members that are neither (:class:`LeftOut`: symbolic
            links, hard links to nothing before them, devices, FIFOs, unknown member types).

    Raises:
        ShardFormatError: bad header checksum or numeric field, truncated header, data or
            padding, malformed extension records, a name that is not UTF-8, sparse members;
            the message names ``where`` and the offset (and the error carries ``shard``,
            ``offset`` and ``kind``). :class:`~feedpipe.errors.CompressedShardError` for
            gzip/bzip2/xz/zstd bytes.
    """
    def read_at(pos: int, n: int) -> bytes:
        f.seek(pos)
        return f.read(n)

    return _walk(read_at, total_size, where, left_out)


def scan_buffer(data: Any, where: str, left_out: list[LeftOut] | None = None) -> Iterator[Member]:
    """:func:`scan` over an archive held in memory (``bytes``, ``memoryview``, ``mmap``)."""
    return _walk(lambda pos, n: bytes(data[pos : pos + n]), len(data), where, left_out)


@dataclass
class _Pending:
    """What the extension headers read so far say about the member to come."""

    long_name: bytes | None = None  # a GNU long name ("L")
    long_link: bytes | None = None  # a GNU long link name ("K")
    pax: dict[str, bytes] | None = None  # a PAX extended header's records ("x")
    at: int | None = None  # the offset of the first of them
    seen: dict[bytes, int] = field(default_factory=dict)  # extension type -> its offset


def _walk(read_at: Callable[[int, int], bytes], total: int, where: str,
          left_out: list[LeftOut] | None) -> Iterator[Member]:
    pos = 0
    # every member so far, by its normalised name (the last one of a name wins, as in tarfile):
    # a regular file's (offset, size), or what else it is; where a hard link finds its target
    before: dict[str, tuple[int, int] | str] = {}
    ext = _Pending()
    while True:
        block = read_at(pos, BLOCK)
        if pos == 0:
            _refuse_compressed(block, where)
        if len(block) < BLOCK or block == _ZERO:
            _end_of_archive(read_at, block, pos, total, where, ext.at)
            return  # end-of-archive block, or the file ends on a block boundary (as tar accepts)
        size = _checked_size(block, where, pos)
        typeflag = block[156:157]
        if typeflag in _EXTENSIONS:
            pos = _read_extension(read_at, block, size, total, where, pos, ext)
            continue
        size = _member_size(typeflag, size, ext, where, pos)
        own_name = _cstr(block[0:100])
        regular = typeflag in _REGULAR or (typeflag == b"\0" and not own_name.endswith(b"/"))
        skip = _data_span(regular, typeflag, size, total, where, pos)
        if regular:
            name = _member_name(block, own_name, ext.long_name, ext.pax, where, pos, ext.at)
            before[_norm(name)] = (pos + BLOCK, size)
            yield Member(name, pos + BLOCK, size)
        else:
            member = _not_regular(block, typeflag, own_name, ext.long_name, ext.long_link,
                                  ext.pax, where, pos, ext.at, before, left_out)
            if member is not None:
                yield member
        ext = _Pending()
        pos += BLOCK + skip


def _refuse_compressed(block: bytes, where: str) -> None:
    """The first block starts like a compressed stream and is no tar header: refused, saying how
    to decompress it."""
    for magic, kind, _ in MAGIC:
        if block.startswith(magic) and (len(block) < BLOCK or not _checksum_ok(block)):
            raise compressed_error(where, kind)


def _end_of_archive(read_at: Callable[[int, int], bytes], block: bytes, pos: int, total: int,
                    where: str, ext_at: int | None) -> None:
    """``block`` at ``pos`` is a zero block or the end of the file: no extension header may be
    waiting for its member, no header cut short; what follows a zero block is checked."""
    if ext_at is not None:
        raise damaged(
            where, ext_at, "truncated",
            f"{where}: truncated: the extension header at offset {ext_at} is followed "
            f"by {'the end of the archive' if block else 'the end of the file'} at "
            f"offset {pos}, not by a member")
    if block and len(block) < BLOCK:
        raise damaged(where, pos, "truncated", f"{where}: truncated tar header at offset {pos}")
    if block:
        _check_tail(read_at, pos, total, where)


def _checked_size(block: bytes, where: str, pos: int) -> int:
    """The size field of the header ``block`` at ``pos``, after its checksum and numeric fields
    are checked."""
    if not _checksum_ok(block):
        raise damaged(where, pos, "header",
                      f"{where}: corrupted tar header at offset {pos} (checksum mismatch)")
    for name, lo, hi in _FIELDS:
        if _number(block[lo:hi]) is None:
            raise damaged(where, pos, "header",
                          f"{where}: corrupted tar header at offset {pos} (bad {name} "
                          f"field {block[lo:hi]!r})")
    size = _number(block[124:136])
    if size is None or size < 0:
        raise damaged(where, pos, "header",
                      f"{where}: corrupted tar header at offset {pos} (bad size field "
                      f"{block[124:136]!r})")
    return size


def _read_extension(read_at: Callable[[int, int], bytes], block: bytes, size: int, total: int,
                    where: str, pos: int, ext: _Pending) -> int:
    """Read the extension header at ``pos`` into ``ext``; the offset of the next header."""
    typeflag = block[156:157]
    if typeflag == b"X":
        typeflag = b"x"  # Solaris' name for a PAX extended header
    if typeflag in ext.seen and typeflag != b"g":
        raise format_error(where, pos, "unsupported",
                           f"{where}: two {typeflag.decode()!r} extension headers for one "
                           f"member (offsets {ext.seen[typeflag]} and {pos}); tar readers "
                           "disagree on which applies")
    ext.seen[typeflag] = pos
    end = pos + BLOCK + padded(size)
    data = read_at(pos + BLOCK, padded(size)) if end <= total else b""
    if len(data) < padded(size):
        raise damaged(where, pos, "truncated",
                      f"{where}: truncated: extension header at offset {pos} needs "
                      f"{padded(size)} bytes of data but the file ends at {total}")
    if typeflag == b"L":
        ext.long_name = _long_name(data, size, where, pos)
    elif typeflag == b"K":
        ext.long_link = _long_name(data, size, where, pos)
    elif typeflag == b"x":
        ext.pax = _pax_records(data, size, where, pos)
    elif typeflag == b"g":
        _refuse_global(data, size, where, pos)
    ext.at = pos if ext.at is None else ext.at
    return end


def _refuse_global(data: bytes, size: int, where: str, pos: int) -> None:
    """A global PAX header may say nothing that changes where members or their names are."""
    sets = [k for k in _pax_records(data, size, where, pos)
            if k in ("path", "size") or k.startswith("GNU.sparse.")]
    if sets:
        raise format_error(where, pos, "unsupported",
                           f"{where}: the global PAX header at offset {pos} sets "
                           f"{sets[0]!r} for every later member; not supported")


def _member_size(typeflag: bytes, size: int, ext: _Pending, where: str, pos: int) -> int:
    """The size of the member at ``pos``: its header's, or its PAX ``size``; sparse members are
    refused."""
    pax = ext.pax
    if typeflag == b"S" or (pax is not None and any(k.startswith("GNU.sparse.") for k in pax)):
        raise format_error(where, pos, "unsupported",
                           f"{where}: sparse member at offset {pos}: not supported (its data "
                           "is not stored contiguously); re-create the shard without --sparse")
    if pax is not None and "size" in pax:
        raw = pax["size"]
        if not raw.isdigit():
            raise damaged(where, ext.at, "header",
                          f"{where}: bad PAX size {raw!r} in the extended header at "
                          f"offset {ext.at}")
        return int(raw)
    return size


def _data_span(regular: bool, typeflag: bytes, size: int, total: int, where: str,
               pos: int) -> int:
    """The bytes of data and padding after the header at ``pos``, checked against the file's
    end; an entry that holds no bytes (a link, a directory, a device) may declare none."""
    if regular or typeflag not in _NO_DATA and typeflag != b"\0":
        skip = padded(size)  # unknown types: their data is skipped, as tar readers do
        if pos + BLOCK + skip > total:
            raise damaged(
                where, pos, "truncated",
                f"{where}: truncated: member at offset {pos} needs {size} bytes of data"
                f"{f' and {skip - size} of padding' if skip > size else ''} but the file "
                f"ends at {total}")
        return skip
    if size:
        what = _NO_DATA.get(typeflag, "directory")
        raise format_error(where, pos, "unsupported",
                           f"{where}: the {what} entry at offset {pos} declares {size} bytes "
                           "of data; tar readers disagree on where the next header is")
    return 0


def _not_regular(block: bytes, typeflag: bytes, own_name: bytes, long_name: bytes | None,
                 long_link: bytes | None, pax: dict[str, bytes] | None, where: str, pos: int,
                 ext_at: int | None, before: dict[str, tuple[int, int] | str],
                 left_out: list[LeftOut] | None) -> Member | None:
    """A member that is not a regular file, at ``pos``: a hard link to a regular member before
    it reads as that member (as :mod:`tarfile` reads it); anything else is recorded in
    ``before`` by what it is and, but for directories, listed in ``left_out`` with its
    reason."""
    if typeflag == _HARD_LINK:
        target = _link_name(block, long_link, pax)
        found = before.get(_norm(target))
        if isinstance(found, tuple):  # a member like any: its name is checked as theirs
            name = _member_name(block, own_name, long_name, pax, where, pos, ext_at)
            before[_norm(name)] = found
            return Member(name, *found)
        else:
            name = _loose_name(block, own_name, long_name, pax, where, pos, ext_at)
            before[_norm(name)] = "hard link to nothing"
            if left_out is not None:
                left_out.append(LeftOut(name, f"hard link to {target!r}, " + (
                    "which the tar does not hold before it" if found is None else
                    f"a {found}")))
    else:
        name = _loose_name(block, own_name, long_name, pax, where, pos, ext_at)
        kind = _NO_DATA.get(typeflag, "directory" if typeflag == b"\0" else "")
        before[_norm(name)] = kind or "member of an unknown type"
        if left_out is not None and typeflag != _DIRECTORY and kind != "directory":
            if typeflag == _SYMLINK:
                why = (f"symbolic link to {_link_name(block, long_link, pax)!r}: it holds no "
                       "bytes (webdataset skips it too); store the file itself")
            elif kind:
                why = f"{kind}: it holds no bytes"
            else:
                why = (f"member type {typeflag.decode('latin-1')!r}, which tar readers do "
                       "not agree on (webdataset skips it)")
            left_out.append(LeftOut(name, why))
    return None


def _check_tail(read_at: Callable[[int, int], bytes], pos: int, total: int, where: str) -> None:
    """What follows the end-of-archive block at ``pos``. Tar readers stop at the first zero block,
    so a tar header anywhere after it (a zeroed header, or a second archive appended) hides
    members that every reader would drop: refused, naming where it is. Other bytes there (junk a
    copy tool or a writer left, which GNU tar and :mod:`tarfile` read past) are ignored, said in a
    log record."""
    first = None  # the first non-zero byte after the end of the archive
    at = pos + BLOCK
    while at < total:
        chunk = read_at(at, min(1 << 20, total - at))
        if not chunk:
            break
        if first is None and chunk.strip(b"\0"):
            first = at + len(chunk) - len(chunk.lstrip(b"\0"))
        if first is not None:
            for i in range(0, len(chunk) - BLOCK + 1, BLOCK):
                block = chunk[i : i + BLOCK]
                if block != _ZERO and _checksum_ok(block):
                    raise damaged(
                        where, pos, "header",
                        f"{where}: data after the end-of-archive block at offset {pos} (a "
                        f"non-zero byte at {first}; a tar header at offset {at + i}): a zeroed "
                        "header, or archives concatenated; tar readers stop at the zero block "
                        "and would drop the members that follow")
        at += len(chunk)  # every read but the last starts and ends on a block boundary
    if first is not None:
        log.warning("%s: %d byte(s) after the end of the archive (offset %d; the first non-zero "
                    "at %d) hold no tar header: ignored, as GNU tar and Python's tarfile ignore "
                    "them", where, total - pos - BLOCK, pos + BLOCK, first)


def _norm(name: str) -> str:
    """``posixpath.normpath(name)``, as :mod:`tarfile` compares a link's target with the names
    before it; only names with an empty, ``.`` or ``..`` segment or a trailing slash change.

    Example:
        >>> _norm("a/b.jpg"), _norm("./a//b.jpg"), _norm("a/../b.jpg"), _norm("d/")
        ('a/b.jpg', 'a/b.jpg', 'b.jpg', 'd')
    """
    if "/." in name or "//" in name or name[:1] == "." or name[-1:] == "/":
        return posixpath.normpath(name)
    return name


def _link_name(block: bytes, long_link: bytes | None, pax: dict[str, bytes] | None) -> str:
    """The name a link member points to: a GNU long link name, a PAX ``linkpath``, or the
    header's ``linkname`` field (for messages and lookups: bytes that are not UTF-8 replaced)."""
    raw = long_link if long_link is not None else (pax or {}).get("linkpath")
    if raw is None:
        raw = _cstr(block[157:257])
    return raw.decode("utf-8", "replace")


def _loose_name(block: bytes, own: bytes, long_name: bytes | None,
                pax: dict[str, bytes] | None, where: str, pos: int, ext_at: int | None) -> str:
    """:func:`_member_name` of a member that makes no sample, to list it: a name that member
    names are refused for (not UTF-8, two names) is no reason to refuse the shard here."""
    try:
        return _member_name(block, own, long_name, pax, where, pos, ext_at).rstrip("/")
    except ShardFormatError:
        raw = long_name if long_name is not None else (pax or {}).get("path", own)
        return raw.decode("utf-8", "replace").rstrip("/")


def _member_name(block: bytes, own: bytes, long_name: bytes | None,
                 pax: dict[str, bytes] | None, where: str, pos: int, ext_at: int | None) -> str:
    """The member's name: a GNU long name, a PAX ``path``, or the ustar prefix and name."""
    path = None if pax is None else pax.get("path")
    if long_name is not None and path is not None:
        raise format_error(where, ext_at, "unsupported",
                           f"{where}: the member at offset {pos} has both a GNU long name and a "
                           "PAX path; tar readers disagree on which applies")
    if long_name is not None:
        return _text(long_name, where, ext_at or 0, "GNU long name")
    if path is not None:
        return _text(path, where, ext_at or 0, "PAX path").rstrip("/")
    prefix = _cstr(block[345:500])
    if prefix:
        if block[257:263] != b"ustar\0":
            raise damaged(where, pos, "header",
                          f"{where}: corrupted tar header at offset {pos} (a name prefix "
                          "without the ustar magic)")
        own = prefix + b"/" + own
    return _text(own, where, pos, "member name")
