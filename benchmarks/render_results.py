"""Markdown and a PNG chart beside a benchmark's JSON results, so that every result set in
``benchmarks/results/`` is JSON + Markdown + PNG (issue 21; git keeps the history).

Usage::

    python benchmarks/render_results.py benchmarks/results/NAME.json [...] [--force]
                                        [--out-dir DIR]

Writes ``NAME.md`` and ``NAME.png`` beside each JSON (or into ``--out-dir``) where they are
missing; ``--force`` rewrites them. A benchmark script calls :func:`render` on the file it has just
written. The figures are the JSON's own, rounded for reading; the Markdown has:

- a title naming the benchmark and what it measures (``ABOUT``, one line per benchmark);
- the environment line: date, CPUs, memory, GPU where there is one, versions, the git revision
  and whether the tree had uncommitted changes (listed below it);
- the settings: the top-level scalars and the ``params`` / ``settings`` / ``args`` sections;
- ``summary_text`` verbatim (what the benchmark printed), where the JSON has one;
- every result section as tables: records that share their keys become rows of one table,
  nested figures become columns (or tables of their own when there are many), and the unit in a
  key's name (``_s``, ``_ms``, ``_bytes``, ``_per_s``, ``_GBps``) goes into the column's header.
  Per-pass lists and raw run records (``runs``, ``log``) stay in the JSON.

The PNG is drawn by ``result_charts.py`` (its docstring says how).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

# beside it in benchmarks/ (on the path when a script there runs, or as the test imports it)
import result_charts
from result_tables import RAW, Writer, scalar_list

HERE = os.path.dirname(os.path.abspath(__file__))

ABOUT: dict[str, tuple[str, str]] = {
    "mixture": ("a mixture of sources against one dataset", "raw batches through FeedLoader "
                "from `Mixture` of three sources and from one dataset of the same samples, "
                "alternating passes: samples/s and the median of the per-pass ratios."),
    "convert": ("conversion speed", "`feedpipe.shard` against `webdataset.ShardWriter` and "
                "`tar cf`, converting the same source trees into shards: files/s, samples/s, "
                "input MB/s."),
    "dask": ("conversion on a Dask cluster", "`feedpipe.shard` on 1, 2 and 4 Dask worker "
             "processes against the local process pool (files/s), and Dask's coordination cost "
             "per task measured with no-op tasks."),
    "listing": ("listing a big source tree", "one process (`list_tree`) against the parallel "
                "streamed listing with 1 and 2 workers: files/s and the lister's memory."),
    "plan": ("planning cost", "building an epoch's sample order (`Plan`) over many shards: wall "
             "time and peak memory against the targets, ids/s drawn from it, and full "
             "permutations (numpy, torch) for comparison."),
    "read": ("raw read speed of shards", "feedpipe's loaders against `webdataset` (through a "
             "DataLoader or its own loader) reading the same shards, every byte of every sample "
             "touched: samples/s and MB/s."),
    "tiny_read": ("raw read of tiny records against `cat`", "`FeedLoader(FeedDataset(root), "
                  "batch_size=256)` with 0 and 2 workers on 200,000 records of 1 KiB against "
                  "`cat` of the same shards: samples/s (cat's in samples-equivalent), peak RSS."),
    "resume": ("resume cost", "continuing an epoch at 90% from `FeedLoader.load_state_dict` "
               "against a naive resume that reads up to 90%: time to the first batch, samples/s, "
               "shard opens and memory."),
    "shuffle": ("shuffle quality", "on a dataset written in class order: feedpipe's plan "
                "(several shuffle windows) against webdataset's shard + buffer shuffle and a full "
                "random permutation: distinct classes and shards per batch, order correlations "
                "(z-scores against random) and reading locality."),
    "decode": ("JPEG decode + resize to 224 on one core", "which decoder and resize path "
               "feedpipe's CPU pipeline should use: images/s and the ratio to simplejpeg's full "
               "decode, per image set."),
    "device": ("the device end of the pipeline", "host-to-device copies (pageable, pinned), a "
               "training step fed through `DeviceLoader` against batches already on the device, "
               "`DeviceCache` gather against a plain copy, and DALI's image pipeline."),
    "eviction": ("L1 cache eviction", "plan-aware eviction (the shard needed furthest ahead "
                 "goes first) against LRU and the optimum: hit ratios over several epochs with "
                 "the cache budget a fraction of the dataset, simulated and in a real run."),
    "hash": ("content hash of the L2 function index", "xxh3-128 against xxh3-64, blake3, "
             "blake2b and sha256 (and feedpipe's `content_hash`) per input size on one core: "
             "µs per call and GB/s."),
    "probe_fio": ("`feedpipe probe` against fio", "sequential-read MB/s of `feedpipe probe` "
                  "and `fio` on the same file, block size and thread count, cold and warm."),
    "resize": ("crop + resize + flip on one core", "a random-resized crop to 224x224 CHW uint8 "
               "with a flip: the torch path against the OpenCV path (ms per image)."),
    "tiers": ("cache tiers, epoch 1 against epoch 2", "samples/s through no cache, L1, L1 + the "
              "decoded store, the L2 memo and L1 + L2, over HTTP on 127.0.0.1."),
    "window_decode": ("window-only JPEG decoding", "`feedpipe._native._jpegcrop` decoding only the "
                      "crop against simplejpeg's whole decode, on the crops `ImagePipeline(224, "
                      "train=True)` draws: µs per image, alone and in the pipeline."),
    "cache_budget": ("L1 cache budget node-wide", "the shared cache directory's peak size "
                     "against `cache_size` with many readers (counts, not timings)."),
    "device_cache": ("DeviceCache serving bandwidth", "`DeviceCache.batches` GB/s against a "
                     "plain copy of the same batches and the device's peak copy."),
    "packed": ("token rows packed to a context length", "`feedpipe.Packed` against LitData's "
               "`TokensLoader` and MosaicML Streaming (packed in the loop) on the same token "
               "corpus: tokens/s, time to the first batch, peak RSS."),
    "versions": ("two feedpipe versions side by side", "the code at a git ref against the "
                 "working tree on the same shards, alternating passes: samples/s, images/s and "
                 "peak RSS."),
    "image_formats": ("decoding images that are not plain JPEGs", "which library decodes each "
                      "format fastest (µs per image, pixel differences) and what "
                      "`ImagePipeline` costs per format."),
    "peers": ("feedpipe against its peers", "webdataset, wids, MosaicML streaming, LitData and "
              "DALI on the same data."),
    "train": ("training throughput", "images/s of a model fed by each loader, against "
              "synthetic data."),
}

SETTINGS = ("params", "settings", "args", "sets", "sizes", "targets", "versions")
META = {"benchmark", "environment", "summary_text", "command", "profile_file", "plot",
        "elapsed_seconds", "seconds", "wall_seconds"}
RESULT_SCALAR = re.compile(r"_over_|ratio|_per_s|^naive_|speedup")


def bench_key(doc: dict, stem: str) -> str:
    """The benchmark's name without ``bench_``: the JSON's ``benchmark``, else the file's."""
    name = doc.get("benchmark") or stem.split("-")[0]
    return name[len("bench_"):] if name.startswith("bench_") else name


