"""The resumable states of the sources: what identifies a dataset's order, and why a saved
state cannot resume a :class:`~feedpipe.FeedDataset` or a :class:`~feedpipe.Packed` (the checks
their ``state_mismatch`` and ``resume_point`` make)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .._redact import logger
from ..errors import StateError
from ..format._manifest import Manifest

log = logger("feedpipe")

STATE_VERSION = 2  # of a FeedDataset's state (a Packed's adds a ``packed`` entry to it)


def dataset_identity(manifest: Manifest) -> dict[str, Any]:
    """What identifies a dataset's order: a digest of its shards' names, sample counts, sizes and
    hashes, with the counts for messages. Two datasets with the same identity have the same
    plan for the same seed and epoch.

    Example:
        >>> from feedpipe import load_manifest
        >>> ident = dataset_identity(load_manifest("shards/example"))
        >>> ident["shards"], ident["samples"], len(ident["digest"])
        (3, 24, 32)
    """
    h = hashlib.blake2b(b"feedpipe-dataset", digest_size=16)
    for r in manifest.shards:
        h.update(f"\0{r.name}\0{r.samples}\0{r.bytes}\0{r.sha256}".encode())
    return {"digest": h.hexdigest(), "shards": len(manifest.shards),
            "samples": manifest.total_samples}


def checked_resume_point(state: Any, mismatch: Callable[[dict[str, Any]], str | None], url: str,
                         strict: bool) -> tuple[int, int]:
    """The ``(epoch, position)`` of a loader ``state`` for the dataset at ``url``, whose
    ``mismatch(state)`` says why the state is another dataset's (or ``None``): refused with a
    :class:`~feedpipe.errors.StateError`, or with ``strict=False`` logged and the saved epoch's
    start."""
    if not isinstance(state, dict) or "position" not in state:
        raise StateError("not a feedpipe loader state (no 'position'): pass what "
                         "FeedLoader.state_dict() returned")
    why = mismatch(state)
    if why is not None:
        if strict:
            raise StateError(f"cannot resume {url}: {why}; the order would differ and "
                             "samples would repeat or be lost (load_state_dict(state, "
                             "strict=False) starts the saved epoch afresh instead)")
        log.warning("feedpipe: %s: %s; starting epoch %s afresh", url, why,
                    state.get("epoch", 0))
        return int(state.get("epoch", 0)), 0
    return int(state["epoch"]), int(state["position"])


def saved_layout(state: dict[str, Any], url: str) -> tuple[int, int] | None:
    """The node layout ``state`` was saved with (``None``: the global order, also for a state
    that names none), refused with a :class:`~feedpipe.errors.StateError` when it is not
    ``[world_size, ranks_per_node]``."""
    lay = state.get("layout")
    if lay is None:
        return None
    if (not isinstance(lay, (list, tuple)) or len(lay) != 2
            or not all(isinstance(x, int) and x >= 1 for x in lay)):
        raise StateError(f"cannot resume {url}: the state's layout {lay!r} is not "
                         "[world_size, ranks_per_node]; pass what state_dict() returned")
    return (int(lay[0]), int(lay[1]))


def dataset_mismatch(state: dict[str, Any], identity: dict[str, Any],
                     order: dict[str, Any]) -> str | None:
    """Why ``state`` cannot resume a dataset of ``identity`` (:func:`dataset_identity`) read
    with ``order`` (its ``seed``, ``shuffle`` and ``shuffle_window``): a reason to show, or
    ``None``."""
    version = state.get("version")
    if version != STATE_VERSION:
        return (f"the state is version {version!r} (this feedpipe writes {STATE_VERSION}, "
                "which names the dataset it belongs to)")
    saved = state.get("dataset") or {}
    if saved.get("digest") != identity["digest"]:
        if saved.get("samples") != identity["samples"]:
            what = "another dataset"
        elif saved.get("shards") != identity["shards"]:
            what = "another shard layout"
        else:
            what = "other shards (their names, sizes or hashes differ)"
        return (f"the state was saved on {what} ({saved.get('shards')} shards, "
                f"{saved.get('samples')} samples, digest {str(saved.get('digest'))[:12]}), "
                f"this dataset has {identity['shards']} shards, {identity['samples']} samples, "
                f"digest {identity['digest'][:12]}")
    for k, value in order.items():
        if state.get(k) != value:
            return f"the state has {k}={state.get(k)!r}, this dataset {k}={value!r}"
    pos = state.get("position")
    if not isinstance(pos, int) or not 0 <= pos <= identity["samples"]:
        return f"the saved position {pos!r} is outside the epoch"
    return None


def packed_mismatch(state: dict[str, Any], entry: dict[str, Any],
                    num_rows: Callable[[int], int], seq_len: int) -> str | None:
    """Why ``state``, whose dataset matches, cannot resume a Packed whose states record
    ``entry`` (its ``seq_len``, field and strategy) and whose epoch ``e`` has ``num_rows(e)``
    rows: a reason to show, or ``None``."""
    if state.get("packed") != entry:
        return (f"the state was saved with packing {state.get('packed')!r}, this loader "
                f"packs {entry!r}; its row position would name other tokens")
    row, epoch = state.get("position"), state.get("epoch")
    if not isinstance(epoch, int) or epoch < 0:
        return f"the saved epoch {epoch!r} is not an epoch"
    # a loop that read its last batch saves the next epoch's start: a position mid-epoch
    # is at most the epoch's rows (the rows of padding a world size adds come last)
    rows = num_rows(epoch)
    if not isinstance(row, int) or not 0 <= row <= rows:
        return (f"the saved row {row!r} is outside epoch {epoch}, which has {rows} rows "
                f"of {seq_len} tokens")
    return None
