"""Text corpora as *units* of documents: what ``feedpipe shard --tokenizer`` lists, plans and
hands to its workers, and how a worker reads a unit's documents back.

A unit is a run of documents one worker tokenises into one shard. Listing a corpus reads no
document, so the plan is known before any text is: a unit is a :class:`SampleSpec` whose key
names it (``u000012``), whose files are the inputs it reads and whose extras say which part of
them (:data:`RANGE`, :data:`ROW_GROUP`). The kinds of input:

- JSON Lines (``.jsonl``, ``.json``, ``.ndjson``): one object per line, the text in
  ``text_field``. A plain file is cut into byte ranges of about ``chunk_bytes`` (a unit owns the
  lines that start in its range), a compressed one (``.gz``, ``.zst``) is one unit.
- Parquet (``.parquet``) and Arrow stream files (``.arrow``, as the Hugging Face ``datasets``
  cache holds them): the text in column ``text_field``; a Parquet row group is one unit, an
  Arrow file one unit.
- Any other file of a tree (``.txt``, ``.md``, code): the whole file is one document; files are
  grouped into units of about ``chunk_bytes`` in sorted path order.

Each document is read as ``(where, text)`` where ``text`` is a ``str`` or, for a bad record,
``None`` with the reason in ``where``'s companion (:class:`Bad`). Bad records are never dropped
here: the writer names and counts them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._helpers.dependency import require
from .._helpers.storage import local_path
from ..errors import InputError
from ._sources import FileRef, SampleSpec, printable

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED = (".gz", ".zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
RANGE = "range"  # extras of a plain JSON Lines unit: b"START END" (bytes of the file)
ROW_GROUP = "row_group"  # extras of a Parquet unit: b"G"
DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Bad:
    """A record that holds no usable text: where it is and why (``kind`` counts it)."""

    where: str
    kind: str
    reason: str


def kind_of(path: str) -> str:
    """``"jsonl"``, ``"jsonl.gz"``, ``"jsonl.zst"``, ``"parquet"``, ``"arrow"`` or ``"text"``
    (a whole file is a document).

    Example:
        >>> kind_of("a/b.jsonl.zst"), kind_of("x.parquet"), kind_of("README.md")
        ('jsonl.zst', 'parquet', 'text')
    """
    low = path.lower()
    for c in COMPRESSED:
        if low.endswith(c) and low[:-len(c)].endswith(JSONL_SUFFIXES):
            return "jsonl" + c
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    for t in TABLE_SUFFIXES:
        if low.endswith(t):
            return t[1:]
    return "text"


def list_inputs(src: str) -> tuple[str, list[str]]:
    """The input files of ``src`` (a file, or a directory walked in sorted order, hidden entries
    left out): the root they are relative to, and their relative paths."""
    root = local_path(src)
    if os.path.isfile(root):
        return os.path.dirname(root) or ".", [os.path.basename(root)]
    if not os.path.isdir(root):
        raise InputError(f"{printable(src)}: no such file or directory; give a JSON Lines, "
                         "Parquet or Arrow file, or a directory of them or of text files")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if not name.startswith("."):
                found.append(name if rel == "." else f"{rel}/{name}")
    found.sort()
    if not found:
        raise InputError(f"{printable(src)}: the directory holds no input files")
    return root, found


def list_units(root: str, files: list[str], chunk_bytes: int) -> list[SampleSpec]:
    """Cut the inputs into units, in order (pure but for file sizes and Parquet footers)."""
    units: list[SampleSpec] = []
    group: list[FileRef] = []
    group_bytes = 0

    def add(files: list[FileRef], extras: list[tuple[str, bytes]] | None = None) -> None:
        units.append(SampleSpec(f"u{len(units):06d}", files, extras or []))

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            add(group)
        group, group_bytes = [], 0

    for rel in files:
        path = os.path.join(root, rel)
        size = os.path.getsize(path)
        kind = kind_of(rel)
        if kind == "text":
            group.append(FileRef(kind, rel, size))
            group_bytes += size
            if group_bytes >= chunk_bytes:
                flush()
            continue
        flush()
        if kind == "jsonl":
            for start in range(0, max(size, 1), chunk_bytes):
                end = min(start + chunk_bytes, size)
                add([FileRef(kind, rel, end - start)], [(RANGE, f"{start} {end}".encode())])
        elif kind == "parquet":
            pq = require("pyarrow.parquet", extra="parquet", purpose="to read Parquet text")
            meta = pq.ParquetFile(path).metadata
            for g in range(meta.num_row_groups):
                add([FileRef(kind, rel, meta.row_group(g).total_byte_size)],
                    [(ROW_GROUP, str(g).encode())])
        else:
            add([FileRef(kind, rel, size)])
    flush()
    return units


def _decode(raw: bytes, where: str) -> str | Bad:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Bad(where, "invalid UTF-8", f"invalid UTF-8 at byte {e.start}")


def text_of(value: Any, where: str, field: str, what: str) -> str | Bad:
    """The text of a record's value, or why it has none."""
    if value is None:
        return Bad(where, "missing field", f"{what} {field!r} is null")
    if isinstance(value, bytes):
        value = _decode(value, where)
        if isinstance(value, Bad):
            return value
    if not isinstance(value, str):
        return Bad(where, "not a string", f"{what} {field!r} is a {type(value).__name__}, "
                   "not a string")
    if not value:
        return Bad(where, "empty text", "empty text")
    return value


