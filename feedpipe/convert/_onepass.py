"""One-pass conversion of a local tree of top-level directories: list, read and stage each
directory in one go, then cut the shards out of the staged bytes.

The general path of :func:`feedpipe.shard` lists the whole tree first, with a ``stat`` per file
for its size. Only then does it plan the shards and read every file in a pool. Here, for a local
source whose files all sit in top-level directories (an image-folder layout, a tree of records),
one worker per directory:

1. walks it without a ``stat``;
2. groups and sorts its samples exactly as the listing does;
3. reads their files in key order and writes their tar members to a *staging* file in OUT (the
   sizes come from the reads).

The parent reads each directory's samples back as it comes in, while the workers stage the next
ones. It then holds the very listing the general path would build: the same samples, keys and
sizes, from the same chunk files (:mod:`~feedpipe.convert._listing`). It plans the same shards
with the same fingerprint. As soon as the plan is made, the workers seal each shard's temp file
from byte ranges of the staging files (:func:`~feedpipe.convert._writer.seal_ranges`: copied,
hashed, synced), while the parent fingerprints the plan, saves its state file, makes each
shard's index and commits the shards in order. The output is the general path's, byte for byte
(``tests/test_onepass.py``). What it saves is the ``stat`` per file and the wait between listing
and writing (``benchmarks/bench_convert.py``).

Anything unusual gives the run back to the general path (:func:`stage_tree` returns ``None``),
which owns the error messages and the ``on_error`` policy: a bad input of any kind (zero-byte,
no extension, unreadable, not UTF-8); a link, a special file or an unlistable directory; a
directory that may hold feedpipe output (``manifest.json``, ``.feedpipe-*`` files); files at
the root; a ``cls`` file under ``labels_from_dirs``, or a class directory without samples;
fewer top-level directories than workers.

A directory is one worker's work. OUT holds a directory's staged bytes beside the shards cut
from it, and each staging file goes as soon as its last shard is committed. So OUT needs room
for the data plus about its largest top-level directory.

Nothing is committed before the plan's fingerprint is saved, as on the general path. A run
killed while staging leaves only hidden temp files, which ``--resume`` or a new run removes. The
work done so far is lost: ``--resume`` then takes the general path, which keeps the shards
already committed.
"""

from __future__ import annotations

import gc
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from stat import S_ISREG
from typing import Any

from .._helpers.dependency import say_unbuilt
from .._helpers.pool_context import die_with_parent, pool_context, sigint_deferred, sigint_held
from .._helpers.progress import progress
from .._redact import logger
from ..format._index import ShardIndex, format_index
from ..format._keys import NEEDS_ESCAPE, valid_extension
from ..format._manifest import ShardRecord
from ..format._tar import BLOCK, SHORT_HEADER, member_header
from ._listing import Chunk, TreeListing, rows, write_chunk, write_rows
from ._source_tree import root_entries
from ._sources import (
    READ_FLAGS,
    FileRef,
    Listing,
    SampleSpec,
    classify,
    count_hidden,
    leave_out_non_images,
    read_local,
)
from ._writer import (
    commit,
    hidden,
    join_ranges,
    range_bases,
    removed_on_error,
    seal_ranges,
    unlink_quiet,
)

log = logger("feedpipe.convert")


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


def shard_index(cuts: list[Cut], bases: list[int]) -> ShardIndex:
    """The index of a shard joined from ``cuts``, each landed at ``bases[i]``: what
    :func:`~feedpipe.format._index.group_members` would make of its members, without parsing
    their names."""
    idx = ShardIndex([], [0], [], [], [], [])
    for cut, base in zip(cuts, bases):
        m = len(idx.exts)
        idx.keys += cut.keys
        idx.starts += [m + f for f in cut.first[1:]]
        idx.exts += cut.exts
        idx.names += cut.names
        idx.sizes += cut.sizes
        shift = base - cut.start
        idx.offsets += [o + shift for o in cut.offsets]
    return idx


