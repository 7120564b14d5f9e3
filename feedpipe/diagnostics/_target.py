"""What ``feedpipe probe`` was pointed at: a single file, a directory of (small) files, or a
shard dataset (a directory or URL holding ``manifest.json``), local or behind any fsspec URL.

Resolving a target is the probe's only look at the tree. It lists at most ``max_files`` files
and stops listing at a deadline, so a huge bucket costs no more than the deadline. Bad targets
fail here with one clear message: missing (:class:`SourceNotFoundError`), empty
(:class:`InputError`), permission denied (:class:`AccessDeniedError`) or unreachable
(:class:`RemoteError`).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from .._helpers.storage import is_local, local_path, split_query
from .._helpers.storage_probe import RawStore
from .._redact import cause
from ..errors import AccessDeniedError, InputError, RemoteError, SourceNotFoundError
from ..format._keys import split_source
from ..format._manifest import Manifest, dataset_root, join, load_manifest
from ._storage import FileSet

LARGE = 1 << 20  # a file this big or bigger is read sequentially
MAX_SEQ_FILES = 256  # files held open at once by the sequential and random phases
MAX_SEQ_BYTES = 64 << 30
MAX_SMALL_FILES = 20_000


@dataclass
class Target:
    """A resolved probe target."""

    url: str
    kind: str  # "file" | "directory" | "dataset"
    local: bool
    root: str  # the file, directory or dataset root (a local path or the URL)
    files: list[tuple[str, int]]  # the listing (possibly cut short), or the shards
    listing_complete: bool = True
    manifest: Manifest | None = None
    store: RawStore | None = None  # the store of a remote target
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s in self.files)

    @property
    def samples(self) -> int | None:
        """Samples in a dataset; for a directory, distinct stems (``a/1.jpg`` + ``a/1.json``)."""
        if self.manifest is not None:
            return self.manifest.total_samples
        if self.kind == "directory":
            return len({split_source(p)[0] for p, _ in self.files})
        return None

    @property
    def fields(self) -> list[str]:
        if self.manifest is not None:
            return sorted(self.manifest.fields)
        if self.kind == "directory":
            return sorted({split_source(p)[1] for p, _ in self.files} - {""})
        return []

    def sequential_set(self) -> FileSet | None:
        """The files the sequential sweep and random reads use: the file, the shards, or a
        directory's files of :data:`LARGE` bytes or more (at most 256 files, 64 GiB)."""
        pool = self.files if self.kind != "directory" else [f for f in self.files if f[1] >= LARGE]
        chosen: list[tuple[str, int]] = []
        total = 0
        for p, s in pool:
            if s <= 0 or len(chosen) >= MAX_SEQ_FILES or total >= MAX_SEQ_BYTES:
                continue
            chosen.append((p, s))
            total += s
        return self._fileset(chosen) if chosen else None

    def small_set(self) -> FileSet | None:
        """A directory's files in a fixed shuffled order (at most 20,000) for the small-file
        phase; ``None`` for a single file or a dataset."""
        if self.kind != "directory":
            return None
        pool = [f for f in self.files if f[1] > 0]
        random.Random(0).shuffle(pool)
        return self._fileset(pool[:MAX_SMALL_FILES]) if pool else None

    def _fileset(self, pairs: list[tuple[str, int]]) -> FileSet:
        return FileSet(tuple(p for p, _ in pairs), tuple(s for _, s in pairs), self.store)

    def describe(self) -> dict[str, Any]:
        n = self.samples
        return {
            "url": self.url, "kind": self.kind, "local": self.local, "root": self.root,
            "files": len(self.files), "bytes": self.total_bytes,
            "listing_complete": self.listing_complete, "samples": n,
            "mean_sample_bytes": self.total_bytes / n if n else None,
            "fields": self.fields,
            "shards": len(self.manifest.shards) if self.manifest is not None else None,
        }


def _walk(root: str, store: RawStore | None, seconds: float,
          max_files: int) -> tuple[list[tuple[str, int]], bool]:
    """``(full path, size)`` of the regular files below ``root``, in sorted order, until
    ``max_files`` or the deadline; and whether the listing is complete."""
    deadline = time.perf_counter() + seconds
    out: list[tuple[str, int]] = []
    if store is not None:
        for files in store.listing(root):
            out.extend(files)
            if len(out) >= max_files or time.perf_counter() >= deadline:
                return out[:max_files], False
        return out, True
    stack = [root]
    while stack:
        path = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except PermissionError as e:
            if path == root:
                raise AccessDeniedError(
                    f"{root}: permission denied: cannot list the directory") from e
            continue
        subdirs = []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.path)
                elif entry.is_file():
                    out.append((entry.path, entry.stat().st_size))
            except OSError:
                continue
        stack.extend(reversed(subdirs))
        if len(out) >= max_files or time.perf_counter() >= deadline:
            return out[:max_files], not stack and len(out) <= max_files
    return out, True


