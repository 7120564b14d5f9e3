"""``feedpipe verify``: check every shard of a dataset against its index and the manifest.

Each shard's size and sha256 are compared with the manifest, its tar headers are read with the
one tar parser (:mod:`feedpipe.format._tar`) and its ``.idx`` is compared entry by entry with the
index those headers give. A sample key held by two samples (of one shard or two) is a problem: an
epoch would read the sample twice. What cannot be checked is said as a warning: a shard the
manifest gives no hash for, a ``.tar`` below the dataset root that the manifest does not list.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from .._helpers.progress import progress
from .._helpers.storage import is_local, local_path, open_binary, size_of
from .._helpers.storage_listing import find_paths
from .._redact import redact
from ..errors import ShardFormatError
from ._compression import compressed_suffix, readable, unpacked
from ._image_fields import image_extension
from ._index import (
    ShardIndex,
    index_from_buffer,
    index_from_tar,
    index_path,
    parse_index,
)
from ._key_registry import KeyRegistry
from ._manifest import Manifest, dataset_root, join, load_manifest
from ._sidecar_list import sidecar_problems
from ._write_lock import write_marks


@dataclass(frozen=True)
class Problem:
    """One finding of :func:`verify` (an item of ``report.problems`` or ``report.warnings``).

    Attributes:
        shard: the shard's path or URL.
        kind: what was found (the kinds are listed below).
        message: the finding said as a sentence (``str(problem)``), with what to do.
        offset: the byte offset in the shard, where known.
        key: the sample's key, where known.

    Kinds: ``missing``, ``size``, ``sha256``, ``truncated``, ``header``, ``unsupported``,
    ``compressed``, ``index`` (the ``.idx`` is missing or unreadable), ``index-entry`` (an entry
    differs from the tar headers), ``index-count``, ``samples`` (the manifest's count differs),
    ``duplicate-key`` (a key that an earlier sample holds, in this shard or another),
    ``no-image`` (a sample without an image field in an image-folder dataset), ``sidecar`` (a
    file beside a shard that the manifest lists is missing or differs from it);
    as warnings: ``unchecked`` (no sha256 in the manifest), ``unlisted`` (a shard file the
    manifest does not list).
    """

    shard: str
    kind: str
    message: str
    offset: int | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        # a sentence for a human: it names the shard's URL, never that URL's secrets
        object.__setattr__(self, "message", redact(self.message))

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The finding as a dict (an item of ``feedpipe verify --json``'s lists)."""
        return asdict(self)

    @classmethod
    def from_error(cls, shard: str, e: ShardFormatError) -> Problem:
        """The finding a :class:`~feedpipe.ShardFormatError` reading ``shard`` says."""
        return cls(shard, e.kind, str(e), e.offset)


@dataclass
class VerifyReport:
    """What :func:`verify` found; ``ok`` is true when there is no problem (warnings say what
    was not checked).

    Attributes:
        root: the dataset's root.
        shards: shards checked.
        samples: samples the checked shards hold.
        problems: each :class:`Problem` found.
        warnings: what was not checked, each as a :class:`Problem` (``unchecked``,
            ``unlisted``).
    """

    root: str
    shards: int = 0
    samples: int = 0
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong (no problem; warnings may remain)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as ``feedpipe verify --json`` prints it."""
        return {"ok": self.ok, "root": self.root, "shards": self.shards, "samples": self.samples,
                "problems": [p.to_dict() for p in self.problems],
                "warnings": [w.to_dict() for w in self.warnings]}


def _open(url: str) -> BinaryIO:
    return open_binary(url)


def _size(url: str) -> int:
    return size_of(url)


def _tar_index(url: str, size: int) -> tuple[ShardIndex, int]:
    """The index the shard's tar headers give, and the size of the tar (a gzip shard's plain tar
    is decompressed into a temporary file for the scan)."""
    with _open(url) as f:
        if readable(url):
            with unpacked(f, url) as (tar, _, _, plain):
                return index_from_tar(tar, plain, url), plain
        return index_from_tar(f, size, url), size


def index_problems(idx: ShardIndex, tar: ShardIndex, shard: str,
                   index_name: str | None = None) -> list[Problem]:
    """How ``idx`` (read from an ``.idx`` file) differs from ``tar`` (made from the shard's tar
    headers, :func:`~feedpipe.format._index.index_from_tar`): the first differing entry, or a
    different number of members or grouping. Empty when they agree.

    Args:
        idx: the index to check.
        tar: the index the tar headers give.
        shard: the shard's path or URL, for messages.
        index_name: the ``.idx`` file, for messages (default: beside ``shard``).
    """
    index_name = index_name or index_path(shard)
    by_place = None
    for m in range(min(len(idx.offsets), len(tar.offsets))):
        off, sz, name = idx.offsets[m], idx.sizes[m], idx.names[m]
        if (off, sz, idx.exts[m]) == (tar.offsets[m], tar.sizes[m], tar.exts[m]) and (
                not idx.named or name == tar.names[m]):
            continue
        key = idx.keys[_sample_of(idx, m)]
        if by_place is None:
            by_place = {(o, s): n for o, s, n in zip(tar.offsets, tar.sizes, tar.names)}
        held = by_place.get((off, sz))
        if held is None:
            text = (f"{shard}: index entry {name!r} at offset {off} ({sz} bytes) matches no "
                    "tar member")
        elif idx.named and held != name:
            text = f"{shard}: at offset {off} the tar holds {held!r}, the index says {name!r}"
        else:
            text = (f"{shard}: index entry {name!r} at offset {off} is member {m} of the index "
                    f"but not of the tar (the tar holds {tar.names[m]!r} there)")
        return [Problem(shard, "index-entry", f"{text} ({index_name}; rebuild it with "
                                              "`feedpipe index`)", off, key)]
    if len(idx.offsets) != len(tar.offsets) or idx.starts != tar.starts:
        return [Problem(shard, "index-count",
                        f"{index_name}: lists {len(idx.offsets)} members in {len(idx)} samples, "
                        f"the tar {shard} holds {len(tar.offsets)} members in {len(tar)} samples; "
                        "rebuild it with `feedpipe index`")]
    return []


def _sample_of(idx: ShardIndex, member: int) -> int:
    from bisect import bisect_right

    return bisect_right(idx.starts, member) - 1


def check_index(idx: ShardIndex, data: Any, where: str, *, index_name: str | None = None) -> None:
    """Check every entry of a shard's index against the tar headers of the shard's bytes.

    What ``feedpipe verify`` does for one shard's ``.idx``, for a reader that holds the shard
    in memory (``FeedDataset(verify=True)``): the headers are parsed with the one tar parser
    and the index must list the same members (name, data offset, size) in the same samples.

    Args:
        idx: the index, as read from the ``.idx`` file.
        data: the whole shard (``bytes``, ``memoryview`` or ``mmap``).
        where: the shard's path or URL, for messages.
        index_name: the ``.idx`` file, for messages (default: beside ``where``).

    Raises:
        ShardFormatError: the tar is malformed, or the index differs from it (the message names
            the shard, the offset and the ``.idx``; the error carries ``shard``, ``offset``,
            ``kind``).

    Example:
        >>> from pathlib import Path
        >>> from feedpipe.format._index import parse_index
        >>> tar = sorted(Path("shards/example").glob("*.tar"))[0]
        >>> idx = parse_index(tar.with_suffix(".idx").read_bytes())
        >>> check_index(idx, tar.read_bytes(), str(tar))
    """
    problems = index_problems(idx, index_from_buffer(data, where), where, index_name)
    if problems:
        p = problems[0]
        err = ShardFormatError(p.message)
        err.shard, err.offset, err.kind = where, p.offset, p.kind
        raise err


def verify_shard(url: str, samples: int | None, nbytes: int | None,
                 sha256: str | None, keys: KeyRegistry | None = None, *,
                 tar_bytes: int | None = None, images: bool = False) -> list[Problem]:
    """Problems found in one shard (empty when sound): size and sha256 against the manifest's
    (when given), every tar header, and the ``.idx`` against the headers. ``keys``: where the
    keys the headers give are recorded (for :func:`duplicate_problems`). A gzip shard's size
    and hash are its own; its headers are those of the plain tar inside, ``tar_bytes`` long.
    ``images``: every sample must hold an image field (an image-folder dataset)."""
    problems: list[Problem] = []
    try:
        size = _size(url)
    except FileNotFoundError:
        return [Problem(url, "missing", f"{url}: shard is missing")]
    if nbytes is not None and size != nbytes:
        problems.append(Problem(
            url, "size",
            f"{url}: size {size} bytes, the manifest says {nbytes} "
            f"({'truncated' if size < nbytes else 'extra bytes'} from offset {min(size, nbytes)})",
            min(size, nbytes)))
    if sha256 is not None:
        h = hashlib.sha256()
        with _open(url) as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        if h.hexdigest() != sha256:
            problems.append(Problem(url, "sha256",
                                    f"{url}: sha256 mismatch: content differs from the manifest"))
    try:
        tar, plain = _tar_index(url, size)
    except ShardFormatError as e:
        return problems + [Problem.from_error(url, e)]
    if tar_bytes is not None and plain != tar_bytes:
        problems.append(Problem(url, "size", f"{url}: the tar inside is {plain} bytes, the "
                                             f"manifest says {tar_bytes} (tar_bytes)"))
    if keys is not None:
        keys.add(url, tar.keys)
    if images:
        problems += image_problems(tar, url)
    ipath = index_path(url)
    try:
        with _open(ipath) as f:
            idx = parse_index(f.read(), ipath)
    except FileNotFoundError:
        return problems + [Problem(url, "index", f"{ipath}: index is missing; write it with "
                                                 "`feedpipe index`")]
    except ShardFormatError as e:
        return problems + [Problem(url, "index", str(e))]
    problems += index_problems(idx, tar, url, ipath)
    if samples is not None and len(tar) != samples:
        problems.append(Problem(url, "samples",
                                f"{url}: the tar holds {len(tar)} samples, the manifest says "
                                f"{samples}"))
    return problems


def image_problems(tar: ShardIndex, shard: str) -> list[Problem]:
    """One problem for the samples of an image-folder shard that hold no image field (a
    class folder's notes or thumbnail database made into a sample: ``ImagePipeline`` has no
    image to give for it), naming the first and how many."""
    bare = [i for i in range(len(tar))
            if not any(image_extension(e) is not None
                       for e in tar.exts[tar.starts[i]:tar.starts[i + 1]])]
    if not bare:
        return []
    first = bare[0]
    fields = tar.exts[tar.starts[first]:tar.starts[first + 1]]
    more = f" (and {len(bare) - 1} more such samples)" if len(bare) > 1 else ""
    return [Problem(shard, "no-image",
                    f"{shard}: sample {tar.keys[first]!r} of this image-folder dataset "
                    f"(--labels-from-dirs) holds no image field (it has {fields}){more}: it "
                    "was made from a file that is not an image; re-shard the source with "
                    "`feedpipe shard SRC OUT --labels-from-dirs`, which leaves such files out",
                    key=tar.keys[first])]


def duplicate_problems(keys: KeyRegistry) -> list[Problem]:
    """One problem per pair of shards that hold a key twice (the later shard, an example key and
    how many), from the keys :func:`verify_shard` recorded."""
    def keys_of(url: str) -> list[str]:
        return _tar_index(url, _size(url))[0].keys

    pairs: dict[tuple[str, str], list[str]] = {}
    for c in keys.clashes(keys_of):
        pairs.setdefault((c.first, c.second), []).append(c.key)
    out = []
    for (first, second), found in pairs.items():
        n = f"{len(found)} sample key{'s' * (len(found) > 1)}"
        where = (f"{n} held by two samples of this shard (members of one sample not consecutive?)"
                 if first == second else f"{n} also in {first}")
        out.append(Problem(second, "duplicate-key", (
            f"{second}: {where}, e.g. {found[0]!r}: such a sample is read twice an epoch; remove "
            "a copied shard, or rewrite the samples with distinct keys"), None, found[0]))
    return out


def _unlisted(root: str, m: Manifest) -> list[Problem]:
    """Shard files (plain or compressed tars) below ``root`` that the manifest omits. Hidden
    directories, and directories holding a manifest of their own (another dataset), are not
    looked into."""
    listed = {rec.name for rec in m.shards}
    try:
        found = [rel for rel in _shard_files(root) if rel not in listed]
    except (OSError, NotImplementedError, ValueError) as e:
        return [Problem(root, "unlisted", f"{root}: cannot list the directory to look for "
                                          f"shards the manifest does not list ({e})")]
    return [Problem(join(root, rel), "unlisted",
                    f"{join(root, rel)}: a shard file not listed in the manifest: not checked, and "
                    "not read by FeedDataset (remove it, or run `feedpipe index` to list it)")
            for rel in found]


def _shard_files(root: str) -> list[str]:
    """The relative names of the files below ``root`` named like shards, sorted."""
    def is_shard(name: str) -> bool:
        return name.endswith(".tar") or compressed_suffix(name) is not None

    out: list[str] = []
    if is_local(root):
        top = local_path(root)
        for here, dirs, files in os.walk(top, onerror=_raise):
            rel = os.path.relpath(here, top)
            if rel != "." and "manifest.json" in files:
                dirs[:] = []
                continue
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            out += [prefix + n for n in files if is_shard(n)]
        return sorted(out)
    paths = find_paths(root)
    nested = {x.rpartition("/")[0] for x in paths if x.endswith("/manifest.json")}
    for rel in paths:
        parts = rel.split("/")
        if any(d.startswith(".") for d in parts[:-1]) or any(
                rel.startswith(n + "/") for n in nested):
            continue
        if is_shard(parts[-1]):
            out.append(rel)
    return sorted(out)


def _read_all(url: str) -> bytes:
    with _open(url) as f:
        return f.read()


def _raise(e: OSError) -> None:
    raise e


def verify(root: str, *, show_progress: bool | None = None) -> VerifyReport:
    """Check every shard of the dataset at ``root``: size, sha256, tar headers, index.

    Args:
        root: the dataset directory or URL (or its ``manifest.json``).
        show_progress: a progress bar (default: when stderr is a terminal).

    Returns:
        A :class:`VerifyReport`: ``report.ok`` is true when the dataset is sound;
        ``report.problems`` and ``report.warnings`` are :class:`Problem` records.

    Raises:
        ManifestError, SourceNotFoundError: ``root`` holds no usable manifest.

    Example:
        >>> report = verify("shards/example", show_progress=False)
        >>> report.ok, report.shards, report.samples
        (True, 3, 24)
    """
    m = load_manifest(root)
    root = dataset_root(root)
    report = VerifyReport(root)
    marks = write_marks(root)  # a rewrite under way or interrupted: the manifest may be stale
    if marks:
        report.problems.append(Problem(root, "interrupted", marks.message(root)))
    keys = KeyRegistry()
    options = m.created_by.get("options") if isinstance(m.created_by, dict) else None
    # class folders of images (not, say, of audio): each sample holds an image
    images = (isinstance(options, dict) and bool(options.get("labels_from_dirs"))
              and any(image_extension(f) is not None for f in m.fields))
    bar = progress(len(m.shards), "verify", "shard", show_progress)
    for rec in m.shards:
        url = join(root, rec.name)
        report.problems += verify_shard(url, rec.samples, rec.bytes, rec.sha256, keys,
                                        tar_bytes=rec.tar_bytes, images=images)
        if rec.sha256 is None:
            report.warnings.append(Problem(
                url, "unchecked",
                f"{url}: the manifest records no sha256: its content was not checked against "
                "the manifest (headers and index were); `feedpipe index` records hashes"))
        report.shards += 1
        report.samples += rec.samples
        bar.update(1)
    bar.close()
    report.problems += duplicate_problems(keys)
    report.problems += [Problem(url, "sidecar", why)
                        for url, why in sidecar_problems(_read_all, join, root, m.sidecars)]
    report.warnings += _unlisted(root, m)
    return report
