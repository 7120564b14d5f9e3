"""The batch core: one loop turns one reader's share of an epoch into batches.

For each batch of ids the plan gives a reader (a rank, or one of its worker processes), the loop
*fetches* (:class:`SampleFetch`, :class:`~feedpipe.stream._refs.RefFetch`,
:class:`~feedpipe.stream._store_gather.GatherFetch`). It hands what it fetched to a *maker*,
which *computes* and *sinks* it into a batch (:class:`CollateMaker`, :class:`RowMaker`, or a
route's own). With a thread pool (the ``threads`` executor) a maker starts a batch's per-sample
work on the pool, and the loop keeps ``ahead`` batches in flight. With none (``inline``) the
work is done as the batch is started. The ``workers`` executor runs this same loop inside each
DataLoader worker process (:mod:`feedpipe.stream._worker_source`).
:mod:`feedpipe.stream._routes` names the combinations.

The loop reads a source through what :class:`~feedpipe.Source` declares, never its class.
Which epoch, from which position and in batches of what
size is the reader's own :class:`~feedpipe.stream._epoch.EpochState`, not the dataset's.

A transform may leave a sample out by raising :class:`~feedpipe.errors.SampleSkipped`: the
makers log a warning naming it, count it and deliver the batch without it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .._redact import logger
from ..caches._passes import begin_pass, end_pass
from ..errors import SampleSkipped
from ..plan._order import batch_groups, iter_ids, worker_positions
from ..transforms._threads import one_thread
from ._collate import LeftOut, decode_fields
from ._worker_rows import WorkerRing

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from ..format._reader import ShardReader
    from ._collator import BatchCollator
    from ._epoch import EpochState
    from ._routes import Route
    from ._source import Source as LoopDataset  # what the loop reads of a source

log = logger("feedpipe")

# Rows written between two drops of the shard maps' pages (RowMaker): a batch's samples are all
# fetched before any is decoded, so the maps' own accounting (reader.DROP_EVERY) comes before the
# touches; without these drops a batch of large images keeps many of its shards' pages mapped.
DROP_ROWS = 16

Item = tuple[int, Any, bool]  # (global id, sample dict or finished output, finished)


class Maker(Protocol):
    """The compute and sink parts of a route: ``start`` a fetched batch (on ``pool`` when
    given), then ``finish`` it into the batch the loop yields."""

    def start(self, fetched: Any, pool: ThreadPoolExecutor | None) -> Any: ...

    def finish(self, pending: Any) -> Any: ...


class PartTimes:
    """Seconds the batch loop spent in each part of a route, added up over a pass: ``fetch``
    (reading ids' samples or references), ``compute`` (starting each batch: the transform where
    it runs inline; with a thread pool, also the wait for the pool's transforms and the batch's
    collation after them, which cannot be told apart from this thread) and ``sink`` (finishing
    each batch: collation, writing rows, resolving references). Timed once per batch. Apart
    from them, ``startup``: from the start of the pass until the batch loop began (worker
    processes started, the dataset and its shards opened, the route's parts made), which the
    loader sets, not the loop."""

    __slots__ = ("fetch", "compute", "sink", "startup")

    def __init__(self) -> None:
        self.fetch = self.compute = self.sink = self.startup = 0.0

    def as_tuple(self) -> tuple[float, float, float]:
        return self.fetch, self.compute, self.sink

    def add(self, t: tuple[float, float, float]) -> None:
        self.fetch += t[0]
        self.compute += t[1]
        self.sink += t[2]


def time_figures(t: PartTimes, waited: float, wall: float, route: Route, workers: int,
                 threads: int) -> tuple[dict[str, Any], str | None]:
    """``stats()["time"]``: a pass of ``route``'s seconds per part (``t``), its ``wait`` for
    batches, its ``step`` between them and its ``wall`` time, with ``parts_in`` saying where the
    parts ran; and ``stats()["bound"]``: the part that bounds the pass (``step`` when the loop
    waited less than it worked), or ``None`` before it ran."""
    if route.in_workers:
        parts_in = f"{workers} worker processes (their seconds added up)"
    elif route.on_threads:
        parts_in = f"this process, compute with {threads} threads (the wait for them)"
    else:
        parts_in = "this process"
    times: dict[str, Any] = {
        "startup": t.startup, "fetch": t.fetch, "compute": t.compute, "sink": t.sink,
        "wait": waited, "step": max(0.0, wall - waited), "wall": wall, "parts_in": parts_in}
    if wall <= 0.0:
        return times, None
    if times["step"] >= waited:
        return times, "step"
    parts = {k: times[k] for k in ("startup", "fetch", "compute", "sink")}
    return times, max(parts, key=parts.__getitem__)


def batch_loop(batches: Iterator[np.ndarray], fetch: Callable[[np.ndarray], Any], maker: Maker,
               pool: ThreadPoolExecutor | None = None, ahead: int = 0,
               times: PartTimes | None = None) -> Iterator[Any]:
    """The one loop: ``maker.finish(maker.start(fetch(ids), pool))`` for each batch of ids,
    with up to ``ahead`` batches started beyond the one being finished. A batch whose every
    sample the transform left out comes as a :class:`~feedpipe.stream._collate.LeftOut`.
    ``times``: where the seconds of each part are added (:class:`PartTimes`)."""
    pending: deque[Any] = deque()
    if times is None:
        for ids in batches:
            pending.append(maker.start(fetch(ids), pool))
            while len(pending) > ahead:
                yield maker.finish(pending.popleft())
        while pending:
            yield maker.finish(pending.popleft())
        return
    clock = time.perf_counter
    waits_on_pool = pool is not None

    def finish() -> Any:
        t = clock()
        out = maker.finish(pending.popleft())
        if waits_on_pool:  # the wait for the pool's transforms
            times.compute += clock() - t
        else:
            times.sink += clock() - t
        return out

    for ids in batches:
        t0 = clock()
        fetched = fetch(ids)
        t1 = clock()
        pending.append(maker.start(fetched, pool))
        times.fetch += t1 - t0
        times.compute += clock() - t1
        while len(pending) > ahead:
            yield finish()
    while pending:
        yield finish()


class EpochReader:
    """One reader's share of the epoch ``state`` names (rank, worker ``worker`` of
    ``workers``): the ids of each of its batches, in order, and, as a context manager, the shard
    prefetching into the cache and the decoded store's bookkeeping around reading them."""

    def __init__(self, dataset: LoopDataset, state: EpochState, worker: int = 0,
                 workers: int = 1) -> None:
        self.dataset = dataset
        self.plan = state.plan(dataset)  # a resumed epoch keeps its saved node layout
        self.split = state.split(dataset)
        self.batch_size = state.batch_size
        self.worker, self.workers = worker, workers
        store = dataset.decoded
        # a complete decoded store needs no shard this epoch: nothing to prefetch; nor has a
        # source whose plan is not of samples (feedpipe.Packed's rows) an order to prefetch by
        self.prefetch = (store is None or not store.complete()) and dataset.prefetches

    def batches(self) -> Iterator[np.ndarray]:
        return iter_ids(self.plan, self.split, self.batch_size, self.worker, self.workers)

    def runs(self, at_least: int) -> Iterator[tuple[np.ndarray, list[int]]]:
        """The same ids as :meth:`batches`, in the same order, consecutive batches joined until
        a run holds at least ``at_least`` ids: ``(ids, each joined batch's length)``. For a
        reader that delivers samples one by one (a batch of one sample each, by default), so
        that what the loop does once a batch (locating shards, checking them for truncation,
        collating) is done once a run."""
        plan, split, size = self.plan, self.split, self.batch_size
        for ts in batch_groups(split, size, self.worker, self.workers):
            pos, lens = worker_positions(split, size, ts)
            ids = plan.sample_ids(pos)
            lo = at = 0
            run: list[int] = []
            for n in lens.tolist():
                run.append(n)
                at += n
                if at - lo >= at_least:
                    yield ids[lo:at], run
                    lo, run = at, []
            if run:
                yield ids[lo:at], run

    def __enter__(self) -> EpochReader:
        ds = self.dataset
        if self.prefetch and ds.shards.cache is not None:  # the next epoch's plan is for it
            ds.shards.begin(self.plan, ds.plan(self.plan.epoch + 1), self.split, ds.world,
                            self.batch_size, self.worker, self.workers)
        elif self.prefetch:
            ds.shards.begin_uncached()
        self.pass_number = begin_pass()  # the caches re-read their transform's fingerprint
        return self

    def __exit__(self, *exc: object) -> None:
        ds = self.dataset
        end_pass(self.pass_number)
        if self.prefetch:
            ds.shards.end()
        if ds.decoded is not None:
            ds.decoded.end_pass()


