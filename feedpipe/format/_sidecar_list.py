"""The manifest's list of sidecar files: the ``.npy`` arrays that lie beside the shards (image
sizes ``.sizes.npy``, video frame counts ``.frames.npy``, token counts ``.lengths.npy``), each
named with its shard, size and SHA-256 as the shards are, so that ``feedpipe verify`` finds one
missing or changed and whatever copies a dataset by its manifest knows them.

``manifest.json`` lists them under ``"sidecars"``::

    "sidecars": [{"name": "data-000000.frames.npy", "shard": "data-000000.tar",
                  "bytes": 176, "sha256": "..."}]

A manifest written before sidecars were listed has no such entry and reads as listing none.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

SUFFIXES: tuple[str, ...] = (".sizes.npy", ".frames.npy", ".lengths.npy")
"""The sidecar files a shard may have beside it, by the suffix that replaces its ``.tar``."""

_KEYS = ("name", "shard", "bytes", "sha256")


def sidecar_name(shard: str, suffix: str) -> str:
    """``data-000000.tar`` -> ``data-000000<suffix>``."""
    stem = shard[:-4] if shard.endswith(".tar") else shard
    return f"{stem}{suffix}"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def list_sidecars(root: str, shards: list[str]) -> list[dict[str, Any]]:
    """The records of the sidecar files beside ``shards`` (names relative to the local
    directory ``root``) that exist, in shard order, then :data:`SUFFIXES` order."""
    out = []
    for shard in shards:
        for suffix in SUFFIXES:
            name = sidecar_name(shard, suffix)
            path = os.path.join(root, name)
            if os.path.isfile(path):
                out.append({"name": name, "shard": shard, "bytes": os.path.getsize(path),
                            "sha256": file_sha256(path)})
    return out


def check_sidecars(value: object) -> str | None:
    """Why ``value`` is not a manifest's ``"sidecars"`` list, or ``None`` where it is one (a
    list of objects with a relative ``name``, the ``shard`` it lies beside, ``bytes`` and
    ``sha256``).

    Example:
        >>> check_sidecars([{"name": "a.frames.npy", "shard": "a.tar", "bytes": 1,
        ...                  "sha256": "0" * 64}]) is None
        True
    """
    if not isinstance(value, list):
        return f"\"sidecars\" must be a list of objects, not {value!r}"
    for i, s in enumerate(value):
        at = f"sidecars[{i}]"
        if not isinstance(s, dict) or set(s) != set(_KEYS):
            return f"{at} must be an object with {', '.join(_KEYS)}, not {s!r}"
        name, sha, n = s["name"], s["sha256"], s["bytes"]
        if (not isinstance(name, str) or not name or name.startswith("/") or "://" in name
                or ".." in name.split("/")):
            return f"{at}.name must be a path relative to the dataset root, not {name!r}"
        if not isinstance(s["shard"], str):
            return f"{at}.shard must be a shard's name, not {s['shard']!r}"
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return f"{at}.bytes must be a non-negative integer, not {n!r}"
        if not (isinstance(sha, str) and len(sha) == 64 and not sha.strip("0123456789abcdef")):
            return f"{at}.sha256 must be 64 lowercase hex digits, not {sha!r}"
    return None


def sidecar_problems(read: Any, join: Any, root: str,
                     sidecars: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(url, message)`` for each listed sidecar file of ``root`` that is missing or differs
    from the manifest (size, then SHA-256); ``read(url)`` gives a file's bytes (raising
    ``OSError`` where there is none), ``join(root, name)`` its URL."""
    out = []
    for s in sidecars:
        url = join(root, s["name"])
        fix = (f"restore it from where the dataset came from, or write it again (for "
               f"{s['shard']}: `feedpipe index {root}` after feedpipe.record_video_frames / "
               "record_image_sizes with overwrite=True)")
        try:
            data = read(url)
        except OSError as e:
            out.append((url, f"{url}: the sidecar file the manifest lists is missing or cannot "
                             f"be read ({type(e).__name__}); {fix}"))
            continue
        if len(data) != s["bytes"]:
            out.append((url, f"{url}: the sidecar file is {len(data)} bytes, the manifest says "
                             f"{s['bytes']}; {fix}"))
        elif hashlib.sha256(data).hexdigest() != s["sha256"]:
            out.append((url, f"{url}: sha256 mismatch: the sidecar file differs from the "
                             f"manifest; {fix}"))
    return out