def _walk_plain(root: str, top: str) -> list[tuple[str, list[str]]] | None:
    """The regular files below ``root/top`` in the listing's walk order (sorted per directory, a
    directory's files before its subdirectories), without a ``stat``: per directory, its path
    relative to ``root`` (ending in ``/``) and its files' names. ``None`` at a link, a special
    file or a directory that cannot be listed."""
    out: list[tuple[str, list[str]]] = []
    stack = [(top + "/", os.path.join(root, top))]
    while stack:
        rel_dir, path = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = list(it)
            # (without the entry type from the directory, these lstat)
            files = sorted([e.name for e in entries if e.is_file(follow_symlinks=False)])
            subdirs = []
            if len(files) < len(entries):
                for e in sorted((e for e in entries if not e.is_file(follow_symlinks=False)),
                                key=lambda e: e.name):
                    if not e.is_dir(follow_symlinks=False):
                        return None
                    subdirs.append((rel_dir + e.name + "/", e.path))
        except OSError:
            return None
        every = "/" + "/".join([e.name for e in entries]) + "/"
        if "/manifest.json/" in every or "/.feedpipe-" in every:
            return None  # perhaps feedpipe output: the general path's walk decides
        if files:
            out.append((rel_dir, files))
        stack.extend(reversed(subdirs))
    return out


# The shortcut of stage_dir: what classify would say of a plain path, judged a directory and a
# name at a time. A plain directory (relative, ending in "/") is ASCII, has nothing to escape and
# no hidden component; a plain name in it is the same, with one dot, which starts a valid field
# name (for a class folder, not "cls"). A plain file's key is its path without the extension.
def _plain_dir(rel_dir: str) -> bool:
    return (not rel_dir.startswith(".") and "/." not in rel_dir and rel_dir.isascii()
            and NEEDS_ESCAPE.search(rel_dir) is None)


def _plain_name(name: str, labels: bool, exts: dict[str, str | None]) -> tuple[str, str] | None:
    """``(stem, ext)`` of a plain name, else ``None``. ``exts`` caches each extension's verdict
    (a tree holds few distinct ones)."""
    dot = name.rfind(".")
    if (dot <= 0 or name.find(".") != dot or not name.isascii()
            or NEEDS_ESCAPE.search(name) is not None):
        return None
    ext = name[dot + 1:]
    ok = exts.get(ext, "")
    if ok == "":
        ok = exts[ext] = ext if valid_extension(ext) and not (labels and ext == "cls") else None
    return None if ok is None else (name[:dot], ok)


# a run of plain names joined by "/": each has one dot, with a stem and an extension
_PLAIN_RUN = re.compile(r"[^./]+\.[^./]+(?:/[^./]+\.[^./]+)*")


def _plain_names(names: list[str], labels: bool, exts: dict[str, str | None]
                 ) -> tuple[list[str], list[str]] | None:
    """``(stems, extensions)`` of ``names`` where every one is plain (what :func:`_plain_name`
    says of each, judged on the names joined), else ``None``."""
    joined = "/".join(names)
    if (not joined.isascii() or NEEDS_ESCAPE.search(joined) is not None
            or _PLAIN_RUN.fullmatch(joined) is None):
        return None
    parts = joined.replace(".", "/").split("/")
    found = parts[1::2]
    for ext in set(found):
        ok = exts.get(ext, "")
        if ok == "":
            ok = exts[ext] = ext if valid_extension(ext) and not (labels and ext == "cls") else None
        if ok is None:
            return None
    return parts[0::2], found


