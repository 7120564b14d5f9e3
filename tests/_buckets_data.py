"""Images of three shapes for the Bucketed tests and their ranks (tests/test_bucketed.py):
sample ``i`` has ``cls = i``, so a batch's labels name its images."""

from __future__ import annotations

import json
import os
from typing import Any

BUCKETS = [(48, 24), (32, 32), (24, 48)]  # (width, height): wide, square, tall
SHAPES = [(60, 30), (40, 40), (30, 60)]  # an image of group k is near bucket k's ratio
N = 53


def shape_of(i: int) -> tuple[int, int]:
    w, h = SHAPES[i % 3]
    return w + i % 4, h + i % 3  # jittered, still nearest its own bucket


def make_images(out: str) -> str:
    """Write the images as shards (sizes recorded at shard time) and return ``out``."""
    import cv2
    import numpy as np

    import feedpipe

    def jpg(i: int) -> bytes:
        w, h = shape_of(i)
        img = np.full((h, w, 3), i % 255, np.uint8)
        return cv2.imencode(".jpg", img)[1].tobytes()

    feedpipe.write_samples([{"__key__": f"s{i:03d}", "jpg": jpg(i), "cls": i}
                            for i in range(N)], out, max_samples=10)
    return out


def gloo_rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    """One torch.distributed rank (gloo on 127.0.0.1) reading a Bucketed source through two
    DataLoader worker processes; rank 0 writes every rank's labels, shapes and pids."""
    import torch.distributed as dist

    import feedpipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        src = feedpipe.Bucketed(feedpipe.FeedDataset(path, seed=3), batch_size=4,
                                buckets=BUCKETS)
        loader = feedpipe.FeedLoader(src, batch_size=4, num_workers=2)
        batches = [(b["cls"].tolist(), list(b["image"].shape)) for b in loader]
        mine: dict[str, Any] = {"rank": src.world.rank, "batches": batches, "len": len(loader),
                                "pid": os.getpid(), "workers": loader.stats()["worker_pids"]}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()
