"""``feedpipe shard``: convert a small-file dataset into WebDataset shards.

The general path plans the work completely before any file is read: samples are listed and
sorted (and shuffled with ``seed`` if asked), then cut into shards by ``max_bytes``/``max_samples``
using the exact tar sizes, and each shard into parts of at most :data:`PART_SAMPLES` samples. Parts
are written by a process pool and joined into shards in order, so the bytes of every shard depend
on the inputs and options only, never on ``workers`` or timing. A run killed at any moment resumes
with ``resume=True``: committed shards are kept, everything else is redone.

A fresh, unshuffled run over a local tree whose files all sit in top-level directories takes the
one-pass path instead (:mod:`feedpipe.onepass`: each directory listed, read and staged by one
worker, the shards cut from the staged bytes): the same shards, indexes and manifest, byte for
byte, and the same plan fingerprint, so either path resumes the other's run.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from . import __version__
from .errors import InputError, OutputError
from .manifest import Manifest, ShardRecord
from .merge import state_name as part_state_name
from .onepass import StagedTree, stage_tree
from .output_dir import (
    STATE_NAME,
    check_state,
    clean_temps,
    prepare_out,
    unlink_quiet,
    write_dataset_manifest,
)
from .partition import PartInfo, parse_part, part_prefix
from .pool_context import die_with_parent, pool_context
from .progress import progress
from .shard_plan import PART_SAMPLES, plan_fingerprint, plan_shards, shuffled
from .shard_summary import ShardSummary
from .sources import Listing, SampleSpec, Source, list_manifest, printable
from .storage import is_local, local_path
from .tarformat import BLOCK
from .writer import (
    PartResult,
    finish_shard,
    hidden,
    load_record,
    output_error,
    write_part,
)

DEFAULT_MAX_BYTES = 256 << 20
ONE_PASS = True  # local trees of top-level directories: feedpipe.onepass (tests compare paths)
log = logging.getLogger(__name__)


@dataclass
class ShardOptions:
    """Options of :func:`shard` that decide the output bytes (recorded in the manifest)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_samples: int | None = None
    shuffle: bool = False
    seed: int = 0
    on_error: str = "raise"
    prefix: str = "data"
    labels_from_dirs: bool = False
    manifest: str | None = None


def _list(src: str, out: str, opts: ShardOptions, workers: int | None,
          show_progress: bool | None, part: tuple[int, int] | None
          ) -> tuple[Listing, PartInfo | None]:
    """The samples to convert (a part's share in its final order) and, for a part, what it is."""
    from .listing import list_tree_parallel
    from .partition import list_part

    if opts.manifest is not None:
        listing: Any = list_manifest(src, opts.manifest)
    else:
        listing = list_tree_parallel(src, labels_from_dirs=opts.labels_from_dirs,
                                     workers=workers, show_progress=show_progress, exclude=out)
    try:
        total = len(listing.samples) if isinstance(listing, Listing) else listing.samples
        _check_not_empty(src, opts, listing, total)
        if part is None:
            return (listing if isinstance(listing, Listing) else listing.to_listing()), None
        return list_part(listing, *part, shuffle=opts.shuffle, seed=opts.seed,
                         options=asdict(opts))
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
    if listing.outputs:
        found.append(f"feedpipe output skipped: {', '.join(listing.outputs)}")
    tail = f" ({'; '.join(found)})" if found else ""
    raise InputError(f"{printable(src)}: the source directory has no files to convert{tail}; "
                     "point SRC at the directory that holds the data")


def _report_outputs(src: str, out: str, listing: Any) -> None:
    """Say which directories the listing skipped as output (:mod:`feedpipe.source_tree`)."""
    if is_local(src) and is_local(out):
        real_src, real_out = os.path.realpath(local_path(src)), os.path.realpath(local_path(out))
        if real_out != real_src and os.path.commonpath([real_src, real_out]) == real_src:
            log.warning("feedpipe shard: the output directory %s is inside the source %s: the "
                        "listing skips it (and any later conversion of the source does too)",
                        printable(out), printable(src))
    for rel in listing.outputs:
        log.warning("feedpipe shard: skipped %s/%s: it holds feedpipe output (shards, a "
                    "manifest or a conversion under way), not source data", printable(src), rel)


