"""Raw read speed of shards: feedpipe vs ``webdataset.WebDataset`` vs ``cat``.

The shards are made once by ``feedpipe.shard`` from each source dataset (see datasets.py;
``--shard-mb`` per shard, 64 by default so that every dataset has several shards to split over
DataLoader workers) and cached beside it. Every system reads the *same* shard files, every sample,
every field, and touches every byte of every field (``touch``: zlib.crc32 below 64 KiB, a numpy
max above, so the byte-touching cost is the same function for every system and near memory speed
for large fields); each run must deliver exactly the manifest's sample count and payload byte
count or it fails loudly. The page cache is warm (one untimed ``cat`` of the shards first). One
subprocess per system-pass; passes alternate the order of the systems.

Systems:
    cat                 ``cat SHARDS > /dev/null`` (MB/s ceiling for a sequential reader)
    fp-reader           feedpipe.ShardReader over every shard in manifest.json, one process
    fp-reader-nocopy    the same, fields only len()'ed: zero-copy delivery cost, bytes untouched
    fp-dataset          feedpipe.FeedDataset(root), one process (when it exists)
    fp-dataset-dl2      DataLoader(FeedDataset(root), batch_size=None, num_workers=2)
    fp-reader-dl2       DataLoader over a benchmark-side IterableDataset: worker w of n reads
                        shards w::n with ShardReader and turns each memoryview into bytes (a
                        memoryview cannot be pickled back to the main process)
    fp-loader           FeedLoader(FeedDataset(root), batch_size=256), one process (batches built
                        from the shard index: the refs route, feedpipe/stream/_refs.py)
    fp-loader-dl2       FeedLoader(FeedDataset(root), batch_size=256, num_workers=2): the
                        recommended way. With every shard fitting in max_open_shards (as
                        here) the training process plans each batch from the index columns
                        and starts no worker; otherwise workers plan each batch and send where
                        its members are (a few kB). The training process copies the bytes out
                        of its maps of the shards (feedpipe/stream/_refs.py; the consumer loop
                        takes the batches apart into sample dicts)
    wds                 webdataset.WebDataset(urls, shardshuffle=False), one process
    wds-loader-dl2      WebLoader(WebDataset(urls, shardshuffle=False).batched(256,
                        collation_fn=None), batch_size=None, num_workers=2): webdataset's
                        recommended batching in the workers (its default collation refuses
                        samples whose keys differ, as with sidecars on some samples)
    wds-dl2             DataLoader(WebDataset(urls, shardshuffle=False), batch_size=None,
                        num_workers=2): webdataset's default nodesplitter/workersplitter
                        (single_node_only / split_by_worker) split the shards across workers
    dl2-null            not a reader: DataLoader(batch_size=None, num_workers=2) over a dataset
                        whose workers yield copies of the dataset's first sample (bytes), as many
                        as the dataset holds: the ceiling the DataLoader's per-sample transport
                        (pickle + pipe + unpickle) puts on any reader in this configuration.
                        Not run by default (``--systems ...,dl2-null``): on this 2-core machine
                        its timings were bimodal (0.4 s or 1.1 s for the same 2,000 samples),
                        scheduling of three busy processes on two cores dominating

The DataLoader systems (``*-dl2``) move every sample through a pipe and run at a few thousand
samples/s here, so on the full ``tiny`` dataset they read only its first 2 of 5 shards (80,000
samples, ``--dl-max-samples``), through a sibling directory of symlinks with a cut-down manifest;
their rates are compared with each other on that same subset.

Timing starts after imports (it includes reading the manifest and indexes, opening shards,
starting DataLoader workers) and stops after the last sample; a run repeats whole epochs (a new
iterator, new DataLoader workers) until ``--min-seconds`` (1 s) have passed and reports seconds
per epoch, so that 0.1 s epochs (``cat``, 1 MB samples) are not all timer noise. With ``--steady``
a run is a training loop's steady state instead: each system's dataset/loader object is built once
per process, one untimed warm-up epoch runs, and the timed epochs iterate the same object again
(new DataLoader workers each epoch, as without ``persistent_workers``; what the object parsed,
opened or mapped in earlier epochs stays). Reported: median samples/s, payload
MB/s (field bytes) and file MB/s (shard bytes, what ``cat`` reads), and ratios feedpipe/webdataset
(samples/s) and feedpipe/cat (file MB/s).

Usage::

    python benchmarks/bench_read.py [--quick] [--passes 3] [--datasets images,tiny,big]
                                    [--systems ...] [--shard-mb 64] [--min-seconds 1]
                                    [--profile] [--root DIR]

``--root`` holds the datasets of ``datasets.py`` (default: ``feedpipe-bench`` under the system
temp dir). Writes ``benchmarks/results/bench_read.json`` (``bench_read-quick.json`` with
``--quick``) and, with ``--profile``, ``benchmarks/results/bench_read-profile.txt``.
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
SYSTEMS = ("cat", "fp-reader", "fp-reader-nocopy", "fp-dataset", "fp-dataset-dl2",
           "fp-reader-dl2", "fp-loader", "fp-loader-dl2", "wds", "wds-dl2", "wds-loader-dl2")
OPTIONAL_SYSTEMS = ("dl2-null",)
BIG_FIELD = 1 << 16


# ----------------------------------------------------------------------------- worker side


def _touch_fn():  # type: ignore[no-untyped-def]
    import zlib

    import numpy as np

    crc32 = zlib.crc32
    frombuffer = np.frombuffer
    u8 = np.uint8

    def touch(v: Any) -> None:
        if len(v) >= BIG_FIELD:
            frombuffer(v, u8).max()
        else:
            crc32(v)

    return touch


def _consume(it: Any, touch: Any) -> tuple[int, int]:
    n = nbytes = 0
    for s in it:
        n += 1
        for k, v in s.items():
            if k[:2] != "__":
                nbytes += len(v)
                if touch is not None:
                    touch(v)
    return n, nbytes


def _manifest_shards(root: str) -> list[tuple[str, str, int, int]]:
    """(path, name, base, bytes) per shard, from manifest.json."""
    with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    out, base = [], 0
    for s in m["shards"]:
        out.append((os.path.join(root, s["name"]), s["name"], base, s["bytes"]))
        base += s["samples"]
    return out


def _fp_reader_iter(root: str) -> Any:
    from feedpipe import ShardReader

    for path, name, base, nbytes in _manifest_shards(root):
        r = ShardReader(path, name=name, base=base, expected_bytes=nbytes)
        yield from r
        # views handed out may still be alive in the caller; ShardReader.close tolerates that
        r.close()


def _reader_dataset(root: str) -> Any:
    import torch.utils.data as tud

    class ShardReaderDataset(tud.IterableDataset):  # type: ignore[misc]
        """What a user of the current API would write: shards split over DataLoader workers,
        memoryviews turned into bytes so samples can be pickled back to the main process."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            info = tud.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            from feedpipe import ShardReader

            for path, name, base, nbytes in _manifest_shards(root)[wid::nw]:
                r = ShardReader(path, name=name, base=base, expected_bytes=nbytes)
                for s in r:
                    yield {k: (bytes(v) if isinstance(v, memoryview) else v)
                           for k, v in s.items()}
                r.close()

    return ShardReaderDataset()


