"""The per-shard index: DALI's webdataset index format, version 1.2.

Text, first line ``v1.2 <num_samples>``, then one line per sample made of repeated groups
``<ext> <offset> <size> <member-name>``, where ``offset`` is where the member's data starts. This
is byte-for-byte what DALI's ``wds2idx`` writes for the same shard (for member names that GNU tar
lists verbatim), so ``fn.readers.webdataset`` can use feedpipe's indexes directly.

Parsing and formatting are pure; the only I/O is in :func:`read_index` / :func:`write_index`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import add
from typing import Any, BinaryIO

from ..errors import ShardFormatError
from ._keys import split_member
from ._tar import LeftOut, format_error
from ._tar_scan import scan, scan_buffer

VERSION = "v1.2"


@dataclass
class ShardIndex:
    """The samples of one shard as its index lists them (:attr:`ShardReader.index`): sample
    ``i`` is the members ``starts[i]:starts[i+1]``.

    Attributes:
        keys: each sample's key.
        starts: each sample's first member, and one past the last member (``len(keys) + 1``
            items).
        exts: each member's extension (its field).
        offsets: each member's data offset in the shard.
        sizes: each member's size in bytes.
        names: each member's name as stored in the tar.
        named: ``False`` for an index of format v1.1, whose member names are made up from the
            line number and extension.
    """

    keys: list[str]
    starts: list[int]  # len(keys) + 1
    exts: list[str]  # per member
    offsets: list[int]  # per member: start of data
    sizes: list[int]  # per member
    names: list[str] = field(default_factory=list)  # per member, as stored in the tar
    # False for a v1.1 index: its names are made up from the line number and extension
    named: bool = field(default=True, compare=False)
    # the tar's members that make no sample, and why (from the tar's headers; an index read
    # from an .idx file has none listed)
    left_out: list[LeftOut] = field(default_factory=list, compare=False)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        """Offset one past the last member byte (the shard is truncated if smaller)."""
        return max(map(add, self.offsets, self.sizes), default=0)

    def fields(self) -> set[str]:
        """The extensions (fields) the shard's members have."""
        return set(self.exts)


HIDDEN = ("hidden file: its WebDataset key (the name up to the first dot of its file name) is "
          "empty, so it belongs to no sample (webdataset and DALI skip it too); rename it key.ext "
          "to keep it")
# (webdataset and DALI's reader make ``dir/.DS_Store`` a sample keyed "dir/", of such files only)
HIDDEN_IN = ("hidden file: its WebDataset key (the name up to the first dot of its file name) "
             "is only its directory {!r}, which names no sample (webdataset would make it one "
             "keyed so); rename it key.ext to keep it")


def group_members(members: Iterable[tuple[str, int, int]],
                  left_out: list[LeftOut] | None = None) -> ShardIndex:
    """Group ``(name, data_offset, size)`` members into samples by the WebDataset rule.

    Consecutive members with the same key form one sample; members whose key is empty (hidden
    files such as ``.DS_Store``, ``dir/.gitignore``) make no sample, as in DALI's ``wds2idx``:
    they are appended to ``left_out`` (and the index's ``left_out``) with the reason.
    """
    idx = ShardIndex([], [0], [], [], [], [], left_out=[] if left_out is None else left_out)
    hidden = idx.left_out.append
    last: str | None = None
    keys, starts, exts, offsets, sizes, names = (idx.keys, idx.starts, idx.exts, idx.offsets,
                                                 idx.sizes, idx.names)
    for name, offset, size in members:
        # split_member, inline: this loop runs once per member of every shard written
        dot = name.find(".", name.rfind("/") + 1)
        key, ext = (name, "") if dot < 0 else (name[:dot], name[dot + 1:])
        if not key or key.endswith("/"):
            hidden(LeftOut(name, HIDDEN_IN.format(key) if key else HIDDEN))
            continue
        if key != last:
            if last is not None:
                starts.append(len(exts))
            keys.append(key)
            last = key
        exts.append(ext)
        offsets.append(offset)
        sizes.append(size)
        names.append(name)
    if last is not None:
        starts.append(len(exts))
    return idx


def index_from_tar(f: BinaryIO, size: int, where: str) -> ShardIndex:
    """The index a shard's tar headers give (``feedpipe index``, ``verify`` and the reader's
    scan of a shard without ``.idx`` all make it here, with the one tar parser). A hard link to
    an earlier member is a member with its target's offset and size; what makes no sample is in
    its ``left_out``, in the order of the tar.

    Raises:
        ShardFormatError: the tar is truncated or malformed (names ``where`` and the offset).
    """
    left: list[LeftOut] = []
    return group_members(((m.name, m.offset, m.size) for m in scan(f, size, where, left)), left)


def index_from_buffer(data: Any, where: str) -> ShardIndex:
    """:func:`index_from_tar` of a whole shard in memory (``bytes``, ``memoryview``, ``mmap``)."""
    left: list[LeftOut] = []
    return group_members(((m.name, m.offset, m.size) for m in scan_buffer(data, where, left)),
                         left)


def format_index(idx: ShardIndex) -> str:
    """The index file text for ``idx``."""
    groups = [f"{e} {o} {s} {n}" for e, o, s, n in zip(idx.exts, idx.offsets, idx.sizes,
                                                        idx.names)]
    if len(groups) == len(idx):  # one member a sample: a line per group
        lines = groups
    else:
        starts = idx.starts
        lines = [" ".join(groups[a:b]) for a, b in zip(starts, starts[1:])]
    return f"{VERSION} {len(idx)}\n" + "".join(line + "\n" for line in lines)


