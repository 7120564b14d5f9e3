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
from contextvars import ContextVar
from typing import Any

from .. import __version__
from .._helpers.pool_context import CommitPoint
from .._helpers.progress import progress
from .._helpers.storage import is_local, local_path
from .._redact import logger, redact
from ..errors import InputError, KeyClashError, OutputError
from ..format._image_fields import IMAGE_FIELDS, image_extension, image_field_of
from ..format._manifest import Manifest, ShardRecord
from ._executors import Executor, Job, PoolExecutor, SerialExecutor
from ._file_list import list_manifest
from ._gc_freeze import frozen
from ._merge import state_name as part_state_name
from ._method import Choice, Facts, choose_method
from ._onepass import StagedExecutor, StagedTree, stage_tree
from ._options import DEFAULT_MAX_BYTES, ShardOptions  # noqa: F401  (re-exported)
from ._output_dir import (
    STATE_NAME,
    check_state,
    clean_temps,
    finished_dataset,
    prepare_out,
    take_lock,
    unlink_quiet,
    write_dataset_manifest,
)
from ._parts import PartInfo, parse_part, part_prefix, part_tag
from ._shard_plan import PART_SAMPLES, plan_fingerprint, plan_shards, shuffled
from ._sources import Listing, SampleSpec, Source, hidden_skipped, printable, several_images
from ._summary import ShardSummary
from ._writer import hidden, load_record, output_error

log = logger("feedpipe.convert")
Records = dict[int, tuple[ShardRecord, list[tuple[str, str]], set[str]]]


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
        token = _COMMIT_POINT.set(point)
        try:
            point.result = _locked_run(out, part_of, run)
        finally:
            _COMMIT_POINT.reset(token)
        return point.result


# the commit point of the run under way in this context (see _under_lock)
_COMMIT_POINT: ContextVar[CommitPoint | None] = ContextVar("feedpipe_shard_commit",
                                                           default=None)


def _commit_point_reached() -> None:
    """The run is complete from here on (its manifest or part record is being written)."""
    point = _COMMIT_POINT.get()
    if point is not None:
        point.reached()


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
        return _convert(src, out, opts, choice, staged, listing, part_info, nworkers, t0)


def _convert(src: str, out: str, opts: ShardOptions, choice: Choice, staged: StagedTree | None,
             listing: Listing, part_info: PartInfo | None, nworkers: int,
             t0: float, rows: Any = None, provenance: dict[str, Any] | None = None
             ) -> ShardSummary:
    """Plan ``listing``'s samples, write the shards not yet committed with the executor of
    ``choice``, and commit the dataset (or the part). ``rows``: the source the samples' fields
    are read from, for a table (:class:`~feedpipe.convert._table_rows.TableRows`; default: the
    files of ``src``); ``provenance``: more for the manifest's ``created_by``."""
    samples = _drop_problems(listing, opts.on_error)
    _refuse_case_clashes(src, samples)
    _report_outputs(src, out, listing)
    _report_left_out(listing)
    several = (several_images_named(samples) if opts.manifest is None and rows is None
               else [])  # (a file list pairs files on purpose)
    _report_several_images(several)
    part_of = None if part_info is None else (part_info.index, part_info.count)
    name_prefix = opts.prefix if part_of is None else part_prefix(opts.prefix, *part_of)
    state = STATE_NAME if part_of is None else part_state_name(*part_of)
    prepare_out(out, opts.resume, None if part_of is None else name_prefix)
    out = local_path(out)
    if opts.shuffle and part_of is None:  # a part's samples come in their final order
        samples = shuffled(samples, opts.seed)
    sizes = staged.sample_sizes() if staged is not None else None
    plan = plan_shards(samples, opts.max_bytes, opts.max_samples, PART_SAMPLES,
                       sizes if sizes is not None and len(sizes) == len(samples) else None)
    names = [f"{name_prefix}-{i:06d}.tar" for i in range(len(plan))]
    if staged is not None:  # (its workers copy meanwhile; nothing is committed before run)
        staged.start(plan, names, out)
    fp = plan_fingerprint(opts.output_options(), plan)
    total_files = (staged.listing.files  # (counted as staged: every sample is kept)
                   if staged is not None and staged.listing is not None
                   and samples is listing.samples else sum(len(s.files) for s in samples))
    done = finished_dataset(out, fp) if opts.resume and part_of is None else None
    if done is not None:
        return _already_complete(out, done, plan, name_prefix, total_files, t0)
    check_state(out, fp, opts.resume, state, opts.output_options())
    if staged is None:  # (the staging files are this run's)
        clean_temps(out, name_prefix, state)
    records: Records = {}
    if opts.resume:
        for i, name in enumerate(names):
            got = load_record(out, name)
            if got is not None:
                records[i] = got
    reused = len(records)
    todo = [i for i in range(len(plan)) if i not in records]
    bar = progress(total_files, "shard", "file", opts.show_progress)
    bar.update(sum(len(s.files) for i in records for p in plan[i] for s in p))

    def record(i: int, rec: ShardRecord, skipped: list[tuple[str, str]],
               fields: set[str]) -> None:
        records[i] = (rec, skipped, fields)
        if opts.on_shard is not None:
            opts.on_shard(rec)

    part_paths = {(i, j): hidden(out, names[i], f".part{j:05d}.tmp-{os.getpid()}")
                  for i in todo for j in range(len(plan[i]))}
    executor = _executor(choice, opts, nworkers, staged)
    job = Job(Source(src) if rows is None else rows, plan, todo, names, part_paths, out,
              opts.on_error, bar, record)
    try:
        executor.run(job)
    except BaseException:
        clean_temps(out, name_prefix, state)
        raise
    finally:
        bar.close()
    m = _manifest(src, opts, choice, listing, plan, records, fp)
    m.created_by.update(provenance or {})
    if several:
        m.created_by["several_images"] = several
    merged = _commit(out, opts, m, listing, part_info, names, state)
    secs = time.perf_counter() - t0
    nbytes = sum(r.bytes for r in m.shards)
    return ShardSummary(
        out=out, shards=len(m.shards), samples=m.total_samples, files=total_files,
        bytes=nbytes, skipped=len(m.skipped), reused_shards=reused, seconds=secs,
        files_per_s=total_files / secs if secs > 0 else 0.0,
        mb_per_s=nbytes / secs / 1e6 if secs > 0 else 0.0, skipped_inputs=list(m.skipped),
        part=None if part_info is None else part_info.label, merged=merged,
        method=choice.method, executor=executor.describe(), why=choice.why,
        several_images=several)


