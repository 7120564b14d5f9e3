"""The per-directory work of one-pass staging (:mod:`~feedpipe.convert._onepass`), run in the
staging workers: a top-level directory listed (:mod:`~feedpipe.convert._stage_walk`), its files
read in key order and written as tar members to a staging file, by the C extension
``feedpipe._native._stagefiles`` where it was built (else the same loop in Python,
:func:`_stage_samples`), and its listing chunk written. :class:`StagedDir` is what comes back:
where each sample and member lies in the staging file, from which shards are cut
(:class:`Cut`).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from stat import S_ISREG
from typing import Any

from ..format._tar import BLOCK, SHORT_HEADER, member_header
from ._listing import Chunk, write_rows
from ._sources import READ_FLAGS, FileRef, leave_out_non_images, read_local
from ._stage_walk import GiveBack, Grouped, group_samples, walk_plain
from ._writer import removed_on_error, unlink_quiet


@dataclass
class StagedDir:
    """One top-level directory, staged: its listing chunk and its staging file.

    Per sample in key order: its key, where it starts in the file and where its members start
    (each list ends with the totals). Per member: its field, tar name, data offset and size."""

    chunk: Chunk
    path: str
    keys: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    first: list[int] = field(default_factory=list)
    exts: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def cut(self, a: int, b: int) -> Cut:
        """Samples ``a`` to ``b`` (exclusive)."""
        m0, m1 = self.first[a], self.first[b]
        keys, first, exts = self.keys, self.first, self.exts
        # (a staged table keeps no names: each is its sample's key and its field)
        names = self.names[m0:m1] if self.names else [
            f"{keys[i]}.{exts[m]}" for i in range(a, b) for m in range(first[i], first[i + 1])]
        return Cut(self.path, self.starts[a], self.starts[b] - self.starts[a], keys[a:b],
                   [f - m0 for f in first[a:b + 1]], exts[m0:m1], names,
                   self.offsets[m0:m1], self.sizes[m0:m1])


@dataclass
class Cut:
    """A run of consecutive samples of a staging file: its bytes and its part of the index
    (``first``: where each sample's members start, from 0, then their count; ``offsets``: in
    the staging file)."""

    path: str
    start: int
    length: int
    keys: list[str]
    first: list[int]
    exts: list[str]
    names: list[str]
    offsets: list[int]
    sizes: list[int]


def read_file(path: str) -> bytes:
    """A local source file's bytes for staging: ``b""`` for one that is not a regular file (the
    general path then says what it is), else what :func:`~feedpipe.convert._sources.read_local`
    reads. Staging calls it once per file, so its common case is written out: a file under
    :data:`_GUESS` bytes is one ``open``, one ``read`` and one ``close``.

    That case asks no ``fstat``: the walk found a regular file here (its type from the
    directory), and a regular file's read comes back short only at its end. Whatever took its
    place since is caught all the same: a directory fails the read, a FIFO (opened
    non-blocking) reads nothing or fails, and a device, which fills the read, is read again
    through ``read_local``, which checks the type and refuses it."""
    fd = os.open(path, READ_FLAGS)
    try:
        try:
            data = os.read(fd, _GUESS)
        except IsADirectoryError:
            return b""
        if len(data) < _GUESS:
            return data
        st = os.fstat(fd)
        if not S_ISREG(st.st_mode):
            return b""
        if st.st_size >= _GUESS:
            data += os.read(fd, st.st_size + 1 - _GUESS)
    finally:
        os.close(fd)
    return data if len(data) == st.st_size else read_local(path)  # (it changed meanwhile)


# a file shorter than this is read in one read of this size, without a stat (see read_file)
_GUESS = 1 << 16


def stage_dir(root: str, top: str, cls: int | None, chunk_path: str,
              stage_path: str) -> StagedDir | None:
    """List, read and stage the top-level directory ``top`` of the local tree at ``root``
    (``cls``: its class index under ``labels_from_dirs``); ``None``: leave it to the general
    path (nothing is left behind).

    The per-file work is written out here rather than through ``classify``, ``read_local`` and
    :func:`~feedpipe.convert._writer.write_members`: a tree of small files spends most of its
    staging time on it (``benchmarks/bench_convert.py --profile``). Headers are packed from
    :data:`~feedpipe.format._tar.SHORT_HEADER`, byte for byte what ``member_header`` packs."""
    groups = walk_plain(root, top)
    if groups is None:
        return None
    labels = cls is not None
    try:
        by_key, ignored, hidden = group_samples(groups, labels)
    except GiveBack:
        return None
    if labels and leave_out_non_images(
            {k: [FileRef(e, r or "", 1) for e, r in v] for k, v in by_key.items()}, [])[0]:
        return None  # the general path reports them
    keys = sorted(by_key)
    members = _member_lists(by_key, keys, labels)
    staged = StagedDir(Chunk(top, chunk_path), stage_path, keys, first=members.first,
                       exts=members.exts)
    rows: list[tuple[str, list[tuple[str, str, int]]]] = []
    extra = str(cls).encode() if labels else b""
    with removed_on_error(stage_path):
        pos = _stage_members(root, stage_path, members, extra, staged, rows)
        if pos is None:  # unreadable, empty or not a regular file: the general path says
            unlink_quiet(stage_path)  # which and why
            return None
        staged.starts.append(pos)
    with removed_on_error(stage_path, chunk_path):  # (a partial chunk: with the listing's tmp)
        write_rows(chunk_path, rows)
    c = staged.chunk
    c.samples, c.files, c.ignored = len(keys), len(members.rels) - labels * len(keys), ignored
    c.hidden = hidden
    if keys:
        c.first, c.last = keys[0], keys[-1]
    return staged


@dataclass
class _Members:
    """A directory's members in key order, flat: each one's field and file relative to the root
    (``None``: the ``cls`` field, ``extra``); per sample, where its members start (ending with
    their count)."""

    keys: list[str]
    first: list[int]
    exts: list[str]
    rels: list[str | None]


def _member_lists(by_key: Grouped, keys: list[str], labels: bool) -> _Members:
    members: list[list[tuple[str, str | None]]] = [by_key[k] for k in keys]
    if labels:
        for ms in members:
            ms.append(("cls", None))
    flat = list(itertools.chain.from_iterable(members))
    return _Members(keys, list(itertools.accumulate(map(len, members), initial=0)),
                    [e for e, _ in flat], [r for _, r in flat])


def _stage_members(root: str, stage_path: str, m: _Members, extra: bytes, staged: StagedDir,
                   rows: list[tuple[str, list[tuple[str, str, int]]]]) -> int | None:
    """Write every member to the staging file: the C loop takes as many samples as it can, the
    Python loop the next one (or all, without the extension); the bytes written, or ``None``
    where a file is unreadable, empty or not a regular file."""
    keys = m.keys
    base = root if root.endswith("/") else root + "/"
    pos = 0
    with open(stage_path, "wb") as out:
        i = 0
        dirfd = _open_dir(root) if _C is not None else -1
        try:
            while i < len(keys):
                if _C is not None and dirfd >= 0:  # as many samples as it can; the next here
                    i, pos = _C.stage(dirfd, out.fileno(), keys, m.first, m.exts, m.rels, extra,
                                      _TEMPLATE, i, pos, _GUESS, READ_FLAGS, staged.starts,
                                      staged.names, staged.offsets, staged.sizes, rows)
                    if i == len(keys):
                        break
                    j = i + 1
                else:
                    j = len(keys)
                reached = _stage_samples(out, base, keys, m.first, m.exts, m.rels, extra, i, j,
                                         pos, staged, rows)
                if reached is None:
                    return None
                out.flush()  # (before the C loop writes to the file again)
                i, pos = j, reached
        finally:
            if dirfd >= 0:
                os.close(dirfd)
    return pos


try:  # optional C extension (setup.py): the per-file loop of stage_dir
    from .._native import _stagefiles as _C
except ImportError:  # pragma: no cover - where it did not build, _stage_samples stages them all
    _C = None

# the ustar header _stagefiles packs from (the name, size and checksum fields filled per member):
# member_header's template, byte for byte
_TEMPLATE = (SHORT_HEADER[0] + SHORT_HEADER[1] + bytes(12) + SHORT_HEADER[2] + b" " * 8
             + SHORT_HEADER[3])


def _open_dir(path: str) -> int:
    """A descriptor of the directory ``path`` for the C loop's ``openat``; -1 where it cannot
    be opened (the Python loop then stages every sample, and meets what is wrong)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


