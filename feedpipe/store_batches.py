"""Batches gathered whole from a complete decoded store, for image batches collated by a
:class:`~feedpipe.collator.BatchCollator`.

Serving a store sample by sample costs, per sample, a record copy (the checksum is taken of the
copy, so what is served is what was checked), rebuilding the output's tree, and the collator's
copy into the batch buffer: two copies and Python work on every sample. When the store's records
are an image (array or tensor of the collator's shape and dtype) and an integer label, or a bare
image, a batch is instead:

1. the state words of its sample ids, then their records, read in that order (as
   :meth:`DecodedStore.get` reads them): each record's image bytes straight into its row of the
   collator's buffer, the rest (the label) into a small array kept across epochs;
2. every record checked against its state word over exactly those copied bytes; a record whose
   checksum fails, or a sample never stored, is recomputed from its shard, stored again and
   written into the batch, as the per-sample path does;
3. the labels copied out of the small array.

One copy per image instead of two. The batches, their order and their contents are the
per-sample path's (``tests/test_store_batches.py`` compares them); resumption is unchanged, the
ids coming from the same plan and split.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .collator import BatchCollator
from .plan import iter_ids
from .record_layout import Layout, flatten

if TYPE_CHECKING:
    from .dataset import FeedDataset
    from .decoded_store import DecodedStore


def store_batches(dataset: FeedDataset, batch_size: int,
                  collate_fn: Any) -> Iterator[Any] | None:
    """The batches of this rank's epoch gathered from the dataset's complete decoded store, or
    ``None`` when this path does not apply (no store, not complete, not a ``BatchCollator``,
    records of another structure)."""
    store = dataset.decoded
    if store is None or not isinstance(collate_fn, BatchCollator) or not store.complete():
        return None
    layout = store.layout()
    if layout is None:
        return None
    leaves = layout.leaves
    paired = layout.tree == ["tuple", ["leaf", "leaf"]]
    if not (paired or layout.tree == "leaf"):
        return None
    image = leaves[0]  # at offset 0 (Layout.of places leaves in order)
    want = torch.empty(0, dtype=collate_fn.dtype).numpy().dtype
    if (image.kind not in ("tensor", "ndarray") or np.dtype(image.dtype) != want
            or image.shape != collate_fn.shape or image.offset != 0):
        return None
    if paired and (leaves[1].kind != "int" or collate_fn.label_dtype != torch.int64):
        return None
    return _batches(dataset, store, layout, batch_size, collate_fn, paired)


def _batches(dataset: FeedDataset, store: DecodedStore, layout: Layout, batch_size: int,
             collate_fn: BatchCollator, paired: bool) -> Iterator[Any]:
    plan, split = dataset.plan(), dataset.split()
    h = layout.leaves[0].nbytes
    tails = store._staging
    if tails is None or tails.shape != (batch_size, layout.record - h):
        tails = store._staging = np.empty((batch_size, layout.record - h), np.uint8)
    record = np.empty(layout.record, np.uint8)
    try:
        for ids in iter_ids(plan, split, batch_size, 0, 1):
            n = len(ids)
            images, labels = collate_fn.buffer(n)
            heads = images.numpy().reshape(n, h)
            bad = store.gather(ids, heads, tails[:n])
            for j in bad.tolist():
                layout.pack(record, flatten(dataset.compute(plan, int(ids[j])))[1])
                heads[j] = record[:h]
                tails[j] = record[h:]
            if not paired:
                yield images
                continue
            at = layout.leaves[1].offset - h
            labels.numpy()[:] = tails[:n, at:at + 8].view(np.int64).reshape(n)
            yield images, labels
    finally:
        store.record()