# the executor of a resume over a dataset already complete (the CLI's summary says so)
ALREADY_COMPLETE = "nothing to do: the dataset was already complete"


def _already_complete(out: str, m: Manifest, plan: Any, name_prefix: str, total_files: int,
                      t0: float) -> ShardSummary:
    """The summary of a ``resume`` over a dataset this very conversion finished (same inputs
    and options, every shard there at its recorded size): nothing is written. What a resume
    would have needed and an older run left behind is removed."""
    _commit_point_reached()
    clean_temps(out, name_prefix)
    for i in range(len(plan)):
        unlink_quiet(os.path.join(out, f".{name_prefix}-{i:06d}.tar.record.json"))
    unlink_quiet(os.path.join(out, STATE_NAME))
    log.warning("feedpipe shard: %s already holds this conversion, complete (its manifest.json "
                "and all %d shards): nothing to resume, nothing written", printable(out),
                len(m.shards))
    secs = time.perf_counter() - t0
    nbytes = sum(r.bytes for r in m.shards)
    method = m.created_by.get("method")
    return ShardSummary(
        out=out, shards=len(m.shards), samples=m.total_samples, files=total_files,
        bytes=nbytes, skipped=len(m.skipped), reused_shards=len(m.shards), seconds=secs,
        files_per_s=0.0, mb_per_s=0.0, skipped_inputs=list(m.skipped),
        method=method if isinstance(method, str) else "general",
        executor=ALREADY_COMPLETE,
        several_images=list(m.created_by.get("several_images", [])))


def _executor(choice: Choice, opts: ShardOptions, workers: int,
              staged: StagedTree | None) -> Executor:
    if choice.executor == "staged" and staged is not None:
        if choice.method == "table":  # (the listing read the rows: one process staged them)
            return StagedExecutor(staged, 1, "one pass: rows staged as they were listed, "
                                  "shards joined in this process")
        return StagedExecutor(staged, workers)
    if choice.executor == "dask":
        from ._dask import DaskExecutor

        return DaskExecutor(opts.dask, opts.retries)
    if choice.executor == "pool":
        return PoolExecutor(workers, opts.start_method)
    return SerialExecutor("one worker" if workers <= 1 else "")


def _manifest(src: str, opts: ShardOptions, choice: Choice, listing: Listing, plan: Any,
              records: Records, fp: str) -> Manifest:
    skipped = [{"path": p, "reason": r} for p, r in _listing_skipped(listing, opts.on_error)]
    fields: set[str] = set()
    for i in range(len(plan)):
        skipped += [{"path": p, "reason": r} for p, r in records[i][1]]
        fields |= records[i][2]
    options = opts.output_options()
    options["src"] = printable(src)
    m = Manifest(shards=[records[i][0] for i in range(len(plan))], fields=sorted(fields),
                 classes=listing.classes, skipped=skipped,
                 created_by={"tool": "feedpipe shard", "feedpipe_version": __version__,
                             "method": choice.method, "options": options,
                             "plan_fingerprint": fp, "ignored_hidden_files": listing.ignored})
    if listing.outputs:
        m.created_by["skipped_output_dirs"] = listing.outputs
    return m


