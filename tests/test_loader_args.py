"""FeedLoader's argument checks: a mistake is refused when the loader is made, with the fix, not
at the first batch with an error from deep inside the batch loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feedpipe import BatchCollator, FeedDataset, FeedLoader, ImagePipeline

EXAMPLE = str(Path(__file__).resolve().parent.parent / "shards" / "example")


def test_a_batch_larger_than_the_collators_rows_is_refused_at_construction() -> None:
    pipe = ImagePipeline(16)
    ds = FeedDataset(EXAMPLE, transform=pipe)
    with pytest.raises(ValueError) as e:
        FeedLoader(ds, batch_size=8, collate_fn=BatchCollator(4, pipe.out_shape, pipe.out_dtype))
    msg = str(e.value)
    assert "batch_size=8" in msg and "BatchCollator of batch_size 4" in msg
    assert "FeedLoader(ds, batch_size=8, collate_fn=BatchCollator(8, ...))" in msg


def test_a_collator_with_more_rows_than_the_batch_still_works() -> None:
    """A smaller batch is a view of the collator's first rows (as its last batch is)."""
    pipe = ImagePipeline(16)
    ds = FeedDataset(EXAMPLE, transform=pipe)
    loader = FeedLoader(ds, batch_size=4, collate_fn=BatchCollator(8, pipe.out_shape,
                                                                   pipe.out_dtype))
    images, labels = next(iter(loader))
    assert images.shape[0] == 4 and labels.dtype == torch.int64


def test_batch_size_none_gets_a_sentence() -> None:
    """``DataLoader(batch_size=None)`` is valid; FeedLoader says what it means instead of a raw
    ``int(None)`` TypeError."""
    with pytest.raises(TypeError, match=r"FeedLoader always makes batches: batch_size=None .*"
                                        r"for sample in dataset"):
        FeedLoader(FeedDataset(EXAMPLE), batch_size=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8", True])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=f"batch_size must be an integer of 1 or more, not "
                                         f"{bad!r}"):
        FeedLoader(FeedDataset(EXAMPLE), batch_size=bad)  # type: ignore[arg-type]
