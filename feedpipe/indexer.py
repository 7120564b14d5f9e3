"""``feedpipe index``: adopt shards made by other tools (``webdataset.ShardWriter``, ``tar``).

Scans each shard once, writes its DALI v1.2 ``.idx`` beside it and a ``manifest.json`` for the
set, so the shards stream through feedpipe without re-sharding.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence

from . import __version__
from .errors import KeyClashError, OutputError, ShardFormatError, SourceNotFoundError
from .index import check_names, group_members, index_path, write_index
from .manifest import Manifest, ShardRecord, write_manifest, write_wids_index
from .progress import progress
from .tarformat import scan


def _expand(shards: Sequence[str]) -> list[str]:
    out: list[str] = []
    for s in shards:
        if os.path.isdir(s):
            found = sorted(glob.glob(os.path.join(s, "*.tar")))
            if not found:
                raise SourceNotFoundError(f"{s}: directory holds no .tar shards")
            out.extend(found)
        elif any(c in s for c in "*?["):
            found = sorted(glob.glob(s))
            if not found:
                raise SourceNotFoundError(f"{s}: no shard matches")
            out.extend(found)
        elif not os.path.exists(s):
            raise SourceNotFoundError(f"{s}: shard not found")
        else:
            out.append(s)
    return out


def index(
    shards: Sequence[str],
    *,
    root: str | None = None,
    manifest: bool = True,
    show_progress: bool | None = None,
) -> Manifest:
    """Write an ``.idx`` for every shard and a ``manifest.json`` in ``root``.

    Args:
        shards: shard paths, globs, or directories (all ``*.tar`` inside).
        root: where the manifest goes (default: the directory of the first shard); every shard
            must lie under it.
        manifest: also write ``manifest.json`` (and ``wids.json``).

    Raises:
        KeyClashError: the same key appears twice (in one shard or in two).
        ShardFormatError: a shard is truncated or corrupted (names the shard and offset).
    """
    paths = _expand(shards)
    if not paths:
        raise SourceNotFoundError("no shards given")
    root = os.path.abspath(root or os.path.dirname(os.path.abspath(paths[0])))
    records: list[ShardRecord] = []
    fields: set[str] = set()
    seen: dict[str, str] = {}
    bar = progress(len(paths), "index", "shard", show_progress)
    for path in paths:
        rel = os.path.relpath(os.path.abspath(path), root)
        if rel.startswith(".."):
            raise OutputError(f"{path}: shard lies outside the dataset root {root}")
        size = os.path.getsize(path)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        with open(path, "rb") as f:
            idx = group_members((m.name, m.offset, m.size) for m in scan(f, size, path))
        if not len(idx):
            raise ShardFormatError(f"{path}: shard holds no samples")
        check_names(idx.names, path)
        for key in idx.keys:
            if key in seen:
                raise KeyClashError(
                    f"duplicate sample key {key!r}: in {seen[key]} and in {rel} (samples must "
                    "have unique keys; keys of one sample must be consecutive in a shard)"
                )
            seen[key] = rel
        write_index(index_path(path), idx)
        records.append(ShardRecord(rel.replace(os.sep, "/"), len(idx), size, h.hexdigest()))
        fields |= idx.fields()
        bar.update(1)
    bar.close()
    m = Manifest(
        shards=records,
        fields=sorted(fields),
        created_by={"tool": "feedpipe index", "feedpipe_version": __version__},
    )
    if manifest:
        write_wids_index(root, m)
        write_manifest(root, m)
    return m
