"""The delivery ledger: which sample ids each rank's training loop received, per epoch, written
as it goes so that a killed run leaves a valid record (``FeedLoader(ledger=DIR)``).

Layout of ``DIR``::

    ledger.json                      the dataset it belongs to: identity digest, shard sample
                                     counts, seed, shuffle, window, drop_last
    r00001-<run>/e000003-000.part    one part: one run's pass over epoch 3 on rank 1 (version
                                     1 wrote e000003/r00001-<run>-000.part: still read)

A *run* is one FeedLoader in one process (a random id). A *lineage* is what every rank of one job
shares without talking to each other: the state the job started from (a fresh start, or the mark of
the state it was loaded with), so all ranks of a job resumed from one checkpoint have the same
lineage. A *part* is the span of one epoch that one run delivered on one rank, from the position it
started at (0, or the resume point it was loaded with) to where it stopped. Each part file is one
JSON line: the part's place in the plan (epoch, rank, world size, start) and ``reached``, the
count of this rank's local positions delivered, which are always the first ones, since batches
are delivered in order. The ids delivered are the plan's ids at those positions (less the padding,
which the part lists apart); the plan is a pure function of what ``ledger.json`` holds and the
epoch, so :func:`check_ledger` computes them, and the training loop never does: computing them
costs one Feistel evaluation per sample, more than the ledger's share of the raw-read route allows
(benchmarks/bench_versions.py, phases ``ledger``). Parts of version 1, which held a bitmap of the
ids, are still read. A run's first part holds the ids of a few positions as the writer's plan
gave them; the checker refuses a run its own plan disagrees with, rather than check it against
another order. The file is rewritten whole through a temporary file and a rename at each flush
(when a run starts or resumes, about once a second while batches arrive, at every
``state_dict()``, at the epoch's end and when the pass stops), so a SIGKILL at any moment leaves
the previous flush intact; a part is a few hundred bytes, whatever ``N``, plus the ids of its
padding and drops (fewer than ``world_size`` and ``batch_size``).

The ids recorded are the plan's ids of the batches the loop received (the loader counts batches
as the training loop takes them, never the prefetched ones): the ledger proves that the resumes,
restarts and changes of world size of a whole run combined to exactly-once, which no test of the
loader alone can. ``state_dict()`` carries a mark ``{"lineage", "epoch", "position", "run",
"time"}`` (the run that saved it and when; the part records it with how far its pass had come),
so that a later run resumed from it says where it came from; :func:`check_ledger`
(:mod:`feedpipe.stream._ledger_check`) follows the marks back from the newest start to tell what
the model's history kept from what was rolled back with a killed run. A resume is on record when
``load_state_dict()`` runs, and a state taken before a pass goes into a part of its own (such
parts say ``"pass": false``); a run numbers its parts, so a lost one leaves a gap. Version 3
parts add ``skipped``, the ids the transform left out (:class:`~feedpipe.errors.SampleSkipped`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
import uuid
import zlib
from typing import Any, Protocol

import numpy as np

from ..errors import StateError
from ..plan._order import Plan, Split

LEDGER_VERSION = 2  # of ledger.json
PART_VERSION = 3  # of a part: 3 added "skipped" (version 2 wrote none) and a flush at each start
READS = (1, 2, 3)  # part versions the checker reads
FLUSH_SECONDS = 1.0
CHECKED = 4  # positions whose ids a part holds, to check the checker's plan against
FRESH = "fresh"  # the lineage of a job that started from nothing


def lineage_of(mark: dict[str, Any] | None) -> str:
    """The lineage of a job started from ``mark`` (``None``: a fresh start): the same on every
    rank that loaded the same state."""
    if mark is None:
        return FRESH
    fields = [mark.get("lineage"), mark.get("epoch"), mark.get("position")]
    if "run" in mark:  # the run that saved it (version 3): fresh starts' states never collide
        fields.append(mark["run"])
    key = json.dumps(fields)
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def part_path(root: str, epoch: int, rank: int, run: str, seq: int) -> str:
    """A part's file: one directory per run and rank, made once, not one per epoch."""
    return os.path.join(root, f"r{rank:05d}-{run}", f"e{epoch:06d}-{seq:03d}.part")


PARTS = ("r*/*.part", "e*/*.part")  # the part files of versions 2 and 1, under the root


