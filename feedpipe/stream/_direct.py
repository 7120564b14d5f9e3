"""The direct reader: a source's samples handed out one by one, as a plain ``DataLoader`` (or
``for sample in dataset``) takes them, with no batch of them made or kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._batch_loop import EpochReader, SampleFetch, Skipped, Skips, attempt, bytes_of
from ._collate import LeftOut

if TYPE_CHECKING:
    from ._epoch import EpochState
    from ._source import Source


def each_sample(dataset: Source, state: EpochState, worker: int, workers: int, run: int, *,
                skips: Skips, to_bytes: bool,
                left_out: Callable[[LeftOut], None]) -> Iterator[Any]:
    """fetch=samples, compute=none or call, sink=one by one: reader ``worker`` of ``workers``'s
    samples of the epoch ``state`` names (read a run of ``run`` at a time with
    :meth:`SampleFetch.lazily`), each through the dataset's transform when it has one, handed
    out as it is made: what a reader that delivers samples one by one yields, with no batch of
    them made or kept. A batch of the plan whose every sample the transform left out is passed
    to ``left_out`` when it ends (which raises, or lets it go). ``to_bytes``: memoryviews of
    shard maps become ``bytes`` (the samples leave this process). The decoded store is not
    asked."""
    transform = dataset.transform
    with EpochReader(dataset, state, worker, workers) as reader:
        fetch = SampleFetch(dataset, reader.plan.epoch, stored=False)
        for ids, lens in reader.runs(run):
            samples = fetch.lazily(ids)
            if transform is None:  # nothing to leave out
                if to_bytes:
                    for x in samples:
                        yield bytes_of(x)
                else:
                    yield from samples
                continue
            batches = iter(lens)
            size = left = next(batches)
            kept = 0
            last: Skipped | None = None
            for x in samples:
                o = attempt(transform, x)
                if type(o) is Skipped:
                    skips.note(o)
                    last = o
                else:
                    kept += 1
                    yield bytes_of(o) if to_bytes else o
                left -= 1
                if not left:  # a batch of the plan ends here
                    if not kept and last is not None:
                        left_out(LeftOut(size, str(last.error)))
                    size = left = next(batches, 0)
                    kept = 0
