"""A remote epoch's first batch, read by byte range while its shards still arrive whole.

With a shuffle across shards, the first batch of an epoch draws from many shards, and a shard
is read from the L1 cache only once the whole of it has arrived and been checked. So the first
batch used to wait for most of the download. Here its samples whose shards are not in the cache
yet are read by their own range requests, from the offsets in each shard's index, while the
shards keep coming whole into the cache (:mod:`feedpipe.caches._shards`). The wait becomes about
three round trips (the manifest, the indexes, the samples) plus the batch's bytes over the
link, instead of most of the dataset's bytes.

**Why byte ranges, not the other two ways.**

- *Readiness per range of the L1 file* (serve a sample once the fill's range holding it has
  landed in the ``.part`` file) does not shorten the wait: the fill's ranges (about 4 MiB,
  ``FEEDPIPE_RANGE_BYTES``) of all the first shards share the link and land together, near the
  end of the download; smaller ranges cost a round trip each. It would also need a record of
  the landed ranges that other processes read and trust, beside files whose only promise is
  that a ``.part`` file is never read (a crash could leave that record claiming bytes the file
  lacks), and it would serve bytes before the shard's hash is checked just the same.
- *Ordering the plan's first samples from the shards fetched first* changes the order: the
  first batches would mix a few shards instead of the whole dataset (worse shuffle quality
  where a training run is most sensitive to it), the order would depend on what the cache
  held, and a batch would still wait for at least one whole shard.
- *Reading the first batch by byte range* leaves the order alone (the plan, its shuffle
  quality, exactly-once and resume are unchanged), never touches the cache's files (their
  crash-safety and budget are unchanged) and shares nothing between processes: each reader
  (each DataLoader worker) reads its own first batch. Its cost: the first batch's bytes are
  fetched twice (alone, and inside their shards), in at most one range request per sample
  (without a cache, samples of a shard at most :data:`GAP` bytes apart share one) and one index
  request per shard of that batch. A shard's index is fetched once per process
  where its fill asks for it at the same time (:mod:`feedpipe.caches.l1._joined`).

Without a cache (``cache_dir=False``: each sample its own range request) the first batch is
read the same way, all its samples at once after its shards' indexes, rather than one shard
after another (each opened with a request for its size, its index, then one sample after
another); nothing else arrives then, and nothing is fetched twice.

Only the first batch after :meth:`~feedpipe.ShardSet.begin` (the start of an epoch, or of a
resumed one) is read this way, and only where it wants at most :data:`MAX_SAMPLES` samples so
(said in a log record otherwise): later batches read the shards the prefetch has been fetching
meanwhile, and reading them by range too would send their bytes twice over a link that is
already busy with them. The samples read this way are checked as an uncached read is (each
member inside the shard's size, the index's samples as many as the manifest's); the shard's
hash is checked when the whole shard lands, as always. A failure here (an index missing or
damaged, the store refusing) is said in a log record and those samples are read through the
cache as before, which reports the error itself if it persists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

from .._helpers.storage import range_target, read_bytes
from .._helpers.storage_io import gathers, read_spans
from .._redact import logger, redact
from ..errors import ShardFormatError
from ..format._index import ShardIndex, index_path, parse_index
from ..format._manifest import ShardRecord
from .l1._joined import joined

log = logger("feedpipe.cache")

STREAMS = 64  # range requests of a first batch in flight at once (a batch's samples, about)
# the most samples a first batch reads by range: beyond, they would go in more than a few waves
# of round trips and add up to many shards' bytes, fetched twice: the batch waits for its shards
MAX_SAMPLES = 4 * STREAMS
# without a cache, samples of one shard at most this many bytes apart share one range request:
# a request costs the client more CPU (and the store a request) than such a gap costs the link.
# Not beside whole-shard fills: a link shared per response gives the batch fewer shares
# against the fills' ranges, and its first batch arrives later (seen in
# test_two_workers_read_their_first_batches_before_the_shards[read-ahead])
GAP = 16 << 10


def enabled() -> bool:
    """Whether first batches are read by range (``FEEDPIPE_FIRST_BATCH_RANGES``, default 1; 0:
    no, for a store that bills each request dearly: the first batch waits for its shards)."""
    return os.environ.get("FEEDPIPE_FIRST_BATCH_RANGES", "1").strip() != "0"


class Want:
    """The samples wanted of one shard: ``url``, its manifest record and
    ``(global id, index in the shard)`` pairs."""

    __slots__ = ("url", "rec", "pairs")

    def __init__(self, url: str, rec: ShardRecord, pairs: list[tuple[int, int]]) -> None:
        self.url, self.rec, self.pairs = url, rec, pairs


def read_early(wants: Sequence[Want], gap: int = -1) -> dict[int, dict[str, Any]]:
    """The samples of ``wants`` by global id, read by range requests (all at once, each shard's
    index first; samples of a shard at most ``gap`` bytes apart in one request: :func:`spans`;
    -1: each sample its own).
    A shard whose index or samples cannot be read is left out, said in a log record: its
    samples are for the caller to read as before."""
    if not wants:
        return {}
    n = sum(len(w.pairs) for w in wants)
    if n > MAX_SAMPLES:
        log.info("%s: the first batch's %d samples whose shards are still coming are more than "
                 "%d: it waits for its shards instead of reading them by range",
                 redact(wants[0].url), n, MAX_SAMPLES)
        return {}
    # a pool of its own, apart from the pool of the shards' ranges
    # (:mod:`feedpipe._helpers.storage`), which the prefetch keeps full: these few small
    # requests do not queue behind whole shards. Made per first batch: nothing stays behind.
    with ThreadPoolExecutor(min(STREAMS, n), thread_name_prefix="feedpipe-early") as pool:
        return _read(pool, wants, gap)


def _read(pool: ThreadPoolExecutor, wants: Sequence[Want],
          gap: int) -> dict[int, dict[str, Any]]:
    jobs = {pool.submit(_index, w): w for w in wants}
    reads: list[tuple[Want, ShardIndex, list[Span], Future[list[bytes]]]] = []
    # each shard's ranges leave as soon as its own index is in, not behind the indexes before it
    for job in as_completed(jobs):
        w = jobs[job]
        try:
            index = job.result()
        except Exception as e:  # noqa: BLE001 - said, and read through the cache instead
            _said(w, e)
            continue
        todo = spans(index, w.pairs, gap)
        if gathers(w.url):  # one job: the client sends them all at once itself
            reads.append((w, index, todo, pool.submit(read_spans, w.url,
                                                      [(s.lo, s.hi) for s in todo])))
        else:
            reads.extend((w, index, [s], pool.submit(read_spans, w.url, [(s.lo, s.hi)]))
                         for s in todo)
    out: dict[int, dict[str, Any]] = {}
    failed: set[str] = set()
    for w, index, group, fut in reads:
        try:
            blobs = fut.result()
        except Exception as e:  # noqa: BLE001 - said, and read through the cache instead
            if w.url not in failed:
                failed.add(w.url)
                _said(w, e)
            continue
        for span, blob in zip(group, blobs):
            for g, i in span.pairs:
                out[g] = _sample(w, index, g, i, blob, span.lo)
    return out


class Span:
    """One range request ``[lo, hi)`` of a shard and the ``(global id, index in the shard)``
    pairs of the samples it holds."""

    __slots__ = ("lo", "hi", "pairs")

    def __init__(self, lo: int, hi: int, pairs: list[tuple[int, int]]) -> None:
        self.lo, self.hi, self.pairs = lo, hi, pairs


def _extent(index: ShardIndex, i: int) -> tuple[int, int]:
    """Sample ``i``'s bytes ``[lo, hi)`` in its shard (its members and the tar headers between)."""
    a, b = index.starts[i], index.starts[i + 1]
    if b <= a:
        return 0, 0
    return index.offsets[a], index.offsets[b - 1] + index.sizes[b - 1]


