"""``feedpipe shard --dask ADDRESS``: write the shards as tasks on an existing Dask cluster.

The client lists and plans exactly as a local run does (:mod:`feedpipe.convert`), then submits
one task per shard *part* (:func:`feedpipe.writer.write_part`) and, for every shard, one task that
joins its parts (:func:`feedpipe.writer.finish_shard`: temp file, fsync, index, rename) once they
are done. The parts and the join are the same functions on the same inputs as on one machine, so
the shards, indexes and manifest are byte-identical to a local run's with the same options.

- **Where files go**: workers read ``src`` and write into ``out`` themselves; both must be visible
  at the same paths on every worker (a shared filesystem, or an fsspec URL for ``src``). A worker
  that cannot see ``out`` fails its task with a message that says so.
- **Failures**: a failed task is retried ``retries`` times (``Client.submit(retries=...)``); a
  task on a worker that dies is rescheduled by Dask itself. Part files are hidden temp files named
  after the client's pid, so a retry overwrites its own earlier attempt and never a shard.
- **Atomicity and resume**: a shard exists under its final name only when complete (the join's
  rename); ``--resume`` reuses committed shards, whatever machine wrote them.
- **Progress**: the client's progress bar counts the files of finished parts.

``dask`` is imported only here and only when asked for (extra ``feedpipe[dask]``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from .errors import OutputError
from .manifest import ShardRecord
from .sources import SampleSpec, Source
from .writer import PartResult, finish_shard, write_part

_PURPOSE = "feedpipe shard --dask"
CONNECT_TIMEOUT = "30s"


def check_dask() -> Any:
    """Import ``distributed`` or fail with the exact pip line of the ``dask`` extra."""
    from .dependency import require

    return require("distributed", extra="dask", purpose=_PURPOSE)


def _where() -> str:
    try:
        from distributed import get_worker

        return f"dask worker {get_worker().address}"
    except (ImportError, ValueError):
        return "this process"


def _check_out(out: str) -> None:
    if not os.path.isdir(out):
        raise OutputError(f"{out}: the output directory is not visible on {_where()}; "
                          "`feedpipe shard --dask` needs OUT on a filesystem shared by the "
                          "client and every worker, at the same path")


def write_part_task(source: Source, specs: list[SampleSpec], path: str, on_error: str,
                    out: str) -> PartResult:
    """Task: write one part of a shard (a hidden temp file in ``out``)."""
    _check_out(out)
    return write_part(source, specs, path, on_error)


def finish_task(out: str, name: str, paths: list[str], results: list[PartResult]
                ) -> tuple[ShardRecord, list[tuple[str, str]], set[str]]:
    """Task: join a shard's parts into ``out/name`` atomically; its record, skips and fields."""
    _check_out(out)
    rec, idx, skipped = finish_shard(out, name, list(zip(paths, results)))
    return rec, skipped, idx.fields()


def run_on_dask(
    cluster: Any,
    source: Source,
    plan: list[list[list[SampleSpec]]],
    todo: list[int],
    names: list[str],
    part_paths: dict[tuple[int, int], str],
    out: str,
    on_error: str,
    bar: Any,
    record: Callable[[int, ShardRecord, list[tuple[str, str]], set[str]], None],
    *,
    retries: int = 2,
) -> int:
    """Write shards ``todo`` of ``plan`` on the cluster at ``cluster`` (an address or a
    ``distributed.Client``); call ``record`` for each committed shard; return the bytes written.

    The first task that still fails after ``retries`` retries cancels the rest and its error is
    raised here (e.g. :class:`~feedpipe.errors.InputError` naming the bad file).
    """
    distributed = check_dask()
    if retries < 0:
        raise ValueError(f"retries must be at least 0, not {retries}")
    own = not isinstance(cluster, distributed.Client)
    try:
        client = distributed.Client(cluster, timeout=CONNECT_TIMEOUT) if own else cluster
    except OSError as e:
        raise OutputError(f"{cluster}: cannot connect to the dask scheduler ({e})") from e
    run = uuid.uuid4().hex[:8]
    futures: list[Any] = []
    try:
        kind: dict[str, tuple[str, int]] = {}
        for i in todo:
            parts = []
            for j, specs in enumerate(plan[i]):
                key = f"feedpipe-part-{names[i]}-{j}-{run}"
                fut = client.submit(write_part_task, source, specs, part_paths[i, j], on_error,
                                    out, key=key, retries=retries, pure=False)
                kind[fut.key] = ("part", i)
                parts.append(fut)
            paths = [part_paths[i, j] for j in range(len(plan[i]))]
            fin = client.submit(finish_task, out, names[i], paths, parts,
                                key=f"feedpipe-shard-{names[i]}-{run}", retries=retries,
                                pure=False)
            kind[fin.key] = ("shard", i)
            futures += parts + [fin]
        written = 0
        for fut in distributed.as_completed(futures):
            what, i = kind[fut.key]
            result = fut.result()  # raises the task's own error once its retries are spent
            if what == "part":
                bar.update(result.files)
                written += result.bytes
            else:
                record(i, *result)
        return written
    except BaseException:
        client.cancel(futures)
        raise
    finally:
        if own:
            client.close()
