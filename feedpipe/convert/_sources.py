"""The inputs of ``feedpipe shard``: samples of files, how a listed file becomes one
(:func:`classify`), reading a source file, and listing a folder tree or image-folder layout on a
local path or any fsspec URL. (:mod:`~feedpipe.convert._file_list` lists a JSONL/CSV file of
samples.)

Listing produces :class:`SampleSpec` objects in a deterministic order (sorted by key), and a list
of problems (bad inputs) for the converter's ``on_error`` policy. Listing reads directory entries
only.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._helpers.storage import is_local, local_path, read_bytes
from .._helpers.storage_listing import exists, find_files, is_dir
from ..errors import KeyClashError, SourceNotFoundError
from ..format._image_fields import image_extension
from ..format._keys import encode_key, split_source, valid_extension
from ._source_tree import LINK_CYCLE, LINK_LOOP, NOT_REGULAR, Identity, TreeWalk, identity


class FileRef(NamedTuple):
    """One input file of a sample: its field (extension), path and listed size.

    A named tuple, not a frozen dataclass: a conversion makes two per input file, and a tuple is
    cheaper to make (``benchmarks/bench_convert.py --profile``)."""

    ext: str
    path: str  # relative to the source root, or an absolute path / URL (manifest mode)
    size: int


@dataclass
class SampleSpec:
    key: str
    files: list[FileRef] = field(default_factory=list)
    extras: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def fields(self) -> list[str]:
        return [f.ext for f in self.files] + [e for e, _ in self.extras]

    def describe(self) -> str:
        return ", ".join(f.path for f in self.files) or self.key


@dataclass
class Listing:
    samples: list[SampleSpec]
    problems: list[tuple[str, str]]  # (path, reason), one per bad input
    classes: list[str] | None = None
    ignored: int = 0  # hidden files
    outputs: list[str] = field(default_factory=list)  # output directories skipped (relative)
    # (path, reason) of each file --labels-from-dirs leaves out: not an image, not a sample
    left_out: list[tuple[str, str]] = field(default_factory=list)
    # (path, reason) of each hidden file left out, a hidden directory once (hidden_skipped)
    hidden: list[tuple[str, str]] = field(default_factory=list)


class Source:
    """Reads input files relative to a root (local path or fsspec URL)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") if "://" in root else root
        self.local = is_local(root)
        self._local_root: str | None = None  # the local root with a trailing "/"
        if self.local:
            base = local_path(self.root)
            self._local_root = base if base.endswith("/") else base + "/"

    def path(self, rel: str) -> str:
        if "://" in rel or os.path.isabs(rel):
            return rel
        if self.local:
            return os.path.join(local_path(self.root), rel)
        return f"{self.root}/{rel}"

    def read(self, rel: str, size: int = -1) -> bytes:
        """The bytes of ``rel``; ``size``: what the listing saw (a hint, the file decides)."""
        root = self._local_root
        if root is not None and "://" not in rel and not rel.startswith("/"):
            # a relative path of a local root, without :meth:`path`'s checks: they cost about
            # as much as reading a small file (benchmarks/bench_convert.py --profile)
            return read_local(root + rel, size)
        p = self.path(rel)
        if is_local(p):
            return read_local(local_path(p), size)
        return read_bytes(p)

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "local": self.local, "_local_root": self._local_root}


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
READ_FLAGS = _OPEN_FLAGS  # (for a reader that inlines read_local: one-pass staging)


