"""Conversion speed: ``feedpipe.shard`` vs ``webdataset.ShardWriter`` vs ``tar cf``.

For each dataset (``images``: 20,000 JPEGs + 2,000 JSON sidecars in 100 class folders; ``tiny``:
200,000 x 1 KiB records), every system converts the same source tree into a fresh output
directory, one subprocess per system-pass (imports and pool start-up are not shared), with the
source in the page cache (one untimed read pass first) and ``sync`` after every run so one
system's writeback does not land in the next one's timing. Passes alternate the order of the
systems. Reported: median files/s (source files, sidecars included), samples/s and input MB/s,
and the ratios feedpipe/ShardWriter and feedpipe/tar (ratio of medians, and the median of the
per-pass ratios).

Systems:
    feedpipe-w2     feedpipe.shard(src, out, workers=2, labels_from_dirs=<images>)
    feedpipe-w1     the same with workers=1
    wds-shardwriter webdataset's recommended usage: a Python loop over the listed samples that
                    reads each sample's files and writes one dict per sample to
                    ``ShardWriter(pattern, maxsize=256e6)`` (``cls`` added for images)
    mds             MosaicML Streaming's ``MDSWriter`` (size_limit 256 MiB) fed by a Python loop
                    over the listed samples (``peer_systems.convert("mosaic")``); with
                    ``--mds-python``, run by that interpreter (a venv where ``streaming``
                    imports)
    tar             ``tar cf out/all.tar -C src .`` (GNU tar, one archive, no index)

Timing starts after imports and stops when the last shard is written (feedpipe's timing includes
its listing, planning, per-shard fsync, hashing, index and manifest writing; ShardWriter's
includes listing the tree in Python; neither fsyncs the same way: ShardWriter never fsyncs).

Usage::

    python benchmarks/bench_convert.py [--quick] [--passes N] [--datasets images,tiny]
                                       [--profile] [--root DIR]

``--root`` holds the datasets of ``datasets.py`` (default: ``feedpipe-bench`` under the system
temp dir). Writes ``benchmarks/results/bench_convert.json`` (``bench_convert-quick.json`` with
``--quick``) and, with ``--profile``, ``benchmarks/results/bench_convert-profile.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import datasets  # noqa: E402
import render_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SYSTEMS = ("feedpipe-w2", "feedpipe-w1", "wds-shardwriter", "mds", "tar")
# issue 31's bars: feedpipe-w2 at least 2x MDSWriter's files/s; at most 1.5x tar's seconds
BARS = {"tiny": (("feedpipe-w2/mds", 2.0), ("feedpipe-w2/tar", 1 / 1.5)),
        "images": (("feedpipe-w2/tar", 1 / 1.5),)}
# runs this file's worker under another interpreter, passed as argv[1] (see --mds-python)
_UNDER = ("import runpy, sys; sys.argv = sys.argv[2:]; "
          "runpy.run_path(sys.argv[0], run_name='__main__')")
WDS_MAXSIZE = 256e6
DEFAULT_PASSES = {"images": 5, "tiny": 3}


# ----------------------------------------------------------------------------- worker side


def _list_samples(src: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(key, [(ext, path), ...]) per sample, keys = relative stem, sorted: what a user writing a
    ShardWriter loop does first."""
    by_key: dict[str, list[tuple[str, str]]] = {}
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, src)
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            stem, ext = name.rsplit(".", 1)
            key = stem if rel_dir == "." else f"{rel_dir}/{stem}"
            by_key.setdefault(key, []).append((ext, os.path.join(dirpath, name)))
    return sorted(by_key.items())


def _shardwriter(src: str, out: str, labels: bool) -> dict[str, Any]:
    import webdataset as wds

    samples = _list_samples(src)
    classes = sorted({k.split("/", 1)[0] for k, _ in samples}) if labels else []
    cls_index = {c: i for i, c in enumerate(classes)}
    n = files = 0
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=WDS_MAXSIZE,
                         verbose=0) as sink:
        for key, members in samples:
            sample: dict[str, Any] = {"__key__": key}
            for ext, path in members:
                with open(path, "rb") as f:
                    sample[ext] = f.read()
                files += 1
            if labels:
                sample["cls"] = cls_index[key.split("/", 1)[0]]
            sink.write(sample)
            n += 1
    return {"samples": n, "files": files}


