"""The output directory of a conversion: made and checked, its temp files, its resume state, and
its manifest written last.

A conversion keeps a hidden *state* file in OUT (``.feedpipe-shard-state.json``, or one per
``--part``) from its start until it has written the manifest. The file holds the plan's
fingerprint, so a ``--resume`` knows whether it continues the same conversion. Temporary files
are hidden (``.NAME.tmp-PID``, ``.NAME.partJJJJJ.tmp-PID``) and removed on error or by the next
run.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import __version__
from .._helpers.storage import is_local, local_path
from .._redact import logger, redact_doc
from ..errors import OutputError
from ..format._manifest import NAME as MANIFEST_NAME
from ..format._manifest import Manifest, write_manifest, write_wids_index
from ..format._write_lock import WriterLock
from ._writer import output_error

log = logger("feedpipe.convert")
STATE_NAME = ".feedpipe-shard-state.json"
WIDS_NAME = "wids.json"


def prepare_out(out: str, resume: bool, own: str | None = None, *,
                tool: str = "`feedpipe shard`", hint: str | None = None) -> str:
    """Make ``out`` (a local directory) if missing and check that it can take the output: the
    local path. Without ``resume`` it must hold no visible entry (with ``own``, a part's shard
    prefix: none of that part's; other parts' files are allowed). ``hint``: what to do about a
    directory that is not empty (default: ``--resume`` where an interrupted run left its state
    there, else another directory; ``--resume`` would write into whatever this one is)."""
    if not is_local(out):
        raise OutputError(f"{out}: the output of {tool} must be a local directory")
    out = local_path(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputError(f"{out}: output exists and is not a directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise OutputError(e.errno, f"{out}: cannot create output directory: {e.strerror}") from e
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: output directory is not writable")
    if not resume:
        visible = [n for n in os.listdir(out) if not n.startswith(".")
                   and (own is None or n.startswith(own + "-"))]
        if visible:
            many = f"{len(visible)} entries" if len(visible) > 1 else "1 entry"
            raise OutputError(
                f"{out}: output directory is not empty ({many}, e.g. {sorted(visible)[0]!r}); "
                f"{hint or _not_empty_hint(out)}"
            )
    return out


def take_lock(out: str, tag: str | None, tool: str) -> WriterLock | None:
    """Lock the local directory ``out`` for one writer (see
    :mod:`~feedpipe.format._write_lock`), making it if missing; ``None`` where there is nothing
    to lock (not a local directory: :func:`prepare_out` says why)."""
    if not is_local(out):
        return None
    path = local_path(out)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # (prepare_out names the problem)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return None
    return WriterLock(path, tag, tool)


def _not_empty_hint(out: str) -> str:
    """What to do about a conversion's output directory that is not empty."""
    names = os.listdir(out)
    if any(n.startswith(STATE_NAME.rsplit(".", 1)[0]) for n in names):
        return "an interrupted run left its state here: rerun with --resume to finish it"
    if MANIFEST_NAME in names:
        return ("it holds a finished dataset: convert into a new or empty directory (or "
                "remove this one first)")
    return "convert into a new or empty directory"


def clean_temps(out: str, prefix: str, state_name: str = STATE_NAME) -> None:
    """Remove the temp files of runs writing shards ``prefix-*`` (and, for a whole run, the
    manifest's; a part leaves those to a merge that may be running)."""
    own: tuple[str, ...] = (f".{prefix}-", f"{state_name}.tmp-")
    if state_name == STATE_NAME:
        own += (f".{MANIFEST_NAME}.tmp-", f".{WIDS_NAME}.tmp-")
    for n in os.listdir(out):
        if n.startswith(own) and (".tmp-" in n or ".part" in n):
            unlink_quiet(os.path.join(out, n))


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_dataset_manifest(out: str, m: Manifest) -> None:
    """``wids.json`` and ``manifest.json`` (last: the dataset's commit point); on any failure
    their temp files go and an ``OSError`` leaves as an :class:`OutputError` naming the file."""
    try:
        write_wids_index(out, m)
        write_manifest(out, m)
    except BaseException as e:
        for name in (MANIFEST_NAME, WIDS_NAME):
            unlink_quiet(os.path.join(out, f".{name}.tmp-{os.getpid()}"))
        if isinstance(e, OSError):
            raise output_error(e, os.path.join(out, MANIFEST_NAME)) from e
        raise


