"""``feedpipe index``: adopt shards made by other tools (``webdataset.ShardWriter``, ``tar``).

Scans each shard once, writes its DALI v1.2 ``.idx`` beside it and a ``manifest.json`` for the
set, so the shards stream through feedpipe without re-sharding. Every shard is read and checked
before anything is written: a bad shard or a key clash leaves no index and no manifest behind.
A gzip shard (``a.tar.gz``, ``a.tgz``) is decompressed into a temporary file for its scan; its
index (``a.tar.gz.idx``) gives offsets in the plain tar inside, which readers decompress once into
the shard cache (:mod:`feedpipe.format._compression`). Members that make no sample (links that
are not hard links to an earlier member, hidden files, devices) are listed with their reasons in
the manifest's ``skipped``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from .._helpers.progress import progress
from .._redact import logger
from ..errors import (
    InputError,
    InterruptedWriteError,
    KeyClashError,
    OutputError,
    ShardFormatError,
    SourceNotFoundError,
)
from ._compression import readable, refuse_unreadable, unpacked
from ._index import ShardIndex, check_names, index_from_tar, index_path, write_index
from ._key_registry import KeyRegistry
from ._manifest import NAME, Manifest, ShardRecord, write_manifest, write_wids_index
from ._write_lock import WriteMarks, clear_marks, write_marks

log = logger("feedpipe.index")


@dataclass
class IndexResult:
    """What :func:`index_dataset` wrote: the dataset root, its manifest, the ``.idx`` files, and
    where the class names came from (``--classes``)."""

    root: str
    manifest: Manifest
    indexes: list[str] = field(default_factory=list)
    classes_from: str | None = None

    @property
    def left_out(self) -> list[dict[str, str]]:
        """Every member of the shards that makes no sample: ``{"shard", "path", "reason"}``
        (the manifest's ``skipped``)."""
        return self.manifest.skipped

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {"root": self.root, "manifest": os.path.join(self.root, NAME),
                "shards": [{"name": s.name, "samples": s.samples, "bytes": s.bytes,
                            "sha256": s.sha256, "index": i}
                           for s, i in zip(m.shards, self.indexes)],
                "total_samples": m.total_samples, "fields": m.fields, "classes": m.classes,
                "classes_from": self.classes_from, "left_out": self.left_out,
                "num_left_out": len(self.left_out)}


ShardPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def _paths(shards: ShardPaths) -> list[str]:
    """``shards`` as a list of path strings: one path (``str`` or ``os.PathLike``) or a list of
    them. A str is one path, never its characters."""
    if isinstance(shards, (str, os.PathLike)):
        return [os.fspath(shards)]
    if isinstance(shards, (bytes, bytearray)) or not isinstance(shards, Sequence):
        raise TypeError(f"shards={shards!r}: give the shard paths as a str, an os.PathLike, or a "
                        "list of them (files, globs or directories)")
    return [os.fspath(s) for s in shards]


def _expand(shards: ShardPaths) -> list[str]:
    out: list[str] = []
    for s in _paths(shards):
        if not any(c in s for c in "*?["):
            refuse_unreadable(s)
        if os.path.isdir(s):
            every = sorted(glob.glob(os.path.join(glob.escape(s), "*")))
            found = [p for p in every if p.endswith(".tar") or readable(p)]
            for p in every:  # never left out in silence: a shard feedpipe cannot read is refused
                refuse_unreadable(p)
            if not found:
                raise SourceNotFoundError(f"{s}: directory holds no .tar shards (nor .tar.gz, "
                                          ".tgz)")
        elif any(c in s for c in "*?["):
            found = sorted(glob.glob(s))
            if not found:
                raise SourceNotFoundError(f"{s}: no shard matches")
        elif not os.path.exists(s):
            raise SourceNotFoundError(f"{s}: shard not found; check the path (a directory "
                                      "indexes every .tar in it; quote a glob: 'shards/*.tar')")
        else:
            found = [s]
        for p in found:
            refuse_unreadable(p)
            if not os.path.isfile(p):
                raise SourceNotFoundError(
                    f"{p}: is {'a directory' if os.path.isdir(p) else 'not a regular file'}, not "
                    "a tar shard; move it out of the way or name the shards to index")
        out.extend(found)
    return out


_NAMES_FILE = re.compile(r"\.(txt|lst|list|names|csv|tsv|json|ya?ml)$", re.IGNORECASE)


def looks_like_a_file(spec: str) -> bool:
    """Whether a ``--classes`` value with no comma is meant as a file (pure): it holds a path
    separator or ends with a file suffix (``classes.txt``), which a class name hardly does.

    Example:
        >>> [looks_like_a_file(s) for s in ("classes.txt", "lists/names", "cat", "a.b,c")]
        [True, True, False, False]
    """
    return "," not in spec and ("/" in spec or os.sep in spec or bool(_NAMES_FILE.search(spec)))


def read_classes(spec: str | Sequence[str]) -> tuple[list[str], str]:
    """Class names from ``--classes``: a file with one name per line when ``spec`` names an
    existing file, else a comma-separated list; and a note of which it was.

    Raises:
        InputError: an empty, blank or repeated name; a value that looks like a file path
            (:func:`looks_like_a_file`) but names no file.
    """
    if not isinstance(spec, str):
        names, source = list(spec), "the list given"
    elif os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as f:
                names, source = [ln.strip() for ln in f.read().splitlines()], spec
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--classes {spec}: cannot read the file ({e}); give a UTF-8 text "
                             "file with one class name per line") from e
        while names and not names[-1]:
            names.pop()
    elif looks_like_a_file(spec):
        raise InputError(f"--classes {spec}: no such file; give the path of a file with one "
                         "class name per line, or the names inline as a comma-separated list "
                         "(--classes cat,dog)")
    else:
        names, source = [n.strip() for n in spec.split(",")], "the comma-separated list"
    if not names or not all(names):
        raise InputError(f"--classes from {source}: empty class name in {names!r} (give a comma "
                         "list, or a file with one name per line)")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(f"--classes from {source}: repeated class name(s) {dup}")
    return names, source


