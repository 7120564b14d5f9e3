"""A tiny DDP training loop on feedpipe that checkpoints mid-epoch and resumes.

Run it on 2 CPU processes (gloo) from the checkout, stop it part-way through epoch 1, then resume
on 1 process (another world size: elastic resumption):

    python tools/make_example.py
    torchrun --nproc_per_node=2 tools/train_ddp.py shards/example --ckpt runs/example.pt --stop-after 2 --ids-log runs/ids.jsonl
    torchrun --nproc_per_node=1 tools/train_ddp.py shards/example --ckpt runs/example.pt --ids-log runs/ids.jsonl

Any dataset made by ``feedpipe shard SRC OUT --labels-from-dirs`` works the same (fields ``jpg``
and ``cls``). Without ``--ckpt`` the checkpoint is ``runs/<dataset name>-<hash of its path or
URL>/ckpt.pt``, so a run on another dataset never resumes this one's checkpoint; a checkpoint of
another dataset given with ``--ckpt`` is refused by name.

Rank 0 saves the checkpoint at ``--stop-after`` and at the end of every epoch, and reads it at
start-up for every rank: ranks step in lockstep, so its loader state resumes every rank of the
next job, whatever its size, and only rank 0 needs to see the file. Each rank appends the sample
ids it trained on to ``--ids-log`` (JSON lines), so a run can be checked for exactly-once delivery.
With ``--ledger DIR`` (the same directory for every job of a run, on storage every node sees) the
loaders record what each rank received, compactly, and ``feedpipe ledger DIR`` proves the whole
run exactly-once or names what repeated or went missing.
"""  # noqa: E501 - one line a command: tests/test_train_example.py runs them as printed

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import feedpipe
from feedpipe import StateError
from feedpipe.format._image_fields import IMAGE_FIELDS, fields_present, image_field_of


def features(sample: dict) -> tuple[torch.Tensor, int, int]:
    """Three numbers of the sample's image file (its first image field, as ImagePipeline takes
    it): enough for a toy model, nothing to decode."""
    field = image_field_of(sample, IMAGE_FIELDS)
    if field is None:
        raise KeyError(f"sample {sample['__key__']!r} has no image field")
    image = bytes(sample[field])
    x = torch.tensor([len(image) / 4096.0, image[-3] / 255.0, image[-4] / 255.0])
    return x, int(bytes(sample["cls"])), sample["__index__"]


def default_ckpt(dataset: str) -> str:
    """``runs/<name>-<hash>/ckpt.pt``: one checkpoint per dataset (a local path by its absolute
    path, a URL as written), relative to the working directory."""
    where = dataset if "://" in dataset else os.path.abspath(dataset)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(where.rstrip("/")) or "dataset")
    digest = hashlib.sha256(where.rstrip("/").encode()).hexdigest()[:8]
    return os.path.join("runs", f"{name}-{digest}", "ckpt.pt")


def save(path: str, state: dict[str, Any]) -> None:
    """Write the checkpoint atomically (temp file + rename): a kill never leaves half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str, rank: int) -> dict[str, Any] | None:
    """Rank 0 reads the checkpoint (if there is one) and hands it to every rank."""
    box: list[Any] = [None]
    if rank == 0 and os.path.exists(path):
        box[0] = torch.load(path, weights_only=True)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--ckpt", default=None,
                    help="checkpoint file, resumed from if it exists (default: "
                         "runs/<dataset name>-<hash>/ckpt.pt)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="save a checkpoint and exit after this many steps of epoch 1 (at its end "
                         "if it has fewer)")
    ap.add_argument("--ids-log", dest="log", default=None,
                    help="append the trained sample ids here")
    ap.add_argument("--cache-dir", default=None,
                    help="node-local L1 shard cache for a remote dataset (s3://, gs://, http://): "
                         "each node fetches the shards its ranks read once, shared by its ranks")
    ap.add_argument("--cache-size", default=None, help="the cache's byte budget, e.g. 200GB")
    ap.add_argument("--ledger", default=None, metavar="DIR",
                    help="record each rank's delivered samples here (FeedLoader(ledger=DIR)); "
                         "check the run with: feedpipe ledger DIR")
    a = ap.parse_args()
    ckpt_path = a.ckpt or default_ckpt(a.dataset)
    if a.log:
        # every rank appends to the log, so every rank makes its directory: exist_ok makes the
        # ranks that lose the race to create it carry on
        os.makedirs(os.path.dirname(a.log) or ".", exist_ok=True)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = feedpipe.FeedDataset(a.dataset, shuffle=True, seed=0, transform=features,
                              cache_dir=a.cache_dir, cache_size=a.cache_size)
    m = ds.manifest
    if "cls" not in m.fields or not fields_present(m.fields, IMAGE_FIELDS):
        sys.exit(f"{a.dataset}: fields {m.fields}; this example trains on image-folder shards "
                 "(an image field and cls): feedpipe shard IMAGES OUT --labels-from-dirs")
    loader = feedpipe.FeedLoader(ds, batch_size=a.batch_size, num_workers=a.workers,
                                 ledger=a.ledger)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, max(2, len(m.classes or []))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    ckpt = load(ckpt_path, rank)
    if ckpt is not None:
        try:
            loader.load_state_dict(ckpt["data"])
        except StateError as e:  # every rank stops; rank 0 says why
            sys.exit(f"{ckpt_path}: {e}\nThis checkpoint belongs to another run: give another "
                     "--ckpt, or delete it to start afresh." if rank == 0 else 1)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["data"]["epoch"]
        if rank == 0:
            print(f"resumed from {ckpt_path} at epoch {start}, position "
                  f"{ckpt['data']['position']}", flush=True)
    elif rank == 0:
        print(f"no checkpoint at {ckpt_path}: starting at epoch 0", flush=True)

    def checkpoint() -> None:
        if rank == 0:
            save(ckpt_path, {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "data": loader.state_dict()})

    stop_at = None
    if a.stop_after is not None:
        stop_at = min(a.stop_after, len(loader))
        if stop_at < a.stop_after and rank == 0:
            print(f"--stop-after {a.stop_after}: an epoch has {len(loader)} steps per rank; "
                  f"stopping at its end", flush=True)
    for epoch in range(start, a.epochs):
        loader.set_epoch(epoch)
        loss = None
        steps = 0
        for step, (x, y, ids) in enumerate(loader, start=1):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if a.log:
                with open(a.log, "a") as f:
                    f.write(json.dumps({"rank": rank, "epoch": epoch, "ids": ids.tolist()}) + "\n")
            if epoch == 1 and step == stop_at:
                checkpoint()
                if rank == 0:
                    print(f"checkpoint at epoch {epoch} step {step}: {loader.state_dict()} "
                          f"-> {ckpt_path}", flush=True)
                dist.barrier()
                dist.destroy_process_group()
                return
        checkpoint()
        if rank == 0 and loss is not None:
            print(f"epoch {epoch}: {steps} steps per rank, last loss {loss.item():.3f}",
                  flush=True)
    if start >= a.epochs and rank == 0:
        print(f"the checkpoint is at epoch {start}: all {a.epochs} epochs are done "
              "(--epochs N for more)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