def _stage(src: str, out: str, prefix: str, labels_from_dirs: bool, workers: int,
           show_progress: bool | None) -> StagedTree | None:
    """:func:`feedpipe.onepass.stage_tree` into ``out``, or ``None`` for the general path,
    which then fails (or not) exactly as it would have: a bad source or output directory is
    its to report, an output inside the source would be listed by the walk, and an output
    directory made here for nothing is removed again."""
    if not os.path.isdir(src):
        return None
    real_src, real_out = os.path.realpath(src), os.path.realpath(out)
    if os.path.commonpath([real_src, real_out]) == real_src:
        return None
    existed = os.path.exists(out)
    try:
        prepare_out(out, False)
    except OutputError:
        return None
    clean_temps(out, prefix)
    staged = stage_tree(src, out, prefix, labels_from_dirs=labels_from_dirs, workers=workers,
                        show_progress=show_progress)
    if staged is None and not existed:  # (a failure, as on the general path, leaves it)
        try:
            os.rmdir(out)
        except OSError:
            pass
    return staged


def _shard_table(src: str, files: list[str], out: str, opts: ShardOptions, *,
                 columns: Any, classes: Any, workers: int | None, resume: bool, part: Any,
                 dask: Any, show_progress: bool | None) -> ShardSummary:
    """A Parquet source, through the table writer (:mod:`feedpipe.table_source`)."""
    from .table_source import shard_parquet

    unsupported = [name for name, on in (
        ("--resume", resume), ("--shuffle", opts.shuffle), ("--part", part is not None),
        ("--dask", dask is not None), ("--labels-from-dirs", opts.labels_from_dirs)) if on]
    if unsupported:
        raise ValueError(f"{printable(src)} is a Parquet source, which is written in one pass "
                         f"in row order: {', '.join(unsupported)} cannot apply; convert it "
                         "without, into an empty directory")
    if workers is not None and workers > 1:
        log.warning("feedpipe shard: %s is a Parquet source, written in one process: "
                    "--workers %d is not used", printable(src), workers)
    return shard_parquet(src, files, out, columns=columns, classes=classes,
                         max_bytes=opts.max_bytes, max_samples=opts.max_samples,
                         prefix=opts.prefix, on_error=opts.on_error,
                         show_progress=show_progress)


def _drop_problems(listing: Listing, on_error: str) -> list[SampleSpec]:
    if listing.problems and on_error == "raise":
        path, reason = listing.problems[0]
        more = len(listing.problems) - 1
        tail = f" (and {more} more bad input(s))" if more else ""
        raise InputError(f"{path}: {reason}{tail}; use --on-error skip to leave bad inputs out")
    return listing.samples


