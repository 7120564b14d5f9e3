"""``feedpipe shard --tokenizer``: text corpora into token shards that
:class:`~feedpipe.Packed` reads directly.

The conversion is planned before any text is read: the inputs are listed in sorted order and cut
into units (:mod:`~feedpipe.convert._text_inputs`), and unit ``i`` becomes shard ``i``. The
shards are written by the same executors as every other conversion (this process, a process
pool, a Dask cluster: :mod:`~feedpipe.convert._executors`), committed one by one (index, then the
``.tar`` by rename), so a run killed at any moment resumes with ``resume=True`` to the same bytes
as a run never stopped; ``part="I/N"`` converts a deterministic share of the units, and
:func:`feedpipe.merge` joins the parts.

Beside each shard ``PREFIX-000000.tar`` lies ``PREFIX-000000.lengths.npy``: the token count of
each of its documents (int64, in sample order, the end-of-document id included), so a reader
plans rows without reading a document. The manifest's ``created_by.tokens`` records the
tokenizer, the dtype, the end-of-document id and the field; every bad record left out under
``on_error="skip"`` is in its ``skipped`` list, named and with its reason.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import numpy as np

from .. import __version__
from .._helpers.progress import progress
from .._helpers.storage import is_local, local_path
from .._redact import logger
from ..errors import InputError
from ..format._index import index_path, parse_index
from ..format._manifest import Manifest, ShardRecord
from ..transforms._tokenizer import TokenizerRef
from ._executors import Executor, Job, PoolExecutor, SerialExecutor
from ._merge import commit_manifest
from ._merge import state_name as part_state_name
from ._output_dir import (
    STATE_NAME,
    check_state,
    clean_temps,
    finished_dataset,
    prepare_out,
    take_lock,
    unlink_quiet,
)
from ._parts import PartInfo, parse_part, part_prefix, part_range, part_tag
from ._shard_plan import plan_fingerprint
from ._sources import printable
from ._summary import ShardSummary
from ._text_inputs import DEFAULT_CHUNK_BYTES, list_inputs, list_units
from ._token_dataset import dataset_plan, is_hf_dataset
from ._token_writer import FIELD, NPY_HEADER, TokenSource, lengths_name, save_lengths
from ._writer import hidden, load_record

log = logger("feedpipe.convert")
METHOD = "tokenize"
Records = dict[int, tuple[ShardRecord, list[tuple[str, str]], set[str]]]


def shard_tokens(src: Any, out: str, *, tokenizer: Any, vocab_size: int | None = None,
                 text_field: str = "text", eos_id: int | None = None, split: str | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, prefix: str = "data",
                 on_error: str = "raise", workers: int | None = None, resume: bool = False,
                 part: str | tuple[int, int] | None = None, merge: bool = False,
                 dask: Any = None, retries: int = 2, start_method: str | None = None,
                 show_progress: bool | None = None) -> ShardSummary:
    """Tokenise the text corpus at ``src`` into token shards in ``out``.

    Args:
        src: a JSON Lines file (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), a Parquet or Arrow
            file, or a local directory of them or of text files (``.txt``, ``.md``, code: each
            file one document); or a Hugging Face ``datasets.Dataset``, ``IterableDataset`` or
            ``DatasetDict`` (with ``split``), its records named by index (``dataset[17]``).
        out: the output directory (missing or empty, or an interrupted run with ``resume``).
        tokenizer: a ``tokenizers`` JSON path, a ``tokenizers.Tokenizer``, or a callable
            taking a list of texts and returning each one's ids (the hook for any tokenizer:
            a function defined at module level, or an object whose class is, so that worker
            processes can be sent it; give ``vocab_size`` or a ``vocab_size`` attribute).
        vocab_size: the vocabulary size (a callable's; default: the tokenizer's). The shards'
            dtype is the smallest unsigned integer holding it.
        text_field: the JSON field or table column holding each document's text.
        eos_id: an id appended to every document (``None``: none).
        split: the split of a ``DatasetDict`` to convert.
        chunk_bytes: about how many input bytes one shard holds (one unit of work; for an
            ``IterableDataset``, a unit is one of its ``n_shards``).
        prefix: shard names are ``PREFIX-000000.tar``.
        on_error: a bad record (invalid UTF-8, empty text, a missing field or column, not a
            string, not JSON) raises (``"raise"``) or is left out and listed in the
            manifest (``"skip"``).
        workers: processes tokenising at once (default: all cores; never changes the output).
        resume: keep the committed shards of an interrupted run and do the rest.
        part: ``"I/N"``: convert part I of a deterministic partition of the units into N.
        merge: with ``part``: the last part to finish writes the manifest.
        dask: a ``dask.distributed`` scheduler address or ``Client`` to write on.
        retries: with ``dask``: retries of a failed task.
        start_method: how pool workers start (default: fork where there is one).
        show_progress: a progress bar in tokens/s (default: when stderr is a terminal).

    Returns:
        A :class:`feedpipe.ShardSummary` whose ``samples`` are documents and whose ``tokens``,
        ``tokens_per_s`` and ``bad_records`` say what was written.

    Example:
        >>> import tempfile, pathlib, json
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "c.jsonl").write_text(json.dumps({"text": "hello"}) + "\\n")
        >>> s = shard_tokens(str(d / "c.jsonl"), str(d / "out"),
        ...                  tokenizer=lambda texts: [[ord(c) for c in t] for t in texts],
        ...                  vocab_size=256, eos_id=0, workers=1)
        >>> s.samples, s.tokens
        (1, 6)
    """
    t0 = time.perf_counter()
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, not {chunk_bytes}")
    if "/" in prefix or not prefix:
        raise ValueError(f"prefix must be a non-empty file name without '/', not {prefix!r}")
    if not is_local(out):
        raise ValueError(f"{printable(out)}: token shards are written to a local directory")
    ref = TokenizerRef(tokenizer, vocab_size)
    options = {"tokenizer": ref.describe(), "text_field": text_field, "eos_id": eos_id,
               "dtype": str(ref.dtype), "chunk_bytes": chunk_bytes, "prefix": prefix,
               "on_error": on_error}
    source: TokenSource
    if is_hf_dataset(src):
        src, units, source, options["dataset"] = dataset_plan(src, split, ref, text_field,
                                                              eos_id, chunk_bytes)
    else:
        if split is not None:
            raise ValueError(f"split={split!r} chooses a split of a Hugging Face DatasetDict; "
                             f"{printable(str(src))} is a path: leave split out")
        root, files = list_inputs(src)
        real_out = os.path.realpath(local_path(out))
        files = [f for f in files  # an output directory inside the source is not an input
                 if os.path.commonpath([os.path.realpath(os.path.join(root, f)), real_out])
                 != real_out]
        units = list_units(root, files, chunk_bytes)
        source = TokenSource(root, ref, text_field, eos_id)
    part_of = None if part is None else parse_part(part)
    nworkers = workers if workers is not None else (os.cpu_count() or 1)
    lock = take_lock(out, None if part_of is None else part_tag(*part_of), "feedpipe shard")
    try:
        return _run(src, local_path(out), source, units, options, part_of, merge, nworkers,
                    resume, dask, retries, start_method, show_progress, t0)
    finally:
        if lock is not None:
            lock.release()


def _run(src: str, out: str, source: TokenSource, units: list[Any], options: dict[str, Any],
         part_of: tuple[int, int] | None, merge: bool, nworkers: int, resume: bool, dask: Any,
         retries: int, start_method: str | None, show_progress: bool | None,
         t0: float) -> ShardSummary:
    on_error = options["on_error"]
    mine, name_prefix, state, info = _part(units, options, part_of)
    prepare_out(out, resume, None if part_of is None else name_prefix)
    plan = [[[u]] for u in mine]  # a shard per unit, written as one part
    names = [f"{name_prefix}-{i:06d}.tar" for i in range(len(plan))]
    fp = plan_fingerprint(options, plan)
    if resume and part_of is None:
        done = finished_dataset(out, fp)
        if done is not None:
            return _summary(out, done, [r.name for r in done.shards], 0, 0,
                            "nothing to do: the dataset was already complete", t0, None)
    check_state(out, fp, resume, state, options)
    clean_temps(out, name_prefix, state)
    records: Records = _committed(out, names) if resume else {}
    reused = len(records)
    todo = [i for i in range(len(plan)) if i not in records]
    bar = progress(None, "tokenize", "tok", show_progress)

    def record(i: int, rec: ShardRecord, skipped: list[tuple[str, str]],
               fields: set[str]) -> None:
        records[i] = (rec, skipped, fields)

    part_paths = {(i, 0): hidden(out, names[i], f".part00000.tmp-{os.getpid()}") for i in todo}
    executor = _executor(nworkers, len(todo), dask, retries, start_method)
    job = Job(source, plan, todo, names, part_paths, out, on_error, bar, record)
    try:
        executor.run(job)
    except BaseException:
        clean_temps(out, name_prefix, state)
        raise
    finally:
        bar.close()
    kept = _drop_empty(out, names, records)
    written = _write_lengths(out, names, [i for i in todo if i in kept], kept, records,
                             source.dtype.itemsize)
    m = _manifest(src, options, fp, [records[i] for i in range(len(plan))], kept, records)
    if m.total_samples == 0 and part_of is None:
        raise InputError(f"{printable(src)}: no document to write ({len(m.skipped)} bad "
                         "record(s) left out); point SRC at the text and --text-field at its "
                         "field")
    merged = commit_manifest(out, m, info, names, state, merge=merge, skipped=0)
    return _summary(out, m, [names[i] for i in kept], reused, written, executor.describe(),
                    t0, info, merged=merged)


def _part(units: list[Any], options: dict[str, Any], part_of: tuple[int, int] | None
          ) -> tuple[list[Any], str, str, PartInfo | None]:
    """The units this run converts, the prefix of its shards' names, its state file's name and
    what the manifest records of the part (``part_of``: ``(part, parts)``, or ``None``)."""
    prefix = options["prefix"]
    if part_of is None:
        return units, prefix, STATE_NAME, None
    lo, hi = part_range(len(units), *part_of)
    info = PartInfo(part_of[0], part_of[1], len(units),
                    plan_fingerprint(options, [[[u]] for u in units]))
    return units[lo:hi], part_prefix(prefix, *part_of), part_state_name(*part_of), info


def _committed(out: str, names: list[str]) -> Records:
    """The records of the shards of ``names`` an interrupted run committed (by number)."""
    records: Records = {}
    for i, name in enumerate(names):
        got = load_record(out, name)
        if got is not None:
            records[i] = got
    return records


def _manifest(src: str, options: dict[str, Any], fp: str, every: list[Any], kept: list[int],
              records: Records) -> Manifest:
    """The manifest of the shards ``kept``: their records, every unit's (``every``) records
    left out, and how they were made (the options, the plan's fingerprint, the token field)."""
    skipped = [{"path": p, "reason": r} for rec in every for p, r in rec[1]]
    return Manifest(shards=[records[i][0] for i in kept], fields=[FIELD], skipped=skipped,
                    created_by={"tool": "feedpipe shard", "feedpipe_version": __version__,
                                "method": METHOD, "options": {**options, "src": printable(src)},
                                "plan_fingerprint": fp,
                                "tokens": {"field": FIELD, "dtype": options["dtype"],
                                           "eos_id": options["eos_id"],
                                           "tokenizer": options["tokenizer"],
                                           "lengths": "<shard stem>.lengths.npy"}})


def _executor(workers: int, shards: int, dask: Any, retries: int,
              start_method: str | None) -> Executor:
    """Dask where a cluster is given, a process pool for several workers and shards, else this
    process (the summary's ``executor`` says which)."""
    if dask is not None:
        from ._dask import DaskExecutor, check_dask

        check_dask()
        return DaskExecutor(dask, retries)
    if workers > 1 and shards > 1:
        return PoolExecutor(workers, start_method)
    return SerialExecutor("one worker" if workers <= 1 else "one shard to write")


def _drop_empty(out: str, names: list[str], records: Records) -> list[int]:
    """The shards holding documents; a unit that held none (a byte range inside one long line,
    a unit of bad records only) leaves no shard: a dataset's shards each hold a sample. Its
    record goes too, so a resume redoes it (to nothing again)."""
    kept = []
    for i, name in enumerate(names):
        if records[i][0].samples:
            kept.append(i)
            continue
        stem = name[:-4]
        for n in (f"{stem}.idx", name, f".{name}.record.json"):
            unlink_quiet(os.path.join(out, n))
    return kept


def _write_lengths(out: str, names: list[str], todo: list[int], kept: list[int],
                   records: Records, itemsize: int) -> int:
    """Each shard's document lengths, from its index (the members' sizes less the ``.npy``
    header), into its lengths file; the tokens of the shards this run wrote."""
    written = 0
    todo_set = set(todo)
    for i in kept:
        name = names[i]
        path = os.path.join(out, lengths_name(name))
        if i not in todo_set and os.path.exists(path):
            continue  # (a shard kept by a resume: its lengths were written with it)
        with open(index_path(os.path.join(out, name)), encoding="utf-8") as f:
            idx = parse_index(f.read(), name)
        lengths = (np.asarray(idx.sizes, dtype=np.int64) - NPY_HEADER) // itemsize
        if i in todo_set:
            written += int(lengths.sum())
        save_lengths(out, name, lengths)
    return written


def bad_record_counts(skipped: list[dict[str, str]]) -> dict[str, int]:
    """Bad records by kind, from the manifest's ``skipped`` reasons.

    Example:
        >>> bad_record_counts([{"path": "a:3", "reason": "bad record (empty text): empty text"}])
        {'empty text': 1}
    """
    c: collections.Counter[str] = collections.Counter()
    for s in skipped:
        r = s.get("reason", "")
        if r.startswith("bad record ("):
            c[r[len("bad record ("):r.index(")")]] += 1
    return dict(sorted(c.items()))


def _summary(out: str, m: Manifest, names: list[str], reused: int, written: int,
             executor: str, t0: float, info: PartInfo | None,
             merged: bool = False) -> ShardSummary:
    secs = time.perf_counter() - t0
    tokens = 0
    for name in names:
        try:
            tokens += int(np.load(os.path.join(out, lengths_name(name))).sum())
        except OSError:
            pass
    nbytes = sum(r.bytes for r in m.shards)
    bad = bad_record_counts(m.skipped)
    if bad:
        log.warning("feedpipe shard: %d bad record(s) left out (%s), each named in %s's "
                    "manifest 'skipped'", sum(bad.values()),
                    ", ".join(f"{k}: {v}" for k, v in bad.items()), printable(out))
    return ShardSummary(
        out=out, shards=len(m.shards), samples=m.total_samples, files=len(names),
        bytes=nbytes, skipped=len(m.skipped), reused_shards=reused, seconds=secs,
        files_per_s=len(names) / secs if secs > 0 else 0.0,
        mb_per_s=nbytes / secs / 1e6 if secs > 0 else 0.0, skipped_inputs=list(m.skipped),
        part=None if info is None else info.label, merged=merged, method=METHOD,
        executor=executor, tokens=tokens,
        tokens_per_s=written / secs if secs > 0 else 0.0, bad_records=bad)
