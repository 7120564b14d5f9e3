"""``feedpipe.ShardWriter``: write samples that live in memory as a feedpipe dataset.

The output is what ``feedpipe shard`` writes:

- tar shards (ustar/GNU headers, no PAX), committed atomically: a hidden temp file, hashed as it
  is written, renamed once whole;
- a DALI v1.2 ``.idx`` beside each shard;
- ``wids.json``, and ``manifest.json`` last;
- for token documents (every sample only a ``tokens.npy`` 1-D integer array, one dtype), each
  shard's ``PREFIX-000000.lengths.npy`` and the manifest's ``created_by.tokens``, as
  ``feedpipe shard --tokenizer`` writes them, so that :class:`~feedpipe.Packed` plans rows
  from the lengths without reading a header (:class:`_TokenLengths`).

Keys follow the same rule. A key is a relative path whose last component may hold dots. It is
encoded with :func:`~feedpipe.format._keys.encode_key`, so that the WebDataset first-dot rule
keeps it one sample (``decode_key`` gives it back). Shards are cut by
:func:`~feedpipe.convert._shard_plan.shard_full`, the rule of ``feedpipe shard``. Field values
become bytes by :mod:`~feedpipe.convert._field_encoding` (no pickle).

Parallel writing: each process (a pool worker, a Dask task) writes one *part* with
``ShardWriter(out, part=(i, n))`` into the same ``out``. Then :func:`feedpipe.merge` writes the
manifest, exactly as for ``feedpipe shard --part I/N`` (or ``merge=True`` on the writers: the
last one to finish merges). Keys must then be unique across parts, since each writer sees only
its own: the merge refuses a key found in two parts, naming it and both shards (the parts stay
as they are, to be rewritten).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .. import __version__
from ..errors import InputError, KeyClashError
from ..format._index import group_members
from ..format._keys import valid_extension
from ..format._manifest import Manifest, ShardRecord
from ..format._tar import BLOCK
from ._options import DEFAULT_MAX_BYTES
from ._output_dir import (
    clean_temps,
    prepare_out,
    take_lock,
    unlink_quiet,
    write_dataset_manifest,
)
from ._parts import PartInfo, parse_part, part_prefix, part_tag
from ._sample_encoder import SampleEncoder
from ._shard_plan import member_size, shard_full
from ._token_writer import FIELD, NPY_HEADER, lengths_name, save_lengths
from ._writer import commit, hidden, output_error, seal, write_members

TOOL = "feedpipe.ShardWriter"
_PART_STATE = ".feedpipe-writer-part"  # (a part writer's temps; it keeps no resume state)


def _checked_options(max_bytes: int | str, max_samples: int | None, prefix: str,
                     encoders: Mapping[str, Any] | None) -> int:
    """``max_bytes`` in bytes, once the writer's size limits, shard name prefix and encoder
    field names are checked (a :class:`ValueError` saying which is wrong)."""
    from .._helpers.sizes import parse_size

    limit = parse_size(max_bytes)
    if limit <= 2 * BLOCK:
        raise ValueError(f"max_bytes must be more than {2 * BLOCK} bytes, not {max_bytes}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1, not {max_samples}")
    if "/" in prefix or not prefix:
        raise ValueError(f"prefix must be a non-empty file name without '/', not {prefix!r}")
    bad = [e for e in (encoders or {}) if not valid_extension(e)]
    if bad:
        raise ValueError(f"encoders: {bad[0]!r} cannot be a field name")
    return limit


def _class_index(classes: list[str] | None) -> dict[str, int]:
    """Each class name's number (refused when a name is given twice)."""
    index = {c: i for i, c in enumerate(classes or ())}
    if classes is not None and len(index) != len(classes):
        dup = sorted({c for c in classes if classes.count(c) > 1})
        raise ValueError(f"classes: repeated class name(s) {dup}; give each class once")
    return index