def shard(
    src: str,
    out: str,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_samples: int | None = None,
    workers: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    on_error: str = "raise",
    resume: bool = False,
    prefix: str = "data",
    labels_from_dirs: bool = False,
    manifest: str | None = None,
    show_progress: bool | None = None,
    on_shard: Callable[[ShardRecord], None] | None = None,
    part: str | tuple[int, int] | None = None,
    merge: bool = False,
    dask: Any = None,
    retries: int = 2,
    columns: str | dict[str, str | None] | None = None,
    classes: str | list[str] | None = None,
) -> ShardSummary:
    """Convert the small-file dataset at ``src`` into shards in ``out``.

    Args:
        src: a local directory or fsspec URL.
        out: a local directory, missing or empty (or holding an interrupted run with ``resume``).
        max_bytes: target shard size; a shard exceeds it only to hold one sample larger than it.
        max_samples: at most this many samples per shard.
        workers: processes writing in parallel (default: all cores); never changes the output.
        shuffle, seed: mix the sample order at write time, deterministically.
        on_error: ``"raise"`` stops at the first bad input; ``"skip"`` leaves it out and lists it
            in the manifest.
        resume: keep the committed shards of an interrupted run and do the rest.
        prefix: shard names are ``PREFIX-000000.tar``.
        labels_from_dirs: image-folder layout: a ``cls`` field from the top-level directory.
        manifest: a JSONL/CSV file naming the files of each sample (see ``feedpipe shard -h``).
        show_progress: a progress bar (default: when stderr is a terminal).
        on_shard: called with each shard's record as it is committed.
        part: ``"I/N"`` or ``(I, N)``: convert only part I (0-based) of a deterministic partition
            into N (see :mod:`feedpipe.partition`); N such runs, anywhere, may write into one
            ``out`` at once; :func:`feedpipe.merge.merge` then writes the manifest.
        merge: with ``part``: the part that finds all N parts finished writes the manifest.
        dask: a ``dask.distributed`` scheduler address or ``Client``: write the shards as tasks on
            that cluster (see :mod:`feedpipe.dask_convert`; ``src`` and ``out`` must be visible
            at the same paths on every worker). The output is the same bytes.
        retries: with ``dask``: times a failed task is retried before the run fails.
        columns: for a Parquet source: overrides of the column-to-field mapping
            (``"img=jpg,label=cls"``, see :mod:`feedpipe.table_columns`).
        classes: for a Parquet source: class names (a list, ``"a,b,c"`` or a file with one
            per line); default: a categorical label column's categories.

    Returns:
        A :class:`ShardSummary`.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "src").mkdir(), (d / "src" / "a.txt").write_text("hi")
        >>> shard(str(d / "src"), str(d / "out"), workers=1).samples
        1
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if max_bytes <= 2 * BLOCK:
        raise ValueError(f"max_bytes must be more than {2 * BLOCK} bytes, not {max_bytes}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1, not {max_samples}")
    if "/" in prefix or not prefix:
        raise ValueError(f"prefix must be a non-empty file name without '/', not {prefix!r}")
    opts = ShardOptions(max_bytes, max_samples, shuffle, seed, on_error, prefix,
                        labels_from_dirs, manifest)
    if manifest is None:
        from .table_source import parquet_files

        tables = parquet_files(src)
        if tables is not None:  # a Parquet file or a directory of them
            return _shard_table(src, tables, out, opts, columns=columns, classes=classes,
                                workers=workers, resume=resume, part=part, dask=dask,
                                show_progress=show_progress)
    if columns is not None or classes is not None:
        raise ValueError(f"{printable(src)}: columns= and classes= apply to Parquet sources "
                         "(a .parquet file or a directory of them); a folder tree takes its "
                         "fields from file extensions and its classes from --labels-from-dirs")
    part_of = None if part is None else parse_part(part)
    if dask is not None:
        from .dask_convert import check_dask

        check_dask()  # a missing extra fails before the listing, with its pip line
    t0 = time.perf_counter()
    nworkers = workers if workers is not None else (os.cpu_count() or 1)
    staged = None
    if (ONE_PASS and dask is None and part_of is None and manifest is None and not resume
            and not shuffle and is_local(src) and is_local(out)):
        # a local tree of top-level directories: listed, read and staged in one pass
        # (feedpipe.onepass); None when anything in it needs the general path
        staged = _stage(local_path(src), local_path(out), prefix, labels_from_dirs, nworkers,
                        show_progress)
    try:
        listing, part_info = ((staged.listing.to_listing(), None) if staged is not None
                              else _list(src, out, opts, workers, show_progress, part_of))
    except BaseException:
        if staged is not None:
            staged.close()
        raise
    # the listing's objects (one per file, alive to the end) out of full collections
    with _gc_frozen(), (closing(staged) if staged is not None else nullcontext()):
        samples = _drop_problems(listing, on_error)
        _report_outputs(src, out, listing)
        name_prefix = prefix if part_of is None else part_prefix(prefix, *part_of)
        state = STATE_NAME if part_of is None else part_state_name(*part_of)
        prepare_out(out, resume, None if part_of is None else name_prefix)
        out = local_path(out)
        if shuffle and part_of is None:  # a part's samples come in their final order
            samples = shuffled(samples, seed)
        plan = plan_shards(samples, max_bytes, max_samples, PART_SAMPLES)
        fp = plan_fingerprint(asdict(opts), plan)
        check_state(out, fp, resume, state)
        if staged is None:  # (the staging files are this run's)
            clean_temps(out, name_prefix, state)
        names = [f"{name_prefix}-{i:06d}.tar" for i in range(len(plan))]

        records: dict[int, tuple[ShardRecord, list[tuple[str, str]], set[str]]] = {}
        if resume:
            for i, name in enumerate(names):
                got = load_record(out, name)
                if got is not None:
                    records[i] = got
        reused = len(records)
        todo = [i for i in range(len(plan)) if i not in records]
        total_files = sum(len(s.files) for s in samples)
        done_files = sum(len(s.files) for i in records for p in plan[i] for s in p)
        bar = progress(total_files, "shard", "file", show_progress)
        bar.update(done_files)
        source = Source(src)
        written_bytes = 0

        def record(i: int, rec: ShardRecord, skipped: list[tuple[str, str]],
                   fields: set[str]) -> None:
            records[i] = (rec, skipped, fields)
            if on_shard is not None:
                on_shard(rec)

        def commit(i: int, parts: list[tuple[str, PartResult]]) -> None:
            rec, idx, skipped = finish_shard(out, names[i], parts)
            record(i, rec, skipped, idx.fields())

        part_paths = {
            (i, j): hidden(out, names[i], f".part{j:05d}.tmp-{os.getpid()}")
            for i in todo for j in range(len(plan[i]))
        }
        try:
            if staged is not None:
                def staged_record(i: int, rec: ShardRecord, fields: set[str]) -> None:
                    record(i, rec, [], fields)
                    bar.update(sum(len(s.files) for part in plan[i] for s in part))

                staged.join(plan, names, out, staged_record)
            elif dask is not None:
                from .dask_convert import run_on_dask

                written_bytes = run_on_dask(dask, source, plan, todo, names, part_paths, out,
                                            on_error, bar, record, retries=retries)
            elif nworkers <= 1 or len(part_paths) <= 1:
                for i in todo:
                    results = []
                    for j, specs in enumerate(plan[i]):
                        res = write_part(source, specs, part_paths[i, j], on_error)
                        results.append((part_paths[i, j], res))
                        bar.update(res.files)
                        written_bytes += res.bytes
                    commit(i, results)
            else:
                written_bytes = _run_pool(
                    nworkers, source, plan, todo, part_paths, on_error, bar, commit
                )
        except BaseException:
            clean_temps(out, name_prefix, state)
            raise
        finally:
            bar.close()

        all_skipped = ([{"path": p, "reason": r} for p, r in listing.problems]
                       if on_error == "skip" else [])
        fields: set[str] = set()
        for i in range(len(plan)):
            all_skipped += [{"path": p, "reason": r} for p, r in records[i][1]]
            fields |= records[i][2]
        opts_doc = asdict(opts)
        opts_doc["src"] = printable(src)
        m = Manifest(
            shards=[records[i][0] for i in range(len(plan))],
            fields=sorted(fields),
            classes=listing.classes,
            skipped=all_skipped,
            created_by={
                "tool": "feedpipe shard",
                "feedpipe_version": __version__,
                "options": opts_doc,
                "plan_fingerprint": fp,
                "ignored_hidden_files": listing.ignored,
            },
        )
        if listing.outputs:
            m.created_by["skipped_output_dirs"] = listing.outputs
        merged = False
        if part_info is not None:
            from .merge import merge_if_complete, write_part_record

            m.created_by["part"] = part_info.label
            listing_skipped = len(listing.problems) if on_error == "skip" else 0
            try:
                write_part_record(out, part_info, m, listing_skipped)
            except OSError as e:
                raise output_error(e, out) from e
            unlink_quiet(os.path.join(out, state))  # shard records stay: --resume reuses them
            merged = merge and merge_if_complete(out, part_info.count) is not None
        else:
            write_dataset_manifest(out, m)
            for name in names:
                unlink_quiet(os.path.join(out, f".{name}.record.json"))
            unlink_quiet(os.path.join(out, STATE_NAME))
        secs = time.perf_counter() - t0
        nbytes = sum(r.bytes for r in m.shards)
        files = total_files
        return ShardSummary(
            out=out,
            shards=len(m.shards),
            samples=m.total_samples,
            files=files,
            bytes=nbytes,
            skipped=len(all_skipped),
            reused_shards=reused,
            seconds=secs,
            files_per_s=files / secs if secs > 0 else 0.0,
            mb_per_s=nbytes / secs / 1e6 if secs > 0 else 0.0,
            skipped_inputs=all_skipped,
            part=None if part_info is None else part_info.label,
            merged=merged,
        )


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """Keep the objects alive now out of the cyclic garbage collector's full collections until
    the block ends (``gc.freeze()``): a conversion's listing is three objects per input file,
    none garbage, and every full collection that the parent's later allocations trigger would
    walk them again (measured on 200,000 files: 1.15 s of collections while the listing was
    built, and as much again while the shards were written). Left alone when the caller has
    frozen objects itself (this would unfreeze them) or has turned the collector off. The
    collector is process-wide: objects another thread freezes during a conversion are unfrozen
    with the listing at its end (they stay alive either way; only collection is deferred)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# Plans handed to forked pool workers by inheritance, by token: a worker forked while its plan is
