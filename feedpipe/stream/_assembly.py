"""The one assembly of a route: its fetch, compute, executor and sink parts built for one reader
of an epoch, whoever runs the loop.

Every caller of the batch loop takes its parts from :func:`assemble`: :class:`~feedpipe.FeedLoader`
in the training process (the ``inline`` and ``threads`` executors), each DataLoader worker
process of a ``workers`` route (:mod:`feedpipe.stream._worker_source`), and a
:class:`~feedpipe.FeedDataset` read directly (by a plain ``DataLoader``, or by
:meth:`~feedpipe.DeviceCache.warmup`). A new source or sink is one more case here, not one more
assembly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ._batch_loop import (
    CollateMaker,
    Maker,
    PartTimes,
    RowMaker,
    SampleFetch,
    Skips,
    batch_loop,
)

if TYPE_CHECKING:
    from ._batch_loop import EpochReader
    from ._dataset import FeedDataset
    from ._refs import Columns
    from ._routes import Route


@dataclass
class Assembly:
    """A route's parts for one reader: ``fetch`` and ``maker`` (compute and sink) for the batch
    loop, the ``pool`` of the ``threads`` executor and the batches started ``ahead``."""

    fetch: Callable[[np.ndarray], Any]
    maker: Maker
    pool: ThreadPoolExecutor | None = None
    ahead: int = 0

    def run(self, reader: EpochReader, times: PartTimes | None = None) -> Iterator[Any]:
        """The batch loop over ``reader``'s batches of ids (``times``: where the seconds of each
        part are added)."""
        return batch_loop(reader.batches(), self.fetch, self.maker, self.pool, self.ahead,
                          times=times)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def assemble(route: Route, dataset: FeedDataset, epoch: int, collate_fn: Any, *, skips: Skips,
             leaves: bool = False, threads: int = 0, fields: Sequence[str] = (),
             default: bool = True, columns: Columns | None = None,
             pin: bool = False, reader: EpochReader | None = None) -> Assembly:
    """The parts of ``route`` reading ``dataset``'s ``epoch``.

    Args:
        route: the route (:mod:`feedpipe.stream._routes`).
        dataset: the dataset read.
        epoch: the epoch read (for the samples' ``__epoch__``).
        collate_fn: the sink: a ``collate_fn``, a :class:`~feedpipe.BatchCollator` or a worker's
            :class:`~feedpipe.stream._worker_rows.WorkerRing` of its buffers (``rows``).
        skips: where samples the transform left out are counted.
        leaves: the batches leave this process (a DataLoader worker): raw fields as ``bytes``,
            references resolved by the receiving process.
        threads: the ``threads`` executor's pool size.
        fields: the manifest's fields, for the default collation of raw samples.
        default: ``collate_fn`` is the default collation.
        columns: the shards' index as columns, when every shard is open here (``refs``).
        pin: resolved references land in pinned memory.
        reader: the reader whose batches the loop will ask for (``packed``: its fetch makes
            the next ones with each).
    """
    fetch: Callable[[np.ndarray], Any]
    maker: Any
    ahead = 0
    if route.fetch == "packed":
        return _packed(dataset, epoch, reader)
    if route.fetch == "refs":
        from ._refs import RefFetch, Resolver
        from ._store_gather import Finished

        # read-ahead advice pays when the bytes are copied later than they are planned: batches
        # planned ahead from the columns, or resolved by the training process
        fetch = RefFetch(dataset.shards, epoch, dataset.seed, columns=columns,
                         advise=columns is not None or leaves)
        maker = Finished() if leaves else Resolver(dataset, pin_memory=pin)
        if columns is not None:
            ahead = 2
    elif route.fetch == "gather":
        from ._store_gather import Finished, GatherFetch

        fetch = GatherFetch(dataset, epoch, collate_fn)
        maker = Finished()
    else:
        if route.fetch == "mixture":
            from ._mixture_fetch import MixtureFetch

            fetch = MixtureFetch(dataset, epoch,  # type: ignore[arg-type]
                                 copy=route.executor == "threads")
        else:
            fetch = SampleFetch(dataset, epoch, stored=dataset.decoded is not None,
                                copy=route.executor == "threads")
        if route.sink == "rows":
            maker = RowMaker(dataset, collate_fn, into=route.compute == "into", skips=skips,
                             drop=dataset.shards.drop_pages)
        else:
            maker = CollateMaker(dataset, collate_fn, skips=skips, to_bytes=leaves,
                                 fields=fields, default=default)
    pool = None
    if route.executor == "threads":
        pool = ThreadPoolExecutor(threads, thread_name_prefix="feedpipe-transform")
        ahead = 2
    return Assembly(fetch, maker, pool, ahead)


def _packed(dataset: Any, epoch: int, reader: EpochReader | None) -> Assembly:
    """fetch=packed, sink=packed: token rows of a :class:`~feedpipe.Packed`, each batch made
    whole by the fetch, a group of the reader's batches at a time."""
    from ._packed import PackedFetch
    from ._store_gather import Finished

    return PackedAssembly(PackedFetch(dataset, epoch), Finished())


@dataclass
class PackedAssembly(Assembly):
    """The packed routes' parts: the fetch runs the loop itself, a group of batches at a time
    (:meth:`~feedpipe.stream._packed.PackedFetch.run`), as nothing is left for a maker."""

    def run(self, reader: EpochReader, times: PartTimes | None = None) -> Iterator[Any]:
        return self.fetch.run(reader.batches(), times)  # type: ignore[attr-defined]

    def ship(self, reader: EpochReader, ring: Any = None,
             times: PartTimes | None = None) -> Iterator[Any]:
        """In a worker process: the reader's batches a group to a message, in buffers of
        ``ring`` where given (:meth:`~feedpipe.stream._packed.PackedFetch.ship`)."""
        return self.fetch.ship(reader.batches(), reader.worker, ring,  # type: ignore[attr-defined]
                               times)
