"""A table (Parquet files, a Hugging Face dataset) as a planned source of ``feedpipe shard``:
its rows listed as samples, their fields read back row by row. So a table takes the planner
and executors of a file tree (``--resume``, ``--shuffle``, ``--part``, ``--workers``,
``--dask``) and its guarantees: shards that depend on the inputs and options only, committed
shards kept by a resume, parts that merge.

The listing reads every row once, in row order, and encodes it as the writer stores it
(:class:`~feedpipe.convert._sample_encoder.SampleEncoder`: the column mapping, key, field names,
``cls``). A row that cannot be a sample is a bad input for ``on_error``. A sample keeps, per
field, a :class:`~feedpipe.convert._sources.FileRef` whose path is the row's locator
(``FILE: row I: FIELD``) and whose size is the field's, so the plan cuts shards by exact sizes
and the fingerprint covers every row. A part writer reads its rows back (:class:`TableRows`:
by Parquet row group; :class:`DatasetRows`: by row number) and encodes them again, the same
way. A part's rows in ``--shuffle`` order lie in many row groups: each is read once per part
that needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from contextlib import closing
from typing import Any

from .._helpers.storage_listing import open_path
from ..errors import InputError, KeyClashError, OutputError
from ._gc_freeze import refreeze
from ._sample_encoder import SampleEncoder
from ._sources import FileRef, Listing, SampleSpec
from ._table_columns import ColumnMap

_REFREEZE_ROWS = 16384  # the listing's new objects kept out of full collections this often
_CACHED_GROUPS = 2  # row groups kept encoded per process (one part's rows are mostly in order)


class Rows:
    """What a part writer reads a table's fields from (``read(locator)``, as
    :class:`~feedpipe.convert._sources.Source` reads files), and how a row is encoded."""

    def __init__(self, cmap: ColumnMap, images: Sequence[str]) -> None:
        self.cmap = cmap
        self.images = list(images)
        self._encoder = SampleEncoder(cmap.classes)

    def path(self, locator: str) -> str:
        return locator

    def encode(self, row: dict[str, Any], key: str, n: int) -> tuple[str, list[tuple[str, bytes]]]:
        """One row as the writer stores it; an :class:`InputError` or :class:`KeyClashError`
        says what is wrong with it, an ``OSError`` which image file it names cannot be read."""
        from ._tables import resolved_media

        for name in self.images:
            row[name] = resolved_media(row.get(name))
        return self._encoder.encode(self.cmap.sample(row, key), n)

    def read(self, locator: str, size: int = -1) -> bytes:
        raise NotImplementedError


class DatasetRows(Rows):
    """The rows of a Hugging Face ``datasets.Dataset`` (random access by row number; locators
    ``row I: FIELD``, keys ``IIIIIIII`` as :func:`~feedpipe.convert._tables.dataset_source`
    gives them)."""

    def __init__(self, dataset: Any, cmap: ColumnMap, images: Sequence[str]) -> None:
        super().__init__(cmap, images)
        self.dataset = dataset
        self._row: tuple[int, dict[str, bytes]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_row": None}

    def read(self, locator: str, size: int = -1) -> bytes:
        where, _, field = locator.rpartition(": ")
        i = int(where.rpartition("row ")[2])
        if self._row is None or self._row[0] != i:  # (a row's fields are read one after another)
            self._row = (i, dict(self.encode(dict(self.dataset[i]), f"{i:08d}", i)[1]))
        return self._row[1][field]


class TableRows(Rows):
    """The rows of the Parquet files ``paths`` (``stems``: each file's key prefix)."""

    def __init__(self, paths: Sequence[str], stems: Sequence[str], src: str, cmap: ColumnMap,
                 images: Sequence[str]) -> None:
        super().__init__(cmap, images)
        self.paths = list(paths)
        self.stems = dict(zip(paths, stems))
        self.src = src
        self._groups: OrderedDict[tuple[str, int], list[dict[str, bytes]]] = OrderedDict()
        self._bounds: dict[str, list[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_groups": OrderedDict(), "_bounds": {}}

    def read(self, locator: str, size: int = -1) -> bytes:
        """The bytes of the field a locator (``FILE: row I: FIELD``) names."""
        where, _, field = locator.rpartition(": ")
        path, _, row = where.rpartition(": row ")
        i = int(row)
        bounds = self._row_groups(path)
        g = _group_of(bounds, i)
        got = self._groups.get((path, g))
        if got is None:
            got = self._load(path, g, bounds[g])
        else:
            self._groups.move_to_end((path, g))
        sample = got[i - bounds[g]]
        if field not in sample:  # (the table changed since it was listed)
            raise InputError(f"{where}: holds no field {field!r} now; the table changed while "
                             "it was converted: convert it again")
        return sample[field]

    def _open(self, path: str) -> Any:
        from ._tables import pyarrow_parquet

        pq = pyarrow_parquet()
        return pq.ParquetFile(open_path(self.src, path))

    def _row_groups(self, path: str) -> list[int]:
        bounds = self._bounds.get(path)
        if bounds is None:
            meta = self._open(path).metadata
            bounds = [0]
            for g in range(meta.num_row_groups):
                bounds.append(bounds[-1] + meta.row_group(g).num_rows)
            self._bounds[path] = bounds
        return bounds

    def _load(self, path: str, g: int, first: int) -> list[dict[str, bytes]]:
        rows = self._open(path).read_row_group(g).to_pylist()
        out = []
        for j, row in enumerate(rows):
            key = f"{self.stems[path]}{first + j:08d}"
            try:
                out.append(dict(self.encode(row, key, first + j)[1]))
            except (InputError, KeyClashError, OSError):
                out.append({})  # (a bad row: listed as a problem, never read)
        self._groups[(path, g)] = out
        while len(self._groups) > _CACHED_GROUPS:
            self._groups.popitem(last=False)
        return out


def _group_of(bounds: list[int], i: int) -> int:
    import bisect

    g = bisect.bisect_right(bounds, i) - 1
    if not 0 <= g < len(bounds) - 1:
        raise InputError(f"row {i} is past the table's {bounds[-1]} rows; the table changed "
                         "while it was converted: convert it again")
    return g


def list_table(source: Any, rows: Rows, show_progress: bool | None = None) -> Listing:
    """The samples of every row of the table ``source`` (a
    :class:`~feedpipe.convert._tables.TableSource`), each field a locator into ``rows``; a row
    that cannot be a sample is a problem (``where``, reason)."""
    from .._helpers.progress import progress

    samples: list[SampleSpec] = []
    problems: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    with closing(progress(source.num_rows, "list", "row", show_progress)) as bar:
        for n, (where, key, row) in enumerate(source.rows()):
            bar.update(1)
            _list_row(rows, n, where, key, row, samples, problems, seen)
            if n % _REFREEZE_ROWS == _REFREEZE_ROWS - 1:
                refreeze()
    return Listing(samples, problems, rows.cmap.classes)


def _list_row(rows: Rows, n: int, where: str, key: str, row: dict[str, Any],
              samples: list[SampleSpec], problems: list[tuple[str, str]],
              seen: dict[str, str]) -> tuple[str, list[tuple[str, bytes]]] | None:
    """List one row: a sample (its key and members returned), or a problem (``None``)."""
    try:
        k, blobs = rows.encode(row, key, n)
    except (InputError, KeyClashError) as e:
        problems.append((where, str(e)))
        return None
    except OutputError:
        raise
    except OSError as e:  # an image file named by a path in the row
        problems.append((where, f"cannot read {e.filename or 'a file it names'}: "
                                f"{e.strerror or e}"))
        return None
    first = seen.setdefault(k, where)
    if first != where:
        raise KeyClashError(f"{where}: duplicate sample key {k!r}: {first} has it too; give "
                            "every row its own key (a key column of unique values, or none)")
    samples.append(SampleSpec(k, [FileRef(ext, f"{where}: {ext}", len(data))
                                  for ext, data in blobs]))
    return k, blobs


def stage_table(source: Any, rows: Rows, stage_path: str,
                show_progress: bool | None = None) -> tuple[Listing, Any]:
    """List the table ``source`` as :func:`list_table` does and, in the same read, stage every
    sample's tar members in ``stage_path`` (a hidden file of OUT).

    Returns the listing and a :class:`~feedpipe.convert._onepass.StagedTree` whose shards are
    cut from the staged bytes, so each row is read and encoded once: the planned route reads
    it again to write it (``benchmarks/bench_convert.py --datasets parquet``). The staged
    members are those a part writer would write, in listing order."""
    from .._helpers.progress import progress
    from ._listing import Chunk
    from ._onepass import StagedDir, StagedTree
    from ._writer import removed_on_error, write_members

    samples: list[SampleSpec] = []
    problems: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    staged = StagedDir(Chunk("", ""), stage_path)
    keys, starts, first, exts = staged.keys, staged.starts, staged.first, staged.exts
    offsets, sizes = staged.offsets, staged.sizes  # (no names: StagedDir.cut makes them)
    members: list[tuple[str, int, int]] = []  # one row's
    pos = 0
    with removed_on_error(stage_path), open(stage_path, "wb", buffering=1 << 20) as out, \
            closing(progress(source.num_rows, "list", "row", show_progress)) as bar:
        write = out.write
        for n, (where, key, row) in enumerate(source.rows()):
            bar.update(1)
            got = _list_row(rows, n, where, key, row, samples, problems, seen)
            if n % _REFREEZE_ROWS == _REFREEZE_ROWS - 1:
                refreeze()
            if got is None:
                continue
            keys.append(got[0])
            starts.append(pos)
            first.append(len(exts))
            exts += [ext for ext, _ in got[1]]
            pos, _ = write_members(write, got[0], got[1], pos, members)
            for _, offset, size in members:
                offsets.append(offset)
                sizes.append(size)
            members.clear()
        starts.append(pos)
        first.append(len(exts))
    return Listing(samples, problems, rows.cmap.classes), StagedTree(None, [staged], [stage_path],
                                                                     None)
