"""Epoch 1 vs epoch 2 samples/s through the cache tiers, over HTTP on 127.0.0.1.

Issue 4: "epoch 1 vs epoch 2 samples/s for: no cache, L1 only, L1 + memmap decoded store, L2 memo,
over the HTTP server. Target: epoch 2 with the decoded store at least 10x epoch 1 with JPEG
decoding."

Data: ``--images`` synthetic JPEGs (``make_image_folder`` of ``feedpipe/convert/_synth.py``, 256-448
px a side, quality 85; noisy, so about 4 bits per pixel), sharded by ``feedpipe shard`` (8 MB
shards), served by nginx (Debian's nginx-light; ``tests/_http_server.py`` when nginx is missing)
from a warm page cache. Uncached sample reads are ranged GETs: the access log's counts of the
``.tar`` requests are in the JSON (``GET 206`` vs ``GET 200``; ``HEAD 200`` is fsspec asking a
size). An L1 fill fetches a shard of at most 16 MiB with one plain GET, larger ones in 16 MiB
ranges.

Transform: ``ImagePipeline(224, train=False, mean=None)``: JPEG decode (reduced-scale where it
applies), centre crop, antialiased resize to a 3x224x224 ``uint8`` tensor, and the label.

Systems (each a fresh interpreter per pass, with fresh, empty caches; two epochs of the same
``FeedLoader(batch_size=64, num_workers=--workers)``, shuffled, epoch 1 then epoch 2):

    none         range reads of every sample, decode every epoch
    l1           L1 shard cache (``cache_dir=``): shards fetched once, read by mmap after
    l1+decoded   L1 + the memmap decoded store (``decoded_cache=``): epoch 2 reads records
    l2           L2 ``FunctionIndex`` memo of the transform (content hash of the JPEG bytes):
                 epoch 2 still reads every sample's bytes (range reads) to hash them. Its
                 in-process LRU (1024 entries by default) holds all of a small dataset: with
                 ``num_workers=0`` epoch 2 then never reads LMDB (``lru_hits`` in the JSON)
    l1+l2        L1 + L2

Per system and epoch: the median samples/s over ``--passes`` alternating passes, and the spread.
Ratios: each system's epoch 2 over its epoch 1, and over ``none``'s epoch 1 (JPEG decoding, the
target's baseline). A checksum of every pixel and label delivered per epoch must agree across
systems and epochs (the fast paths deliver the same data).

Usage::

    python benchmarks/bench_tiers.py [--quick] [--passes 3] [--images 768] [--workers 0]

Writes ``benchmarks/results/tiers.json`` (``tiers-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import render_results  # noqa: E402

SYSTEMS = ["none", "l1", "l1+decoded", "l2", "l1+l2"]
SIZE = 224
BATCH = 64


# -- the worker: one system, two epochs -------------------------------------------------------
def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from feedpipe import FeedDataset, FeedLoader, FunctionIndex, ImagePipeline
    from feedpipe.caches.decoded._files import read_recorded

    torch.set_num_threads(1)
    system, tmp = spec["system"], spec["tmp"]
    transform: Any = ImagePipeline(SIZE, train=False, mean=None)
    kw: dict[str, Any] = {}
    if "l1" in system.split("+"):
        kw["cache_dir"] = os.path.join(tmp, "l1")
    if "decoded" in system:
        kw["decoded_cache"] = os.path.join(tmp, "decoded")
    index = None
    if "l2" in system:
        index = FunctionIndex(os.path.join(tmp, "l2"), map_size=1 << 30)
        transform = index.wrap(transform, fields=["jpg", "cls"])
    ds = FeedDataset(spec["url"], transform=transform, shuffle=True, seed=0, **kw)
    loader = FeedLoader(ds, batch_size=BATCH, num_workers=spec["workers"])
    epochs = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = []
        t0 = time.perf_counter()
        for images, labels in loader:
            batches.append((images, labels))
        dt = time.perf_counter() - t0
        n = sum(len(lb) for _, lb in batches)
        checksum = sum(int(im.sum(dtype=torch.int64)) * 7 + int(lb.sum()) for im, lb in batches)
        epochs.append({"samples": n, "seconds": dt, "samples_per_s": n / dt,
                       "checksum": checksum})
    out: dict[str, Any] = {"system": system, "epochs": epochs}
    if ds.decoded is not None:
        out["decoded"] = read_recorded(ds.decoded.path)
    if ds.cache is not None and spec["workers"] == 0:
        out["l1"] = vars(ds.cache.stats)
    if index is not None:
        s = index.stats()
        out["l2"] = {"entries": s.entries, "hits": s.hits, "lru_hits": s.lru_hits,
                     "misses": s.misses}
    return out


# -- the parent: data, server, passes ---------------------------------------------------------
def make_data(tmp: str, images: int) -> str:
    from feedpipe import shard
    from feedpipe.convert._synth import make_image_folder

    src, out = os.path.join(tmp, "src"), os.path.join(tmp, "www", "ds")
    classes = 8
    make_image_folder(src, classes=classes, per_class=images // classes, min_size=256,
                      max_size=448, sidecar_every=0, seed=4)
    shard(src, out, max_bytes=8 << 20, labels_from_dirs=True, workers=1, show_progress=False)
    return out


class Server:
    """nginx over ``root`` (python's Range server when nginx is missing), with a way to count
    the ``.tar`` requests and their status codes between two moments."""

    def __init__(self, root: str, work: str) -> None:
        sys.path.insert(0, os.path.join(common.REPO, "tests"))
        import contextlib

        from _servers import nginx_binary, nginx_server, python_server

        self._stack = contextlib.ExitStack()
        self.log: str | None = None
        if nginx_binary() is not None:
            self.url = self._stack.enter_context(nginx_server(root, work))
            self.name, self.log = "nginx", os.path.join(work, "access.log")
        else:
            s = self._stack.enter_context(python_server(root))
            self.url, self.name = s.url, "tests/_http_server.py"
            self._py = s

    def mark(self) -> int:
        return os.path.getsize(self.log) if self.log and os.path.exists(self.log) else 0

    def tar_requests(self, since: int) -> dict[str, int]:
        """``"METHOD status"`` -> count of ``.tar`` requests logged after ``since`` (nginx only)."""
        if self.log is None:
            return {}
        counts: dict[str, int] = {}
        with open(self.log, encoding="utf-8", errors="replace") as f:
            f.seek(since)
            for line in f:
                parts = line.split('"')
                if len(parts) > 2 and ".tar " in parts[1]:
                    code = f"{parts[1].split()[0]} {parts[2].split()[0]}"  # "GET 206"
                    counts[code] = counts.get(code, 0) + 1
        return counts

    def close(self) -> None:
        self._stack.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="256 images, 2 passes")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--images", type=int, default=768)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers (default: 0)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    a = ap.parse_args()
    if a.worker is not None:
        common.emit(worker(common.load_spec(a.worker)))
        return 0
    if a.quick:
        a.images, a.passes = 256, 2
    systems = [s for s in a.systems.split(",") if s]
    tmp = tempfile.mkdtemp(prefix="fp-bench-tiers-")
    try:
        data = make_data(tmp, a.images)
        data_bytes = sum(os.path.getsize(os.path.join(data, n)) for n in os.listdir(data))
        common.warm_files(common.walk_files(data))
        server = Server(os.path.join(tmp, "www"), os.path.join(tmp, "server"))
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        failed = False
        try:
            for p in range(a.passes):
                for system in common.alternating(systems, p):
                    caches = os.path.join(tmp, "caches")
                    shutil.rmtree(caches, ignore_errors=True)
                    os.makedirs(caches)
                    common.sync_disk()
                    since = server.mark()
                    r = common.run_worker(__file__, {"system": system, "tmp": caches,
                                                     "url": f"{server.url}/ds",
                                                     "workers": a.workers})
                    r["tar_requests"] = server.tar_requests(since)
                    if "error" in r:
                        failed = True
                        print(f"{system}: {r['error']}\n{r.get('stderr_tail', '')}",
                              file=sys.stderr)
                    runs[system].append(r)
                    e = r.get("epochs") or [{}, {}]
                    print(f"pass {p} {system:12s} epoch 1 {common.fmt(e[0].get('samples_per_s'))}"
                          f"  epoch 2 {common.fmt(e[1].get('samples_per_s'))} samples/s",
                          flush=True)
        finally:
            server.close()
        summary = summarise(runs)
        doc = {"benchmark": "tiers", "images": a.images, "passes": a.passes,
               "workers": a.workers, "batch_size": BATCH, "output": f"uint8 3x{SIZE}x{SIZE}",
               "dataset_bytes": data_bytes, "server": server.name,
               "environment": common.environment(tmp), "summary": summary, "runs": runs}
        path = common.write_results("tiers-quick" if a.quick else "tiers", doc)
        render_results.render(path, force=True)  # the Markdown and chart beside it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(summary, server.name, a)
    print(f"wrote {path}")
    return 1 if failed else 0


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sums = set()
    for system, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        e1 = [r["epochs"][0]["samples_per_s"] for r in ok]
        e2 = [r["epochs"][1]["samples_per_s"] for r in ok]
        sums.update(e["checksum"] for r in ok for e in r["epochs"])
        out[system] = {"epoch1": common.median(e1), "epoch2": common.median(e2),
                       "epoch1_spread": common.spread(e1), "epoch2_spread": common.spread(e2),
                       "epoch2_over_epoch1": common.median([b / a for a, b in zip(e1, e2)]),
                       "tar_requests": ok[-1].get("tar_requests") if ok else None}
    base = out.get("none", {}).get("epoch1")
    for s in out.values():
        s["epoch2_over_none_epoch1"] = s["epoch2"] / base if base and s["epoch2"] else None
    out["_checksums_agree"] = len(sums) == 1
    return out


def print_table(summary: dict[str, Any], server: str, a: argparse.Namespace) -> None:
    rows = []
    for system, s in summary.items():
        if system.startswith("_"):
            continue
        req = s["tar_requests"] or {}
        rows.append([system, common.fmt(s["epoch1"]), common.fmt(s["epoch2"]),
                     common.fmt(s["epoch2_over_epoch1"], 1) + "x",
                     common.fmt(s["epoch2_over_none_epoch1"], 1) + "x",
                     ", ".join(f"{k}: {v}" for k, v in sorted(req.items()))])
    print(f"\n{a.images} JPEGs -> uint8 3x{SIZE}x{SIZE}, {a.workers} workers, batch {BATCH}, "
          f"median of {a.passes} passes, over {server} on 127.0.0.1")
    print(common.table(rows, ["system", "epoch 1 /s", "epoch 2 /s", "e2/e1", "e2/none-e1",
                              ".tar requests (last pass)"]))
    print(f"checksums agree across systems and epochs: {summary['_checksums_agree']}")


if __name__ == "__main__":
    sys.exit(main())
