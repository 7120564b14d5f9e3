"""Text to token shards: ``feedpipe shard --tokenizer`` against LitData's ``optimize()`` and
datatrove's ``DocumentTokenizer``, same corpus, same tokenizer, same worker count.

Corpus: the ``.py`` files of the running Python's standard library (real text), one document per
top-level block (split at PEP 8's two blank lines: many short documents, a median of about
900 bytes, a few of tens of kB), cut to about ``--mb`` MB and
written as ``--files`` JSON Lines files (``{"text": ...}``) under ``--root``. Tokenizer: a
byte-level BPE of ``--vocab`` ids trained on that corpus with ``tokenizers`` (saved as
``tokenizer.json``; the end-of-document token ``<eos>`` is appended to every document by each
system). Every system writes the same documents' ids:

- **feedpipe**: ``feedpipe.shard_tokens(corpus, out, tokenizer=tokenizer.json, eos_id=...,
  workers=W)``: ``.npy`` token members in tar shards plus per-shard lengths, read by
  ``feedpipe.Packed``.
- **litdata**: LitData's documented pre-training recipe, ``optimize(fn=tokenize_fn,
  inputs=files, output_dir=..., chunk_bytes="64MB", item_loader=TokensLoader(),
  num_workers=W)``, where ``tokenize_fn(path)`` yields ``torch.tensor(tokenizer.encode(text).ids
  + [eos], dtype=torch.int)`` for each document of a file (one document at a time, as its
  recipe does).
- **datatrove**: ``LocalPipelineExecutor([JsonlReader(corpus), DocumentTokenizer(out,
  tokenizer_name_or_path=tokenizer.json, eos_token="<eos>", shuffle_documents=False)],
  tasks=W, workers=W)`` (its tokenizer step; no shuffle, as the others).

Each run is a fresh interpreter writing into a fresh directory; ``--passes`` passes, the
systems' order rotated every pass. Measured per run: wall seconds from the call to its return
(the tokenizer's load included, the interpreter's start not), tokens/s (the corpus's tokens,
EOS included, counted once with the same tokenizer, over the wall time), and the peak RSS of
the process tree (the sum over the run's processes, sampled every 20 ms, and the largest one
process), and CPU seconds (each process's user + system time when last sampled). Beside them,
not a system, run in turn with them: the **floor**, ``encode_batch_fast`` of the whole corpus
in one process with ``tokenizers``' own threads, nothing written (what the tokenizer alone
costs here).

**The bar** (issue 44: at least 2x the faster of the peers on 2 cores) is the median over passes
of feedpipe's tokens/s over the faster peer's in that pass.

Usage::

    python benchmarks/bench_tokenize.py [--mb 16] [--workers 2] [--passes 3] [--root DIR]
        [--out benchmarks/results/bench_tokenize.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import sysconfig
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULT_TAG, default_root, environment, load_spec, run_worker  # noqa: E402

SYSTEMS = ("feedpipe", "litdata", "datatrove", "floor")
EOS = "<eos>"


def make_corpus(root: str, mb: float, files: int, vocab: int) -> dict[str, Any]:
    """The JSON Lines corpus and the tokenizer under ``root`` (made once, then reused)."""
    corpus = os.path.join(root, "corpus")
    tok_path = os.path.join(root, "tokenizer.json")
    meta_path = os.path.join(root, "corpus.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("mb") == mb and meta.get("files") == files and meta.get("vocab") == vocab:
            return meta  # type: ignore[no-any-return]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(corpus)
    lib = sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(lib):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                try:
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        text = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                for piece in text.split("\n\n\n"):  # top-level blocks (PEP 8's two blank
                    if piece.strip():                  # lines): many short, a few long
                        docs.append(piece)
                        total += len(piece.encode())
        if total >= mb * 1e6:
            break
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tok.save(tok_path)
    # the EOS each system appends: datatrove through this post-processor (its way), the others
    # by hand from the id; the corpus file keeps the tokenizer without it
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}",
                                                       special_tokens=[(EOS, eos_id)])
    tok.save(os.path.join(root, "tokenizer-eos.json"))
    per = -(-len(docs) // files)
    paths = []
    for k in range(files):
        p = os.path.join(corpus, f"part-{k:03d}.jsonl")
        with open(p, "w", encoding="utf-8") as f:
            for d in docs[k * per:(k + 1) * per]:
                f.write(json.dumps({"text": d}) + "\n")
        paths.append(p)
    plain = Tokenizer.from_file(tok_path)
    tokens = sum(len(e.ids) + 1 for e in plain.encode_batch_fast(docs))
    meta = {"mb": mb, "files": files, "vocab": vocab, "documents": len(docs), "bytes": total,
            "tokens": tokens, "eos_id": eos_id, "corpus": corpus, "paths": paths,
            "tokenizer": tok_path}
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump(meta, f)
    return meta


class _Peak(threading.Thread):
    """Samples the RSS of this process and all its descendants: the peak of the sum, and of one
    process."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psutil

        self.me = psutil.Process()
        self.stop = threading.Event()
        self.tree = self.one = 0
        self.cpu: dict[int, float] = {}  # per process seen: its CPU seconds when last sampled

    def run(self) -> None:
        import psutil

        while not self.stop.wait(0.02):
            total = 0
            try:
                procs = [self.me, *self.me.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                self.cpu[p.pid] = t.user + t.system
                total += rss
                self.one = max(self.one, rss)
            self.tree = max(self.tree, total)


def _tokenize_fn(path: str, tok_path: str = "", eos_id: int = 0) -> Any:
    """LitData's recipe: each document of a file, encoded one at a time, as an int32 tensor."""
    import torch
    from tokenizers import Tokenizer

    tok = _TOK.get(tok_path)
    if tok is None:
        tok = _TOK[tok_path] = Tokenizer.from_file(tok_path)
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"]).ids
            ids.append(eos_id)
            yield torch.tensor(ids, dtype=torch.int)


_TOK: dict[str, Any] = {}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    system, meta, out, w = spec["system"], spec["meta"], spec["out"], spec["workers"]
    shutil.rmtree(out, ignore_errors=True)
    peak = _Peak()
    peak.start()
    t0 = time.perf_counter()
    if system == "floor":  # not a system: the tokenizer alone, in this process, its threads
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(meta["tokenizer"])
        texts = []
        for path in meta["paths"]:
            with open(path, encoding="utf-8") as f:
                texts += [json.loads(line)["text"] for line in f]
        tokens = sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts))
    elif system == "feedpipe":
        from feedpipe import shard_tokens

        s = shard_tokens(meta["corpus"], out, tokenizer=meta["tokenizer"],
                         eos_id=meta["eos_id"], workers=w, chunk_bytes=spec["chunk_bytes"],
                         show_progress=False)
        tokens = s.tokens
    elif system == "litdata":
        from functools import partial

        from litdata import TokensLoader, optimize

        optimize(fn=partial(_tokenize_fn, tok_path=meta["tokenizer"], eos_id=meta["eos_id"]),
                 inputs=meta["paths"], output_dir=out, chunk_bytes="64MB",
                 item_loader=TokensLoader(), num_workers=w, verbose=False)
        tokens = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)
                     if n.endswith(".bin")) // 4  # int32 tokens (the chunks' few header bytes
        # are counted too: a check that they are all there, not the figure reported)
    else:
        from datatrove.executor import LocalPipelineExecutor
        from datatrove.pipeline.readers import JsonlReader
        from datatrove.pipeline.tokens import DocumentTokenizer

        tok_eos = os.path.join(os.path.dirname(meta["tokenizer"]), "tokenizer-eos.json")
        LocalPipelineExecutor(
            pipeline=[JsonlReader(meta["corpus"], text_key="text"),
                      DocumentTokenizer(out, tokenizer_name_or_path=tok_eos, eos_token=None,
                                        shuffle_documents=False)],
            tasks=w, workers=w, logging_dir=out + "-logs", skip_completed=False).run()
        tokens = sum(os.path.getsize(os.path.join(dp, n)) for dp, _, names in os.walk(out)
                     for n in names if n.endswith(".ds")) // 2  # uint16 tokens
    secs = time.perf_counter() - t0
    peak.stop.set()
    peak.join()
    return {"system": system, "seconds": secs, "tokens_written": int(tokens),
            "cpu_seconds": sum(peak.cpu.values()),
            "peak_rss_tree_mb": peak.tree / 1e6, "peak_rss_one_mb": peak.one / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=float, default=16.0, help="corpus size in MB of text")
    ap.add_argument("--files", type=int, default=8, help="JSON Lines files of the corpus")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20,
                    help="feedpipe's --chunk-bytes (input bytes per shard)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--root", default=default_root("tokenize"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_tokenize.json"))
    ap.add_argument("--render", action="store_true",
                    help="only write the Markdown of the JSON at --out again")
    a = ap.parse_args()
    if a.render:
        with open(a.out, encoding="utf-8") as f:
            doc = json.load(f)
        with open(a.out[:-5] + ".md", "w", encoding="utf-8") as f:
            f.write(_markdown(doc))
        return
    if a.worker is not None:
        print(RESULT_TAG + json.dumps(worker(load_spec(a.worker))), flush=True)
        return
    meta = make_corpus(a.root, a.mb, a.files, a.vocab)
    systems = a.systems.split(",")
    env = environment(a.root)
    runs: list[dict[str, Any]] = []
    failed = False
    for p in range(a.passes):
        order = systems[p % len(systems):] + systems[:p % len(systems)]
        for system in order:
            r = run_worker(__file__, {"system": system, "meta": meta, "workers": a.workers,
                                      "chunk_bytes": a.chunk_bytes,
                                      "out": os.path.join(a.root, f"out-{system}")},
                           timeout=1800)
            r.update(system=system, pass_=p)
            if "error" in r:
                failed = True
                print(f"{system}: FAILED: {r['error']}\n{r.get('stderr_tail', '')}",
                      file=sys.stderr)
            else:
                r["tokens_per_s"] = meta["tokens"] / r["seconds"]
                print(f"pass {p} {system:>9}: {r['seconds']:7.2f}s  "
                      f"{r['tokens_per_s'] / 1e6:6.2f}M tokens/s  cpu {r['cpu_seconds']:.1f}s  "
                      f"peak RSS {r['peak_rss_tree_mb']:.0f} MB (one process "
                      f"{r['peak_rss_one_mb']:.0f} MB)  wrote {r['tokens_written']:,} tokens",
                      flush=True)
            runs.append(r)
    summary: dict[str, Any] = {}
    for s in systems:
        ok = [r for r in runs if r["system"] == s and "error" not in r]
        if ok:
            summary[s] = {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                          "median_seconds": statistics.median(r["seconds"] for r in ok),
                          "median_cpu_seconds": statistics.median(r["cpu_seconds"] for r in ok),
                          "max_peak_rss_tree_mb": max(r["peak_rss_tree_mb"] for r in ok),
                          "max_peak_rss_one_mb": max(r["peak_rss_one_mb"] for r in ok)}
    ratios = []
    for p in range(a.passes):
        got = {r["system"]: r for r in runs if r["pass_"] == p and "error" not in r}
        peers = [got[s]["tokens_per_s"] for s in got if s not in ("feedpipe", "floor")]
        if "feedpipe" in got and peers:
            ratios.append(got["feedpipe"]["tokens_per_s"] / max(peers))
    doc = {"benchmark": "bench_tokenize", "corpus": {k: v for k, v in meta.items()
                                                     if k != "paths"},
           "workers": a.workers, "passes": a.passes, "runs": runs, "summary": summary,
           "ratio_vs_faster_peer": {"per_pass": ratios,
                                    "median": statistics.median(ratios) if ratios else None},
           "command": " ".join(sys.argv), "environment": env}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    with open(a.out[:-5] + ".md", "w", encoding="utf-8") as f:
        f.write(_markdown(doc))
    print(_markdown(doc))
    if failed:
        sys.exit(1)


def _cpu_ratios(doc: dict[str, Any]) -> list[float]:
    """Per pass: the CPU seconds of the peer that used fewest, over feedpipe's."""
    out = []
    for p in range(doc["passes"]):
        got = {r["system"]: r for r in doc["runs"] if r["pass_"] == p and "error" not in r}
        peers = [got[s]["cpu_seconds"] for s in got if s not in ("feedpipe", "floor")]
        if "feedpipe" in got and peers and got["feedpipe"]["cpu_seconds"] > 0:
            out.append(min(peers) / got["feedpipe"]["cpu_seconds"])
    return out


def _markdown(doc: dict[str, Any]) -> str:
    c = doc["corpus"]
    lines = [
        "# bench_tokenize: text to token shards",
        "",
        f"Corpus: {c['documents']:,} documents ({c['bytes'] / 1e6:.1f} MB of Python source, "
        f"{c['tokens']:,} tokens with EOS), byte-level BPE of {c['vocab']:,} ids; "
        f"{doc['workers']} workers each; {doc['passes']} passes, order rotated. "
        f"Machine: {doc['environment']['cpu_count']} cores "
        f"(load at start {doc['environment'].get('loadavg_at_start')}).",
        "",
        "| system | tokens/s (median) | wall s | CPU s | peak RSS, tree (MB) | "
        "peak RSS, one process (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, v in doc["summary"].items():
        name = "floor (not a system): encode_batch_fast, one process" if s == "floor" else s
        lines.append(f"| {name} | {v['median_tokens_per_s'] / 1e6:.2f}M | "
                     f"{v['median_seconds']:.2f} | {v['median_cpu_seconds']:.1f} | "
                     f"{v['max_peak_rss_tree_mb']:.0f} | {v['max_peak_rss_one_mb']:.0f} |")
    r = doc["ratio_vs_faster_peer"]
    if r["median"] is not None:
        lines += ["", f"feedpipe / faster peer, by wall time: median {r['median']:.2f}x "
                      f"(per pass: {', '.join(f'{x:.2f}' for x in r['per_pass'])}). "
                      "Goal (issue 44): 2x.", ""]
    cpu = _cpu_ratios(doc)
    if cpu:
        lines += [f"By CPU seconds (the figure to read where other work shares the cores: wall "
                  f"time then counts the waits for a core): the faster peer's CPU seconds over "
                  f"feedpipe's, median {statistics.median(cpu):.2f}x (per pass: "
                  f"{', '.join(f'{x:.2f}' for x in cpu)}).", ""]
    lines += [f"Command: `{doc['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
