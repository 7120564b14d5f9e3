"""Entry points run in separate processes by the resume and distributed tests."""

from __future__ import annotations

import datetime
import json
import os
import sys


def simulate(args: dict) -> dict:
    """Run ``world`` ranks in lockstep in this process (each with real DataLoader worker
    processes: the ``samples-workers`` route, their pids returned),
    consume ``stop`` batches per rank (None: all), and return ids and the state of rank 0."""
    from feedpipe import FeedDataset, FeedLoader

    loaders = [
        FeedLoader(FeedDataset(args["path"], shuffle=True, seed=11, rank=r,
                               world_size=args["world"]),
                   batch_size=args["batch"], num_workers=args["workers"],
                   route="samples-workers")
        for r in range(args["world"])
    ]
    if args.get("state") is not None:
        for ld in loaders:
            ld.load_state_dict(args["state"])
    for ld in loaders:
        ld.set_epoch(args["epoch"])
    iters = [iter(ld) for ld in loaders]
    ids: list[int] = []
    steps = len(loaders[0])  # the whole epoch's batches; a resumed one yields only the rest
    stop = steps if args.get("stop") is None else args["stop"]
    for _ in range(stop):
        try:
            for it in iters:
                ids += next(it)["__index__"].tolist()
        except StopIteration:
            break
    pids = [ld.stats().get("worker_pids", []) for ld in loaders]
    return {"ids": ids, "state": loaders[0].state_dict(), "steps": steps, "pids": pids,
            "pid": os.getpid()}


def ddp_rank(rank: int, world: int, port: int, path: str, out: str, drop_last: bool) -> None:
    import torch
    import torch.distributed as dist

    from feedpipe import FeedDataset, FeedLoader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        ds = FeedDataset(path, shuffle=True, seed=1, drop_last=drop_last)  # world detected
        loader = FeedLoader(ds, batch_size=3, num_workers=2, route="samples-workers")
        loader.set_epoch(1)
        ids: list[int] = []
        batches = 0
        for batch in loader:
            ids += batch["__index__"].tolist()
            batches += 1
            t = torch.ones(1)
            dist.all_reduce(t)  # a DDP step: would hang if one rank had fewer batches
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"rank": ds.world.rank, "ids": ids, "batches": batches,
                                          "len": len(loader), "pid": os.getpid(),
                                          "workers": loader.stats()["worker_pids"]})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(simulate(json.loads(sys.argv[1]))))
