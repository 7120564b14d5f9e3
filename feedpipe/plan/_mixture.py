"""The plan of a weighted mixture of sources: which source, and which of its samples, each
position of a mixture's epoch holds. Pure functions of (the sources' shard counts, weights,
epoch size, seed, epoch) only, so any number of ranks and workers deal the same epoch, and a
position reached resumes anywhere (the :class:`~feedpipe.plan._order.Split` of the epoch's
positions is the same as a single dataset's).

**Counts.** Each epoch draws ``weights[s] * epoch_size`` samples of source ``s``, rounded by the
largest remainder so that they sum to ``epoch_size`` exactly. Default: every source once at its own
size.

**Within a source.** Its draws continue one sequence of permutations across epochs: the ``k``-th
draw ever of source ``s`` (``k = epoch * count_s + j`` for its ``j``-th draw of the epoch) is
position ``k % size_s`` of the source's own :class:`~feedpipe.plan._order.Plan` of "epoch"
``k // size_s``. No sample repeats before the whole source was drawn: a source drawn three times
its size an epoch is three whole permutations; one drawn 12% of its size continues its permutation
in the next epoch.

**Spread.** The sources are interleaved by formula
(:class:`~feedpipe.plan._interleave.Interleave`): the ``j``-th draw of source ``s`` sits in the
cell of its ideal time ``(j + 1/2) / count_s`` of the epoch (ties by source order), so every run
of consecutive positions holds each source close to its weight, not by chance.

**Memory.** Nothing is the size of the epoch: any positions' sources and draws come from the
counts by formula, and each source's ids from its own Feistel permutation per chunk (a source's
whole permutation is kept only while the kept ones stay within :data:`TABLE_BYTES`), so a reader
anywhere in an epoch of any size holds ``O(sources + shards + chunk)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import PlanError
from ._interleave import Interleave
from ._order import Plan, Split, feistel, mix, round_keys, worker_positions


def epoch_counts(sizes: Sequence[int], weights: Sequence[float] | None = None,
                 epoch_size: int | None = None) -> np.ndarray:
    """Samples drawn from each source per epoch: ``weights`` (normalised) times ``epoch_size``,
    rounded by the largest remainder (ties to the earlier source) to sum to ``epoch_size``.
    Defaults: ``weights`` the sizes, ``epoch_size`` their sum (every source once).

    Example:
        >>> epoch_counts([10, 20, 30], [1, 1, 1], 100).tolist()
        [34, 33, 33]
        >>> epoch_counts([10, 20, 30]).tolist()
        [10, 20, 30]
    """
    n = np.asarray(sizes, dtype=np.int64)
    if n.ndim != 1 or len(n) == 0 or (n < 1).any():
        raise PlanError(f"a mixture needs sources of at least one sample each, not sizes {sizes}")
    total = int(n.sum()) if epoch_size is None else int(epoch_size)
    if total < 1:
        raise PlanError(f"epoch_size must be at least 1, not {epoch_size}")
    if weights is None:
        w = n.astype(np.float64)
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != n.shape or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise PlanError(f"weights {list(weights)} must be one non-negative number per source "
                            f"({len(n)}), not all zero")
    if weights is None and epoch_size is None:
        return n.copy()
    quota = w / w.sum() * total
    counts = np.floor(quota).astype(np.int64)
    short = total - int(counts.sum())
    if short:
        order = np.lexsort((np.arange(len(n)), -(quota - counts)))  # largest remainder first
        counts[order[:short]] += 1
    return counts


# the largest Feistel domain a source's whole permutation is drawn and kept for (its table is
# made in blocks of _TABLE_BLOCK), and the most bytes of ids kept over all sources: a source past
# either draws its ids per chunk (the same ids)
_WHOLE_MAX = 1 << 18
TABLE_BYTES = 1 << 24
_TABLE_BLOCK = 1 << 18
# positions counted together by MixturePlan.source_counts
_COUNT_GROUP = 1 << 18


#: the version of the interleave (a ledger records it: one of another version is checked by the
#: feedpipe that wrote it). 1: every draw sorted by its ideal time as a float; 2: by its cell
INTERLEAVE = 2


def _source_seed(seed: int, source: int) -> int:
    h = hashlib.blake2b(f"feedpipe-mixture\0{seed}\0{source}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


class MixturePlan:
    """Which source and which of its samples each position of a mixture's epoch holds.

    Args:
        sources: each source's samples per shard (its manifest's counts).
        weights: each source's share of an epoch (normalised); ``None``: its size.
        epoch_size: positions per epoch; ``None``: the sources' total size.
        seed: the mixture's seed (each source's order comes from it and the source's index).
        shuffle: permute each source's samples (``False``: each source in manifest order); one
            flag for all, or one per source.

    Example:
        >>> plan = MixturePlan([(3,), (2, 2)], weights=[1, 1], epoch_size=6, seed=0)
        >>> src, ids = plan.draws(0, np.arange(6))
        >>> src.tolist(), sorted(ids[src == 0].tolist())
        ([0, 1, 0, 1, 0, 1], [0, 1, 2])
    """

    def __init__(self, sources: Sequence[Sequence[int]], weights: Sequence[float] | None = None,
                 epoch_size: int | None = None, seed: int = 0,
                 shuffle: bool | Sequence[bool] = True) -> None:
        self.shard_counts = [tuple(int(c) for c in s) for s in sources]
        self.sizes = np.array([sum(s) for s in self.shard_counts], dtype=np.int64)
        self.counts = epoch_counts(self.sizes.tolist(), weights, epoch_size)
        self.epoch_size = int(self.counts.sum())
        self.seed = int(seed)
        self.shuffle = ([bool(shuffle)] * len(self.counts) if isinstance(shuffle, bool)
                        else [bool(x) for x in shuffle])
        if len(self.shuffle) != len(self.counts):
            raise PlanError(f"{len(self.shuffle)} shuffle flags for {len(self.counts)} sources")
        self.interleave = Interleave(self.counts)  # which source each position holds
        self._plans: dict[tuple[int, int], Plan] = {}  # (source, cycle): its order, made once
        # source: (cycle, its whole permutation's ids), for a source an epoch draws a good part
        # of (at least a quarter of its Feistel domain): drawing it whole costs about what its
        # chunks would, and each chunk is then one lookup. One cycle a source is kept, and only
        # as many sources (smallest first) as TABLE_BYTES holds; the others draw per chunk
        self._ids: dict[int, tuple[int, np.ndarray]] = {}
        self._tabled = _tabled(self.sizes.tolist(), self.counts.tolist(), self.shuffle)
        self._tabled_at = np.array(self._tabled, dtype=bool)
        # per source: its ids come from its keyed permutation per chunk (shuffled, not kept)
        self._keyed_at = np.array(self.shuffle, dtype=bool) & ~self._tabled_at
        # (source, cycle): its permutation's round keys, and its shards' first positions in
        # its order and first ids (what Plan.sample_ids reads of it), kept with its Plan
        self._parts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _plan(self, source: int, cycle: int) -> Plan:
        """The order of ``source``'s ``cycle``-th permutation (a few are kept: a reader asks for
        the same ones chunk after chunk of an epoch)."""
        key = (source, cycle)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 4 * len(self.counts):
                self._plans.clear()
                self._parts.clear()
            plan = self._plans[key] = Plan(self.shard_counts[source],
                                           _source_seed(self.seed, source), cycle,
                                           self.shuffle[source])
        return plan

    def _whole(self, source: int, cycle: int) -> np.ndarray | None:
        """Every sample id of ``source``'s ``cycle``-th permutation, in order, made once and kept
        while chunks of the epoch draw from it; ``None`` where drawing it whole would cost far
        more than the epoch draws of it (a source drawn a small share of its size an epoch),
        or where the source is not shuffled (its ids are its draws' places)."""
        if not self._tabled[source]:
            return None
        kept = self._ids.get(source)
        if kept is None or kept[0] != cycle:
            kept = self._ids[source] = (cycle, whole_permutation(self._plan(source, cycle)))
        return kept[1]

    def draws(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source and the sample id within it (its manifest order) at each of
        ``positions`` of ``epoch``."""
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) and (pos.min() < 0 or pos.max() >= self.epoch_size):
            raise PlanError(f"positions outside an epoch of {self.epoch_size}")
        src, draw = self.interleave.at(pos)
        cycle, at = np.divmod(int(epoch) * self.counts[src] + draw, self.sizes[src])
        # positions far apart (a rank's share of a large world): a reader draws a small share of
        # each cycle, so a cycle not kept yet is not worth drawing whole
        sparse = len(pos) > 1 and int(pos.max() - pos.min()) > 8 * len(pos)
        return src, self._sample_ids(src, cycle, at, sparse)

    def source_ids(self, source: int, first: int, last: int) -> np.ndarray:
        """The sample ids of ``source``'s draws ``first`` to ``last`` (exclusive), its draws
        numbered across epochs (draw ``j`` of epoch ``e`` is ``e * counts[source] + j``): what
        :meth:`draws` gives for them.

        Example:
            >>> plan = MixturePlan([(3,), (2, 2)], weights=[1, 1], epoch_size=6, seed=0)
            >>> src, ids = plan.draws(1, np.arange(6))
            >>> plan.source_ids(0, 3, 6).tolist() == ids[src == 0].tolist()
            True
        """
        k = np.arange(int(first), int(last), dtype=np.int64)
        src = np.full(len(k), int(source), dtype=np.int64)
        cycle, at = np.divmod(k, self.sizes[source])
        return self._sample_ids(src, cycle, at, False)

    def _sample_ids(self, src: np.ndarray, cycle: np.ndarray, at: np.ndarray,
                    sparse: bool) -> np.ndarray:
        """The sample id of draw ``at`` of the ``cycle``-th permutation of ``src`` (each)."""
        ids = at.copy()
        tabled = self._tabled_at[src]
        keyed = self._keyed_at[src]
        if tabled.any():
            sel = np.flatnonzero(tabled)
            for (s, k), where in _groups(src[sel], cycle[sel]):
                got = sel[where]
                kept = self._ids.get(s)
                if sparse and (kept is None or kept[0] != k):
                    keyed[got] = True
                    continue
                ids[got] = self._whole(s, k)[at[got]]  # type: ignore[index]
        if keyed.any():
            sel = np.flatnonzero(keyed)
            ids[sel] = self._keyed_ids(src[sel], cycle[sel], at[sel])
        return ids

    def _keyed_ids(self, src: np.ndarray, cycle: np.ndarray, at: np.ndarray) -> np.ndarray:
        """``self._plan(s, k).sample_ids([a])`` for each ``(s, k, a)``, every source's Feistel
        rounds run together (one set of numpy calls a chunk, not one a source)."""
        pairs = _groups(src, cycle)
        m = len(pairs)
        n = np.empty(m, dtype=np.uint64)
        keys = np.empty((m, len(round_keys(0, 0, 0))), dtype=np.uint64)
        bases = np.zeros(m + 1, dtype=np.int64)  # each pair's places, laid end to end
        cums, firsts, which = [], [], np.empty(len(src), dtype=np.int64)
        for i, ((s, k), where) in enumerate(pairs):
            plan = self._plan(s, k)
            parts = self._parts.get((s, k))
            if parts is None:
                parts = self._parts[(s, k)] = _keyed_parts(plan)
            n[i], bases[i + 1] = plan.num_samples, bases[i] + plan.num_samples
            keys[i] = parts[0]
            cums.append(parts[1] + bases[i])
            firsts.append(parts[2])
            which[where] = i
        perm = feistel_many(at.astype(np.uint64), n[which], keys[which]).astype(np.int64)
        cum, first = np.concatenate(cums), np.concatenate(firsts)
        x = perm + bases[which]
        j = np.searchsorted(cum, x, side="right") - 1  # the shard of the order it falls in
        return np.asarray(first[j] + (x - cum[j]), dtype=np.int64)

    def source_counts(self, split: Split, batch_size: int, batches: int) -> np.ndarray:
        """Samples of each source in the first ``batches`` batches of ``batch_size`` of a
        rank's ``split``: by formula for one rank (its positions are one run), else counted a
        bounded group of batches at a time."""
        n = min(batches, split.batches(batch_size))
        if split.world_size == 1:
            hi = split.start + min(n * batch_size, split.length)
            return self.interleave.before(hi) - self.interleave.before(split.start)
        out = np.zeros(len(self.counts), dtype=np.int64)
        group = max(1, _COUNT_GROUP // max(batch_size, 1))
        for t in range(0, n, group):
            pos, _ = worker_positions(split, batch_size, np.arange(t, min(n, t + group)))
            out += np.bincount(self.interleave.at(pos)[0], minlength=len(self.counts))
        return out


def _groups(src: np.ndarray, cycle: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray]]:
    """The distinct ``(source, cycle)`` pairs of the arrays, each with where it occurs."""
    lo = int(cycle.min())
    key = src * (int(cycle.max()) - lo + 1) + (cycle - lo)
    order = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    out = []
    for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(order)].tolist(), strict=True):
        i = int(order[a])
        out.append(((int(src[i]), int(cycle[i])), order[a:b]))
    return out


def _keyed_parts(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :meth:`Plan.sample_ids` reads of a shuffled plan of one window: its round keys, the
    first position of each shard in its order (and the total), each such shard's first id."""
    order = plan._order
    cum = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(np.asarray(plan.counts, dtype=np.int64)[order], out=cum[1:])
    first = np.append(plan.first_ids[order], plan.num_samples)
    return round_keys(plan.seed, plan.epoch, 0), cum, first


def feistel_many(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """:func:`~feedpipe.plan._order.feistel` of each ``x[i]`` over ``[0, n[i])`` with round keys
    ``keys[i]``: element by element the same bijections, for many domains in one pass.

    Example:
        >>> k = np.stack([round_keys(1, 0, 0), round_keys(2, 5, 0)])
        >>> x, n = np.array([3, 4], np.uint64), np.array([10, 1000], np.uint64)
        >>> feistel_many(x, n, k).tolist() == [int(feistel(x[:1], 10, k[0])[0]),
        ...                                    int(feistel(x[1:], 1000, k[1])[0])]
        True
    """
    bits = np.maximum(2, _bit_length(np.maximum(n, 2) - np.uint64(1)))
    wa0 = bits // np.uint64(2)
    wb0 = bits - wa0
    one = np.uint64(1)

    def once(v: np.ndarray, wa: np.ndarray, wb: np.ndarray, k: np.ndarray) -> np.ndarray:
        for r in range(k.shape[1]):  # as feistel(): (hi, lo) -> (lo, hi ^ F(lo)), widths swap
            hi, lo = v >> wb, v & ((one << wb) - one)
            f = mix(lo ^ k[:, r]) & ((one << wa) - one)
            v = (lo << wa) | (hi ^ f)
            wa, wb = wb, wa
        return v

    y = once(x.astype(np.uint64, copy=False), wa0, wb0, keys)
    bad = np.flatnonzero(y >= n)
    while len(bad):  # cycle-walk back into each domain
        y[bad] = once(y[bad], wa0[bad], wb0[bad], keys[bad])
        bad = bad[y[bad] >= n[bad]]
    return np.where(n <= one, x, y)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """``int.bit_length`` of each element (of values below 2**63)."""
    out = np.zeros(len(v), dtype=np.uint64)
    v = v.copy()
    for shift in (32, 16, 8, 4, 2, 1):
        s = np.uint64(shift)
        big = v >= (np.uint64(1) << s)
        out[big] += s
        v[big] >>= s
    return out + (v > 0).astype(np.uint64)


def _tabled(sizes: list[int], counts: list[int], shuffle: list[bool]) -> list[bool]:
    """Which sources keep their whole permutation: shuffled ones an epoch draws at least a
    quarter of the Feistel domain of, within :data:`_WHOLE_MAX`, the smallest first while their
    ids (8 bytes each) fit :data:`TABLE_BYTES` together."""
    out = [False] * len(sizes)
    left = TABLE_BYTES
    for s in sorted(range(len(sizes)), key=sizes.__getitem__):
        d = 1 << max(2, int(sizes[s] - 1).bit_length())
        if shuffle[s] and d <= 4 * counts[s] and d <= _WHOLE_MAX and 8 * sizes[s] <= left:
            out[s] = True
            left -= 8 * sizes[s]
    return out


def whole_permutation(plan: Plan) -> np.ndarray:
    """``plan.sample_ids(np.arange(plan.num_samples))`` for a shuffled :class:`Plan` of one
    window, computed as a table: the Feistel rounds run once over the whole power-of-two
    domain (no element twice), and the cycle walk back into ``[0, n)`` is table lookups, not
    more rounds.

    Example:
        >>> p = Plan((5, 3, 9), seed=4, epoch=2)
        >>> whole_permutation(p).tolist() == p.sample_ids(np.arange(17)).tolist()
        True
    """
    n = plan.num_samples
    bits = max(2, (n - 1).bit_length())
    # the same network feistel() uses on [0, n): its widths come from the bits of n - 1 only
    keys = round_keys(plan.seed, plan.epoch, 0)
    table = np.empty(1 << bits, dtype=np.int64)
    for lo in range(0, 1 << bits, _TABLE_BLOCK):  # in blocks: the rounds' temporaries stay small
        hi = min(lo + _TABLE_BLOCK, 1 << bits)
        table[lo:hi] = feistel(np.arange(lo, hi, dtype=np.uint64), 1 << bits, keys)
    perm = table[:n].copy()
    bad = np.flatnonzero(perm >= n)
    while len(bad):
        perm[bad] = table[perm[bad]]
        bad = bad[perm[bad] >= n]
    order = plan._order
    counts = np.asarray(plan.counts, dtype=np.int64)[order]
    starts = np.zeros(len(order), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    j = np.searchsorted(starts, perm, side="right") - 1
    return np.asarray(plan.first_ids[order][j] + (perm - starts[j]), dtype=np.int64)


class MixtureEpoch:
    """A mixture's epoch as the batch loop reads a plan: the sample number (in
    the mixture's numbering: its sources' samples one after the other) at each position."""

    def __init__(self, plan: MixturePlan, epoch: int, bases: np.ndarray) -> None:
        self.mixture_plan, self.epoch, self.bases = plan, int(epoch), bases

    @property
    def num_samples(self) -> int:
        return self.mixture_plan.epoch_size

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        src, ids = self.mixture_plan.draws(self.epoch, positions)
        return np.asarray(self.bases[src] + ids, dtype=np.int64)
