"""``manifest.json``: what a shard dataset holds, at its root.

Format version 1::

    {"format": "feedpipe-manifest", "version": 1,
     "shards": [{"name": "data-000000.tar", "samples": 1000, "bytes": 123, "sha256": "..."}],
     "total_samples": 1000, "fields": ["cls", "jpg"], "classes": [...] | null,
     "skipped": [{"path": "...", "reason": "..."}], "num_skipped": 0,
     "created_by": {"tool": "feedpipe shard", "feedpipe_version": "...", "options": {...}}}

Loading is the only I/O here (through fsspec, so any URL works).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ManifestError, SourceNotFoundError

FORMAT = "feedpipe-manifest"
VERSION = 1
NAME = "manifest.json"


@dataclass
class ShardRecord:
    name: str  # relative to the dataset root
    samples: int
    bytes: int
    sha256: str | None = None


@dataclass
class Manifest:
    shards: list[ShardRecord]
    fields: list[str] = field(default_factory=list)
    classes: list[str] | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    created_by: dict[str, Any] = field(default_factory=dict)

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "shards": [asdict(s) for s in self.shards],
            "total_samples": self.total_samples,
            "fields": sorted(self.fields),
            "classes": self.classes,
            "skipped": self.skipped,
            "num_skipped": len(self.skipped),
            "created_by": self.created_by,
        }
        return json.dumps(doc, indent=1, ensure_ascii=False, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = NAME) -> Manifest:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a feedpipe manifest (no \"format\": \"{FORMAT}\")")
        version = doc.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise ManifestError(
                f"{where}: manifest format version {version!r} is newer than this feedpipe "
                f"understands ({VERSION}); upgrade feedpipe (pip install -U feedpipe)"
            )
        try:
            shards = [ShardRecord(**s) for s in doc["shards"]]
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{where}: malformed shard list ({e})") from e
        m = cls(
            shards=shards,
            fields=list(doc.get("fields", [])),
            classes=doc.get("classes"),
            skipped=list(doc.get("skipped", [])),
            created_by=dict(doc.get("created_by", {})),
        )
        if "total_samples" in doc and doc["total_samples"] != m.total_samples:
            raise ManifestError(
                f"{where}: total_samples {doc['total_samples']} does not match the shard list "
                f"({m.total_samples})"
            )
        return m


def write_manifest(root: str, manifest: Manifest) -> str:
    """Write ``root/manifest.json`` atomically; return its path."""
    path = os.path.join(root, NAME)
    tmp = os.path.join(root, f".{NAME}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_wids_index(root: str, manifest: Manifest, name: str = "wids.json") -> str:
    """Write a wids-style shard index (``wids-shard-index-v1``) next to the manifest."""
    doc = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": s.name, "nsamples": s.samples} for s in manifest.shards],
    }
    path = os.path.join(root, name)
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_manifest(root: str) -> Manifest:
    """Load the manifest of the dataset at ``root`` (a local path or any fsspec URL)."""
    from .storage import read_bytes  # local import: storage pulls in fsspec

    url = root if root.endswith(".json") else join(root, NAME)
    try:
        text = read_bytes(url).decode("utf-8")
    except FileNotFoundError as e:
        raise SourceNotFoundError(
            f"{url}: no manifest.json; is this a feedpipe dataset? For shards made by other tools "
            f"run `feedpipe index` first"
        ) from e
    return Manifest.from_json(text, where=url)


def join(root: str, name: str) -> str:
    """Join a dataset root (path or URL) and a relative name."""
    return root.rstrip("/") + "/" + name if root else name


def dataset_root(url: str) -> str:
    """The dataset root of a URL that may name the manifest itself."""
    return url.rsplit("/", 1)[0] if url.endswith(".json") else url.rstrip("/")
