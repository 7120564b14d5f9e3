"""``feedpipe probe``: how fast the storage and each pipeline stage deliver, which stage bounds
samples/s, and what to change.

The facade, in the order it runs:

1. resolve the target (:mod:`~feedpipe.diagnostics._target`);
2. the storage phases, cold then warm (:mod:`~feedpipe.diagnostics._storage`), with the page
   cache state measured (:mod:`~feedpipe.diagnostics._pagecache`);
3. the pipeline phases on shard datasets (:mod:`~feedpipe.diagnostics._pipeline`), then the
   FeedLoader a script gets and its own accounts (:mod:`~feedpipe.diagnostics._accounts`);
4. the verdict (:mod:`~feedpipe.diagnostics._verdict`, pure);
5. the report: a table (:mod:`~feedpipe.diagnostics._report`), JSON, a PNG
   (:mod:`~feedpipe.diagnostics._plot`).

Every phase stops at its own deadline of ``duration`` seconds. Nothing is written except the
outputs asked for and, with ``generate``, one test file in a temp dir that is deleted afterwards.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from .._helpers.progress import progress
from .._helpers.storage import is_local, local_path
from .._redact import redact_doc
from ..errors import OutputError, SourceNotFoundError
from . import _pagecache as pagecache
from . import _phases as phases
from ._env import environment, memory, usable_cpus
from ._settings import DEFAULT_BLOCKS, DEFAULT_THREADS, ProbeSettings
from ._target import Target, resolve
from ._verdict import decide

FORMAT = "feedpipe-probe"
VERSION = 1


class ProbeReport:
    """What a probe measured and decided; :func:`probe` makes one.

    Args:
        doc: the report as a dict (the ``--json`` document): ``target``, ``settings``,
            ``storage``, ``pipeline``, ``verdict``, ``environment``, ``phases``, ``elapsed_s``.

    Example:
        >>> r = probe(generate=1 << 20, duration=0.05, block_sizes=[1 << 16], threads=[1])
        >>> r.verdict["bounding_stage"], sorted(r.to_dict())[:3]
        ('storage', ['elapsed_s', 'environment', 'format'])
        >>> print(r.table().splitlines()[0])  # doctest: +ELLIPSIS
        feedpipe probe  .../probe-data.bin
    """

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    @property
    def verdict(self) -> dict[str, Any]:
        """The verdict, with the bounding stage, the ceiling and the advice."""
        return self.doc["verdict"]

    def to_dict(self) -> dict[str, Any]:
        """The report as a dict (the ``--json`` document)."""
        return self.doc

    def to_json(self) -> str:
        """The report as JSON text (no NaN or infinity: such figures are ``null``)."""
        return json.dumps(_finite(self.doc), indent=1, allow_nan=False) + "\n"

    def table(self) -> str:
        """The report as a table for a terminal."""
        from ._report import table

        return table(self.doc)


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: such figures become ``null``."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def generate_file(path: str, size: int, *, seed: int = 0) -> dict[str, Any]:
    """Write ``size`` random (incompressible, never deduplicable) bytes to ``path`` and fsync, so
    that its pages are clean and can be dropped. Returns the write figures."""
    import numpy as np

    rng = np.random.default_rng(seed)
    chunk = 16 << 20
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(chunk, left)
            f.write(rng.integers(0, 1 << 63, size=(n + 7) // 8, dtype=np.uint64).tobytes()[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    return {"bytes": size, "seconds": round(elapsed, 6), "mb_per_s": size / 1e6 / elapsed}


@contextmanager
def _generated(where: str | None, size: int) -> Iterator[tuple[str, dict[str, Any]]]:
    base = where if where is not None else tempfile.gettempdir()
    if not is_local(base):
        raise ValueError(f"{base}: --generate writes a local test file; give a local directory")
    base = local_path(base)
    if not os.path.isdir(base):
        raise SourceNotFoundError(f"{base}: not a directory to generate test data in")
    if size < 1 << 20:
        raise ValueError(f"--generate needs at least 1 MiB, not {size} bytes")
    free = shutil.disk_usage(base).free
    if size > free // 2:
        raise OutputError(f"{base}: generating {size:,} bytes would use more than half of the "
                          f"{free:,} bytes free; choose a smaller --generate size")
    try:
        tmp = tempfile.mkdtemp(prefix="feedpipe-probe-", dir=base)
    except OSError as e:
        raise OutputError(f"{base}: cannot create a temp dir for test data ({e.strerror})") from e
    try:
        path = os.path.join(tmp, "probe-data.bin")
        try:
            info = generate_file(path, size)
        except OSError as e:
            raise OutputError(f"{path}: cannot write test data ({e.strerror})") from e
        info["dir"] = tmp
        yield path, info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plan(t: Target, seq: Any, small: Any, can_drop: bool, loaders: list[int],
          decode: bool) -> int:
    """Phases to run (host-to-device, known only once CUDA may be asked about, comes on top)."""
    n = 1 if seq is not None else 0  # sequential cold (or remote)
    n += 1 if seq is not None and t.local else 0  # sequential warm
    n += (2 if t.local and can_drop else 1) if small is not None else 0
    n += 1  # random reads
    if t.kind == "dataset":
        n += 2 + (1 if decode else 0) + len(loaders)
    elif t.kind == "directory" and decode:
        n += 1
    return n


def probe(
    target: str | None = None,
    *,
    duration: float = 5.0,
    step_time_ms: float | None = None,
    batch_size: int = 64,
    workers: int | None = None,
    block_sizes: tuple[int, ...] | list[int] | None = None,
    threads: tuple[int, ...] | list[int] | None = None,
    random_block: int = 4096,
    generate: int | None = None,
    json_path: str | None = None,
    plot_path: str | None = None,
    decode: Callable[[dict[str, Any]], Any] | None = None,
    show_progress: bool | None = None,
    route: str | list[str] | None = None,
    price_per_gb: float | None = None,
    price_per_1k_requests: float | None = None,
) -> ProbeReport:
    """Probe ``target``: storage read rates, pipeline stage rates, the bounding stage, advice.

    Args:
        target: a file, a directory of files, a shard dataset (holds ``manifest.json``), local or
            any fsspec URL. With ``generate``: the local directory to generate test data in
            (default: the system temp dir).
        duration: seconds each phase may take (about ten phases for a dataset).
        step_time_ms: the accelerator's time per batch, for the utilisation figure.
        batch_size: samples per batch (batching stage, loader, utilisation).
        workers: DataLoader workers the verdict plans for (default: the usable CPUs); worker
            scaling is measured at 0, 1, 2 and this many.
        block_sizes, threads: the sequential-read grid (default 64 KiB..16 MiB, 1..16 threads).
        random_block: bytes per random read (latency phase).
        generate: write a test file of this many bytes in a temp dir, probe it, delete it.
        json_path: write the report as JSON there (``"-"``: standard output).
        plot_path: write a PNG there (needs the ``plot`` extra: matplotlib).
        decode: ``sample dict -> decoded sample``, the decode stage (default: every image
            field, decoded as ImagePipeline decodes it); also run inside FeedLoader workers.
        show_progress: a progress bar (default: when stderr is a terminal).
        route: on a dataset, the FeedLoader a script gets is run for its accounts (per-part
            times, the bounding part, bytes and requests per epoch): with the route it chooses
            (default), or each route named (``"samples,refs"``; ``"auto"``: its own choice).
        price_per_gb, price_per_1k_requests: the remote store's prices, for a cost per epoch.

    Returns:
        A :class:`ProbeReport`.

    Example:
        >>> r = probe(generate=1 << 20, duration=0.05, block_sizes=[1 << 16], threads=[1])
        >>> r.verdict["bounding_stage"], r.to_dict()["target"]["kind"]
        ('storage', 'file')
    """
    from ._accounts import parse_routes

    settings = ProbeSettings(duration, tuple(block_sizes or DEFAULT_BLOCKS),
                             tuple(threads or DEFAULT_THREADS), random_block, batch_size,
                             workers, step_time_ms, tuple(parse_routes(route)), price_per_gb,
                             price_per_1k_requests)
    if plot_path is not None:
        from .._helpers.dependency import require

        require("matplotlib", extra="plot", purpose="feedpipe probe --plot")
    if generate is not None:
        with _generated(target, int(generate)) as (path, info):
            report = _run(path, settings, decode, show_progress, info)
    elif target is None:
        raise ValueError("no TARGET: name a file, directory, dataset or URL (or use --generate)")
    else:
        report = _run(target, settings, decode, show_progress, None)
    if json_path is not None:
        _write_json(report, json_path)
    if plot_path is not None:
        from ._plot import plot

        plot(report.to_dict(), plot_path)
    return report


def _write_json(report: ProbeReport, path: str) -> None:
    if path == "-":
        sys.stdout.write(report.to_json())
        sys.stdout.flush()
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(report.to_json())
    except OSError as e:
        raise OutputError(f"{path}: cannot write the JSON report ({e.strerror})") from e


def _run(url: str, settings: ProbeSettings, decode: Callable[[dict[str, Any]], Any] | None,
         show_progress: bool | None, generated: dict[str, Any] | None) -> ProbeReport:
    from . import _pipeline as pipeline

    t_start = time.perf_counter()
    d = settings.duration
    t = resolve(url, seconds=d)
    asked = [name for name, given in (
        ("--route", settings.routes != (None,)), ("--price-per-gb", settings.price_per_gb),
        ("--price-per-1k-requests", settings.price_per_1k_requests)) if given is not None
        and given is not False]
    if asked and t.kind != "dataset":
        t.notes.append(f"{', '.join(asked)}: for a shard dataset's FeedLoader; not used on a "
                       f"{t.kind}")
    cpus = usable_cpus()
    plan_workers = settings.workers if settings.workers is not None else cpus
    p = max(1, min(plan_workers, cpus))
    seq, small = t.sequential_set(), t.small_set()
    can_drop = t.local and pagecache.can_drop()
    decode_fn = decode
    if decode_fn is None and pipeline.image_fields(t.fields):
        default = pipeline.ImageDecode(t.fields)
        decode_fn = default if default.fields else None
    # measured worker counts; more than 4 per core only measures contention
    loaders = sorted({0, 1, 2, min(plan_workers, 4 * cpus)}) if t.kind == "dataset" else []
    mem_avail = memory().get("available_bytes", 0)
    fits = bool(mem_avail) and t.total_bytes <= mem_avail // 2
    total = _plan(t, seq, small, can_drop, loaders, decode_fn is not None)
    total += len(settings.routes) if t.kind == "dataset" else 0
    bar = progress(total, desc="feedpipe probe", unit="phase", enabled=show_progress)
    phase = phases.Phases(bar)
    try:
        st = phases.storage_phases(t, seq, small, settings, can_drop, mem_avail, p, phase)
        pl = None
        if t.kind == "dataset":
            pl = phases.dataset_pipeline(t, settings, decode_fn, loaders, phase, workers=p,
                                         cpus=cpus)
        elif t.kind == "directory" and decode_fn is not None and small is not None:
            pl = phases.directory_pipeline(small, decode_fn, decode is not None, d, phase)
    finally:
        bar.close()
    cuda = bool(pl and pl.get("cuda"))
    figures = phases.figures(t, st, pl, settings, cpus, plan_workers, p, fits, cuda)
    verdict = decide(figures)
    target_doc = t.describe()
    target_doc.update(generated=generated, notes=t.notes)
    doc: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "target": target_doc,
        "settings": {**asdict(settings), "workers": plan_workers,
                     "decode": _decode_name(decode, decode_fn)},
        "storage": st, "pipeline": pl, "verdict": verdict.to_dict(),
        "environment": environment(t.root if t.local else url, t.local),
        "phases": phase.done, "elapsed_s": round(time.perf_counter() - t_start, 3),
    }
    if pl and pl.get("h2d"):
        doc["environment"]["cuda_device"] = pl["h2d"]["device"]
    return ProbeReport(_finite(redact_doc(doc)))  # its JSON, table and plot name no secret


def _decode_name(given: Any, used: Any) -> str | None:
    if used is None:
        return None
    if given is None:
        return f"image fields ({', '.join(used.fields)}) decoded as ImagePipeline decodes them"
    return getattr(given, "__qualname__", type(given).__name__)


