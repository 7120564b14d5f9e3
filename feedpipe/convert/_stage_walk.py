"""The listing part of one-pass staging (:mod:`~feedpipe.convert._onepass`): a top-level
directory walked without a ``stat`` and its files grouped into samples, exactly as the general
path's listing groups them.

Most names are judged by a shortcut (:func:`_plain_names`, :func:`_plain_name`: what
:func:`~feedpipe.convert._sources.classify` would say of a plain name); the others go through
``classify`` itself. What only the general path converts (a bad input, a link, possible feedpipe
output) gives the directory back: :func:`group_samples` raises :class:`GiveBack`.
"""

from __future__ import annotations

import os
import re

from ..format._keys import NEEDS_ESCAPE, valid_extension
from ._sources import classify, count_hidden

# per sample key: its members' (field, file relative to the root; None: the cls field)
Grouped = dict[str, list[tuple[str, str | None]]]


class GiveBack(Exception):
    """The directory holds what only the general path converts (and reports)."""


def walk_plain(root: str, top: str) -> list[tuple[str, list[str]]] | None:
    """The regular files below ``root/top`` in the listing's walk order (sorted per directory, a
    directory's files before its subdirectories), without a ``stat``: per directory, its path
    relative to ``root`` (ending in ``/``) and its files' names. ``None`` at a link, a special
    file or a directory that cannot be listed."""
    out: list[tuple[str, list[str]]] = []
    stack = [(top + "/", os.path.join(root, top))]
    while stack:
        rel_dir, path = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = list(it)
            # (without the entry type from the directory, these lstat)
            files = sorted([e.name for e in entries if e.is_file(follow_symlinks=False)])
            subdirs = []
            if len(files) < len(entries):
                for e in sorted((e for e in entries if not e.is_file(follow_symlinks=False)),
                                key=lambda e: e.name):
                    if not e.is_dir(follow_symlinks=False):
                        return None
                    subdirs.append((rel_dir + e.name + "/", e.path))
        except OSError:
            return None
        every = "/" + "/".join([e.name for e in entries]) + "/"
        if "/manifest.json/" in every or "/.feedpipe-" in every:
            return None  # perhaps feedpipe output: the general path's walk decides
        if files:
            out.append((rel_dir, files))
        stack.extend(reversed(subdirs))
    return out


# The shortcut of stage_dir: what classify would say of a plain path, judged a directory and a
# name at a time. A plain directory (relative, ending in "/") is ASCII, has nothing to escape and
# no hidden component; a plain name in it is the same, with one dot, which starts a valid field
# name (for a class folder, not "cls"). A plain file's key is its path without the extension.
def _plain_dir(rel_dir: str) -> bool:
    return (not rel_dir.startswith(".") and "/." not in rel_dir and rel_dir.isascii()
            and NEEDS_ESCAPE.search(rel_dir) is None)


def _plain_name(name: str, labels: bool, exts: dict[str, str | None]) -> tuple[str, str] | None:
    """``(stem, ext)`` of a plain name, else ``None``. ``exts`` caches each extension's verdict
    (a tree holds few distinct ones)."""
    dot = name.rfind(".")
    if (dot <= 0 or name.find(".") != dot or not name.isascii()
            or NEEDS_ESCAPE.search(name) is not None):
        return None
    ext = name[dot + 1:]
    ok = exts.get(ext, "")
    if ok == "":
        ok = exts[ext] = ext if valid_extension(ext) and not (labels and ext == "cls") else None
    return None if ok is None else (name[:dot], ok)


# a run of plain names joined by "/": each has one dot, with a stem and an extension
_PLAIN_RUN = re.compile(r"[^./]+\.[^./]+(?:/[^./]+\.[^./]+)*")


def _plain_names(names: list[str], labels: bool, exts: dict[str, str | None]
                 ) -> tuple[list[str], list[str]] | None:
    """``(stems, extensions)`` of ``names`` where every one is plain (what :func:`_plain_name`
    says of each, judged on the names joined), else ``None``."""
    joined = "/".join(names)
    if (not joined.isascii() or NEEDS_ESCAPE.search(joined) is not None
            or _PLAIN_RUN.fullmatch(joined) is None):
        return None
    parts = joined.replace(".", "/").split("/")
    found = parts[1::2]
    for ext in set(found):
        ok = exts.get(ext, "")
        if ok == "":
            ok = exts[ext] = ext if valid_extension(ext) and not (labels and ext == "cls") else None
        if ok is None:
            return None
    return parts[0::2], found


def _sample_key(rel: str, labels: bool, exts: dict[str, str | None]) -> tuple[str, str] | None:
    """``(key, ext)`` of the file ``rel`` (relative to the root, in a directory) by the shortcut,
    or ``None`` where it leaves the file to ``classify``."""
    head, _, name = rel.rpartition("/")
    if not head or not _plain_dir(head + "/"):
        return None
    got = _plain_name(name, labels, exts)
    return None if got is None else (f"{head}/{got[0]}", got[1])


def group_samples(groups: list[tuple[str, list[str]]], labels: bool
                  ) -> tuple[Grouped, int, dict[str, int]]:
    """The samples of a directory's files (:func:`walk_plain`'s ``groups``), grouped by key as
    the listing groups them, the number of files it ignores and the hidden ones among them (by
    top-level directory). Raises :class:`GiveBack` at a bad input or a ``cls`` file under
    ``labels``."""
    by_key: Grouped = {}
    ignored = 0
    hidden: dict[str, int] = {}
    exts: dict[str, str | None] = {}
    for rel_dir, dir_names in groups:
        plain = _plain_dir(rel_dir)
        split = _plain_names(dir_names, labels, exts) if plain else None
        if split is not None:  # (most directories: every name plain, judged at once)
            _add_plain(by_key, rel_dir, dir_names, *split)
            continue
        for name in dir_names:
            rel = rel_dir + name
            got = _file_key(rel_dir, name, plain, labels, exts)
            if got is None:
                ignored += 1
                count_hidden(hidden, rel)
                continue
            files = by_key.get(got[0])
            if files is None:
                by_key[got[0]] = [(got[1], rel)]
            else:
                files.append((got[1], rel))
    return by_key, ignored, hidden


def _add_plain(by_key: Grouped, rel_dir: str, names: list[str], stems: list[str],
               exts: list[str]) -> None:
    """Add a directory's files whose names are all plain (``stems``, ``exts``: theirs)."""
    paths = [rel_dir + n for n in names]
    keyed: Grouped = {rel_dir + k: [(e, r)] for k, e, r in zip(stems, exts, paths)}
    if len(keyed) == len(paths):  # (one file a sample)
        by_key.update(keyed)
        return
    for k, e, r in zip(stems, exts, paths):
        key = rel_dir + k
        files = by_key.get(key)
        if files is None:
            by_key[key] = [(e, r)]
        else:
            files.append((e, r))


def _file_key(rel_dir: str, name: str, plain: bool, labels: bool,
              exts: dict[str, str | None]) -> tuple[str, str] | None:
    """``(key, field)`` of the file ``name`` in ``rel_dir``, ``None`` where the listing ignores
    it; :class:`GiveBack` where the general path must judge it."""
    fast = _plain_name(name, labels, exts) if plain else None
    if fast is not None:
        return rel_dir + fast[0], fast[1]
    got = classify(rel_dir + name, 1, labels_from_dirs=labels)  # the size is checked once read
    if got is None:
        return None
    if isinstance(got, str) or (labels and got[1].ext == "cls"):
        raise GiveBack(rel_dir + name)
    return got[0], got[1].ext
