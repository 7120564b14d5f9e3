"""The options of a conversion (:func:`feedpipe.shard`): what decides the output bytes, and how
the run goes (which never changes them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..format._tar import BLOCK

DEFAULT_MAX_BYTES = 256 << 20
METHODS = ("auto", "general", "one-pass")
START_METHODS = ("fork", "spawn", "forkserver")

# the options that decide the output bytes, in the order the manifest records them
OUTPUT_OPTIONS = ("max_bytes", "max_samples", "shuffle", "seed", "on_error", "prefix",
                  "labels_from_dirs", "manifest")


@dataclass(frozen=True)
class ShardOptions:
    """Everything :func:`feedpipe.shard` can be told besides ``src`` and ``out``.

    The first eight decide the output bytes. They are recorded in the manifest and in the plan's
    fingerprint, so a ``resume`` refuses other values. The rest decide how the run goes and never
    change the output. Bad values raise ``ValueError`` on construction.

    Args:
        max_bytes: target shard size; a shard exceeds it only to hold one sample larger than it.
        max_samples: at most this many samples per shard.
        shuffle: mix the sample order at write time, deterministically (with ``seed``).
        seed: the seed of ``shuffle``.
        on_error: ``"raise"`` stops at the first bad input; ``"skip"`` leaves it out and lists
            it in the manifest.
        prefix: shard names are ``PREFIX-000000.tar``.
        labels_from_dirs: image-folder layout: a ``cls`` field from the top-level directory.
        manifest: a JSONL/CSV file naming the files of each sample (see ``feedpipe shard -h``).
        workers: processes writing in parallel (default: all cores).
        resume: keep the committed shards of an interrupted run and do the rest.
        method: ``"auto"``, ``"general"`` or ``"one-pass"`` (``"auto"`` takes one pass
            where the input allows it; :attr:`ShardSummary.method` says which ran, and for a
            table, whose method is ``"table"`` either way, :attr:`ShardSummary.executor`); a
            forced method that cannot serve the input is refused, saying why.
        part: ``"I/N"`` or ``(I, N)``: convert only part I (0-based) of a deterministic
            partition into N (the same shares on any machine); :func:`feedpipe.merge`
            joins them.
        merge: with ``part``: the part that finds all N parts finished writes the manifest.
        dask: a ``dask.distributed`` scheduler address or ``Client``: write the shards as tasks
            on that cluster (the ``dask`` extra).
        retries: with ``dask``: times a failed task is retried before the run fails.
        start_method: how pool workers start (``"fork"``, ``"spawn"``, ``"forkserver"``;
            default: fork where there is one). Spawn when the calling process holds threads or
            a CUDA context that a fork must not copy.
        show_progress: a progress bar (default: when stderr is a terminal).
        on_shard: called with each shard's record as it is committed.
        columns: a Parquet source's column-to-field overrides (``"img=jpg,label=cls"``; the
            mapping taken is printed and kept in :attr:`ShardSummary.columns`).
        classes: a Parquet source's class names (a list, ``"a,b,c"`` or a file with one per
            line; default: a categorical label column's categories).

    Example:
        >>> opts = ShardOptions(max_samples=1000, workers=4)
        >>> opts.output_options()["max_samples"], opts.with_overrides({"resume": True}).resume
        (1000, True)
        >>> ShardOptions(on_error="ignore")
        Traceback (most recent call last):
        ...
        ValueError: on_error must be 'raise' or 'skip', not 'ignore'
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    max_samples: int | None = None
    shuffle: bool = False
    seed: int = 0
    on_error: str = "raise"
    prefix: str = "data"
    labels_from_dirs: bool = False
    manifest: str | None = None
    workers: int | None = None
    resume: bool = False
    method: str = "auto"
    part: str | tuple[int, int] | None = None
    merge: bool = False
    dask: Any = None
    retries: int = 2
    start_method: str | None = None
    show_progress: bool | None = None
    on_shard: Callable[[Any], None] | None = None
    columns: str | Mapping[str, str | None] | None = None
    classes: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {self.on_error!r}")
        if self.max_bytes <= 2 * BLOCK:
            raise ValueError(f"max_bytes must be more than {2 * BLOCK} bytes, "
                             f"not {self.max_bytes}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be at least 1, not {self.max_samples}")
        if "/" in self.prefix or not self.prefix:
            raise ValueError(f"prefix must be a non-empty file name without '/', "
                             f"not {self.prefix!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if self.retries < 0:
            raise ValueError(f"retries must be at least 0, not {self.retries}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, "
                             f"not {self.start_method!r}")

    def output_options(self) -> dict[str, Any]:
        """The options that decide the output bytes (the manifest's ``options``)."""
        return {name: getattr(self, name) for name in OUTPUT_OPTIONS}

    def with_overrides(self, overrides: Mapping[str, Any]) -> ShardOptions:
        """These options with ``overrides`` (keyword arguments of :func:`feedpipe.shard`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"shard() got unknown option(s) {', '.join(unknown)}; the options "
                            f"are the fields of ShardOptions: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **overrides) if overrides else self
