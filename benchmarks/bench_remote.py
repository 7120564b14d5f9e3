"""Reading one dataset from an object store over a simulated link: feedpipe (http:// and s3://,
with and without ``cache_dir``) beside MosaicML Streaming, LitData, webdataset and plain
parallel GETs (issue 48).

    PYTHONPATH=. python benchmarks/bench_remote.py --quick     # 3 cases, for development
    PYTHONPATH=. python benchmarks/bench_remote.py             # every case of issue 48
    PYTHONPATH=OTHER python benchmarks/bench_remote.py --quick --tag other \
        --compare . --compare-label this   # feedpipe of two trees in the same rounds

The same samples (random bytes of 80-120 KB) are written in each system's own format with
~8 MB shards/chunks: feedpipe tars (ShardWriter), MosaicML Streaming MDS, LitData ``optimize``
chunks; webdataset reads feedpipe's tars over http (its default ``curl`` pipe). They are served
by ``linkstore.py`` (in this process) over a simulated link: each response waits the RTT before
its first byte, all bodies share the node's bandwidth, optionally each response is capped.

Each run is a fresh process with an empty cache, shuffle on, raw bytes, batch 64; every sample
is checked (key and CRC-32 of its bytes) and must arrive exactly once. "Of the link" is
``(RTT + bytes of the system's files / node bandwidth) / wall``, wall from the dataset's
construction to the last batch. Best of ``--rounds`` (2) per system, systems alternating.
Requests, bytes and the most responses in flight are as the store counted them.

Writes ``results/bench_remote[-TAG].json``, ``.md`` and ``.png`` (bytes over time per system).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    RESULTS,
    alternating,
    default_root,
    emit,
    environment,
    load_spec,
    run_worker,
    table,
)

MB = 1_000_000
BATCH = 64
SHARD_BYTES = 8 << 20
SYSTEMS = ["gets8", "feedpipe-http", "feedpipe-s3", "streaming", "litdata", "webdataset"]
NOCACHE = ["feedpipe-http-nocache", "feedpipe-s3-nocache"]
FORMAT = {"gets8": "fp", "webdataset": "fp", "streaming": "mds", "litdata": "lit"}
BUCKET = "bkt"


def fmt_of(system: str) -> str:
    return FORMAT.get(system.split("@")[0], "fp")


# -- the data ----------------------------------------------------------------------------------
def sample_bytes(seed: int, i: int) -> bytes:
    rng = random.Random(seed * 10_000_019 + i)
    return rng.randbytes(rng.randint(80_000, 120_000))


def key_of(i: int) -> str:
    return f"s{i:07d}"


def prepare(root: str, n: int, seed: int = 0) -> dict[str, Any]:
    """Write ``n`` samples in every format under ``root/n{n}/bkt`` (once); return its sizes."""
    base = os.path.join(root, f"n{n}")
    done = os.path.join(base, "done.json")
    if os.path.exists(done):
        with open(done, encoding="utf-8") as f:
            return json.load(f)
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.join(base, BUCKET))
    r = run_worker(os.path.abspath(__file__), {"mode": "write", "base": base, "n": n,
                                               "seed": seed}, timeout=900)
    if "error" in r:
        raise RuntimeError(f"writing the data failed: {r}")
    sizes = {}
    for fmt in ("fp", "mds", "lit"):
        d = os.path.join(base, BUCKET, fmt)
        sizes[fmt] = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
    info = {"n": n, "seed": seed, "base": base, "payload_bytes": r["payload_bytes"],
            "format_bytes": sizes, "fp_shards": sorted(
                x for x in os.listdir(os.path.join(base, BUCKET, "fp")) if x.endswith(".tar"))}
    with open(done, "w", encoding="utf-8") as f:
        json.dump(info, f)
    return info


def _write(spec: dict[str, Any]) -> dict[str, Any]:
    base, n, seed = spec["base"], spec["n"], spec["seed"]
    bucket = os.path.join(base, BUCKET)
    from feedpipe import ShardWriter

    payload = 0
    with ShardWriter(os.path.join(bucket, "fp"), max_bytes=SHARD_BYTES) as w:
        for i in range(n):
            b = sample_bytes(seed, i)
            payload += len(b)
            w.write({"__key__": key_of(i), "bin": b})
    streaming = _import_streaming()
    with streaming.MDSWriter(out=os.path.join(bucket, "mds"), columns={"key": "str",
                             "bin": "bytes"}, size_limit=SHARD_BYTES) as w:
        for i in range(n):
            w.write({"key": key_of(i), "bin": sample_bytes(seed, i)})
    import litdata

    litdata.optimize(fn=_lit_sample, inputs=[(seed, i) for i in range(n)],
                     output_dir=os.path.join(bucket, "lit"), chunk_bytes=SHARD_BYTES,
                     num_workers=1, mode="overwrite")
    return {"payload_bytes": payload}


def _lit_sample(item: tuple[int, int]) -> dict[str, Any]:
    seed, i = item
    return {"key": key_of(i), "bin": sample_bytes(seed, i)}


def _import_streaming() -> Any:
    """``import streaming``: its package imports ``transformers`` (for a dataloader of text
    batches) and ``torchvision`` (for its vision datasets), neither used here nor installed with
    a CPU torch; stub modules stand in for them (no code path measured touches them)."""
    import importlib.abc
    import importlib.machinery
    import types

    class _Stub(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (dict,), {})

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname.split(".")[0] == "transformers":
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec: Any) -> Any:
            m = _Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module: Any) -> None:
            pass

    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _Finder())
    from peer_systems import import_streaming

    return import_streaming()


# -- one run (a worker process) ----------------------------------------------------------------
def _loader(spec: dict[str, Any], tmp: str) -> tuple[Any, Any]:
    """(iterable of batches, how to get (key, bytes) pairs out of a batch)."""
    system, url, nw = spec["system"].split("@")[0], spec["url"], spec["workers"]
    if system.startswith("feedpipe"):
        from feedpipe import FeedDataset, FeedLoader

        root = f"{url}/{BUCKET}/fp" if "-http" in system else f"s3://{BUCKET}/fp"
        cache = None if system.endswith("-nocache") else os.path.join(tmp, "cache")
        ds = FeedDataset(root, shuffle=True, seed=1, cache_dir=cache)
        loader = FeedLoader(ds, batch_size=BATCH, num_workers=nw)
        spec["_feedpipe_loader"] = loader
        return loader, lambda b: zip(b["__key__"], b["bin"], strict=True)
    if system == "streaming":
        streaming = _import_streaming()
        from streaming.base.util import clean_stale_shared_memory
        from torch.utils.data import DataLoader

        clean_stale_shared_memory()
        ds = streaming.StreamingDataset(remote=f"s3://{BUCKET}/mds",
                                        local=os.path.join(tmp, "mds"), shuffle=True,
                                        shuffle_seed=1, batch_size=BATCH)
        dl = DataLoader(ds, batch_size=BATCH, num_workers=nw, collate_fn=_list_collate)
        return dl, lambda b: ((s["key"], s["bin"]) for s in b)
    if system == "litdata":
        import litdata
        from litdata.streaming import downloader

        # LitData fetches chunks with obstore under client options of its own, which drop
        # AWS_ALLOW_HTTP: without this an http:// endpoint fails "builder error" (a user of a
        # plain-http S3-compatible store must do the same)
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # type: ignore[index]

        ds = litdata.StreamingDataset(
            f"s3://{BUCKET}/lit", shuffle=True, seed=1, cache_dir=os.path.join(tmp, "lit"),
            storage_options={"endpoint_url": url, "aws_access_key_id": "k",
                             "aws_secret_access_key": "s", "region_name": "us-east-1"})
        dl = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=nw,
                                         collate_fn=_copy_collate)
        return dl, lambda b: ((s["key"], s["bin"]) for s in b)
    if system == "webdataset":
        import webdataset as wds
        from torch.utils.data import DataLoader

        urls = [f"{url}/{BUCKET}/fp/{s}" for s in spec["fp_shards"]]
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=1, empty_check=False,
                            nodesplitter=None).shuffle(1000)
        dl = DataLoader(ds, batch_size=BATCH, num_workers=nw, collate_fn=_list_collate)
        return dl, lambda b: ((s["__key__"], s["bin"]) for s in b)
    raise ValueError(system)


def _imports(system: str) -> None:
    import torch.utils.data  # noqa: F401

    if system.startswith("feedpipe"):
        import feedpipe.stream._dataset  # noqa: F401
        import feedpipe.stream._loader  # noqa: F401

        if "-s3" in system:
            import s3fs  # noqa: F401
        else:
            import aiohttp  # noqa: F401
    elif system == "streaming":
        _import_streaming()
        import boto3  # noqa: F401
    elif system == "litdata":
        import litdata  # noqa: F401
        import obstore  # noqa: F401
    elif system == "webdataset":
        import webdataset  # noqa: F401


def _list_collate(batch: list[Any]) -> list[Any]:
    return batch


def _copy_collate(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # LitData hands bytes fields as memoryviews, which cannot leave a worker: copy, as a user must
    return [{k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in s.items()}
            for s in batch]


def _gets(spec: dict[str, Any], streams: int = 8) -> dict[str, Any]:
    """Whole-shard GETs, ``streams`` at a time: what the link gives a simple client."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    urls = [f"{spec['url']}/{BUCKET}/fp/{s}" for s in spec["fp_shards"]]
    t0 = time.perf_counter()
    first: list[float] = []

    def get(u: str) -> int:
        n = 0
        with urllib.request.urlopen(u, timeout=120) as r:
            while chunk := r.read(1 << 20):
                if not first:
                    first.append(time.perf_counter() - t0)
                n += len(chunk)
        return n

    with ThreadPoolExecutor(streams) as ex:
        total = sum(ex.map(get, urls))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "first_batch_s": first[0] if first else None, "samples": None,
            "bytes": total}


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["system"] == "gets8":
        return _gets(spec)
    import feedpipe

    spec["feedpipe_from"] = os.path.dirname(os.path.dirname(feedpipe.__file__))
    with open(spec["expect"], encoding="utf-8") as f:
        expect: dict[str, int] = json.load(f)
    tmp = tempfile.mkdtemp(prefix="bench-remote-")
    seen: dict[str, int] = {}
    bad: list[str] = []
    nbytes = 0
    _imports(spec["system"].split("@")[0])  # before the clock: an import is not the link's time
    try:
        t0 = time.perf_counter()
        first = None
        loader, pairs = _loader(spec, tmp)
        for batch in loader:
            if first is None:
                first = time.perf_counter() - t0
            for k, v in pairs(batch):
                k = str(k)
                seen[k] = seen.get(k, 0) + 1
                nbytes += len(v)
                if expect.get(k) != zlib.crc32(v):
                    bad.append(k)
        wall = time.perf_counter() - t0
        io = None
        loader_obj = spec.get("_feedpipe_loader")
        if loader_obj is not None:
            try:
                io = loader_obj.stats().get("io")
            except Exception as e:  # noqa: BLE001 - a figure missing is not the run failing
                io = {"error": repr(e)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dup = sum(1 for c in seen.values() if c > 1)
    missing = len(set(expect) - set(seen))
    res: dict[str, Any] = {"wall_s": wall, "first_batch_s": first, "samples": sum(seen.values()),
                           "bytes": nbytes, "duplicates": dup, "missing": missing,
                           "corrupt": len(bad), "exactly_once": not dup and not missing
                           and not bad and sum(seen.values()) == len(expect)}
    if io is not None:
        res["feedpipe_io"] = io
    res["feedpipe_from"] = spec["feedpipe_from"]
    return res


def worker(spec: dict[str, Any]) -> None:
    if spec.get("mode") == "write":
        emit(_write(spec))
        return
    os.environ.update({"AWS_ENDPOINT_URL_S3": spec["url"], "AWS_ENDPOINT_URL": spec["url"],
                       "S3_ENDPOINT_URL": spec["url"], "AWS_ACCESS_KEY_ID": "k",
                       "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
                       "NO_PROXY": "127.0.0.1,localhost",
                       "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    try:
        res = _run(spec)
    except BaseException as e:  # noqa: BLE001 - reported as this system's result
        emit({"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()})
        return
    emit(res)


# -- the harness -------------------------------------------------------------------------------
def cases(quick: bool) -> list[dict[str, Any]]:
    def case(rtt: float, node: float, cap: float = 0, nw: int = 0, n: int = 600,
             systems: list[str] | None = None) -> dict[str, Any]:
        name = f"rtt{int(rtt * 1000)}ms-node{int(node / MB)}" + (
            f"-cap{int(cap / MB)}" if cap else "") + f"-w{nw}-n{n}" + (
            "-nocache" if systems == NOCACHE else "")
        return {"name": name, "rtt": rtt, "node_rate": node, "response_rate": cap,
                "workers": nw, "n": n, "systems": systems or SYSTEMS}

    if quick:
        return [case(0.1, 200 * MB, systems=SYSTEMS + NOCACHE[:1]),
                case(0.03, 200 * MB, 25 * MB),
                case(0.1, 200 * MB, nw=2)]
    # issue 48's rows first (a run cut short keeps them), then the rest of the grid
    out = [case(0.1, 200 * MB), case(0.05, 200 * MB), case(0.02, 200 * MB),
           case(0.03, 200 * MB, 25 * MB), case(0.1, 200 * MB, nw=2),
           case(0.1, 200 * MB, n=3000), case(0.03, 200 * MB, 25 * MB, n=3000)]
    for rtt in (0.02, 0.05, 0.1):
        for node in (50 * MB, 200 * MB):
            for nw in (0, 2):
                c = case(rtt, node, nw=nw)
                if c["name"] not in {x["name"] for x in out}:
                    out.append(c)
    out.append(case(0.03, 200 * MB, 25 * MB, nw=2))
    out.append(case(0.1, 200 * MB, nw=2, n=3000))
    out.append(case(0.1, 200 * MB, systems=NOCACHE))
    out.append(case(0.1, 200 * MB, nw=2, systems=NOCACHE))
    return out


def floor_s(c: dict[str, Any], nbytes: int) -> float:
    return c["rtt"] + nbytes / c["node_rate"]


def measure(args: argparse.Namespace, save: Any = None) -> dict[str, Any]:
    from linkstore import LinkStore

    root = args.root
    os.makedirs(root, exist_ok=True)
    todo = cases(args.quick)
    if args.cases:  # a whole case name picks that case only, a part of one every case with it
        names = {c["name"] for c in todo}
        todo = [c for c in todo if any(s == c["name"] if s in names else s in c["name"]
                                       for s in args.cases)]
        if not todo:
            raise SystemExit(f"no case matches {args.cases}; the cases: {sorted(names)}")
    if args.systems:
        for c in todo:
            c["systems"] = [s for s in c["systems"] if s in args.systems]
    if args.compare:  # the same feedpipe systems again, from another tree, in the same rounds
        for c in todo:
            c["systems"] = c["systems"] + [f"{s}@{args.compare_label}" for s in c["systems"]
                                           if s.startswith("feedpipe")]
    datas = {n: prepare(root, n) for n in sorted({c["n"] for c in todo})}
    for n, d in datas.items():
        exp = os.path.join(d["base"], "expect.json")
        if not os.path.exists(exp):
            with open(exp, "w", encoding="utf-8") as f:
                json.dump({key_of(i): zlib.crc32(sample_bytes(d["seed"], i)) for i in range(n)},
                          f)
        d["expect"] = exp
    results: dict[str, Any] = {}
    script = os.path.abspath(__file__)
    assert len({c["name"] for c in todo}) == len(todo), "case names must differ"
    for c in todo:
        d = datas[c["n"]]
        store = LinkStore(d["base"]).start()
        store.configure(rtt=c["rtt"], node_rate=c["node_rate"], response_rate=c["response_rate"])
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in c["systems"]}
        load0 = os.getloadavg()[0]  # the machine is shared: each case says what it ran under
        print(f"== {c['name']}", flush=True)
        for r in range(args.rounds):
            for system in alternating(c["systems"], r):
                spec = {"system": system, "url": store.url, "workers": c["workers"],
                        "fp_shards": d["fp_shards"], "expect": d["expect"]}
                store.reset()
                pp = os.environ.get("PYTHONPATH")
                if "@" in system:
                    os.environ["PYTHONPATH"] = args.compare
                try:
                    res = run_worker(script, spec, timeout=args.timeout)
                finally:
                    if pp is None:
                        os.environ.pop("PYTHONPATH", None)
                    else:
                        os.environ["PYTHONPATH"] = pp
                st = store.stats()
                nbytes = d["format_bytes"][fmt_of(system)]
                res["store"] = {k: st[k] for k in ("requests", "requests_total", "bytes",
                                                   "max_in_flight", "errors")}
                res["store"]["objects_touched"] = len(st["per_object"])
                res["timeline"] = st["timeline"]
                if "error" not in res:
                    res["of_link"] = floor_s(c, nbytes) / res["wall_s"]
                    if res.get("samples"):
                        res["samples_per_s"] = res["samples"] / res["wall_s"]
                runs[system].append(res)
                print(f"  {system:24s} " + (
                    f"ERROR {res['error'][:300]}" if "error" in res else
                    f"wall {res['wall_s']:.2f}s of_link {res['of_link']:.2f} first "
                    f"{res['first_batch_s'] or 0:.2f}s req {st['requests_total']} inflight "
                    f"{st['max_in_flight']} bytes {st['bytes'] / MB:.1f}MB"
                    + ("" if res.get("exactly_once", True) else " NOT EXACTLY ONCE")),
                    flush=True)
        store.close()
        results[c["name"]] = {"loadavg": [load0, os.getloadavg()[0]], "case": c,
                              "floor_s": {s: floor_s(c, d["format_bytes"][fmt_of(s)])
                                          for s in c["systems"]},
                              "runs": runs, "best": {s: _best(rs) for s, rs in runs.items()}}
        if save is not None:  # each case as it ends: a long run interrupted keeps what it has
            save(results)
    return {"data": {n: {k: v for k, v in d.items() if k != "base"} for n, d in datas.items()},
            "results": results}


def _best(rs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rs if "error" not in r and r.get("exactly_once", True)]
    if not ok:
        return {"error": "; ".join(str(r.get("error") or "not exactly once") for r in rs)[:600]}
    b = min(ok, key=lambda r: r["wall_s"])
    return {k: v for k, v in b.items() if k != "timeline"} | {"rounds_ok": len(ok),
                                                                "rounds": len(rs)}


def report(doc: dict[str, Any]) -> str:
    systems = list(dict.fromkeys(s for r in doc["results"].values() for s in r["case"]["systems"]))
    lines = [f"# bench_remote{' (quick)' if doc['quick'] else ''}", "",
             f"{doc['env']['date_utc']}, {doc['env']['cpu_count']} CPUs (load average "
             f"{(doc['env'].get('loadavg_at_start') or [float('nan')])[0]:.1f} at the start"
             f"{_load_during(doc)}), "
             f"feedpipe from the tree `{os.path.basename(doc['feedpipe_path'])}`"
             + (f"; SYSTEM@{doc['compare']['label']}: feedpipe from the tree "
                f"`{os.path.basename(os.path.abspath(doc['compare']['path']))}`"
                if doc.get("compare") else "")
             + f"; benchmark rev {(doc['env']['git'].get('revision') or '?')[:10]}. "
             "Fraction of the link (RTT + bytes / node rate) / wall, best of "
             f"{doc['rounds']} rounds; every sample checked exactly once (else the cell says "
             "so).", ""]
    rows = []
    for name, r in doc["results"].items():
        row = [name]
        for s in systems:
            b = r["best"].get(s)
            row.append("" if b is None else ("failed" if "error" in b else f"{b['of_link']:.2f}"))
        rows.append(row)
    lines += ["## Fraction of the link", "", table(rows, ["case", *systems]), ""]
    for title, key, digits in (("Samples/s", "samples_per_s", 0),
                               ("Time to first batch (s)", "first_batch_s", 2),
                               ("Requests (store-counted)", None, 0),
                               ("Most responses in flight (store-counted)", None, 0)):
        rows = []
        for name, r in doc["results"].items():
            row = [name]
            for s in systems:
                b = r["best"].get(s)
                if b is None:
                    row.append("")
                elif "error" in b:
                    row.append("failed")
                elif title.startswith("Requests"):
                    row.append(str(b["store"]["requests_total"]))
                elif title.startswith("Most"):
                    row.append(str(b["store"]["max_in_flight"]))
                else:
                    v = b.get(key)
                    row.append("" if v is None else f"{v:.{digits}f}")
            rows.append(row)
        lines += [f"## {title}", "", table(rows, ["case", *systems]), ""]
    lines += previous_rows(doc.get("previous"))
    errs = [(n, s, b["error"]) for n, r in doc["results"].items() for s, b in r["best"].items()
            if "error" in b]
    if errs:
        lines += ["## Failures", ""] + [f"- {n} / {s}: {e}" for n, s, e in errs] + [""]
    return "\n".join(lines)


def _load_during(doc: dict[str, Any]) -> str:
    loads = [x for r in doc["results"].values() for x in r.get("loadavg") or []]
    if loads:
        return f", {min(loads):.1f} to {max(loads):.1f} at the cases' starts and ends"
    d = doc["env"].get("loadavg_during")
    return f", {d['min']:.1f} to {d['max']:.1f} during ({d['how']})" if d else ""


def previous_of(path: str) -> dict[str, Any]:
    """The fraction of the link per case and system of an earlier run's JSON, and what it ran
    on, for the report's "previous" table."""
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    return {"date_utc": old["env"]["date_utc"], "loadavg": old["env"].get("loadavg_at_start"),
            "tree": os.path.basename(old.get("feedpipe_path") or "?"),
            "revision": (old["env"].get("git") or {}).get("revision"),
            "of_link": {name: {s: ("failed" if "error" in b else round(b["of_link"], 2))
                               for s, b in r["best"].items()}
                        for name, r in old["results"].items()}}


def previous_rows(prev: dict[str, Any] | None) -> list[str]:
    if not prev:
        return []
    systems = list(dict.fromkeys(s for r in prev["of_link"].values() for s in r))
    rows = [[name, *(f"{v:.2f}" if isinstance(v, float) else str(v)
                     for v in (r.get(s, "") for s in systems))]
            for name, r in prev["of_link"].items()]
    load = (prev.get("loadavg") or [float("nan")])[0]
    return [f"## Previous: fraction of the link, {prev['date_utc']} (feedpipe from the tree "
            f"`{prev['tree']}`, benchmark rev {(prev.get('revision') or '?')[:10]}, load average "
            f"{load:.1f} at the start)", "",
            "The full set before this run, on the code of that day; compare within a row of one "
            "run, not across the two runs (the machine's load differs).", "",
            table(rows, ["case", *systems]), ""]


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["results"])
    if not names:  # nothing measured (yet): no plot rather than a division by zero
        return
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        r = doc["results"][name]
        for s, rs in r["runs"].items():
            ok = [x for x in rs if "error" not in x and x.get("timeline")]
            if not ok:
                continue
            best = min(ok, key=lambda x: x["wall_s"])
            tl = best["timeline"]
            # from the bin of the first byte: each process starts (imports) at its own pace
            i0 = next((i for i, p in enumerate(tl) if p[1] > 0), 0)
            t0 = tl[i0 - 1][0] if i0 else 0.0
            t = [0.0] + [p[0] - t0 for p in tl[i0:]]
            b = [0.0] + [p[1] / MB for p in tl[i0:]]
            ax.plot(t, b, label=s)
        fl = max(r["floor_s"].values()) - r["case"]["rtt"]
        ax.axvline(fl, color="grey", ls=":", lw=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("s from the first byte (grey: bytes / node rate)")
        ax.set_ylabel("MB sent")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--root", default=default_root("remote"))
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tag", default="")
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--cases", nargs="*", help="only the cases whose name contains one of these")
    ap.add_argument("--systems", nargs="*")
    ap.add_argument("--compare", metavar="DIR", help="also run the feedpipe systems with "
                    "PYTHONPATH=DIR (another tree), as SYSTEM@LABEL, in the same rounds")
    ap.add_argument("--compare-label", default="other")
    ap.add_argument("--previous", metavar="JSON", help="an earlier run's JSON: its fractions of "
                    "the link go into the report as a 'previous' table")
    ap.add_argument("--render", metavar="JSON", help="only write the Markdown and the plot again "
                    "from this run's JSON (with --previous: adding that table)")
    args = ap.parse_args()
    if args.worker:
        worker(load_spec(args.worker))
        return 0
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            doc = json.load(f)
        if args.previous:
            doc["previous"] = previous_of(args.previous)
            with open(args.render, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
        stem = os.path.splitext(args.render)[0]
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(report(doc) + "\n")
        plot(doc, stem + ".png")
        return 0
    import feedpipe

    doc: dict[str, Any] = {"quick": args.quick, "rounds": args.rounds,
                           "feedpipe_path": os.path.dirname(os.path.dirname(feedpipe.__file__)),
                           "env": environment(args.root),
                           "compare": {"label": args.compare_label, "path": args.compare}
                           if args.compare else None,
                           "previous": previous_of(args.previous) if args.previous else None}
    name = "bench_remote" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    os.makedirs(args.out, exist_ok=True)

    def save(results: dict[str, Any]) -> str:
        doc["results"] = results
        with open(os.path.join(args.out, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        md = report(doc)
        with open(os.path.join(args.out, name + ".md"), "w", encoding="utf-8") as f:
            f.write(md + "\n")
        plot(doc, os.path.join(args.out, name + ".png"))
        return md

    doc.update(measure(args, save))
    print(save(doc["results"]))
    failed = [s for r in doc["results"].values() for s, b in r["best"].items() if "error" in b]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