class _TokenLengths:
    """The token counts of a writer's documents, while every sample so far is a token document:
    a lone ``tokens.npy`` member of a short name (one tar header) holding a 1-D integer array
    of the writer's one dtype in a 128-byte ``.npy`` header, the layout a lengths file describes
    (``shards/README.md``). One other sample and the writer writes no lengths file at all."""

    def __init__(self, encoders: Mapping[str, Any]) -> None:
        self.ok = FIELD not in encoders  # (an encoder's bytes need not be np.save's)
        self.dtype: Any = None
        self.shard: list[int] = []  # the counts of the shard being written

    def add(self, key: str, sample: Mapping[str, Any], blobs: list[tuple[str, bytes]]) -> None:
        if not self.ok:
            return
        value: Any = sample.get(FIELD)
        if (len(blobs) != 1 or blobs[0][0] != FIELD or type(value).__module__ != "numpy"
                or getattr(value, "ndim", 0) != 1 or value.dtype.kind not in "iu"
                or len(blobs[0][1]) != NPY_HEADER + value.nbytes
                or member_size(f"{key}.{FIELD}", len(blobs[0][1]))
                != BLOCK + -(-len(blobs[0][1]) // BLOCK) * BLOCK
                or (self.dtype is not None and value.dtype != self.dtype)):
            self.ok = False
            return
        self.dtype = value.dtype
        self.shard.append(len(value))

    def manifest_entry(self) -> dict[str, Any]:
        return {"field": FIELD, "dtype": str(self.dtype.newbyteorder("=")), "eos_id": None,
                "tokenizer": None, "lengths": "<shard stem>.lengths.npy"}


class ShardWriter:
    """Write samples (dicts) as a feedpipe dataset in ``out``; a context manager.

    Args:
        out: a local directory, missing or empty (for a part: holding no files of this part).
        max_samples: at most this many samples per shard.
        max_bytes: target shard size in bytes (or a size such as ``"256MB"``); a shard exceeds
            it only to hold one sample larger than it.
        classes: class names, recorded in the manifest (what the ``cls`` values index). A
            ``cls`` given as a name of the list is stored as its index; a name not in the list,
            or an index out of range, is refused. With or without them, a ``cls`` number is
            stored as an integer (``7.0`` and ``numpy.int64(7)`` as ``7``); a non-integral one
            is refused.
        prefix: shard names are ``PREFIX-000000.tar``.
        encoders: per field, a function turning its value into bytes (for values other than
            ``bytes``, ``str``, numbers and NumPy arrays, which need none), e.g.
            ``{"json": lambda v: json.dumps(v).encode()}``.
        part: ``(i, n)``: write part ``i`` of ``n`` (each writer its own shard names; a
            :func:`~feedpipe.merge` joins them).
        merge: with ``part``: the writer that finds all parts finished writes the manifest.
        provenance: entries for the manifest's ``created_by`` (what the samples were made from).

    Example:
        >>> import tempfile, os
        >>> out = os.path.join(tempfile.mkdtemp(), "ds")
        >>> with ShardWriter(out, max_samples=2, classes=["cat", "dog"]) as w:
        ...     for i in range(3):
        ...         _ = w.write({"__key__": f"{i:04d}", "jpg": b"...", "cls": i % 2,
        ...                      "txt": "a cat"})
        >>> sorted(n for n in os.listdir(out) if n.endswith((".tar", ".json")))
        ['data-000000.tar', 'data-000001.tar', 'manifest.json', 'wids.json']
    """

    def __init__(self, out: str, *, max_samples: int | None = None,
                 max_bytes: int | str = DEFAULT_MAX_BYTES, classes: Sequence[str] | None = None,
                 prefix: str = "data", encoders: Mapping[str, Callable[[Any], Any]] | None = None,
                 part: tuple[int, int] | str | None = None, merge: bool = False,
                 provenance: Mapping[str, Any] | None = None) -> None:
        self.max_bytes = _checked_options(max_bytes, max_samples, prefix, encoders)
        self.max_samples = max_samples
        self.classes = None if classes is None else [str(c) for c in classes]
        self._class_index = _class_index(self.classes)
        self.prefix = prefix
        self.encoders = dict(encoders or {})
        self._encoder = SampleEncoder(self.classes, self.encoders)
        self.part = None if part is None else parse_part(part)
        self.merge = merge
        self.provenance = dict(provenance or {})
        self.skipped: list[dict[str, str]] = []
        own = None if self.part is None else part_prefix(prefix, *self.part)
        self._lock = take_lock(out, None if self.part is None else part_tag(*self.part), TOOL)
        try:
            self.out = prepare_out(out, False, own, tool="feedpipe.ShardWriter",
                                   hint="write into an empty directory")
            # what a writer of this name that died left (the lock says none is alive)
            if own is None:
                clean_temps(self.out, prefix)
            else:
                clean_temps(self.out, own, _PART_STATE)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        self._names_prefix = own or prefix
        self._keys: dict[str, int] = {}  # key -> the number of the write that stored it
        self._records: list[ShardRecord] = []
        self._fields: set[str] = set()
        self._file: Any = None
        self._tmp = ""
        self._hash: Any = None
        self._members: list[tuple[str, int, int]] = []
        self._pos = self._count = 0
        self._tokens = _TokenLengths(self.encoders)
        self._lengths_files: list[str] = []
        self._closed = False
        self.manifest: Manifest | None = None

    # ------------------------------------------------------------------ writing

    def write(self, sample: Mapping[str, Any]) -> str:
        """Add one sample: ``__key__`` (a str) and one entry per field (the extension).

        Other ``__dunder__`` entries (``__shard__``, ``__index__``, as a reader yields them) are
        not stored, nor are fields whose value is ``None``. Returns the key as stored
        (encoded)."""
        if self._closed:
            raise ValueError("this ShardWriter is closed")
        n = len(self._keys)
        key, blobs = self._encoder.encode(sample, n)
        first = self._keys.get(key)
        if first is not None:
            raise KeyClashError(f"duplicate sample key {key!r}: sample #{n} and sample #{first} "
                                "both have it; give every sample its own '__key__'")
        size = sum(member_size(f"{key}.{ext}", len(data)) for ext, data in blobs)
        if shard_full(self._pos, self._count, size, self.max_bytes, self.max_samples):
            self._end_shard()
        if self._file is None:
            self._begin_shard()
        try:
            self._pos, _ = write_members(self._write, key, blobs, self._pos, self._members)
        except OSError as e:
            raise output_error(e, os.path.join(self.out, self._name())) from e
        self._keys[key] = n
        self._tokens.add(key, sample, blobs)
        self._count += 1
        self._fields.update(ext for ext, _ in blobs)
        return key

    def _write(self, data: bytes) -> None:
        self._hash.update(data)
        self._file.write(data)

    def _name(self) -> str:
        return f"{self._names_prefix}-{len(self._records):06d}.tar"

    def _begin_shard(self) -> None:
        self._tmp = hidden(self.out, self._name(), f".tmp-{os.getpid()}")
        try:
            self._file = open(self._tmp, "wb", buffering=1 << 20)  # noqa: SIM115 (kept open)
        except OSError as e:
            raise output_error(e, os.path.join(self.out, self._name())) from e
        self._hash = hashlib.sha256()
        self._members, self._pos, self._count = [], 0, 0
        self._tokens.shard = []

    def _end_shard(self) -> None:
        name = self._name()
        try:
            total = seal(self._file, self._hash)
            self._file.close()
            self._file = None
            rec = commit(self.out, name, self._tmp, total, self._hash.hexdigest(),
                         group_members(self._members), [], keep_record=False)
        except OSError as e:
            raise output_error(e, os.path.join(self.out, name)) from e
        self._records.append(rec)
        if self._tokens.ok:
            self._lengths_files.append(lengths_name(name))
            save_lengths(self.out, name, self._tokens.shard)

    # ------------------------------------------------------------------ closing

    def close(self) -> Manifest:
        """Commit the last shard and write the manifest (for a part: its part record, and with
        ``merge`` the manifest once every part is done). Returns the dataset's (or the part's)
        manifest."""
        if self._closed:
            if self.manifest is None:
                raise ValueError("this ShardWriter was aborted: nothing to close")
            return self.manifest
        try:
            if self._file is not None:
                self._end_shard()
            if not self._records and self.part is None:
                raise InputError(f"{self.out}: no sample was written; nothing to save")
            if not self._tokens.ok:  # (a later sample was not a token document of the dtype)
                for n in self._lengths_files:
                    unlink_quiet(os.path.join(self.out, n))
            m = Manifest(shards=list(self._records), fields=sorted(self._fields),
                         classes=self.classes, skipped=list(self.skipped),
                         created_by=self._created_by())
            if self.part is None:
                write_dataset_manifest(self.out, m)
            else:
                self._commit_part(m, *self.part)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self.manifest = m
        try:
            if self.part is not None and self.merge:  # (the part stands whatever the merge says)
                from ._merge import merge_if_complete

                merge_if_complete(self.out, self.part[1])
        finally:
            self._release()
        return m

    def skip(self, what: str, reason: str) -> None:
        """Record an input left out (listed in the manifest's ``skipped``, as ``feedpipe shard
        --on-error skip`` lists bad files)."""
        self.skipped.append({"path": what, "reason": reason})

    def _created_by(self) -> dict[str, Any]:
        tokens = {"tokens": self._tokens.manifest_entry()} if self._tokens.ok and \
            self._tokens.dtype is not None else {}
        return {"tool": TOOL, "feedpipe_version": __version__,
                "options": {"max_bytes": self.max_bytes, "max_samples": self.max_samples,
                            "prefix": self.prefix, "encoders": sorted(self.encoders)},
                **tokens, **self.provenance}

    def _commit_part(self, m: Manifest, index: int, count: int) -> None:
        from ._merge import write_part_record

        # what every part of one dataset shares (a merge refuses parts that differ)
        same = json.dumps({"tool": TOOL, "options": m.created_by["options"],
                           "classes": self.classes}, sort_keys=True)
        info = PartInfo(index, count, len(self._keys), hashlib.sha256(same.encode()).hexdigest())
        m.created_by["part"] = info.label
        try:
            write_part_record(self.out, info, m, 0)
        except OSError as e:
            raise output_error(e, self.out) from e

    def abort(self) -> None:
        """Stop without a manifest: remove the shard being written and every shard and index
        this writer committed (there is no resuming a writer)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp:
            unlink_quiet(self._tmp)
        for rec in self._records:
            unlink_quiet(os.path.join(self.out, rec.name))
            unlink_quiet(os.path.join(self.out, rec.name[:-4] + ".idx"))
            unlink_quiet(os.path.join(self.out, rec.name[:-4] + ".sizes.npy"))
            unlink_quiet(os.path.join(self.out, lengths_name(rec.name)))
            unlink_quiet(os.path.join(self.out, rec.name[:-4] + ".frames.npy"))
        self._records = []
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __len__(self) -> int:
        """Samples written so far."""
        return len(self._keys)


def write_samples(samples: Iterable[Mapping[str, Any]], out: str, **options: Any) -> Manifest:
    """Write ``samples`` with one :class:`ShardWriter`.

    A top-level function, so that a process pool or a Dask task can run it on a share of the
    samples.

    Args:
        samples: dicts, each with a ``__key__`` and its fields (see :meth:`ShardWriter.write`).
        out: the output directory, as for :class:`ShardWriter`.
        **options: the other arguments of :class:`ShardWriter` (``max_samples=``, ``part=``,
            ``merge=``, ...).

    Returns:
        The dataset's manifest, or with ``part=`` the part's.

    Example:
        >>> import tempfile, os
        >>> out = os.path.join(tempfile.mkdtemp(), "ds")
        >>> for i in range(2):  # e.g. pool.submit(write_samples, share, out, part=(i, 2))
        ...     _ = write_samples([{"__key__": f"{i}-{j}", "txt": "x"} for j in range(3)], out,
        ...                       part=(i, 2), merge=True)
        >>> from feedpipe import load_manifest
        >>> load_manifest(out).total_samples
        6
    """
    with ShardWriter(out, **options) as w:
        for sample in samples:
            w.write(sample)
    return w.close()  # (closed on leaving the block: this returns its manifest)