def _check_labels(tar: str, idx: ShardIndex, names: list[str], source: str | None,
                  path: str) -> None:
    """Refuse a ``cls`` value of the shard at ``path`` (its plain tar at ``tar``) that is not an
    index into ``names`` (the class names ``--classes`` records: what the ``cls`` values
    index)."""
    last = len(names) - 1
    try:
        with open(tar, "rb") as f:
            for i, key in enumerate(idx.keys):
                for m in range(idx.starts[i], idx.starts[i + 1]):
                    if idx.exts[m] != "cls":
                        continue
                    f.seek(idx.offsets[m])
                    text = f.read(idx.sizes[m]).decode("utf-8", "replace").strip()
                    try:
                        value: int | None = int(text)
                    except ValueError:
                        value = None
                    if value is None:
                        raise InputError(
                            f"{path}: sample {key!r}: cls {text!r} is not an integer, so not an "
                            f"index into the classes given (--classes from {source}); index the "
                            "shards without --classes, or store class indexes")
                    if not 0 <= value <= last:
                        raise InputError(
                            f"{path}: sample {key!r}: cls {value} is outside the {len(names)} "
                            f"classes given (0..{last}, --classes from {source}); give every "
                            "class name, in the order of the indexes")
    except OSError as e:
        raise InputError(f"{path}: cannot read the shard ({e.strerror or e})") from e


def _scan(path: str) -> tuple[ShardIndex, int, str]:
    """The index, size and sha256 of a shard (a gzip one's plain tar indexed)."""
    with _scanned(path) as (idx, rec, _):
        return idx, rec.bytes, rec.sha256 or ""


