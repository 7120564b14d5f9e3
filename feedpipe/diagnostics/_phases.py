"""The measurement phases of ``feedpipe probe``, in the order they run, and the translation of
their figures into the verdict's :class:`~feedpipe.diagnostics._verdict.Figures`.

Order matters. The cold sequential sweep runs first, before anything this probe does warms the
page cache. Then come the warm sweep, small files and random reads. On datasets the pipeline
stages follow, then the FeedLoader worker scaling (workers are forked), and only then
host-to-device (the first CUDA call).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..format._manifest import dataset_root
from . import _pagecache as pagecache
from . import _storage as storage
from ._accounts import script_loader
from ._target import Target
from ._verdict import Figures

if TYPE_CHECKING:
    from ._settings import ProbeSettings


class Phases:
    """Times each phase and moves the progress bar."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.done: list[dict[str, Any]] = []

    def extend(self, n: int) -> None:
        """``n`` more phases than planned."""
        if getattr(self.bar, "total", None) is not None:
            self.bar.total += n
            self.bar.refresh()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.bar.set_postfix_str(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.done.append({"name": name, "seconds": round(time.perf_counter() - t0, 6)})
            self.bar.update(1)


def _drop_files(files: storage.FileSet) -> None:
    for path in files.paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            pagecache.drop_fd(fd)
        finally:
            os.close(fd)


def storage_phases(t: Target, seq: Any, small: Any, s: ProbeSettings, can_drop: bool,
                   mem_avail: int, p: int, phase: Phases) -> dict[str, Any]:
    d = s.duration
    probed = seq if seq is not None else small
    pc: dict[str, Any] = {"remote": not t.local, "can_drop": can_drop,
                          "method": "posix_fadvise(POSIX_FADV_DONTNEED) on the probed files"
                          if can_drop else None,
                          "resident_at_start": pagecache.resident_fraction(probed.pairs())
                          if t.local and probed is not None else None,
                          "resident_after_drop": None, "resident_before_warm": None,
                          "warm_window_bytes": None}
    out: dict[str, Any] = {"page_cache": pc, "basis": None,
                           "sequential": {"cells": [], "skipped": None},
                           "small_files": None, "random_read": None}
    cells = out["sequential"]["cells"]
    window = None
    if seq is None:
        out["sequential"]["skipped"] = (f"no file of {1 << 20:,} bytes or more: see small files, "
                                        "or probe --generate SIZE")
    elif not t.local:
        with phase("sequential read (remote)"):
            cells += storage.sequential_sweep(seq, s.block_sizes, s.threads, d, cold=True)
    else:
        if can_drop:
            with phase("sequential read, cold"):
                _drop_files(seq)
                pc["resident_after_drop"] = pagecache.resident_fraction(seq.pairs())
                cells += storage.sequential_sweep(seq, s.block_sizes, s.threads, d, cold=True)
        with phase("sequential read, warm"):
            window = min(seq.total, max(16 << 20, mem_avail // 2)) if mem_avail else seq.total
            if (pagecache.resident_fraction(seq.pairs(), limit=window) or 0) < 0.99:
                window = storage.warm_up(seq, window, d) or window
            pc["resident_before_warm"] = pagecache.resident_fraction(seq.pairs(), limit=window)
            pc["warm_window_bytes"] = window
            cells += storage.sequential_sweep(seq, s.block_sizes, s.threads, d, cold=False,
                                              window=window)
    if small is not None:
        out["small_files"] = _small_phases(t, small, d, can_drop, p, phase)
        after = out["small_files"].pop("resident_after_drop", None)
        if pc["resident_after_drop"] is None:
            pc["resident_after_drop"] = after
    if not t.local and seq is not None:
        from . import _link as link

        phase.extend(1)
        with phase("the link (remote): latency, one and several range reads"):
            out["link"] = link.measure(seq, d)
            if t.kind == "dataset":
                out["link"]["cold_epoch_s"] = link.cold_epoch_s(out["link"], t.total_bytes)
    rset = seq if seq is not None else storage.FileSet(small.paths[:256], small.sizes[:256],
                                                       small.store)
    with phase("random reads"):
        rr: dict[str, Any] = {}
        if not t.local:
            rr["remote"] = storage.random_reads(rset, s.random_block, d, cold=False)
        else:
            if can_drop:
                rr["cold"] = storage.random_reads(rset, s.random_block, d / 2, cold=True)
            rwin = window if rset is seq and window else rset.total
            if (pagecache.resident_fraction(rset.pairs(), limit=rwin) or 0) < 0.99:
                rwin = storage.warm_up(rset, rwin, d / 4) or rwin
            rr["warm"] = storage.random_reads(rset, s.random_block, d / 2, cold=False, window=rwin)
        out["random_read"] = rr
    return out


def _small_phases(t: Target, small: storage.FileSet, d: float, can_drop: bool, p: int,
                  phase: Phases) -> dict[str, Any]:
    """Small files at 1 thread and at ``p`` threads (the worker count), cold and warm."""
    counts = sorted({1, p})
    res: dict[str, Any] = {}
    if not t.local:
        with phase("small files (remote)"):
            res["remote"] = [storage.small_files(small, d / len(counts), cold=False, threads=n)
                             for n in counts]
        return res
    if can_drop:
        with phase("small files, cold"):
            sample = storage.FileSet(small.paths[:256], small.sizes[:256])
            _drop_files(sample)
            res["resident_after_drop"] = pagecache.resident_fraction(sample.pairs())
            res["cold"] = [storage.small_files(small, d / len(counts), cold=True, threads=n)
                           for n in counts]
        read = max(r["files"] for r in res["cold"])
    with phase("small files, warm"):
        if not can_drop:
            read = storage.small_files(small, d / 2, cold=False)["files"]
        warm = storage.FileSet(small.paths[:read], small.sizes[:read], small.store)
        res["warm"] = [storage.small_files(warm, d / len(counts), cold=False, threads=n)
                       for n in counts]
    return res


def dataset_pipeline(t: Target, s: ProbeSettings, decode_fn: Any, loaders: list[int],
                     phase: Phases, workers: int = 1, cpus: int = 1) -> dict[str, Any]:
    """The stages measured alone, the FeedLoader at each of ``loaders`` worker counts, then the
    loader a script gets (with ``workers`` processes; each of ``s.routes``) and its accounts,
    each saying why where it ran fewer workers than asked for or fell far below the best
    scaling run."""
    from . import _accounts as accounts
    from . import _pipeline as pipeline

    d = s.duration
    out: dict[str, Any] = {"read": None, "decode": None, "batch": None, "loader": [],
                           "accounts": [], "h2d": None, "cuda": None, "notes": []}
    manifest = t.manifest
    if manifest is None:
        raise TypeError(f"{t.url}: not a dataset target")
    src = t.root if t.local else dataset_root(t.url)  # what ShardReader and FeedDataset take
    with phase("read"):
        before = pagecache.resident_fraction(t.files) if t.local else None
        out["read"], kept = pipeline.read_stage(src, manifest, d)
        out["read"]["resident_before"] = before
    decoded = kept
    skipped = decode_fn.skipped if isinstance(decode_fn, pipeline.ImageDecode) else []
    if skipped:
        out["notes"].append(f"{', '.join(skipped)} not decoded: no library here decodes that "
                            "format (pip install 'feedpipe[images]'); the decode and batch "
                            "figures leave those images out")
    if decode_fn is not None:
        with phase("decode"):
            out["decode"], decoded = pipeline.decode_stage(kept, decode_fn, d)
    else:
        missing = pipeline.ImageDecode(t.fields).skipped if decode_fn is None else []
        why = (f" ({', '.join(missing)}: no library here decodes that format; pip install "
               "'feedpipe[images]')" if missing else "")
        out["notes"].append(f"no image field decodable here{why}: decode stage not measured "
                            "(pass decode= to measure your own decoder)")
    collate, note = pipeline.choose_collate(decoded, s.batch_size)
    if note:
        out["notes"].append(note)
    with phase("batch"):
        out["batch"] = pipeline.batch_stage(decoded, collate, s.batch_size, d)
    for w in loaders:  # before any CUDA call: workers are forked
        with phase(f"loader, {w} workers"):
            out["loader"].append(pipeline.loader_stage(src, decode_fn, collate, s.batch_size,
                                                       w, d))
    for route in s.routes:
        with phase(f"FeedLoader route {route or 'auto'}, its accounts"):
            out["accounts"].append(accounts.run_loader(
                src, route, decode=decode_fn, collate=collate, batch_size=s.batch_size,
                workers=workers, seconds=d, samples=t.samples or 0,
                price_per_gb=s.price_per_gb, price_per_1k_requests=s.price_per_1k_requests))
    for run in out["accounts"]:
        if "error" in run:
            continue
        if run["parts"]["executor"] == "workers":
            fewer = accounts.fewer_workers(s.workers, run["workers"], cpus)
            if fewer:
                run["workers_note"] = fewer
        slower = accounts.slower_than_best(run, out["loader"])
        if slower:
            run["slower_note"] = slower
    # CUDA is asked about after the loader stages, so that they measure a process (and forked
    # workers) that never touched CUDA, as a CPU-only storage check runs
    import torch

    out["cuda"] = cuda = torch.cuda.is_available()
    if cuda:
        phase.extend(1)
        per_sample = (out["decode"] or {}).get("output_bytes_per_sample") or (
            out["read"]["bytes"] / max(1, out["read"]["samples"]))
        with phase("host-to-device"):
            out["h2d"] = pipeline.h2d_stage(int(per_sample * s.batch_size), d)
        if out["h2d"]:
            out["h2d"]["bytes_per_sample"] = per_sample
    return out


def directory_pipeline(small: storage.FileSet, decode_fn: Any, custom: bool, d: float,
                       phase: Phases) -> dict[str, Any] | None:
    """Decode alone, on up to 256 of the directory's files (image files this machine decodes,
    unless ``custom``)."""
    from ..format._keys import split_source
    from . import _pipeline as pipeline

    samples = []
    decodable = set(pipeline.ImageDecode(list(pipeline.IMAGE_FORMATS)).fields)
    for path in small.paths:
        stem, ext = split_source(path)
        if custom or ext.lower() in decodable:
            try:
                with open(path, "rb") if small.store is None else small.store.open(path) as f:
                    samples.append({"__key__": stem, ext: f.read()})
            except OSError:
                continue
        if len(samples) >= 256:
            break
    if not samples:
        return None
    if not custom:
        decode_fn = pipeline.ImageDecode([next(k for k in s if k != "__key__") for s in samples])
    with phase("decode"):
        fig, _ = pipeline.decode_stage(samples, decode_fn, d)
    note = ("a directory: only decoding is measured (reading is the small-file figure); shard "
            "it to measure the reader, batching and the loader")
    return {"read": None, "decode": fig, "batch": None, "loader": [], "h2d": None, "cuda": None,
            "notes": [note]}


def _script_figures(pl: dict[str, Any] | None) -> tuple[str | None, dict[str, float]]:
    """What the loader a script gets spent most in (start-up apart: the steady state's part;
    ``None`` where its bound was the step, which the probe's loop does not take) and its part
    times."""
    script = script_loader((pl or {}).get("accounts") or [])
    if script is None:
        return None, {}
    bound = script["loop_bound"] if script["bound"] != "step" else None
    times = {k: v for k, v in script.get("time", {}).items() if isinstance(v, (int, float))}
    return bound, times


def figures(t: Target, st: dict[str, Any], pl: dict[str, Any] | None, s: ProbeSettings,
            cpus: int, workers: int, p: int, fits: bool, cuda: bool) -> Figures:
    from ._pipeline import jpeg_fields

    def state_of(has_cold: bool) -> str:
        # what later epochs see: the page cache keeps a dataset that fits in memory warm
        return "remote" if not t.local else "warm" if fits or not has_cold else "cold"

    def best_of(state: str) -> dict[str, Any] | None:
        sel = [c for c in cells if c["cache"] == state]
        fit = [c for c in sel if c["threads"] <= p] or [c for c in sel if c["threads"] == min(
            (c["threads"] for c in sel), default=0)]
        return storage.best(fit)

    cells = st["sequential"]["cells"]
    # the storage stage is the device's (cold) rate where it was measured, the warm (page
    # cache) rate beside it: a warm figure is the memory's speed, not the storage's
    state = "remote" if not t.local else "cold" if any(
        c["cache"] == "cold" for c in cells) else "warm"
    seq_best = best_of(state)
    cold_best, warm_best = best_of("cold"), best_of("warm")
    samples = t.samples
    sps = mb = None
    basis = ""
    small_rate = small_mb = mean_file = None
    if st.get("small_files"):
        sf_state = state_of("cold" in st["small_files"])
        runs = st["small_files"][sf_state]
        one, many = runs[0], max(runs, key=lambda r: r["threads"])
        small_rate, small_mb = one["files_per_s"], one["mb_per_s"]
        mean_file = one["mean_file_bytes"]
    if t.kind == "directory" and st.get("small_files"):
        files_per_sample = len(t.files) / samples if samples else 1.0
        sps, mb = many["files_per_s"] / files_per_sample, many["mb_per_s"]
        basis = (f"small files, {sf_state}, {many['threads']} thread(s), "
                 f"{files_per_sample:.2f} files per sample")
    elif seq_best is not None:
        mb = seq_best["mb_per_s"]
        if samples:
            sps = mb * 1e6 / (t.total_bytes / samples)
        basis = (f"sequential, {state}, {seq_best['threads']} thread(s), "
                 f"{seq_best['block_bytes'] >> 10} KiB blocks")
    st["basis"] = basis or None

    def rate(stage: str) -> float | None:
        return (pl.get(stage) or {}).get("samples_per_s") if pl else None

    h2d = pl.get("h2d") if pl else None
    h2d_sps = (h2d["pinned_gb_per_s"] * 1e9 / h2d["bytes_per_sample"]
               if h2d and h2d.get("bytes_per_sample") else None)
    best_seq_all = storage.best([c for c in cells if c["cache"] == state])
    loader_bound, loader_time = _script_figures(pl)
    return Figures(
        kind=t.kind, target=t.url, cpus=cpus, workers=workers, batch_size=s.batch_size,
        storage=sps, storage_mb_per_s=mb, storage_basis=basis,
        read=rate("read"), decode=rate("decode"), batch=rate("batch"), h2d=h2d_sps,
        h2d_pinned_gb_per_s=h2d["pinned_gb_per_s"] if h2d else None,
        h2d_pageable_gb_per_s=h2d["pageable_gb_per_s"] if h2d else None,
        loader={r["workers"]: r["samples_per_s"] for r in (pl or {}).get("loader", [])
                if r.get("samples_per_s")},
        small_files_per_s=small_rate, small_file_mb_per_s=small_mb, mean_file_bytes=mean_file,
        sequential_mb_per_s=best_seq_all["mb_per_s"] if best_seq_all else None,
        jpeg=bool(jpeg_fields(t.fields)), remote=not t.local, fits_in_memory=fits, cuda=cuda,
        step_time_ms=s.step_time_ms,
        cold_mb_per_s=cold_best["mb_per_s"] if cold_best else None,
        warm_mb_per_s=warm_best["mb_per_s"] if warm_best else None,
        loader_bound=loader_bound, loader_time=loader_time, link=st.get("link"),
        dataset_bytes=t.total_bytes if t.kind == "dataset" else None)
