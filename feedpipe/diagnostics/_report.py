"""The probe's terminal table: a pure function of the report dict (the same dict ``--json``
writes), so what a person reads and what a machine reads cannot disagree."""

from __future__ import annotations

from typing import Any


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _block(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}" if abs(x) >= 1 else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "unknown" if x is None else f"{100 * x:.0f}%"


def _header(doc: dict[str, Any]) -> list[str]:
    t, env = doc["target"], doc["environment"]
    if t["kind"] == "dataset":
        what = f"shard dataset: {t['shards']} shards, {t['samples']:,} samples"
    elif t["kind"] == "directory":
        what = f"directory: {t['files']:,} files" + (
            "" if t["listing_complete"] else " listed (listing cut short)")
    else:
        what = "single file"
    lines = [f"feedpipe probe  {t['url']}",
             f"  {what}, {_size(t['bytes'])}" + (f"; fields {', '.join(t['fields'])}"
                                                if t["fields"] else "")]
    if t.get("generated"):
        g = t["generated"]
        lines.append(f"  generated {_size(g['bytes'])} in a temp dir ({_num(g['mb_per_s'])} MB/s "
                     "written, fsync'ed); deleted afterwards")
    fs, mem = env.get("filesystem", {}), env.get("memory", {})
    where = (f"{fs.get('type')} on {fs.get('device')} ({fs.get('mount_point')})"
             if not fs.get("remote") else f"remote ({fs.get('type')}://)")
    ram = (f", {_size(mem['total_bytes'])} RAM ({_size(mem.get('available_bytes', 0))} available)"
           if mem.get("total_bytes") else "")
    lines.append(f"  {where}, {env.get('cpu_affinity') or env.get('cpu_count')} CPUs{ram}")
    pc = doc["storage"]["page_cache"]
    if pc.get("remote"):
        lines.append("  page cache: not applicable (remote reads; server-side caching unknown)")
    else:
        hot = pc.get("resident_at_start")
        state = ("" if hot is None else " (hot)" if hot > 0.9 else " (cold)" if hot < 0.1
                 else " (partly hot)")
        after = _pct(pc.get("resident_after_drop"))
        cold = (f"cold figures after posix_fadvise(DONTNEED), {after} "
                "resident after the drop" if pc.get("can_drop") else "cold figures unavailable "
                "(no posix_fadvise)")
        lines.append(f"  page cache: {_pct(hot)} of the probed data resident at start{state}; "
                     f"{cold}")
    for note in t.get("notes", []):
        lines.append(f"  note: {note}")
    return lines


def _storage(doc: dict[str, Any]) -> list[str]:
    st = doc["storage"]
    lines: list[str] = []
    seq = st["sequential"]
    if seq["cells"]:
        threads = sorted({c["threads"] for c in seq["cells"]})
        head = "".join(f"{f'{t} thr':>10}" for t in threads)
        lines += ["", f"Sequential read, MB/s{'':13}{head}"]
        for cache in ("cold", "warm", "remote"):
            cells = [c for c in seq["cells"] if c["cache"] == cache]
            for i, b in enumerate(sorted({c["block_bytes"] for c in cells})):
                row = {c["threads"]: c["mb_per_s"] for c in cells if c["block_bytes"] == b}
                label = cache if i == 0 else ""
                lines.append(f"  {label:<8}{_block(b):>10}{'':14}"
                             + "".join(f"{_num(row.get(t)):>10}" for t in threads))
    elif seq.get("skipped"):
        lines += ["", f"Sequential read: skipped ({seq['skipped']})"]
    if st.get("small_files"):
        runs = [r for rs in st["small_files"].values() for r in rs]
        parts = [f"{r['cache']}, {r['threads']} thr: {_num(r['files_per_s'])} files/s, "
                 f"{_num(r['mb_per_s'])} MB/s" for r in runs]
        lines.append(f"Small files (open+read+close, mean {_size(runs[0]['mean_file_bytes'])}): ")
        lines += [f"  {x}" for x in parts]
    if st.get("random_read"):
        rr = st["random_read"]
        parts = [f"{k} p50 {v['p50_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms ({v['reads']:,} reads)"
                 for k, v in rr.items() if v]
        blk = next(iter(rr.values()))["block_bytes"]
        lines.append(f"Random {_block(blk)} reads (1 thread): " + "; ".join(parts))
    link = st.get("link")
    if link:
        lines.append(f"Link (as the L1 cache fetches): {link['latency_s'] * 1e3:.0f} ms to a "
                     f"first byte; {_num(link['one_stream_mb_per_s'])} MB/s on one range read, "
                     f"{_num(link['aggregate_mb_per_s'])} MB/s with {link['streams']} at once")
        if link.get("cold_epoch_s"):
            lines.append(f"  a cold epoch of this dataset needs about {link['cold_epoch_s']:.3g}"
                         " s of this link (its bytes at that rate, plus one round trip)")
    return lines