def _sample_key(rel: str, labels: bool, exts: dict[str, str | None]) -> tuple[str, str] | None:
    """``(key, ext)`` of the file ``rel`` (relative to the root, in a directory) by the shortcut,
    or ``None`` where it leaves the file to ``classify``."""
    head, _, name = rel.rpartition("/")
    if not head or not _plain_dir(head + "/"):
        return None
    got = _plain_name(name, labels, exts)
    return None if got is None else (f"{head}/{got[0]}", got[1])


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
    groups = _walk_plain(root, top)
    if groups is None:
        return None
    labels = cls is not None
    by_key: dict[str, list[tuple[str, str | None]]] = {}  # (None: the cls field, below)
    ignored = 0
    hidden: dict[str, int] = {}
    exts: dict[str, str | None] = {}
    for rel_dir, dir_names in groups:
        plain = _plain_dir(rel_dir)
        split = _plain_names(dir_names, labels, exts) if plain else None
        if split is not None:  # (most directories: every name plain, judged at once)
            stems, dir_exts = split
            paths = [rel_dir + n for n in dir_names]
            keyed: dict[str, list[tuple[str, str | None]]] = {
                rel_dir + k: [(e, r)] for k, e, r in zip(stems, dir_exts, paths)}
            if len(keyed) == len(paths):  # (one file a sample)
                by_key.update(keyed)
                continue
            for k, e, r in zip(stems, dir_exts, paths):
                key = rel_dir + k
                files = by_key.get(key)
                if files is None:
                    by_key[key] = [(e, r)]
                else:
                    files.append((e, r))
            continue
        for name in dir_names:
            fast = _plain_name(name, labels, exts) if plain else None
            if fast is not None:
                key, ext = rel_dir + fast[0], fast[1]
                rel = rel_dir + name
            else:
                rel = rel_dir + name
                got = classify(rel, 1, labels_from_dirs=labels)  # the size is checked once read
                if got is None:
                    ignored += 1
                    count_hidden(hidden, rel)
                    continue
                if isinstance(got, str) or (labels and got[1].ext == "cls"):
                    return None
                key, ext = got[0], got[1].ext
            files = by_key.get(key)
            if files is None:
                by_key[key] = [(ext, rel)]
            else:
                files.append((ext, rel))
    if labels and leave_out_non_images(
            {k: [FileRef(e, r or "", 1) for e, r in v] for k, v in by_key.items()}, [])[0]:
        return None  # the general path reports them
    keys = sorted(by_key)
    base = root if root.endswith("/") else root + "/"
    # per member in key order (flat): its field and its file relative to root (None: the cls
    # field, ``extra``); per sample: where its members start (ending with their count)
    members: list[list[tuple[str, str | None]]] = [by_key[k] for k in keys]
    if labels:
        for ms in members:
            ms.append(("cls", None))
    flat = list(itertools.chain.from_iterable(members))
    member_exts: list[str] = [e for e, _ in flat]
    rels: list[str | None] = [r for _, r in flat]
    first = list(itertools.accumulate(map(len, members), initial=0))
    extra = str(cls).encode() if labels else b""
    staged = StagedDir(Chunk(top, chunk_path), stage_path, keys, first=first, exts=member_exts)
    starts, names, offsets, sizes = staged.starts, staged.names, staged.offsets, staged.sizes
    rows: list[tuple[str, list[tuple[str, str, int]]]] = []
    pos = 0
    with removed_on_error(stage_path), open(stage_path, "wb") as out:
        i = 0
        dirfd = _open_dir(root) if _C is not None else -1
        try:
            while i < len(keys):
                if _C is not None and dirfd >= 0:  # as many samples as it can; the next here
                    i, pos = _C.stage(dirfd, out.fileno(), keys, first, member_exts, rels, extra,
                                      _TEMPLATE, i, pos, _GUESS, READ_FLAGS, starts, names,
                                      offsets, sizes, rows)
                    if i == len(keys):
                        break
                    j = i + 1
                else:
                    j = len(keys)
                reached = _stage_samples(out, base, keys, first, member_exts, rels, extra, i, j,
                                         pos, staged, rows)
                if reached is None:  # unreadable, empty or not a regular file: the general path
                    # says which and why
                    out.close()
                    unlink_quiet(stage_path)
                    return None
                out.flush()  # (before the C loop writes to the file again)
                i, pos = j, reached
        finally:
            if dirfd >= 0:
                os.close(dirfd)
        starts.append(pos)
    with removed_on_error(stage_path, chunk_path):  # (a partial chunk: with the listing's tmp)
        write_rows(chunk_path, rows)
    c = staged.chunk
    c.samples, c.files, c.ignored = len(keys), len(rels) - labels * len(keys), ignored
    c.hidden = hidden
    if keys:
        c.first, c.last = keys[0], keys[-1]
    return staged