class SampleFetch:
    """fetch=samples: each id's sample dict from the dataset's :class:`~feedpipe.ShardSet`
    (with ``__epoch__`` and ``__seed__``, and its ``decode=`` fields decoded), or, with
    ``stored=True``, its transform output when the decoded store holds it. Before returning it
    checks that no shard it read from was truncated since it was opened. With ``copy=True``
    the fields are copied out of the maps right after that check (``bytes``, not views): for
    an executor that reads them later on other threads of this process, where a read past the
    end of a shard cut in the meantime would kill the process (``SIGBUS``)."""

    def __init__(self, dataset: LoopDataset, epoch: int, *, stored: bool,
                 copy: bool = False) -> None:
        self.shards = dataset.shards
        self.epoch, self.seed = epoch, dataset.seed
        self.store = dataset.decoded if stored else None
        self.decode = dataset.decode
        self.copy = copy

    def __call__(self, ids: np.ndarray) -> list[Item]:
        shards = self.shards
        s_of, i_of = shards.locate(ids)
        store, decode, epoch, seed = self.store, self.decode, self.epoch, self.seed
        out: list[Item] = []
        readers: dict[int, ShardReader] = {}  # looked up once a batch, not once a sample
        # an epoch's first batch: samples whose shards are still arriving, read by range
        early = shards.early(ids) if store is None else {}
        for g, s, i in zip(ids.tolist(), s_of.tolist(), i_of.tolist()):
            if store is not None:
                o = store.get(g)
                if o is not None:
                    out.append((g, o, True))
                    continue
            x = early.pop(g, None) if early else None
            if x is None:
                r = readers.get(s)
                if r is None:
                    with shards.hold(readers):  # opening it closes none this batch reads
                        r = readers[s] = shards.reader(s)
                x = r.sample(i)
            x["__epoch__"] = epoch  # with __index__ and __seed__: per-sample
            x["__seed__"] = seed  # augmentation seeds, reproducible on resume
            if decode:
                decode_fields(x, decode)
            out.append((g, x, False))
        shards.check(readers)
        if self.copy:
            for _, x, done in out:
                if not done:
                    bytes_of(x)
        return out

    def lazily(self, ids: np.ndarray) -> Iterator[dict[str, Any]]:
        """The sample dicts of ``ids`` (the decoded store not asked), each made as it is taken:
        for a reader that hands samples out one by one (:class:`~feedpipe.FeedDataset` iterated
        directly), so that no batch of them is alive at once. The shards they are in are opened
        and checked for truncation first, once for all of them; their bytes are read after
        that (by ``decode=`` or ``copy=True`` here, or by the taker)."""
        shards = self.shards
        s_of, i_of = shards.locate(ids)
        s_list = s_of.tolist()
        readers = self._open(dict.fromkeys(s_list))
        shards.check(readers)
        epoch, seed, decode, copy = self.epoch, self.seed, self.decode, self.copy
        for s, i in zip(s_list, i_of.tolist()):
            try:
                x = readers[s].sample(i)
            except IndexError:  # closed since by the taker's own reads of this dataset
                x = shards.reader(s).sample(i)
            x["__epoch__"] = epoch
            x["__seed__"] = seed
            if decode:
                decode_fields(x, decode)
            if copy:
                bytes_of(x)
            yield x

    def _open(self, shards: Iterable[int]) -> dict[int, ShardReader]:
        """The readers of these shards, opened together (opening one closes none of them)."""
        readers: dict[int, ShardReader] = {}
        with self.shards.hold(shards):
            for s in shards:
                readers[s] = self.shards.reader(s)
        return readers


