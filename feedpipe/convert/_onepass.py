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

Each worker's part (walk, group, read and stage one directory) is
:func:`~feedpipe.convert._stage_dir.stage_dir`, its walk and grouping in
:mod:`~feedpipe.convert._stage_walk`; this module plans the tree's staging (:func:`stage_tree`)
and cuts the shards (:class:`StagedTree`).

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
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from .._helpers.dependency import say_unbuilt
from .._helpers.pool_context import die_with_parent, pool_context, sigint_deferred, sigint_held
from .._helpers.progress import progress
from .._redact import logger
from ..format._index import ShardIndex, format_index
from ..format._manifest import ShardRecord
from ._listing import Chunk, TreeListing, rows, write_chunk
from ._source_tree import root_entries
from ._sources import FileRef, Listing, SampleSpec
from ._stage_dir import Cut, StagedDir, stage_dir, stage_files_with
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
    if stage_files_with() == "python":
        say_unbuilt(log, "_native._stagefiles", "one-pass conversion stages its files with a "
                    "Python loop", "the shards are the same")
    # (a directory of feedpipe output is not looked for here: each worker's walk of its
    # directory gives the run back at the signs of one, a manifest.json or .feedpipe-* file)
    files, dirs, outputs = root_entries(src, outputs=False)
    unfit = _unfit(src, files, dirs, outputs, workers)
    if unfit is not None:
        said.append(unfit)
        return None
    stage_paths = [hidden(out, f"{prefix}-stage{i:06d}", f".tmp-{os.getpid()}")
                   for i in range(len(dirs))]
    # class indices: the listing's classes are the top-level directories with samples, and a
    # hidden one never has any (a visible one without samples sends the run back)
    index = {d: i for i, d in enumerate(d for d in dirs if not d.startswith("."))}
    classes = ([index.get(d) for d in dirs] if labels_from_dirs
               else itertools.repeat(None))
    ok = False
    tmp = tempfile.mkdtemp(prefix="feedpipe-listing-")
    pool = None
    try:
        root_chunk = write_chunk(files, "", os.path.join(tmp, "root.chunk"), labels_from_dirs)
        chunk_paths = [os.path.join(tmp, f"{i:08d}.chunk") for i in range(len(dirs))]
        bar = progress(len(dirs), "shard", "dir", show_progress)
        args = (itertools.repeat(src), dirs, classes, chunk_paths, stage_paths)
        if workers > 1 and len(dirs) > 1:
            pool = _pool(min(workers, len(dirs)), start_method)
        results = _stage_dirs(pool, args)
        got = _collect(dirs, results, pool is not None, index if labels_from_dirs else None,
                       bar, said)
        tree = None if got is None else _staged_tree(root_chunk, *got, tmp, labels_from_dirs,
                                                     stage_paths, pool, said)
        ok = tree is not None
        return tree
    finally:
        if not ok:
            with sigint_deferred():  # nor in the shutdown, nor before the cleanup
                if pool is not None:
                    pool.shutdown(cancel_futures=True)
                for p in stage_paths:
                    unlink_quiet(p)
                shutil.rmtree(tmp, ignore_errors=True)


def _unfit(src: str, files: list[tuple[str, Any]], dirs: list[str], outputs: Any,
           workers: int) -> str | None:
    """Why the tree at ``src`` is not for one-pass staging (judged from its top level), or
    ``None``."""
    if outputs or any(os.path.islink(os.path.join(src, d)) for d in dirs):
        # links are followed and output directories skipped by the general path
        return "a top-level directory is a symbolic link or holds feedpipe output"
    if any(not name.startswith(".") for name, _ in files):
        return "files at the top of the tree (one-pass stages top-level directories)"
    visible = [d for d in dirs if not d.startswith(".")]
    if len(visible) < max(2, workers):
        # a directory is one worker's: fewer than the workers would leave some idle, and one
        # big directory would need room for the data twice (staged, then as shards)
        return (f"{len(visible)} top-level director{'y' if len(visible) == 1 else 'ies'} "
                f"for {max(2, workers)} workers (one-pass gives each worker a directory)")
    return None


def _pool(workers: int, start_method: str | None) -> ProcessPoolExecutor:
    import multiprocessing as mp

    ctx = pool_context() if start_method is None else mp.get_context(start_method)
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=die_with_parent,
                               initargs=(os.getpid(),))


def _stage_dirs(pool: ProcessPoolExecutor | None, args: tuple[Any, ...]) -> Iterator[Any]:
    """:func:`stage_dir` of each directory, in order: here, or on the pool's workers."""
    if pool is None:
        return map(stage_dir, *args)
    with sigint_held():  # the workers start as the tasks are submitted
        return pool.map(stage_dir, *args)


def _collect(dirs: list[str], results: Iterator[StagedDir | None], pooled: bool,
             index: dict[str, int] | None, bar: Any, said: list[str]
             ) -> tuple[list[StagedDir], dict[str, list[SampleSpec]]] | None:
    """The staged directories and each one's samples, read back as each comes in, while the
    workers stage the next ones (this process would wait for them otherwise); ``None`` where a
    directory was given back. ``index``: the class index of each directory under
    ``labels_from_dirs``."""
    staged: list[StagedDir] = []
    samples: dict[str, list[SampleSpec]] = {}
    # the objects made here are none of them garbage: the collector is paused meanwhile, as in
    # TreeListing.to_listing
    paused = gc.isenabled()
    gc.disable()
    # with a pool, a Ctrl-C is raised between directories, never inside it (see
    # sigint_deferred); staged here, it stops the staging at once
    with sigint_deferred(pooled) as interrupted:
        try:
            for top, sd in zip(dirs, results):
                if sd is None:
                    said.append(f"directory {top!r} holds what only the general method "
                                "converts (a bad input, a file that is not an image beside "
                                "images, a link or special file, an unlistable directory, "
                                "possible feedpipe output or a cls file)")
                    return None
                staged.append(sd)
                cls = None if index is None else index.get(top)
                samples[top] = _samples(sd.chunk.path, None if cls is None
                                        else ("cls", str(cls).encode()))
                bar.update(1)
                interrupted()
        finally:
            bar.close()
            if paused:
                gc.enable()
    return staged, samples


def _staged_tree(root_chunk: Chunk, staged: list[StagedDir],
                 samples: dict[str, list[SampleSpec]], tmp: str, labels_from_dirs: bool,
                 stage_paths: list[str], pool: ProcessPoolExecutor | None,
                 said: list[str]) -> StagedTree | None:
    """The staged tree of the directories ``staged``, or ``None`` (the reason in ``said``)."""
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
    return StagedTree(listing, order, stage_paths, pool)
