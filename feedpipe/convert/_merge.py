"""``feedpipe merge OUT``: one manifest for the parts of a ``feedpipe shard --part I/N`` run.

A part that finishes writes its *part record* ``OUT/.feedpipe-part-IIIII-of-NNNNN.json``
atomically, after all its shards are committed: the record is the part's commit point. It holds
the part's shard records (names, sample counts, sizes, sha256), fields, classes, skipped inputs
and the dataset fingerprint (:mod:`~feedpipe.convert._parts`).

:func:`merge` checks that all N records exist and agree on the fingerprint, that every shard
they name is on disk with its recorded size, and that no sample key is in two shards (each
writer of parts sees only its own keys). Then it writes ``wids.json`` and ``manifest.json``
(atomically, the manifest last), listing the parts' shards in part order. The ``.idx`` files
already sit beside the shards. Merging twice, or by two processes at once, writes the same bytes.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .. import __version__
from .._helpers.storage import is_local, local_path
from ..errors import PartsError, ShardFormatError
from ..format._index import index_from_tar, index_path, parse_index
from ..format._key_registry import KeyRegistry
from ..format._manifest import Manifest, ShardRecord, write_manifest, write_wids_index
from ._output_dir import STATE_NAME, unlink_quiet, write_dataset_manifest
from ._parts import PartInfo, part_tag
from ._writer import output_error

_RECORD = re.compile(r"^\.feedpipe-part-(\d{5})-of-(\d{5})\.json$")


def record_name(index: int, count: int) -> str:
    """The part record's file name: ``.feedpipe-part-00002-of-00003.json``."""
    return f".feedpipe-part-{index:05d}-of-{count:05d}.json"


def state_name(index: int, count: int) -> str:
    """The file a running part keeps in OUT (it exists from the start until the part finished)."""
    return f".feedpipe-shard-state-{part_tag(index, count)}.json"


def write_part_record(out: str, info: PartInfo, manifest: Manifest, listing_skipped: int) -> str:
    """Commit a finished part: write its record atomically; return the record's path.

    ``listing_skipped``: how many of ``manifest.skipped`` come first from the listing (every part
    lists the whole source, so these are the same in every part and a merge keeps them once).
    """
    doc = {
        "format": "feedpipe-part",
        "version": 1,
        "part": info.index,
        "parts": info.count,
        "dataset_fingerprint": info.fingerprint,
        "total_samples": info.total_samples,
        "listing_skipped": listing_skipped,
        "manifest": json.loads(manifest.to_json()),
    }
    path = os.path.join(out, record_name(info.index, info.count))
    tmp = path + f".tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _records(out: str) -> dict[tuple[int, int], str]:
    found = {}
    for name in os.listdir(out):
        m = _RECORD.match(name)
        if m:
            found[int(m.group(1)), int(m.group(2))] = os.path.join(out, name)
    return found


