"""Tar members: deterministic ustar/GNU headers for writing, and the one strict header scanner.

Writing uses the standard library's header encoder with fixed metadata (mode 0644, uid/gid 0,
mtime 0, no user names), so the same bytes give the same shard on every machine. A member whose
name fits the ustar ``prefix``/``name`` fields gets a plain ustar header (what DALI's
``wds2idx``, GNU tar and every reader understand); a longer one gets a GNU long-name record.
PAX headers are never written (DALI rejects them).

The scanner (:func:`scan`, :func:`scan_buffer`) is the only tar parser: ``feedpipe index``,
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

import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from .._redact import logger
from ..errors import ShardFormatError
from ._compression import MAGIC, compressed_error

log = logger("feedpipe.format")

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


# -- the scanner ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Member:
    """One regular-file member found by :func:`scan` (or a hard link to one: its name, and its
    target's data)."""

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


def _walk(read_at: Callable[[int, int], bytes], total: int, where: str,
          left_out: list[LeftOut] | None) -> Iterator[Member]:
    pos = 0
    long_name: bytes | None = None
    long_link: bytes | None = None
    # every member so far, by its normalised name (the last one of a name wins, as in tarfile):
    # a regular file's (offset, size), or what else it is; where a hard link finds its target
    before: dict[str, tuple[int, int] | str] = {}
    pax: dict[str, bytes] | None = None
    ext_at: int | None = None  # the first extension header of the member to come
    seen: dict[bytes, int] = {}  # extension type -> its offset, for the member to come
    while True:
        block = read_at(pos, BLOCK)
        if pos == 0:
            for magic, kind, _ in MAGIC:
                if block.startswith(magic) and (len(block) < BLOCK or not _checksum_ok(block)):
                    raise compressed_error(where, kind)
        if len(block) < BLOCK or block == _ZERO:
            if ext_at is not None:
                raise damaged(
                    where, ext_at, "truncated",
                    f"{where}: truncated: the extension header at offset {ext_at} is followed "
                    f"by {'the end of the archive' if block else 'the end of the file'} at "
                    f"offset {pos}, not by a member")
            if block and len(block) < BLOCK:
                raise damaged(where, pos, "truncated",
                              f"{where}: truncated tar header at offset {pos}")
            if block:
                _check_tail(read_at, pos, total, where)
            return  # end-of-archive block, or the file ends on a block boundary (as tar accepts)
        if not _checksum_ok(block):
            raise damaged(where, pos, "header",
                          f"{where}: corrupted tar header at offset {pos} (checksum mismatch)")
        for field, lo, hi in _FIELDS:
            if _number(block[lo:hi]) is None:
                raise damaged(where, pos, "header",
                              f"{where}: corrupted tar header at offset {pos} (bad {field} "
                              f"field {block[lo:hi]!r})")
        size = _number(block[124:136])
        if size is None or size < 0:
            raise damaged(where, pos, "header",
                          f"{where}: corrupted tar header at offset {pos} (bad size field "
                          f"{block[124:136]!r})")
        typeflag = block[156:157]
        data_off = pos + BLOCK
        if typeflag in _EXTENSIONS:
            if typeflag == b"X":
                typeflag = b"x"  # Solaris' name for a PAX extended header
            if typeflag in seen and typeflag != b"g":
                raise format_error(where, pos, "unsupported",
                                   f"{where}: two {typeflag.decode()!r} extension headers for one "
                                   f"member (offsets {seen[typeflag]} and {pos}); tar readers "
                                   "disagree on which applies")
            seen[typeflag] = pos
            end = data_off + padded(size)
            data = read_at(data_off, padded(size)) if end <= total else b""
            if len(data) < padded(size):
                raise damaged(where, pos, "truncated",
                              f"{where}: truncated: extension header at offset {pos} needs "
                              f"{padded(size)} bytes of data but the file ends at {total}")
            if typeflag == b"L":
                long_name = _long_name(data, size, where, pos)
            elif typeflag == b"K":
                long_link = _long_name(data, size, where, pos)
            elif typeflag == b"x":
                pax = _pax_records(data, size, where, pos)
            elif typeflag == b"g":
                sets = [k for k in _pax_records(data, size, where, pos)
                        if k in ("path", "size") or k.startswith("GNU.sparse.")]
                if sets:
                    raise format_error(where, pos, "unsupported",
                                       f"{where}: the global PAX header at offset {pos} sets "
                                       f"{sets[0]!r} for every later member; not supported")
            ext_at = pos if ext_at is None else ext_at
            pos = end
            continue
        if typeflag == b"S" or (pax is not None and any(k.startswith("GNU.sparse.") for k in pax)):
            raise format_error(where, pos, "unsupported",
                               f"{where}: sparse member at offset {pos}: not supported (its data "
                               "is not stored contiguously); re-create the shard without --sparse")
        if pax is not None and "size" in pax:
            raw = pax["size"]
            if not raw.isdigit():
                raise damaged(where, ext_at, "header",
                              f"{where}: bad PAX size {raw!r} in the extended header at "
                              f"offset {ext_at}")
            size = int(raw)
        own_name = _cstr(block[0:100])
        regular = typeflag in _REGULAR or (typeflag == b"\0" and not own_name.endswith(b"/"))
        if regular or typeflag not in _NO_DATA and typeflag != b"\0":
            skip = padded(size)  # unknown types: their data is skipped, as tar readers do
            if data_off + skip > total:
                raise damaged(
                    where, pos, "truncated",
                    f"{where}: truncated: member at offset {pos} needs {size} bytes of data"
                    f"{f' and {skip - size} of padding' if skip > size else ''} but the file "
                    f"ends at {total}")
        elif size:
            what = _NO_DATA.get(typeflag, "directory")
            raise format_error(where, pos, "unsupported",
                               f"{where}: the {what} entry at offset {pos} declares {size} bytes "
                               "of data; tar readers disagree on where the next header is")
        else:
            skip = 0
        if regular:
            name = _member_name(block, own_name, long_name, pax, where, pos, ext_at)
            before[_norm(name)] = (data_off, size)
            yield Member(name, data_off, size)
        else:
            member = _not_regular(block, typeflag, own_name, long_name, long_link, pax, where,
                                  pos, ext_at, before, left_out)
            if member is not None:
                yield member
        long_name, long_link, pax, ext_at = None, None, None, None
        seen.clear()
        pos = data_off + skip


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
