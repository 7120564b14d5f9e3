"""Tables as a source: Parquet files (``feedpipe shard data.parquet OUT``) and Hugging Face
datasets (:func:`shard_from`).

A table's columns become fields by :mod:`~feedpipe.convert._table_columns` (printed, and
overridable with ``columns=``/``--columns``). Rows are read in batches (``pyarrow``; a
``datasets.Dataset`` is Arrow underneath). ``feedpipe shard`` of a Parquet table and
:func:`shard_from` of a ``datasets.Dataset`` list the rows as samples, then plan and write them
as a tree's files (:mod:`~feedpipe.convert._table_rows`: ``--resume``, ``--shuffle``,
``--part``, ``--workers``). An ``IterableDataset``, which can only be read in order, is written
one sample per row, in one process, through :class:`feedpipe.ShardWriter` (:func:`write_table`).
A row that cannot be a sample (a class name not in the class list, a value of no known kind)
stops the run with its file and row named. With ``on_error="skip"`` it is left out and listed in
the manifest.

``pyarrow`` (extra ``parquet``) and ``datasets`` are imported only here and only when used.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._helpers.storage import is_local, local_path
from .._helpers.storage_listing import is_dir, is_file, open_path, path_in, walker
from ..errors import InputError, KeyClashError, OutputError
from ._shard_writer import ShardWriter
from ._summary import ShardSummary
from ._table_columns import Column, ColumnMap, default_map, index_fields, override

BATCH_ROWS = 1024


@dataclass
class TableSource:
    """What a converter needs of a table: its ``columns``, its ``rows`` (an iterator of
    ``(where, default key, row dict)``; ``where`` names the row in messages), how many rows,
    and what it is (``describe``, for the manifest)."""

    columns: list[Column]
    rows: Callable[[], Iterator[tuple[str, str, dict[str, Any]]]]
    num_rows: int | None
    describe: dict[str, Any]
    paths: list[str] = field(default_factory=list)  # Parquet: the files, as rows() names them
    stems: list[str] = field(default_factory=list)  # Parquet: each file's key prefix
    hidden: list[tuple[str, str]] = field(default_factory=list)  # Parquet: hidden files left out
    dataset: Any = None  # a Hugging Face dataset, its images and audio left encoded


def parquet_files(src: str, hidden: dict[str, int] | None = None) -> list[str] | None:
    """The Parquet files of ``src`` (a ``.parquet`` file, or a directory whose visible files are
    all ``.parquet``, sorted by path), or ``None`` when ``src`` is not a Parquet source.
    ``hidden``: where to count the directory's hidden files, as a tree's listing does
    (:func:`~feedpipe.convert._sources.count_hidden`)."""
    from ._sources import count_hidden, printable

    got = _parquet_root(src)
    if not isinstance(got, tuple):
        return got
    path, walker = got
    base = path.rstrip("/") + "/"

    def rel(root: str, name: str) -> str:
        full = f"{root.rstrip('/')}/{name}"
        return full[len(base):] if full.startswith(base) else name

    found = []
    seen: dict[str, int] = {}
    hidden_dirs = []  # (walked only once the source is known to be a table)
    for root, dirs, files in walker(path):
        hidden_dirs += [(rel(root, d), f"{root.rstrip('/')}/{d}") for d in dirs
                        if d.startswith(".")]
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):  # (no data: left out, and listed)
                count_hidden(seen, rel(root, name))
                continue
            if not name.endswith(".parquet"):
                return None  # the first other file: a tree of files, not a table
            found.append(rel(root, name))
    if not found:
        return None
    if hidden is not None:
        for name, full in hidden_dirs:
            seen[printable(f"{name}/")] = sum(len(files) for _, _, files in walker(full))
        hidden.update({k: n for k, n in seen.items() if n})
    return sorted(found)


def _parquet_root(src: str) -> list[str] | None | tuple[str, Callable[[str], Any]]:
    """A ``.parquet`` file ``src`` (as the list of it), a directory to walk (its path and the
    walk of its storage), or ``None`` where ``src`` is neither."""
    if is_local(src):
        path = local_path(src)
        if path.endswith(".parquet"):
            return [path] if os.path.isfile(path) else None
        return (path, os.walk) if os.path.isdir(path) else None
    path, walk = walker(src)
    if path.endswith(".parquet"):
        return [path] if is_file(src) else None
    return (path, walk) if is_dir(src) else None


def pyarrow_parquet() -> Any:
    from .._helpers.dependency import require

    require("pyarrow", extra="parquet", purpose="Parquet sources")
    import pyarrow.parquet as pq

    return pq


def _kind(t: Any) -> str:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return "category" if pa.types.is_string(t.value_type) or pa.types.is_large_string(
            t.value_type) else _kind(t.value_type)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return "image"  # (datasets.Image and Audio as Parquet stores them: {bytes, path})
    if pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_large_list(t) \
            or pa.types.is_map(t):
        return "nested"
    return "other"


def parquet_source(src: str, files: Sequence[str]) -> TableSource:
    """The Parquet files ``files`` (relative to the directory ``src``, or ``src`` itself)."""
    pq = pyarrow_parquet()
    path = path_in(src)
    single = path.endswith(".parquet")
    paths = [path] if single else [f"{path.rstrip('/')}/{f}" for f in files]

    def open_file(p: str) -> Any:
        try:
            return pq.ParquetFile(open_path(src, p))
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise InputError(f"{p}: not a readable Parquet file ({e})") from e

    first = open_file(paths[0])
    schema = first.schema_arrow
    names = schema.names
    rows_total = 0
    for p in paths:
        pf = open_file(p)
        if pf.schema_arrow.names != names:
            raise InputError(f"{p}: its columns {pf.schema_arrow.names} differ from "
                             f"{paths[0]}'s {names}; convert files of one table together")
        rows_total += pf.metadata.num_rows
    head = next(first.iter_batches(batch_size=64), None)
    head_rows = head.to_pylist() if head is not None else []
    labels = hf_class_labels(schema.metadata)
    index = index_fields(names, schema.metadata)
    columns = []
    for name in names:
        kind = _kind(schema.field(name).type)
        sample = next((r[name] for r in head_rows if r.get(name) is not None), None)
        cats = _categories(pq, src, paths, name) if kind == "category" else None
        if kind == "int" and name in labels:  # a datasets.ClassLabel, as its Parquet keeps it
            kind, cats = "category", labels[name]
        columns.append(Column(name, kind, cats, sample, *index.get(name, (None, ""))))

    stems = ["" if single else rel[: -len(".parquet")] + "/" for rel in files]

    def rows() -> Iterator[tuple[str, str, dict[str, Any]]]:
        for stem, p in zip(stems, paths):
            i = 0
            for batch in open_file(p).iter_batches(batch_size=BATCH_ROWS):
                for row in batch.to_pylist():
                    yield f"{p}: row {i}", f"{stem}{i:08d}", row
                    i += 1

    return TableSource(columns, rows, rows_total,
                       {"source": "parquet", "files": list(files) if not single else [src]},
                       paths, stems)


def hf_class_labels(metadata: Mapping[bytes, bytes] | None) -> dict[str, tuple[str, ...]]:
    """The class names of the ``ClassLabel`` columns a Hugging Face Parquet file records in its
    schema metadata (key ``huggingface``), by column; none for other files (pure).

    Example:
        >>> meta = {b"huggingface": b'{"info": {"features": {"label": {"_type": "ClassLabel", '
        ...                         b'"names": ["cat", "dog"]}}}}'}
        >>> hf_class_labels(meta)
        {'label': ('cat', 'dog')}
    """
    import json

    raw = (metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}  # (metadata of another shape: the column stays an integer label)
    if not isinstance(features, dict):
        return {}
    return {name: tuple(str(n) for n in f["names"]) for name, f in features.items()
            if isinstance(f, dict) and f.get("_type") == "ClassLabel"
            and isinstance(f.get("names"), list) and f["names"]}


def _categories(pq: Any, src: str, paths: list[str], column: str) -> tuple[str, ...]:
    """The categories of a dictionary column: the dictionary values in the order they are first
    met, file by file (a pandas categorical's categories, in their order)."""
    seen: dict[str, None] = {}
    for p in paths:
        for batch in pq.ParquetFile(open_path(src, p)).iter_batches(columns=[column]):
            for v in batch.column(0).dictionary.to_pylist():
                seen.setdefault(str(v), None)
    return tuple(seen)


def dataset_source(dataset: Any) -> TableSource:
    """A Hugging Face ``datasets.Dataset`` (one split): ``ClassLabel`` columns keep their names,
    ``Image``/``Audio`` columns give their encoded bytes (not decoded)."""
    import datasets

    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise InputError(f"a DatasetDict of splits {sorted(dataset)}; pass one split, e.g. "
                         f"dataset[{sorted(dataset)[0]!r}], and an output directory per split")
    features = dataset.features or {}
    for name, feat in features.items():
        if isinstance(feat, (datasets.Image, datasets.Audio)) and feat.decode:
            dataset = dataset.cast_column(name, type(feat)(decode=False))
    features = dataset.features or {}
    first: dict[str, Any] = next(iter(dataset), {})
    # (Dataset.from_pandas keeps an index as __index_level_N__ columns, without pandas' metadata)
    index = index_fields(list(features), None)
    columns = []
    for name, feat in features.items():
        sample = first.get(name)
        if isinstance(feat, datasets.ClassLabel):
            columns.append(Column(name, "category", tuple(feat.names), sample))
        elif isinstance(feat, (datasets.Image, datasets.Audio)):
            columns.append(Column(name, "image", None, resolved_media(sample)))
        elif isinstance(feat, datasets.Value):
            columns.append(Column(name, _value_kind(feat.dtype), None, sample,
                                  *index.get(name, (None, ""))))
        else:
            columns.append(Column(name, "nested", None, sample))

    def rows() -> Iterator[tuple[str, str, dict[str, Any]]]:
        for i, row in enumerate(dataset):
            yield f"row {i}", f"{i:08d}", row

    n = len(dataset) if hasattr(dataset, "__len__") else None
    info = getattr(dataset, "info", None)
    split = getattr(dataset, "split", None)
    return TableSource(columns, rows, n, {"source": "datasets",
                                          "dataset": getattr(info, "dataset_name", None),
                                          "split": None if split is None else str(split)},
                       dataset=dataset)


def _value_kind(dtype: str) -> str:
    if dtype in ("string", "large_string"):
        return "string"
    if dtype in ("binary", "large_binary"):
        return "binary"
    if dtype == "bool":
        return "bool"
    if dtype.startswith(("int", "uint")):
        return "int"
    if dtype.startswith("float"):
        return "float"
    return "other"


def resolved_media(value: Any) -> Any:
    """An image/audio value ``{bytes, path}`` with its bytes read from ``path`` when it holds
    only the path (a dataset built from local files)."""
    if isinstance(value, dict) and value.get("bytes") is None and value.get("path"):
        with open(value["path"], "rb") as f:
            return {**value, "bytes": f.read()}
    return value


def column_map(source: TableSource, columns: str | Mapping[str, str | None] | None,
               classes: str | Sequence[str] | None) -> tuple[ColumnMap, list[str]]:
    """The fields the columns of ``source`` become (``columns``: overrides; ``classes``: class
    names, see :func:`shard_from`), and the image columns whose values may name a file."""
    from ..format._indexer import read_classes

    names, whence = (read_classes(classes) if classes is not None else (None, None))
    cmap = default_map(source.columns, names, f"--classes ({whence})", check=not columns)
    if columns:
        cmap = override(cmap, source.columns, columns)
    images = [t.column for t in cmap.targets if t.encoding == "bytes"
              and next(c for c in source.columns if c.name == t.column).kind == "image"]
    return cmap, images


def write_table(source: TableSource, out: str, *, columns: str | Mapping[str, str | None] | None,
                classes: str | Sequence[str] | None, max_bytes: int | str, max_samples: int | None,
                prefix: str, on_error: str, show_progress: bool | None, src: str,
                tool: str = "feedpipe shard") -> ShardSummary:
    """Write every row of ``source`` as a sample in ``out``; the summary."""
    from .._helpers.progress import progress

    t0 = time.perf_counter()
    cmap, images = column_map(source, columns, classes)
    provenance = {"tool": tool, "method": "table",
                  "source": {**source.describe, "src": src}, "columns": cmap.to_dict()}
    bar = progress(source.num_rows, "shard", "row", show_progress)
    rows = 0
    try:
        with ShardWriter(out, max_samples=max_samples, max_bytes=max_bytes,
                         classes=cmap.classes, prefix=prefix, provenance=provenance) as w:
            for where, key, row in source.rows():
                rows += 1
                bar.update(1)
                problem = _write_row(w, cmap, images, row, key)
                if problem is None:
                    continue
                if on_error == "raise":
                    raise type(problem)(f"{where}: {problem}; fix the row, or use --on-error "
                                        "skip to leave it out") from problem
                w.skip(where, str(problem))
            if not len(w):
                raise InputError(f"{src}: the table has no rows to convert"
                                 + (f" ({len(w.skipped)} skipped)" if w.skipped else ""))
    finally:
        bar.close()
    m = w.close()  # (closed when the block ended: its manifest)
    secs = time.perf_counter() - t0
    nbytes = sum(r.bytes for r in m.shards)
    return ShardSummary(
        out=w.out, shards=len(m.shards), samples=m.total_samples, files=rows,
        bytes=nbytes, skipped=len(m.skipped), reused_shards=0, seconds=secs,
        files_per_s=rows / secs if secs > 0 else 0.0,
        mb_per_s=nbytes / secs / 1e6 if secs > 0 else 0.0,
        skipped_inputs=list(m.skipped), method="table",
        executor="the table writer, in this process", columns=cmap.lines())


def _write_row(w: ShardWriter, cmap: ColumnMap, images: list[str], row: dict[str, Any],
               key: str) -> InputError | KeyClashError | None:
    """Write one row's sample; what was wrong with the row, if anything (an error writing the
    output is raised)."""
    try:
        for name in images:
            row[name] = resolved_media(row.get(name))
        w.write(cmap.sample(row, key))
    except (InputError, KeyClashError) as e:
        return e
    except OutputError:
        raise
    except OSError as e:  # an image file named by a path in the row
        return InputError(f"cannot read {e.filename or 'a file it names'}: {e.strerror or e}")
    return None