try:  # optional C extension (setup.py): the per-file loop of stage_dir
    from .. import _stagefiles as _C
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
    """What runs one-pass staging's per-file loop: the C extension ``feedpipe._stagefiles``
    where it was built, else ``python`` (the same bytes, more slowly)."""
    return "python" if _C is None else "feedpipe._stagefiles"


def _stage_samples(out: Any, base: str, keys: list[str], first: list[int], exts: list[str],
                   rels: list[str | None], extra: bytes, a: int, b: int, pos: int,
                   staged: StagedDir, rows: list[tuple[str, list[tuple[str, str, int]]]]
                   ) -> int | None:
    """Stage samples ``a`` to ``b`` (exclusive) of :func:`stage_dir`'s flat lists into ``out``
    from ``pos``, appending to ``staged``'s lists and ``rows`` as ``feedpipe._stagefiles``
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


def _samples(chunk_path: str, extra: tuple[str, bytes] | None) -> list[SampleSpec]:
    """The samples of a staged directory's chunk file, as the listing makes them; ``extra``:
    the ``cls`` field of each (``--labels-from-dirs``: one class per top-level directory)."""
    make = FileRef._make
    if extra is None:
        return [SampleSpec(key, [make(r) for r in files]) for key, files in rows(chunk_path)]
    return [SampleSpec(key, [make(r) for r in files], [extra])
            for key, files in rows(chunk_path)]


class StagedListing(TreeListing):
    """The :class:`~feedpipe.convert._listing.TreeListing` of a staged tree whose root holds no
    samples, its samples made as the directories were staged (``samples``: per top-level
    directory). :meth:`to_listing` puts them in the listing's order: by key, which is the
    order of the directories' first keys, the directories' key ranges being disjoint."""

    def __init__(self, chunks: list[Chunk], tmp: str, labels_from_dirs: bool,
                 samples: dict[str, list[SampleSpec]]) -> None:
        super().__init__(chunks, tmp, labels_from_dirs)
        self._samples = samples

    def to_listing(self) -> Listing:
        dirs = sorted((c for c in self.chunks if c.top and c.samples), key=lambda c: c.first or "")
        out: list[SampleSpec] = []
        for c in dirs:
            out += self._samples[c.top]
        return Listing(out, self.problems, self.classes, self.ignored, self.outputs,
                       self.left_out, self.hidden)


class StagedTree:
    """A staged tree: ``listing`` (a :class:`~feedpipe.convert._listing.TreeListing`, sizes as
    read; ``None`` for a staged table, whose listing is in memory) and the staged directories
    in the listing's order. :meth:`join` cuts shards out of
    them; :meth:`close` removes every staging and chunk file."""

    def __init__(self, listing: TreeListing | None, dirs: list[StagedDir], paths: list[str],
                 pool: ProcessPoolExecutor | None) -> None:
        self.listing = listing
        self.dirs = dirs
        self._paths = paths  # every staging file, those of directories without samples too
        self._pool = pool  # the staging workers, which seal the shards too
        self._jobs: list[tuple[int, list[Cut]]] | None = None  # per shard: its cuts (started)
        self._futures: list[Any] | None = None  # per shard: its seal on the pool (started)
        self._committed = 0  # the shards of _futures committed so far (in order)

    def sample_sizes(self) -> list[int]:
        """The bytes each sample takes in a shard (:func:`~feedpipe.convert._shard_plan.
        sample_size`), in the listing's order: as staged, their members being the shard's."""
        out: list[int] = []
        for sd in self.dirs:
            starts = sd.starts
            out += [b - a for a, b in zip(starts, starts[1:])]
        return out

    def cuts(self, counts: list[int]) -> Iterator[list[Cut]]:
        """Per shard of ``counts[i]`` consecutive samples (in listing order), its cuts."""
        d, k = 0, 0  # the directory and the sample in it where the next shard starts
        dirs = self.dirs
        for n in counts:
            out: list[Cut] = []
            while n:
                sd = dirs[d]
                take = min(n, len(sd.keys) - k)
                out.append(sd.cut(k, k + take))
                n -= take
                k += take
                if k == len(sd.keys):
                    d, k = d + 1, 0
            yield out

    def start(self, plan: list[list[list[SampleSpec]]], names: list[str], out: str) -> None:
        """Start sealing the shards of ``plan`` on the staging workers (see :meth:`join`), as
        soon as the plan is made: the caller's work until :meth:`join` (the plan's fingerprint
        and its state file, which must precede any commit but no copy) overlaps theirs. Without
        a pool, or for one shard, nothing starts before :meth:`join`."""
        if self._pool is None or len(plan) <= 1 or self._jobs is not None:
            return
        counts = [sum(len(p) for p in shard) for shard in plan]
        self._jobs = list(enumerate(self.cuts(counts)))
        pool = self._pool
        with sigint_held():  # (workers started before: only the submissions)
            self._futures = [pool.submit(seal_ranges, out, names[i], cut_ranges(cuts))
                             for i, cuts in self._jobs]

    def join(self, plan: list[list[list[SampleSpec]]], names: list[str], out: str,
             record: Callable[[int, ShardRecord, set[str]], None]) -> None:
        """Write every shard of ``plan`` (a plan of this listing's samples, in order) from the
        staged bytes, on the staging workers; ``record(i, rec, fields)`` as each is committed.

        The workers seal each shard's temp file (copied, hashed, synced); this process makes its
        index meanwhile and commits it (index, record, rename)."""
        self.start(plan, names, out)
        if self._jobs is None:
            counts = [sum(len(p) for p in shard) for shard in plan]
            jobs = list(enumerate(self.cuts(counts)))
        else:
            jobs = self._jobs
        last = {cut.path: i for i, cuts in jobs for cut in cuts}  # the last shard cut from each
        by_shard: dict[int, list[str]] = {}
        for path, i in last.items():
            by_shard.setdefault(i, []).append(path)

        def done(i: int, rec: ShardRecord, fields: set[str]) -> None:
            record(i, rec, fields)
            for path in by_shard.get(i, ()):  # all shards up to i are committed: OUT holds
                unlink_quiet(path)  # the staged bytes once, not once more as shards

        futures = self._futures
        if futures is None:
            for i, cuts in jobs:
                done(i, *join_cuts(out, names[i], cuts))
            return
        # a Ctrl-C is raised between shards, never inside the pool (see sigint_deferred)
        with sigint_deferred() as interrupted:
            try:
                for (i, cuts), fut in zip(jobs, futures):  # in shard order
                    # the index is made here while the workers copy and hash: this process
                    # has nothing else to do meanwhile, and they have no core to spare
                    idx = shard_index(cuts, range_bases([c.length for c in cuts]))
                    text = format_index(idx)
                    tmp, _, total, sha256 = fut.result()
                    with removed_on_error(tmp, os.path.join(out, names[i])):
                        rec = commit(out, names[i], tmp, total, sha256, idx, [],
                                     index_text=text)
                    self._committed += 1
                    done(i, rec, idx.fields())
                    interrupted()
            except BaseException:
                self._stop()
                raise

    def _stop(self) -> None:
        """Shut the pool down, letting the seals under way finish, and remove the temp shards
        sealed but not committed (those of a failed or interrupted run)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for fut in (self._futures or [])[self._committed:]:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                unlink_quiet(fut.result()[0])

    def close(self) -> None:
        with sigint_deferred():  # a Ctrl-C neither in the pool's shutdown nor before the cleanup
            self._stop()  # (waits for a seal under way)
            for path in self._paths:
                unlink_quiet(path)
            if self.listing is not None:
                self.listing.close()


class StagedExecutor:
    """The conversion executor of the one-pass method (see
    :mod:`feedpipe.convert._executors`): the shards cut from ``staged``'s files."""

    name = "staged"

    def __init__(self, staged: StagedTree, workers: int, description: str = "") -> None:
        self.staged = staged
        self.workers = workers
        self.description = description  # (default: the workers)

    def run(self, job: Any) -> int:
        plan = job.plan

        shown = getattr(job.bar, "shown", True)

        def record(i: int, rec: ShardRecord, fields: set[str]) -> None:
            job.record(i, rec, [], fields)
            if shown:  # (a count per sample: not made for a bar that shows nothing)
                job.bar.update(sum(len(s.files) for part in plan[i] for s in part))

        self.staged.join(plan, job.names, job.out, record)
        return 0

    def describe(self) -> str:
        return self.description or f"one pass, {self.workers} worker{'s' * (self.workers > 1)}"


def cut_ranges(cuts: list[Cut]) -> list[tuple[str, int, int]]:
    """The byte ranges of ``cuts``, as :func:`~feedpipe.convert._writer.join_ranges` takes
    them."""
    return [(c.path, c.start, c.length) for c in cuts]


def join_cuts(out: str, name: str, cuts: list[Cut]) -> tuple[ShardRecord, set[str]]:
    """Join ``cuts`` into the shard ``out/name``; its record and fields."""
    rec, idx = join_ranges(out, name, cut_ranges(cuts), lambda bases: shard_index(cuts, bases),
                           [])
    return rec, idx.fields()


def stage_tree(src: str, out: str, prefix: str, *, labels_from_dirs: bool, workers: int,
               show_progress: bool | None = None, start_method: str | None = None,
               why: list[str] | None = None) -> StagedTree | None:
    """Stage the local tree ``src`` into hidden files of ``out`` (see the module docstring), or
    ``None`` when the general path must convert it (the reason then appended to ``why``)."""
    said = why if why is not None else []
    if _C is None:
        say_unbuilt(log, "_stagefiles", "one-pass conversion stages its files with a Python "
                    "loop", "the shards are the same")
    # (a directory of feedpipe output is not looked for here: each worker's walk of its
    # directory gives the run back at the signs of one, a manifest.json or .feedpipe-* file)
    files, dirs, outputs = root_entries(src, outputs=False)
    visible = [d for d in dirs if not d.startswith(".")]
    if outputs or any(os.path.islink(os.path.join(src, d)) for d in dirs):
        # links are followed and output directories skipped by the general path
        said.append("a top-level directory is a symbolic link or holds feedpipe output")
        return None
    if any(not name.startswith(".") for name, _ in files):
        said.append("files at the top of the tree (one-pass stages top-level directories)")
        return None
    if len(visible) < max(2, workers):
        # a directory is one worker's: fewer than the workers would leave some idle, and one
        # big directory would need room for the data twice (staged, then as shards)
        said.append(f"{len(visible)} top-level director{'y' if len(visible) == 1 else 'ies'} "
                    f"for {max(2, workers)} workers (one-pass gives each worker a directory)")
        return None
    chunk_paths = [f"{i:08d}.chunk" for i in range(len(dirs))]
    stage_paths = [hidden(out, f"{prefix}-stage{i:06d}", f".tmp-{os.getpid()}")
                   for i in range(len(dirs))]
    # class indices: the listing's classes are the top-level directories with samples, and a
    # hidden one never has any (a visible one without samples sends the run back)
    index = {d: i for i, d in enumerate(visible)}
    classes = ([index.get(d) for d in dirs] if labels_from_dirs
               else itertools.repeat(None))
    staged: list[StagedDir] = []
    ok = False
    tmp = tempfile.mkdtemp(prefix="feedpipe-listing-")
    pool = None
    try:
        root_chunk = write_chunk(files, "", os.path.join(tmp, "root.chunk"), labels_from_dirs)
        chunk_paths = [os.path.join(tmp, p) for p in chunk_paths]
        bar = progress(len(dirs), "shard", "dir", show_progress)
        args = (itertools.repeat(src), dirs, classes, chunk_paths, stage_paths)
        if workers <= 1 or len(dirs) <= 1:
            results: Any = map(stage_dir, *args)
        else:
            import multiprocessing as mp

            ctx = pool_context() if start_method is None else mp.get_context(start_method)
            pool = ProcessPoolExecutor(min(workers, len(dirs)), mp_context=ctx,
                                       initializer=die_with_parent, initargs=(os.getpid(),))
            with sigint_held():  # the workers start as the tasks are submitted
                results = pool.map(stage_dir, *args)
        # with a pool, a Ctrl-C is raised between directories, never inside it (see
        # sigint_deferred); staged here, it stops the staging at once
        # each directory's samples are read back here as it comes in, while the workers stage
        # the next ones: this process would wait for them otherwise (the objects are none of
        # them garbage: the collector is paused meanwhile, as in TreeListing.to_listing)
        samples: dict[str, list[SampleSpec]] = {}
        paused = gc.isenabled()
        gc.disable()
        with sigint_deferred(pool is not None) as interrupted:
            try:
                for top, sd in zip(dirs, results):
                    if sd is None:
                        said.append(f"directory {top!r} holds what only the general method "
                                    "converts (a bad input, a file that is not an image beside "
                                    "images, a link or special file, an unlistable directory, "
                                    "possible feedpipe output or a cls file)")
                        return None
                    staged.append(sd)
                    cls = index.get(top) if labels_from_dirs else None
                    samples[top] = _samples(sd.chunk.path, None if cls is None
                                            else ("cls", str(cls).encode()))
                    bar.update(1)
                    interrupted()
            finally:
                bar.close()
                if paused:
                    gc.enable()
        if labels_from_dirs and any(sd.chunk.samples == 0 for sd in staged
                                    if not sd.chunk.top.startswith(".")):
            # the class indices given to the workers counted it
            said.append("a class directory without samples")
            return None
        chunks = [root_chunk, *(sd.chunk for sd in staged)]
        listing = (TreeListing(chunks, tmp, labels_from_dirs) if root_chunk.samples
                   else StagedListing(chunks, tmp, labels_from_dirs, samples))
        if not listing.samples:
            said.append("no samples")  # the general path says what the tree holds instead
            return None
        order = sorted((sd for sd in staged if sd.chunk.samples),
                       key=lambda sd: sd.chunk.first or "")
        if any(a.chunk.last >= b.chunk.first  # type: ignore[operator]
               for a, b in zip(order, order[1:])):
            # cannot happen with feedpipe's key encoding (see feedpipe.convert._listing)
            said.append("the key ranges of two top-level directories overlap")
            return None
        ok = True
        return StagedTree(listing, order, stage_paths, pool)
    finally:
        if not ok:
            with sigint_deferred():  # nor in the shutdown, nor before the cleanup
                if pool is not None:
                    pool.shutdown(cancel_futures=True)
                for p in stage_paths:
                    unlink_quiet(p)
                shutil.rmtree(tmp, ignore_errors=True)