def _pipeline(doc: dict[str, Any]) -> list[str]:
    v, pl = doc["verdict"], doc.get("pipeline")
    p = v["parallelism"]
    lines = ["", f"Stage             samples/s, 1 core   with {p} worker{'s' if p > 1 else ''}"]
    per_core = {k: (pl.get(k) or {}).get("samples_per_s") if pl else None
                for k in ("read", "decode", "batch")}
    names = {"storage": "storage", "read": "read", "decode": "decode", "batch": "batch",
             "h2d": "host-to-device"}
    for k, label in names.items():
        cap = v["stage_samples_per_s"].get(k)
        mark = "   <- bounds" if v["bounding_stage"] == k else ""
        if k == "storage":
            extra = f"   ({doc['storage'].get('basis') or 'not measured'})"
            lines.append(f"  {label:<16}{'':>17}   {_num(cap):>14}{mark}{extra}")
        elif k == "h2d":
            h = pl.get("h2d") if pl else None
            if h:
                lines.append(f"  {label:<16}{'':>17}   {_num(cap):>14}{mark}   (pinned "
                             f"{h['pinned_gb_per_s']:.1f} GB/s, pageable "
                             f"{h['pageable_gb_per_s']:.1f} GB/s)")
            else:
                lines.append(f"  {label:<16}{'n/a (no CUDA device)':>17}")
        else:
            lines.append(f"  {label:<16}{_num(per_core[k]):>17}   {_num(cap):>14}{mark}")
    batch = (pl or {}).get("batch") or {}
    if batch.get("tensors"):
        tensors = batch["tensors"]
        shown = {k: v for k, v in tensors.items() if not k.startswith("__")} or tensors
        lines.append("Batches stacked: " + ", ".join(f"{k} {v}" for k, v in shown.items())
                     + f" ({_size(batch['tensor_bytes'])} per batch)")
    if pl and pl.get("loader"):
        parts = [f"{r['workers']} workers: " + (_num(r.get("samples_per_s")) + "/s"
                                                if "error" not in r else "error")
                 for r in pl["loader"]]
        lines.append("FeedLoader measured (read+decode+batch): " + ", ".join(parts))
    for note in (pl or {}).get("notes", []):
        lines.append(f"  note: {note}")
    return lines


def _cold_warm(v: dict[str, Any]) -> str:
    """Which sequential rate the storage verdict quotes, and the other beside it."""
    cold, warm = v.get("storage_cold_mb_per_s"), v.get("storage_warm_mb_per_s")
    if cold is None or v["bounding_stage"] != "storage":
        return ""
    beside = f"; warm, from the page cache: {_num(warm)} MB/s" if warm is not None else ""
    return f" (cold: the device's reads, pages dropped{beside})"