def _commit(out: str, opts: ShardOptions, m: Manifest, listing: Listing,
            part_info: PartInfo | None, names: list[str], state: str) -> bool:
    """Write the manifest (a part: its part record, and with ``merge`` the manifest once every
    part is done) and remove what only a resume needed; whether this run merged the parts.
    This is the run's commit point: a Ctrl-C from here on is noted, not raised (see
    :func:`_under_lock`), so the files that only a resume needed are removed in full."""
    _commit_point_reached()
    if part_info is None:
        write_dataset_manifest(out, m)
        for name in names:
            unlink_quiet(os.path.join(out, f".{name}.record.json"))
        unlink_quiet(os.path.join(out, STATE_NAME))
        return False
    from ._merge import merge_if_complete, write_part_record

    m.created_by["part"] = part_info.label
    listing_skipped = len(_listing_skipped(listing, opts.on_error))
    try:
        write_part_record(out, part_info, m, listing_skipped)
    except OSError as e:
        raise output_error(e, out) from e
    unlink_quiet(os.path.join(out, state))  # shard records stay: --resume reuses them
    return opts.merge and merge_if_complete(out, part_info.count) is not None


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
        _check_not_empty(src, opts, listing, total)
        if part is None:
            return (listing if isinstance(listing, Listing) else listing.to_listing()), None
        return list_part(listing, *part, shuffle=opts.shuffle, seed=opts.seed,
                         options=opts.output_options())
    finally:
        if not isinstance(listing, Listing):
            listing.close()


def _check_not_empty(src: str, opts: ShardOptions, listing: Any, total: int) -> None:
    """Refuse a source with nothing to convert (a dataset of 0 samples is a mistake), saying
    what was found instead; a bad input under ``on_error="raise"`` is reported first."""
    if total:
        return
    _drop_problems(listing, opts.on_error)
    if opts.manifest is not None:
        raise InputError(f"{opts.manifest}: the manifest names no samples; add rows with a "
                         "'path' or '<ext>_path' column")
    found = []
    if listing.problems:
        found.append(f"{len(listing.problems)} bad input(s) skipped, e.g. "
                     f"{listing.problems[0][0]}: {listing.problems[0][1]}")
    if listing.ignored:
        found.append(f"{listing.ignored} hidden file(s) ignored")
    if listing.left_out:
        found.append(f"{len(listing.left_out)} file(s) of class folders left out as not "
                     f"images, e.g. {listing.left_out[0][0]}")
    if listing.outputs:
        found.append(f"feedpipe output skipped: {', '.join(listing.outputs)}")
    tail = f" ({'; '.join(found)})" if found else ""
    raise InputError(f"{printable(src)}: the source directory has no files to convert{tail}; "
                     "point SRC at the directory that holds the data")


def _report_outputs(src: str, out: str, listing: Any) -> None:
    """Say which directories the listing skipped as output (see
    :mod:`~feedpipe.convert._source_tree`)."""
    if is_local(src) and is_local(out):
        real_src, real_out = os.path.realpath(local_path(src)), os.path.realpath(local_path(out))
        if real_out != real_src and os.path.commonpath([real_src, real_out]) == real_src:
            log.warning("feedpipe shard: the output directory %s is inside the source %s: the "
                        "listing skips it (and any later conversion of the source does too)",
                        printable(out), printable(src))
    for rel in listing.outputs:
        log.warning("feedpipe shard: skipped %s/%s: it holds feedpipe output (shards, a "
                    "manifest or a conversion under way), not source data", printable(src), rel)


def several_images_named(samples: list[SampleSpec]) -> list[dict[str, Any]]:
    """Every sample of two or more images (files that share a stem), by key: its ``key``, its
    image files (``images``) and the one :class:`~feedpipe.ImagePipeline` takes by default
    (``taken``, the first of its ``image_field`` list): an ImageFolder counts each file as an
    image, and the others are never trained."""
    multi = [s for s in samples if len(s.files) > 1]
    if not multi:  # a sample of one file holds one image at most
        return []
    out: list[tuple[str, list[str], str]] = []
    for spec in several_images(multi, IMAGE_FIELDS):
        taken = image_field_of(dict.fromkeys((f.ext for f in spec.files), True), IMAGE_FIELDS)
        out.append((spec.key, sorted(printable(f.path) for f in spec.files
                                     if image_extension(f.ext) is not None),
                    next(printable(f.path) for f in spec.files if f.ext == taken)))
    out.sort()  # (by key: a part's samples come shuffled)
    return [{"key": key, "images": images, "taken": path} for key, images, path in out]


