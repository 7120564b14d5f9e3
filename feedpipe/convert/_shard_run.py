"""Writing a listed conversion (:func:`convert_listing`): its samples planned into shards, the
shards a resumed run committed reused, the rest written by the method's executor, then the
manifest (or a part's record) committed. :func:`feedpipe.shard` lists the source
(:mod:`~feedpipe.convert._shard`) and hands the listing here.
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .. import __version__
from .._helpers.pool_context import CommitPoint
from .._helpers.progress import progress
from .._helpers.storage import local_path
from .._redact import logger
from ..format._manifest import Manifest, ShardRecord
from ._executors import Executor, Job, PoolExecutor, SerialExecutor
from ._listing_checks import (
    drop_problems,
    listing_skipped,
    refuse_case_clashes,
    report_left_out,
    report_outputs,
    report_several_images,
    several_images_named,
)
from ._merge import state_name as part_state_name
from ._method import Choice
from ._onepass import StagedExecutor, StagedTree
from ._options import ShardOptions
from ._output_dir import (
    STATE_NAME,
    check_state,
    clean_temps,
    finished_dataset,
    prepare_out,
    unlink_quiet,
)
from ._parts import PartInfo, part_prefix
from ._shard_plan import PART_SAMPLES, plan_fingerprint, plan_shards, shuffled
from ._sources import Listing, SampleSpec, Source, printable
from ._summary import ShardSummary
from ._writer import hidden, load_record

log = logger("feedpipe.convert")
Records = dict[int, tuple[ShardRecord, list[tuple[str, str]], set[str]]]

# the commit point of the run under way in this context (see _under_lock)
COMMIT_POINT: ContextVar[CommitPoint | None] = ContextVar("feedpipe_shard_commit",
                                                           default=None)


def commit_point_reached() -> None:
    """The run is complete from here on (its manifest or part record is being written)."""
    point = COMMIT_POINT.get()
    if point is not None:
        point.reached()



def convert_listing(src: str, out: str, opts: ShardOptions, choice: Choice,
                    staged: StagedTree | None, listing: Listing, part_info: PartInfo | None,
                    nworkers: int, t0: float, rows: Any = None,
                    provenance: dict[str, Any] | None = None) -> ShardSummary:
    """Plan ``listing``'s samples, write the shards not yet committed with the executor of
    ``choice``, and commit the dataset (or the part). ``rows``: the source the samples' fields
    are read from, for a table (:class:`~feedpipe.convert._table_rows.TableRows`; default: the
    files of ``src``); ``provenance``: more for the manifest's ``created_by``."""
    samples, several = _checked(src, out, listing, opts, rows)
    names_of = _Names.of(opts.prefix, part_info)
    prepare_out(out, opts.resume, None if part_info is None else names_of.prefix)
    out = local_path(out)
    if opts.shuffle and part_info is None:  # a part's samples come in their final order
        samples = shuffled(samples, opts.seed)
    plan = _plan(samples, opts, staged)
    names = [f"{names_of.prefix}-{i:06d}.tar" for i in range(len(plan))]
    if staged is not None:  # (its workers copy meanwhile; nothing is committed before run)
        staged.start(plan, names, out)
    fp = plan_fingerprint(opts.output_options(), plan)
    total_files = _total_files(samples, listing, staged)
    done = finished_dataset(out, fp) if opts.resume and part_info is None else None
    if done is not None:
        return _already_complete(out, done, plan, names_of.prefix, total_files, t0)
    check_state(out, fp, opts.resume, names_of.state, opts.output_options())
    if staged is None:  # (the staging files are this run's)
        clean_temps(out, names_of.prefix, names_of.state)
    records = _reused(out, names) if opts.resume else {}
    reused = len(records)
    executor = _executor(choice, opts, nworkers, staged)
    _execute(executor, Source(src) if rows is None else rows, plan, names, out, opts, records,
             total_files, names_of)
    m = _manifest(src, opts, choice, listing, plan, records, fp)
    m.created_by.update(provenance or {})
    if several:
        m.created_by["several_images"] = several
    merged = _commit(out, opts, m, listing, part_info, names, names_of.state)
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


def _checked(src: str, out: str, listing: Listing, opts: ShardOptions, rows: Any
             ) -> tuple[list[SampleSpec], list[dict[str, Any]]]:
    """The samples to convert, after what the listing found is refused or said
    (:mod:`~feedpipe.convert._listing_checks`), and the samples of several images."""
    samples = drop_problems(listing, opts.on_error)
    refuse_case_clashes(src, samples)
    report_outputs(src, out, listing)
    report_left_out(listing)
    several = (several_images_named(samples) if opts.manifest is None and rows is None
               else [])  # (a file list pairs files on purpose)
    report_several_images(several)
    return samples, several


def _total_files(samples: list[SampleSpec], listing: Listing, staged: StagedTree | None) -> int:
    if staged is not None and staged.listing is not None and samples is listing.samples:
        return staged.listing.files  # (counted as staged: every sample is kept)
    return sum(len(s.files) for s in samples)


@dataclass(frozen=True)
class _Names:
    """The shards' name prefix and the state file's name: the dataset's, or a part's."""

    prefix: str
    state: str

    @staticmethod
    def of(prefix: str, part_info: PartInfo | None) -> _Names:
        if part_info is None:
            return _Names(prefix, STATE_NAME)
        part_of = (part_info.index, part_info.count)
        return _Names(part_prefix(prefix, *part_of), part_state_name(*part_of))


def _plan(samples: list[SampleSpec], opts: ShardOptions, staged: StagedTree | None) -> Any:
    """The shards of ``samples``, each cut into parts; a staged tree's sample sizes are as
    staged (where every sample was kept, in order)."""
    sizes = staged.sample_sizes() if staged is not None else None
    return plan_shards(samples, opts.max_bytes, opts.max_samples, PART_SAMPLES,
                       sizes if sizes is not None and len(sizes) == len(samples) else None)


def _reused(out: str, names: list[str]) -> Records:
    """The records of the shards an interrupted run committed, by shard index."""
    records: Records = {}
    for i, name in enumerate(names):
        got = load_record(out, name)
        if got is not None:
            records[i] = got
    return records


def _execute(executor: Executor, source: Any, plan: Any, names: list[str], out: str,
             opts: ShardOptions, records: Records, total_files: int, names_of: _Names) -> None:
    """Write the shards of ``plan`` not in ``records`` (adding theirs), under a progress bar;
    a failed or interrupted run's temp files are removed."""
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
    job = Job(source, plan, todo, names, part_paths, out, opts.on_error, bar, record)
    try:
        executor.run(job)
    except BaseException:
        clean_temps(out, names_of.prefix, names_of.state)
        raise
    finally:
        bar.close()


# the executor of a resume over a dataset already complete (the CLI's summary says so)
ALREADY_COMPLETE = "nothing to do: the dataset was already complete"


def _already_complete(out: str, m: Manifest, plan: Any, name_prefix: str, total_files: int,
                      t0: float) -> ShardSummary:
    """The summary of a ``resume`` over a dataset this very conversion finished (same inputs
    and options, every shard there at its recorded size): nothing is written. What a resume
    would have needed and an older run left behind is removed."""
    commit_point_reached()
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
    skipped = [{"path": p, "reason": r} for p, r in listing_skipped(listing, opts.on_error)]
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
    commit_point_reached()
    from ._merge import commit_manifest

    skipped = 0 if part_info is None else len(listing_skipped(listing, opts.on_error))
    return commit_manifest(out, m, part_info, names, state, merge=opts.merge, skipped=skipped)


