"""The walk over a local source tree: what ``feedpipe shard`` sees of a folder.

Symbolic links are followed, to files and to directories, as ``torchvision``'s ``ImageFolder``
does: a class directory that is a link to another disk is a class like any other. A link that
leads back to a directory the walk is already inside (a link to an ancestor, or a cycle of
links) would never end. It is reported as a bad input naming the link (size :data:`LINK_LOOP`),
and the walk goes on. So is a chain of links that leads back to itself, and so to no file or
directory at all (``b -> a/c``, ``a/c -> ../b``: the system refuses to follow it, ``ELOOP``),
with size :data:`LINK_CYCLE`. Entries that are not regular files (FIFOs, sockets, devices) are
reported with size :data:`NOT_REGULAR`; entries that cannot be stat'ed or listed, with
:data:`UNREADABLE`. The listing's ``classify`` turns those sizes into reasons.

*Output directories* are skipped: the run's own output directory, and any directory inside the
source that holds a feedpipe dataset or a conversion under way (its ``manifest.json``, a resume
state or a part record). Those recognised by their content are reported in ``outputs``. So
converting a tree that holds its own shards never makes the shards a class.

The walk order is deterministic: entries sorted by name, a directory's files before its
subdirectories.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator

UNREADABLE = -1  # cannot stat or list it (permission, broken link)
NOT_REGULAR = -2  # a FIFO, socket or device
LINK_LOOP = -3  # a link to a directory the walk is inside
LINK_CYCLE = -4  # a chain of links that leads back to itself (ELOOP)

Identity = tuple[int, int]  # (st_dev, st_ino) of a directory


def identity(path: str) -> Identity | None:
    """The identity of the directory ``path`` (links followed), or ``None``."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def is_output_dir(path: str, names: set[str]) -> bool:
    """Whether the directory ``path`` with entries ``names`` holds feedpipe output: a resume
    state or part record, or a ``manifest.json`` that is a feedpipe manifest."""
    for n in names:
        if n.startswith((".feedpipe-shard-state", ".feedpipe-part-")) and n.endswith(".json"):
            return True
    if "manifest.json" not in names:
        return False
    try:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    try:
        return json.loads(head).get("format") == "feedpipe-manifest"
    except (ValueError, AttributeError):  # a partial read of a long manifest: look for the tag
        return b'"format": "feedpipe-manifest"' in head


def _entries(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


class TreeWalk:
    """Walks the local directory ``root`` (see the module docstring).

    Args:
        root: the local directory to walk.
        ancestors: identities of the directories above ``root`` that the walk is inside (for a
            top-level directory walked on its own: the source root's).
        skip: identities of directories to skip as output directories (the run's own output).

    After iterating, ``outputs`` holds the relative paths of the output directories skipped for
    their content (those of ``skip`` are left out).
    """

    def __init__(self, root: str, *, ancestors: tuple[Identity, ...] = (),
                 skip: frozenset[Identity] = frozenset()) -> None:
        self.root = root
        self.ancestors = ancestors
        self.skip = skip
        self.outputs: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, int]]:
        """``(relative path, size)`` of every file below the root; an unlistable directory
        as itself with :data:`UNREADABLE` (the root as its full path)."""
        top = identity(self.root)
        stack = [("", self.root, self.ancestors + ((top,) if top else ()))]
        while stack:
            rel_dir, path, above = stack.pop()
            try:
                entries = _entries(path)
            except OSError:
                yield (rel_dir.rstrip("/") or path), UNREADABLE
                continue
            if rel_dir and is_output_dir(path, {e.name for e in entries}):
                self.outputs.append(rel_dir.rstrip("/"))
                continue
            subdirs = []
            for e in entries:
                rel = rel_dir + e.name
                got = self.entry(e, above)
                if isinstance(got, tuple):
                    subdirs.append((rel + "/", e.path, above + (got,)))
                elif got is not None:
                    yield rel, got
            stack.extend(reversed(subdirs))

    def entry(self, e: os.DirEntry[str], above: tuple[Identity, ...]) -> Identity | int | None:
        """One directory entry: a directory to descend into (its identity), a file (its size
        or a sentinel size), or ``None`` for a directory of ``skip``."""
        try:
            if e.is_dir():  # (follows a link: one stat, which the identity needs anyway)
                st = e.stat()
                ident = st.st_dev, st.st_ino
                if ident in above:
                    return LINK_LOOP
                if ident in self.skip:  # the run's own output (the caller says so)
                    return None
                return ident
            st = e.stat()
        except OSError as err:
            return LINK_CYCLE if err.errno == errno.ELOOP else UNREADABLE
        return st.st_size if stat.S_ISREG(st.st_mode) else NOT_REGULAR


def root_entries(src: str, skip: frozenset[Identity] = frozenset(), *,
                 outputs: bool = True) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    """The local root ``src``'s files ``(name, size)``, its subdirectories (links to directories
    included) and the output directories among them, each sorted by name. ``outputs=False``:
    no subdirectory is listed to tell (the caller's own walk of each finds the signs), and the
    third list is empty."""
    walk = TreeWalk(src, skip=skip)
    top = identity(src)
    above: tuple[Identity, ...] = (top,) if top else ()
    files: list[tuple[str, int]] = []
    dirs: list[str] = []
    for e in _entries(src):
        got = walk.entry(e, above)
        if isinstance(got, tuple):
            if not outputs:
                dirs.append(e.name)
                continue
            try:
                names = set(os.listdir(e.path))
            except OSError:
                names = set()  # (the walk of the directory reports it)
            if is_output_dir(e.path, names):
                walk.outputs.append(e.name)
            else:
                dirs.append(e.name)
        elif got is not None:
            files.append((e.name, got))
    return files, dirs, walk.outputs