def write_part(path: str, data: bytes) -> None:
    """``data`` at ``path`` through ``path.tmp`` and a rename: a part has one writer, so its
    temporary file needs no unique name."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_atomic(path: str, data: bytes) -> None:
    """``data`` at ``path`` through a temporary file beside it and a rename."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_part(path: str) -> tuple[dict[str, Any], np.ndarray | None]:
    """A part file's header and, for a version-1 part, its delivered-ids bitmap (packed, little
    bit order); a version-2 part has none: its ids follow from the plan (:func:`delivered`)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    head, sep, body = raw.partition(b"\n")
    if not sep:
        raise ValueError("no header line")
    header = json.loads(head)
    if not isinstance(header, dict) or header.get("version") not in READS:
        raise ValueError(f"not a ledger part of version {' or '.join(map(str, READS))}")
    if header["version"] != 1:
        if body:
            raise ValueError(f"{len(body)} bytes after its header line")
        return header, None
    bits = np.frombuffer(zlib.decompress(body), dtype=np.uint8)
    if len(bits) != (int(header["samples"]) + 7) // 8:
        raise ValueError(f"its bitmap has {len(bits)} bytes, {header['samples']} samples need "
                         f"{(int(header['samples']) + 7) // 8}")
    return header, bits


class Ordered(Protocol):
    """What the ledger reads of an epoch's plan: a dataset's :class:`Plan` or a mixture's
    epoch (the sample number at each position)."""

    @property
    def epoch(self) -> int: ...

    def sample_ids(self, positions: np.ndarray) -> np.ndarray: ...


def padding_from(split: Split) -> int:
    """The first local index of ``split`` that repeats a position as padding (its length when
    none does): local ``L`` is padding where ``L * world_size + rank >= remaining``."""
    return min(split.length, max(0, -(-(split.remaining - split.rank) // split.world_size)))


def delivered(plan: Ordered, split: Split, reached: int) -> np.ndarray:
    """The ids a version-2 part delivered: the plan's ids at the first ``reached`` local
    positions of ``split``, less the padding (listed in the part apart)."""
    return plan.sample_ids(split.positions(0, min(int(reached), padding_from(split))))


def dropped_ids(plan: Ordered, split: Split, reached: int) -> np.ndarray:
    """What a pass of ``split`` that ended at local ``reached`` left out by design: its short
    last batch (``FeedLoader(drop_last=True)``) and, on rank 0, the positions no rank gets
    (the dataset's ``drop_last=True``)."""
    ids = [plan.sample_ids(split.positions(min(int(reached), split.length), split.length))]
    if split.rank == 0 and split.dropped:
        lo = split.start + split.length * split.world_size
        ids.append(plan.sample_ids(np.arange(lo, split.num_samples, dtype=np.int64)))
    return np.concatenate(ids).astype(np.int64)


def finished_reach(split: Split, batch_size: int) -> int:
    """Where a pass of ``split`` in batches of ``batch_size`` ends (local)."""
    return min(split.length, split.batches(batch_size) * batch_size)


class Ledger:
    """One FeedLoader's ledger writer (see the module docstring).

    Args:
        root: the ledger directory (made if missing); every run of one training job writes into
            the same one.
        dataset: what the ledger belongs to: ``{"digest", "counts", "seed", "shuffle", "window",
            "drop_last"}``. A directory already holding another dataset's ledger is refused.
    """

    def __init__(self, root: str | os.PathLike[str], dataset: dict[str, Any]) -> None:
        self.root = os.fspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.info = {"version": LEDGER_VERSION, **dataset}
        self.samples = int(sum(dataset["counts"]))
        meta = os.path.join(self.root, "ledger.json")
        try:
            with open(meta, encoding="utf-8") as fh:
                have = json.load(fh)
        except FileNotFoundError:
            write_atomic(meta, json.dumps(self.info, indent=1).encode())
        except ValueError as e:
            raise StateError(f"{meta} is not a feedpipe ledger ({e}): give FeedLoader(ledger=) "
                             "a directory of its own") from e
        else:
            if have != self.info:
                what = [k for k in self.info if have.get(k) != self.info[k]]
                raise StateError(
                    f"{self.root} holds the ledger of another dataset or order (its "
                    f"{', '.join(what) or 'format'} differ): a ledger records one training "
                    "job; give this one another directory")
        self.run = uuid.uuid4().hex[:12]
        self.lineage = FRESH
        self.origin: dict[str, Any] | None = None
        self._seq = 0
        self._header: dict[str, Any] | None = None
        self._path = ""
        self._dir = ""
        self._plan: Plan | None = None
        self._split: Split | None = None
        self._batch = 1
        self._length = 0
        self._pad_from = 0  # the first padding local index (see padding_from)
        self._reached = 0
        self._last_flush = 0.0
        self._dirty = False

    @property
    def in_part(self) -> bool:
        """Whether a part is open: a pass under way or ended, not yet left (:meth:`leave`)."""
        return self._header is not None

    def leave(self) -> None:
        """The loader left its pass for another (``set_epoch``): a state taken from now on
        belongs to the pass to come, and goes on record in a part of its own."""
        self.end()
        self._header = None

    # -- a part ----------------------------------------------------------------------------
    def begin(self, plan: Plan, split: Split, batch_size: int,
              resumed_from: dict[str, Any] | None, *, record: bool = False) -> None:
        """Start the part of one pass (``split`` gives this rank's share from its start);
        ``resumed_from``: the mark of the state the loader was just loaded with. ``record``:
        no pass begins, the loader only goes on record where it stands (it was loaded, or a
        state is taken before its first pass); the pass that follows from the same place
        continues that part."""
        h = self._header
        if (h is not None and resumed_from is None and not self._reached and not h["finished"]
                and (h["epoch"], h["rank"], h["world_size"], h["start"], h["batch_size"])
                == (plan.epoch, split.rank, split.world_size, split.start, int(batch_size))):
            if not record and not h["pass"]:
                h["pass"] = True
                self._flush()
            return
        self.end()
        if resumed_from is not None:
            self.origin = dict(resumed_from)
            self.lineage = lineage_of(self.origin)
        self._plan, self._split, self._batch = plan, split, int(batch_size)
        self._length, self._pad_from = split.length, padding_from(split)
        self._reached = 0
        self._path = part_path(self.root, plan.epoch, split.rank, self.run, self._seq)
        self._seq += 1
        if os.path.dirname(self._path) != self._dir:
            self._dir = os.path.dirname(self._path)
            os.makedirs(self._dir, exist_ok=True)
        self._header = {
            "version": PART_VERSION, "run": self.run, "host": socket.gethostname(),
            "pid": os.getpid(), "created": time.time(), "lineage": self.lineage,
            "origin": self.origin, "epoch": plan.epoch,
            "rank": split.rank, "world_size": split.world_size, "start": split.start,
            "length": split.length, "positions": int(plan.num_samples),
            "batch_size": self._batch,
            "whole_batches": split.whole_batches, "samples": self.samples,
            # the node layout the epoch's plan was cut with (None: the global order)
            "layout": (list(plan.layout) if isinstance(plan, Plan) and plan.layout is not None
                       and plan.nodes > 1 else None),
            "reached": 0, "delivered": 0, "padding": [], "skipped": [],
            "dropped": [], "marks": [], "finished": False, "pass": not record}
        if self._seq == 1:  # the run's first part: the ids its plan gives, for the checker
            checked = split.positions(0, min(CHECKED, split.length))
            self._header["checked"] = [checked.tolist(), plan.sample_ids(checked).tolist()]
        # every pass is on record before its first batch: the checker tells a rank that never
        # began an epoch from one whose part is missing
        self._flush()

    def batch(self, t: int) -> None:
        """The loop received local batch ``t`` of this pass (batches arrive in order, each
        once): a counter moves; the ids are the checker's to compute."""
        lo = t * self._batch
        hi = min(lo + self._batch, self._length)
        if hi <= lo:
            return
        if hi > self._pad_from:
            self._padding(max(lo, self._pad_from), hi)
        self._reached = hi
        self._dirty = True
        now = time.monotonic()
        if now - self._last_flush >= FLUSH_SECONDS:
            self._flush(now)

    def skipped(self, ids: list[int]) -> None:
        """The transform left these samples out (:class:`~feedpipe.errors.SampleSkipped`): named
        in the part, apart from the delivered ones. Samples of batches prefetched ahead of the
        loop may be named before their batch arrives: the checker counts those of the positions
        the part reached."""
        if self._header is not None and ids:
            self._header["skipped"].extend(int(i) for i in ids)
            self._dirty = True

    def _padding(self, lo: int, hi: int) -> None:
        """Local ``[lo, hi)`` repeat positions to even the ranks out: their ids are named apart
        (neither delivered nor repeats)."""
        if self._plan is not None and self._split is not None and self._header is not None:
            self._header["padding"].extend(
                int(i) for i in self._plan.sample_ids(self._split.positions(lo, hi)))

    def mark(self, epoch: int, position: int) -> dict[str, Any]:
        """A state is being saved that resumes at global ``position`` of ``epoch`` (the next
        epoch's start after a finished one): flush, and return the mark that a run resumed from
        this state names. The part records the mark with how far its pass had come and when: a
        state resumed from proves that every rank had come as far (they deliver in lockstep),
        and tells the passes before it (kept) from those after (rolled back with it)."""
        header = self._header
        now = time.time()
        if header is not None:
            header["marks"].append([int(epoch), int(position), self._reached, now])
            self._dirty = True
            self._flush()
        return {"lineage": self.lineage, "epoch": int(epoch), "position": int(position),
                "run": self.run, "time": now}

    def finish(self) -> None:
        """The pass reached the end of this rank's share: record what was dropped by design
        (a short last batch with ``drop_last=True``, the positions no rank gets with the
        dataset's ``drop_last=True``) and flush."""
        split, header = self._split, self._header
        if split is None or header is None or self._plan is None:
            return
        header["dropped"] = dropped_ids(self._plan, split, self._reached).tolist()
        header["finished"] = True
        self._dirty = True
        self._flush()

    def end(self) -> None:
        """The pass stopped (finished or not): flush what it delivered."""
        if self._header is not None and self._dirty:
            self._flush()

    def _flush(self, now: float | None = None) -> None:
        header = self._header
        if header is None:
            return
        header["flushed"] = time.time()
        header["reached"] = self._reached
        header["delivered"] = min(self._reached, self._pad_from)
        write_part(self._path, json.dumps(header).encode() + b"\n")
        self._last_flush = time.monotonic() if now is None else now
        self._dirty = False