def _report_several_images(several: list[dict[str, Any]]) -> None:
    """Say, once a run, that files sharing a stem made samples of two or more images, naming
    some (the manifest and the summary name all)."""
    if not several:
        return
    n = len(several)
    shown = "; ".join(f"{' + '.join(e['images'])} (trains with {e['taken']})"
                      for e in several[:5]) + ("; ..." if n > 5 else "")
    log.warning("feedpipe shard: %d sample%s hold%s two or more images (files that share a stem "
                "are one sample), where an ImageFolder counts each file as an image, and "
                "ImagePipeline takes the first of its image_field list: %s. Every one is named "
                "in the manifest's created_by.several_images (and the summary's "
                "several_images); give each image its own stem if each is a sample",
                n, "s" * (n > 1), "" if n > 1 else "s", shown)


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
            _drop_problems(listing, opts.on_error)
            raise InputError(f"{printable(src)}: the table has no rows to convert"
                             + (f" ({len(listing.problems)} skipped)" if listing.problems
                                else ""))
        part_info = None
        if part_of is not None:
            listing, part_info = list_part(listing, *part_of, shuffle=opts.shuffle,
                                           seed=opts.seed, options=opts.output_options())
        provenance = {"source": {**table.describe, "src": src}, "columns": cmap.to_dict()}
        s = _convert(src, out, opts, choice, staged, listing, part_info, nworkers, t0, rows,
                     provenance)
    nrows = table.num_rows or 0
    return dataclasses.replace(s, files=nrows, columns=cmap.lines(),
                               files_per_s=nrows / s.seconds if s.seconds > 0 else 0.0)


def _refuse_case_clashes(src: str, samples: list[SampleSpec]) -> None:
    """Refuse a sample of two files whose extensions differ only in case (``x.jpg`` and
    ``x.JPG``): WebDataset readers take extensions in lower case and cannot read it."""
    for spec in samples:
        files, extras = spec.files, spec.extras
        # the common shapes checked cheaply: one file and the class field, or two files
        if len(files) < 2:
            if not files or not extras or (len(extras) == 1 and
                                           files[0].ext.lower() != extras[0][0].lower()):
                continue
        elif len(files) == 2 and not extras and files[0].ext.lower() != files[1].ext.lower():
            continue
        exts = [f.ext for f in files] + [e for e, _ in extras]
        if len({e.lower() for e in exts}) == len(exts):
            continue
        seen: dict[str, str] = {}
        for ext, path in [(f.ext, printable(f.path)) for f in files] + [
                (e, f"the {e!r} field of --labels-from-dirs") for e, _ in extras]:
            first = seen.setdefault(ext.lower(), path)
            if first != path:
                raise KeyClashError(
                    f"{printable(src)}: {first} and {path} make one sample "
                    f"whose fields differ only in case; WebDataset readers take extensions in "
                    "lower case and cannot read it: rename one of the files (or move it out)")


def _listing_skipped(listing: Listing, on_error: str) -> list[tuple[str, str]]:
    """The listing's inputs the manifest counts as skipped: the files ``--labels-from-dirs``
    left out (not images), the hidden files (a hidden directory once), and the bad inputs
    ``on_error="skip"`` left out."""
    return listing.left_out + listing.hidden + (listing.problems if on_error == "skip" else [])


def _report_left_out(listing: Listing) -> None:
    """Say which files of class folders were left out as not images (they are counted in the
    manifest's ``skipped`` and listed in the summary's ``skipped_inputs``)."""
    if listing.left_out:
        n = len(listing.left_out)
        shown = ", ".join(p for p, _ in listing.left_out[:5]) + (", ..." if n > 5 else "")
        log.warning("feedpipe shard: left out %d file%s of the class folders that %s not an "
                    "image (--labels-from-dirs takes image files, as torchvision's ImageFolder "
                    "does; the manifest's 'skipped' lists them): %s",
                    n, "s" * (n > 1), "are" if n > 1 else "is", shown)


def _drop_problems(listing: Listing, on_error: str) -> list[SampleSpec]:
    if listing.problems and on_error == "raise":
        path, reason = listing.problems[0]
        more = len(listing.problems) - 1
        tail = f" (and {more} more bad input(s))" if more else ""
        raise InputError(f"{path}: {reason}{tail}; use --on-error skip to leave bad inputs out")
    return listing.samples


