"""feedpipe side by side with the loaders users would pick instead, on the same data and machine,
in one run (issue 8). The systems and their setups are in peer_systems.py.

Datasets (datasets.py, deterministic): ``images`` (20,000 JPEGs of 160-320 px in 100 class
folders, a JSON sidecar on every 10th: 22,000 files) and ``tiny`` (200,000 records of 1 KiB);
``--quick``: 2,000 images and 20,000 records.

Phases, each system-pass a fresh interpreter (common.run_worker); passes alternate the order of
the systems (common.alternating); figures are medians over ``--passes`` (>= 3) passes:

    convert   source files -> each format (64 MiB shards; 8 MiB with --quick). files/s =
              source files (images: jpg + json) / seconds. wids and DALI read webdataset's
              shards after one more index step each (a wids.json, DALI's wds2idx), timed and
              added to webdataset's time. "files" needs none.
    read      shuffled epochs of raw bytes in batches of 256 with num_workers 0 and 2 (3 epochs
              per process, their median): the main field of every sample is hashed (XXH3-64,
              or CRC-32 without xxhash: peer_systems.content_hash; the same cost for all) and
              every epoch must deliver exactly the source's samples, bytes and XOR of hashes.
    decode    images only: two shuffled epochs of JPEG decode + random-resized crop to 224 +
              flip + batch 256 (uint8 CHW), num_workers 0 and 2; every batch's shape is checked
              and the epoch's sample count too. Epoch 1 is the "decode" figure, epoch 2 the
              "second epoch" with whatever cache the system has (feedpipe: its decoded store
              once it exists; reported as pending otherwise).
    memory    peak RSS and PSS summed over the process and the workers alive with it
              (peer_memory.py) during the decode phase, per num_workers.

Warm-up: the page cache is warmed by one untimed read of every input before a phase, and every
rate is the steady rate after the first batch (its samples are counted for the check, not the
rate); the whole-epoch rate including worker start-up is in the JSON too.

Ceilings in the same run: ``cat`` of the feedpipe shards, a Python ``readinto`` loop into a
4 KiB-aligned 1 MiB buffer over the same shards, and single-core JPEG decode (simplejpeg and
Pillow, full-size, one CPU pinned).

Usage, from the checkout, in a separate venv holding the peers (docs/performance.md)::

    python3 -m venv .bench-venv && . .bench-venv/bin/activate
    pip install torch==2.13.0 && pip install -e '.[test,bench]' torch==2.13.0

    python benchmarks/bench_peers.py [--quick] [--passes 3] [--phases convert,read,decode,ceil]
                                     [--systems feedpipe,files,...] [--root DIR]
    python benchmarks/plot_peers.py [--quick]

``--root DIR`` holds the generated datasets and every system's converted copy (default:
``feedpipe-bench-peers`` under the system temp dir; several GB without ``--quick``).

Writes ``benchmarks/results/bench_peers.json`` and ``bench_peers.md`` (``-quick`` suffixed with
--quick).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import datasets  # noqa: E402
import peer_report  # noqa: E402
import peer_systems as ps  # noqa: E402

SCRIPT = os.path.abspath(__file__)
PHASES = ("convert", "read", "decode", "ceil")
WORKERS = (0, 2)


# ----------------------------------------------------------------------------- worker side


def _have_store() -> str | None:
    try:
        from feedpipe import DecodedStore  # noqa: F401
        return None
    except ImportError as e:
        return f"this feedpipe has no decoded store ({e})"


def _run_epochs(spec: dict[str, Any]) -> dict[str, Any]:
    from peer_memory import PeakMemory

    system, kind, phase = spec["system"], spec["kind"], spec["phase"]
    field = ps.main_field(kind)
    want = spec["expected"]
    out: dict[str, Any] = {"system": system, "epochs": []}
    t_setup = time.perf_counter()
    with PeakMemory() as mem:
        L = ps.loader(system, phase, spec["root"], kind, spec["nw"], spec)
        out["setup_seconds"] = time.perf_counter() - t_setup
        for _ in range(spec["epochs"]):
            n = nbytes = h = 0
            t0 = time.perf_counter()
            t_first = None
            n_first = 0
            for batch in L.epoch():
                if phase == "read":
                    k, b, c = ps.count_raw(system, batch, field)
                    nbytes += b
                    h ^= c
                else:
                    k = ps.count_decoded(batch)
                n += k
                if t_first is None:
                    t_first, n_first = time.perf_counter(), k
            t1 = time.perf_counter()
            got = {"samples": n} if phase == "decode" else {"samples": n, "bytes": nbytes,
                                                            "hash_xor": h}
            ep = {"seconds": t1 - t0, "first_batch_seconds": (t_first or t1) - t0,
                  "steady_samples": n - n_first, "steady_seconds": t1 - (t_first or t1), **got}
            out["epochs"].append(ep)
            bad = {k: (v, want[k]) for k, v in got.items() if want.get(k) != v}
            if bad:
                out["error"] = f"epoch {len(out['epochs'])} delivered {bad} (got, expected)"
                break
    out["memory"] = mem.result()
    return out


def _ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    which = spec["which"]
    if which == "cat":
        t0 = time.perf_counter()
        subprocess.run(["cat", *spec["files"]], stdout=subprocess.DEVNULL, check=True)
        return {"seconds": time.perf_counter() - t0}
    if which == "pyread":
        import numpy as np

        raw = np.empty((1 << 20) + 4096, dtype=np.uint8)
        off = (-raw.ctypes.data) % 4096
        buf = memoryview(raw[off:off + (1 << 20)])
        t0 = time.perf_counter()
        n = 0
        for p in spec["files"]:
            with open(p, "rb", buffering=0) as f:
                while k := f.readinto(buf):
                    n += k
        return {"seconds": time.perf_counter() - t0, "bytes": n}
    if which in ("jpeg-simplejpeg", "jpeg-pil"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        blobs = []
        for p in spec["files"]:
            with open(p, "rb") as f:
                blobs.append(f.read())
        if which == "jpeg-simplejpeg":
            import simplejpeg

            dec = lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB")  # noqa: E731
        else:
            dec = lambda b: ps.pil_rgb(b).load()  # noqa: E731
        for b in blobs[:20]:
            dec(b)
        t0 = time.perf_counter()
        for b in blobs:
            dec(b)
        return {"seconds": time.perf_counter() - t0, "images": len(blobs)}
    raise SystemExit(which)


def worker(spec: dict[str, Any]) -> int:
    task = spec["task"]
    try:
        if task == "convert":
            res = {"system": spec["system"], **ps.convert(spec["system"], spec["src"], spec["out"],
                                                          spec["kind"], spec["shard_bytes"])}
        elif task == "ceil":
            res = _ceiling(spec)
        elif spec["system"] == "feedpipe-store" and _have_store():
            res = {"unavailable": _have_store()}
        elif spec["system"] == "feedpipe-store":
            import shutil
            import tempfile

            spec["store_dir"] = tempfile.mkdtemp(prefix="fp-store-", dir=spec["scratch"])
            try:
                res = _run_epochs(spec)
            finally:
                shutil.rmtree(spec["store_dir"], ignore_errors=True)
        else:
            res = _run_epochs(spec)
    except Exception as e:  # noqa: BLE001 - a failing peer is reported, not dropped
        import traceback

        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
    res["loadavg"] = list(os.getloadavg())
    common.emit(res)
    return 0


# ----------------------------------------------------------------------------- parent side


def _files_of(root: str, ext: str) -> list[str]:
    return [p for p in common.walk_files(root) if p.endswith(ext)]


def _expected(info: dict[str, Any]) -> dict[str, Any]:
    field = ps.main_field(info["name"])
    name, digest = ps.content_hash()
    h = nbytes = 0
    for p in _files_of(info["src"], "." + field):
        with open(p, "rb") as f:
            b = f.read()
        h ^= digest(b)
        nbytes += len(b)
    return {"samples": info["samples"], "bytes": nbytes, "hash_xor": h, "check": name}


_PARTIAL: list[Any] = []  # [path, doc] once main() has a doc: saved before every run


def _save_partial() -> None:
    """Write what the run has so far to ``<name>.partial.json`` (removed at the end), so a crash
    late in a long run loses only the run in flight: ``peer_report.summarize``/``markdown`` turn
    it into tables."""
    if _PARTIAL:
        path, doc = _PARTIAL
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)


def _run(spec: dict[str, Any], log: list[str]) -> dict[str, Any]:
    _save_partial()
    t0 = time.perf_counter()
    r = common.run_worker(SCRIPT, spec, timeout=spec.get("timeout", 600))
    tag = "/".join(str(spec.get(k)) for k in ("task", "phase", "kind", "system", "nw", "which")
                   if spec.get(k) is not None)
    status = r.get("error") or r.get("unavailable") or "ok"
    line = f"  {tag}: {time.perf_counter() - t0:.1f}s {str(status)[:160]}"
    print(line, flush=True)
    log.append(line)
    return r


def profile(a: argparse.Namespace, cases: list[str]) -> str:
    """feedpipe's runs of ``cases`` (``phase:dataset:workers``) under py-spy (all processes),
    reduced by profiling.py_spy_summary: where its time goes."""
    from profiling import have_py_spy, py_spy_summary

    spy = have_py_spy()
    if not spy:
        return "py-spy is not installed (pip install py-spy)\n"
    parts = []
    for case in cases:
        phase, ds, nw = case.split(":")
        info = datasets.ensure(ds, root=a.root, quick=a.quick)
        base = os.path.dirname(info["src"])
        raw = os.path.join(base, f"profile-{phase}-{ds}-{nw}.txt")
        spec = {"task": "epochs", "phase": phase, "system": "feedpipe", "kind": ds, "nw": int(nw),
                "root": os.path.join(base, "peers", "feedpipe"), "src": info["src"],
                "samples": info["samples"], "expected": _expected(info), "scratch": base,
                "epochs": 1}
        wrap = [spy, "record", "--nonblocking", "--subprocesses", "--format", "raw", "-r", "200",
                "-o", raw, "--"]
        r = common.run_worker(SCRIPT, spec, wrap=wrap)
        ep = (r.get("epochs") or [{}])[0]
        parts.append(f"##### feedpipe {phase} {ds}, {nw} workers, one epoch under py-spy "
                     f"({ep.get('samples', '?')} samples in {ep.get('seconds', 0):.2f}s with "
                     f"sampling overhead; {r.get('error', 'ok')})\n")
        if os.path.exists(raw):
            parts.append(py_spy_summary(raw, top=18, rate=200))
        else:
            parts.append(json.dumps(r))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=common.default_root("peers"),
                    help="where the datasets and converted copies go (default: %(default)s)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--systems", default=",".join(ps.SYSTEMS + ("feedpipe-store",
                                                                 "feedpipe-threads")))
    ap.add_argument("--datasets", default="images,tiny")
    ap.add_argument("--read-epochs", type=int, default=3,
                    help="raw-read epochs per process; the run's figure is their median")
    ap.add_argument("--name", default=None,
                    help="results name (default bench_peers, bench_peers-quick with --quick)")
    ap.add_argument("--profile", default=None, metavar="PHASE:DATASET:WORKERS,...",
                    help="only profile feedpipe in these cases (e.g. read:images:0,"
                    "decode:images:0) under py-spy; writes results/bench_peers-profile.txt")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(common.load_spec(a.worker))
    if a.profile:
        txt = profile(a, a.profile.split(","))
        path = os.path.join(common.RESULTS, "bench_peers-profile" + ("-quick" if a.quick else "")
                            + ".txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(txt)
        print(txt)
        return 0
    phases = a.phases.split(",")
    systems = a.systems.split(",")
    shard_bytes = (8 if a.quick else 64) << 20
    doc: dict[str, Any] = {"benchmark": "bench_peers", "quick": a.quick, "passes": a.passes,
                           "command": " ".join(["python", "benchmarks/bench_peers.py",
                                                *(argv if argv is not None else sys.argv[1:])]),
                           "environment": common.environment(a.root),
                           "shard_bytes": shard_bytes, "batch_size": ps.BATCH,
                           "datasets": {}, "runs": {}, "log": []}
    doc["environment"]["read_check"] = ps.content_hash()[0]
    doc["environment"]["versions"].update({m: common._version(m) for m in (
        "mosaicml-streaming", "litdata", "nvidia-dali-cuda130", "wids", "torchvision", "pillow",
        "psutil", "matplotlib")})
    log = doc["log"]
    name = a.name or "bench_peers" + ("-quick" if a.quick else "")
    os.makedirs(common.RESULTS, exist_ok=True)
    _PARTIAL[:] = [os.path.join(common.RESULTS, f"{name}.partial.json"), doc]
    t_start = time.perf_counter()
    for ds in a.datasets.split(","):
        info = datasets.ensure(ds, root=a.root, quick=a.quick)
        base = os.path.dirname(info["src"])
        roots = {s: os.path.join(base, "peers", ps.CONVERTER[s]) if ps.CONVERTER[s]
                 else info["src"] for s in ps.SYSTEMS}
        roots["feedpipe-store"] = roots["feedpipe-threads"] = roots["feedpipe"]
        exp = _expected(info)
        doc["datasets"][ds] = {**info, "expected": exp}
        common.warm_files(common.walk_files(info["src"]))
        runs = doc["runs"].setdefault(ds, {})
        convs = [s for s in ps.CONVERTERS if s in systems or any(
            ps.CONVERTER.get(x) == s for x in systems)]
        if "convert" in phases or any(not os.path.exists(os.path.join(roots[s], ".ok"))
                                      for s in systems if ps.CONVERTER.get(s)):
            npass = a.passes if "convert" in phases else 1
            for p in range(npass):
                for s in common.alternating(convs, p):
                    common.sync_disk()
                    r = _run({"task": "convert", "system": s, "src": info["src"],
                              "out": os.path.join(base, "peers", s), "kind": ds,
                              "shard_bytes": shard_bytes}, log)
                    if "error" not in r:
                        open(os.path.join(base, "peers", s, ".ok"), "w").close()
                    runs.setdefault("convert", {}).setdefault(s, []).append(r)
            common.sync_disk()
        for s in convs:
            common.warm_files(common.walk_files(os.path.join(base, "peers", s)))
        for phase in ("read", "decode"):
            if phase not in phases or (phase == "decode" and ds != "images"):
                continue
            for nw in WORKERS:
                for p in range(a.passes):
                    for s in common.alternating(systems, p):
                        if phase == "read" and s in ("feedpipe-store", "feedpipe-threads"):
                            continue
                        if s == "feedpipe-threads" and nw == 0:  # 0 threads: feedpipe itself
                            continue
                        r = _run({"task": "epochs", "phase": phase, "system": s, "kind": ds,
                                  "nw": nw, "root": roots[s], "src": info["src"],
                                  "samples": info["samples"], "expected": exp,
                                  "scratch": base, "timeout": 240 if a.quick else 600,
                                  "epochs": 2 if phase == "decode" else a.read_epochs}, log)
                        runs.setdefault(f"{phase}-nw{nw}", {}).setdefault(s, []).append(r)
        if "ceil" in phases:
            shards = [p for p in common.walk_files(roots["feedpipe"]) if p.endswith(".tar")]
            jpgs = _files_of(info["src"], ".jpg")
            for _ in range(a.passes):
                for which in ("cat", "pyread") + (("jpeg-simplejpeg", "jpeg-pil")
                                                  if ds == "images" else ()):
                    files = jpgs if which.startswith("jpeg") else shards
                    r = _run({"task": "ceil", "which": which, "files": files}, log)
                    r["file_bytes"] = sum(os.path.getsize(f) for f in files)
                    runs.setdefault("ceil", {}).setdefault(which, []).append(r)
    doc["wall_seconds"] = time.perf_counter() - t_start
    doc["environment"]["loadavg_at_end"] = list(os.getloadavg())
    doc["summary"] = peer_report.summarize(doc)
    path = common.write_results(name, doc)
    if os.path.exists(_PARTIAL[0]):
        os.unlink(_PARTIAL[0])
    md = peer_report.markdown(doc)
    with open(os.path.join(common.RESULTS, f"{name}.md"), "w",
              encoding="utf-8") as f:
        f.write(md)
    print(md)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
