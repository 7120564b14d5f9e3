"""``manifest.json``: what a shard dataset holds, at its root.

Format version 1::

    {"format": "feedpipe-manifest", "version": 1,
     "shards": [{"name": "data-000000.tar", "samples": 1000, "bytes": 123, "sha256": "..."},
                {"name": "more.tar.gz", ..., "tar_bytes": 456}],
     "total_samples": 1000, "fields": ["cls", "jpg"], "classes": [...] | null,
     "skipped": [{"path": "...", "reason": "..."}], "num_skipped": 0,
     "sidecars": [{"name": "data-000000.frames.npy", "shard": "data-000000.tar", ...}],
     "created_by": {"tool": "feedpipe shard", "feedpipe_version": "...", "options": {...}}}

A gzip shard (``.tar.gz``, ``.tgz``) records its own size and hash in ``bytes`` and ``sha256``,
and the size of the plain tar inside in ``tar_bytes`` (the offsets of its index are offsets in
that tar; see :mod:`feedpipe.format._compression`). Only such a shard has ``tar_bytes``.

``sidecars`` (present where there are any) lists the arrays beside the shards with their size and
hash (:mod:`feedpipe.format._sidecar_list`); :func:`write_manifest` lists those it finds.

Loading is the only I/O here (through fsspec, so any URL works).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .._redact import cause, logger, redact_doc
from ..errors import ManifestError, SourceNotFoundError
from ._compression import compressed_error, compressed_suffix, readable
from ._sidecar_list import check_sidecars, list_sidecars

log = logger("feedpipe.format")

FORMAT = "feedpipe-manifest"
VERSION = 1
NAME = "manifest.json"


@dataclass
class ShardRecord:
    """One shard of a dataset as its manifest lists it (an item of :attr:`Manifest.shards`).

    Attributes:
        name: the shard's file, relative to the dataset root.
        samples: samples it holds.
        bytes: its size in bytes.
        sha256: its SHA-256 digest, where the manifest gives one.
        tar_bytes: a gzip shard's plain tar size (``None`` for a plain tar).
    """

    name: str  # relative to the dataset root
    samples: int
    bytes: int
    sha256: str | None = None
    tar_bytes: int | None = None  # a gzip shard's plain tar size

    @property
    def tar_size(self) -> int:
        """The size of the plain tar a reader maps, ``tar_bytes`` for a gzip shard (else
        ``bytes``)."""
        return self.bytes if self.tar_bytes is None else self.tar_bytes

    def to_dict(self) -> dict[str, Any]:
        """The record as ``manifest.json`` lists it (``tar_bytes`` only where there is one)."""
        d = asdict(self)
        if self.tar_bytes is None:
            del d["tar_bytes"]
        return d


@dataclass
class Manifest:
    """What a shard dataset holds: ``manifest.json`` at its root (see the module docstring).

    Attributes:
        shards: the shards, in the order their samples are numbered.
        fields: the field names (extensions) samples carry.
        classes: the class names ``cls`` values index, when the dataset has labels.
        skipped: the source files a conversion left out, each with its reason.
        created_by: the tool, its version and options.
        sidecars: the files beside the shards (``name``, ``shard``, ``bytes``, ``sha256``).

    Example:
        >>> m = Manifest([ShardRecord("data-000000.tar", 3, 10240)], fields=["jpg"])
        >>> m.total_samples, Manifest.from_json(m.to_json()) == m
        (3, True)
    """

    shards: list[ShardRecord]
    fields: list[str] = field(default_factory=list)
    classes: list[str] | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    created_by: dict[str, Any] = field(default_factory=dict)
    sidecars: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total_samples(self) -> int:
        """Samples over all shards."""
        return sum(s.samples for s in self.shards)

    def to_json(self) -> str:
        """The text of ``manifest.json``."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "shards": [s.to_dict() for s in self.shards],
            "total_samples": self.total_samples,
            "fields": sorted(self.fields),
            "classes": self.classes,
            # how it was made names the source, which may be a URL with a token: the file keeps
            # no secret (a manifest is shared with the dataset)
            "skipped": redact_doc(self.skipped),
            "num_skipped": len(self.skipped),
            "created_by": redact_doc(self.created_by),
        }
        if self.sidecars:  # a dataset without sidecars keeps the manifest it always had
            doc["sidecars"] = self.sidecars
        return json.dumps(doc, indent=1, ensure_ascii=False, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = NAME) -> Manifest:
        """Parse and check a manifest's text.

        Raises:
            ManifestError: not JSON, not a feedpipe manifest, a newer format, a field of the
                wrong type or value, a shard listed twice (names ``where`` and the field).
            CompressedShardError: a shard is a compressed tar other than gzip.
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{where}: not valid JSON ({e})") from cause(e)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a feedpipe manifest (no \"format\": \"{FORMAT}\")")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ManifestError(f"{where}: \"version\" must be a positive integer, not "
                                f"{version!r}")
        if version > VERSION:
            raise ManifestError(
                f"{where}: manifest format version {version!r} is newer than this feedpipe "
                f"understands ({VERSION}); upgrade feedpipe (pip install -U feedpipe)"
            )
        m = cls(
            shards=_shard_list(doc.get("shards"), where),
            fields=_strings(doc, "fields", where, []),
            classes=_strings(doc, "classes", where, None),
            skipped=_typed(doc, "skipped", list, where, "a list of objects"),
            created_by=_typed(doc, "created_by", dict, where, "an object"),
            sidecars=doc.get("sidecars") or [],  # none listed before sidecars were
        )
        bad = check_sidecars(m.sidecars)
        if bad:
            raise _edited(where, bad)
        if not all(isinstance(x, dict) for x in m.skipped):
            raise _edited(where, "\"skipped\" must be a list of objects")
        total = doc.get("total_samples", m.total_samples)
        if not _is_count(total):
            raise _edited(where, f"\"total_samples\" must be a non-negative integer, not "
                                 f"{total!r}")
        if total != m.total_samples:
            raise _edited(where, f"total_samples {total} does not match the shard list "
                                 f"({m.total_samples})")
        return m


_SHARD_KEYS = tuple(f.name for f in fields(ShardRecord))


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _typed(doc: dict[str, Any], key: str, kind: type, where: str, what: str) -> Any:
    v = doc.get(key)
    if v is None:
        return kind()
    if not isinstance(v, kind):
        raise _edited(where, f"\"{key}\" must be {what}, not {v!r}")
    return v


def _strings(doc: dict[str, Any], key: str, where: str, default: Any) -> Any:
    v = doc.get(key, default)
    if v is None and default is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _edited(where, f"\"{key}\" must be a list of strings"
                             f"{' or null' if default is None else ''}, not {v!r}")
    return list(v)


def _edited(where: str, what: str) -> ManifestError:
    """A wrong field of a manifest: most likely edited by hand; a new one is a command away
    (a part record, which ``where`` may name as well, says its own remedy)."""
    if not where.endswith(NAME):
        return ManifestError(f"{where}: {what}")
    root = where[: -len(NAME)].rstrip("/") or "."
    return ManifestError(f"{where}: {what} (edited by hand? restore it from where the dataset "
                         f"came from, or re-create it with `feedpipe index {root}`: that reads "
                         "the .tar files directly in it; give --classes again if it had class "
                         "names)")


def _shard_list(shards: object, where: str) -> list[ShardRecord]:
    """The shard records, each field checked (type, range, a relative name, listed once)."""
    if not isinstance(shards, list):
        raise _edited(where, f"\"shards\" must be a list of shard records, not "
                             f"{type(shards).__name__}")
    out: list[ShardRecord] = []
    first: dict[str, int] = {}
    for i, s in enumerate(shards):
        at = f"shards[{i}]"
        _check_keys(s, at, where)
        name = s["name"]
        _check_values(s, name, at, where)
        if name in first:
            raise ManifestError(
                f"{where}: shard {name!r} is listed twice (shards[{first[name]}] and "
                f"shards[{i}]); a dataset lists each shard once: remove the repeated entry (and "
                "correct total_samples), or rebuild the manifest with `feedpipe index`")
        first[name] = i
        _check_compression(s, name, at, where)
        out.append(ShardRecord(**s))
    return out


def _check_keys(s: object, at: str, where: str) -> None:
    """Shard record ``at`` is an object of known keys holding the required ones."""
    if not isinstance(s, dict):
        raise _edited(where, f"{at} must be an object with {', '.join(_SHARD_KEYS)}, not {s!r}")
    for k in s:
        if k not in _SHARD_KEYS:
            raise _edited(where, f"{at}: unknown key {k!r} (a shard record has "
                                 f"{', '.join(_SHARD_KEYS)})")
    for k in ("name", "samples", "bytes"):
        if k not in s:
            raise _edited(where, f"{at}: missing {k!r}")


def _check_values(s: dict[str, Any], name: object, at: str, where: str) -> None:
    """The name, counts and hash of shard record ``at``."""
    sha = s.get("sha256")
    if (not isinstance(name, str) or not name or name.startswith("/") or "://" in name
            or ".." in name.split("/")):
        raise _edited(where, f"{at}.name must be a shard path relative to the dataset root "
                             f"(no leading '/', no '..'), not {name!r}")
    for k in ("samples", "bytes", "tar_bytes"):
        if k in s and not _is_count(s[k]) and not (k == "tar_bytes" and s[k] is None):
            raise _edited(where, f"{at}.{k} must be a non-negative integer, not {s[k]!r}")
    if s["samples"] == 0:
        # no writer makes an empty shard (`feedpipe index` refuses one), and a shard the
        # plan gives no sample ids is never opened: its samples would be left out in silence
        raise _edited(where, f"{at}.samples is 0 for shard {name!r}: every shard holds at "
                             "least one sample, and a shard counted 0 would never be read")
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64
                                and not sha.strip("0123456789abcdef")):
        raise _edited(where, f"{at}.sha256 must be 64 lowercase hex digits or null, not "
                             f"{sha!r}")


def _check_compression(s: dict[str, Any], name: str, at: str, where: str) -> None:
    """A compressed shard is a gzip one with its ``tar_bytes``; a plain tar has none."""
    if compressed_suffix(name) and not readable(name):
        raise compressed_error(join(dataset_root(where), name))
    if readable(name) and s.get("tar_bytes") is None:
        raise _edited(where, f"{at}: the gzip shard {name!r} has no \"tar_bytes\" (the size "
                             "of the plain tar inside, which its index describes)")
    if not readable(name) and s.get("tar_bytes") is not None:
        raise _edited(where, f"{at}: \"tar_bytes\" is for gzip shards (.tar.gz, .tgz), not "
                             f"{name!r}")


def write_manifest(root: str, manifest: Manifest) -> str:
    """Write ``root/manifest.json`` atomically; return its path. The sidecar files found beside
    the shards are listed in it (``manifest.sidecars`` is set to them)."""
    manifest.sidecars = list_sidecars(root, [s.name for s in manifest.shards])
    path = os.path.join(root, NAME)
    _write_atomic(path, manifest.to_json(), fsync=True)
    return path


def _write_atomic(path: str, text: str, *, fsync: bool = False) -> None:
    """``text`` at ``path`` through a temp file beside it; the temp file never outlives an error
    (which leaves as it came: callers name the output their own way)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_wids_index(root: str, manifest: Manifest, name: str = "wids.json") -> str:
    """Write a wids-style shard index (``wids-shard-index-v1``) next to the manifest."""
    doc = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": s.name, "nsamples": s.samples} for s in manifest.shards],
    }
    path = os.path.join(root, name)
    _write_atomic(path, json.dumps(doc, indent=1) + "\n")
    return path


