"""``feedpipe verify``: check every shard of a dataset against its index and the manifest."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from .errors import ShardFormatError
from .index import index_path, parse_index
from .manifest import join, load_manifest
from .progress import progress
from .storage import filesystem, is_local, local_path
from .tarformat import scan


@dataclass
class VerifyReport:
    root: str
    shards: int = 0
    samples: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _open(url: str):  # type: ignore[no-untyped-def]
    if is_local(url):
        return open(local_path(url), "rb")
    fs, p = filesystem(url)
    return fs.open(p, "rb")


def _read_text(url: str) -> str:
    with _open(url) as f:
        return f.read().decode("utf-8")


def _size(url: str) -> int:
    if is_local(url):
        return os.path.getsize(local_path(url))
    fs, p = filesystem(url)
    return int(fs.size(p))


def verify_shard(url: str, samples: int | None, nbytes: int | None, sha256: str | None) -> list[str]:
    """Problems found in one shard (empty when sound)."""
    problems: list[str] = []
    try:
        size = _size(url)
    except FileNotFoundError:
        return [f"{url}: shard is missing"]
    if nbytes is not None and size != nbytes:
        problems.append(
            f"{url}: size {size} bytes, the manifest says {nbytes} "
            f"({'truncated' if size < nbytes else 'extra bytes'} from offset {min(size, nbytes)})"
        )
    if sha256 is not None:
        h = hashlib.sha256()
        with _open(url) as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        if h.hexdigest() != sha256:
            problems.append(f"{url}: sha256 mismatch: content differs from the manifest")
    try:
        with _open(url) as f:
            members = [(m.name, m.offset, m.size) for m in scan(f, size, url)]
    except ShardFormatError as e:
        problems.append(str(e))
        return problems
    ipath = index_path(url)
    try:
        idx = parse_index(_read_text(ipath), ipath)
    except FileNotFoundError:
        problems.append(f"{ipath}: index is missing")
        return problems
    except ShardFormatError as e:
        problems.append(str(e))
        return problems
    found = {(o, s): n for n, o, s in members}
    for name, off, sz in zip(idx.names, idx.offsets, idx.sizes):
        if (off, sz) not in found:
            problems.append(
                f"{url}: index entry {name!r} at offset {off} ({sz} bytes) matches no tar member"
            )
            break
        if found[(off, sz)] != name:
            problems.append(
                f"{url}: at offset {off} the tar holds {found[(off, sz)]!r}, the index says {name!r}"
            )
            break
    if samples is not None and len(idx) != samples:
        problems.append(f"{url}: index has {len(idx)} samples, the manifest says {samples}")
    return problems


def verify(root: str, *, show_progress: bool | None = None) -> VerifyReport:
    """Check every shard of the dataset at ``root``: size, sha256, tar headers, index.

    Returns a :class:`VerifyReport`; ``report.ok`` is true when the dataset is sound.
    """
    m = load_manifest(root)
    report = VerifyReport(root)
    bar = progress(len(m.shards), "verify", "shard", show_progress)
    for rec in m.shards:
        report.problems += verify_shard(join(root, rec.name), rec.samples, rec.bytes, rec.sha256)
        report.shards += 1
        report.samples += rec.samples
        bar.update(1)
    bar.close()
    return report
