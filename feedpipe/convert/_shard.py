"""``feedpipe shard``: convert a small-file dataset into WebDataset shards.

A conversion is planned in full before any shard is written. Samples are listed and sorted, and
shuffled with ``seed`` if asked. They are cut into shards by ``max_bytes`` and ``max_samples``
using exact tar sizes, and each shard into parts (:mod:`~feedpipe.convert._shard_plan`). An
executor (:mod:`~feedpipe.convert._executors`) writes the parts and joins them into shards in
order. So the bytes of a shard depend on the inputs and options only, never on ``workers``, the
executor or timing. A run killed at any moment resumes with ``resume=True``: committed shards are
kept and the rest is redone.

One table chooses the *method* (:func:`~feedpipe.convert._method.choose_method`):

- ``general``: list, plan, then write (in this process, a process pool or a Dask cluster).
- ``one-pass``: a fresh run over a local tree of top-level directories. One worker lists, reads
  and stages each directory; the shards are cut from the staged bytes
  (:mod:`~feedpipe.convert._onepass`).
- ``table``: a Parquet source. Its rows are listed as samples
  (:mod:`~feedpipe.convert._table_rows`), then planned and written as in ``general``.

``general`` and ``one-pass`` write the same shards, indexes and plan fingerprint, so either
resumes the other's run. The manifest's ``created_by.method`` names the one that wrote it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from contextlib import closing, nullcontext
from typing import Any

from .._helpers.pool_context import CommitPoint
from .._helpers.storage import is_local, local_path
from .._redact import logger, redact
from ..errors import InputError, OutputError
from ._file_list import list_manifest
from ._gc_freeze import frozen
from ._listing_checks import check_not_empty, drop_problems
from ._method import Choice, Facts, choose_method
from ._onepass import StagedTree, stage_tree
from ._options import DEFAULT_MAX_BYTES, ShardOptions  # noqa: F401  (re-exported)
from ._output_dir import (
    clean_temps,
    prepare_out,
    take_lock,
)
from ._parts import PartInfo, parse_part, part_tag
from ._shard_run import (
    ALREADY_COMPLETE,  # noqa: F401  (re-exported)
    COMMIT_POINT,
    convert_listing,
)
from ._sources import Listing, hidden_skipped, printable
from ._summary import ShardSummary
from ._writer import hidden

log = logger("feedpipe.convert")


def shard(src: str, out: str, options: ShardOptions | None = None, /,
          **overrides: Any) -> ShardSummary:
    """Convert the small-file dataset at ``src`` into shards in ``out``.

    Args:
        src: a local directory or fsspec URL (a folder tree; with ``manifest``, the root the
            manifest's paths are relative to), or a Parquet file or directory of them.
        out: a local directory, missing or empty (or holding an interrupted run with ``resume``).
        options: a :class:`feedpipe.ShardOptions` (default: its defaults).
        **overrides: any of its fields by name, over ``options`` (``workers=2, resume=True``).

    Returns:
        A :class:`feedpipe.ShardSummary`. Its ``method`` and ``executor`` say how the run went.

    Raises:
        MethodError: a forced ``method`` that cannot serve the input, saying why.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "src").mkdir(), (d / "src" / "a.txt").write_text("hi")
        >>> shard(str(d / "src"), str(d / "out"), workers=1).samples
        1
    """
    opts = (options or ShardOptions()).with_overrides(overrides)
    t0 = time.perf_counter()
    tables = None
    hidden_files: dict[str, int] = {}  # a Parquet directory's hidden files
    if opts.manifest is None:
        from ._tables import parquet_files

        tables = parquet_files(src, hidden_files)  # a Parquet file or a directory of them
    nworkers = opts.workers if opts.workers is not None else (os.cpu_count() or 1)
    facts = Facts(requested=opts.method,
                  source="table" if tables is not None else "manifest" if opts.manifest else "tree",
                  # (a table is read through fsspec wherever it is: its staging needs OUT local)
                  local=is_local(out) and (tables is not None or is_local(src)),
                  resume=opts.resume, shuffle=opts.shuffle,
                  part=opts.part is not None, dask=opts.dask is not None, workers=nworkers)
    choice = choose_method(facts)
    if tables is None and (opts.columns is not None or opts.classes is not None):
        raise ValueError(f"{redact(printable(src))}: columns= and classes= apply to Parquet "
                         "sources (a .parquet file or a directory of them); a folder tree takes "
                         "its fields from file extensions and its classes from --labels-from-dirs")
    part_of = None if opts.part is None else parse_part(opts.part)
    if tables is not None:
        return _under_lock(out, part_of, lambda: _shard_table(src, tables, out, opts, choice,
                                                              part_of, nworkers, t0,
                                                              hidden_files))
    return _under_lock(out, part_of,
                       lambda: _locked(src, out, opts, facts, choice, part_of, nworkers, t0))


def _under_lock(out: str, part_of: tuple[int, int] | None,
                run: Callable[[], ShardSummary]) -> ShardSummary:
    """``run()`` with ``out`` locked for this writer (:mod:`~feedpipe.format._write_lock`).

    From the moment the run commits (:func:`_commit`) to its return, a Ctrl-C is only noted,
    then raised as an :class:`~feedpipe._helpers.pool_context.InterruptedAfterCommit` holding
    the summary: the dataset is complete, and must not be reported as interrupted."""
    what = (f"{printable(out)}: the conversion" if part_of is None
            else f"{printable(out)}: part {part_of[0]}/{part_of[1]} of the conversion")
    with CommitPoint(what) as point:
        token = COMMIT_POINT.set(point)
        try:
            point.result = _locked_run(out, part_of, run)
        finally:
            COMMIT_POINT.reset(token)
        return point.result


def _locked_run(out: str, part_of: tuple[int, int] | None,
                run: Callable[[], ShardSummary]) -> ShardSummary:
    existed = not is_local(out) or os.path.lexists(local_path(out))
    lock = take_lock(out, None if part_of is None else part_tag(*part_of), "feedpipe shard")
    try:
        return run()
    except Exception as e:
        if lock is not None and not existed and not isinstance(e, OutputError):
            lock.release()  # a run that failed on its input leaves no OUT made for its lock
            try:
                os.rmdir(local_path(out))
            except OSError:
                pass
        raise
    finally:
        if lock is not None:
            lock.release()


def shard_rows(src: str, table: Any, rows: Any, out: str, opts: ShardOptions) -> ShardSummary:
    """Convert a table already opened (:func:`feedpipe.shard_from`): ``table`` a
    :class:`~feedpipe.convert._tables.TableSource`, ``rows`` the source its fields are read
    back from (:mod:`~feedpipe.convert._table_rows`); ``src`` names it in messages."""
    t0 = time.perf_counter()
    nworkers = opts.workers if opts.workers is not None else 1
    choice = choose_method(Facts(requested=opts.method, source="table", local=is_local(out),
                                 resume=opts.resume, shuffle=opts.shuffle,
                                 part=opts.part is not None, dask=opts.dask is not None,
                                 workers=nworkers))
    part_of = None if opts.part is None else parse_part(opts.part)
    return _under_lock(out, part_of, lambda: _shard_rows(src, table, rows, out, opts, choice,
                                                         part_of, nworkers, t0))


def _locked(src: str, out: str, opts: ShardOptions, facts: Facts, choice: Choice,
            part_of: tuple[int, int] | None, nworkers: int, t0: float) -> ShardSummary:
    """:func:`shard` of a tree or file list, with ``out`` locked for this run."""
    if opts.dask is not None:
        from ._dask import check_dask

        check_dask()  # a missing extra fails before the listing, with its pip line
    staged = None
    if choice.executor == "staged":
        why: list[str] = []
        staged = _stage(local_path(src), local_path(out), opts, nworkers, why)
        if staged is None:  # the general method (or, forced, a MethodError saying why)
            choice = choose_method(dataclasses.replace(facts, gave_back="; ".join(why)))
    try:
        listing, part_info = ((staged.listing.to_listing(), None)  # type: ignore[union-attr]
                              if staged is not None
                              else _list(src, out, opts, part_of))
    except BaseException:
        if staged is not None:
            staged.close()
        raise
    # the listing's objects (one per file, alive to the end) out of full collections
    with frozen(), (closing(staged) if staged is not None else nullcontext()):
        return convert_listing(src, out, opts, choice, staged, listing, part_info, nworkers, t0)


def _list(src: str, out: str, opts: ShardOptions, part: tuple[int, int] | None
          ) -> tuple[Listing, PartInfo | None]:
    """The samples to convert (a part's share in its final order) and, for a part, what it is."""
    from ._listing import list_tree_parallel
    from ._parts import list_part

    if opts.manifest is not None:
        listing: Any = list_manifest(src, opts.manifest)
    else:
        listing = list_tree_parallel(src, labels_from_dirs=opts.labels_from_dirs,
                                     workers=opts.workers, show_progress=opts.show_progress,
                                     exclude=out)
    try:
        total = len(listing.samples) if isinstance(listing, Listing) else listing.samples
        check_not_empty(src, opts, listing, total)
        if part is None:
            return (listing if isinstance(listing, Listing) else listing.to_listing()), None
        return list_part(listing, *part, shuffle=opts.shuffle, seed=opts.seed,
                         options=opts.output_options())
    finally:
        if not isinstance(listing, Listing):
            listing.close()


def _stage(src: str, out: str, opts: ShardOptions, workers: int,
           why: list[str]) -> StagedTree | None:
    """Stage ``src`` into ``out`` (:func:`~feedpipe.convert._onepass.stage_tree`), or return
    ``None`` for the general method and append the reason to ``why``.

    The general method then fails, or not, exactly as it would have. It reports a bad source or
    output directory (unless one-pass was forced). An output inside the source is left to its
    walk. An output directory made here for nothing is removed again."""
    if not os.path.isdir(src):
        why.append("the source is not a local directory")
        return None
    real_src, real_out = os.path.realpath(src), os.path.realpath(out)
    if os.path.commonpath([real_src, real_out]) == real_src:
        why.append("the output directory is inside the source")
        return None
    existed = os.path.exists(out)
    try:
        prepare_out(out, False)
    except OutputError:
        if opts.method == "one-pass":
            raise
        why.append("the output directory cannot take it")
        return None
    clean_temps(out, opts.prefix)
    staged = stage_tree(src, out, opts.prefix, labels_from_dirs=opts.labels_from_dirs,
                        workers=workers, show_progress=opts.show_progress,
                        start_method=opts.start_method, why=why)
    if staged is None and not existed:  # (a failure, as on the general path, leaves it)
        try:
            os.rmdir(out)
        except OSError:
            pass
    return staged


def _shard_table(src: str, files: list[str], out: str, opts: ShardOptions, choice: Choice,
                 part_of: tuple[int, int] | None, nworkers: int, t0: float,
                 hidden_files: dict[str, int]) -> ShardSummary:
    """A Parquet source: its rows listed as samples (:mod:`~feedpipe.convert._table_rows`),
    then planned and written as a tree's files are; ``hidden_files``: the hidden files its
    directory holds (:func:`~feedpipe.convert._tables.parquet_files`), left out and listed."""
    from ._table_rows import TableRows
    from ._tables import column_map, parquet_source

    if opts.labels_from_dirs:
        raise ValueError(f"{redact(printable(src))} is a Parquet source: --labels-from-dirs cannot "
                         "apply (a table's class names come from a categorical or ClassLabel "
                         "column, or --classes)")
    table = parquet_source(src, files)
    table.hidden = hidden_skipped(hidden_files)
    cmap, images = column_map(table, opts.columns, opts.classes)
    rows = TableRows(table.paths, table.stems, src, cmap, images)
    return _shard_rows(src, table, rows, out, opts, choice, part_of, nworkers, t0)


def _shard_rows(src: str, table: Any, rows: Any, out: str, opts: ShardOptions, choice: Choice,
                part_of: tuple[int, int] | None, nworkers: int, t0: float) -> ShardSummary:
    """The rows of ``table`` listed as samples, then planned and written as a tree's files."""
    with frozen():  # (the listing: several objects per row, alive to the end)
        return _shard_listed_rows(src, table, rows, out, opts, choice, part_of, nworkers, t0)


def _shard_listed_rows(src: str, table: Any, rows: Any, out: str, opts: ShardOptions,
                       choice: Choice, part_of: tuple[int, int] | None, nworkers: int,
                       t0: float) -> ShardSummary:
    from ._parts import list_part
    from ._table_rows import list_table, stage_table

    cmap = rows.cmap
    staged = None
    if choice.executor == "staged":  # (a fresh run into a local OUT: see choose_method)
        prepare_out(out, False)
        clean_temps(local_path(out), opts.prefix)
        listing, staged = stage_table(table, rows, hidden(
            local_path(out), f"{opts.prefix}-stage{0:06d}", f".tmp-{os.getpid()}"),
            opts.show_progress)
    else:
        listing = list_table(table, rows, opts.show_progress)
    listing.hidden = list(table.hidden)
    with closing(staged) if staged is not None else nullcontext():
        if not listing.samples:
            drop_problems(listing, opts.on_error)
            raise InputError(f"{printable(src)}: the table has no rows to convert"
                             + (f" ({len(listing.problems)} skipped)" if listing.problems
                                else ""))
        part_info = None
        if part_of is not None:
            listing, part_info = list_part(listing, *part_of, shuffle=opts.shuffle,
                                           seed=opts.seed, options=opts.output_options())
        provenance = {"source": {**table.describe, "src": src}, "columns": cmap.to_dict()}
        s = convert_listing(src, out, opts, choice, staged, listing, part_info, nworkers, t0, rows,
                     provenance)
    nrows = table.num_rows or 0
    return dataclasses.replace(s, files=nrows, columns=cmap.lines(),
                               files_per_s=nrows / s.seconds if s.seconds > 0 else 0.0)


