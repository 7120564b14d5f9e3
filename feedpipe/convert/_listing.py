"""Listing big source trees: in parallel per top-level directory, streamed through sorted chunks.

A tree of millions of files is listed by one task per top-level directory: processes for a local
tree, threads for an fsspec URL (whose listing waits on the network). Each task groups its files
into samples (:func:`~feedpipe.convert._sources.classify`), sorts them by key and writes them to
a *chunk* file in a private temporary directory. A chunk holds length-prefixed ``marshal``
records of up to :data:`CHUNK_ROWS` samples each: plain tuples of str and int, which load
without running code (unlike pickle) and without parsing text (unlike JSON). The parent keeps
per-chunk counts only. Iterating a :class:`TreeListing` streams the samples from the
chunks in global key order. So no process holds a Python object per file of the whole tree: a
task holds one top-level directory, the parent one sample at a time.

The result is exactly :func:`~feedpipe.convert._sources.list_tree`'s: the same samples in the
same order, the same problems in the same (walk) order, the same classes and hidden files.
Keys of one top-level directory all start with that directory's encoded name and a ``/``. So
the chunks of directories cover disjoint, consecutive key ranges: the stream chains
them in order and merges only the root directory's own files in between.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import marshal
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .._helpers.pool_context import die_with_parent, sigint_deferred, sigint_held
from .._helpers.progress import progress
from .._helpers.storage import is_local, local_path
from .._helpers.storage_listing import list_dir
from ._source_tree import Identity, TreeWalk, identity, root_entries
from ._sources import (
    FileRef,
    Listing,
    SampleSpec,
    add_class_field,
    check_source_dir,
    classify,
    count_hidden,
    hidden_skipped,
    leave_out_non_images,
    output_identity,
    printable,
    walk_remote,
)

CHUNK_ROWS = 4096  # samples per marshal record of a chunk file: what the parent holds at once


@dataclass
class Chunk:
    """The listing of one top-level directory (``top``; ``""``: the root's own files)."""

    top: str
    path: str
    samples: int = 0
    files: int = 0
    first: str | None = None
    last: str | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)
    ignored: int = 0
    outputs: list[str] = field(default_factory=list)  # output directories skipped
    left_out: list[tuple[str, str]] = field(default_factory=list)  # not images (labels)
    hidden: dict[str, int] = field(default_factory=dict)  # hidden files, by hidden_entry


def top_entries(src: str, skip: frozenset[Identity] = frozenset()
                  ) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    """The root's files ``(name, size)``, its subdirectories and the output directories
    skipped among them (:mod:`feedpipe.convert._source_tree`), each sorted by name."""
    if is_local(src):
        return root_entries(local_path(src), skip)
    files, dirs = list_dir(src)
    return files, dirs, []


def _list_dir(src: str, top: str, path: str, labels_from_dirs: bool,
              skip: frozenset[Identity] = frozenset()) -> Chunk:
    """List the top-level directory ``top`` into the chunk file ``path``."""
    if not is_local(src):
        remote = walk_remote(f"{src.rstrip('/')}/{top}")
        return write_chunk(((f"{top}/{rel}", size) for rel, size in remote), top, path,
                           labels_from_dirs)
    root = local_path(src)
    sub = os.path.join(root, top)
    above = identity(root)
    walk = TreeWalk(sub, ancestors=(above,) if above else (), skip=skip)
    # an unlistable directory comes back as its full path: name it like list_tree does
    entries = ((top if rel == sub else f"{top}/{rel}", size) for rel, size in walk)
    chunk = write_chunk(entries, top, path, labels_from_dirs)
    chunk.outputs = [printable(f"{top}/{o}") for o in walk.outputs]
    return chunk


