"""``feedpipe.shard_from``: a Hugging Face dataset converted into a feedpipe dataset.

A ``datasets.Dataset`` (random access) goes through ``feedpipe shard``'s planner and executors
(:func:`~feedpipe.convert._shard.shard_rows`, its rows read by
:class:`~feedpipe.convert._table_rows.DatasetRows`); an ``IterableDataset`` is written in order by
:func:`~feedpipe.convert._tables.write_table`. It sits above those three modules so that the table
readers (:mod:`~feedpipe.convert._tables`) need not import the converter that uses them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._shard_writer import DEFAULT_MAX_BYTES
from ._summary import ShardSummary
from ._tables import column_map, dataset_source, write_table


def shard_from(dataset: Any, out: str, *, columns: str | Mapping[str, str | None] | None = None,
               classes: str | Sequence[str] | None = None,
               max_bytes: int | str = DEFAULT_MAX_BYTES, max_samples: int | None = None,
               prefix: str = "data", on_error: str = "raise",
               show_progress: bool | None = None, **options: Any) -> ShardSummary:
    """Convert a Hugging Face ``datasets.Dataset`` (one split) into a feedpipe dataset in
    ``out``, through the planner and executors of ``feedpipe shard``.

    Args:
        dataset: a ``datasets.Dataset`` (or ``IterableDataset``) of one split. Samples that
            are dicts already go through :func:`feedpipe.write_samples` instead.
        out: a local directory, missing or empty.
        columns: overrides of the column-to-field mapping (images and binaries to their
            format, an integer label to ``cls``), ``"img=jpg,label=cls"`` or a dict; the
            mapping taken is in the summary's ``columns``.
        classes: class names (a list, a comma-separated string or a file with one per line);
            default: a ``ClassLabel`` column's names.
        max_bytes, max_samples, prefix: as for :func:`feedpipe.shard`.
        on_error: ``"skip"`` leaves out a row that cannot be a sample and lists it in the
            manifest; ``"raise"`` stops there.
        show_progress: a progress bar over rows (default: when stderr is a terminal).
        **options: for a ``datasets.Dataset``, the options of :func:`feedpipe.shard` that a
            table takes: ``shuffle``, ``seed``, ``resume``, ``part``, ``merge``, ``workers``
            (default 1: the dataset is pickled to each worker's task), ``start_method``,
            ``dask``, ``retries``, ``on_shard``. An ``IterableDataset`` is read once, in
            order, and takes none of them (refused, naming them).

    Returns:
        A :class:`feedpipe.ShardSummary` (``method="table"``).

    Raises:
        TypeError: ``dataset`` is not a Hugging Face dataset (a generator or list of dicts:
            the message points to ``write_samples``).

    Example:
        >>> import os, tempfile, datasets
        >>> ds = datasets.Dataset.from_dict({"text": ["a cat", "a dog"], "label": [0, 1]})
        >>> s = shard_from(ds, os.path.join(tempfile.mkdtemp(), "ds"))
        >>> s.samples, s.method
        (2, 'table')
        >>> for line in s.columns:  # the column-to-field mapping taken
        ...     print(line)
        column   text -> text   (text)
        column   label -> cls   (integer label)
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if not hasattr(dataset, "features") and not isinstance(dataset, Mapping):
        # (a DatasetDict is a dict of splits: dataset_source names its splits)
        raise TypeError(
            "shard_from takes a Hugging Face datasets.Dataset or IterableDataset (one split), "
            f"not a {type(dataset).__name__}; for samples as dicts ({{'__key__': ..., 'jpg': "
            "...}) use feedpipe.write_samples(samples, out) or a feedpipe.ShardWriter")
    from .._helpers.dependency import require

    require("datasets", extra="hub", purpose="feedpipe.shard_from")
    import datasets

    planned = ("shuffle", "seed", "resume", "part", "merge", "workers", "start_method", "dask",
               "retries", "on_shard")
    other = sorted(set(options) - set(planned))
    if other:
        raise TypeError(f"shard_from got option(s) {', '.join(other)} it does not take; it "
                        f"takes columns, classes, max_bytes, max_samples, prefix, on_error, "
                        f"show_progress and {', '.join(planned)}")
    table = dataset_source(dataset)
    if isinstance(table.dataset, datasets.Dataset):
        from .._helpers.sizes import parse_size
        from ._options import ShardOptions
        from ._shard import shard_rows
        from ._table_rows import DatasetRows

        cmap, images = column_map(table, columns, classes)
        opts = ShardOptions(max_bytes=parse_size(max_bytes), max_samples=max_samples,
                            prefix=prefix, on_error=on_error, show_progress=show_progress,
                            columns=columns, classes=classes, **options)
        return shard_rows(type(dataset).__name__, table, DatasetRows(table.dataset, cmap, images),
                          out, opts)
    if options:
        raise ValueError(f"a {type(dataset).__name__} is read once, in order (no random "
                         f"access): {', '.join(sorted(options))} cannot apply; convert it "
                         "without, or pass a datasets.Dataset")
    return write_table(table, out, columns=columns, classes=classes,
                       max_bytes=max_bytes, max_samples=max_samples, prefix=prefix,
                       on_error=on_error, show_progress=show_progress,
                       src=type(dataset).__name__, tool="feedpipe.shard_from")
