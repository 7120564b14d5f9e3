"""Shards joined while a tree is still being staged (the one-pass method).

The one-pass method has no plan until the last directory is staged, but the plan of an
unshuffled run is cut front to back: whether a shard ends before a sample depends only on the
samples before it (:func:`~feedpipe.convert._shard_plan.shard_full`). So the parent, which
waits on the staging workers anyway, takes each staged directory in key order as soon as it is
in, cuts its samples into shards by that rule, and appends their bytes to the shards' hidden
temp files (copied by the kernel, hashed on the way). Each staging file goes as soon as its
bytes are in a shard, and a shard is sealed (end of archive, fsync) as soon as it is full.

Nothing is committed or synced here. Once the plan's fingerprint is saved, the caller commits
the sealed shards in order (fsync, index, ``--resume`` record, rename:
:func:`~feedpipe.convert._writer.commit`), after checking that the plan cuts the samples as this
did. The temp files are named as any
shard's temp file (``.PREFIX-NNNNNN.tar.tmp-PID``), so what a failed run leaves is removed as
its other temp files are.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import OutputError
from ..format._tar import END_OF_ARCHIVE
from ._writer import append_range, hidden, output_error, seal, unlink_quiet

if TYPE_CHECKING:
    from ._onepass import Cut, StagedDir


@dataclass
class Joined:
    """A shard sealed in its temp file ``tmp``: ``total`` bytes, hashing to ``sha256``; its
    ``cuts`` landed at ``bases``."""

    name: str
    tmp: str
    samples: int = 0
    total: int = 0
    sha256: str = ""
    cuts: list[Cut] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)


class PreJoin:
    """Shards ``PREFIX-NNNNNN.tar`` of at most ``max_bytes`` (and ``max_samples``) in ``out``,
    filled from staged directories given in key order by :meth:`add`; :meth:`finish` seals the
    last one and returns them all."""

    def __init__(self, out: str, prefix: str, max_bytes: int, max_samples: int | None) -> None:
        self.out, self.prefix = out, prefix
        self.limit = max_bytes - len(END_OF_ARCHIVE)  # (the cut rule of shard_full)
        self.max_samples = max_samples
        self.shards: list[Joined] = []
        self._file: Any = None
        self._hash: Any = None
        self._bytes = 0  # the open shard's sample bytes so far

    def temps(self) -> list[str]:
        """Every temp file made so far (for the caller's cleanup)."""
        return [j.tmp for j in self.shards]

    def add(self, sd: StagedDir) -> None:
        """Append the samples of ``sd`` (the next directory in key order) to the shards, then
        remove its staging file. A failure to write is an :class:`OutputError` naming the
        shard."""
        try:
            self._add(sd)
        except OutputError:
            raise
        except OSError as e:
            raise output_error(e, os.path.join(self.out, self.shards[-1].name)) from e

    def _add(self, sd: StagedDir) -> None:
        starts = sd.starts
        limit, max_samples = self.limit, self.max_samples
        count = self.shards[-1].samples if self._file is not None else 0
        nbytes = self._bytes
        a = 0
        for i in range(len(sd.keys)):
            size = starts[i + 1] - starts[i]
            if count > 0 and (nbytes + size > limit
                              or (max_samples is not None and count >= max_samples)):
                if i > a:
                    self._append(sd.cut(a, i), i - a)
                self._seal()
                a, count, nbytes = i, 0, 0
            count += 1
            nbytes += size
        if len(sd.keys) > a:
            self._append(sd.cut(a, len(sd.keys)), len(sd.keys) - a)
        self._bytes = nbytes
        unlink_quiet(sd.path)  # (its bytes are all in shards now)

    def finish(self) -> list[Joined]:
        """Seal the shard being filled; every shard, in order."""
        if self._file is not None:
            try:
                self._seal()
            except OSError as e:
                raise output_error(e, os.path.join(self.out, self.shards[-1].name)) from e
        return self.shards

    def close(self) -> None:
        """Close the temp file being filled, which is given up (the caller removes the temp
        files): what it could not write is lost with it."""
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()
            except OSError:
                pass

    def _append(self, cut: Cut, samples: int) -> None:
        if self._file is None:
            name = f"{self.prefix}-{len(self.shards):06d}.tar"
            j = Joined(name, hidden(self.out, name, f".tmp-{os.getpid()}"))
            self.shards.append(j)
            self._file = open(j.tmp, "wb")  # noqa: SIM115 (kept open until sealed)
            self._hash = hashlib.sha256()
            self._bytes = 0
        j = self.shards[-1]
        base = j.bases[-1] + j.cuts[-1].length if j.cuts else 0
        append_range(cut.path, cut.start, cut.start + cut.length, self._file.fileno(), base,
                     self._hash, os.path.join(self.out, j.name))
        j.cuts.append(cut)
        j.bases.append(base)
        j.samples += samples

    def _seal(self) -> None:
        j = self.shards[-1]
        f = self._file
        f.seek(j.bases[-1] + j.cuts[-1].length)
        # not synced here: on ext4 an fsync commits the journal, which first writes out every
        # file's dirty data, the staging files' too (gone, unwritten, if left alone); the
        # shard is synced when it is committed, after the staging
        j.total = seal(f, self._hash, sync=False)
        j.sha256 = self._hash.hexdigest()
        self._file = None
        f.close()
