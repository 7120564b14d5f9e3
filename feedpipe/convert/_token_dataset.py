"""Hugging Face ``datasets`` objects as the source of a token conversion:
``feedpipe.shard_tokens(dataset, out, tokenizer=...)``.

The conversion is planned as for files (:mod:`~feedpipe.convert._text_inputs`): units listed
before any text is read, unit ``i`` written as shard ``i`` by the same executors.

- A ``datasets.Dataset`` is cut into units of consecutive rows (extras :data:`ROWS`,
  ``b"LO HI"``), about ``chunk_bytes`` of text each by the text column's Arrow size per row (the
  buffers' sizes: no row is read). A unit reads its rows with ``dataset[LO:HI]`` in Arrow format,
  so an index mapping (``select``, ``shuffle``) is followed: the shards hold the documents in
  the order ``dataset[i]`` gives them.
- An ``IterableDataset`` has no random access: a unit is one of its ``n_shards`` data-source
  shards (extras :data:`SHARD`, ``b"I N"``), read in order by ``dataset.shard(N, I)``.
- A ``DatasetDict`` (or ``IterableDatasetDict``) gives the split named by ``split``.

A worker process gets the dataset pickled with the source: a dataset loaded from files
(``load_dataset``, ``load_from_disk``) pickles as its cache files' paths, an in-memory one
(``Dataset.from_dict``) as its whole table, once per unit.

Records are named by their place in the dataset: ``dataset[17]`` (a split:
``dataset['train'][17]``), or for an ``IterableDataset`` ``dataset shard 2 of 4, record 17``. A
``None``, an empty or a non-string value, or a missing column, is a bad record, named and
counted like those of a file (:class:`~feedpipe.convert._text_inputs.Bad`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import InputError
from ..transforms._tokenizer import TokenizerRef
from ._sources import SampleSpec
from ._text_inputs import Bad, text_of
from ._token_writer import TokenSource

ROWS = "rows"  # extras of a Dataset unit: b"LO HI" (dataset indices, HI excluded)
SHARD = "shard"  # extras of an IterableDataset unit: b"I N" (data-source shard I of N)


def is_hf_dataset(src: Any) -> bool:
    """Whether ``src`` is a Hugging Face ``datasets`` object (told without importing
    ``datasets``)."""
    return not isinstance(src, (str, bytes, os.PathLike)) and \
        type(src).__module__.split(".")[0] == "datasets"


def pick_split(src: Any, split: str | None) -> tuple[Any, str]:
    """The dataset to convert (a ``DatasetDict``'s split ``split``) and how its records are
    named."""
    if isinstance(src, Mapping):
        splits = sorted(src)
        if split is None:
            raise InputError(f"a {type(src).__name__} of splits {splits}; pass split=..., e.g. "
                             f"split={splits[0] if splits else 'train'!r}, and an output "
                             "directory per split")
        if split not in src:
            raise InputError(f"the {type(src).__name__} has no split {split!r}; its splits are "
                             f"{splits}")
        return src[split], f"dataset[{split!r}]"
    if split is not None:
        raise ValueError(f"split={split!r} chooses a split of a DatasetDict; this is a "
                         f"{type(src).__name__} (one split already): leave split out")
    return src, "dataset"


def dataset_plan(src: Any, split: str | None, tokenizer: TokenizerRef, text_field: str,
                 eos_id: int | None, chunk_bytes: int
                 ) -> tuple[str, list[SampleSpec], DatasetTokenSource, str]:
    """What a conversion of the Hugging Face dataset ``src`` needs: a label for the manifest and
    messages, the units, the source that reads them, and what identifies the dataset (its
    length, features and cache files), so that a resume refuses another dataset."""
    ds, name = pick_split(src, split)
    label = f"datasets.{type(src).__name__}" + ("" if name == "dataset" else name[7:])
    if hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        units = _row_units(ds, text_field, chunk_bytes)
        label += f" ({len(ds)} rows)"
    else:
        n = int(getattr(ds, "n_shards", 1) or 1) if hasattr(ds, "shard") else 1
        units = [SampleSpec(f"u{k:06d}", [], [(SHARD, f"{k} {n}".encode())]) for k in range(n)]
        label += f" ({n} shard{'s' if n != 1 else ''})"
    ident = _identity(ds)
    source = DatasetTokenSource(ds, name, tokenizer, text_field, eos_id)
    return label, units, source, ident


def _identity(ds: Any) -> str:
    """What tells this dataset from another for a resume, from its public attributes: its
    type, length, features and cache files (a dataset built in memory has none: another of the
    same length and features passes for it)."""
    files = sorted(str(f.get("filename", f)) for f in getattr(ds, "cache_files", None) or [])
    n = len(ds) if hasattr(ds, "__len__") else getattr(ds, "n_shards", None)
    return json.dumps([type(ds).__name__, n, str(getattr(ds, "features", None)), files])


def _row_units(ds: Any, field: str, chunk_bytes: int) -> list[SampleSpec]:
    """Units of consecutive rows of about ``chunk_bytes`` of text, by the Arrow size per row of
    the text column (of the whole table where there is no such column)."""
    table = ds.data  # (the table under any index mapping: its mean row size is what counts)
    size = table.column(field).nbytes if field in table.column_names else table.nbytes
    per_row = max(1.0, size / max(table.num_rows, 1))
    step = max(1, int(chunk_bytes // per_row))
    n = len(ds)
    return [SampleSpec(f"u{k:06d}", [], [(ROWS, f"{lo} {min(lo + step, n)}".encode())])
            for k, lo in enumerate(range(0, n, step))]


class DatasetTokenSource(TokenSource):
    """A token conversion's source reading its units from a Hugging Face dataset (see the
    module docstring); ``name`` names the records (``dataset``, ``dataset['train']``)."""

    def __init__(self, dataset: Any, name: str, tokenizer: TokenizerRef, text_field: str,
                 eos_id: int | None) -> None:
        super().__init__(".", tokenizer, text_field, eos_id)
        self.dataset, self.name = dataset, name
        self._view: Any = None  # the dataset in Arrow format, the text column only

    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "dataset": self.dataset, "name": self.name,
                "_view": None}

    def documents(self, unit: SampleSpec) -> Iterator[tuple[str, str | Bad]]:
        extras = dict(unit.extras)
        if ROWS in extras:
            lo, hi = (int(x) for x in extras[ROWS].split())
            return self._rows(lo, hi)
        k, n = (int(x) for x in extras[SHARD].split())
        return self._shard(k, n)

    def _rows(self, lo: int, hi: int) -> Iterator[tuple[str, str | Bad]]:
        ds, field = self.dataset, self.text_field
        if field not in ds.column_names:
            reason = f"no column {field!r} (it has {ds.column_names[:8]})"
            for i in range(lo, hi):
                w = f"{self.name}[{i}]"
                yield w, Bad(w, "missing field", reason)
            return
        if self._view is None:
            self._view = ds.with_format("arrow", columns=[field])
        for i, value in enumerate(self._view[lo:hi].column(field).to_pylist(), lo):
            w = f"{self.name}[{i}]"
            yield w, text_of(value, w, field, "column")

    def _shard(self, k: int, n: int) -> Iterator[tuple[str, str | Bad]]:
        field = self.text_field
        part = self.dataset.shard(num_shards=n, index=k) if n > 1 else self.dataset
        for j, row in enumerate(part):
            w = f"{self.name} shard {k} of {n}, record {j}"
            if field in row:
                yield w, text_of(row[field], w, field, "column")
            else:
                yield w, Bad(w, "missing field", f"no column {field!r} (it has "
                                                 f"{sorted(row)[:8]})")