def stage_files_with() -> str:
    """What runs one-pass staging's per-file loop: the C extension ``feedpipe._native._stagefiles``
    where it was built, else ``python`` (the same bytes, more slowly)."""
    return "python" if _C is None else "feedpipe._native._stagefiles"


def _stage_samples(out: Any, base: str, keys: list[str], first: list[int], exts: list[str],
                   rels: list[str | None], extra: bytes, a: int, b: int, pos: int,
                   staged: StagedDir, rows: list[tuple[str, list[tuple[str, str, int]]]]
                   ) -> int | None:
    """Stage samples ``a`` to ``b`` (exclusive) of :func:`stage_dir`'s flat lists into ``out``
    from ``pos``, appending to ``staged``'s lists and ``rows`` as ``feedpipe._native._stagefiles``
    does; the position reached, or ``None`` where a file is unreadable, empty or not a regular
    file. The C loop leaves the unusual samples to it (a name over 100 bytes, a file that fills
    the first read)."""
    starts, names, offsets, sizes = staged.starts, staged.names, staged.offsets, staged.sizes
    pad, mode_to_size, mtime, after, template_sum, max_fast = SHORT_HEADER
    tails = [bytes(n) for n in range(BLOCK)]  # the padding after a member, by its length
    pads = [pad[n:] for n in range(101)]  # a short name's padding, by the name's length
    os_open, os_read, os_close = os.open, os.read, os.close
    size_fields: dict[int, tuple[bytes, int]] = {}  # size -> (field, template sum + its sum)
    pending: list[bytes] = []  # (written in batches: one write call per file costs)
    pending_bytes = 0
    write = out.write
    for i in range(a, b):
        key = keys[i]
        row = []
        starts.append(pos)
        for m in range(first[i], first[i + 1]):
            ext, rel = exts[m], rels[m]
            if rel is None:
                data = extra
            else:
                try:  # (read_file's common case, written out: it runs once per file)
                    fd = os_open(base + rel, READ_FLAGS)
                    try:
                        data = os_read(fd, _GUESS)
                    finally:
                        os_close(fd)
                    if len(data) >= _GUESS:
                        data = read_file(base + rel)
                except OSError:
                    data = b""
                if not data:
                    return None
                row.append((ext, rel, len(data)))
            name = f"{key}.{ext}"
            size = len(data)
            raw = name.encode("utf-8")
            if len(raw) <= 100 and size < max_fast:
                got_size = size_fields.get(size)
                if got_size is None:
                    field_ = b"%011o\0" % size
                    got_size = size_fields[size] = (field_, template_sum + sum(field_))
                header = b"".join((raw, pads[len(raw)], mode_to_size, got_size[0], mtime,
                                   b"%06o\0 " % (got_size[1] + sum(raw)), after))
            else:
                header = member_header(name, size)
            tail = -size % BLOCK
            names.append(name)
            offsets.append(pos + len(header))
            sizes.append(size)
            step = len(header) + size + tail
            pos += step
            if size > _WRITE_BATCH // 16:  # a large member: written as it is, not copied
                pending.append(header)
                write(b"".join(pending))
                write(data)
                pending[:] = (tails[tail],)
                pending_bytes = tail
            else:
                pending += (header, data, tails[tail])
                pending_bytes += step
        if pending_bytes >= _WRITE_BATCH:
            write(b"".join(pending))
            pending.clear()
            pending_bytes = 0
        rows.append((key, row))
    if pending:
        write(b"".join(pending))
    return pos

# bytes gathered before one write to a staging file (a few hundred small members a call); a
# member over a sixteenth of it is written on its own
_WRITE_BATCH = 1 << 20