class NotRegularFileError(OSError):
    """A source path names a FIFO, socket, device or directory: ``feedpipe shard`` reads regular
    files only (opening a FIFO without a writer would block the reader forever)."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def not_regular(path: str, mode: int) -> NotRegularFileError:
    return NotRegularFileError(
        errno.EINVAL, f"not a regular file ({_kind(mode)}); feedpipe shard reads regular files "
        "only", path)


def read_local(path: str, size: int = -1) -> bytes:
    """A local regular file's bytes, in one ``read`` when ``size`` is right, else until a read
    finds nothing.

    The read asks for one byte more than ``size``: a regular file's read comes back short only
    at its end. A file longer or shorter than ``size`` is read whole all the same. The file is
    opened non-blocking and its type checked after the open. So a FIFO, socket or device (also
    one swapped in after the listing) raises :class:`NotRegularFileError` rather than blocking
    or reading forever. Python's buffered file object is left out: for the many small files of
    a conversion this is the cheaper read (``benchmarks/bench_convert.py``)."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
        if size < 0:  # the size the type check just gave: one read of a file that keeps it
            size = st.st_size
        want = size + 1
        data = os.read(fd, want)
        if len(data) == size:  # short by the byte asked beyond the listed size: at the end
            return data
        parts = [data]
        if len(data) < want:  # short: the end, unless a second read still finds bytes
            more = os.read(fd, 1 << 16)
            if not more:
                return data
            parts.append(more)
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def printable(rel: str) -> str:
    r"""``rel`` as text that JSON and terminals take: bytes of a file name that are not UTF-8
    (``os`` hands them over as lone surrogates) become ``\xNN`` escapes (pure).

    Example:
        >>> printable("a/bad\udcff.jpg")
        'a/bad\\xff.jpg'
    """
    try:
        rel.encode("utf-8")
        return rel
    except UnicodeEncodeError:
        pass
    try:
        return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return rel.encode("utf-8", "backslashreplace").decode("utf-8")


def walk_remote(root: str) -> Iterator[tuple[str, int]]:
    """Every file under the remote directory ``root``: ``(relative path, size)``, in order."""
    return find_files(root)


def check_source_dir(src: str) -> None:
    """Raise a clear error if ``src`` is missing or not a directory."""
    if is_local(src):
        p = local_path(src)
        if not os.path.exists(p):
            raise SourceNotFoundError(f"{src}: source does not exist")
        if not os.path.isdir(p):
            raise SourceNotFoundError(f"{src}: source is not a directory")
        if not os.access(p, os.R_OK | os.X_OK):
            raise SourceNotFoundError(f"{src}: source directory is not readable (permission)")
        return
    if not exists(src):
        raise SourceNotFoundError(f"{src}: source does not exist")
    if not is_dir(src):
        raise SourceNotFoundError(f"{src}: source is not a directory")


class NotASample(str):
    """A bad input of :func:`classify` (the string: why) that ``labels_from_dirs`` may leave out
    instead: a class folder's file that is not an image (so no sample in torchvision's
    ``ImageFolder``). :func:`leave_out_non_images` decides, knowing the folder's files."""


NOT_IMAGE = ("not an image file (in a class folder of images, --labels-from-dirs takes the "
             "image files, by extension in any case, as torchvision's ImageFolder does); left "
             "out")


def classify(rel: str, size: int, *,
             labels_from_dirs: bool = False) -> tuple[str, FileRef] | str | None:
    """What one listed file is (pure): ``None`` for a hidden file (ignored), a reason string for a
    bad input (a :class:`NotASample` where a class folder's file that is not an image is bad),
    else its sample key and :class:`FileRef`.

    Example:
        >>> classify("a/cat.v2.jpg", 3)
        ('a/cat%2Ev2', FileRef(ext='jpg', path='a/cat.v2.jpg', size=3))
        >>> classify("a/empty.txt", 0)
        'zero-byte file'
    """
    got = _classify(rel, size, labels_from_dirs)
    if (labels_from_dirs and isinstance(got, str) and "/" in rel and size >= 0
            and image_extension(split_source(rel)[1]) is None):
        return NotASample(got)
    return got