@contextmanager
def _scanned(path: str) -> Iterator[tuple[ShardIndex, ShardRecord, str]]:
    """The shard's index from its headers, its record (all but the name) and the plain tar to
    read members from: the shard itself, or a gzip shard's tar decompressed into a temporary
    file, removed afterwards (I/O errors named)."""
    try:
        with open(path, "rb") as f:
            if readable(path):
                with unpacked(f, path) as (tar, sha, size, plain):
                    idx = index_from_tar(tar, plain, path)
                    yield idx, ShardRecord("", len(idx), size, sha, plain), tar.name
                return
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256()
            while chunk := f.read(1 << 22):
                h.update(chunk)
            f.seek(0)
            idx = index_from_tar(f, size, path)
    except OSError as e:
        raise InputError(f"{path}: cannot read the shard ({e.strerror or e})") from e
    yield idx, ShardRecord("", len(idx), size, h.hexdigest()), path


def index_dataset(
    shards: ShardPaths,
    *,
    root: str | None = None,
    manifest: bool = True,
    classes: str | Sequence[str] | None = None,
    show_progress: bool | None = None,
    adopt_interrupted: bool = False,
) -> IndexResult:
    """:func:`index`, returning what was written (:class:`IndexResult`)."""
    paths = _expand(shards)
    if not paths:
        raise SourceNotFoundError("no shards given")
    names, source = read_classes(classes) if classes is not None else (None, None)
    root = os.path.abspath(root or os.path.dirname(os.path.abspath(paths[0])))
    interrupted = _interrupted_writes(root, paths, adopt_interrupted)
    records: list[ShardRecord] = []
    indexes: list[tuple[str, ShardIndex]] = []
    left_out: list[dict[str, str]] = []
    fields: set[str] = set()
    keys = KeyRegistry()
    by_rel: dict[str, ShardIndex] = {}
    bar = progress(len(paths), "index", "shard", show_progress)
    for path in paths:
        rel = os.path.relpath(os.path.abspath(path), root)
        if rel.startswith(".."):
            raise OutputError(f"{path}: shard lies outside the dataset root {root}; pass --root "
                              "with a directory above every shard")
        with _scanned(path) as (idx, rec, tar):
            if not len(idx):
                raise ShardFormatError(f"{path}: shard holds no samples")
            check_names(idx.names, path)
            if names is not None:
                _check_labels(tar, idx, names, source, path)
        keys.add(rel, idx.keys)
        by_rel[rel] = idx
        indexes.append((index_path(path), idx))
        rec.name = rel.replace(os.sep, "/")
        records.append(rec)
        left_out += [{"shard": rec.name, "path": x.name, "reason": x.reason}
                     for x in idx.left_out]
        fields |= idx.fields()
        bar.update(1)
    bar.close()
    clashes = keys.clashes(lambda rel: by_rel[rel].keys)
    if clashes:
        c = clashes[0]
        where = f"twice in {c.first}" if c.first == c.second else f"in {c.first} and in {c.second}"
        raise KeyClashError(
            f"duplicate sample key {c.key!r}: {where} ({len(clashes)} sample(s) repeat a key); "
            "keys must be unique in a dataset and a sample's members consecutive in its shard: "
            "leave a copied shard out, or rewrite the samples with distinct keys")
    m = Manifest(
        shards=records,
        fields=sorted(fields),
        classes=names,
        skipped=left_out,
        created_by={"tool": "feedpipe index", "feedpipe_version": __version__},
    )
    target = root
    try:  # every shard is sound: now write
        for target, idx in indexes:
            write_index(target, idx)
        if manifest:
            target = os.path.join(root, "wids.json")
            write_wids_index(root, m)
            target = os.path.join(root, NAME)
            write_manifest(root, m)
    except OSError as e:
        raise OutputError(e.errno, f"{target}: cannot write it ({e.strerror or e})") from e
    for where, marks in interrupted:  # adopted: what the dead writer left goes
        log.warning("%s; adopted as asked (--adopt-interrupted): the dataset holds only the "
                    "shards it committed", marks.what(where))
        clear_marks(where, marks)
    return IndexResult(root, m, [i for i, _ in indexes], source)


def describe(left: dict[str, str]) -> str:
    """One member left out, for a summary line: ``shard: member (reason)``."""
    return f"{left['shard']}: {left['path']} ({left['reason']})"


