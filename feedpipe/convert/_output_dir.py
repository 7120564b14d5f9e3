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
from ..errors import OutputError
from ..format._manifest import NAME as MANIFEST_NAME
from ..format._manifest import Manifest, write_manifest, write_wids_index
from ..format._write_lock import WriterLock
from ._writer import output_error

STATE_NAME = ".feedpipe-shard-state.json"
WIDS_NAME = "wids.json"


def prepare_out(out: str, resume: bool, own: str | None = None, *,
                tool: str = "`feedpipe shard`",
                hint: str = "use --resume to continue an interrupted run, or an empty "
                            "directory") -> str:
    """Make ``out`` (a local directory) if missing and check that it can take the output: the
    local path. Without ``resume`` it must hold no visible entry (with ``own``, a part's shard
    prefix: none of that part's; other parts' files are allowed)."""
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
            raise OutputError(
                f"{out}: output directory is not empty ({len(visible)} entries, e.g. "
                f"{sorted(visible)[0]!r}); {hint}"
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


def check_state(out: str, fp: str, resume: bool, state_name: str = STATE_NAME) -> None:
    """Refuse to resume a run of other inputs or options; then save ``fp`` as this run's."""
    path = os.path.join(out, state_name)
    if resume and os.path.exists(path):
        old = _saved_fingerprint(path, "plan_fingerprint")
        if old != fp:
            raise OutputError(
                f"{out}: cannot resume: the inputs or options differ from the interrupted run "
                "(start again in an empty directory, or rerun with the original options)"
            )
        return
    if resume and state_name == STATE_NAME and os.path.exists(os.path.join(out, MANIFEST_NAME)):
        old = _saved_fingerprint(os.path.join(out, MANIFEST_NAME), "created_by")
        if old != fp:
            raise OutputError(
                f"{out}: cannot resume: it holds a finished dataset made from other inputs or "
                "options"
            )
    tmp = path + f".tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"plan_fingerprint": fp, "feedpipe_version": __version__}, f)
        os.replace(tmp, path)
    except OSError as e:
        unlink_quiet(tmp)
        raise output_error(e, path) from e


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