def _classify(rel: str, size: int, labels_from_dirs: bool) -> tuple[str, FileRef] | str | None:
    # hidden files and everything inside hidden directories (.git, .ipynb_checkpoints)
    if rel.startswith(".") or "/." in rel:
        return None
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "file name is not valid UTF-8 (rename it)"
    if size == NOT_REGULAR:
        return ("not a regular file (a FIFO, socket or device); feedpipe shard reads regular "
                "files only")
    if size == LINK_LOOP:
        return ("symbolic link to a directory it is inside (a loop); remove the link or point it "
                "elsewhere")
    if size == LINK_CYCLE:
        return ("symbolic link loop: its chain of links leads back to itself; remove a link of "
                "the chain or point it elsewhere")
    if size < 0:  # before the extension checks: it may be an unreadable directory
        return "cannot stat or list it (permission or broken link)"
    stem, ext = split_source(rel)
    if not ext:
        return "file has no extension (a WebDataset field needs one)"
    if not valid_extension(ext):
        return f"extension {ext!r} cannot be a field name"
    if size == 0:
        return "zero-byte file"
    if labels_from_dirs and "/" not in rel:
        return "file is not inside a class directory (--labels-from-dirs)"
    return encode_key(stem), FileRef(ext, rel, size)


def hidden_entry(rel: str) -> str:
    """What the listing names of the hidden file ``rel`` (pure): the file itself, or the hidden
    directory it lies in (the outermost, ending in ``/``), which names all its files at once.

    Example:
        >>> hidden_entry("a/.DS_Store"), hidden_entry("a/.git/objects/ab"), hidden_entry(".x/y")
        ('a/.DS_Store', 'a/.git/', '.x/')
    """
    start = 0 if rel.startswith(".") else rel.index("/.") + 1
    end = rel.find("/", start)
    return printable(rel if end < 0 else rel[:end + 1])


def hidden_skipped(counts: dict[str, int]) -> list[tuple[str, str]]:
    """``(path, reason)`` of the hidden files and directories left out (pure): ``counts`` holds,
    per :func:`hidden_entry`, how many files it stands for.

    Example:
        >>> hidden_skipped({"a/.git/": 2, ".DS_Store": 1})[0]
        ('.DS_Store', "hidden file (its name starts with '.'): left out")
    """
    out = []
    for path in sorted(counts):
        if path.endswith("/"):
            n = counts[path]
            out.append((path, f"hidden directory (its name starts with '.'): its {n} "
                              f"file{'s' * (n != 1)} left out"))
        else:
            out.append((path, "hidden file (its name starts with '.'): left out"))
    return out


def count_hidden(counts: dict[str, int], rel: str) -> None:
    """Count the hidden file ``rel`` under its :func:`hidden_entry` in ``counts``."""
    entry = hidden_entry(rel)
    counts[entry] = counts.get(entry, 0) + 1


