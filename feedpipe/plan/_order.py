"""The plan: which sample every (rank, worker) reads, in which order. Pure functions only.

**Global order.** An epoch's order is a permutation of the dataset's ``N`` samples that depends on
``(shard sample counts, seed, epoch, shuffle, window)`` only: never on the number of ranks or
workers, never on the machine. The shards are put in a random order, cut into *windows* of
``window`` consecutive shards (``None``: one window holding the whole dataset), and the samples of
each window are permuted by a keyed Feistel network. The permutation is computed on the fly for any
run of positions, so planning costs O(shards) memory, never O(samples): no Python object per
sample (benchmarks/bench_plan.py).

Keys come from ``blake2b("feedpipe-plan", seed, epoch)``: no ``seed + epoch`` aliasing, and the
same integers give the same order with any numpy on any machine.

**Split.** Positions ``start, start+1, ...`` of the global order are dealt round-robin to ranks:
rank ``r`` of ``W`` gets positions ``start + L*W + r`` for local index ``L``. Every rank gets the
same count, ``ceil(R/W)`` (the shortfall filled by repeating the first remaining positions, at most
``W-1`` repeats) or ``floor(R/W)`` with ``drop_last`` (at most ``W-1`` left out), where ``R`` is
the number of remaining positions. A rank's local positions are cut into batches of ``batch_size``,
and batch ``t`` goes to worker ``t % num_workers``: exactly the order in which a
``torch.utils.data.DataLoader`` hands batches back, so after ``c`` batches on every rank the
consumed samples are precisely global positions ``[start, start + c*batch_size*W)``. That prefix is
the whole resumable state, which is why a run saved with one world shape resumes exactly on another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError

_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def round_keys(seed: int, epoch: int, stream: int, rounds: int = _ROUNDS) -> np.ndarray:
    """Independent 64-bit keys for one permutation, from ``(seed, epoch, stream)``."""
    text = f"feedpipe-plan\0{seed}\0{epoch}\0{stream}"
    h = hashlib.blake2b(text.encode(), digest_size=8 * rounds)
    return np.frombuffer(h.digest(), dtype="<u8").astype(np.uint64)


def feistel(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` applied to ``x`` (cycle-walking balanced Feistel).

    Example:
        >>> k = round_keys(0, 0, 0)
        >>> sorted(feistel(np.arange(10, dtype=np.uint64), 10, k).tolist()) == list(range(10))
        True
    """
    if n <= 1:
        return x.astype(np.uint64, copy=True)
    bits = max(2, int(n - 1).bit_length())
    a = bits // 2
    b = bits - a

    def once(v: np.ndarray) -> np.ndarray:
        # Alternating-width Feistel on 2**bits: (hi: wa bits, lo: wb bits) ->
        # (lo, hi ^ F(lo)); each round is a bijection and the widths swap every round.
        wa, wb = a, b
        for k in keys:
            hi, lo = v >> np.uint64(wb), v & np.uint64((1 << wb) - 1)
            f = _mix(lo ^ k) & np.uint64((1 << wa) - 1)
            v = (lo << np.uint64(wa)) | (hi ^ f)
            wa, wb = wb, wa
        return v

    y = once(x.astype(np.uint64, copy=False))
    nn = np.uint64(n)
    bad = y >= nn
    while bad.any():  # cycle-walk back into [0, n); the domain is < 2n, so few rounds
        y[bad] = once(y[bad])
        bad = y >= nn
    return y