def finished_dataset(out: str, fp: str) -> Manifest | None:
    """The manifest of ``out`` where it records a conversion of plan fingerprint ``fp`` (the same
    inputs and options) and each of its shards is there at the size it records; else ``None``.
    A cheap check (no shard is read): ``feedpipe verify`` checks the bytes."""
    path = os.path.join(out, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            m = Manifest.from_json(f.read(), where=path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # (a damaged manifest: check_state says what to do)
        return None
    if m.created_by.get("plan_fingerprint") != fp:
        return None
    for rec in m.shards:
        try:
            size = os.path.getsize(os.path.join(out, rec.name))
        except OSError:
            size = -1
        if size != rec.bytes:
            log.warning("%s: holds a finished dataset of this conversion, but its shard %s is "
                        "%s: the conversion is redone", out, rec.name,
                        "missing" if size < 0 else f"{size} bytes, not the {rec.bytes} recorded")
            return None
    return m


def check_state(out: str, fp: str, resume: bool, state_name: str = STATE_NAME,
                options: dict[str, Any] | None = None) -> None:
    """Refuse to resume a run of other inputs or options (naming the options that differ, from
    ``options``: the output-deciding ones); then save ``fp`` and ``options`` as this run's."""
    path = os.path.join(out, state_name)
    if resume and os.path.exists(path):
        old = _saved_fingerprint(path, "plan_fingerprint")
        if old != fp:
            what = _what_differs(_saved_options(path, "options"), options)
            raise OutputError(
                f"{out}: cannot resume: {what} of the interrupted run (rerun with its options, "
                "or start again in an empty directory)"
            )
        return
    if resume and state_name == STATE_NAME and os.path.exists(os.path.join(out, MANIFEST_NAME)):
        old = _saved_fingerprint(os.path.join(out, MANIFEST_NAME), "created_by")
        if old != fp:
            what = _what_differs(_saved_options(os.path.join(out, MANIFEST_NAME), "created_by"),
                                 options)
            raise OutputError(
                f"{out}: cannot resume: it holds a finished dataset, and {what} of the run "
                "that made it"
            )
    tmp = path + f".tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"plan_fingerprint": fp, "feedpipe_version": __version__,
                       "options": redact_doc(options)}, f)
        os.replace(tmp, path)
    except OSError as e:
        unlink_quiet(tmp)
        raise output_error(e, path) from e


def _what_differs(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    """The options that differ between two runs, as the command line names them, or that the
    inputs do."""
    if old is None or new is None:
        return "the inputs or options differ from those"
    changed = [f"--{k.replace('_', '-')} was {old.get(k)!r}, now {new.get(k)!r}"
               for k in sorted(set(old) | set(new)) if k != "src" and old.get(k) != new.get(k)]
    if changed:
        return f"the options differ from those ({'; '.join(changed)})"
    return ("the inputs differ from those (files added, removed or changed in the source since "
            "then)")


def _saved_options(path: str, where: str) -> dict[str, Any] | None:
    """The output options a state file (``where="options"``) or a manifest (``"created_by"``)
    saved; ``None`` where it saved none."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        found = doc.get(where)
        if where == "created_by":
            found = found.get("options")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def _saved_fingerprint(path: str, where: str) -> Any:
    """The plan fingerprint saved in the state file or manifest ``path`` (``where``: the key
    holding it, or ``"created_by"`` for a manifest's)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if where == "created_by":
            return doc.get("created_by", {}).get("plan_fingerprint")
        return doc.get(where)
    except (OSError, ValueError, AttributeError) as e:
        raise OutputError(f"{path}: cannot resume: the file is unreadable or damaged ({e}); "
                          "start again in an empty directory") from e
