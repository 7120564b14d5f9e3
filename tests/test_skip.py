"""A transform that raises SampleSkipped leaves that sample out of its batch, on every route that
runs a transform: a warning names it, stats() counts it, nothing else is lost."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from feedpipe import BatchCollator, DecodeError, FeedDataset, FeedLoader, ImagePipeline, ShardWriter

CORRUPT = {5, 6, 17}  # ids of samples whose JPEG is cut short
N = 24


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """24 samples (shards of 8), three of them with a corrupt JPEG; label = the sample's id."""
    import numpy as np
    import simplejpeg

    def jpeg_bytes(h: int, w: int, seed: int) -> bytes:
        img = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
        return simplejpeg.encode_jpeg(img, quality=90)

    out = tmp_path_factory.mktemp("broken") / "ds"
    with ShardWriter(str(out), max_samples=8) as w:
        for i in range(N):
            data = jpeg_bytes(20, 20, seed=i)
            w.write({"__key__": f"s{i:03d}", "jpg": data[:40] if i in CORRUPT else data,
                     "cls": i})
    return str(out)


ROUTES = [("samples", {}), ("samples-workers", {"num_workers": 2}),
          ("samples-threads", {"transform_threads": 2}), ("rows", {}),
          ("rows-workers", {"num_workers": 2}), ("rows-threads", {"transform_threads": 2})]


@pytest.mark.parametrize("route,kw", ROUTES)
def test_skipped_samples_are_left_out_logged_and_counted(broken: str, route: str, kw: dict,
                                                        caplog) -> None:  # type: ignore[no-untyped-def]
    pipe = ImagePipeline(8, train=False, mean=None, on_error="skip")
    ds = FeedDataset(broken, transform=pipe)
    ld = FeedLoader(ds, batch_size=4, collate_fn=BatchCollator(4, (3, 8, 8)), route=route, **kw)
    with caplog.at_level(logging.WARNING):
        batches = list(ld)
    labels = torch.cat([y for _, y in batches]).tolist()
    assert labels == [i for i in range(N) if i not in CORRUPT]
    assert len(batches) == len(ld) == 6  # a short batch, never a missing one
    assert [len(y) for _, y in batches] == [4, 2, 4, 4, 3, 4]
    assert ld.stats()["skipped"] == len(CORRUPT)
    if kw.get("num_workers") is None:  # worker processes log to their own stderr
        assert sum("was left out" in r.getMessage() for r in caplog.records) == len(CORRUPT)
    want = {i: ImagePipeline(8, train=False, mean=None)(s)[0] for i, s in
            enumerate(FeedDataset(broken)) if i not in CORRUPT}
    for images, ys in batches:  # rows after a skipped one moved up, pixels intact
        for img, y in zip(images, ys.tolist()):
            assert torch.equal(img, want[y])


def test_without_skip_the_corrupt_sample_stops_the_epoch_naming_it(broken: str) -> None:
    ds = FeedDataset(broken, transform=ImagePipeline(8, train=False, mean=None))
    with pytest.raises(DecodeError, match="s005"):
        list(FeedLoader(ds, batch_size=4))


def test_a_batch_with_every_sample_skipped_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "all-bad"
    with ShardWriter(str(out)) as w:
        for i in range(4):
            w.write({"__key__": f"s{i}", "jpg": b"\xff\xd8\xff" + bytes(20), "cls": i})
    ds = FeedDataset(str(out), transform=ImagePipeline(8, mean=None, on_error="skip"))
    with pytest.raises(DecodeError, match="every one of the 4 samples of a batch"):
        list(FeedLoader(ds, batch_size=4))