def _interrupted_writes(root: str, paths: list[str],
                        adopt: bool) -> list[tuple[str, WriteMarks]]:
    """The directories (``root`` and the shards') whose write was interrupted, with their
    marks; refused (:class:`InterruptedWriteError`) unless ``adopt``. A write under way is
    refused always."""
    found = []
    for where in sorted({root} | {os.path.dirname(os.path.abspath(p)) for p in paths}):
        marks = write_marks(where)
        if not marks:
            continue
        if marks.live or not adopt:
            raise InterruptedWriteError(
                marks.message(where) + ("" if marks.live else
                                        "; `feedpipe index` does not turn the shards of an "
                                        "unfinished write into a dataset unless asked: "
                                        "--adopt-interrupted (adopt_interrupted=True)"))
        found.append((where, marks))
    return found


def index(
    shards: ShardPaths,
    *,
    root: str | None = None,
    manifest: bool = True,
    classes: str | Sequence[str] | None = None,
    show_progress: bool | None = None,
    adopt_interrupted: bool = False,
) -> Manifest:
    """Write an ``.idx`` for every shard and a ``manifest.json`` in ``root``.

    Members are read as ``tar`` and :mod:`tarfile` read them: a hard link to an earlier member
    is a member with its target's bytes. Every member that makes no sample (a symbolic link, a
    hidden file such as ``.gitignore``, whose WebDataset key is empty, a hard link to nothing
    before it, a device) is listed with its shard and reason in the manifest's ``skipped`` and
    said in a log record (``feedpipe.index``); directories hold no bytes and are not listed.

    Args:
        shards: a shard path, glob or directory (all ``*.tar``, ``*.tar.gz`` and ``*.tgz``
            inside), as a ``str`` or ``os.PathLike``, or a list of them.
        root: where the manifest goes (default: the directory of the first shard); every shard
            must lie under it.
        manifest: also write ``manifest.json`` (and ``wids.json``).
        classes: class names for the manifest (what ``cls`` values index), as
            ``feedpipe shard --labels-from-dirs`` records them: a list, a comma-separated
            string, or the path of a file with one name per line. Every ``cls`` value of the
            shards must be an index into them.
        show_progress: a progress bar (default: when stderr is a terminal).
        adopt_interrupted: index the shards of a directory whose writer was killed or never
            closed (its lock file and temp files are still there): the dataset is then what
            the writer committed, and what it left (temp files, its lock) is removed. Without it
            such a directory is refused, since its samples after the last committed shard are
            lost.

    Raises:
        InterruptedWriteError: a directory's write was interrupted (without
            ``adopt_interrupted``) or is under way (names the writer's pid and its files).
        KeyClashError: the same key appears twice (in one shard or in two).
        InputError: a ``cls`` value that is not an index into ``classes`` (names the value, the
            key and the shard), or ``classes`` that looks like a file path but names no file.
        ShardFormatError: a shard is truncated or corrupted (names the shard and offset);
            CompressedShardError for shards compressed otherwise than with gzip (says how to
            convert).
        SourceNotFoundError: a shard is missing or is not a regular file.
        TypeError: ``shards`` is neither a path nor a list of paths.

    Example:
        >>> import io, os, tarfile, tempfile
        >>> d = tempfile.mkdtemp()
        >>> with tarfile.open(os.path.join(d, "a.tar"), "w", format=tarfile.USTAR_FORMAT) as t:
        ...     for name in ("s0.txt", "s1.txt"):
        ...         info = tarfile.TarInfo(name); info.size = 2
        ...         t.addfile(info, io.BytesIO(b"hi"))
        >>> m = index([d], show_progress=False)
        >>> m.total_samples, sorted(os.listdir(d))
        (2, ['a.idx', 'a.tar', 'manifest.json', 'wids.json'])
    """
    r = index_dataset(shards, root=root, manifest=manifest, classes=classes,
                      show_progress=show_progress, adopt_interrupted=adopt_interrupted)
    if r.left_out:  # (the command prints them in its summary)
        log.warning("%d member(s) of the shards make no sample and are left out, each listed "
                    "with its reason in the manifest's \"skipped\"%s: %s", len(r.left_out),
                    f" ({os.path.join(r.root, NAME)})" if manifest else "",
                    "; ".join(describe(x) for x in r.left_out))
    return r.manifest