def _jsonl_lines(data: bytes, field: str, name: str, first_line: int | None,
                 base: int) -> Iterator[tuple[str, str | Bad]]:
    """The documents of JSON Lines ``data``; records are named by line number (where known)
    or by byte offset in the file."""
    pos = 0
    n = len(data)
    line = first_line
    while pos < n:
        end = data.find(b"\n", pos)
        if end < 0:
            end = n
        raw = data[pos:end]
        where = f"{name}:{line}" if line is not None else f"{name} at byte {base + pos}"
        pos = end + 1
        if line is not None:
            line += 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            yield where, Bad(where, "blank line", "blank line (not a JSON object)")
            continue
        text = _decode(raw, where)
        if isinstance(text, Bad):
            yield where, text
            continue
        try:
            obj = json.loads(text)
        except ValueError as e:
            yield where, Bad(where, "not JSON", f"not valid JSON ({e})")
            continue
        if not isinstance(obj, dict):
            yield where, Bad(where, "not an object", f"a JSON {type(obj).__name__}, not an "
                             "object")
            continue
        yield where, text_of(obj.get(field), where, field, "field") if field in obj else \
            Bad(where, "missing field", f"no field {field!r} (it has {sorted(obj)[:8]})")


def _range_bytes(path: str, start: int, end: int) -> tuple[bytes, int]:
    """The whole lines of ``path`` that start in ``[start, end)`` and where the first starts."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the line under way at ``start`` belongs to the unit before
        at = f.tell()
        if at >= end:
            return b"", at
        data = f.read(end - at)
        if data and not data.endswith(b"\n"):
            data += f.readline()  # the last line that starts in the range, to its end
    return data, at


def _decompressed(path: str, kind: str) -> bytes:
    if kind == "jsonl.gz":
        import gzip  # here: a conversion of files or tables never loads it

        with gzip.open(path, "rb") as f:
            return f.read()
    zstd = require("zstandard", extra="text", purpose="to read .zst JSON Lines")
    with open(path, "rb") as f:
        return zstd.ZstdDecompressor().stream_reader(f).read()


def _column(table: Any, field: str, name: str, base: int = 0
            ) -> Iterator[tuple[str, str | Bad]]:
    """The documents of the column ``field`` of an Arrow table, named by row (``base``: the
    file's row of the table's first)."""
    if field not in table.column_names:
        reason = f"no column {field!r} (it has {table.column_names[:8]})"
        for r in range(table.num_rows):
            w = f"{name} row {base + r}"
            yield w, Bad(w, "missing field", reason)
        return
    for r, value in enumerate(table.column(field).to_pylist()):
        w = f"{name} row {base + r}"
        yield w, text_of(value, w, field, "column")


def read_unit(root: str, unit: SampleSpec, field: str) -> Iterator[tuple[str, str | Bad]]:
    """The documents of ``unit``, in order: ``(where, text or Bad)``; an input that cannot be
    read at all raises :class:`InputError` naming it."""
    extras = dict(unit.extras)
    for ref in unit.files:
        path = os.path.join(root, ref.path)
        name = printable(ref.path)
        try:
            if ref.ext == "text":
                with open(path, "rb") as f:
                    raw = f.read()
                text = _decode(raw, name)
                yield name, (Bad(name, "empty text", "empty file") if text == "" else text)
            elif ref.ext == "jsonl":
                start, end = (int(x) for x in extras[RANGE].split())
                data, at = _range_bytes(path, start, end)
                yield from _jsonl_lines(data, field, name, 1 if at == 0 else None, at)
            elif ref.ext.startswith("jsonl."):
                yield from _jsonl_lines(_decompressed(path, ref.ext), field, name, 1, 0)
            elif ref.ext == "parquet":
                pq = require("pyarrow.parquet", extra="parquet", purpose="to read Parquet text")
                g = int(extras[ROW_GROUP])
                f = pq.ParquetFile(path)
                cols = [field] if field in f.schema_arrow.names else None
                base = sum(f.metadata.row_group(i).num_rows for i in range(g))
                table = f.read_row_group(g, columns=cols)
                yield from _column(table, field, name, base)
            else:  # arrow: an IPC stream (the datasets cache) or file
                pa = require("pyarrow", extra="parquet", purpose="to read Arrow text")
                with pa.memory_map(path) as m:
                    try:
                        table = pa.ipc.open_stream(m).read_all()
                    except pa.ArrowInvalid:
                        m.seek(0)
                        table = pa.ipc.open_file(m).read_all()
                yield from _column(table, field, name)
        except (OSError, EOFError) as e:
            raise InputError(f"{name}: cannot read: {e}; fix or remove it") from e
        except Exception as e:
            # (gzip's BadGzipFile is an OSError: named above)
            if type(e).__module__.startswith(("pyarrow", "zstandard")):
                raise InputError(f"{name}: cannot read: {e}; fix or remove it") from e
            raise