# -- the document ---------------------------------------------------------------------------------

def _git(env: dict) -> str:
    git = env.get("git") or {}
    rev = (git.get("revision") or "unknown")[:12]
    if git.get("dirty"):
        return f"git `{rev}` with uncommitted changes in {len(git.get('dirty_files', []))} files"
    return f"git `{rev}`" + (" (clean)" if git.get("dirty") is False else "")


def _cpus(env: dict) -> str:
    n, aff = env.get("cpu_count"), env.get("cpu_affinity")
    if not n:
        return ""
    return ((f"{aff} of {n} CPUs" if aff and aff != n else f"{n} CPUs")
            + (f" ({env['cpu_model']})" if env.get("cpu_model") else ""))


def environment_line(env: dict) -> str:
    """Where and when the figures were measured, in one line."""
    bits = []
    if env.get("date_utc"):
        bits.append(str(env["date_utc"])[:16].replace("T", " ") + " UTC")
    if _cpus(env):
        bits.append(_cpus(env))
    mem = (env.get("memory") or {}).get("MemTotal_bytes")
    if mem:
        bits.append(f"{mem / 2**30:.0f} GiB RAM")
    if env.get("gpu"):
        gpu = f"GPU {env['gpu']}"
        if env.get("gpu_memory_bytes"):
            gpu += f" ({env['gpu_memory_bytes'] / 2**30:.0f} GiB)"
        if env.get("torch_cuda"):
            gpu += f", CUDA {env['torch_cuda']}"
        bits.append(gpu)
    if env.get("python"):
        bits.append(f"Python {env['python']}")
    vers = ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v)
    if vers:
        bits.append(vers)
    bits.append(_git(env))
    load = env.get("loadavg_at_start")
    if load:
        bits.append(f"load average {load[0]:.2f} at the start")
    return "**Environment:** " + "; ".join(bits) + "."


