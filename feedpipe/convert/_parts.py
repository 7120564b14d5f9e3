"""``feedpipe shard --part I/N``: a deterministic partition of a conversion into N parts.

Every part lists the whole source (in parallel, streamed: :mod:`~feedpipe.convert._listing`). So
it knows the global sample order: sorted by key, or the ``--shuffle`` permutation of it, exactly
the order of a single ``feedpipe shard`` run. Part ``I`` (0-based) of ``N`` takes positions
``[T*I//N, T*(I+1)//N)`` of that order (``T`` samples) and keeps only those samples in memory.

Its shards are named ``PREFIX-pIIIIIofNNNNN-SSSSSS.tar``, so parts never collide. Its state and
temporary files carry the same part tag, so N parts may write into one directory at once.
Concatenated in part order, the parts hold the single run's samples in the single run's order;
only the shard boundaries differ. :mod:`~feedpipe.convert._merge` joins them under one manifest.

Every part also hashes the whole listing and the options (the *dataset fingerprint*), so a merge
refuses parts made from different inputs or options.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ._shard_plan import shuffle_permutation
from ._sources import Listing, SampleSpec

_PART = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class PartInfo:
    """Which part a run is, and what the whole conversion is."""

    index: int
    count: int
    total_samples: int
    fingerprint: str

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def parse_part(part: str | tuple[int, int]) -> tuple[int, int]:
    """``"I/N"`` or ``(I, N)`` -> ``(I, N)`` with ``0 <= I < N`` (pure).

    Example:
        >>> parse_part("2/3")
        (2, 3)
    """
    if isinstance(part, str):
        m = _PART.match(part)
        if m is None:
            raise ValueError(f"part must look like I/N (e.g. 0/4), not {part!r}")
        i, n = int(m.group(1)), int(m.group(2))
    else:
        i, n = (int(x) for x in part)
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"part {i}/{n}: I must be in 0..N-1 (parts are numbered from 0)")
    if n > 99999:
        raise ValueError(f"part {i}/{n}: at most 99999 parts")
    return i, n


def part_range(total: int, index: int, count: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of the global order that part ``index`` of ``count`` converts.

    Example:
        >>> [part_range(10, i, 3) for i in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    return total * index // count, total * (index + 1) // count


def part_tag(index: int, count: int) -> str:
    """The tag naming a part's files: ``p00002of00003``."""
    return f"p{index:05d}of{count:05d}"


def part_prefix(prefix: str, index: int, count: int) -> str:
    """The shard name prefix of a part: ``data-p00002of00003`` (shards ``...-000000.tar``)."""
    return f"{prefix}-{part_tag(index, count)}"


def _digest_update(h: Any, spec: SampleSpec) -> None:
    h.update(spec.key.encode() + b"\0")
    for f in spec.files:
        h.update(f"{f.ext}\0{f.path}\0{f.size}\0".encode())
    for e, b in spec.extras:
        h.update(e.encode() + b"\0" + hashlib.sha256(b).digest())
    h.update(b"\1")


def select(
    samples: Iterable[SampleSpec], total: int, index: int, count: int, *, shuffle: bool, seed: int,
    options: dict[str, Any],
) -> tuple[list[SampleSpec], str]:
    """Stream ``samples`` (``total`` of them, sorted by key) and keep part ``index``'s share in
    its final order; return it with the dataset fingerprint (of all samples and ``options``).

    With ``shuffle`` the global order is
    :func:`~feedpipe.convert._shard_plan.shuffle_permutation`'s, as for a single run. Memory:
    this part's samples and, with ``shuffle``, one int64 per sample in numpy.
    """
    lo, hi = part_range(total, index, count)
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    out: list[SampleSpec | None] = [None] * (hi - lo)
    if shuffle:
        import numpy as np

        wanted = shuffle_permutation(total, seed)[lo:hi]
        order = np.argsort(wanted, kind="stable")
        targets = wanted[order].tolist()
        slots = order.tolist()
    else:
        targets = list(range(lo, hi))
        slots = list(range(hi - lo))
    k = seen = 0
    for spec in samples:
        _digest_update(h, spec)
        if k < len(targets) and targets[k] == seen:
            out[slots[k]] = spec
            k += 1
        seen += 1
    if k != len(targets) or seen != total:
        raise InputError(f"the source listing changed while it was read ({seen} samples, "
                         f"{total} expected); convert a source that nothing is writing to")
    h.update(f"total\0{total}".encode())
    return [s for s in out if s is not None], h.hexdigest()


def list_part(
    listing: Any, index: int, count: int, *, shuffle: bool, seed: int, options: dict[str, Any]
) -> tuple[Listing, PartInfo]:
    """Part ``index`` of ``count`` of a listing: its samples in final order, and all problems.

    ``listing`` is a :class:`~feedpipe.convert._listing.TreeListing` or an in-memory
    :class:`~feedpipe.convert._sources.Listing`."""
    if isinstance(listing, Listing):
        samples, total = listing.samples, len(listing.samples)
    else:
        samples, total = listing, listing.samples
    mine, fp = select(samples, total, index, count, shuffle=shuffle, seed=seed, options=options)
    part = Listing(mine, listing.problems, listing.classes, listing.ignored,
                   left_out=list(listing.left_out), hidden=list(listing.hidden))
    return part, PartInfo(index, count, total, fp)
