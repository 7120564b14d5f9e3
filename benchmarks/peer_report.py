"""bench_peers.py's summary (medians, ratios to the fastest peer, issue 8's bars) and its
Markdown tables. Pure functions of the results document."""

from __future__ import annotations

from typing import Any

import common

FP = ("feedpipe", "feedpipe-store", "feedpipe-threads")
LABEL = {"feedpipe": "feedpipe", "feedpipe-store": "feedpipe + decoded store",
         "feedpipe-threads": "feedpipe, transform threads",
         "files": "PyTorch DataLoader, files", "wds": "webdataset", "wids": "wids",
         "mosaic": "MosaicML Streaming", "litdata": "LitData", "dali": "DALI (CPU)"}


def _ok(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "error" not in r and "unavailable" not in r]


def _why(runs: list[dict[str, Any]]) -> str | None:
    for r in runs:
        if "unavailable" in r:
            return "pending: " + r["unavailable"]
    for r in runs:
        if "error" in r:
            return "error: " + r["error"]
    return None


def _convert(ds: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    derived = {"wds": ("wds", None), "wids": ("wds", "wids_index_seconds"),
               "dali": ("wds", "dali_index_seconds"), "feedpipe": ("feedpipe", None),
               "mosaic": ("mosaic", None), "litdata": ("litdata", None)}
    for s, (src, extra) in derived.items():
        rs = runs.get(src, [])
        ok = _ok(rs)
        secs = [r["seconds"] + (r.get(extra) or 0 if extra else 0) for r in ok]
        m = common.median(secs)
        out[s] = {"seconds": m, "files_per_s": ds["files"] / m if m else None,
                  "passes_ok": len(ok), "why": None if ok else _why(rs) or "not run"}
        if s == "dali" and ok and ok[0].get("dali_index_error"):
            out[s]["why"] = ok[0]["dali_index_error"]
    out["files"] = {"seconds": 0.0, "files_per_s": None, "why": "reads the source files as is"}
    return out


def _epoch_stats(runs: list[dict[str, Any]], e: int | None,
                 mean_bytes: float | None) -> dict[str, Any]:
    """Median over passes of epoch ``e``'s steady rate (``None``: each pass's median epoch)."""
    ok = [r for r in _ok(runs) if e is None or len(r["epochs"]) > e]

    def eps(r: dict[str, Any]) -> list[dict[str, Any]]:
        return r["epochs"] if e is None else [r["epochs"][e]]

    rate = [common.median(x["steady_samples"] / x["steady_seconds"] for x in eps(r)
                          if x["steady_seconds"] > 0) for r in ok]
    whole = [common.median(x["samples"] / x["seconds"] for x in eps(r)) for r in ok]
    m = common.median(rate)
    return {"samples_per_s": m, "samples_per_s_range": common.spread(rate),
            "epoch_samples_per_s": common.median(whole),
            "mb_per_s": m * mean_bytes / 1e6 if m and mean_bytes else None,
            "peak_rss_bytes": common.median(r["memory"]["peak_rss_bytes"] for r in ok),
            "peak_pss_bytes": common.median(r["memory"]["peak_pss_bytes"] for r in ok),
            "passes_ok": len(ok), "why": None if ok else _why(runs) or "not run"}


def _ratios(col: dict[str, dict[str, Any]], key: str, lowest: bool = False) -> str | None:
    peers = {s: v[key] for s, v in col.items() if s not in FP and v.get(key)}
    if not peers:
        return None
    best = (min if lowest else max)(peers, key=peers.__getitem__)
    for v in col.values():
        v[f"{key}_ratio"] = v[key] / peers[best] if v.get(key) else None
    return best


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    summ: dict[str, Any] = {}
    for ds, runs in doc["runs"].items():
        info = doc["datasets"][ds]
        mean_bytes = info["expected"]["bytes"] / info["expected"]["samples"]
        s: dict[str, Any] = {}
        if "convert" in runs:
            s["convert"] = _convert(info, runs["convert"])
            s["convert_fastest_peer"] = _ratios(s["convert"], "files_per_s")
        for nw in (0, 2):
            if f"read-nw{nw}" in runs:
                col = {k: _epoch_stats(v, None, mean_bytes)
                       for k, v in runs[f"read-nw{nw}"].items()}
                s[f"read-nw{nw}"] = col
                s[f"read-nw{nw}_fastest_peer"] = _ratios(col, "samples_per_s")
            if f"decode-nw{nw}" in runs:
                for e, name in ((0, "decode"), (1, "second")):
                    col = {k: _epoch_stats(v, e, None) for k, v in runs[f"decode-nw{nw}"].items()}
                    s[f"{name}-nw{nw}"] = col
                    s[f"{name}-nw{nw}_fastest_peer"] = _ratios(col, "samples_per_s")
                    if e == 0:
                        s[f"memory-nw{nw}_lowest_peer"] = _ratios(col, "peak_rss_bytes", True)
        if "ceil" in runs:
            c = {}
            for which, rs in runs["ceil"].items():
                ok = _ok(rs)
                secs = common.median(r["seconds"] for r in ok)
                c[which] = {"seconds": secs, "why": None if ok else _why(rs)}
                if secs and which in ("cat", "pyread"):
                    c[which]["mb_per_s"] = rs[0]["file_bytes"] / secs / 1e6
                    c[which]["samples_per_s"] = info["samples"] / secs
                elif secs:
                    c[which]["images_per_s"] = ok[0]["images"] / secs
            s["ceil"] = c
        summ[ds] = s
    summ["bars"] = bars(summ)
    return summ


def bars(summ: dict[str, Any]) -> list[dict[str, Any]]:
    out = []

    def bar(name: str, col: dict[str, Any] | None, key: str, fp: str, peer: str | None,
            need: float, lowest: bool = False) -> None:
        if not col:
            return
        v = col.get(fp, {})
        mine, why = v.get(key), v.get("why")
        other = col.get(peer, {}).get(key) if peer else None
        ratio = mine / other if mine and other else None
        if lowest:
            met = None if ratio is None else ratio <= need
        else:
            met = None if ratio is None else ratio >= need
        out.append({"bar": name, "feedpipe": mine, "peer": peer, "peer_value": other,
                    "ratio": ratio, "need": need, "met": met, "why": why})

    for ds, s in summ.items():
        if ds == "bars":
            continue
        if "convert" in s:
            bar(f"conversion {ds}: files/s >= 2x fastest peer", s["convert"], "files_per_s",
                "feedpipe", s.get("convert_fastest_peer"), 2)
        for nw in (0, 2):
            col = s.get(f"read-nw{nw}")
            if col:
                bar(f"raw read {ds}, {nw} workers: >= 2x fastest peer", col, "samples_per_s",
                    "feedpipe", s.get(f"read-nw{nw}_fastest_peer"), 2)
                bar(f"raw read {ds}, {nw} workers: >= 5x webdataset", col, "samples_per_s",
                    "feedpipe", "wds", 5)
            col = s.get(f"decode-nw{nw}")
            if col:
                bar(f"decode {ds}, {nw} workers: >= 2x fastest peer", col, "samples_per_s",
                    "feedpipe", s.get(f"decode-nw{nw}_fastest_peer"), 2)
                second = dict(s.get(f"second-nw{nw}") or {})
                peer = s.get(f"decode-nw{nw}_fastest_peer")
                second["_peer_first"] = {"samples_per_s": col.get(peer, {}).get("samples_per_s")}
                bar(f"second epoch {ds}, {nw} workers, decoded store: >= 10x fastest peer's "
                    "first epoch", second, "samples_per_s", "feedpipe-store", "_peer_first", 10)
                out[-1]["peer"] = peer
                bar(f"memory {ds}, {nw} workers: peak RSS <= lowest peer + 20%", col,
                    "peak_rss_bytes", "feedpipe", s.get(f"memory-nw{nw}_lowest_peer"), 1.2,
                    lowest=True)
                if col.get("feedpipe-threads"):  # the same bars with N threads for N workers
                    bar(f"decode {ds}, {nw} transform threads: >= 2x fastest peer", col,
                        "samples_per_s", "feedpipe-threads",
                        s.get(f"decode-nw{nw}_fastest_peer"), 2)
                    bar(f"memory {ds}, {nw} transform threads: peak RSS <= lowest peer + 20%",
                        col, "peak_rss_bytes", "feedpipe-threads",
                        s.get(f"memory-nw{nw}_lowest_peer"), 1.2, lowest=True)
    return out


def _cell(v: dict[str, Any] | None, key: str, scale: float = 1, digits: int = 0,
          ratio: bool = True) -> str:
    if not v:
        return "-"
    if v.get(key) is None:
        why = v.get("why") or "-"
        return "pending" if why.startswith("pending") else ("error" if why.startswith("error")
                                                           else "n/a")
    txt = common.fmt(v[key] / scale, digits)
    r = v.get(f"{key}_ratio")
    return f"{txt} ({r:.2f}x)" if ratio and r is not None else txt


def markdown(doc: dict[str, Any]) -> str:
    summ = doc["summary"]
    env = doc["environment"]
    systems = ["feedpipe", "feedpipe-store", "feedpipe-threads", "files", "wds", "wids", "mosaic",
               "litdata", "dali"]
    lines = [f"Measured {env['date_utc']} on {env['cpu_model']} ({env['cpu_affinity']} cores), "
             f"{env['memory'].get('MemTotal_bytes', 0) / 2**30:.0f} GiB RAM, {env['platform']}, "
             f"Python {env['python']}, torch {env['versions'].get('torch')}; load average "
             f"{env['loadavg_at_start'][0]:.2f} at start, {env['loadavg_at_end'][0]:.2f} at end; "
             f"git {str(env['git']['revision'])[:10]}{' (dirty)' if env['git']['dirty'] else ''}."
             f" Median of {doc['passes']} passes, each system-pass a fresh process; "
             "in parentheses: the ratio to the fastest peer (feedpipe rows excluded from 'peer').",
             ""]
    ds_names = list(summ.keys() - {"bars"})
    ds_names.sort()
    n = {ds: doc["datasets"][ds]["samples"] for ds in ds_names}
    head = "| system |"
    if any("convert" in summ[d] for d in ds_names):
        lines += ["**Conversion, source files/s** (" + ", ".join(
            f"{ds}: {doc['datasets'][ds]['files']:,} files" for ds in ds_names) + ")", "",
                  head + "".join(f" {ds} |" for ds in ds_names), "|---|" + "---:|" * len(ds_names)]
        for s in systems:
            if s in ("feedpipe-store", "feedpipe-threads"):
                continue
            lines.append(f"| {LABEL[s]} |" + "".join(
                f" {_cell(summ[d].get('convert', {}).get(s), 'files_per_s')} |"
                for d in ds_names))
        lines.append("")
    cols = [(d, nw) for d in ds_names for nw in (0, 2) if f"read-nw{nw}" in summ[d]]
    if cols:
        check = doc.get("environment", {}).get("read_check", "zlib.crc32")
        lines += ["**Raw read, samples/s** (shuffled epoch, batches of 256, every byte "
                  f"hash-checked with {check}; MB/s of payload below)", "",
                  head + "".join(f" {d} ({n[d]:,}), {nw} workers |" for d, nw in cols),
                  "|---|" + "---:|" * len(cols)]
        for s in systems:
            if s in ("feedpipe-store", "feedpipe-threads"):
                continue
            lines.append(f"| {LABEL[s]} |" + "".join(
                f" {_cell(summ[d][f'read-nw{nw}'].get(s), 'samples_per_s')} |"
                for d, nw in cols))
        lines.append("| *MB/s: feedpipe / fastest peer* |" + "".join(
            f" {_cell(summ[d][f'read-nw{nw}'].get('feedpipe'), 'mb_per_s', ratio=False)} / "
            f"{_cell(summ[d][f'read-nw{nw}'].get(summ[d].get(f'read-nw{nw}_fastest_peer')), 'mb_per_s', ratio=False)} |"  # noqa: E501
            for d, nw in cols))
        lines.append("")
    dcols = [(d, nw, k) for d in ds_names for k in ("decode", "second") for nw in (0, 2)
             if f"{k}-nw{nw}" in summ[d]]
    if dcols:
        lines += ["**Decode + random-resized crop to 224 + flip + batch 256, images/s** "
                  "(epoch 1; epoch 2 = second epoch with the system's cache)", "",
                  head + "".join(f" {'epoch 1' if k == 'decode' else 'epoch 2'}, {nw} workers |"
                                 for d, nw, k in dcols), "|---|" + "---:|" * len(dcols)]
        for s in systems:
            lines.append(f"| {LABEL[s]} |" + "".join(
                f" {_cell(summ[d][f'{k}-nw{nw}'].get(s), 'samples_per_s')} |"
                for d, nw, k in dcols))
        lines.append("")
        mcols = [(d, nw) for d in ds_names for nw in (0, 2) if f"decode-nw{nw}" in summ[d]]
        lines += ["**Peak memory during the decode epochs, MB** (RSS summed over the process and "
                  "the workers alive with it, ratio to the lowest peer; PSS sum after the slash)",
                  "",
                  head + "".join(f" {nw} workers |" for d, nw in mcols),
                  "|---|" + "---:|" * len(mcols)]
        for s in systems:
            if s == "feedpipe-store":
                continue
            lines.append(f"| {LABEL[s]} |" + "".join(
                f" {_cell(summ[d][f'decode-nw{nw}'].get(s), 'peak_rss_bytes', 1e6)} / "
                f"{_cell(summ[d][f'decode-nw{nw}'].get(s), 'peak_pss_bytes', 1e6, ratio=False)} |"
                for d, nw in mcols))
        lines.append("")
    ceil = [(d, summ[d]["ceil"]) for d in ds_names if "ceil" in summ[d]]
    if ceil:
        lines += ["**Ceilings (same run)**", "", "| ceiling | " + " | ".join(d for d, _ in ceil)
                  + " |", "|---|" + "---:|" * len(ceil)]
        for which, what in (("cat", "`cat` of the feedpipe shards"),
                            ("pyread", "Python readinto loop, aligned 1 MiB buffer"),
                            ("jpeg-simplejpeg", "JPEG decode, 1 core, simplejpeg"),
                            ("jpeg-pil", "JPEG decode, 1 core, Pillow")):
            cells = []
            for _, c in ceil:
                v = c.get(which)
                if not v or not v.get("seconds"):
                    cells.append("-")
                elif "mb_per_s" in v:
                    cells.append(f"{v['mb_per_s']:,.0f} MB/s = {v['samples_per_s']:,.0f} "
                                 "samples/s")
                else:
                    cells.append(f"{v['images_per_s']:,.0f} images/s")
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**Issue 8's bars**", "", "| bar | feedpipe | against | ratio | met |",
              "|---|---:|---|---:|---|"]
    for b in summ["bars"]:
        f = b["feedpipe"]
        big = "memory" in b["bar"]
        fv = "-" if f is None else (f"{f / 1e6:,.0f} MB" if big else f"{f:,.0f}/s")
        pv = b["peer_value"]
        pv = "-" if pv is None else (f"{pv / 1e6:,.0f} MB" if big else f"{pv:,.0f}/s")
        met = {True: "yes", False: "**no**", None: (b["why"] or "n/a").split(":")[0]}[b["met"]]
        r = "-" if b["ratio"] is None else f"{b['ratio']:.2f}x"
        lines.append(f"| {b['bar']} | {fv} | {LABEL.get(b['peer'], b['peer'])} {pv} | {r} | "
                     f"{met} |")
    errs = []
    for ds, runs in doc["runs"].items():
        for phase, per in runs.items():
            for s, rs in per.items():
                for r in rs:
                    if "error" in r:
                        errs.append(f"- {ds} {phase} {s}: {r['error'][:300]}")
                        break
                    if "unavailable" in r:
                        errs.append(f"- {ds} {phase} {s}: pending, {r['unavailable'][:300]}")
                        break
    if errs:
        lines += ["", "**Errors and pending systems**", "", *errs]
    return "\n".join(lines) + "\n"