def _settings(doc: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if k in META or k in RAW:
            continue
        if k in ("params", "settings", "args") and isinstance(v, dict):
            out.update(v)
        elif k in SETTINGS and isinstance(v, dict):
            out[k] = v  # flattened to k.key
        elif not isinstance(v, (dict, list)) and not RESULT_SCALAR.search(k):
            out[k] = v
        elif v and scalar_list(v) and k != "errors":
            out[k] = v
    return out


def markdown(doc: dict, stem: str, png: str | None) -> str:
    """The Markdown of result set ``stem`` (``png``: its chart's file name, if there is one)."""
    key = bench_key(doc, stem)
    short, what = ABOUT.get(key, (key, ""))
    w = Writer()
    w.lines += [f"# {stem}: {short}", ""]
    script = os.path.join(HERE, f"bench_{key}.py")
    by = f" Measured by `benchmarks/bench_{key}.py`." if os.path.exists(script) else ""
    if what or by:
        w.lines += [(what[0].upper() + what[1:] if what else "") + by, ""]
    env = doc.get("environment") or {}
    w.lines += [environment_line(env), ""]
    dirty = (env.get("git") or {}).get("dirty_files") or []
    if dirty:
        w.lines += ["<details><summary>Uncommitted files in the tree at the run</summary>", ""]
        w.lines += [f"- `{f.strip()}`" for f in dirty] + ["", "</details>", ""]
    took = next((doc[k] for k in ("elapsed_seconds", "wall_seconds", "seconds")
                 if isinstance(doc.get(k), (int, float))), None)
    if doc.get("command"):
        w.lines += [f"Command: `{doc['command']}`" + (f" ({took:,.0f} s)." if took else "."), ""]
    elif took:
        w.lines += [f"The run took {took:,.0f} s.", ""]
    if png:
        w.lines += [f"![{stem}]({png})", ""]
    settings = _settings(doc)
    if settings:
        w.heading(2, "Settings")
        w.kv(settings)
    text = doc.get("summary_text")
    if isinstance(text, str) and text.strip():
        fence = "~~~~" if "```" in text else "```"
        w.heading(2, "Summary (as the benchmark printed it)")
        w.lines += [fence + "text", text.strip("\n"), fence, ""]
    headline = {k: v for k, v in doc.items() if k not in META and not isinstance(v, (dict, list))
                and RESULT_SCALAR.search(k)}
    if headline:
        w.heading(2, "Results")
        w.kv(headline)
    for k, v in doc.items():
        if k in META or k in RAW or k in SETTINGS or not isinstance(v, (dict, list)):
            continue
        if isinstance(v, list) and (not v or scalar_list(v)):
            continue
        w.heading(2, k)
        w.section(v, k, 2)
    errors = doc.get("errors")
    if errors:
        w.heading(2, "Errors")
        w.lines += ["```", json.dumps(errors, indent=1)[:4000], "```", ""]
    left = RAW & set(_keys(doc))
    if left:
        w.lines += [f"Per-pass values and raw records ({', '.join(f'`{k}`' for k in sorted(left))}"
                    f") are in `{stem}.json`.", ""]
    return "\n".join(w.lines).rstrip() + "\n"


def _keys(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _keys(v)
    elif isinstance(node, list):
        for v in node:
            yield from _keys(v)


def chart_subtitle(env: dict) -> str:
    """The chart's second title line: when, on what, at which revision."""
    bits = [str(env.get("date_utc", ""))[:10], _cpus(env)]
    if env.get("gpu"):
        bits.append(str(env["gpu"]))
    git = env.get("git") or {}
    bits.append(f"git {(git.get('revision') or '?')[:10]}" + (" + changes" if git.get("dirty")
                                                               else ""))
    return " · ".join(b for b in bits if b)


def render(json_path: str, *, force: bool = False, out_dir: str | None = None,
           parts: tuple[str, ...] = ("md", "png"), benchmark: str | None = None) -> list[str]:
    """Write ``NAME.md`` and ``NAME.png`` for ``NAME.json`` where missing (all with ``force``);
    ``parts`` picks which (a script that writes its own Markdown asks for the PNG only);
    ``benchmark`` names it where the JSON has no ``benchmark`` and the file is named otherwise.
    Returns the paths written."""
    with open(json_path, encoding="utf-8") as f:
        doc = json.load(f)
    if benchmark and not doc.get("benchmark"):
        doc["benchmark"] = benchmark
    stem = os.path.basename(json_path)[:-len(".json")]
    out = out_dir or os.path.dirname(os.path.abspath(json_path))
    os.makedirs(out, exist_ok=True)
    md_path, png_path = os.path.join(out, stem + ".md"), os.path.join(out, stem + ".png")
    written = []
    if "png" in parts and (force or not os.path.exists(png_path)):
        key = bench_key(doc, stem)
        charts = result_charts.CHARTS.get(key)
        panels = [p for p in charts(doc) if p is not None] if charts else []
        short = ABOUT.get(key, (key, ""))[0]
        if not panels:
            print(f"{json_path}: no chart for benchmark {key!r} (result_charts.CHARTS); no PNG",
                  file=sys.stderr)
        else:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                print("matplotlib is not installed (pip install matplotlib): no PNG",
                      file=sys.stderr)
            else:
                written.append(result_charts.write_chart(
                    panels, f"{stem}: {short}", chart_subtitle(doc.get("environment") or {}),
                    png_path))
    if "md" in parts and (force or not os.path.exists(md_path)):
        png = stem + ".png" if os.path.exists(png_path) else None
        with open(md_path, "w", encoding="utf-8") as f:
            f.write(markdown(doc, stem, png))
        written.append(os.path.abspath(md_path))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="result files (benchmarks/results/NAME.json)")
    ap.add_argument("--force", action="store_true", help="rewrite an existing .md and .png")
    ap.add_argument("--out-dir", default=None, help="where to write (default: beside the JSON)")
    a = ap.parse_args(argv)
    for path in a.json:
        if not path.endswith(".json") or not os.path.isfile(path):
            print(f"{path}: not a JSON results file", file=sys.stderr)
            return 2
    for path in a.json:
        for w in render(path, force=a.force, out_dir=a.out_dir):
            print(f"wrote {os.path.relpath(w)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