def write_chunk(entries: Iterable[tuple[str, int]], top: str, path: str,
                labels_from_dirs: bool) -> Chunk:
    """Group ``entries`` into samples, sort them by key and write them to ``path``."""
    chunk = Chunk(top, path)
    by_key: dict[str, list[FileRef]] = {}
    for rel, size in entries:
        got = classify(rel, size, labels_from_dirs=labels_from_dirs)
        if got is None:
            chunk.ignored += 1
            count_hidden(chunk.hidden, rel)
        elif isinstance(got, str):
            chunk.problems.append((printable(rel), got))
        else:
            by_key.setdefault(got[0], []).append(got[1])
            chunk.files += 1
    if labels_from_dirs:  # (a chunk is one top-level directory: one class folder)
        chunk.left_out, chunk.problems = leave_out_non_images(by_key, chunk.problems)
        chunk.files = sum(map(len, by_key.values()))
    keys = sorted(by_key)
    rows = ((k, [tuple(r) for r in by_key[k]]) for k in keys)  # (marshal takes plain tuples)
    write_rows(path, rows)  # type: ignore[arg-type]
    chunk.samples = len(keys)
    if keys:
        chunk.first, chunk.last = keys[0], keys[-1]
    return chunk


def write_rows(path: str, rows: Iterable[tuple[str, list[tuple[str, str, int]]]]) -> None:
    """Write a chunk file: ``rows`` (``(key, [(ext, path, size), ...])``, sorted by key) as
    length-prefixed ``marshal`` records of up to :data:`CHUNK_ROWS` rows (read by
    :func:`_rows`)."""
    it = iter(rows)
    with open(path, "wb") as f:
        while batch := list(itertools.islice(it, CHUNK_ROWS)):
            record = marshal.dumps(batch)
            f.write(len(record).to_bytes(8, "little"))
            f.write(record)


def rows(path: str) -> Iterator[tuple[str, list[tuple[str, str, int]]]]:
    """The rows of a chunk file (:func:`write_rows`), each file as a plain tuple."""
    # length-prefixed records: marshal.load from a file object reads it a few bytes at a time
    with open(path, "rb") as f:
        while head := f.read(8):
            yield from marshal.loads(f.read(int.from_bytes(head, "little")))


def _rows(path: str) -> Iterator[tuple[str, list[FileRef]]]:
    # length-prefixed records: marshal.load from a file object reads it a few bytes at a time
    make = FileRef._make
    with open(path, "rb") as f:
        while head := f.read(8):
            rows = marshal.loads(f.read(int.from_bytes(head, "little")))
            for key, files in rows:
                yield key, [make(r) for r in files]


class TreeListing:
    """The listing of a source tree, streamed from sorted chunk files.

    Attributes: ``samples`` and ``files`` (counts), ``problems`` (``(path, reason)`` in walk
    order), ``classes`` (``--labels-from-dirs``), ``ignored`` (hidden files) and ``hidden``
    (``(path, reason)`` of each, a hidden directory once), ``outputs`` (output
    directories skipped, :mod:`feedpipe.convert._source_tree`). Iterating yields
    :class:`SampleSpec` objects sorted by key. Use it as a context manager (or call
    :meth:`close`) to delete the chunk files.
    """

    def __init__(self, chunks: list[Chunk], tmp: str, labels_from_dirs: bool) -> None:
        self.chunks = chunks
        self._tmp = tmp
        self.samples = sum(c.samples for c in chunks)
        self.files = sum(c.files for c in chunks)
        self.problems = [p for c in chunks for p in c.problems]
        self.ignored = sum(c.ignored for c in chunks)
        self.outputs = sorted(o for c in chunks for o in c.outputs)
        self.left_out = sorted(p for c in chunks for p in c.left_out)
        # (a hidden entry lies in one top-level directory: the chunks' entries are disjoint)
        self.hidden = hidden_skipped({p: n for c in chunks for p, n in c.hidden.items()})
        self.classes: list[str] | None = None
        if labels_from_dirs:
            self.classes = sorted(c.top for c in chunks if c.top and c.samples)
        self._index = {c: i for i, c in enumerate(self.classes or ())}

    def _ordered(self) -> Iterator[tuple[str, list[FileRef]]]:
        root = [c for c in self.chunks if not c.top and c.samples]
        dirs = sorted((c for c in self.chunks if c.top and c.samples), key=lambda c: c.first or "")
        disjoint = all(a.last < b.first for a, b in zip(dirs, dirs[1:]))  # type: ignore[operator]
        streams: list[Iterator[tuple[str, list[FileRef]]]]
        if disjoint:
            streams = [itertools.chain.from_iterable(_rows(c.path) for c in dirs)]
        else:  # cannot happen with feedpipe's key encoding; merge all rather than be wrong
            streams = [_rows(c.path) for c in dirs]
        streams += [_rows(c.path) for c in root]
        if len(streams) == 1:  # (a merge of one stream would only add its cost per row)
            return streams[0]
        return heapq.merge(*streams, key=lambda row: row[0])

    def __iter__(self) -> Iterator[SampleSpec]:
        for key, files in self._ordered():
            spec = SampleSpec(key, files)
            if self.classes is not None:
                add_class_field(spec, self._index)
            yield spec

    def to_listing(self) -> Listing:
        """Everything in memory, as :func:`feedpipe.convert._sources.list_tree` returns it.

        The cyclic garbage collector is paused while the list is built. The list holds three
        objects per sample, none garbage, and the full collections that a growing heap triggers
        would walk them again and again (``benchmarks/bench_listing.py``)."""
        paused = gc.isenabled()
        gc.disable()
        try:
            return Listing(list(self), self.problems, self.classes, self.ignored, self.outputs,
                           self.left_out, self.hidden)
        finally:
            if paused:
                gc.enable()

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> TreeListing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _executor(src: str, workers: int) -> Executor:
    if not is_local(src):
        return ThreadPoolExecutor(workers)
    import multiprocessing as mp

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(workers, mp_context=mp.get_context(method),
                               initializer=die_with_parent, initargs=(os.getpid(),))