class Skips:
    """Samples left out by their transform (:class:`~feedpipe.errors.SampleSkipped`), logged
    one warning each and counted."""

    def __init__(self, bases: Mapping[str, int] | None = None) -> None:
        self.count = 0
        self.ids: list[int] = []  # the global ids of those left out (FeedLoader's ledger)
        # a Mixture's: each source's first sample number, since a sample's __index__ is its id
        # within its __source__
        self.bases = bases

    def note(self, skipped: Skipped) -> None:
        self.count += 1
        base = 0 if self.bases is None else self.bases.get(str(skipped.source))
        if skipped.index is not None and base is not None:  # unnamed: the ledger finds a loss
            self.ids.append(base + skipped.index)
        log.warning("feedpipe: a sample was left out of its batch: %s", skipped.error)


class Skipped:
    """A sample its transform left out (:func:`attempt`): the error, and the sample's
    ``__index__`` and ``__source__`` where it had them."""

    __slots__ = ("error", "index", "source")

    def __init__(self, error: SampleSkipped, sample: Any) -> None:
        self.error = error
        index = sample.get("__index__") if isinstance(sample, dict) else None
        self.index = None if index is None else int(index)
        self.source = sample.get("__source__") if isinstance(sample, dict) else None


def attempt(fn: Callable[[Any], Any], x: Any) -> Any:
    try:
        return fn(x)
    except SampleSkipped as e:
        return Skipped(e, x)


