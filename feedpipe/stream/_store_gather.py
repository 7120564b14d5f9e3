"""fetch=gather: whole batches copied out of a complete decoded store into a
:class:`~feedpipe.stream._collator.BatchCollator`'s buffers (the ``gather`` route).

Serving a store sample by sample costs, per sample, a record copy (the checksum is taken of the
copy, so what is served is what was checked), rebuilding the output's tree, and the collator's
copy into the batch buffer: two copies and Python work on every sample. Some stores hold an
image (array or tensor of the collator's shape and dtype) and an integer label, or a bare image.
From those, a batch is instead:

1. the state words of its sample ids, then their records, read in that order (as
   :meth:`DecodedStore.get` reads them): each record's image bytes straight into its row of the
   collator's buffer, the rest (the label) into a small array kept across batches;
2. every record checked against its state word over exactly those copied bytes; a record whose
   checksum fails, or a sample never stored, is recomputed from its shard, stored again and
   written into the batch, as the per-sample path does;
3. the labels copied out of the small array.

One copy per image instead of two. The batches, their order and their contents are the
per-sample path's (``tests/test_store_gather.py`` compares them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..caches.decoded._layout import Layout, flatten
from ._collator import BatchCollator

if TYPE_CHECKING:
    from ._source import Source


def gatherable(dataset: Source, collator: Any) -> bool:
    """Whether ``dataset``'s decoded store holds records ``collator`` can take whole: an image of
    its shape and dtype at offset 0, and nothing else or an int64 label."""
    store = dataset.decoded
    if store is None or not isinstance(collator, BatchCollator):
        return False
    layout = store.layout()
    if layout is None:
        return False
    leaves = layout.leaves
    paired = layout.tree == ["tuple", ["leaf", "leaf"]]
    if not (paired or layout.tree == "leaf"):
        return False
    image = leaves[0]  # at offset 0 (Layout.of places leaves in order)
    want = torch.empty(0, dtype=collator.dtype).numpy().dtype
    if (image.kind not in ("tensor", "ndarray") or np.dtype(image.dtype) != want
            or image.shape != collator.shape or image.offset != 0):
        return False
    return not paired or (leaves[1].kind == "int" and collator.label_dtype == torch.int64)


class GatherFetch:
    """The batches of ids gathered from the dataset's complete decoded store into ``collator``'s
    buffers (check :func:`gatherable` first); each call returns a finished batch."""

    def __init__(self, dataset: Source, epoch: int, collator: BatchCollator) -> None:
        store = dataset.decoded
        layout = store.layout() if store is not None else None
        if store is None or layout is None:
            raise ValueError("the gather route needs a decoded store that holds records")
        self.dataset, self.epoch, self.store, self.collator = dataset, epoch, store, collator
        self.layout: Layout = layout
        self.paired = layout.tree != "leaf"
        self.head = layout.leaves[0].nbytes
        self.tails = np.empty((collator.batch_size, layout.record - self.head), np.uint8)
        self.record = np.empty(layout.record, np.uint8)

    def __call__(self, ids: np.ndarray) -> Any:
        n, h = len(ids), self.head
        images, labels = self.collator.buffer(n)
        heads = images.numpy().reshape(n, -1).view(np.uint8)  # records are bytes: any dtype
        tails = self.tails[:n]
        for j in self.store.gather(ids, heads, tails).tolist():
            self.layout.pack(self.record, flatten(self._recompute(int(ids[j])))[1])
            heads[j] = self.record[:h]
            tails[j] = self.record[h:]
        if not self.paired:
            return images
        at = self.layout.leaves[1].offset - h
        labels.numpy()[:] = tails[:, at:at + 8].view(np.int64).reshape(n)
        return images, labels

    def _recompute(self, g: int) -> Any:
        """Sample ``g``'s transform output, read from its shard and stored again (the store's
        miss path, as the per-sample route computes and stores it)."""
        ds = self.dataset
        shards = ds.shards
        sample = ds.sample(g)
        sample["__epoch__"] = self.epoch  # the pass's epoch
        out = ds.transform(sample)  # type: ignore[misc]
        s = int(shards.locate(np.asarray([g]))[0][0])
        return self.store.put(g, out, key=sample["__key__"], shard=shards.names[s],
                              sample=sample)


class Finished:
    """The maker of routes whose fetch already makes the batch (gather, and refs in a worker)."""

    def start(self, fetched: Any, pool: Any = None) -> Any:
        return fetched

    def finish(self, pending: Any) -> Any:
        return pending
