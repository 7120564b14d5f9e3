"""``feedpipe shard --manifest FILE``: samples named by the rows of a JSONL or CSV file.

Columns: ``key`` (optional; default: the first file's stem); ``path`` (a file whose own
extension names its field); ``<ext>_path`` (a file stored as field ``<ext>``); every other
non-empty column is a scalar field written as UTF-8 text (JSON for lists and objects). Relative
paths are taken from the source root. Only the listed files' sizes are read here.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator

from .._helpers.storage import is_local, local_path, size_of
from ..errors import InputError, KeyClashError
from ..format._keys import encode_key, split_source, valid_extension
from ._sources import FileRef, Listing, SampleSpec, Source, check_source_dir


def _rows(manifest_file: str) -> Iterator[tuple[int, dict[str, object]]]:
    from .._helpers.storage import read_bytes

    text = read_bytes(manifest_file).decode("utf-8-sig")  # -sig: spreadsheets write a BOM
    if manifest_file.endswith(".csv"):
        for i, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
            yield i, dict(row)
    elif manifest_file.endswith((".jsonl", ".ndjson")):
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{manifest_file}:{i}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise InputError(f"{manifest_file}:{i}: a row must be a JSON object")
            yield i, row
    else:
        raise InputError(f"{manifest_file}: manifest must end in .jsonl, .ndjson or .csv")


def list_manifest(src: str, manifest_file: str) -> Listing:
    """Samples named by the rows of a JSONL or CSV manifest.

    Columns: ``key`` (optional; default: the first file's stem); ``path`` (a file whose own
    extension names its field); ``<ext>_path`` (a file stored as field ``<ext>``); every other
    non-empty column is a scalar field written as UTF-8 text (JSON for lists and objects).
    Relative paths are taken from ``src``.
    """
    check_source_dir(src)
    source = Source(src)
    problems: list[tuple[str, str]] = []
    samples: dict[str, tuple[SampleSpec, str]] = {}
    for lineno, row in _rows(manifest_file):
        where = f"{manifest_file}:{lineno}"
        files: list[FileRef] = []
        extras: list[tuple[str, bytes]] = []
        bad = _row_fields(source, row, where, files, extras)
        if bad is not None:
            problems.append(bad)
            continue
        if not files and not extras:
            continue
        key = _row_key(row, files, where)
        exts = [f.ext for f in files] + [e for e, _ in extras]
        dup = {e for e in exts if exts.count(e) > 1}
        if dup:
            raise KeyClashError(f"{where}: field(s) {sorted(dup)} given twice in one row")
        spec = SampleSpec(key, files, extras)
        here = f"{where} ({spec.describe()})"
        if key in samples:
            other = samples[key][1]
            raise KeyClashError(
                f"duplicate sample key {key!r}: {here} and {other} both map to it; give rows "
                "distinct 'key' values"
            )
        samples[key] = (spec, here)
    return Listing([samples[k][0] for k in sorted(samples)], problems)


def _row_fields(source: Source, row: dict[str, object], where: str, files: list[FileRef],
                extras: list[tuple[str, bytes]]) -> tuple[str, str] | None:
    """Append a row's files and scalar fields; the bad input (a path and why) that leaves the
    row out, or None."""
    for col, value in row.items():
        if value is None or value == "" or col == "key":
            continue
        if col == "path" or col.endswith("_path"):
            rel = str(value)
            ext = split_source(rel)[1] if col == "path" else col[: -len("_path")]
            if not valid_extension(ext):
                return rel, f"{where}: field {ext!r} from column {col!r} is not a valid name"
            try:
                size = _size(source, rel)
            except OSError:
                return rel, f"{where}: file not found or not readable"
            if size == 0:
                return rel, f"{where}: zero-byte file"
            files.append(FileRef(ext, rel, size))
        else:
            if not valid_extension(col):
                raise InputError(f"{where}: column {col!r} cannot be a field name (no "
                                 "spaces, '/' or '%'); rename the column")
            text = value if isinstance(value, str) else json.dumps(value)
            extras.append((col, text.encode("utf-8")))
    return None


def _row_key(row: dict[str, object], files: list[FileRef], where: str) -> str:
    """A row's sample key: its ``key`` column, else its first file's stem."""
    raw_key = row.get("key")
    if raw_key not in (None, ""):
        return encode_key(str(raw_key))
    if files:
        return encode_key(split_source(files[0].path)[0].lstrip("/"))
    raise InputError(f"{where}: row has no files and no key; give it a 'key' column or "
                     "a 'path' column")


def _size(source: Source, rel: str) -> int:
    p = source.path(rel)
    if is_local(p):
        return os.stat(local_path(p)).st_size
    try:
        return size_of(p)
    except FileNotFoundError as e:
        raise OSError(str(e)) from e
