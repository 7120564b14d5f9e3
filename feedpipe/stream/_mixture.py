"""``Mixture``: a weighted mixture of named :class:`~feedpipe.FeedDataset` sources, read by the
same batch loop and routes as one dataset.

A mixture is one more *source* of the batch loop, not another loader. Its epoch's positions are
dealt to ranks, workers and batches exactly as one dataset's (a :class:`~feedpipe.plan._order.
Split` of ``epoch_size`` positions); what differs is what a position holds, which the
:class:`~feedpipe.plan._mixture.MixturePlan` says as a pure function of (seed, epoch). Its
samples are numbered in one space, the sources' shards one after the other
(:class:`~feedpipe.stream._mixture_shards.MixtureShards`), so that the parts of a route that
address samples by number (the ``refs`` fetch, the I/O tally, the ``rows`` sink's page drops)
read a mixture as they read one dataset. The ``samples`` fetch becomes
:class:`~feedpipe.stream._mixture_fetch.MixtureFetch`, which reads each sample through its own
source (its ``decode=``, seed and cache), and the transform is each sample's source's
(:class:`~feedpipe.stream._mixture_fetch.BySource`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .._helpers.exit_close import closed_at_exit
from .._redact import logger
from ..errors import MixtureError, PlanError
from ..plan._mixture import INTERLEAVE, MixtureEpoch, MixturePlan
from ..plan._order import Split
from ._assembly import assemble
from ._batch_loop import EpochReader, Skips
from ._collate import LeftOut, left_out_error
from ._dataset import FeedDataset, read_capabilities
from ._epoch import EpochState
from ._mixture_fetch import BySource, BySourceInto, MixtureFetch
from ._mixture_shards import MixtureShards
from ._routes import ROUTES, Capabilities
from ._source import Source
from ._states import checked_resume_point

if TYPE_CHECKING:
    from ..plan._world import World

log = logger("feedpipe")

# 2: the sources interleaved by cells (feedpipe.plan._interleave); a version-1 state's position
# named the samples of the interleave before, so only its epoch boundaries still hold
STATE_VERSION = 2


class Mixture(IterableDataset, Source):
    """A weighted mixture of named :class:`FeedDataset` sources: a :class:`~feedpipe.Source` of
    its own, read by a :class:`FeedLoader` (every route that applies: workers, threads, rows,
    raw batches by reference, ``device=``) or iterated directly.

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
    shard cache (read without prefetching ahead: said in a warning), ``verify`` and
    ``shuffle`` (``False``: its samples in manifest order) are its own; the order of the epoch
    comes from the mixture's ``seed``, and its ranks are made equal by the mixture's
    ``drop_last``. A source's ``shuffle_window`` and ``drop_last`` are not
    used (said in a warning). A source with a ``decoded_cache`` is refused (a
    :class:`MixtureError`): the mixture's own plan neither fills nor reads a decoded store; a
    :class:`~feedpipe.FunctionIndex` wrapped around the source's transform keeps its outputs
    instead.

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
            _check_source(name, ds)
        self.sources: dict[str, FeedDataset] = dict(zip(self.names, sources.values()))
        self.weights = self._weights(weights)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.mixture_plan = self._plan(epoch_size)
        self.epoch_size = self.mixture_plan.epoch_size
        self._epoch_size_given = epoch_size  # the plan's input, as the ledger records it
        # its sources' shards, numbered as one (a Source's shards: read by sample number)
        self.shards: MixtureShards = MixtureShards(  # type: ignore[assignment]
            [ds.shards for ds in self.sources.values()])
        self.decoded = None
        self.shuffle = True
        self.shuffle_window = None
        self.max_open_shards = sum(ds.max_open_shards for ds in self.sources.values())
        self.url = "mixture(" + ", ".join(self.names) + ")"
        self.transform = by_source(self.names, [ds.transform for ds in self.sources.values()])
        decodes = [ds.decode for ds in self.sources.values()]
        #: the sources' common ``decode=`` (raw batches by reference decode by it)
        self.decode = decodes[0] if all(d == decodes[0] for d in decodes) else {}
        self.decodes_agree = all(d == decodes[0] for d in decodes)
        #: what a reader needs of a manifest, made of the sources' shards and fields, and the
        #: samples an epoch holds (``epoch_size``)
        self.manifest = replace(self.shards.manifest, total_samples=self.epoch_size)
        self.identity = self._identity()
        self._reader = EpochState()
        # per shard of the union: its source's seed and name, so that tagging a raw batch is
        # one gather a column, with no per-sample step through the source
        seeds = np.array([ds.seed for ds in self.sources.values()], dtype=np.int64)
        self._shard_seeds = seeds[self.shards.source_of]
        self._shard_names = np.array(self.names, dtype=object)[self.shards.source_of]
        self._check_world()

    def _plan(self, epoch_size: int | None) -> MixturePlan:
        """The plan of the sources' samples in each epoch (refused with a
        :class:`~feedpipe.errors.MixtureError`); a source whose weight gives it no sample is
        said in a warning."""
        try:
            plan = MixturePlan(
                [ds.shards.counts for ds in self.sources.values()], self.weights, epoch_size,
                self.seed, shuffle=[ds.shuffle for ds in self.sources.values()])
        except PlanError as e:
            raise MixtureError(f"Mixture of {', '.join(map(repr, self.names))}: {e}") from e
        counts = plan.counts.tolist()
        for name, w, c in zip(self.names, self.weights or [1.0] * len(self.names), counts):
            if w > 0 and c == 0:
                log.warning("feedpipe: Mixture source %r: its weight gives it no sample in an "
                            "epoch of %d (each epoch's counts are %s); raise its weight or "
                            "epoch_size, or give it weight 0 to say so", name, plan.epoch_size,
                            dict(zip(self.names, counts)))
        return plan

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

    @property
    def source_bases(self) -> dict[str, int]:
        """Each source's first sample number in the mixture's numbering."""
        return {n: int(b) for n, b in zip(self.names, self.shards.bases)}

    # -- what the routes read (feedpipe.Source) ---------------------------------------------
    @property
    def skip_bases(self) -> dict[str, int]:
        """A left-out sample's ``__index__`` is its id in its ``__source__``: numbered from
        :attr:`source_bases`."""
        return self.source_bases

    def capabilities(self, collate_fn: Any) -> Capabilities:
        """What the mixture offers the routes: its sources' transforms and shards, read through
        the ``mixture`` fetch; a batch decoded one way only where the sources agree."""
        return read_capabilities(self, collate_fn, fetch="mixture",
                                 decodes_agree=self.decodes_agree)

    def sample_fetch(self, epoch: int, *, copy: bool) -> MixtureFetch:
        """Each id's sample read through its own source (``decode=``, seed, shards), marked
        with ``__source__``."""
        return MixtureFetch(self.names, self.shards.bases, list(self.sources.values()), epoch,
                            copy=copy)

    def check_loader(self, raw_default: bool) -> None:
        """As :meth:`check_fields`."""
        self.check_fields(raw_default)

    def ledger_info(self) -> dict[str, Any]:
        """What ``FeedLoader(ledger=)`` records of this mixture in ``ledger.json``: the inputs
        of its plan, from which ``feedpipe ledger`` recomputes what each epoch draws
        (``counts``: the shards' samples, one source's after another's)."""
        return {"kind": "mixture", "digest": self.identity["digest"],
                "counts": [int(c) for c in self.shards.counts], "sources": list(self.names),
                "shards": [[int(c) for c in ds.shards.counts] for ds in self.sources.values()],
                "shuffle": [bool(ds.shuffle) for ds in self.sources.values()],
                "weights": self.weights, "epoch_size": self._epoch_size_given,
                "draws": self.mixture_plan.counts.tolist(), "seed": self.seed,
                "interleave": INTERLEAVE,
                "drop_last": self.drop_last}

    # -- the world and the plan ------------------------------------------------------------
    @property
    def world(self) -> World:  # type: ignore[override]
        """This process's rank and the number of ranks, every source's (they must agree)."""
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

    def plan(self, epoch: int | None = None) -> MixtureEpoch:  # type: ignore[override]
        """The epoch ``epoch``'s plan (``None``: the direct reader's epoch)."""
        return MixtureEpoch(self.mixture_plan, self.epoch if epoch is None else int(epoch),
                            self.shards.bases)

    def split_at(self, start: int = 0, whole_batches: bool = False, *,
                 epoch: int | None = None) -> Split:
        """This rank's share of the epoch's positions from ``start`` on (every ``epoch`` has
        ``epoch_size``)."""
        return Split(self.epoch_size, self.world.world_size, self.world.rank, int(start),
                     self.drop_last, bool(whole_batches))

    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        """Sample ``g`` (the sources' samples numbered one after the other, in the order of the
        sources) as its
        source's transform sees it in ``epoch``, with ``__source__``."""
        src = int(np.searchsorted(self.shards.bases, g, side="right")) - 1
        name = self.names[src]
        x = self.sources[name].sample(int(g) - int(self.shards.bases[src]),
                                      self.epoch if epoch is None else epoch)
        x["__source__"] = name
        return x

    def delivered(self, epoch: int, split: Split, batches: int, batch_size: int) -> dict[str, int]:
        """Samples of each source in this rank's first ``batches`` batches of ``split``."""
        counts = self.mixture_plan.source_counts(split, batch_size, batches)
        return dict(zip(self.names, counts.tolist()))

    def tag_batch(self, batch: dict[str, Any], shards: np.ndarray) -> None:
        """A raw batch by reference (the sources' shards numbered one after the other), said as the
        ``samples`` fetch says it: each sample's ``__source__``, its ``__index__`` in that
        source and the source's ``__seed__`` (in this process's memory: before pinning)."""
        batch["__index__"] = torch.from_numpy(batch["__index__"].numpy()
                                              - self.shards.base_of.take(shards))
        batch["__seed__"] = torch.from_numpy(self._shard_seeds.take(shards))
        batch["__source__"] = self._shard_names.take(shards).tolist()

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
        return self._reader.split(self).length

    # -- resumption ------------------------------------------------------------------------
    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The resumable state of a reader at global ``position`` of ``epoch``."""
        return {"version": STATE_VERSION, "kind": "mixture", "epoch": int(epoch),
                "position": int(position), "num_samples": self.epoch_size,
                "dataset": dict(self.identity), "seed": self.seed}

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, position)`` a reader loading ``state`` continues from; a state of
        another mixture is refused (``strict=False``: logged, the saved epoch from its start)."""
        return checked_resume_point(state, self.state_mismatch, self.url, strict)

    def state_mismatch(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot resume this source (a reason to show), or ``None``."""
        if state.get("kind") != "mixture":
            return "the state is not a Mixture's (it was saved reading one FeedDataset)"
        if state.get("version") != STATE_VERSION and not (
                state.get("version") == 1 and state.get("position") in (0, self.epoch_size)):
            return (f"the state is of version {state.get('version')!r}, saved by a feedpipe "
                    f"whose mixture plan interleaved the sources otherwise (this one reads "
                    f"version {STATE_VERSION}): its mid-epoch position names other samples here")
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
        return closed_at_exit(self._samples())

    def _samples(self) -> Generator[Any, None, None]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is None:
            self.attach()
        with EpochReader(self, self._reader, worker, workers) as reader:
            parts = assemble(ROUTES["samples"], self, reader.plan.epoch, list,
                             skips=Skips(), leaves=info is not None, default=False)
            for outs in parts.run(reader):
                if type(outs) is LeftOut:
                    if self.world.world_size > 1:
                        raise left_out_error(outs, self.world.rank, self.world.world_size,
                                             "read directly (a DataLoader batches what comes)")
                    continue
                yield from outs

    def close(self) -> None:
        """Close every source's open shards."""
        self.shards.close()


def _check_source(name: str, ds: Any) -> None:
    """Refuse a source a mixture cannot read (not a FeedDataset, a decoded store), and say what
    of it the mixture does not use (its shard cache's prefetch, shuffle_window, drop_last)."""
    if not isinstance(ds, FeedDataset):
        raise MixtureError(f"source {name!r} is a {type(ds).__name__}, not a FeedDataset")
    if ds.decoded is not None:
        raise MixtureError(
            f"source {name!r} has a decoded_cache ({ds.decoded.path}): a Mixture reads "
            "its sources' shards through its own plan, which neither fills nor reads a "
            "decoded store, so the store would be left as it is while every epoch runs "
            "the transform; make the source without decoded_cache= and keep its "
            "transform's outputs in a FunctionIndex instead: FeedDataset(url, "
            "transform=FunctionIndex(directory).wrap(transform, fields=[...], "
            "version=1))")
    if ds.cache is not None:
        log.warning("feedpipe: Mixture source %r reads through its shard cache without "
                    "prefetching ahead: the cache's prefetcher follows one dataset's "
                    "plan, not a mixture's, so each shard is fetched as it is first "
                    "read", name)
    if ds.shuffle_window is not None or ds.drop_last:
        log.warning("feedpipe: Mixture source %r: its shuffle_window=%r and "
                    "drop_last=%r are not used: the mixture's plan orders the epoch "
                    "and Mixture(drop_last=) makes the ranks equal", name,
                    ds.shuffle_window, ds.drop_last)


def by_source(names: list[str], transforms: list[Any]) -> BySource | None:
    """The mixture's transform: each source's own ``transforms`` (``None``: none has one),
    writing into a batch's buffer where every one can and all make the same shape and dtype."""
    if all(t is None for t in transforms):
        return None
    into = all(callable(getattr(t, "into", None)) for t in transforms) and len(
        {(tuple(getattr(t, "out_shape", ())), getattr(t, "out_dtype", None))
         for t in transforms}) == 1
    return (BySourceInto if into else BySource)(names, transforms)
