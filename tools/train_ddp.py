"""A tiny DDP training loop on feedpipe that checkpoints mid-epoch and resumes.

Run it on 2 CPU processes (gloo), stop it part-way through epoch 1, then resume — also with a
different number of processes:

    python tools/make_example.py                    # or any feedpipe dataset
    torchrun --nproc_per_node=2 tools/train_ddp.py shards/example --ckpt /tmp/ckpt.pt --stop-after 3
    torchrun --nproc_per_node=2 tools/train_ddp.py shards/example --ckpt /tmp/ckpt.pt
    torchrun --nproc_per_node=1 tools/train_ddp.py shards/example --ckpt /tmp/ckpt.pt  # elastic

Each rank appends the sample ids it trained on to ``--ids-log`` (JSON lines), so a run can be checked
for exactly-once delivery. Rank 0 saves the checkpoint: ranks step in lockstep, so its loader
state resumes every rank of the next job, whatever its size.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import feedpipe


def features(sample: dict) -> tuple[torch.Tensor, int, int]:
    jpg = bytes(sample["jpg"])
    x = torch.tensor([len(jpg) / 4096.0, jpg[-3] / 255.0, jpg[-4] / 255.0])
    return x, int(bytes(sample["cls"])), sample["__index__"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--ckpt", required=True, help="checkpoint file (resumed from if it exists)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="save a checkpoint and exit after this many steps of epoch 1")
    ap.add_argument("--ids-log", dest="log", default=None, help="append the trained sample ids here")
    ap.add_argument("--cache-dir", default=None,
                    help="node-local L1 shard cache for a remote dataset (s3://, gs://, http://): "
                         "each node fetches the shards its ranks read once, shared by its ranks")
    ap.add_argument("--cache-size", default=None, help="the cache's byte budget, e.g. 200GB")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = feedpipe.FeedDataset(a.dataset, shuffle=True, seed=0, transform=features,
                              cache_dir=a.cache_dir, cache_size=a.cache_size)
    loader = feedpipe.FeedLoader(ds, batch_size=a.batch_size, num_workers=a.workers)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if os.path.exists(a.ckpt):
        ckpt = torch.load(a.ckpt, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        loader.load_state_dict(ckpt["data"])
        start = ckpt["data"]["epoch"]
        if rank == 0:
            print(f"resumed at epoch {start}, position {ckpt['data']['position']}", flush=True)
    for epoch in range(start, a.epochs):
        loader.set_epoch(epoch)
        for step, (x, y, ids) in enumerate(loader, start=1):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if a.log:
                with open(a.log, "a") as f:
                    f.write(json.dumps({"rank": rank, "epoch": epoch, "ids": ids.tolist()}) + "\n")
            if a.stop_after is not None and epoch == 1 and step == a.stop_after:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "data": loader.state_dict()}, a.ckpt)
                    print(f"checkpoint at epoch {epoch} step {step}: {loader.state_dict()}",
                          flush=True)
                dist.barrier()
                dist.destroy_process_group()
                return
        if rank == 0:
            print(f"epoch {epoch}: {len(loader)} steps per rank, last loss {loss.item():.3f}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