def bytes_of(x: Any) -> Any:
    if isinstance(x, dict):
        for k, v in x.items():
            if type(v) is memoryview:
                x[k] = v.tobytes()
    return x


class CollateMaker:
    """compute=none or call, sink=collate: each sample's output (the sample itself without a
    transform; the store's copy when it holds one) collated by ``collate_fn``. New outputs are
    stored in the decoded store here, in the thread that finishes the batch (the store is
    written from one thread). ``to_bytes``: memoryviews of shard maps become ``bytes`` (the
    batch leaves this process). ``fields``: the manifest's fields, passed to the default
    collation of raw samples so that every batch has every field."""

    def __init__(self, dataset: LoopDataset, collate_fn: Callable[[list[Any]], Any], *,
                 skips: Skips, to_bytes: bool = False, fields: Sequence[str] = (),
                 default: bool = True) -> None:
        self.transform = dataset.transform
        self.store = dataset.decoded
        self.names = dataset.shards.names
        self.first = dataset.shards.first
        self.collate_fn = collate_fn
        self.skips = skips
        self.to_bytes = to_bytes
        self.fields = fields if default and self.transform is None else ()
        self.collate_error = dataset.collate_error  # a Mixture names the sources

    def start(self, items: list[Item], pool: ThreadPoolExecutor | None) -> Any:
        fn = self.transform
        if fn is None:
            return None, [x for _, x, _ in items]
        if pool is None:
            outs = [x if done else attempt(fn, x) for _, x, done in items]
        else:
            outs = [x if done else pool.submit(attempt, fn, x) for _, x, done in items]
        return (items if self.store is not None else None), outs

    def finish(self, pending: Any) -> Any:
        items, pending = pending
        if self.transform is None:  # the samples themselves: nothing to wait for, skip or store
            return self._collate([bytes_of(o) for o in pending] if self.to_bytes else pending)
        outs: list[Any] = []
        store = self.store
        last: Skipped | None = None
        for j, o in enumerate(pending):
            if isinstance(o, Future):
                o = o.result()
            if type(o) is Skipped:
                self.skips.note(o)
                last = o
                continue
            if items is not None and not items[j][2]:
                g, x, _ = items[j]
                s = int(np.searchsorted(self.first, g, side="right")) - 1
                o = store.put(g, o, key=x["__key__"], shard=self.names[s],  # type: ignore[union-attr]
                              sample=x)
            outs.append(bytes_of(o) if self.to_bytes else o)
        if last is not None and not outs:
            return LeftOut(len(pending), str(last.error))
        return self._collate(outs)

    def _collate(self, outs: list[Any]) -> Any:
        try:
            if self.fields:
                return self.collate_fn(outs, self.fields)  # type: ignore[call-arg]
            return self.collate_fn(outs)
        except Exception as e:
            why = self.collate_error(outs, e)
            if why is None:
                raise
            raise why from e