def spans(index: ShardIndex, pairs: Sequence[tuple[int, int]], gap: int = GAP,
          most: int | None = None) -> list[Span]:
    """The range requests for the samples ``pairs`` of one shard: samples whose bytes lie at
    most ``gap`` bytes apart share one request (split here), up to ``most`` bytes a request
    (default :func:`~feedpipe._helpers.storage.range_target`), so that a batch with many
    samples of one shard costs a few requests, not one a sample.

        >>> from feedpipe.format._index import ShardIndex
        >>> ix = ShardIndex(["a", "b", "c"], [0, 1, 2, 3], ["bin"] * 3, [512, 1536, 9000],
        ...                 [512] * 3)
        >>> [(s.lo, s.hi, s.pairs) for s in spans(ix, [(7, 2), (5, 0), (6, 1)], gap=1024)]
        [(512, 2048, [(5, 0), (6, 1)]), (9000, 9512, [(7, 2)])]
    """
    most = range_target() if most is None else most
    out: list[Span] = []
    for lo, hi, g, i in sorted((*_extent(index, i), g, i) for g, i in pairs):
        last = out[-1] if out else None
        if last is not None and lo - last.hi <= gap and max(hi, last.hi) - last.lo <= most:
            last.hi = max(last.hi, hi)
            last.pairs.append((g, i))
        else:
            out.append(Span(lo, hi, [(g, i)]))
    return out


def _index(w: Want) -> ShardIndex:
    """The shard's index from the source (the GET its fill makes at the same moment, where
    there is one), checked against the manifest's record."""
    iurl = index_path(w.url)
    index = parse_index(joined(iurl, lambda: read_bytes(iurl)), iurl)
    size = w.rec.bytes
    if len(index) != w.rec.samples or index.end > size:
        raise ShardFormatError(
            f"{iurl}: the index lists {len(index)} samples up to byte {index.end}; the manifest "
            f"says {w.rec.samples} samples in {size} bytes")
    return index


def _sample(w: Want, index: ShardIndex, g: int, i: int, blob: bytes,
            base: int) -> dict[str, Any]:
    """Sample ``i`` as :meth:`~feedpipe.format._reader.ShardReader.sample` makes it, with
    ``bytes`` fields (they may be sent to another process as they are), from ``blob``: the
    shard's bytes from ``base`` on."""
    a, b = index.starts[i], index.starts[i + 1]
    d: dict[str, Any] = {"__key__": index.keys[i], "__shard__": w.rec.name, "__index__": g}
    for m in range(a, b):
        o, n = index.offsets[m] - base, index.sizes[m]
        d[index.exts[m]] = blob if (o, n) == (0, len(blob)) else blob[o: o + n]
    return d


def _said(w: Want, error: BaseException) -> None:
    log.warning("%s: the first batch's samples of this shard could not be read by range before "
                "the shard arrives (%s); they are read once the whole shard is in the cache",
                redact(w.url), redact(str(error)))