def leave_out_non_images(by_key: dict[str, list[FileRef]], problems: list[tuple[str, str]]
                         ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``--labels-from-dirs``: leave out of a class folder that holds images the files that are
    not (torchvision's ``ImageFolder`` takes image files only). Removes from ``by_key`` the
    samples of such a folder that hold no image file. ``problems``: the bad inputs
    :func:`classify` found, a :class:`NotASample` among them left out too when its folder holds
    images (notes, ``Thumbs.db``, an empty placeholder), else kept as a bad input (a
    class-folder dataset of other files, audio say). Returns ``(left_out, problems)``, each
    ``(path, reason)``, the problems in their order. A file beside an image of the same stem
    (a JSON sidecar) is a field of that image's sample.

    Example:
        >>> by_key = {"a/x": [FileRef("JPEG", "a/x.JPEG", 9), FileRef("json", "a/x.json", 2)],
        ...           "a/notes": [FileRef("txt", "a/notes.txt", 5)],
        ...           "b/y": [FileRef("wav", "b/y.wav", 7)]}
        >>> bad = [("a/Thumbs", NotASample("file has no extension")),
        ...        ("b/empty.txt", NotASample("zero-byte file"))]
        >>> left, problems = leave_out_non_images(by_key, bad)
        >>> [p for p, _ in left], problems, list(by_key)
        (['a/notes.txt', 'a/Thumbs'], [('b/empty.txt', 'zero-byte file')], ['a/x', 'b/y'])
    """
    def top(path: str) -> str:  # the class folder, as the problems name it
        return printable(path).split("/", 1)[0]

    with_images = {top(f.path) for files in by_key.values() for f in files
                   if image_extension(f.ext) is not None}
    gone = [k for k, files in by_key.items() if top(files[0].path) in with_images
            and not any(image_extension(f.ext) is not None for f in files)]
    left = [(printable(f.path), NOT_IMAGE) for k in gone for f in by_key.pop(k)]
    kept = []
    for path, why in problems:
        if isinstance(why, NotASample) and path.split("/", 1)[0] in with_images:  # (printable)
            left.append((path, NOT_IMAGE))
        else:
            kept.append((path, str(why)))
    return left, kept


def several_images(samples: Iterable[SampleSpec],
                   image_fields: Sequence[str]) -> list[SampleSpec]:
    """The samples that hold more than one of ``image_fields`` (files sharing a stem, such as
    ``cat/x.jpg`` and ``cat/x.png``, are one sample), in their order (pure).

    Example:
        >>> two = SampleSpec("x", [FileRef("jpg", "x.jpg", 1), FileRef("png", "x.png", 1)])
        >>> one = SampleSpec("y", [FileRef("jpg", "y.jpg", 1), FileRef("json", "y.json", 1)])
        >>> [s.key for s in several_images([one, two], ("jpg", "png"))]
        ['x']
    """
    wanted = frozenset(f.lower() for f in image_fields)
    return [spec for spec in samples if len(files := spec.files) > 1
            and sum(f.ext.lower() in wanted for f in files) > 1]


def add_class_field(spec: SampleSpec, index: dict[str, int]) -> None:
    """Append the ``cls`` field of ``--labels-from-dirs`` (the index of the sample's top-level
    directory in ``index``); refuse a sample that already has a ``cls`` file."""
    if any(f.ext == "cls" for f in spec.files):
        raise KeyClashError(
            f"{spec.files[0].path}: sample already has a 'cls' file, which clashes with the "
            "class field written by --labels-from-dirs; rename the file or drop "
            "--labels-from-dirs"
        )
    spec.extras.append(("cls", str(index[spec.files[0].path.split("/", 1)[0]]).encode()))


def list_tree(src: str, *, labels_from_dirs: bool = False, exclude: str | None = None) -> Listing:
    """Group the files of a folder tree into samples by relative directory and stem (in one
    process; :mod:`feedpipe.convert._listing` lists big trees in parallel with the same result).
    ``exclude``: the output directory, skipped if it is inside ``src``."""
    check_source_dir(src)
    walk: Any
    if is_local(src):
        walk = TreeWalk(local_path(src), skip=output_identity(exclude))
    else:
        walk = walk_remote(src)
    problems: list[tuple[str, str]] = []
    left_out: list[tuple[str, str]] = []
    by_key: dict[str, list[FileRef]] = {}
    ignored = 0
    hidden: dict[str, int] = {}
    for rel, size in walk:
        got = classify(rel, size, labels_from_dirs=labels_from_dirs)
        if got is None:
            ignored += 1
            count_hidden(hidden, rel)
        elif isinstance(got, str):
            problems.append((printable(rel), got))
        else:
            by_key.setdefault(got[0], []).append(got[1])
    if labels_from_dirs:
        left_out, problems = leave_out_non_images(by_key, problems)
    samples = [SampleSpec(k, by_key[k]) for k in sorted(by_key)]
    classes = None
    if labels_from_dirs:
        classes = sorted({s.files[0].path.split("/", 1)[0] for s in samples})
        index = {c: i for i, c in enumerate(classes)}
        for s in samples:
            add_class_field(s, index)
    outputs = sorted(printable(o) for o in getattr(walk, "outputs", []))
    return Listing(samples, problems, classes, ignored, outputs, sorted(left_out),
                   hidden_skipped(hidden))


def output_identity(out: str | None) -> frozenset[Identity]:
    """The identity of the output directory ``out`` when it exists locally (for the walk to
    skip it), else nothing."""
    if out is None or not is_local(out):
        return frozenset()
    got = identity(local_path(out))
    return frozenset() if got is None else frozenset([got])