# here reads its parts from its copy of the parent's memory instead of unpickling them (11.6 us a
# sample, more than writing it: 16.4 us for a 1 KiB file).
_FORK_PLANS: dict[int, list[list[list[SampleSpec]]]] = {}
_fork_tokens = itertools.count()


def _write_inherited(token: int, i: int, j: int, source: Source, path: str,
                     on_error: str) -> PartResult:
    plan = _FORK_PLANS.get(token)
    if plan is None:  # not forked from the run that planned it: cannot happen; fail loudly
        raise RuntimeError(f"conversion worker {os.getpid()} has no plan {token}: it was not "
                           "forked from the process that planned the run")
    return write_part(source, plan[i][j], path, on_error)


_pool_context = pool_context  # (a test forces spawn through it)


def _run_pool(
    nworkers: int,
    source: Source,
    plan: list[list[list[SampleSpec]]],
    todo: list[int],
    part_paths: dict[tuple[int, int], str],
    on_error: str,
    bar: Any,
    commit: Callable[[int, list[tuple[str, PartResult]]], None],
) -> int:
    ctx = _pool_context()
    token = next(_fork_tokens) if ctx.get_start_method() == "fork" else None
    if token is not None:  # before the pool exists: its workers are forked with the plan
        _FORK_PLANS[token] = plan
    try:
        with ProcessPoolExecutor(max_workers=nworkers, mp_context=ctx,
                                 initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
            return _drive_pool(pool, token, source, plan, todo, part_paths, on_error, bar,
                               commit)
    finally:
        if token is not None:
            _FORK_PLANS.pop(token, None)


def _drive_pool(pool: ProcessPoolExecutor, token: int | None, source: Source,
                plan: list[list[list[SampleSpec]]], todo: list[int],
                part_paths: dict[tuple[int, int], str], on_error: str, bar: Any,
                commit: Callable[[int, list[tuple[str, PartResult]]], None]) -> int:
    """Submit every part (by reference to the inherited plan ``token``, or pickled), commit each
    shard once all its parts are written; the bytes written."""
    written = 0
    futures: dict[Future[PartResult], tuple[int, int]] = {}
    results: dict[int, dict[int, PartResult]] = {i: {} for i in todo}
    for i in todo:
        for j, part in enumerate(plan[i]):
            if token is not None:
                fut = pool.submit(_write_inherited, token, i, j, source, part_paths[i, j],
                                  on_error)
            else:
                fut = pool.submit(write_part, source, part, part_paths[i, j], on_error)
            futures[fut] = (i, j)
    pending = set(futures)
    try:
        while pending:
            # each part as it comes: a shard is joined while the workers write the next ones
            # (FIRST_EXCEPTION waited for every part, and then joined all shards serially)
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i, j = futures[fut]
                res = fut.result()
                results[i][j] = res
                bar.update(res.files)
                written += res.bytes
                if len(results[i]) == len(plan[i]):
                    commit(i, [(part_paths[i, k], results[i][k]) for k in range(len(plan[i]))])
    except BaseException:
        for fut in pending:
            fut.cancel()
        raise
    return written
