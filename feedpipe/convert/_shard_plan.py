"""Planning a conversion: samples cut into shards, shards into parts, and the plan's fingerprint.

Everything here is pure. A plan is ``plan[shard][part] -> [SampleSpec, ...]``. A shard holds at
most ``max_samples`` samples and ``max_bytes`` bytes of tar (exact member sizes, the end of
archive included). It exceeds ``max_bytes`` only to hold one sample larger than it. Each shard
is cut into parts of at most ``part_samples`` samples and :data:`PART_BYTES` bytes: the unit one
worker writes. The fingerprint hashes the plan and the options that decide the output bytes, so
a resumed run can tell whether it continues the same conversion.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..format._tar import BLOCK, END_OF_ARCHIVE, member_header, padded
from ._sources import SampleSpec

PART_SAMPLES = 1024
PART_BYTES = 32 << 20

Plan = list[list[list[SampleSpec]]]


def member_size(name: str, size: int) -> int:
    """Bytes one member takes in the tar (header, long-name record, padded data).

    Example:
        >>> member_size("a/0.jpg", 10), member_size("x" * 120 + ".jpg", 10)
        (1024, 2048)
    """
    if len(name.encode("utf-8")) <= 100:
        return BLOCK + padded(size)
    return len(member_header(name, size)) + padded(size)


def sample_size(spec: SampleSpec) -> int:
    """Bytes a sample's members take in the tar."""
    # a plain loop with the short-name case inline: planning runs it once per sample, serially
    total = 0
    key = spec.key
    for f in spec.files:
        name = f"{key}.{f.ext}"
        if name.isascii() and len(name) <= 100:
            total += BLOCK + (f.size + BLOCK - 1) // BLOCK * BLOCK
        else:
            total += member_size(name, f.size)
    for e, b in spec.extras:
        total += member_size(f"{key}.{e}", len(b))
    return total


def shard_full(shard_bytes: int, shard_count: int, size: int, max_bytes: int,
               max_samples: int | None) -> bool:
    """Whether a shard holding ``shard_count`` samples of ``shard_bytes`` bytes must be closed
    before a sample of ``size`` bytes (the cut rule every writer shares)."""
    return shard_count > 0 and (
        shard_bytes + size > max_bytes - len(END_OF_ARCHIVE)
        or (max_samples is not None and shard_count >= max_samples))


def plan_shards(samples: list[SampleSpec], max_bytes: int, max_samples: int | None,
                part_samples: int = PART_SAMPLES, sizes: list[int] | None = None) -> Plan:
    """Cut samples into shards, and each shard into parts. ``sizes``: each sample's
    :func:`sample_size`, where the caller knows them already (one-pass staging wrote them).

    Example:
        >>> from feedpipe.convert._sources import FileRef
        >>> specs = [SampleSpec(str(i), [FileRef("bin", f"{i}.bin", 10)]) for i in range(5)]
        >>> [[len(p) for p in s] for s in plan_shards(specs, 1 << 20, 2)]
        [[2], [2], [1]]
    """
    shards: Plan = []
    cur: list[list[SampleSpec]] = []
    part: list[SampleSpec] = []
    shard_bytes = part_bytes = 0
    shard_count = 0
    limit = max_bytes - len(END_OF_ARCHIVE)
    for i, spec in enumerate(samples):
        size = sample_size(spec) if sizes is None else sizes[i]
        full = shard_count > 0 and (
            shard_bytes + size > limit or (max_samples is not None and shard_count >= max_samples)
        )
        if full:
            if part:
                cur.append(part)
            shards.append(cur)
            cur, part, shard_bytes, part_bytes, shard_count = [], [], 0, 0, 0
        if part and (len(part) >= part_samples or part_bytes + size > PART_BYTES):
            cur.append(part)
            part, part_bytes = [], 0
        part.append(spec)
        part_bytes += size
        shard_bytes += size
        shard_count += 1
    if part:
        cur.append(part)
    if cur:
        shards.append(cur)
    return shards


def plan_fingerprint(options: dict[str, Any], plan: Plan) -> str:
    """A digest of the output-deciding ``options`` and of every sample of ``plan`` (its shard,
    key, files with their sizes, and extra fields)."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    # the same bytes as one update per field, gathered into few updates (a shard's text at once)
    for s, parts in enumerate(plan):
        text: list[str] = []
        add = text.append
        for part in parts:
            for spec in part:
                files = spec.files
                if len(files) == 1:  # (most samples: their text in one piece)
                    ext, path, size = files[0]
                    add(f"{s}\0{spec.key}\0{ext}\0{path}\0{size}\0")
                else:
                    add(f"{s}\0{spec.key}\0")
                    for f in files:
                        add(f"{f.ext}\0{f.path}\0{f.size}\0")
                if spec.extras:
                    h.update("".join(text).encode())
                    text.clear()
                    for e, b in spec.extras:
                        h.update(e.encode() + b"\0" + hashlib.sha256(b).digest())
        h.update("".join(text).encode())
    return h.hexdigest()


def shuffle_permutation(n: int, seed: int) -> Any:
    """The ``--shuffle`` order: position ``k`` holds sorted sample ``perm[k]`` (a numpy array).

    Example:
        >>> sorted(shuffle_permutation(5, 0).tolist())
        [0, 1, 2, 3, 4]
    """
    import numpy as np

    return np.random.default_rng(np.random.SeedSequence([seed, 0x5A4D])).permutation(n)


def shuffled(samples: list[SampleSpec], seed: int) -> list[SampleSpec]:
    """``samples`` in the ``--shuffle`` order of ``seed``."""
    return [samples[i] for i in shuffle_permutation(len(samples), seed)]