def _load(path: str, label: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        Manifest.from_json(json.dumps(doc["manifest"]), where=path)
        doc["dataset_fingerprint"], doc["listing_skipped"], doc["total_samples"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PartsError(f"part {label}: its record {path} is unreadable or damaged ({e}); rerun "
                         f"the part with --resume") from e
    return doc


def _keys(out: str, name: str, label: str) -> list[str]:
    """The sample keys of the committed shard ``name``: from its ``.idx`` (written before the
    shard was renamed into place), else from its tar headers."""
    path = os.path.join(out, name)
    try:
        with open(index_path(path), "rb") as f:
            idx = parse_index(f.read(), index_path(path))
        if idx.named:
            return idx.keys
    except (OSError, ShardFormatError):
        pass
    try:
        with open(path, "rb") as f:
            return index_from_tar(f, os.path.getsize(path), path).keys
    except (OSError, ShardFormatError) as e:
        raise PartsError(f"part {label}: shard {path} cannot be read ({e}); rerun the part with "
                         "--resume") from e


def _why_missing(out: str, index: int, count: int) -> str:
    tag = part_tag(index, count)
    shards = [n for n in os.listdir(out) if n.endswith(".tar") and f"-{tag}-" in n]
    if os.path.exists(os.path.join(out, state_name(index, count))) or shards:
        return (f"part {index}/{count} is incomplete ({len(shards)} shard(s) committed, no part "
                f"record): it is still running or was interrupted; rerun it with --resume")
    return f"part {index}/{count} is missing (no {record_name(index, count)}): it never ran here"


def _part_count(out: str, found: dict[tuple[int, int], str], parts: int | None) -> int:
    """The N of the parts in ``out`` (``parts`` where given): one, and at least one part."""
    counts = sorted({n for _, n in found})
    if parts is not None:
        counts = [parts]
    if not counts:
        raise PartsError(f"{out}: no finished parts (no .feedpipe-part-*.json records); run "
                         "`feedpipe shard SRC OUT --part I/N` for I = 0..N-1 first")
    if len(counts) > 1:
        raise PartsError(f"{out}: holds parts of conversions into different numbers of parts "
                         f"(N = {', '.join(map(str, counts))}); merge one with --parts N or use "
                         "one directory per conversion")
    return counts[0]


def _finished_parts(out: str, found: dict[tuple[int, int], str], n: int
                    ) -> list[dict[str, Any]]:
    """The records of parts 0..N-1, every one finished and made from the same inputs and
    options."""
    problems = [_why_missing(out, i, n) for i in range(n) if (i, n) not in found]
    if problems:
        raise PartsError(f"cannot merge {out}: " + "; ".join(problems))
    docs = [_load(found[i, n], f"{i}/{n}") for i in range(n)]
    first = docs[0]
    for i, doc in enumerate(docs):
        if doc["dataset_fingerprint"] != first["dataset_fingerprint"]:
            raise PartsError(f"cannot merge {out}: part {i}/{n} was made from other inputs or "
                             f"options than part 0/{n}; rerun it with the same SRC and options")
    return docs


def merge(out: str, *, parts: int | None = None) -> Manifest:
    """Write one ``manifest.json`` (and ``wids.json``) for the finished parts in ``out``.

    Args:
        out: the directory every ``feedpipe shard SRC OUT --part I/N`` wrote into.
        parts: the expected N (default: read from the part records).

    Returns:
        The merged :class:`feedpipe.Manifest`.

    Raises:
        PartsError: naming every part that is missing or unfinished, a part made from other
            inputs or options, a part whose shard is missing or has the wrong size, or a sample
            key found in two shards (naming the key and both shards).

    Example:
        >>> import tempfile, pathlib
        >>> from feedpipe import shard
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> (d / "src").mkdir()
        >>> _ = (d / "src" / "a.txt").write_text("1"), (d / "src" / "b.txt").write_text("2")
        >>> for i in range(2):
        ...     _ = shard(str(d / "src"), str(d / "out"), part=(i, 2), workers=1)
        >>> merge(str(d / "out")).total_samples
        2
    """
    if not is_local(out) or not os.path.isdir(local_path(out)):
        raise PartsError(f"{out}: not a local directory holding `feedpipe shard --part` output")
    out = local_path(out)
    found = _records(out)
    n = _part_count(out, found, parts)
    docs = _finished_parts(out, found, n)
    first = docs[0]
    shards: list[ShardRecord] = []
    fields: set[str] = set()
    skipped = list(first["manifest"]["skipped"][: first["listing_skipped"]])
    keys = KeyRegistry()
    part_of: dict[str, int] = {}
    for i, doc in enumerate(docs):
        m = Manifest.from_json(json.dumps(doc["manifest"]))
        for rec in m.shards:
            path = os.path.join(out, rec.name)
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != rec.bytes:
                got = "missing" if size is None else f"{size} bytes, {rec.bytes} recorded"
                raise PartsError(f"cannot merge {out}: part {i}/{n}: shard {rec.name} is {got}; "
                                 "rerun the part with --resume")
            keys.add(rec.name, _keys(out, rec.name, f"{i}/{n}"))
            part_of[rec.name] = i
        shards += m.shards
        fields |= set(m.fields)
        skipped += m.skipped[doc["listing_skipped"]:]
    clashes = keys.clashes(lambda name: _keys(out, name, f"{part_of[name]}/{n}"))
    if clashes:
        c = clashes[0]
        raise PartsError(
            f"cannot merge {out}: {len(clashes)} sample key(s) written twice, e.g. {c.key!r} in "
            f"{c.first} (part {part_of[c.first]}/{n}) and {c.second} (part "
            f"{part_of[c.second]}/{n}); keys must be unique in a dataset and each writer sees "
            "only its own: rewrite the parts with distinct keys (e.g. prefixed with the part "
            "number), then merge")
    created = dict(first["manifest"]["created_by"])
    tool = created.get("tool", "feedpipe shard")
    created.update({"tool": f"{tool} --part + feedpipe merge" if tool == "feedpipe shard"
                    else f"{tool} parts + feedpipe merge",
                    "feedpipe_version": __version__, "parts": n,
                    "dataset_fingerprint": first["dataset_fingerprint"]})
    created.pop("plan_fingerprint", None)
    created.pop("part", None)
    # each part names its own samples of several images (feedpipe.convert._shard)
    several = sorted((e for doc in docs
                      for e in doc["manifest"]["created_by"].get("several_images", [])),
                     key=lambda e: str(e.get("key")) if isinstance(e, dict) else "")
    created.pop("several_images", None)
    if several:
        created["several_images"] = several
    merged = Manifest(shards=shards, fields=sorted(fields),
                      classes=first["manifest"]["classes"], skipped=skipped, created_by=created)
    write_wids_index(out, merged)
    write_manifest(out, merged)
    return merged


def merge_if_complete(out: str, count: int) -> Manifest | None:
    """Merge when all ``count`` part records are in ``out`` (the last part to finish does it);
    else return None."""
    found = _records(out)
    if all((i, count) in found for i in range(count)):
        return merge(out, parts=count)
    return None


def commit_manifest(out: str, m: Manifest, info: PartInfo | None, names: list[str], state: str,
                    *, merge: bool, skipped: int) -> bool:
    """A conversion's commit: the dataset's manifest and the shard records only a resume needed
    removed; or, for a part (``info``), its part record (with ``skipped`` inputs counted), its
    state file removed (its shard records stay: ``--resume`` reuses them), and with ``merge``
    the dataset's manifest once every part is in. Whether this run merged the parts."""
    if info is None:
        write_dataset_manifest(out, m)
        for name in names:
            unlink_quiet(os.path.join(out, f".{name}.record.json"))
        unlink_quiet(os.path.join(out, STATE_NAME))
        return False
    m.created_by["part"] = info.label
    try:
        write_part_record(out, info, m, skipped)
    except OSError as e:
        raise output_error(e, out) from e
    unlink_quiet(os.path.join(out, state))
    return merge and merge_if_complete(out, info.count) is not None