def load_manifest(root: str) -> Manifest:
    """Load the manifest of the dataset at ``root`` (a local path or any fsspec URL).

    Args:
        root: the dataset directory, or its ``manifest.json``.

    Raises:
        SourceNotFoundError: ``root`` does not exist or is not a dataset (a folder of source
            files, shards without a manifest, a single shard); the message says what to run.
        CompressedShardError: ``root`` is, or holds only, compressed shards other than gzip.
        ManifestError: the manifest is malformed (names the file and the field); a remote one
            is fetched a second time first, in case it was damaged on the way.

    Example:
        >>> m = load_manifest("shards/example")
        >>> len(m.shards), m.total_samples
        (3, 24)
    """
    from .._helpers.storage import check_query, is_local, read_bytes, split_query

    check_query(root)
    url = root if split_query(root)[0].endswith(".json") else join(root, NAME)
    # a remote manifest that arrives damaged (cut short, bytes changed on the way) is fetched
    # once more, as a damaged shard is; a local file reads the same every time
    fetches = 1 if is_local(url) else 2
    for fetch in range(1, fetches + 1):
        try:
            raw = read_bytes(url)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise _not_a_dataset(root, url) from cause(e)
        try:
            return parse_manifest(raw, url)
        except ManifestError as e:
            if fetch < fetches:
                log.warning("%s: the manifest fetched cannot be used (%s); fetching it again, in "
                            "case it was damaged on the way", url, e)
                continue
            if fetches == 1:
                raise
            raise ManifestError(
                f"{e}. The same on each of {fetches} fetches of {url}: the object itself is "
                "damaged (or so is every copy of it on the way); restore it from where the "
                "dataset came from, or re-create it with `feedpipe index` where the shards "
                "are") from cause(e)
    raise AssertionError("unreachable")  # pragma: no cover


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """A manifest from the bytes of a ``manifest.json`` (``where`` names it in errors).

    Raises:
        ManifestError: not UTF-8, not JSON, or not a valid manifest (see
            :meth:`Manifest.from_json`).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{where}: not UTF-8 text (byte {e.start}); not a feedpipe "
                            "manifest") from cause(e)
    return Manifest.from_json(text, where=where)


def _not_a_dataset(root: str, url: str) -> Exception:
    """Why ``root`` has no readable manifest, and what to run instead."""
    from ._write_lock import interrupted_error

    if (interrupted := interrupted_error(dataset_root(root))) is not None:
        return interrupted
    kind, entries = _look_at(root)
    if kind == "missing":
        return SourceNotFoundError(f"{root}: does not exist (no such directory or file)")
    if kind == "file":
        return _a_file(root)
    if kind == "dir":  # (a directory's entry ends with "/": data.tar/ is no shard)
        return _a_directory(root, url, entries)
    return SourceNotFoundError(
        f"{url}: no manifest.json; is this a feedpipe dataset? For shards made by other tools run "
        "`feedpipe index DIR`; for a folder of source files `feedpipe shard SRC OUT`")


def _a_file(root: str) -> Exception:
    """What to pass instead of the file ``root``: a shard's dataset, or a compressed shard
    decompressed."""
    if compressed_suffix(root) and not readable(root):
        return compressed_error(root)
    parent = root.rstrip("/").rsplit("/", 1)[0] if "/" in root.rstrip("/") else "."
    if root.endswith(".tar") or readable(root):
        return SourceNotFoundError(
            f"{root}: is a shard, not a dataset: pass the dataset directory, the one holding "
            f"manifest.json, {parent} (shards made by another tool: run "
            f"`feedpipe index {parent}` first)")
    return SourceNotFoundError(f"{root}: is a file, not a dataset: pass the directory "
                               "holding manifest.json (or the manifest.json itself)")


def _a_directory(root: str, url: str, entries: list[str]) -> Exception:
    """What the directory ``root`` without a manifest holds, and what to run: ``feedpipe index``
    over shards, ``feedpipe shard`` over a source tree."""
    tars = [n for n in entries if n.endswith(".tar") or readable(n)]
    packed = [n for n in entries if compressed_suffix(n) and not readable(n)]
    if packed and not tars:
        return compressed_error(join(root, packed[0]))
    if tars:
        return SourceNotFoundError(
            f"{url}: no manifest.json, but {len(tars)} .tar shard{'s' * (len(tars) > 1)} "
            f"(made by another tool?): run `feedpipe index {root}` to write their indexes "
            "and a manifest")
    if entries:
        many = f"{len(entries)} entries" if len(entries) > 1 else "1 entry"
        return SourceNotFoundError(
            f"{root}: no manifest.json and no .tar shards: this looks like a source tree "
            f"({many}, e.g. {entries[0]!r}), not a shard dataset; convert it first: "
            f"`feedpipe shard {root} OUT`, then use OUT")
    return SourceNotFoundError(f"{root}: is empty: no manifest.json and no shards")


def _look_at(root: str) -> tuple[str | None, list[str]]:
    """``("missing" | "file" | "dir" | None, visible entries of a directory)``, each directory
    among the entries with a trailing ``/``; None when the storage cannot say (a listing
    refused, an HTTP server)."""
    from .._helpers.storage import is_local, local_path
    from .._helpers.storage_listing import list_names, path_info

    try:
        if is_local(root):
            p = local_path(root)
            if not os.path.exists(p):
                return "missing", []
            if not os.path.isdir(p):
                return "file", []
            with os.scandir(p) as it:
                return "dir", sorted(e.name + "/" * e.is_dir() for e in it
                                     if not e.name.startswith("."))
        if path_info(root).get("type") != "directory":
            return "file", []
        names = [name + "/" * is_directory for name, is_directory in list_names(root)]
        return "dir", sorted(n for n in names if not n.startswith("."))
    except FileNotFoundError:
        return "missing", []
    except Exception:  # noqa: BLE001 - the plain message below is still right
        return None, []


def join(root: str, name: str) -> str:
    """Join a dataset root (path or URL) and a relative name; a URL's query string (and
    fragment) goes to the object it names.

    Example:
        >>> join("https://h/data?token=1", "a.tar"), join("shards", "a.tar")
        ('https://h/data/a.tar?token=1', 'shards/a.tar')
    """
    from .._helpers.storage import split_query

    base, query = split_query(root)
    return base.rstrip("/") + "/" + name + query if root else name


def dataset_root(url: str) -> str:
    """The dataset root of a URL that may name the manifest itself (its query string kept).

    Example:
        >>> dataset_root("https://h/data/manifest.json?token=1")
        'https://h/data?token=1'
    """
    from .._helpers.storage import split_query

    base, query = split_query(url)
    return (base.rsplit("/", 1)[0] if base.endswith(".json") else base.rstrip("/")) + query

