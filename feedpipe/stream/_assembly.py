"""The one assembly of a route: its fetch, compute, executor and sink parts built for one reader
of an epoch, whoever runs the loop.

Every caller of the batch loop takes its parts from :func:`assemble`: :class:`~feedpipe.FeedLoader`
in the training process (the ``inline`` and ``threads`` executors), each DataLoader worker
process of a ``workers`` route (:mod:`feedpipe.stream._worker_source`), and a
:class:`~feedpipe.FeedDataset` read directly (by a plain ``DataLoader``, or by
:meth:`~feedpipe.DeviceCache.warmup`). The fetch of samples is the source's own
(:class:`~feedpipe.Source`): a new kind of source needs no case here; a new sink is one.
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
    Skips,
    batch_loop,
)
from ._refs import RefFetch, Resolver
from ._store_gather import Finished, GatherFetch

if TYPE_CHECKING:
    from ._batch_loop import EpochReader
    from ._refs import Columns
    from ._routes import Route
    from ._source import Source


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


def assemble(route: Route, source: Source, epoch: int, collate_fn: Any, *, skips: Skips,
             leaves: bool = False, threads: int = 0, fields: Sequence[str] = (),
             default: bool = True, columns: Columns | None = None,
             pin: bool = False, reader: EpochReader | None = None) -> Assembly:
    """The parts of ``route`` reading ``source``'s ``epoch``.

    Args:
        route: the route (:mod:`feedpipe.stream._routes`).
        source: the source read (:class:`~feedpipe.Source`).
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
        reader: the reader whose batches the loop will ask for.
    """
    fetch: Callable[[np.ndarray], Any]
    maker: Any
    ahead = 0
    if route.source_batches:
        return SourceBatches(source.batch_fetch(epoch), Finished())  # type: ignore[arg-type]
    if route.by_reference:
        # read-ahead advice pays when the bytes are copied later than they are planned: batches
        # planned ahead from the columns, or resolved by the training process
        fetch = RefFetch(source.shards, epoch, source.seed, columns=columns,
                         advise=columns is not None or leaves)
        maker = Finished() if leaves else Resolver(source, pin_memory=pin)
        if columns is not None:
            ahead = 2
    elif route.gathers:
        fetch = GatherFetch(source, epoch, collate_fn)
        maker = Finished()
    else:
        fetch = source.sample_fetch(epoch, copy=route.on_threads)
        if route.writes_rows:
            maker = RowMaker(source, collate_fn, into=route.writes_into, skips=skips,
                             drop=source.shards.drop_pages)
        else:
            maker = CollateMaker(source, collate_fn, skips=skips, to_bytes=leaves,
                                 fields=fields, default=default)
    pool = None
    if route.on_threads:
        pool = ThreadPoolExecutor(threads, thread_name_prefix="feedpipe-transform")
        ahead = 2
    return Assembly(fetch, maker, pool, ahead)


@dataclass
class SourceBatches(Assembly):
    """The parts of a route whose source makes its batches whole (``fetch=packed``): the
    source's :class:`~feedpipe.stream._source.BatchFetch` runs the loop itself, as nothing is
    left for a maker."""

    def run(self, reader: EpochReader, times: PartTimes | None = None) -> Iterator[Any]:
        return self.fetch.run(reader.batches(), times)  # type: ignore[attr-defined]

    def ship(self, reader: EpochReader, ring: Any = None,
             times: PartTimes | None = None) -> Iterator[Any]:
        """In a worker process: the reader's batches as the messages the source's fetch sends,
        in buffers of ``ring`` where given (:meth:`BatchFetch.ship
        <feedpipe.stream._source.BatchFetch.ship>`)."""
        return self.fetch.ship(reader.batches(), reader.worker, ring,  # type: ignore[attr-defined]
                               times)
