"""Time to a remote epoch's first batch, and the store's requests before it, for two trees.

    PYTHONPATH=. python benchmarks/bench_remote_first.py --other DIR --passes 3 --out NAME

benchmarks/linkstore.py (its own process) serves 600 samples of 111 kB in 8 shards behind a
100 ms RTT and 200 MB/s; each run is a fresh process (``PYTHONPATH`` = the tree) that builds a
shuffled FeedLoader (batch 64, ``cache_dir``) over http:// or s3:// and takes one batch. Trees
alternate run by run, pass by pass. Per run: the first batch's wall and CPU (the loader's
process, imports excluded), the store's requests completed before it (ranged GETs of shards
apart), the spread of the batch's range requests' starts, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LINK = {"rtt": 0.1, "node_rate": 200_000_000, "chunk": 64 << 10}
BUCKET = "b"

CHILD = r"""
import json, os, sys, tempfile, time
import feedpipe
from feedpipe import FeedDataset, FeedLoader
root, cache = sys.argv[1], tempfile.mkdtemp()
c0, t0 = time.process_time(), time.perf_counter()
loader = FeedLoader(FeedDataset(root, shuffle=True, seed=1, cache_dir=cache), batch_size=64)
it = iter(loader)
next(it)
t1, c1 = time.perf_counter(), time.process_time()
print(json.dumps({"first_s": t1 - t0, "cpu_s": c1 - c0}), flush=True)
os._exit(0)
"""


def post(url: str, path: str, doc: dict[str, Any] | None = None) -> None:
    req = urllib.request.Request(url + path, data=json.dumps(doc or {}).encode(), method="POST")
    urllib.request.urlopen(req, timeout=10).close()


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/__stats__", timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def make(root: Path) -> None:
    import feedpipe
    from feedpipe.convert._synth import make_records

    make_records(str(root / "src"), count=600, size=111_000, per_dir=1000, seed=5)
    feedpipe.shard(str(root / "src"), str(root / "store" / BUCKET / "fp"), max_samples=75,
                   workers=1, show_progress=False)


def one(tree: str, proto: str, url: str) -> dict[str, Any]:
    post(url, "/__link__", LINK)
    post(url, "/__reset__")
    env = dict(os.environ, PYTHONPATH=tree, AWS_ENDPOINT_URL_S3=url, AWS_ENDPOINT_URL=url,
               AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1",
               AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true", NO_PROXY="127.0.0.1,localhost",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    root = f"{url}/{BUCKET}/fp" if proto == "http" else f"s3://{BUCKET}/fp"
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, root], env=env, capture_output=True,
                         text=True, timeout=120)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    log = stats(url)["log"]
    man = next(e for e in log if e[1].endswith("manifest.json"))
    idx = [e for e in log if e[1].endswith(".idx")]
    # the first batch's own ranges: ranged GETs of a shard under 2 MiB (a fill's are 4 MB)
    small = [e for e in log if e[1].endswith(".tar") and e[2] and _len(e[2]) < 2 << 20]
    fills = [e for e in log if e[1].endswith(".tar") and e not in small]
    res.update(tree=tree, proto=proto, load=round(load, 2), requests_logged=len(log),
               batch_ranges=len(small), fill_ranges=len(fills), indexes=len(idx),
               manifest_start=man[3], manifest_end=man[4],
               index_first_start=min((e[3] for e in idx), default=None),
               fill_first_start=min((e[3] for e in fills), default=None),
               batch_ranges_first_start=min((e[3] for e in small), default=None),
               batch_ranges_last_start=max((e[3] for e in small), default=None),
               batch_ranges_last_end=max((e[4] or 0 for e in small), default=None))
    return res


def _len(rng: str) -> int:
    a, b = rng.split("=", 1)[1].split("-")
    return int(b) - int(a) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the tree to compare with (PYTHONPATH)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    trees = [str(HERE.parent), os.path.abspath(args.other)]
    with tempfile.TemporaryDirectory() as tmp:
        make(Path(tmp))
        proc = subprocess.Popen([sys.executable, str(HERE / "linkstore.py"),
                                 str(Path(tmp) / "store")], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            url = f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
            runs = []
            for p in range(args.passes):
                for proto in ("http", "s3"):
                    for tree in (trees if p % 2 else trees[::-1]):
                        r = one(tree, proto, url) | {"pass": p + 1}
                        print(json.dumps(r), flush=True)
                        runs.append(r)
        finally:
            proc.terminate()
    if args.out:
        doc = {"what": __doc__, "link": LINK, "trees": trees, "runs": runs}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