def _dataset(url: str, root: str, store: RawStore | None) -> Target:
    manifest = load_manifest(url)
    if manifest.total_samples == 0:
        raise InputError(f"{url}: the dataset's manifest lists no samples: nothing to probe")
    files = []
    for i, rec in enumerate(manifest.shards):
        path = join(root, rec.name)
        try:
            if store is None:
                size = os.stat(path).st_size
            elif i < 8:  # a few round trips to catch a wrong root; the manifest has the rest
                size = store.size(path)
            else:
                size = rec.bytes
        except FileNotFoundError as e:
            raise SourceNotFoundError(f"{path}: shard listed in manifest.json is missing") from e
        except PermissionError as e:
            raise AccessDeniedError(f"{path}: permission denied: the probe cannot read it") from e
        files.append((path, size))
    return Target(url, "dataset", store is None, root, files, manifest=manifest, store=store)


def resolve(url: str, *, seconds: float = 5.0, max_files: int = 100_000) -> Target:
    """Classify and list ``url`` (listing bounded by ``seconds`` and ``max_files``)."""
    if is_local(url):
        return _resolve_local(url, seconds, max_files)
    return _resolve_remote(url, seconds, max_files)


def _resolve_local(url: str, seconds: float, max_files: int) -> Target:
    path = local_path(url)
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise SourceNotFoundError(f"{url}: no such file or directory") from e
    except PermissionError as e:
        raise AccessDeniedError(f"{url}: permission denied") from e
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"{url}: permission denied: cannot list the directory")
        if os.path.exists(os.path.join(path, "manifest.json")):
            return _dataset(path, path.rstrip("/") or "/", None)
        files, complete = _walk(path, None, seconds, max_files)
        if not any(s > 0 for _, s in files):
            raise InputError(f"{url}: empty directory: no non-empty file to probe")
        t = Target(url, "directory", True, path, files, complete)
        if not complete:
            t.notes.append(f"listing stopped after {len(files)} files (time or count limit); "
                           "figures use those files")
        if any(p.endswith(".tar") for p, _ in files):
            t.notes.append("tar files but no manifest.json: run `feedpipe index` on the shards to "
                           "probe the pipeline stages")
        return t
    if path.endswith(".json") and os.path.basename(path) == "manifest.json":
        return _dataset(path, dataset_root(path), None)
    if st.st_size == 0:
        raise InputError(f"{url}: empty file: nothing to read")
    try:
        os.close(os.open(path, os.O_RDONLY))
    except PermissionError as e:
        raise AccessDeniedError(f"{url}: permission denied: the probe cannot read it") from e
    return Target(url, "file", True, path, [(path, st.st_size)])


def _has_manifest(store: RawStore, path: str) -> bool:
    """Whether ``path`` (a folder URL or prefix) holds ``manifest.json``, asked as FeedDataset
    asks: for the manifest itself. An HTTP server has no folders (a folder URL answers with a
    listing page, or not at all), so the folder is never asked about first."""
    try:
        return store.exists(join(path, "manifest.json"))
    except Exception:  # noqa: BLE001 - unreachable or refused: store.info below names it
        return False


def _resolve_remote(url: str, seconds: float, max_files: int) -> Target:
    store, path = RawStore.of(url)
    if not split_query(path)[0].endswith(".json") and _has_manifest(store, path):
        t = _dataset(url, path.rstrip("/"), store)
        t.url = url
        return t
    try:
        info = store.info(path)
    except FileNotFoundError as e:
        why = e.__cause__ or e.__context__
        if why is not None and "connect" in type(why).__name__.lower():
            # fsspec's HTTP backend reports a refused connection as FileNotFoundError
            raise RemoteError(f"{url}: cannot reach it ({type(why).__name__}: {why})") \
                from cause(e)
        raise SourceNotFoundError(f"{url}: no such object or prefix") from cause(e)
    except PermissionError as e:
        raise AccessDeniedError(f"{url}: permission denied") from cause(e)
    except Exception as e:
        raise RemoteError(f"{url}: cannot reach it ({type(e).__name__}: {e})") from cause(e)
    if info.get("type") == "directory":
        files, complete = _walk(path, store, seconds, max_files)
        if not any(s > 0 for _, s in files):
            raise InputError(f"{url}: empty: no non-empty object to probe")
        return Target(url, "directory", False, path, files, complete, store=store)
    if path.endswith("manifest.json"):
        return _dataset(url, dataset_root(path), store)
    size = int(info.get("size") or 0)
    if size == 0:
        raise InputError(f"{url}: empty object: nothing to read")
    return Target(url, "file", False, path, [(path, size)], store=store)