class RowMaker:
    """sink=rows: each sample's image written into its row of a batch buffer of ``buffers``.

    ``buffers`` is a :class:`~feedpipe.BatchCollator`, or a worker's
    :class:`~feedpipe.stream._worker_rows.WorkerRing`. The transform writes the row itself
    (``into=True``: ``transform.into(sample, row)``, no per-sample tensor), or its output is
    copied there; the label goes into the labels. A skipped sample's row is filled by the rows
    after it (the batch is that much shorter). ``drop`` unmaps the shard pages read so far,
    every :data:`DROP_ROWS` rows and after each batch."""

    def __init__(self, dataset: LoopDataset, buffers: BatchCollator | WorkerRing, *, into: bool,
                 skips: Skips, drop: Callable[[], None] | None = None) -> None:
        self.transform = dataset.transform
        self.buffers = buffers
        self.collator = buffers.collator if isinstance(buffers, WorkerRing) else buffers
        self.into = into
        self.skips = skips
        self.drop = drop

    def start(self, items: list[Item], pool: ThreadPoolExecutor | None) -> Any:
        n = len(items)
        images, labels = self.buffers.buffer(n)
        rows = images.unbind(0)
        if pool is not None:
            return images, labels, [pool.submit(self._row, x, rows, labels, j)
                                    for j, (_, x, _) in enumerate(items)]
        try:
            ys: Any = labels.numpy()
        except TypeError:  # a label dtype NumPy lacks (bfloat16): item assignment
            ys = labels
        drop = self.drop
        results: list[Any] = []
        with one_thread():  # once a batch, not twice a sample
            for j, (_, x, _) in enumerate(items):
                if drop is not None and j and not j % DROP_ROWS:
                    drop()
                results.append(self._row(x, rows, ys, j))
        return images, labels, results

    def _row(self, x: Any, rows: Sequence[torch.Tensor], labels: Any, j: int) -> Any:
        """Sample ``x`` into row ``j``: True/False (a label was written or not), or Skipped."""
        try:
            if self.into:
                label = self.transform.into(x, rows[j])  # type: ignore[union-attr]
            else:
                out = self.transform(x)  # type: ignore[misc]
                paired = isinstance(out, (tuple, list))
                img, label = (out[0], out[1]) if paired else (out, None)
                if tuple(img.shape) != self.collator.shape:
                    raise ValueError(
                        f"sample {x.get('__key__')!r} of {x.get('__shard__')!r}: the transform "
                        f"gave shape {tuple(img.shape)}, the collator takes "
                        f"{self.collator.shape}")
                with one_thread():
                    rows[j].copy_(img if isinstance(img, torch.Tensor) else torch.as_tensor(img))
        except SampleSkipped as e:
            return Skipped(e, x)
        if label is not None:
            labels[j] = label
        return label is not None

    def finish(self, pending: Any) -> Any:
        images, labels, results = pending
        results = [r if type(r) in (bool, Skipped) else r.result() for r in results]
        keep = [j for j, r in enumerate(results) if type(r) is not Skipped]
        for r in results:
            if type(r) is Skipped:
                self.skips.note(r)
        if not keep:
            if self.drop is not None:
                self.drop()
            return LeftOut(len(results), str(results[-1].error))
        paired = {results[j] for j in keep}
        if len(paired) != 1:
            raise ValueError("the transform returned a label for some samples of a batch and "
                             "none for others")
        if len(keep) < len(results):  # close the gaps the skipped rows left
            for to, j in enumerate(keep):
                if to != j:
                    images[to].copy_(images[j])
                    labels[to] = labels[j]
            images, labels = images[:len(keep)], labels[:len(keep)]
        if self.drop is not None:
            self.drop()
        return (images, labels) if paired.pop() else images