def _feedpipe(src: str, out: str, labels: bool, workers: int) -> dict[str, Any]:
    import feedpipe

    s = feedpipe.shard(src, out, workers=workers, labels_from_dirs=labels, show_progress=False)
    return {"samples": s.samples, "files": s.files, "skipped": s.skipped,
            "feedpipe_summary_files_per_s": s.files_per_s}


def _tar(src: str, out: str) -> dict[str, Any]:
    subprocess.run(["tar", "cf", os.path.join(out, "all.tar"), "-C", src, "."], check=True)
    return {}


def worker(spec: dict[str, Any]) -> int:
    system, src, out, labels = spec["system"], spec["src"], spec["out"], spec["labels"]
    if system.startswith("feedpipe"):
        import feedpipe  # noqa: F401  (imports are not timed)
        import feedpipe.convert._shard  # noqa: F401

        workers = int(system.rsplit("w", 1)[1])
        fn = lambda: _feedpipe(src, out, labels, workers)  # noqa: E731
    elif system == "wds-shardwriter":
        import webdataset  # noqa: F401

        os.makedirs(out, exist_ok=True)
        fn = lambda: _shardwriter(src, out, labels)  # noqa: E731
    elif system == "mds":
        import peer_systems

        peer_systems.import_streaming()
        kind = "images" if labels else "tiny"
        fn = lambda: {"mds_seconds": peer_systems.convert(  # noqa: E731
            "mosaic", src, out, kind, 256 << 20)["seconds"]}
    elif system == "tar":
        os.makedirs(out, exist_ok=True)
        fn = lambda: _tar(src, out)  # noqa: E731
    else:
        raise SystemExit(f"unknown system {system!r}")
    prof = None
    if spec.get("cprofile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    extra = fn()
    secs = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(spec["cprofile"])
    out_files = [os.path.join(out, n) for n in os.listdir(out)]
    res = {"system": system, "seconds": secs, **extra,
           "out_bytes": sum(os.path.getsize(p) for p in out_files if os.path.isfile(p)),
           "out_tars": sum(1 for p in out_files if p.endswith(".tar"))}
    error = None
    if "samples" in extra and extra["samples"] != spec["expected_samples"]:
        error = f"wrote {extra['samples']} samples, expected {spec['expected_samples']}"
    if "files" in extra and extra["files"] != spec["expected_files"]:
        error = f"read {extra['files']} files, expected {spec['expected_files']}"
    if res["out_bytes"] < spec["expected_bytes"]:
        error = f"output has {res['out_bytes']} bytes, less than the input {spec['expected_bytes']}"
    if error:
        res["error"] = error
    common.emit(res)
    return 1 if error else 0


# ----------------------------------------------------------------------------- parent side


def _row_stats(runs: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    secs = [r["seconds"] for r in ok]
    fps = [info["files"] / s for s in secs]
    return {
        "passes_ok": len(ok),
        "passes_failed": len(runs) - len(ok),
        "errors": [r["error"] for r in runs if "error" in r],
        "median_seconds": common.median(secs),
        "files_per_s": common.median(fps),
        "files_per_s_range": common.spread(fps),
        "samples_per_s": common.median(info["samples"] / s for s in secs),
        "input_mb_per_s": common.median(info["bytes"] / s / 1e6 for s in secs),
        "out_bytes": ok[0]["out_bytes"] if ok else None,
        "out_tars": ok[0]["out_tars"] if ok else None,
    }


def _ratios(per_pass: list[dict[str, dict[str, Any]]], stats: dict[str, dict[str, Any]],
            num: str, den: str) -> dict[str, Any]:
    a, b = stats.get(num, {}).get("files_per_s"), stats.get(den, {}).get("files_per_s")
    pp = [p[den]["seconds"] / p[num]["seconds"] for p in per_pass
          if num in p and den in p and "error" not in p[num] and "error" not in p[den]]
    return {"ratio_of_medians": a / b if a and b else None,
            "median_of_pass_ratios": common.median(pp), "pass_ratios": pp}


def _profile(ds: str, info: dict[str, Any], labels: bool, work: str) -> str:
    from profiling import cprofile_summary, have_py_spy, py_spy_summary

    parts = []
    out = os.path.join(work, f"profile-{ds}-w1")
    shutil.rmtree(out, ignore_errors=True)
    stats = os.path.join(work, f"profile-{ds}-w1.pstats")
    spec = {"system": "feedpipe-w1", "src": info["src"], "out": out, "labels": labels,
            "expected_samples": info["samples"], "expected_files": info["files"],
            "expected_bytes": info["bytes"], "cprofile": stats}
    r = common.run_worker(SCRIPT, spec)
    parts.append(f"##### {ds}: feedpipe.shard(workers=1) under cProfile "
                 f"({r.get('seconds', 0):.2f}s with profiling overhead)\n")
    parts.append(cprofile_summary(stats) if "error" not in r else json.dumps(r))
    shutil.rmtree(out, ignore_errors=True)
    common.sync_disk()
    spy = have_py_spy()
    if spy:
        out = os.path.join(work, f"profile-{ds}-w2")
        shutil.rmtree(out, ignore_errors=True)
        raw = os.path.join(work, f"profile-{ds}-w2.pyspy.txt")
        spec = {**spec, "system": "feedpipe-w2", "out": out, "cprofile": None}
        r = common.run_worker(SCRIPT, spec, wrap=[spy, "record", "--subprocesses", "--format",
                                                  "raw", "-r", "250", "-o", raw, "--"])
        parts.append(f"\n##### {ds}: feedpipe.shard(workers=2) under py-spy --subprocesses, "
                     f"on-CPU samples only ({r.get('seconds', 0):.2f}s wall)\n")
        parts.append(py_spy_summary(raw, rate=250) if os.path.exists(raw) else json.dumps(r))
        shutil.rmtree(out, ignore_errors=True)
        common.sync_disk()
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=datasets.DEFAULT_ROOT)
    ap.add_argument("--quick", action="store_true", help="small datasets (see datasets.py)")
    ap.add_argument("--passes", type=int, default=None,
                    help="passes per dataset (default: 5 for images, 3 for tiny, whose passes "
                    "take ~1.5 min)")
    ap.add_argument("--datasets", default="images,tiny")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--mds-python", default=sys.executable,
                    help="the interpreter that runs the mds system (default: this one)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile feedpipe (cProfile for workers=1, py-spy for workers=2)")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(common.load_spec(a.worker))

    name = "bench_convert" + ("-quick" if a.quick else "")
    systems = a.systems.split(",")
    work = os.path.join(a.root, "work", "convert")
    os.makedirs(work, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "convert",
        "environment": common.environment(a.root),
        "settings": {"quick": a.quick, "passes": a.passes or DEFAULT_PASSES, "systems": systems,
                     "wds_maxsize": WDS_MAXSIZE, "jpeg_quality": datasets.JPEG_QUALITY,
                     "page_cache": "warm (one untimed read of the source before the passes)",
                     "unit": "files/s = source files (sidecars included) / wall seconds"},
        "datasets": {},
    }
    failed = False
    t_start = time.perf_counter()
    text_out = []
    profiles = []
    for ds in a.datasets.split(","):
        info = datasets.ensure(ds, root=a.root, quick=a.quick)
        labels = ds == "images"
        print(f"\n[{ds}] {info['files']:,} files, {info['samples']:,} samples, "
              f"{info['bytes'] / 1e6:,.1f} MB; warming the page cache ...", flush=True)
        common.warm_files(common.walk_files(info["src"]))
        per_pass: list[dict[str, dict[str, Any]]] = []
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        passes = a.passes or DEFAULT_PASSES.get(ds, 3)
        for p in range(passes):
            this: dict[str, dict[str, Any]] = {}
            for system in common.alternating(systems, p):
                out = os.path.join(work, f"{ds}-{system}")
                shutil.rmtree(out, ignore_errors=True)
                common.sync_disk()
                spec = {"system": system, "src": info["src"], "out": out, "labels": labels,
                        "expected_samples": info["samples"], "expected_files": info["files"],
                        "expected_bytes": info["bytes"]}
                wrap = ([a.mds_python, "-c", _UNDER]
                        if system == "mds" and a.mds_python != sys.executable else [])
                r = common.run_worker(SCRIPT, spec, wrap=wrap)
                r["pass"] = p
                r["loadavg_1min_after"] = os.getloadavg()[0]
                shutil.rmtree(out, ignore_errors=True)
                common.sync_disk()
                this[system] = r
                runs[system].append(r)
                if "error" in r:
                    failed = True
                    print(f"  pass {p} {system:16s} FAILED: {r['error']}\n"
                          f"{r.get('stderr_tail', '')}", flush=True)
                else:
                    print(f"  pass {p} {system:16s} {r['seconds']:7.2f}s "
                          f"{info['files'] / r['seconds']:10,.0f} files/s", flush=True)
            per_pass.append(this)
        stats = {s: _row_stats(runs[s], info) for s in systems}
        ratios = {}
        for num in ("feedpipe-w2", "feedpipe-w1"):
            for den in ("wds-shardwriter", "mds", "tar"):
                if num in stats and den in stats:
                    ratios[f"{num}/{den}"] = _ratios(per_pass, stats, num, den)
        target = ratios.get("feedpipe-w2/wds-shardwriter", {}).get("ratio_of_medians")
        doc["datasets"][ds] = {"info": info, "labels_from_dirs": labels, "systems": stats,
                               "ratios": ratios, "runs": runs,
                               "target": {"what": "feedpipe-w2 files/s >= 2x ShardWriter",
                                          "ratio": target,
                                          "met": None if target is None else target >= 2.0},
                               "bars": {k: {"median_of_pass_ratios":
                                            ratios.get(k, {}).get("median_of_pass_ratios"),
                                            "at_least": bar}
                                        for k, bar in BARS.get(ds, ())}}
        rows = [[s, common.fmt(st["median_seconds"], 2), common.fmt(st["files_per_s"]),
                 "-" if not st["files_per_s_range"] else
                 f"{st['files_per_s_range'][0]:,.0f}-{st['files_per_s_range'][1]:,.0f}",
                 common.fmt(st["samples_per_s"]), common.fmt(st["input_mb_per_s"], 1),
                 str(st["passes_ok"]) + ("" if not st["passes_failed"] else
                                         f" ({st['passes_failed']} FAILED)")]
                for s, st in stats.items()]
        tbl = common.table(rows, ["system", "sec", "files/s", "range", "samples/s", "MB/s",
                                  "passes"])
        rat = "\n".join(f"  {k:32s} {common.fmt(v['ratio_of_medians'], 2)}x "
                        f"(median of per-pass ratios {common.fmt(v['median_of_pass_ratios'], 2)}x)"
                        for k, v in ratios.items())
        load = common.median(r.get("loadavg_1min_after") for rs in runs.values() for r in rs)
        doc["datasets"][ds]["median_loadavg_1min"] = load
        block = (f"\n== convert {ds} ({info['files']:,} files, {info['samples']:,} samples, "
                 f"{info['bytes'] / 1e6:,.1f} MB), median of {passes} passes "
                 f"(1-min load average during the runs: median {common.fmt(load, 1)} on "
                 f"{os.cpu_count()} CPUs)\n{tbl}\n{rat}\n"
                 f"  target feedpipe-w2 >= 2x ShardWriter: "
                 f"{'MET' if target and target >= 2 else 'NOT MET'}\n"
                 + "".join(f"  bar {k} >= {bar:.3g} (median of per-pass ratios): "
                           f"{common.fmt(v, 3)} "
                           f"{'MET' if v is not None and v >= bar else 'NOT MET'}\n"
                           for k, bar in BARS.get(ds, ())
                           for v in [ratios.get(k, {}).get("median_of_pass_ratios")]))
        print(block, flush=True)
        text_out.append(block)
        if a.profile:
            prof = _profile(ds, info, labels, work)
            profiles.append(prof)
    rc = common.finish(name, doc, text_out, profiles, bool(failed), t_start)
    render_results.render(os.path.join(common.RESULTS, name + ".json"), force=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
