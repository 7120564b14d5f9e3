"""``FeedDataset``: the streaming ``IterableDataset``.

A thin facade. The plan decides what each rank and worker reads (:mod:`feedpipe.plan._order`),
the :class:`~feedpipe.ShardSet` reads it, and the batch loop (:mod:`feedpipe.stream._batch_loop`)
turns it into samples or batches."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .._helpers.exit_close import closed_at_exit
from .._redact import logger
from ..caches._manifest_copy import load_manifest_cached
from ..caches._readahead import make_cache
from ..caches._shards import ShardCache
from ..caches.decoded._store import open_decoded_store
from ..device._fallback import WarmupSource
from ..errors import PlanError
from ..format._manifest import Manifest, dataset_root
from ..plan._order import Plan, Split
from ..plan._world import detect_world, resolve_world
from ._assembly import assemble
from ._batch_loop import EpochReader, SampleFetch, Skips
from ._collate import Decoder, LeftOut, decode_fields, decoders, left_out_error
from ._direct import each_sample
from ._epoch import EpochState
from ._routes import ROUTES, Capabilities
from ._shard_set import ShardSet
from ._source import Source
from ._states import (
    STATE_VERSION,
    checked_resume_point,
    dataset_identity,
    dataset_mismatch,
    saved_layout,
)
from ._store_gather import gatherable
from ._worker_rows import writes_into

log = logger("feedpipe")

RUN = 256  # samples located and checked at once when iterated directly (each_sample)


class FeedDataset(IterableDataset, Source, WarmupSource):
    """Stream a feedpipe (or ``feedpipe index``-ed WebDataset) shard dataset.

    Each epoch every sample is delivered exactly once over all ranks and workers, in an order that
    depends on ``(dataset, seed, epoch)`` only. Every rank gets the same number of samples (see
    :class:`~feedpipe.Plan`). Samples are dicts: ``__key__``, ``__shard__``, ``__index__``
    (global sample id), ``__epoch__`` and ``__seed__`` (for reproducible per-sample
    augmentation), and one raw-bytes entry per field. A field is a zero-copy ``memoryview`` of a
    local shard in the process that reads it, ``bytes`` when a worker process must send a raw
    sample to the main process.

    The dataset describes data: it holds no epoch, position or batch size of a
    :class:`FeedLoader` (each loader owns its own, so several may share one dataset).
    :attr:`epoch`, :meth:`set_epoch`, :meth:`state_dict` and :meth:`load_state_dict` are the
    state of the one reader that iterates the dataset directly (a plain ``DataLoader``, or
    ``for sample in ds``).

    Args:
        url: dataset root (local path or fsspec URL) holding ``manifest.json``.
        shuffle: permute samples each epoch; ``False``: manifest order.
        seed: the order's seed.
        drop_last: how ranks are made equal: ``False`` pads them by repeating at most
            ``world_size - 1`` samples per epoch; ``True`` leaves at most ``world_size - 1`` out.
            (To drop a short last *batch*, pass ``drop_last=True`` to :class:`FeedLoader`.)
        transform: a callable applied to each sample dict (in the worker that reads it).
        decode: fields to decode before the transform (and in raw batches), e.g.
            ``{"cls": int, "txt": str, "json": "json"}``: a field name to ``int``, ``float``,
            ``str`` (UTF-8), ``"json"`` or a callable taking the field's bytes.
        shuffle_window: shards mixed together (``None``: all). See :class:`feedpipe.Plan`.
        rank: this process's rank; detected from ``torch.distributed`` or the launcher's
            environment when not given.
        world_size: the number of ranks; detected as ``rank`` is.
        verify: check every shard against the manifest's hash, and its index against its tar
            headers, when it is first opened: every byte served has been checked (a shard the
            manifest gives no sha256 for is named in a warning: its bytes cannot be).
        max_open_shards: shard maps a process keeps open at once.
        cache_dir: the node-local L1 shard cache (:class:`~feedpipe.ShardCache`): a directory,
            ``True``/``"auto"`` for ``$XDG_CACHE_HOME/feedpipe/shards``, or a
            :class:`~feedpipe.ShardCache`. Shards are fetched there once per node
            (prefetched ahead of use, evicted by the plan) and read with mmap. ``None``: remote
            shards are read with range requests.
        cache_size: the cache's byte budget (``"20GB"``, ``"512MiB"`` or an int; ``None``: no
            limit).
        node_local: give each node its own piece of the shards each epoch (a different piece
            every epoch, mixed inside), so that a node fetches its share of the dataset (plus
            at most the two shards it shares with its neighbours) instead of every shard; across
            the nodes every sample still comes once, and resumes, also on another world, stay
            exact. ``None`` (default): on for remote shards (an fsspec URL) read by more than
            one node with ``shuffle=True``, off for local ones (said in a log record); ``True``
            or ``False`` chooses. See :class:`feedpipe.Plan` and docs/concepts.md.
        ranks_per_node: the ranks that share a node (a cache directory): ranks
            ``k*ranks_per_node`` up to ``(k+1)*ranks_per_node - 1`` form node ``k``. ``None``:
            the launcher's ``LOCAL_WORLD_SIZE`` (torchrun; Slurm's and Open MPI's likewise)
            where ``rank=`` is not given, else 1 (each rank a node of its own: never more
            fetched than the node's share plus its ranks' boundary shards, at the price of
            less mixing per rank). Every rank must be given the same value.
        decoded_cache: keep ``transform``'s outputs in a node-local memmap store under this
            directory (``True``/``"auto"``: ``$XDG_CACHE_HOME/feedpipe/decoded``): the first epoch
            fills it, later ones read it without reading a shard or calling the transform. The
            transform must be deterministic with fixed-shape outputs (e.g. decode and resize);
            see :class:`~feedpipe.DecodedStore`. Counters: ``ds.decoded.stats``.

    Example:
        >>> ds = FeedDataset("shards/example", decode={"cls": int})
        >>> s = next(iter(ds))
        >>> len(ds), s["cls"], sorted(k for k in s if not k.startswith('__'))
        (24, 0, ['cls', 'jpg', 'json'])
    """

    def __init__(
        self,
        url: str,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        decode: Mapping[str, Any] | None = None,
        shuffle_window: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        verify: bool = False,
        max_open_shards: int = 64,
        cache_dir: str | os.PathLike[str] | bool | ShardCache | None = None,
        cache_size: int | str | None = None,
        decoded_cache: str | os.PathLike[str] | bool | None = None,
        node_local: bool | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        super().__init__()
        self.url = dataset_root(url)
        cache = make_cache(cache_dir, cache_size, self.url)
        # through the cache when there is one: a warm cache starts while the storage is down
        self.manifest: Manifest = load_manifest_cached(url, cache_dir)
        if self.manifest.total_samples == 0:
            raise PlanError(f"{url}: the dataset holds no samples")
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.transform = transform
        self.decode: dict[str, Decoder] = decoders(decode)
        self.shuffle_window = shuffle_window
        self.world = resolve_world(rank, world_size)
        self._world_given = rank is not None
        if ranks_per_node is not None and ranks_per_node < 1:
            raise PlanError(f"ranks_per_node must be at least 1, not {ranks_per_node}")
        self.node_local = node_local
        self.ranks_per_node = ranks_per_node
        self._said: tuple[int, int] | None = None
        self.verify = verify
        unhashed = [r.name for r in self.manifest.shards if r.sha256 is None] if verify else []
        if unhashed:
            log.warning("feedpipe: %s: verify=True cannot check the bytes of %d shard(s) (%s%s): "
                        "the manifest records no sha256 for them (their index entries are still "
                        "checked against the tar headers); a manifest written by `feedpipe "
                        "shard`, `feedpipe index` or ShardWriter records the hashes", self.url,
                        len(unhashed), ", ".join(unhashed[:3]),
                        ", ..." if len(unhashed) > 3 else "")
        self.max_open_shards = max(1, max_open_shards)
        self.identity = dataset_identity(self.manifest)
        self._check_world()
        # the state of the one reader that iterates this dataset directly (a plain DataLoader);
        # each FeedLoader has its own
        self._reader = EpochState()
        self.cache = cache
        self.shards = ShardSet(self.url, self.manifest, cache=cache, verify=verify,
                               max_open=self.max_open_shards)
        self.decoded = open_decoded_store(decoded_cache, transform, self.manifest)

    # -- the world and the plan: what the data is ------------------------------------------
    def _check_world(self) -> None:
        if self.drop_last and self.manifest.total_samples < self.world.world_size:
            raise PlanError(
                f"{self.url}: {self.manifest.total_samples} samples cannot give each of "
                f"{self.world.world_size} ranks one with drop_last=True; use drop_last=False "
                "(pads by repeating samples) or fewer ranks")

    def attach(self) -> None:
        """Make this dataset the one of the process that iterates it. :class:`FeedLoader` calls
        this as each pass starts and for ``len()``; a DataLoader worker never does.

        1. The direct reader's epoch lives in shared memory, for this process's own worker
           processes. A copy sent to another training process (a rank spawned by a launcher, as
           Lightning's ``ddp_spawn`` does) would share it with its sender: it takes a memory of
           its own first, so that ranks never advance each other's epoch.
        2. Where ``rank=``/``world_size=`` were not given, the world is detected again: a
           launcher may initialise ``torch.distributed`` after the dataset was made (Lightning's
           own does, before it trains). A world that names no rank is refused here
           (:func:`~feedpipe.detect_world`, ``strict``).
        """
        self._reader.own()
        if self._world_given:
            return
        world = detect_world(strict=True)
        if world != self.world:
            self.world = world
            self._check_world()

    def node_layout(self) -> tuple[int, int] | None:
        """``(world_size, ranks_per_node)`` when this world's epochs give each node a piece of
        the shards of its own (see ``node_local=``), else ``None`` (the global order)."""
        w = self.world
        per_node = self.ranks_per_node or (1 if self._world_given else w.local_world_size)
        per_node = max(1, min(per_node, w.world_size))
        nodes = -(-w.world_size // per_node)
        if not self.shuffle or nodes == 1:
            return None
        remote = not self.shards.local
        on = remote if self.node_local is None else self.node_local
        if self._said != (w.world_size, per_node):  # said once for each world
            self._said = (w.world_size, per_node)
            how = "node_local=None: remote shards" if self.node_local is None and remote else (
                "node_local=None: local shards" if self.node_local is None else
                f"node_local={self.node_local}")
            if on:
                log.info("feedpipe: %s: each of %d nodes (%d ranks each) reads its own piece of "
                         "the shards each epoch, about 1/%d of the dataset (%s; node_local=False "
                         "mixes every rank over all shards)", self.url, nodes, per_node, nodes,
                         how)
            else:
                log.info("feedpipe: %s: every rank of %d nodes reads from all the shards each "
                         "epoch (%s; node_local=True gives each node its own piece)", self.url,
                         nodes, how)
        return (w.world_size, per_node) if on else None

    def plan(self, epoch: int | None = None, *, layout: Any = -1) -> Plan:
        """The plan of ``epoch`` (``None``: the direct reader's epoch, :attr:`epoch`), laid out
        for this world's nodes (:meth:`node_layout`), or with ``layout`` (``None``: the global
        order; a resumed epoch's saved layout)."""
        return Plan(self.shards.counts, self.seed, self.epoch if epoch is None else epoch,
                    self.shuffle, self.shuffle_window,
                    self.node_layout() if layout == -1 else layout)

    def split_at(self, start: int = 0, whole_batches: bool = False, *,
                 epoch: int | None = None, layout: Any = -1) -> Split:
        """This rank's share of the epoch's positions from ``start`` on; ``whole_batches``:
        each rank's short last batch is left out (every ``epoch`` has as many positions).
        Under a node layout a padded rank repeats one of its own samples."""
        lay = self.node_layout() if layout == -1 else layout
        return Split(self.manifest.total_samples, self.world.world_size, self.world.rank,
                     int(start), self.drop_last, bool(whole_batches), pad_own=lay is not None)

    # -- what the routes read (feedpipe.Source) ---------------------------------------------
    def capabilities(self, collate_fn: Any) -> Capabilities:
        """What this dataset offers the routes (:meth:`Source.capabilities`): its transform,
        its shards' place and its decoded store."""
        return read_capabilities(self, collate_fn)

    def sample_fetch(self, epoch: int, *, copy: bool) -> SampleFetch:
        """Each id's sample from the shards, or its output from the decoded store."""
        return SampleFetch(self, epoch, stored=self.decoded is not None, copy=copy)

    def ledger_info(self) -> dict[str, Any]:
        """What ``ledger.json`` records of this dataset: what its epochs' plans are made of."""
        return {"digest": self.identity["digest"],
                "counts": [int(c) for c in self.shards.counts], "seed": self.seed,
                "shuffle": self.shuffle, "window": self.shuffle_window,
                "drop_last": self.drop_last}

    # -- the direct reader's epoch (a plain DataLoader's; FeedLoader keeps its own) ---------
    @property
    def epoch(self) -> int:
        """The epoch the dataset's direct reader reads (not any :class:`FeedLoader`'s)."""
        return self._reader.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order when iterated directly (a plain ``DataLoader``, the convention
        of ``DistributedSampler.set_epoch``), from the next iteration on; clears a pending
        resume point. A :class:`FeedLoader` over this dataset has its own ``set_epoch``."""
        self._reader.set_epoch(epoch)

    def split(self) -> Split:
        """The direct reader's share of the rest of its epoch."""
        return self._reader.split(self)

    def __len__(self) -> int:
        """Samples this rank delivers in the direct reader's current (possibly resumed)
        epoch."""
        return self.split().length

    def sample_ids(self, epoch: int | None = None) -> np.ndarray:
        """The ids this rank delivers, in order (as one reader: ``num_workers=0``), in ``epoch``
        from its start (``None``: the direct reader's epoch, from its resume point).

        Example:
            >>> FeedDataset("shards/example").sample_ids()[:4].tolist()
            [0, 1, 2, 3]
        """
        if epoch is None:
            plan, split = self._reader.plan(self), self.split()
        else:
            plan, split = self.plan(epoch), self.split_at(0)
        return plan.sample_ids(split.positions(0, split.length))

    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        """Sample ``g`` (a global id) as the transform sees it in ``epoch`` (``None``: the
        direct reader's): read from its shard, with ``__epoch__`` and ``__seed__``, the
        ``decode=`` fields decoded.

        Example:
            >>> FeedDataset("shards/example", decode={"cls": int}).sample(3)["cls"]
            0
        """
        x = self.shards.sample(int(g))
        x["__epoch__"] = self.epoch if epoch is None else int(epoch)
        x["__seed__"] = self.seed
        if self.decode:
            decode_fields(x, self.decode)
        return x

    def __getitem__(self, g: int) -> dict[str, Any]:
        """Sample ``g`` by its global id, on any rank: ``ds[g]`` is :meth:`sample` ``(g)``, read
        before the transform (``ds.transform(ds[g])`` gives what iteration hands out). A
        negative ``g`` counts from the dataset's end, as a list's index does. The ids are the
        dataset's (``0`` to the manifest's sample count less one), not this rank's positions:
        :meth:`sample_ids` lists those.

        Raises:
            IndexError: ``g`` is outside the dataset (the message gives the valid range).
            TypeError: ``g`` is not an integer (a slice: take :meth:`sample_ids` and index
                with each id).

        Example:
            >>> ds = FeedDataset("shards/example", decode={"cls": int})
            >>> ds[3]["__index__"], ds[3]["cls"], ds[-1]["__index__"]
            (3, 0, 23)
        """
        if isinstance(g, slice):
            raise TypeError(f"{self.url}: FeedDataset takes one global sample id, not a slice; "
                            f"for this rank's ids in order use ds.sample_ids(), then ds[g] "
                            f"for each")
        try:
            i = operator.index(g)
        except TypeError:
            raise TypeError(f"{self.url}: a sample id is an integer, not "
                            f"{type(g).__name__} {g!r} (ds.sample_ids() lists them)") from None
        n = self.manifest.total_samples
        if not -n <= i < n:
            raise IndexError(f"{self.url}: sample id {i} is outside the dataset: it has {n} "
                             f"samples, ids 0 .. {n - 1} (or -{n} .. -1 from the end)")
        return self.sample(i + n if i < 0 else i)

    def in_order(self, transform: Callable[[dict[str, Any]], Any] | None) -> FeedDataset:
        """This dataset read whole in manifest order by one reader (rank 0 of 1, no shuffle),
        each sample through ``transform``; its ``decode=``, ``verify``, shard cache and open
        shard limit kept (what :meth:`~feedpipe.DeviceCache.warmup` reads)."""
        return type(self)(self.url, rank=0, world_size=1, transform=transform,
                          decode=self.decode, verify=self.verify,
                          max_open_shards=self.max_open_shards, cache_dir=self.cache)

    # -- resumption: states of any reader, and the direct reader's -------------------------
    def state_at(self, epoch: int, position: int, layout: Any = -1) -> dict[str, Any]:
        """The resumable state of a reader at global ``position`` of ``epoch``, with what
        identifies the order (the dataset's identity, seed, shuffle, and the node layout the
        epoch was cut with: ``layout``, by default this world's)."""
        lay = self.node_layout() if layout == -1 else layout
        return {
            "version": STATE_VERSION,
            "epoch": int(epoch),
            "position": int(position),
            "num_samples": self.manifest.total_samples,
            "dataset": dict(self.identity),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "layout": None if lay is None else [int(lay[0]), int(lay[1])],
        }

    def resume_layout(self, state: dict[str, Any]) -> tuple[int, int] | None | int:
        """The node layout the rest of ``state``'s epoch is read with: the one it was saved
        with (``None``: the global order, also for a state that names none), or ``-1`` (this
        world's) when it resumes an epoch at its start or is refused."""
        if not state.get("position") or self.state_mismatch(state) is not None:
            return -1
        return saved_layout(state, self.url)

    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, position)`` a reader loading ``state`` continues from.

        A state saved on another dataset, shard layout, seed or shuffle would repeat and lose
        samples: refused with a :class:`~feedpipe.errors.StateError` saying what differs, unless
        ``strict=False``, which logs the difference and gives the saved epoch's start."""
        return checked_resume_point(state, self.state_mismatch, self.url, strict)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The direct reader's resumable state: its epoch and the global position reached
        (``consumed``; default: where its pass starts). :meth:`FeedLoader.state_dict` gives a
        loader's."""
        state = self.state_at(self.epoch, self._reader.start if consumed is None else consumed)
        return self._reader.stamp(state)

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue ``state['epoch']`` at ``state['position']`` on the direct reader's next
        iteration (see :meth:`resume_point` for what is refused)."""
        self._reader.resume(*self.resume_point(state, strict=strict))
        self._reader.keep_layout(self, state)

    def state_mismatch(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot resume this source (a reason to show), or ``None``."""
        return dataset_mismatch(state, self.identity, {
            "seed": self.seed, "shuffle": self.shuffle, "shuffle_window": self.shuffle_window})

    # -- samples ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """This reader's samples of the epoch (a DataLoader worker's share when in one), each
        transformed when there is a transform: the ``samples`` route, unbatched."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is None:
            self.attach()
        if self.decoded is None and self.shards.local:
            # each sample made and handed out as it is taken; what the loop does once a batch
            # (locating shards, checking them for truncation) is done once a run of RUN. Not
            # through the L1 cache: opening a run's shards together would run its plan clock
            # ahead of the reads, letting shards still in use go (and counting them twice)
            return closed_at_exit(each_sample(self, self._reader, worker, workers, RUN,
                                              skips=Skips(), to_bytes=info is not None,
                                              left_out=self._left_out))
        return closed_at_exit(self._batched(worker, workers, to_bytes=info is not None))

    def _batched(self, worker: int, workers: int, *, to_bytes: bool) -> Iterator[Any]:
        """:meth:`__iter__` batch by batch of the plan: through the L1 cache, or with a decoded
        store (its outputs where it holds them)."""
        with EpochReader(self, self._reader, worker, workers) as reader:
            parts = assemble(ROUTES["samples"], self, reader.plan.epoch, list, skips=Skips(),
                             leaves=to_bytes, default=False)
            for outs in parts.run(reader):
                if type(outs) is LeftOut:
                    self._left_out(outs)
                    continue
                yield from outs

    def _left_out(self, batch: LeftOut) -> None:
        """A batch of the plan that lost every sample, read directly: let go on one rank,
        refused on several (their DataLoaders could make different numbers of batches)."""
        if self.world.world_size > 1:
            raise left_out_error(batch, self.world.rank, self.world.world_size,
                                 "read directly (a DataLoader batches what comes)")

    def close(self) -> None:
        """Close the shards this process has open (their leases in the cache released)."""
        self.shards.close()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()  # the ShardSet drops its open shards on the way


def read_capabilities(source: Source, collate_fn: Any, **more: Any) -> Capabilities:
    """The capabilities of a source of samples read from its :attr:`~Source.shards` (through
    its ``transform``, ``decoded`` store and ``max_open_shards``), collated by ``collate_fn``;
    ``more``: the fields it sets otherwise (:class:`~feedpipe.stream._routes.Capabilities`)."""
    store = source.decoded
    state = "none" if store is None else ("complete" if store.complete() else "partial")
    return Capabilities(**{
        "transform": source.transform is not None,
        "into": writes_into(source.transform, collate_fn),
        "local": source.shards.local,
        "store": state,
        "gatherable": state == "complete" and gatherable(source, collate_fn),
        "shards_fit": len(source.shards) <= source.max_open_shards,
        **more})


def sample_ids_of(ds: FeedDataset, epoch: int | None = None) -> np.ndarray:
    """The ids this rank delivers in ``epoch`` with ``num_workers=0``
    (:meth:`FeedDataset.sample_ids`)."""
    return ds.sample_ids(epoch)