def _first_sample(root: str) -> dict[str, Any]:
    from feedpipe import ShardReader

    path, name, base, nbytes = _manifest_shards(root)[0]
    with ShardReader(path, name=name, base=base, expected_bytes=nbytes) as r:
        return {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in r.sample(0).items()}


def _null_dataset(template: dict[str, Any], total: int) -> Any:
    import torch.utils.data as tud

    class NullDataset(tud.IterableDataset):  # type: ignore[misc]
        def __iter__(self):  # type: ignore[no-untyped-def]
            info = tud.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            for _ in range(total // nw + (1 if wid < total % nw else 0)):
                yield dict(template)

    return NullDataset()


BATCH = 256  # samples per batch for the batched DataLoader systems


def _fp_rows(loader: Any) -> Any:
    """FeedLoader's batches (field -> list, None where a sample lacks the field) as per-sample
    dicts of the fields the sample has, so every system is consumed by the same loop."""
    for b in loader:
        fields = [k for k in b if k[:2] != "__"]
        for vals in zip(*(b[k] for k in fields)):
            yield {k: v for k, v in zip(fields, vals) if v is not None}


_BUILT: dict[str, Any] = {}
_STEADY = False  # --steady: build each system's object once per process (see the docstring)


def _once(system: str, build: Any) -> Any:
    """``build()``, or with ``--steady`` the object built for ``system`` earlier in this process."""
    if not _STEADY:
        return build()
    if system not in _BUILT:
        _BUILT[system] = build()
    return _BUILT[system]


def _make_iter(system: str, root: str, urls: list[str], extra: Any = None) -> Any:
    if system in ("fp-reader", "fp-reader-nocopy"):
        return _fp_reader_iter(root)
    if system == "fp-dataset":
        import feedpipe

        return iter(_once(system, lambda: feedpipe.FeedDataset(root)))
    if system == "fp-dataset-dl2":
        from torch.utils.data import DataLoader

        import feedpipe

        return iter(_once(system, lambda: DataLoader(feedpipe.FeedDataset(root), batch_size=None,
                                                     num_workers=2)))
    if system == "fp-reader-dl2":
        from torch.utils.data import DataLoader

        return iter(DataLoader(_reader_dataset(root), batch_size=None, num_workers=2))
    if system == "dl2-null":
        from torch.utils.data import DataLoader

        return iter(DataLoader(_null_dataset(*extra), batch_size=None, num_workers=2))
    if system == "fp-loader":
        import feedpipe

        return _fp_rows(_once(system, lambda: feedpipe.FeedLoader(feedpipe.FeedDataset(root),
                                                                  batch_size=BATCH)))
    if system == "fp-loader-dl2":
        import feedpipe

        ld = _once(system, lambda: feedpipe.FeedLoader(feedpipe.FeedDataset(root),
                                                       batch_size=BATCH, num_workers=2))
        return _fp_rows(ld)
    if system == "wds-loader-dl2":
        import webdataset as wds

        # webdataset's own recipe: batch in the workers, WebLoader(batch_size=None). Its default
        # collation needs the same keys in every sample (a sidecar on some breaks it), so the
        # batch is the list of sample dicts.
        wl = _once(system, lambda: wds.WebLoader(
            wds.WebDataset(urls, shardshuffle=False).batched(BATCH, collation_fn=None),
            batch_size=None, num_workers=2))
        return (s for b in wl for s in b)
    if system == "wds":
        import webdataset as wds

        return iter(_once(system, lambda: wds.WebDataset(urls, shardshuffle=False)))
    if system == "wds-dl2":
        import webdataset as wds
        from torch.utils.data import DataLoader

        return iter(_once(system, lambda: DataLoader(wds.WebDataset(urls, shardshuffle=False),
                                                     batch_size=None, num_workers=2)))
    raise SystemExit(f"unknown system {system!r}")


def _preimport(system: str) -> str | None:
    """Import what the system needs before the clock starts; a reason if it is unavailable."""
    import numpy  # noqa: F401

    if system.startswith("fp-") or system == "dl2-null":
        import feedpipe
        import feedpipe.format._reader  # noqa: F401

        if system.startswith(("fp-dataset", "fp-loader")):
            try:
                feedpipe.FeedDataset  # noqa: B018
                feedpipe.FeedLoader  # noqa: B018
            except (AttributeError, ImportError) as e:
                return f"feedpipe.FeedDataset is not available: {type(e).__name__}: {e}"
    if system.startswith("wds"):
        import webdataset  # noqa: F401
    if system.endswith("dl2"):
        import torch.utils.data  # noqa: F401
    return None


def _epochs(run: Any, min_seconds: float, max_epochs: int = 50) -> tuple[float, int, Any]:
    """Run whole epochs until ``min_seconds`` have passed; (seconds per epoch, epochs, result of
    the last epoch). Short epochs are repeated so a 0.1 s measurement is not all noise."""
    total, k, last = 0.0, 0, None
    while True:
        t0 = time.perf_counter()
        last = run()
        total += time.perf_counter() - t0
        k += 1
        if total >= min_seconds or k >= max_epochs:
            return total / k, k, last


def worker(spec: dict[str, Any]) -> int:
    global _STEADY
    system, root = spec["system"], spec["root"]
    _STEADY = bool(spec.get("steady"))
    min_seconds = float(spec.get("min_seconds", 0))
    urls = [p for p, _, _, _ in _manifest_shards(root)]
    if system == "cat":
        secs, k, _ = _epochs(
            lambda: subprocess.run(["cat", *urls], stdout=subprocess.DEVNULL, check=True),
            min_seconds)
        common.emit({"system": system, "seconds": secs, "epochs": k})
        return 0
    missing = _preimport(system)
    if missing:
        common.emit({"system": system, "unavailable": missing})
        return 0
    touch = None if system == "fp-reader-nocopy" else _touch_fn()
    expected = (spec["expected_samples"], spec["expected_payload"])
    extra = None
    if system == "dl2-null":
        template = _first_sample(root)
        extra = (template, spec["expected_samples"])
        expected = (spec["expected_samples"], spec["expected_samples"] * sum(
            len(v) for k, v in template.items() if k[:2] != "__"))
    prof = None
    if spec.get("cprofile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    counts: list[tuple[int, int]] = []

    def one_epoch() -> None:
        counts.append(_consume(_make_iter(system, root, urls, extra), touch))

    if _STEADY:
        one_epoch()  # warm-up, untimed (its delivery is checked with the others)
    secs, k, _ = _epochs(one_epoch, min_seconds)
    if prof is not None:
        prof.disable()
        prof.dump_stats(spec["cprofile"])
    n, nbytes = counts[-1]
    res: dict[str, Any] = {"system": system, "seconds": secs, "epochs": k, "samples": n,
                           "payload_bytes": nbytes}
    bad = [c for c in counts if c != expected]
    if bad:
        res["error"] = (f"delivered {bad[0][0]} samples / {bad[0][1]} payload bytes in an epoch, "
                        f"expected {expected[0]} / {expected[1]}")
    common.emit(res)
    return 1 if "error" in res else 0


# ----------------------------------------------------------------------------- parent side


def ensure_shards(info: dict[str, Any], shard_mb: int, labels: bool) -> dict[str, Any]:
    """feedpipe shards of a source dataset (cached), with the expected read totals."""
    from feedpipe.format._index import parse_index

    out = os.path.join(os.path.dirname(info["src"]), f"shards-{shard_mb}mb")
    mpath = os.path.join(out, "manifest.json")
    if not os.path.exists(mpath):
        import feedpipe

        shutil.rmtree(out, ignore_errors=True)
        print(f"  sharding {info['src']} -> {out} ...", flush=True)
        feedpipe.shard(info["src"], out, max_bytes=shard_mb << 20, workers=2,
                       labels_from_dirs=labels, show_progress=False)
    with open(mpath, encoding="utf-8") as f:
        m = json.load(f)
    payload = 0
    for s in m["shards"]:
        stem = s["name"][:-4]
        with open(os.path.join(out, stem + ".idx"), encoding="utf-8") as f:
            payload += sum(parse_index(f.read()).sizes)
    if m["total_samples"] != info["samples"]:
        raise SystemExit(f"{out}: manifest has {m['total_samples']} samples, the source has "
                         f"{info['samples']}; delete {out} and rerun")
    return {"root": out, "shards": len(m["shards"]), "samples": m["total_samples"],
            "file_bytes": sum(s["bytes"] for s in m["shards"]), "payload_bytes": payload,
            "fields": m["fields"], "shard_max_bytes": shard_mb << 20}


def dl_subset(sh: dict[str, Any], cap: int | None) -> dict[str, Any]:
    """The dataset the DataLoader systems read: the first shards of ``sh`` (at least two, so both
    workers get one) holding at least ``cap`` samples; all of it when ``cap`` is None or the
    dataset is small. A subset is a sibling directory of symlinks plus a cut-down manifest, so
    ``FeedDataset`` and ``WebDataset`` read exactly the same files. (DataLoader systems move every
    sample through a pipe and run at a few thousand samples/s here; 200,000 tiny records would
    take ~45 s per run.)"""
    from feedpipe.format._index import parse_index

    with open(os.path.join(sh["root"], "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    keep, total = [], 0
    for rec in m["shards"]:
        if cap is not None and len(keep) >= 2 and total >= cap:
            break
        keep.append(rec)
        total += rec["samples"]
    if len(keep) == len(m["shards"]):
        return {**sh, "subset_of": None}
    out = f"{sh['root']}-first{len(keep)}of{len(m['shards'])}"
    mpath = os.path.join(out, "manifest.json")
    if not os.path.exists(mpath):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out + ".tmp", exist_ok=True)
        for rec in keep:
            stem = rec["name"][:-4]
            for n in (rec["name"], stem + ".idx"):
                os.symlink(os.path.join(sh["root"], n), os.path.join(out + ".tmp", n))
        sub = {**m, "shards": keep, "total_samples": total}
        sub.setdefault("created_by", {})["subset_of"] = sh["root"]
        with open(os.path.join(out + ".tmp", "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(sub, f, indent=1)
        os.replace(out + ".tmp", out)
    payload = 0
    for rec in keep:
        with open(os.path.join(out, rec["name"][:-4] + ".idx"), encoding="utf-8") as f:
            payload += sum(parse_index(f.read()).sizes)
    return {**sh, "root": out, "shards": len(keep), "samples": total,
            "file_bytes": sum(r["bytes"] for r in keep), "payload_bytes": payload,
            "subset_of": sh["root"]}


def _is_dl(system: str) -> bool:
    return system.endswith("dl2") or system == "dl2-null"


def _stats(runs: list[dict[str, Any]], sh: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r and "unavailable" not in r]
    secs = [r["seconds"] for r in ok]
    sps = [sh["samples"] / s for s in secs]
    return {
        "passes_ok": len(ok),
        "passes_failed": sum(1 for r in runs if "error" in r),
        "errors": [r["error"] for r in runs if "error" in r],
        "unavailable": next((r["unavailable"] for r in runs if "unavailable" in r), None),
        "median_seconds": common.median(secs),
        "samples_per_s": common.median(sps),
        "samples_per_s_range": common.spread(sps),
        "payload_mb_per_s": common.median(sh["payload_bytes"] / s / 1e6 for s in secs),
        "file_mb_per_s": common.median(sh["file_bytes"] / s / 1e6 for s in secs),
    }


def _ratio(per_pass: list[dict[str, dict[str, Any]]], stats: dict[str, dict[str, Any]],
           sizes: dict[str, dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    """samples/s of ``num`` over ``den`` (the ratio of file MB/s too: shards are uniform)."""
    a = stats.get(num, {}).get("samples_per_s")
    b = stats.get(den, {}).get("samples_per_s")
    if not a or not b:
        return None
    pp = [(sizes[num]["samples"] / p[num]["seconds"]) / (sizes[den]["samples"] / p[den]["seconds"])
          for p in per_pass
          if all(s in p and "seconds" in p[s] and "error" not in p[s] for s in (num, den))]
    return {"ratio_of_medians": a / b, "median_of_pass_ratios": common.median(pp),
            "pass_ratios": pp}


def _profile(ds: str, sh: dict[str, Any], dl: dict[str, Any], work: str) -> str:
    from profiling import cprofile_summary, have_py_spy, py_spy_summary

    parts = []
    base = {"root": sh["root"], "expected_samples": sh["samples"],
            "expected_payload": sh["payload_bytes"]}
    for system in ("fp-reader", "fp-dataset", "wds"):
        stats = os.path.join(work, f"read-{ds}-{system}.pstats")
        r = common.run_worker(SCRIPT, {**base, "system": system, "cprofile": stats})
        parts.append(f"##### read {ds}: {system}, one epoch under cProfile "
                     f"({r.get('seconds', 0):.2f}s with profiling overhead)\n")
        parts.append(cprofile_summary(stats, top=18) if "seconds" in r else json.dumps(r))
    spy = have_py_spy()
    if spy:
        raw = os.path.join(work, f"read-{ds}-fp-dataset-dl2.pyspy.txt")
        dl_spec = {"root": dl["root"], "expected_samples": dl["samples"],
                   "expected_payload": dl["payload_bytes"], "system": "fp-dataset-dl2"}
        r = common.run_worker(SCRIPT, dl_spec,
                              wrap=[spy, "record", "--subprocesses", "--format", "raw", "-r",
                                    "250", "-o", raw, "--"])
        parts.append(f"##### read {ds}: fp-dataset-dl2, one epoch of {dl['samples']:,} samples "
                     f"under py-spy --subprocesses ({r.get('seconds', 0):.2f}s wall; the whole "
                     "process including imports; py-spy's idle detection is unreliable on this VM, "
                     "so waiting threads may show up)\n")
        parts.append(py_spy_summary(raw, top=15, rate=250) if os.path.exists(raw)
                     else json.dumps(r))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=datasets.DEFAULT_ROOT)
    ap.add_argument("--quick", action="store_true", help="small datasets (see datasets.py)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--datasets", default="images,tiny,big")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--shard-mb", type=int, default=None,
                    help="max shard size in MiB (default 64; 8 with --quick)")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="repeat whole epochs inside one run until this long (default 1.0; 0.3 "
                    "with --quick); "
                    "the figure is seconds per epoch")
    ap.add_argument("--dl-max-samples", type=int, default=None,
                    help="DataLoader systems read only the first shards (at least 2) holding at "
                    "least this many samples (default 50000; 0: everything). Only the tiny "
                    "dataset is cut (to 2 of 5 shards, ~87,000 samples)")
    ap.add_argument("--steady", action="store_true",
                    help="a training loop's steady state: each system's dataset/loader built "
                    "once per process, one untimed warm-up epoch, then the timed epochs over the "
                    "same object (default: a new object and a cold start every epoch)")
    ap.add_argument("--name", default=None,
                    help="results file name (default bench_read, bench_read-quick with --quick)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile fp-reader, fp-dataset and wds under cProfile and "
                    "fp-dataset-dl2 under py-spy (when installed), one epoch each")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(common.load_spec(a.worker))

    name = a.name or "bench_read" + ("-quick" if a.quick else "")
    if a.shard_mb is None:
        a.shard_mb = 8 if a.quick else 64
    if a.dl_max_samples is None:
        a.dl_max_samples = 50_000
    if a.min_seconds is None:
        a.min_seconds = 0.3 if a.quick else 1.0
    systems = a.systems.split(",")
    work = os.path.join(a.root, "work", "read")
    os.makedirs(work, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "read",
        "environment": common.environment(a.root),
        "settings": {"quick": a.quick, "passes": a.passes, "systems": systems, "steady": a.steady,
                     "shard_mb": a.shard_mb, "min_seconds_per_run": a.min_seconds,
                     "dl_max_samples": a.dl_max_samples,
                     "touch": f"zlib.crc32 below {BIG_FIELD} bytes, "
                     "numpy uint8 max at or above (every byte read)",
                     "page_cache": "warm (one untimed cat of the shards before the passes)"},
        "datasets": {},
    }
    failed = False
    t_start = time.perf_counter()
    text_out, profiles = [], []
    for ds in a.datasets.split(","):
        info = datasets.ensure(ds, root=a.root, quick=a.quick)
        sh = ensure_shards(info, a.shard_mb, labels=ds == "images")
        print(f"\n[{ds}] {sh['samples']:,} samples in {sh['shards']} shards, "
              f"{sh['file_bytes'] / 1e6:,.1f} MB ({sh['payload_bytes'] / 1e6:,.1f} MB payload); "
              "warming the page cache ...", flush=True)
        dl = dl_subset(sh, a.dl_max_samples or None)
        if dl["subset_of"]:
            print(f"  DataLoader systems read the first {dl['shards']} of {sh['shards']} shards "
                  f"({dl['samples']:,} samples): {dl['root']}", flush=True)
        sizes = {s_: (dl if _is_dl(s_) else sh) for s_ in systems}
        urls = [p for p, _, _, _ in _manifest_shards(sh["root"])]
        common.warm_files(urls)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        per_pass: list[dict[str, dict[str, Any]]] = []
        unavailable: set[str] = set()
        for p in range(a.passes):
            this: dict[str, dict[str, Any]] = {}
            for system in common.alternating(systems, p):
                if system in unavailable:
                    continue
                z = sizes[system]
                spec = {"system": system, "root": z["root"], "expected_samples": z["samples"],
                        "expected_payload": z["payload_bytes"], "min_seconds": a.min_seconds,
                        "steady": a.steady}
                r = common.run_worker(SCRIPT, spec)
                r["pass"] = p
                r["loadavg_1min_after"] = os.getloadavg()[0]
                this[system] = r
                runs[system].append(r)
                if "unavailable" in r:
                    unavailable.add(system)
                    print(f"  {system:16s} unavailable: {r['unavailable']}", flush=True)
                elif "error" in r:
                    failed = True
                    print(f"  pass {p} {system:16s} FAILED: {r['error']}\n"
                          f"{r.get('stderr_tail', '')}", flush=True)
                else:
                    print(f"  pass {p} {system:16s} {r['seconds']:7.3f}s x{r['epochs']:<2d} "
                          f"{z['samples'] / r['seconds']:12,.0f} samples/s "
                          f"{z['file_bytes'] / r['seconds'] / 1e6:9,.0f} MB/s", flush=True)
            per_pass.append(this)
        stats = {s: _stats(runs[s], sizes[s]) for s in systems}
        ratios: dict[str, Any] = {}
        for num, den in (("fp-reader", "wds"), ("fp-reader-nocopy", "wds"), ("fp-loader", "wds"),
                         ("fp-dataset", "wds"), ("fp-dataset-dl2", "wds-dl2"),
                         ("fp-reader-dl2", "wds-dl2"), ("fp-loader-dl2", "wds-loader-dl2"),
                         ("fp-loader-dl2", "wds-dl2"), ("fp-dataset-dl2", "dl2-null"),
                         ("fp-reader-dl2", "dl2-null"), ("wds-dl2", "dl2-null"),
                         ("fp-reader", "cat"),
                         ("fp-reader-nocopy", "cat"), ("fp-dataset", "cat"),
                         ("fp-reader-dl2", "cat"), ("fp-dataset-dl2", "cat"),
                         ("fp-loader-dl2", "cat"), ("wds", "cat"),
                         ("wds-dl2", "cat")):
            r = _ratio(per_pass, stats, sizes, num, den)
            if r is not None:
                ratios[f"{num}/{den}"] = r
        targets = {}
        for k in ("fp-reader/wds", "fp-dataset/wds", "fp-loader/wds", "fp-reader-dl2/wds-dl2",
                  "fp-dataset-dl2/wds-dl2", "fp-loader-dl2/wds-loader-dl2",
                  "fp-loader-dl2/wds-dl2"):
            if k in ratios:
                v = ratios[k]["ratio_of_medians"]
                targets[k] = {"what": ">= 5x webdataset samples/s", "ratio": v, "met": v >= 5}
        if ds == "big":
            for k in ("fp-reader/cat", "fp-dataset/cat", "fp-reader-dl2/cat",
                      "fp-dataset-dl2/cat", "fp-loader-dl2/cat"):
                if k in ratios:
                    v = ratios[k]["ratio_of_medians"]
                    targets[k] = {"what": ">= 70% of cat MB/s (1 MB samples)", "ratio": v,
                                  "met": v >= 0.7}
        doc["datasets"][ds] = {"info": info, "shards": sh, "dataloader_shards": dl,
                               "systems": stats, "ratios": ratios,
                               "targets": targets, "runs": runs}
        rows = []
        for s, st in stats.items():
            if st["unavailable"]:
                rows.append([s, "n/a", "-", "-", "-", "-", "unavailable"])
                continue
            rng = st["samples_per_s_range"]
            rows.append([s, common.fmt(st["median_seconds"], 2),
                         common.fmt(st["samples_per_s"]),
                         "-" if not rng else f"{rng[0]:,.0f}-{rng[1]:,.0f}",
                         common.fmt(st["payload_mb_per_s"]), common.fmt(st["file_mb_per_s"]),
                         str(st["passes_ok"]) + (f" ({st['passes_failed']} FAILED)"
                                                 if st["passes_failed"] else "")])
        tbl = common.table(rows, ["system", "sec", "samples/s", "range", "payload MB/s",
                                  "file MB/s", "passes"])
        rat = "\n".join(f"  {k:28s} {common.fmt(v['ratio_of_medians'], 2)}x "
                        f"(median of per-pass ratios {common.fmt(v['median_of_pass_ratios'], 2)}x)"
                        for k, v in ratios.items())
        tg = "\n".join(f"  target {k}: {v['what']}: {v['ratio']:.2f}x "
                       f"{'MET' if v['met'] else 'NOT MET'}" for k, v in targets.items())
        load = common.median(r.get("loadavg_1min_after") for rs in runs.values() for r in rs)
        doc["datasets"][ds]["median_loadavg_1min"] = load
        block = (f"\n== read {ds} ({sh['samples']:,} samples, {sh['shards']} shards, "
                 f"{sh['file_bytes'] / 1e6:,.1f} MB), median of {a.passes} passes "
                 f"(1-min load average during the runs: median {common.fmt(load, 1)} on "
                 f"{os.cpu_count()} CPUs)\n"
                 + (f"DataLoader (*-dl2) rows: first {dl['shards']} shards, {dl['samples']:,} "
                    "samples\n" if dl["subset_of"] else "")
                 + f"{tbl}\n"
                 f"ratios (samples/s; for /cat the same as file MB/s):\n{rat}\n{tg}\n")
        print(block, flush=True)
        text_out.append(block)
        if a.profile:
            profiles.append(_profile(ds, sh, dl, work))
    rc = common.finish(name, doc, text_out, profiles, bool(failed), t_start)
    render_results.render(os.path.join(common.RESULTS, name + ".json"), force=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
