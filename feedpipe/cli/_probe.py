"""``feedpipe probe``: its arguments and what it prints."""

from __future__ import annotations

import argparse

from ._output import add_json_options, emit, int_list, parse_size, size_list


def add_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="measure storage and pipeline throughput; say what bounds samples/s",
        description=(
            "Probe TARGET (a file, a directory of small files, a shard dataset with\n"
            "manifest.json, or any fsspec URL): sequential read MB/s over block sizes and\n"
            "threads, small-file open+read rate, random read latency p50/p99, cold (pages\n"
            "dropped with posix_fadvise) and warm; on shard datasets each pipeline stage's\n"
            "samples/s (read, image decode per core, batching, host-to-device when CUDA is\n"
            "present) and FeedLoader worker scaling; then the FeedLoader a script gets (or\n"
            "each --route): its seconds per part, the part that bounds it, bytes and requests\n"
            "per epoch (a cost per epoch with the prices). Ends with the bounding stage (and\n"
            "its part in the loader's stats(): fetch, compute, sink), the predicted ceiling,\n"
            "the accelerator utilisation for --step-time, and advice, what bounds first.\n"
            "A dataset is named as FeedDataset takes it: its folder (a URL too, e.g.\n"
            "http://host/data/) or its manifest.json.\n\n"
            "Each phase stops after --duration seconds. Nothing is written except --json-out,\n"
            "--plot and, with --generate, one test file in a temp dir that is deleted afterwards."
        ),
        epilog=(
            "Examples:\n"
            "  feedpipe probe ./shards --step-time 120 --batch-size 256 --workers 8\n"
            "  feedpipe probe ./images --json-out probe.json --plot probe.png\n"
            "  feedpipe probe s3://bucket/shards --duration 10 --json | jq .verdict\n"
            "  feedpipe probe /mnt/nvme --generate 4GiB --block-sizes 1MiB,16MiB --threads 1,8"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="file, directory, shard dataset or fsspec URL (with --generate: the "
                        "directory to generate test data in; default: the system temp dir)")
    add_json_options(p, out=True)
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a PNG: sequential read curves (small-file rates for a "
                        "directory) and the stage bars (needs feedpipe[plot])")
    p.add_argument("--duration", type=float, default=5.0, metavar="S",
                   help="seconds per measurement phase (default: 5; a dataset has about ten)")
    p.add_argument("--step-time", type=float, default=None, metavar="MS",
                   help="accelerator time per batch, for the utilisation figure")
    p.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="samples per batch (default: 64)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="DataLoader workers to plan for (default: usable CPUs); scaling is "
                        "measured at 0, 1, 2 and N")
    p.add_argument("--block-sizes", type=size_list, default=None, metavar="LIST",
                   help="sequential block sizes (default: 64KiB,256KiB,1MiB,4MiB,16MiB)")
    p.add_argument("--threads", type=int_list, default=None, metavar="LIST",
                   help="sequential reader threads (default: 1,2,4,8,16)")
    p.add_argument("--random-block", type=parse_size, default=4096, metavar="SIZE",
                   help="bytes per random read (default: 4KiB)")
    p.add_argument("--generate", type=parse_size, default=None, metavar="SIZE",
                   help="write a SIZE test file in a temp dir, probe it, delete it")
    p.add_argument("--route", default=None, metavar="NAME[,NAME]",
                   help="on a dataset, run the FeedLoader with these routes and compare their "
                        "per-part times, bound and bytes (default: the route the loader "
                        "chooses, as a training script gets it; auto names that choice)")
    p.add_argument("--price-per-gb", type=float, default=None, metavar="PRICE",
                   help="the remote store's price per GB read, for a cost per epoch")
    p.add_argument("--price-per-1k-requests", type=float, default=None, metavar="PRICE",
                   help="the remote store's price per 1,000 requests, for a cost per epoch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_probe(a: argparse.Namespace) -> int:
    from ..diagnostics._probe import probe

    r = probe(a.target, duration=a.duration, step_time_ms=a.step_time, batch_size=a.batch_size,
              workers=a.workers, block_sizes=a.block_sizes, threads=a.threads,
              random_block=a.random_block, generate=a.generate, plot_path=a.plot,
              show_progress=False if a.no_progress else None, route=a.route,
              price_per_gb=a.price_per_gb, price_per_1k_requests=a.price_per_1k_requests)
    emit(a, r.to_dict(), r.table)
    return 0
