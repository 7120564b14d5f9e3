"""``Mixture``: a weighted mixture of named :class:`~feedpipe.FeedDataset` sources, read by the
same batch loop and routes as one dataset.

A mixture is one more *source* of the batch loop, not another loader. Its epoch's positions are
dealt to ranks, workers and batches exactly as one dataset's (a :class:`~feedpipe.plan._order.
Split` of ``epoch_size`` positions); what differs is what a position holds, which the
:class:`~feedpipe.plan._mixture.MixturePlan` says as a pure function of (seed, epoch). Its
samples are numbered in one space, the sources' shards one after the other
(:class:`MixtureShards`), so that the parts of a route that address samples by number (the
``refs`` fetch, the I/O tally, the ``rows`` sink's page drops) read a mixture as they read one
dataset. The ``samples`` fetch becomes :class:`MixtureFetch`, which reads each sample through its
own source (its ``decode=``, seed and cache), and the transform is each sample's source's
(:class:`BySource`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import FeedpipeError, PlanError, StateError
from ..plan._mixture import MixturePlan
from ..plan._order import Split, worker_positions
from ._batch_loop import EpochReader, Item, SampleFetch, Skips
from ._dataset import FeedDataset
from ._epoch import EpochState

if TYPE_CHECKING:
    from ..format._reader import ShardReader
    from ..plan._world import World

log = logging.getLogger("feedpipe")

STATE_VERSION = 1


class MixtureError(FeedpipeError, ValueError):
    """A :class:`~feedpipe.Mixture` cannot be made or read as asked; the message names the
    source."""


class MixtureShards:
    """The shards of every source of a mixture as one numbered set: shard ``k`` of source ``s``
    is shard ``offset[s] + k``, and a sample's number is its source's first number plus its id
    in the source. Reading is the sources' own :class:`~feedpipe.ShardSet`'s (their caches,
    verification and open-shard limits)."""

    def __init__(self, sets: Sequence[Any]) -> None:
        self.sets = list(sets)
        self.offsets = np.cumsum([0] + [len(s) for s in self.sets])  # per source: first shard
        self.bases = np.cumsum([0] + [s.num_samples for s in self.sets])  # first sample
        self.names = tuple(n for s in self.sets for n in s.names)
        self.counts = tuple(c for s in self.sets for c in s.counts)
        self.first = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.first[1:])
        #: per shard of the union: its source
        self.source_of = np.repeat(np.arange(len(self.sets)), [len(s) for s in self.sets])
        # per shard of the union: its source's set and its number there (looked up per batch
        # and shard by the refs route)
        self._at = [(s, k) for s in self.sets for k in range(len(s))]
        self._where_n = [(i, k) for i, s in enumerate(self.sets) for k in range(len(s))]
        # every shard's reader, once every set keeps all its shards open (open_all): none is
        # closed while they are, so a batch looks its shards up here, and holds none
        self._fixed: list[ShardReader] | None = None
        #: per shard of the union: its source's first sample number and its source's seed
        self.base_of = self.bases[self.source_of]
        fields: dict[str, None] = {}
        for s in self.sets:
            fields.update(dict.fromkeys(s.manifest.fields))
        self.manifest = UnionManifest([r for s in self.sets for r in s.manifest.shards],
                                      list(fields), int(self.first[-1]))
        # the sources' prefetchers are planned by one dataset's plan, not a mixture's: the
        # mixture's sources fetch into their caches as each shard is first read
        self.cache = None
        remote = [s.root for s in self.sets if not _is_local(s.root)]
        self.root = remote[0] if remote else self.sets[0].root

    def __len__(self) -> int:
        return len(self.names)

    @property
    def num_samples(self) -> int:
        return int(self.first[-1])

    @property
    def local(self) -> bool:
        return all(s.local for s in self.sets)

    def _where(self, shard: int) -> tuple[Any, int]:
        return self._at[shard]

    def url(self, shard: int) -> str:
        ss, k = self._where(shard)
        return str(ss.url(k))

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.searchsorted(self.first, ids, side="right") - 1
        return s, ids - self.first[s]

    def reader(self, shard: int, *, index: bool = True) -> ShardReader:
        fixed = self._fixed
        if fixed is not None:
            return fixed[shard]
        ss, k = self._at[shard]
        return ss.reader(k, index=index)

    def hold(self, shards: Iterable[int]) -> AbstractContextManager[None]:
        """Keep these shards open while the block runs (each in its source's set)."""
        if self._fixed is not None:
            return _HELD
        return self._hold(shards)

    @contextmanager
    def _hold(self, shards: Iterable[int]) -> Iterator[None]:
        per: dict[int, list[int]] = {}
        where = self._where_n
        for sh in shards:
            src, k = where[sh]
            got = per.get(src)
            if got is None:
                per[src] = [k]
            else:
                got.append(k)
        with ExitStack() as stack:
            for src, ks in per.items():
                stack.enter_context(self.sets[src].hold(ks))
            yield

    def check(self, shards: Iterable[int]) -> None:
        for sh in shards:
            ss, k = self._where(int(sh))
            ss.check([k])

    def open_all(self) -> bool:
        if all([s.open_all() for s in self.sets]):
            self._fixed = self.open_readers()
        return self._fixed is not None

    def open_readers(self) -> list[ShardReader] | None:
        out: list[ShardReader] = []
        for s in self.sets:
            readers = s.open_readers()
            if readers is None:
                return None
            out.extend(readers)
        return out

    def is_open(self, shard: int) -> bool:
        ss, k = self._where(shard)
        return bool(ss.is_open(k))

    def changed(self) -> str | None:
        for s in self.sets:
            why = s.changed()
            if why is not None:
                return str(why)
        return None

    def drop_pages(self) -> None:
        for s in self.sets:
            s.drop_pages()

    def begin(self, *args: Any) -> None:  # no prefetch plan across sources (see cache)
        return None

    def end(self) -> None:
        for s in self.sets:
            s.end()

    def close(self) -> None:
        self._fixed = None
        for s in self.sets:
            s.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fixed"] = None  # maps do not cross processes; each set reopens its own
        return state


_HELD = nullcontext()


@dataclass
class UnionManifest:
    """What the parts of a route read of a manifest, for the union of a mixture's sources: their
    shard records in union order, their fields in order of first appearance and the samples an
    epoch holds (the sources' total for the union; a mixture's ``epoch_size`` for it)."""

    shards: list[Any]
    fields: list[str]
    total_samples: int


def _is_local(root: str) -> bool:
    from .._helpers.storage import is_local

    return bool(is_local(root))


class MixtureEpoch:
    """A mixture's epoch as the batch loop reads a plan: the sample number (in
    :class:`MixtureShards`' numbering) at each position."""

    def __init__(self, plan: MixturePlan, epoch: int, bases: np.ndarray) -> None:
        self.mixture_plan, self.epoch, self.bases = plan, int(epoch), bases

    @property
    def num_samples(self) -> int:
        return self.mixture_plan.epoch_size

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        src, ids = self.mixture_plan.draws(self.epoch, positions)
        return np.asarray(self.bases[src] + ids, dtype=np.int64)


class BySource:
    """The transform of a mixture: each sample through its own source's transform (its
    ``__source__`` says which); a source without one passes its samples as they are."""

    def __init__(self, names: Sequence[str], transforms: Sequence[Any]) -> None:
        self.transforms = dict(zip(names, transforms))

    def __call__(self, x: dict[str, Any]) -> Any:
        name = x["__source__"]
        fn = self.transforms[name]
        if fn is None:
            return x
        out = fn(x)
        if type(out) is dict:  # a dict output says its source too
            out.setdefault("__source__", name)
        return out


class BySourceInto(BySource):
    """:class:`BySource` whose sources' transforms all write into a collator's rows, with the
    same ``out_shape`` and ``out_dtype``."""

    def __init__(self, names: Sequence[str], transforms: Sequence[Any]) -> None:
        super().__init__(names, transforms)
        self.out_shape = tuple(transforms[0].out_shape)
        self.out_dtype = transforms[0].out_dtype

    def into(self, x: dict[str, Any], out: torch.Tensor) -> Any:
        return self.transforms[x["__source__"]].into(x, out)


class MixtureFetch:
    """fetch=mixture: each number's sample read through its own source (the source's
    :class:`~feedpipe.stream._batch_loop.SampleFetch`: its shards, ``decode=`` and seed), marked
    with ``__source__``, in the batch's order."""

    def __init__(self, mixture: Mixture, epoch: int, *, copy: bool = False) -> None:
        self.names = mixture.names
        self.bases = mixture.shards.bases
        self.fetches = [SampleFetch(ds, epoch, stored=False, copy=copy)
                        for ds in mixture.sources.values()]

    def __call__(self, ids: np.ndarray) -> list[Item]:
        src = np.searchsorted(self.bases, ids, side="right") - 1
        out: list[Any] = [None] * len(ids)
        for s in np.unique(src).tolist():
            at = np.flatnonzero(src == s)
            name = self.names[s]
            for j, (g, x, done) in zip(at.tolist(), self.fetches[s](ids[at] - self.bases[s])):
                x["__source__"] = name
                out[j] = (int(self.bases[s]) + g, x, done)
        return out


class Mixture(IterableDataset):
    """A weighted mixture of named :class:`FeedDataset` sources, usable wherever a
    ``FeedDataset`` is: as the dataset of a :class:`FeedLoader` (every route that applies:
    workers, threads, rows, raw batches by reference, ``device=``) or iterated directly.

    Each epoch draws exactly ``weights[s] * epoch_size`` samples of source ``s`` (largest
    remainder rounding, summing to ``epoch_size``); within a source no sample repeats before
    every sample of it was drawn, across epochs (a source drawn three times its size an epoch is
    three whole permutations; one drawn 12% of its size continues its permutation next epoch).
    The sources are spread evenly through the epoch by construction. The epoch is a function of
    ``(seed, epoch)`` only: any number of ranks and workers deliver the same samples, every rank
    the same number of batches, and a mid-epoch ``state_dict()`` resumes on another number of
    ranks to exactly the rest.

    Each sample (and each raw batch) carries ``__source__``, the name of its source; its
    ``__index__`` is its id in that source and ``__seed__`` the source's seed.
    :meth:`FeedLoader.stats` gives the samples delivered per source under ``sources``.

    What each source keeps and what the mixture decides: a source's ``transform``, ``decode=``,
    shard cache, ``verify`` and ``shuffle`` (``False``: its samples in manifest order) are its
    own; the order of the epoch comes from the mixture's ``seed``, and its ranks are made equal
    by the mixture's ``drop_last``. A source's ``shuffle_window`` and ``drop_last`` are not
    used (said in a warning). Sources with a ``decoded_cache`` are refused.

    Args:
        sources: a mapping of names to :class:`FeedDataset` objects (in the order given).
        weights: each source's share of an epoch, a mapping of names (or a sequence in the
            sources' order) to non-negative numbers, normalised; ``None``: each source's size.
        epoch_size: samples per epoch; ``None``: the sources' total size.
        seed: the seed of the epoch's order.
        drop_last: as :class:`FeedDataset`'s: ``False`` pads the ranks to equal length by
            repeating at most ``world_size - 1`` positions, ``True`` leaves as many out.

    Example:
        >>> from feedpipe import FeedLoader
        >>> web = FeedDataset("shards/example", decode={"cls": int})
        >>> other = FeedDataset("shards/example", decode={"cls": int})
        >>> mix = Mixture({"web": web, "other": other}, weights={"web": 3, "other": 1},
        ...               epoch_size=8)
        >>> [s["__source__"] for s in mix]
        ['web', 'web', 'other', 'web', 'web', 'web', 'other', 'web']
        >>> loader = FeedLoader(mix, batch_size=4)
        >>> batch = next(iter(loader))
        >>> batch["__source__"], loader.stats()["sources"]
        (['web', 'web', 'other', 'web'], {'web': 3, 'other': 1})
    """

    def __init__(self, sources: Mapping[str, FeedDataset],
                 weights: Mapping[str, float] | Sequence[float] | None = None,
                 epoch_size: int | None = None, seed: int = 0, *,
                 drop_last: bool = False) -> None:
        super().__init__()
        if not isinstance(sources, Mapping) or not sources:
            raise MixtureError("Mixture needs a mapping of source names to FeedDatasets, e.g. "
                               "Mixture({'web': FeedDataset(...), 'books': FeedDataset(...)})")
        self.names = [str(n) for n in sources]
        for name, ds in sources.items():
            if not isinstance(ds, FeedDataset):
                raise MixtureError(f"source {name!r} is a {type(ds).__name__}, not a FeedDataset")
            if ds.decoded is not None:
                raise MixtureError(
                    f"source {name!r} has a decoded_cache: a Mixture reads its sources' shards "
                    "and does not fill their decoded stores; make the source without "
                    "decoded_cache= (a FunctionIndex keeps a transform's outputs instead)")
            if ds.shuffle_window is not None or ds.drop_last:
                log.warning("feedpipe: Mixture source %r: its shuffle_window=%r and "
                            "drop_last=%r are not used: the mixture's plan orders the epoch "
                            "and Mixture(drop_last=) makes the ranks equal", name,
                            ds.shuffle_window, ds.drop_last)
        self.sources: dict[str, FeedDataset] = dict(zip(self.names, sources.values()))
        self.weights = self._weights(weights)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        try:
            self.mixture_plan = MixturePlan(
                [ds.shards.counts for ds in self.sources.values()], self.weights, epoch_size,
                self.seed, shuffle=[ds.shuffle for ds in self.sources.values()])
        except PlanError as e:
            raise MixtureError(f"Mixture of {', '.join(map(repr, self.names))}: {e}") from e
        self.epoch_size = self.mixture_plan.epoch_size
        for name, w, c in zip(self.names, self.weights or [1.0] * len(self.names),
                              self.mixture_plan.counts.tolist()):
            if w > 0 and c == 0:
                log.warning("feedpipe: Mixture source %r: its weight gives it no sample in an "
                            "epoch of %d (each epoch's counts are %s); raise its weight or "
                            "epoch_size, or give it weight 0 to say so", name, self.epoch_size,
                            dict(zip(self.names, self.mixture_plan.counts.tolist())))
        self.shards = MixtureShards([ds.shards for ds in self.sources.values()])
        self.decoded = None
        self.shuffle = True
        self.shuffle_window = None
        self.max_open_shards = sum(ds.max_open_shards for ds in self.sources.values())
        self.url = "mixture(" + ", ".join(self.names) + ")"
        transforms = [ds.transform for ds in self.sources.values()]
        self.transform: BySource | None = None
        if any(t is not None for t in transforms):
            into = all(callable(getattr(t, "into", None)) for t in transforms) and len(
                {(tuple(getattr(t, "out_shape", ())), getattr(t, "out_dtype", None))
                 for t in transforms}) == 1
            self.transform = (BySourceInto if into else BySource)(self.names, transforms)
        decodes = [ds.decode for ds in self.sources.values()]
        #: the sources' common ``decode=`` (raw batches by reference decode by it)
        self.decode = decodes[0] if all(d == decodes[0] for d in decodes) else {}
        self.decodes_agree = all(d == decodes[0] for d in decodes)
        #: what a reader needs of a manifest: the sources' shards and fields, and the samples
        #: an epoch holds (``epoch_size``)
        self.manifest = replace(self.shards.manifest, total_samples=self.epoch_size)
        self.identity = self._identity()
        self._reader = EpochState()
        self._seeds = np.array([ds.seed for ds in self.sources.values()], dtype=np.int64)
        self._names = np.array(self.names, dtype=object)
        self._check_world()

    def _weights(self, weights: Any) -> list[float] | None:
        if weights is None:
            return None
        if isinstance(weights, Mapping):
            unknown = [k for k in weights if k not in self.sources]
            if unknown:
                raise MixtureError(f"weights name unknown source(s) {unknown}; the sources are "
                                   f"{self.names}")
            missing = [n for n in self.names if n not in weights]
            if missing:
                raise MixtureError(f"weights give no weight for source(s) {missing}; give one "
                                   "for every source (0 leaves a source out)")
            values = [weights[n] for n in self.names]
        else:
            values = list(weights)
            if len(values) != len(self.names):
                raise MixtureError(f"{len(values)} weights for {len(self.names)} sources "
                                   f"{self.names}")
        for n, w in zip(self.names, values):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) \
                    or w < 0:
                raise MixtureError(f"source {n!r} has weight {w!r}: a weight is a finite "
                                   "number of 0 or more")
        if not sum(values) > 0:
            raise MixtureError(f"the weights {dict(zip(self.names, values))} are all zero: "
                               "give at least one source a positive weight")
        return [float(w) for w in values]

    def _identity(self) -> dict[str, Any]:
        h = hashlib.blake2b(b"feedpipe-mixture", digest_size=16)
        for name, ds in self.sources.items():
            h.update(f"\0{name}\0{ds.identity['digest']}\0{ds.shuffle}".encode())
        h.update(f"\0{self.mixture_plan.counts.tolist()}".encode())
        return {"digest": h.hexdigest(), "shards": len(self.shards),
                "samples": self.epoch_size, "sources": list(self.names)}

    # -- the world and the plan ------------------------------------------------------------
    @property
    def world(self) -> World:
        """This process's rank and the number of ranks (every source's: they must agree)."""
        return next(iter(self.sources.values())).world

    def _check_world(self) -> None:
        worlds = {n: ds.world for n, ds in self.sources.items()}
        first = self.names[0]
        for n, w in worlds.items():
            if w != worlds[first]:
                raise MixtureError(f"source {n!r} is rank {w.rank} of {w.world_size}, source "
                                   f"{first!r} rank {worlds[first].rank} of "
                                   f"{worlds[first].world_size}: give every source the same "
                                   "rank= and world_size= (or none)")
        if self.drop_last and self.epoch_size < self.world.world_size:
            raise PlanError(f"{self.url}: an epoch of {self.epoch_size} samples cannot give "
                            f"each of {self.world.world_size} ranks one with drop_last=True")

    def attach(self) -> None:
        """As :meth:`FeedDataset.attach`, for every source."""
        self._reader.own()
        for ds in self.sources.values():
            ds.attach()
        self._check_world()

    def plan(self, epoch: int | None = None) -> MixtureEpoch:
        """The epoch ``epoch``'s plan (``None``: the direct reader's epoch)."""
        return MixtureEpoch(self.mixture_plan, self.epoch if epoch is None else int(epoch),
                            self.shards.bases)

    def split_at(self, start: int = 0, whole_batches: bool = False) -> Split:
        """This rank's share of the epoch's positions from ``start`` on."""
        return Split(self.epoch_size, self.world.world_size, self.world.rank, int(start),
                     self.drop_last, bool(whole_batches))

    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        """Sample ``g`` (numbered as :attr:`shards` numbers the sources' samples) as its
        source's transform sees it in ``epoch``, with ``__source__``."""
        src = int(np.searchsorted(self.shards.bases, g, side="right")) - 1
        name = self.names[src]
        x = self.sources[name].sample(int(g) - int(self.shards.bases[src]),
                                      self.epoch if epoch is None else epoch)
        x["__source__"] = name
        return x

    def delivered(self, epoch: int, split: Split, batches: int, batch_size: int) -> dict[str, int]:
        """Samples of each source in this rank's first ``batches`` batches of ``split``."""
        n = min(batches, split.batches(batch_size))
        pos, _ = worker_positions(split, batch_size, np.arange(n))
        counts = np.bincount(self.mixture_plan.source_at[pos], minlength=len(self.names))
        return dict(zip(self.names, counts.tolist()))

    def tag_batch(self, batch: dict[str, Any], shards: np.ndarray) -> None:
        """A raw batch by reference (numbered in :class:`MixtureShards`), said as the
        ``samples`` fetch says it: each sample's ``__source__``, its ``__index__`` in that
        source and the source's ``__seed__`` (in this process's memory: before pinning)."""
        src = self.shards.source_of[shards]
        batch["__index__"] = torch.from_numpy(batch["__index__"].numpy()
                                              - self.shards.base_of[shards])
        batch["__seed__"] = torch.from_numpy(self._seeds.take(src))
        batch["__source__"] = self._names.take(src).tolist()

    def check_fields(self, raw_default: bool) -> None:
        """Refuse sources whose fields or ``decode=`` differ when their raw samples are collated
        by the default collation (a batch would hold one source's field as ``None`` for the
        others, or one field as both bytes and decoded values)."""
        if not raw_default:
            return
        first = self.names[0]
        want = list(self.sources[first].manifest.fields)
        want_decode = self.sources[first].decode
        for n, ds in self.sources.items():
            have = list(ds.manifest.fields)
            if sorted(have) != sorted(want):
                raise MixtureError(
                    f"source {n!r} has fields {have}, source {first!r} {want}: raw batches of a "
                    "mixture need the same fields from every source; give the sources a "
                    "transform that makes their samples alike, or a collate_fn that takes them")
            if ds.decode != want_decode:
                raise MixtureError(
                    f"source {n!r} decodes {sorted(ds.decode)}, source {first!r} "
                    f"{sorted(want_decode)} (decode=): a raw batch's field would hold bytes from "
                    "one source and decoded values from another; give every source the same "
                    "decode=, or a collate_fn that takes them")

    def collate_error(self, outs: list[Any], error: Exception) -> MixtureError:
        """The error for a batch of this mixture that its collation refused, naming the field
        and the sources whose values differ."""
        by: dict[str, dict[str, str]] = {}  # field -> source -> the type of its values
        named = [o for o in outs if type(o) is dict and "__source__" in o]
        for o in named:
            for k, v in o.items():
                by.setdefault(k, {}).setdefault(o["__source__"], type(v).__name__)
        sources = sorted({o["__source__"] for o in named}, key=self.names.index)
        for k, types in by.items():
            seen = {src: types.get(src, "missing") for src in sources}
            if len(set(seen.values())) > 1:
                said = ", ".join(f"{t} in source {src!r}" for src, t in seen.items())
                return MixtureError(
                    f"a batch of {self.url} does not collate ({type(error).__name__}: {error}): "
                    f"field {k!r} is {said}; make the sources' samples alike (the same decode=, "
                    "transforms with the same outputs) or pass a collate_fn that takes them")
        return MixtureError(f"a batch of {self.url} (sources "
                            f"{sources or self.names}) does not collate: "
                            f"{type(error).__name__}: {error}")

    # -- the direct reader's epoch ---------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the mixture's direct reader reads (not any :class:`FeedLoader`'s)."""
        return self._reader.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` when iterated directly (a plain ``DataLoader``)."""
        self._reader.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this rank delivers in the direct reader's current epoch."""
        return self._reader.split(self).length  # type: ignore[arg-type]

    # -- resumption ------------------------------------------------------------------------
    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The resumable state of a reader at global ``position`` of ``epoch``."""
        return {"version": STATE_VERSION, "kind": "mixture", "epoch": int(epoch),
                "position": int(position), "num_samples": self.epoch_size,
                "dataset": dict(self.identity), "seed": self.seed}

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, position)`` a reader loading ``state`` continues from; a state of
        another mixture is refused (``strict=False``: logged, the saved epoch from its start)."""
        if not isinstance(state, dict) or "position" not in state:
            raise StateError("not a feedpipe loader state (no 'position'): pass what "
                             "FeedLoader.state_dict() returned")
        why = self._mismatch(state)
        if why is not None:
            if strict:
                raise StateError(f"cannot resume {self.url}: {why}; the order would differ "
                                 "(load_state_dict(state, strict=False) starts the saved epoch "
                                 "afresh instead)")
            log.warning("feedpipe: %s: %s; starting epoch %s afresh", self.url, why,
                        state.get("epoch", 0))
            return int(state.get("epoch", 0)), 0
        return int(state["epoch"]), int(state["position"])

    def _mismatch(self, state: dict[str, Any]) -> str | None:
        if state.get("kind") != "mixture" or state.get("version") != STATE_VERSION:
            return "the state is not a Mixture's (it was saved reading one FeedDataset)"
        saved = state.get("dataset") or {}
        if saved.get("digest") != self.identity["digest"]:
            return (f"the state was saved on another mixture (sources {saved.get('sources')}, "
                    f"{saved.get('samples')} samples an epoch), this one has sources "
                    f"{self.names}, {self.epoch_size} samples an epoch, or their data, "
                    "weights or shuffle differ")
        if state.get("seed") != self.seed:
            return f"the state has seed={state.get('seed')!r}, this mixture seed={self.seed!r}"
        pos = state.get("position")
        if not isinstance(pos, int) or not 0 <= pos <= self.epoch_size:
            return f"the saved position {pos!r} is outside the epoch"
        return None

    def state_dict(self) -> dict[str, Any]:
        """The direct reader's resumable state (where its next pass starts)."""
        return self.state_at(self.epoch, self._reader.start)

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue ``state`` on the direct reader's next iteration."""
        self._reader.resume(*self.resume_point(state, strict=strict))

    # -- samples ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """This reader's samples of the epoch (a DataLoader worker's share when in one), each
        through its source's transform."""
        from ._assembly import assemble
        from ._collate import LeftOut
        from ._routes import ROUTES

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is None:
            self.attach()
        route = ROUTES["samples"]
        route = type(route)(route.name, "mixture", "call", "inline", "collate")
        with EpochReader(self, self._reader, worker, workers) as reader:  # type: ignore[arg-type]
            parts = assemble(route, self, reader.plan.epoch, list,  # type: ignore[arg-type]
                             skips=Skips(), leaves=info is not None, default=False)
            for outs in parts.run(reader):
                if type(outs) is LeftOut:
                    if self.world.world_size > 1:
                        from ._collate import left_out_error

                        raise left_out_error(outs, self.world.rank, self.world.world_size,
                                             "read directly (a DataLoader batches what comes)")
                    continue
                yield from outs

    def close(self) -> None:
        """Close every source's open shards."""
        self.shards.close()