def distinct(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct values of a 1-D integer array and where each first occurs: what
    ``np.unique(a, return_index=True)`` gives, without the ``numpy.ma`` import it makes on
    first use (a cost paid inside whichever epoch first calls it).

    Example:
        >>> [x.tolist() for x in distinct(np.array([5, 2, 5, 7, 2]))]
        [[2, 5, 7], [1, 0, 3]]
    """
    order = np.argsort(a, kind="stable")
    s = a[order]
    keep = np.ones(len(s), dtype=bool)
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep], order[keep]


@dataclass(frozen=True)
class Plan:
    """The global order of one epoch.

    Args:
        counts: samples per shard, in manifest order.
        seed: the run's seed; the order is a function of it and of the other arguments.
        epoch: the epoch; each epoch has its own order.
        shuffle: ``False`` keeps manifest order.
        window: shards whose samples are mixed together (``None``: the whole dataset). A smaller
            window keeps each worker on fewer shards at once (for remote or cached reading) at the
            price of less mixing.

    Example:
        >>> p = Plan((3, 2), seed=1, epoch=0, shuffle=True)
        >>> sorted(p.sample_ids(np.arange(5)).tolist())
        [0, 1, 2, 3, 4]
    """

    counts: tuple[int, ...]
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    window: int | None = None
    _first: np.ndarray = field(init=False, repr=False, compare=False)
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    _wstart: np.ndarray = field(init=False, repr=False, compare=False)
    _starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        if counts.ndim != 1 or (counts < 0).any():
            raise PlanError("shard sample counts must be non-negative integers")
        if self.window is not None and self.window < 1:
            raise PlanError(f"window must be at least 1 shard, not {self.window}")
        first = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        object.__setattr__(self, "_first", first)
        if not self.shuffle:
            return
        seq = np.random.SeedSequence([self.seed, self.epoch, 0xF33D])
        rng = np.random.Generator(np.random.PCG64(seq))
        order = rng.permutation(len(counts))
        w = len(counts) if self.window is None else self.window
        ordered = counts[order]
        starts = np.arange(0, len(counts), max(w, 1))
        wsize = np.add.reduceat(ordered, starts) if len(counts) else np.zeros(0, np.int64)
        wstart = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(wsize, out=wstart[1:])
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_wstart", wstart)
        object.__setattr__(self, "_starts", starts)

    @property
    def num_samples(self) -> int:
        """Samples in the epoch (over every shard)."""
        return int(self._first[-1])

    @property
    def first_ids(self) -> np.ndarray:
        """The global id of each shard's first sample, and the sample count at the end (one item
        more than there are shards)."""
        return self._first

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids (manifest order) at the given positions of this epoch's order."""
        pos = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return pos.copy()
        out = np.empty(len(pos), dtype=np.int64)
        win = np.searchsorted(self._wstart, pos, side="right") - 1
        order, counts, first = self._order, np.asarray(self.counts, np.int64), self._first
        for g in distinct(win)[0]:
            sel = win == g
            lo, hi = int(self._wstart[g]), int(self._wstart[g + 1])
            keys = round_keys(self.seed, self.epoch, int(g))
            perm = feistel((pos[sel] - lo).astype(np.uint64), hi - lo, keys).astype(np.int64)
            a = int(self._starts[g])
            shards = order[a : a + (len(order) if self.window is None else self.window)]
            cum = np.zeros(len(shards) + 1, dtype=np.int64)
            np.cumsum(counts[shards], out=cum[1:])
            j = np.searchsorted(cum, perm, side="right") - 1
            out[sel] = first[shards[j]] + (perm - cum[j])
        return out

    def shard_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard index, index within shard)`` of global sample ids."""
        s = np.searchsorted(self._first, ids, side="right") - 1
        return s, ids - self._first[s]


@dataclass(frozen=True)
class Split:
    """One rank's share of the positions ``[start, N)`` of an epoch (see the module docstring)."""

    num_samples: int
    world_size: int
    rank: int
    start: int = 0
    drop_last: bool = False
    whole_batches: bool = False  # drop each rank's short last batch (FeedLoader(drop_last=True))

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise PlanError(f"world_size must be at least 1, not {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise PlanError(f"rank {self.rank} is outside a world of {self.world_size}")
        if not 0 <= self.start <= self.num_samples:
            raise PlanError(f"start {self.start} is outside an epoch of {self.num_samples} samples")

    @property
    def remaining(self) -> int:
        return self.num_samples - self.start

    @property
    def length(self) -> int:
        """Samples this rank delivers (the same on every rank)."""
        r, w = self.remaining, self.world_size
        return r // w if self.drop_last else -(-r // w)

    @property
    def padding(self) -> int:
        """Repeated samples over all ranks (``drop_last=False``), at most ``world_size - 1``."""
        return 0 if self.drop_last else self.length * self.world_size - self.remaining

    @property
    def dropped(self) -> int:
        """Samples left out over all ranks (``drop_last=True``), at most ``world_size - 1``."""
        return self.remaining - self.length * self.world_size if self.drop_last else 0

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Global positions of local indices ``[lo, hi)``."""
        local = np.arange(lo, hi, dtype=np.int64) * self.world_size + self.rank
        if self.remaining:
            local %= self.remaining  # padding repeats the first remaining positions
        return local + self.start

    def batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` this rank delivers: with ``whole_batches`` only full ones
        (the same count on every rank, since every rank has the same length)."""
        if self.whole_batches:
            return self.length // batch_size
        return -(-self.length // batch_size)

    def worker_batches(self, batch_size: int, worker: int, num_workers: int) -> range:
        """Local batch numbers of one worker: the DataLoader's round-robin order."""
        return range(worker, self.batches(batch_size), num_workers)

    def consumed(self, batches: int, batch_size: int) -> int:
        """The global position reached after every rank consumed ``batches`` batches."""
        local = min(batches * batch_size, self.length)
        return min(self.start + local * self.world_size, self.num_samples)


def worker_positions(split: Split, batch_size: int,
                     ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global positions of local batches ``ts`` (concatenated) and each batch's length."""
    starts = ts.astype(np.int64) * batch_size
    lens = np.minimum(starts + batch_size, split.length) - starts
    total = int(lens.sum())
    local = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
    local = local * split.world_size + split.rank
    if split.remaining:
        local %= split.remaining  # padding repeats the first remaining positions
    return local + split.start, lens


def batch_groups(split: Split, batch_size: int, worker: int, num_workers: int,
                 chunk: int = 16384) -> Iterator[np.ndarray]:
    """One worker's local batch numbers, about ``chunk`` samples' worth at a time: numpy's
    per-call overhead is paid per group, not per batch.

    Example:
        >>> [g.tolist() for g in batch_groups(Split(12, 1, 0), 2, 1, 2, chunk=4)]
        [[1, 3], [5]]
    """
    mine = split.worker_batches(batch_size, worker, num_workers)
    group = max(1, chunk // max(batch_size, 1))
    for g in range(0, len(mine), group):
        yield np.arange(mine.start + g * mine.step,
                        min(mine.stop, mine.start + (g + group) * mine.step), mine.step)


def iter_ids(
    plan: Plan, split: Split, batch_size: int, worker: int, num_workers: int, chunk: int = 16384
) -> Iterator[np.ndarray]:
    """For one worker, the global sample ids of each of its batches, in order."""
    for ts in batch_groups(split, batch_size, worker, num_workers, chunk):
        pos, lens = worker_positions(split, batch_size, ts)
        ids = plan.sample_ids(pos)
        at = 0
        for n in lens.tolist():
            yield ids[at : at + n]
            at += n


def all_ids(plan: Plan, split: Split, batch_size: int, num_workers: int) -> list[int]:
    """The ids one rank's DataLoader yields, in order (for tests and tools, not the hot path)."""
    per = [list(iter_ids(plan, split, batch_size, w, num_workers)) for w in range(num_workers)]
    out: list[int] = []
    for t in range(split.batches(batch_size)):
        out.extend(per[t % num_workers][t // num_workers].tolist())
    return out


def counts_tuple(counts: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(c) for c in counts)