def _accounts(doc: dict[str, Any]) -> list[str]:
    """The loader a script gets, per route: its per-part times, bound and bytes per epoch."""
    runs = (doc.get("pipeline") or {}).get("accounts") or []
    lines: list[str] = []
    for r in runs:
        if "error" in r:
            lines.append(f"  route {r['asked']}: cannot serve ({r['error']})")
            continue
        t = r["time"]
        parts = ", ".join(f"{k} {t[k]:.3f} s" for k in ("startup", "fetch", "compute", "sink",
                                                        "wait", "step") if k in t)
        then = (f" (then {r['loop_bound']}, once started)"
                if r["bound"] == "startup" and r.get("loop_bound") else "")
        lines.append(f"  route {r['route']}" + (" (its choice)" if r["asked"] == "auto" else "")
                     + f": {_num(r['samples_per_s'])} samples/s, bound: {r['bound']}{then}; "
                     f"{parts} of {t['wall']:.3f} s ({t['parts_in']})")
        for key in ("workers_note", "slower_note"):
            if r.get(key):
                lines.append(f"    why: {r[key]}")
        io = r.get("io_per_epoch")
        if io is not None:
            remote = io["remote"]
            cost = (f", about {r['cost_per_epoch']:,.4g} per epoch"
                    if r.get("cost_per_epoch") is not None else "")
            lines.append(f"    per epoch: {_size(io['local_bytes'])} read from local shards, "
                         f"{remote['requests']:,} remote requests, {_size(remote['bytes'])} "
                         f"remote{cost}; L1 {io['l1']['hits']} hits, {io['l1']['misses']} "
                         f"misses" + ("" if r["epoch_fraction"] >= 1 else
                                      f" (scaled from {100 * r['epoch_fraction']:.0f}% of one)"))
    if lines:
        lines.insert(0, "FeedLoader as a script gets it (stats()['time'], ['bound'], ['io']):")
    return lines


def table(doc: dict[str, Any]) -> str:
    """The human-readable report."""
    v = doc["verdict"]
    stages = _pipeline(doc) if doc["target"]["kind"] != "file" else []
    lines = _header(doc) + _storage(doc) + stages + _accounts(doc) + [""]
    part = v.get("bounding_part")
    named = (f"{part} (the {v['bounding_stage']} stage) bounds"
             if part and part != v["bounding_stage"] else f"{v['bounding_stage']} bounds")
    if v["bounding_stage"] is None:
        lines.append("Verdict: not enough figures to name a bounding stage")
    elif v["ceiling_samples_per_s"] is not None:
        mb = f" ({_num(v['ceiling_mb_per_s'])} MB/s)" if v["ceiling_mb_per_s"] else ""
        lines.append(f"Verdict: {named}; ceiling about "
                     f"{_num(v['ceiling_samples_per_s'])} samples/s{mb} with "
                     f"{v['parallelism']} worker process(es)")
    else:
        lines.append(f"Verdict: {named} at {_num(v['ceiling_mb_per_s'])} MB/s" + _cold_warm(v))
    if v.get("bound_basis") and v["bounding_stage"] is not None:
        lines.append(f"  decided by {v['bound_basis']}")
    if v.get("parallelism_note"):
        lines.append(f"  workers: {v['parallelism_note']}")
    if v["measured_loader_samples_per_s"]:
        lines.append(f"  measured FeedLoader best: {_num(v['measured_loader_samples_per_s'])} "
                     f"samples/s with num_workers={v['measured_loader_workers']} (the ceiling "
                     "leaves out per-batch hand-over costs)")
    s = doc["settings"]
    if v["accelerator_utilisation"] is not None:
        lines.append(f"  accelerator utilisation at {s['step_time_ms']:g} ms/step, batch "
                     f"{s['batch_size']}: {_pct(v['accelerator_utilisation'])}")
    lines.append("Advice:")
    lines += [f"  * {a}" for a in v["advice"]]
    lines.append(f"({doc['elapsed_s']:.1f} s; --json or --json-out FILE for every figure)")
    return "\n".join(lines)
