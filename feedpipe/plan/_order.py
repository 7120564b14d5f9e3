"""The plan: which sample every (rank, worker) reads, in which order. Pure functions only.

**Global order.** An epoch's order is a permutation of the dataset's ``N`` samples that depends on
``(shard sample counts, seed, epoch, shuffle, window)`` only (and on the node layout where one is
given: see below): never on the number of ranks or workers, never on the machine. The shards are
put in a random order, cut into *windows* of ``window`` consecutive shards (``None``: one window
holding the whole dataset), and the samples of each window are permuted by a keyed Feistel
network. The permutation is computed on the fly for any run of positions, so planning costs
O(shards) memory, never O(samples): no Python object per sample (benchmarks/bench_plan.py).

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

**Node layout** (``Plan(layout=(world_size, ranks_per_node))``, :func:`node_quotas`). With a shuffle
over all shards every rank's samples touch every shard, so every node (the ranks that share a cache
directory: ranks ``k*ranks_per_node .. (k+1)*ranks_per_node - 1`` form node ``k``) would fetch the
whole dataset each epoch. A node layout puts the epoch's shard order end to end and cuts it into one
contiguous *piece* per node, of exactly as many samples as the split deals that node's ranks (so a
shard is cut in two only where a piece ends: at most ``nodes - 1`` shards are shared, each by two
neighbouring nodes). The positions the split deals to node ``k`` walk its piece in order, and the
piece is mixed by windows (of ``window`` pieces of shards; ``None``: the whole piece) as the global
order is. Each node reads only its piece: its samples, plus the rest of at most the two boundary
shards it shares. The shard order, and so the pieces, change every epoch. It is still one
permutation of positions, so exactly-once, the prefix state and elastic resume hold as before; a
resume on another world keeps the saved epoch's layout for the rest of that epoch (its nodes no
longer match: they read other nodes' pieces) and the next epoch is laid out for the new world. With
one node the layout is the global order above, the same ids.
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


mix = _mix  # the name other plan modules use (the mixture's Feistel rounds over many domains)


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
        layout: ``(world_size, ranks_per_node)``: give each node a piece of the shards of its own
            (see the module docstring); ``None`` or one node: the global order.

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
    layout: tuple[int, int] | None = None
    _first: np.ndarray = field(init=False, repr=False, compare=False)
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    _wstart: np.ndarray = field(init=False, repr=False, compare=False)
    _starts: np.ndarray = field(init=False, repr=False, compare=False)
    _seg: np.ndarray = field(init=False, repr=False, compare=False)
    _seg_shard: np.ndarray = field(init=False, repr=False, compare=False)
    _seg_lo: np.ndarray = field(init=False, repr=False, compare=False)
    _off: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        if counts.ndim != 1 or (counts < 0).any():
            raise PlanError("shard sample counts must be non-negative integers")
        if self.window is not None and self.window < 1:
            raise PlanError(f"window must be at least 1 shard, not {self.window}")
        if self.layout is not None and (self.layout[0] < 1 or self.layout[1] < 1):
            raise PlanError(f"a node layout needs at least 1 rank and 1 rank per node, not "
                            f"world_size={self.layout[0]}, ranks_per_node={self.layout[1]}")
        first = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        object.__setattr__(self, "_first", first)
        if not self.shuffle:
            return
        seq = np.random.SeedSequence([self.seed, self.epoch, 0xF33D])
        rng = np.random.Generator(np.random.PCG64(seq))
        order = rng.permutation(len(counts))
        if self.nodes > 1:
            self._lay_out(counts, order)
            return
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
    def nodes(self) -> int:
        """How many nodes the epoch is laid out for; one is the global order."""
        if self.layout is None or not self.shuffle:
            return 1
        return -(-self.layout[0] // self.layout[1])

    def _lay_out(self, counts: np.ndarray, order: np.ndarray) -> None:
        """Cut the shard order into the nodes' pieces: *segments* (a shard, or the part of one
        inside a piece), then windows of ``window`` segments inside each piece."""
        ws, rpn = self.layout or (1, 1)
        quota = node_quotas(int(counts.sum()), ws, rpn)
        off = np.zeros(len(quota) + 1, dtype=np.int64)
        np.cumsum(quota, out=off[1:])
        cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(counts[order], out=cum[1:])
        # every shard end and piece end, in layout coordinates (repeats give empty runs, dropped)
        cuts = np.sort(np.concatenate((cum, off)), kind="stable")
        lo, hi = cuts[:-1], cuts[1:]
        keep = hi > lo
        lo, hi = lo[keep], hi[keep]
        at = np.searchsorted(cum, lo, side="right") - 1  # which shard of the order
        node = np.searchsorted(off, lo, side="right") - 1
        seg = np.zeros(len(lo) + 1, dtype=np.int64)
        seg[:-1], seg[-1] = lo, int(off[-1])
        w = len(lo) if self.window is None else self.window
        first_of_node = np.searchsorted(node, np.arange(len(quota)), side="left")
        starts = np.flatnonzero((np.arange(len(lo)) - first_of_node[node]) % max(w, 1) == 0)
        wstart = np.append(seg[starts], seg[-1])
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_wstart", wstart)
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_seg", seg)
        object.__setattr__(self, "_seg_shard", order[at])
        object.__setattr__(self, "_seg_lo", lo - cum[at])
        object.__setattr__(self, "_off", off)

    def node_shards(self, node: int) -> np.ndarray:
        """The shards node ``node`` reads this epoch, in the order its piece holds them (every
        shard for the global order)."""
        if self.nodes == 1:
            return np.flatnonzero(np.asarray(self.counts) > 0) if not self.shuffle else \
                self._order[np.asarray(self.counts, np.int64)[self._order] > 0]
        a, b = np.searchsorted(self._seg[:-1], self._off[node : node + 2], side="left")
        return self._seg_shard[a:b]

    def _layout_positions(self, pos: np.ndarray) -> np.ndarray:
        """Where each position lies in the pieces laid end to end: node ``k``'s ``j``-th
        position (in increasing order) is its piece's ``j``-th sample."""
        ws, rpn = self.layout or (1, 1)
        r = pos % ws
        k = r // rpn
        n_k = np.minimum(rpn, ws - k * rpn)
        return self._off[k] + (pos // ws) * n_k + (r - k * rpn)

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
        if self.nodes > 1:
            return self._node_ids(self._layout_positions(pos))
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

    def _node_ids(self, x: np.ndarray) -> np.ndarray:
        """Global ids at layout positions ``x``: each window of segments permuted by its own
        keyed Feistel network (window ``g`` of the layout, numbered across the nodes)."""
        out = np.empty(len(x), dtype=np.int64)
        win = np.searchsorted(self._wstart, x, side="right") - 1
        seg, first = self._seg, self._first
        # grouped by window once (a whole epoch's positions span a window per node)
        by = np.argsort(win, kind="stable")
        sw = win[by]
        cuts = np.flatnonzero(np.diff(sw)) + 1
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(sw)].tolist(), strict=True):
            if a == b:
                continue
            g = int(sw[a])
            sel = by[a:b]
            lo, hi = int(self._wstart[g]), int(self._wstart[g + 1])
            keys = round_keys(self.seed, self.epoch, g)
            perm = feistel((x[sel] - lo).astype(np.uint64), hi - lo, keys).astype(np.int64) + lo
            j = np.searchsorted(seg, perm, side="right") - 1
            out[sel] = first[self._seg_shard[j]] + self._seg_lo[j] + (perm - seg[j])
        return out

    def shard_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard index, index within shard)`` of global sample ids."""
        s = np.searchsorted(self._first, ids, side="right") - 1
        return s, ids - self._first[s]


def node_quotas(num_samples: int, world_size: int, ranks_per_node: int) -> np.ndarray:
    """Positions of ``[0, num_samples)`` the split deals to each node's ranks (ranks
    ``k*ranks_per_node`` up to ``(k+1)*ranks_per_node - 1``; the last node may have fewer).

    Example:
        >>> node_quotas(10, 4, 2).tolist()
        [6, 4]
    """
    starts = np.arange(0, world_size, ranks_per_node, dtype=np.int64)
    n_k = np.minimum(ranks_per_node, world_size - starts)
    extra = np.clip(num_samples % world_size - starts, 0, n_k)
    return n_k * (num_samples // world_size) + extra


@dataclass(frozen=True)
class Split:
    """One rank's share of the positions ``[start, N)`` of an epoch (see the module docstring)."""

    num_samples: int
    world_size: int
    rank: int
    start: int = 0
    drop_last: bool = False
    whole_batches: bool = False  # drop each rank's short last batch (FeedLoader(drop_last=True))
    # pad a rank with its own previous sample, not the first remaining ones (another rank's):
    # under a node layout the padding then stays in the node's piece
    pad_own: bool = False

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
        return self.padded(local) + self.start

    def padded(self, local: np.ndarray) -> np.ndarray:
        """Offsets from ``start`` with the padding resolved: past the remaining positions,
        the first remaining positions again, or (``pad_own``) the rank's own previous one."""
        if not self.remaining:
            return local
        if self.pad_own:
            back = local - self.world_size
            local = np.where((local >= self.remaining) & (back >= 0), back, local)
        return local % self.remaining

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
    return split.padded(local) + split.start, lens


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