def parse_index(text: str | bytes, where: str = "<index>") -> ShardIndex:
    """Parse index text (v1.2; v1.1 lines without names are accepted too); bytes are UTF-8.

    Raises:
        ShardFormatError: not an index, or a malformed line (names ``where`` and the line).
    """
    body, group = _index_lines(text, where)
    if group == 4:
        fast = _parse_columns(body)
        if fast is not None:
            return fast
    idx = ShardIndex([], [0], [], [], [], [], named=group == 4)
    for lineno, line in enumerate(body, start=2):
        _parse_line(idx, line, lineno, group, where)
    return idx


def _index_lines(text: str | bytes, where: str) -> tuple[list[str], int]:
    """The sample lines of index text, checked against its header's count, and the fields per
    member (4 in v1.2, 3 in v1.1)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad_index(where, f"not UTF-8 text (byte {e.start})") from e
    lines = text.split("\n")
    head = lines[0].split()
    if len(head) != 2 or head[0] not in ("v1.1", "v1.2"):
        raise _bad_index(where, f"first line {lines[0][:60]!r}")
    try:
        n = int(head[1])
    except ValueError as e:
        raise ShardFormatError(f"{where}: bad sample count {head[1]!r}") from e
    body = [ln for ln in lines[1:] if ln]
    if len(body) != n:
        raise ShardFormatError(
            f"{where}: index says {n} samples but has {len(body)} lines (truncated index?)"
        )
    return body, 4 if head[0] == "v1.2" else 3


def _parse_line(idx: ShardIndex, line: str, lineno: int, group: int, where: str) -> None:
    """Append one sample's line (line ``lineno`` of the index) to ``idx``."""
    parts = line.split(" ")
    if len(parts) % group:
        raise ShardFormatError(f"{where}:{lineno}: malformed index line")
    key = None
    for g in range(0, len(parts), group):
        ext = parts[g]
        try:
            off, size = int(parts[g + 1]), int(parts[g + 2])
        except ValueError as e:
            raise ShardFormatError(f"{where}:{lineno}: bad offset/size") from e
        if off < 0 or size < 0:
            raise ShardFormatError(f"{where}:{lineno}: bad offset/size")
        name = parts[g + 3] if group == 4 else ""
        if key is None:
            key = split_member(name)[0] if name else f"{lineno - 2}"
        idx.exts.append(ext)
        idx.offsets.append(off)
        idx.sizes.append(size)
        idx.names.append(name or f"{key}.{ext}")
    idx.keys.append(key or "")
    idx.starts.append(len(idx.exts))


def _parse_columns(body: list[str]) -> ShardIndex | None:
    """v1.2 lines parsed column-wise (C-level splits and int conversions, one pass per column):
    the same :class:`ShardIndex` as the line loop in :func:`parse_index`, or None when a line is
    malformed, so that the loop finds and names it."""
    groups = [c + 1 for c in map(str.count, body, [" "] * len(body))]
    if not body or any(g & 3 for g in groups):
        return None
    tokens = " ".join(body).split(" ")
    try:
        offsets = list(map(int, tokens[1::4]))
        sizes = list(map(int, tokens[2::4]))
    except ValueError:
        return None
    if min(offsets) < 0 or min(sizes) < 0:  # the loop names the line
        return None
    names = tokens[3::4]
    if "" in names:  # the loop names those members after their line
        return None
    starts = [0, *accumulate(g >> 2 for g in groups)]
    # split_member(name)[0] of each sample's first member, inline
    keys = [n[:d] if (d := n.find(".", n.rfind("/") + 1)) >= 0 else n
            for n in map(names.__getitem__, starts[:-1])]
    return ShardIndex(keys, starts, tokens[0::4], offsets, sizes, names)


def index_path(shard_path: str) -> str:
    """The index path beside a shard: ``x.tar`` -> ``x.idx`` (a URL's query string kept:
    ``x.tar?token=1`` -> ``x.idx?token=1``)."""
    from .._helpers.storage import split_query

    path, query = split_query(shard_path)
    base = path[:-4] if path.endswith(".tar") else path
    return base + ".idx" + query


def write_index(path: str, idx: ShardIndex, text: str | None = None) -> None:
    """Write ``idx`` to ``path`` atomically (temp file + rename, the temp file removed on error);
    ``text``: its :func:`format_index`, where the caller made it already."""
    tmp = f"{os.path.join(os.path.dirname(path), '.' + os.path.basename(path))}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(format_index(idx) if text is None else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # as it came (callers name the output), with no temp file left
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _bad_index(where: str, why: str) -> ShardFormatError:
    return format_error(where, None, "index",
                        f"{where}: not a webdataset index: {why}; rebuild it with "
                        "`feedpipe index` (or delete it: the shard is then scanned)")


def check_names(names: Sequence[str], where: str) -> None:
    """Refuse member names the space-separated index cannot hold."""
    for n in names:
        if any(c.isspace() for c in n):
            raise ShardFormatError(
                f"{where}: member name {n!r} contains whitespace, which the DALI index format "
                "cannot store; re-shard with `feedpipe shard` (which encodes such names)"
            )
