"""``Source``: what a kind of data gives :class:`~feedpipe.FeedLoader`, and the one interface the
loader, its route choice (:mod:`feedpipe.stream._routes`) and the assembly of a route
(:mod:`feedpipe.stream._assembly`) are written against.

:class:`~feedpipe.FeedDataset` (samples of one dataset's shards), :class:`~feedpipe.Mixture`
(samples drawn from several) and :class:`~feedpipe.Packed` (token rows cut from documents)
implement it; a new kind of data implements it too, outside feedpipe, with no change here
(``tests/test_third_party_source.py`` builds one). A source is a description of data: the
loader that reads it owns the epoch being read (:class:`~feedpipe.stream._epoch.EpochState`).

What a source provides for an epoch:

* its **plan**: :meth:`Source.plan` (which id each position of the epoch holds) and
  :meth:`Source.split_at` (a rank's share of the positions; the loader deals them to batches
  and worker processes);
* its **fetch part**: :meth:`Source.sample_fetch` (the samples of a batch of ids), or, for a
  source whose ids are rows it makes batches of itself, :meth:`Source.batch_fetch`;
* its **state and resume**: :meth:`Source.state_at` and :meth:`Source.resume_point`;
* its **length**: the positions of :meth:`Source.split_at`;
* the **capabilities** a route needs (:meth:`Source.capabilities`): a transform to share
  among workers, fixed-size rows it writes into, local shards to read by reference, a decoded
  store, batches it makes whole (token rows); the route table reads them, never the class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..plan._order import Split
from ._routes import Capabilities

if TYPE_CHECKING:
    import numpy as np

    from ..caches._decoded import DecodedStore
    from ..plan._order import Plan
    from ..plan._world import World
    from ._shard_set import ShardSet


class BatchFetch(Protocol):
    """The fetch part of a source that makes its batches whole (:meth:`Source.batch_fetch`):
    it runs the batch loop itself over the reader's batches of ids (``times``: where the
    seconds of its parts are added, a ``PartTimes`` of the batch loop)."""

    def run(self, batches: Iterator[np.ndarray], times: Any = None) -> Iterator[Any]:
        """The batches of ``batches`` (each an array of the source's ids), in order."""

    def ship(self, batches: Iterator[np.ndarray], worker: int, ring: Any = None,
             times: Any = None) -> Iterator[Any]:
        """In a worker process: the same batches, as the messages sent to the training process
        (``ring``: the worker's reused buffers, or ``None``)."""


class Source(ABC):
    """What :class:`~feedpipe.FeedLoader` reads: a kind of data, described for every rank and
    epoch.

    A subclass sets the attributes below in its constructor and implements the abstract
    methods; the other methods have defaults that suit a source of samples. The loader asks
    a source only what this class declares: never which class it is.

    Attributes:
        url: where the data is (named in messages).
        manifest: the :class:`~feedpipe.Manifest` of the shards read, or an object with its
            ``fields`` (the fields of a raw batch), ``total_samples`` and ``shards``.
        shards: the :class:`~feedpipe.ShardSet` the samples are read from: the loader prefetches
            through it, counts its bytes, and names a shard cut under a worker through it.
        world: the rank of this process and the number of ranks (:class:`~feedpipe.World`).
        seed: the seed of the source's order (each sample's ``__seed__``).
        transform: what each sample goes through, or ``None``.
        decode: the fields decoded as they are read (``decode=``), by name.
        decoded: the decoded store of the transform's outputs, or ``None``.
        max_open_shards: shards kept open at once in a process.
        bytes_read: bytes the source copies out of the shards itself (a source that makes its
            batches whole), counted in ``stats()["io"]``; ``None``: the loader counts them.
        prefetches: its shards are read in the plan's order of samples, so the shard cache
            may prefetch them along it (a plan of rows is not).
        drop_last: ``True``: the ranks are made equal by leaving positions out, ``False``: by
            repeating at most ``world_size - 1`` of them (the default :meth:`split_at`).

    Example:
        >>> import feedpipe
        >>> isinstance(feedpipe.FeedDataset("shards/example"), feedpipe.Source)
        True
    """

    url: str
    manifest: Any  # a Manifest, or what a reader needs of one (fields, total_samples, shards)
    shards: ShardSet
    world: World
    seed: int
    transform: Callable[[Any], Any] | None
    decode: Mapping[str, Any]
    decoded: DecodedStore | None
    max_open_shards: int
    bytes_read: int | None = None
    prefetches: bool = True
    drop_last: bool = False

    # -- the plan of an epoch ----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the source's direct reader reads (a loader keeps its own; a source that
        is only read by loaders: 0)."""
        return 0

    def attach(self) -> None:
        """Make the source the one of the process that reads it (each pass calls this before
        it plans): take this process's own memory, detect the world again. By default, there
        is nothing to do."""
        return None

    @abstractmethod
    def plan(self, epoch: int | None = None) -> Plan:
        """The plan of ``epoch``: the id each position holds (``plan.sample_ids(positions)``)."""

    def split_at(self, start: int = 0, whole_batches: bool = False, *,
                 epoch: int | None = None) -> Split:
        """This rank's share of ``epoch``'s positions from ``start`` on (``whole_batches``:
        each rank's short last batch left out); its ``length`` is the source's length. By
        default every epoch has the manifest's ``total_samples`` positions, the ranks made equal
        as ``drop_last`` says."""
        return Split(self.manifest.total_samples, self.world.world_size, self.world.rank,
                     int(start), self.drop_last, bool(whole_batches))

    # -- state and resume --------------------------------------------------------------------
    @abstractmethod
    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The resumable state of a reader at global ``position`` of ``epoch`` (with ``epoch``
        and ``position`` keys)."""

    @abstractmethod
    def resume_point(self, state: dict[str, Any], *, strict: bool = True) -> tuple[int, int]:
        """The ``(epoch, position)`` a reader loading ``state`` continues from; a state of
        other data raises :class:`~feedpipe.StateError` (``strict=False``: the saved epoch
        from its start, said in a log record)."""

    # -- what a route needs ------------------------------------------------------------------
    @abstractmethod
    def capabilities(self, collate_fn: Any) -> Capabilities:
        """What this source offers the routes when its batches are collated by ``collate_fn``
        (:class:`~feedpipe.Capabilities`)."""

    def sample_fetch(self, epoch: int, *, copy: bool) -> Callable[[np.ndarray], list[Any]]:
        """The fetch part of a route of samples: for a batch of ids, a list of ``(id, sample,
        finished)`` (``finished``: the sample is already its transform's output). ``copy``:
        the samples hold no view of a shard's map (other threads read them later)."""
        raise NotImplementedError(f"{type(self).__name__} makes no samples (its capabilities "
                                  "say makes_batches: its batch_fetch makes them)")

    def sample(self, g: int, epoch: int | None = None) -> dict[str, Any]:
        """Sample ``g`` as its transform sees it in ``epoch``: what a source with a decoded
        store reads again where the store lost a record."""
        raise NotImplementedError(f"{type(self).__name__} reads no sample on its own")

    def batch_fetch(self, epoch: int) -> BatchFetch:
        """The fetch part of a source that makes its batches whole (``makes_batches``)."""
        raise NotImplementedError(f"{type(self).__name__} makes samples, not whole batches")

    # -- what the loader reports -------------------------------------------------------------
    def ledger_info(self) -> dict[str, Any]:
        """What ``FeedLoader(ledger=)`` records of this source in ``ledger.json``: what its
        epochs' plans are made of, for ``feedpipe ledger`` to recompute them."""
        raise ValueError(f"FeedLoader(ledger=) over a {type(self).__name__}: this source says "
                         "nothing the ledger can recompute its plans from; leave ledger out")

    @property
    def skip_bases(self) -> Mapping[str, int] | None:
        """Where a sample a transform left out is numbered from, by its ``__source__`` (a
        source whose samples name the source they come from); ``None``: by ``__index__``."""
        return None

    def delivered(self, epoch: int, split: Split, batches: int,
                  batch_size: int) -> dict[str, int] | None:
        """``stats()["sources"]``: the samples of each part of the source in a rank's first
        ``batches`` batches of ``split``, or ``None`` where it has no parts."""
        return None

    def check_loader(self, raw_default: bool) -> None:
        """Refuse a loader that cannot collate this source's batches (``raw_default``: raw
        samples, the default collation) with an error saying why; by default, accept it."""
        return None

    def collate_error(self, outs: list[Any], error: Exception) -> Exception | None:
        """The error to raise for a batch whose collation raised ``error`` (``None``: that
        error itself)."""
        return None

    def tag_batch(self, batch: dict[str, Any], shards: np.ndarray) -> None:
        """Add to a raw batch read by reference (``refs``) what the source's samples carry
        besides their fields; ``shards``: each sample's shard."""
        return None
