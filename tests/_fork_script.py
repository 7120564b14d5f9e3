"""A training script as people write them on a laptop: no ``if __name__ == "__main__":`` guard, a
lambda transform, worker processes with the default start method. Run by
tests/test_fork_after_cuda.py as ``python _fork_script.py SHARDS DEVICE LOG``.

With DEVICE ``cuda`` it initialises CUDA first, as a script that builds its model before its
loader does. Each run appends its pid to LOG at import: a worker started by ``spawn`` or
``forkserver`` would import this guard-less script again and add a line. It prints one JSON
record per workers route: the ids delivered, the reference route's ids, the worker pids, the
start method, whether each worker saw CUDA, and the sum of the batches moved to DEVICE."""

import json
import os
import sys

import torch

import feedpipe

shards, device, log = sys.argv[1], sys.argv[2], sys.argv[3]
with open(log, "a") as f:
    f.write(f"{os.getpid()}\n")

if device == "cuda":
    torch.ones(1, device="cuda")  # a CUDA context in the training process
    assert torch.cuda.is_initialized()


SIZE = 8
results = {}
for route in ("samples-workers", "rows-workers", "refs-workers"):
    if route == "rows-workers":
        transform = feedpipe.ImagePipeline(SIZE, train=False, mean=None)
        collate = feedpipe.BatchCollator(4, (3, SIZE, SIZE))
    elif route == "samples-workers":
        # not picklable: a forkserver or spawn start would refuse it
        transform = lambda s: (int(s["__index__"]), os.getpid(),  # noqa: E731
                               bool(torch.cuda._is_in_bad_fork()))
        collate = None
    else:
        transform, collate = None, None
    kw = {"shuffle": True, "seed": 3, "transform": transform}
    ref = feedpipe.FeedLoader(feedpipe.FeedDataset(shards, **kw), batch_size=4,
                              collate_fn=collate, route="samples")
    loader = feedpipe.FeedLoader(feedpipe.FeedDataset(shards, **kw), batch_size=4,
                                 collate_fn=collate, num_workers=2, route=route,
                                 pin_memory=device == "cuda")
    got, want, total, bad_fork, pids_seen = [], [], 0.0, [], set()
    for batch in loader:
        if route == "samples-workers":
            index, pid, in_bad_fork = batch
            got.append(index.tolist())
            pids_seen.update(pid.tolist())
            bad_fork += in_bad_fork.tolist()
            total += float(index.to(device).sum())
        elif route == "rows-workers":
            images, labels = batch
            got.append([labels.tolist(), images.sum((1, 2, 3)).tolist()])
            total += float(images.to(device).float().sum())
        else:
            got.append(batch["__index__"].tolist())
            total += float(batch["__index__"].to(device).sum())
    for batch in ref:
        if route == "samples-workers":
            want.append(batch[0].tolist())
        elif route == "rows-workers":
            want.append([batch[1].tolist(), batch[0].sum((1, 2, 3)).tolist()])
        else:
            want.append(batch["__index__"].tolist())
    stats = loader.stats()
    results[route] = {
        "same": got == want,
        "samples": sum(len(b[0]) if route == "rows-workers" else len(b) for b in got),
        "start_method": stats["start_method"],
        "worker_pids": stats["worker_pids"],
        "transform_pids": sorted(pids_seen),
        "workers_saw_cuda_in_bad_fork": bad_fork,
        "total": total,
    }
results["parent"] = os.getpid()
results["cuda_initialised"] = bool(device == "cuda" and torch.cuda.is_initialized())
print(json.dumps(results))