def list_tree_parallel(
    src: str,
    *,
    labels_from_dirs: bool = False,
    workers: int | None = None,
    show_progress: bool | None = None,
    tmp_dir: str | None = None,
    exclude: str | None = None,
) -> TreeListing:
    """List the tree at ``src`` with one task per top-level directory, ``workers`` at a time.

    Args:
        src: a local directory or fsspec URL.
        labels_from_dirs: image-folder layout (see :func:`feedpipe.shard`).
        workers: parallel listing tasks (default: all cores; 1 lists in this process).
        show_progress: a progress bar over top-level directories (default: on a terminal).
        tmp_dir: where the chunk files go (default: the system temp directory).
        exclude: the conversion's output directory: skipped if it is inside ``src`` (as any
            directory holding feedpipe output is, see :mod:`feedpipe.convert._source_tree`).

    Returns:
        A :class:`TreeListing` (close it to remove its chunk files).

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "b").mkdir(), (d / "b" / "x.txt").write_text("1")
        >>> _ = (d / "a.txt").write_text("2")
        >>> with list_tree_parallel(str(d), workers=1) as t:
        ...     [s.key for s in t]
        ['a', 'b/x']
    """
    check_source_dir(src)
    skip = output_identity(exclude)
    tmp = tempfile.mkdtemp(prefix="feedpipe-listing-", dir=tmp_dir)
    try:
        root_files, dirs, outputs = top_entries(src, skip)
        chunks = [write_chunk(root_files, "", os.path.join(tmp, "root.chunk"), labels_from_dirs)]
        chunks[0].outputs = [printable(o) for o in outputs]
        paths = [os.path.join(tmp, f"{i:08d}.chunk") for i in range(len(dirs))]
        nworkers = min(workers if workers is not None else (os.cpu_count() or 1), len(dirs))
        bar = progress(len(dirs), "list", "dir", show_progress)
        files = chunks[0].files
        pool: Any = None
        # with a pool, a Ctrl-C is raised between directories, never inside it, nor in its
        # shutdown (see sigint_deferred); listed here, it stops the listing at once
        with sigint_deferred(nworkers > 1) as interrupted:
            try:
                if nworkers <= 1:
                    results: Iterable[Chunk] = (
                        _list_dir(src, d, p, labels_from_dirs, skip)
                        for d, p in zip(dirs, paths))
                else:
                    pool = _executor(src, nworkers)
                    with sigint_held():  # the workers start as the tasks are submitted
                        results = pool.map(_list_dir, itertools.repeat(src), dirs, paths,
                                           itertools.repeat(labels_from_dirs),
                                           itertools.repeat(skip))
                for chunk in results:  # in directory order: the walk order of the problems
                    chunks.append(chunk)
                    files += chunk.files
                    bar.update(1)
                    bar.set_postfix_str(f"{files:,} files", refresh=False)
                    interrupted()
            finally:
                if pool is not None:
                    pool.shutdown(cancel_futures=True)
                bar.close()
        return TreeListing(chunks, tmp, labels_from_dirs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
