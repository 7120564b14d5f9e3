"""``feedpipe shard``, ``merge``, ``index`` and ``verify``: their arguments and what they print."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._helpers.sizes import format_size
from ._output import add_json_options, emit, parse_size


def add_shard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shard",
        help="convert a small-file dataset into WebDataset tar shards",
        description=(
            "Convert a small-file dataset into WebDataset tar shards with DALI indexes and a "
            "manifest.json. Files sharing a relative directory and stem form one sample "
            "(cls/0001.jpg + cls/0001.json; two images, cls/x.jpg + cls/x.png, make one sample "
            "too, with a warning); keys are encoded so that dots, spaces and unicode "
            "survive the WebDataset first-dot rule (a/cat.v2.jpg stays one sample, field 'jpg'). "
            "Output is deterministic: the same inputs and options give the same bytes whatever "
            "--workers is."
        ),
        epilog=(
            "Manifest files (--manifest): JSONL objects or CSV rows. Column 'key' (optional)\n"
            "names the sample; 'path' is a file stored under its own extension; '<ext>_path' is\n"
            "a file stored as field <ext>; every other column is a scalar field stored as UTF-8\n"
            "text. Relative paths are taken from SRC.\n\n"
            "Past one machine: with --part, N runs (any machines, at once or not) each convert\n"
            "a deterministic share of the inputs into their own shards in the shared OUT, named\n"
            "PREFIX-pIIIIIofNNNNN-*.tar. The merged dataset has the same samples in the same\n"
            "order whatever N is. With --dask, SRC and OUT must be at the same paths on every\n"
            "worker; the output is byte-identical to a local run.\n\n"
            "Text in, token shards out (--tokenizer): SRC is a JSON Lines file (.jsonl,\n"
            ".jsonl.gz, .jsonl.zst), a Parquet or Arrow file, or a directory of them or of text\n"
            "files (.txt, .md, code: each file one document). Each document becomes a sample\n"
            "whose tokens.npy field holds its ids in the smallest unsigned dtype of the\n"
            "vocabulary, read by feedpipe.Packed directly; each shard's document lengths go to\n"
            "PREFIX-*.lengths.npy. Bad records (invalid UTF-8, empty text, a missing field, not\n"
            "a string) stop the run, or with --on-error skip are left out, named in the manifest\n"
            "and counted. --max-bytes, --max-samples, --shuffle, --manifest, --columns,\n"
            "--classes, --labels-from-dirs and --method do not apply (refused).\n\n"
            "Examples:\n"
            "  feedpipe shard ./images ./shards --labels-from-dirs --max-bytes 256MB\n"
            "  feedpipe shard s3://bucket/raw ./shards --manifest rows.jsonl --shuffle --seed 1\n"
            "  feedpipe shard train.parquet ./shards --columns image=jpg,label=cls\n"
            "  feedpipe shard ./images ./shards --resume     # after an interrupted run\n"
            "  feedpipe shard SRC OUT --part 2/8 --merge     # part 2 of 0..7, e.g. a Slurm array\n"
            "  feedpipe merge OUT                            # or let the last part --merge\n"
            "  feedpipe shard SRC OUT --dask tcp://sched:8786   # tasks on a Dask cluster\n"
            "  feedpipe shard corpus.jsonl.zst ./tokens --tokenizer tokenizer.json --eos-id 0\n"
            "  feedpipe shard ./wiki-parquet ./tokens --tokenizer tok.json --text-field content\n"
            "  feedpipe shard ./code ./tokens --tokenizer tok.json --workers 8 --on-error skip\n"
            "  feedpipe shard corpus.jsonl ./tokens --tokenizer tok.json --resume   # after a kill"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="source directory (local path or fsspec URL)")
    p.add_argument("out", metavar="OUT", help="output directory (missing or empty, or --resume)")
    p.add_argument("--max-bytes", type=parse_size, default="256MiB",
                   help="target shard size (default: 256MiB)")
    p.add_argument("--max-samples", type=int, default=None, help="at most N samples per shard")
    p.add_argument("--workers", type=int, default=None,
                   help="writer (and directory listing) processes (default: all cores); never "
                        "changes the output")
    p.add_argument("--shuffle", action="store_true", help="mix the sample order at write time")
    p.add_argument("--seed", type=int, default=0, help="seed for --shuffle (default: 0)")
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="bad input (zero-byte, unreadable, no extension): stop (raise, the "
                        "default) or leave the sample out and list it in the manifest (skip)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run in OUT: keep its committed shards")
    p.add_argument("--prefix", default="data", help="shard name prefix (default: data)")
    p.add_argument("--labels-from-dirs", action="store_true",
                   help="image-folder layout: write a 'cls' field (class index of the top-level "
                        "directory) and the class list in the manifest")
    p.add_argument("--manifest", metavar="FILE", default=None,
                   help="a .jsonl or .csv file naming the files of each sample (see below)")
    p.add_argument("--part", metavar="I/N", default=None,
                   help="convert only part I (0..N-1) of N: a deterministic share of the inputs "
                        "written as its own shards; then `feedpipe merge OUT` (or --merge)")
    p.add_argument("--merge", action="store_true",
                   help="with --part: if every part has finished, write the manifest")
    p.add_argument("--dask", metavar="ADDRESS", default=None,
                   help="run the writing as tasks on this dask.distributed scheduler (e.g. "
                        "tcp://host:8786; needs feedpipe[dask]; SRC and OUT shared by workers)")
    p.add_argument("--retries", type=int, default=2,
                   help="with --dask: retries of a failed task (default: 2)")
    p.add_argument("--method", choices=("auto", "general", "one-pass"), default="auto",
                   help="auto (default): one pass over a fresh local tree of top-level "
                        "directories or a fresh Parquet source (its rows staged as they are "
                        "read), else the general method (list, plan, write); general or "
                        "one-pass force one (a forced one-pass that cannot serve the input is "
                        "refused, saying why). Same shards either way")
    p.add_argument("--columns", metavar="COL=FIELD,...", default=None,
                   help="Parquet source: send columns to fields (img=jpg,label=cls,id=__key__; "
                        "COL= drops one); the mapping taken is printed")
    p.add_argument("--classes", metavar="NAMES|FILE", default=None,
                   help="Parquet source: class names of the cls column (a,b,c or a file with "
                        "one per line; default: a categorical column's categories)")
    p.add_argument("--tokenizer", metavar="JSON", default=None,
                   help="tokenise a text corpus into token shards with this `tokenizers` JSON "
                        "file (see below; any other tokenizer: feedpipe.shard_tokens)")
    p.add_argument("--text-field", metavar="NAME", default="text",
                   help="with --tokenizer: the JSON field or table column of the text "
                        "(default: text)")
    p.add_argument("--eos-id", type=int, default=None,
                   help="with --tokenizer: append this id to every document (default: none)")
    p.add_argument("--chunk-bytes", type=parse_size, default="64MiB",
                   help="with --tokenizer: about how many input bytes make one shard "
                        "(default: 64MiB)")
    add_json_options(p, out=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# options of a small-file conversion that a token conversion has no use for: refused, not ignored
_NOT_WITH_TOKENIZER = {"shuffle": False, "labels_from_dirs": False, "manifest": None,
                       "columns": None, "classes": None, "max_samples": None, "method": "auto"}


def _cmd_shard_tokens(a: argparse.Namespace) -> Any:
    from ..convert._token_shard import shard_tokens

    given = [k for k, v in _NOT_WITH_TOKENIZER.items() if getattr(a, k) != v]
    if a.max_bytes != parse_size("256MiB"):
        given.append("max_bytes")
    if given:
        raise ValueError(", ".join("--" + k.replace("_", "-") for k in given) + " cannot apply "
                         "with --tokenizer (documents stay in input order; Packed shuffles at "
                         "read time; --chunk-bytes sizes the shards)")
    return shard_tokens(a.src, a.out, tokenizer=a.tokenizer, text_field=a.text_field,
                        eos_id=a.eos_id, chunk_bytes=a.chunk_bytes, prefix=a.prefix,
                        on_error=a.on_error, workers=a.workers, resume=a.resume, part=a.part,
                        merge=a.merge, dask=a.dask, retries=a.retries,
                        show_progress=False if a.no_progress else None)


def cmd_shard(a: argparse.Namespace) -> int:
    from .._helpers.pool_context import CommitPoint, InterruptedAfterCommit
    from ..convert._options import ShardOptions
    from ..convert._shard import shard

    if a.tokenizer is not None:
        s = _cmd_shard_tokens(a)
        emit(a, s.to_dict(), lambda: _shard_text(a, s))
        return 0
    opts = ShardOptions(
        max_bytes=a.max_bytes, max_samples=a.max_samples, shuffle=a.shuffle, seed=a.seed,
        on_error=a.on_error, prefix=a.prefix, labels_from_dirs=a.labels_from_dirs,
        manifest=a.manifest, workers=a.workers, resume=a.resume, method=a.method, part=a.part,
        merge=a.merge, dask=a.dask, retries=a.retries,
        show_progress=False if a.no_progress else None, columns=a.columns, classes=a.classes)
    try:
        s = shard(a.src, a.out, opts)
        late: InterruptedAfterCommit | None = None
    except InterruptedAfterCommit as e:  # the dataset is complete: the summary stands
        s, late = e.result, e
    try:
        with CommitPoint("the conversion") as point:
            point.reached()  # a Ctrl-C while the summary prints does not undo the run either
            emit(a, s.to_dict(), lambda: _shard_text(a, s))
    except InterruptedAfterCommit as e:
        late = late or e
    if late is not None:
        # status 0: the exit status says whether OUT is usable, and it is; 130 would send the
        # user (or a script retrying on it) to resume a conversion that has nothing left to do
        done = (f"part {s.part} was complete (its part record written)" if s.part else
                "the dataset was complete (manifest.json written)")
        print(f"feedpipe shard: {s.out}: the Ctrl-C came after {done}: it is finished, "
              "there is nothing to resume", file=sys.stderr)
    return 0


_SHOWN = 10  # samples of several images named in the text summary (--json names all)


def _shard_text(a: argparse.Namespace, s: Any) -> str:
    """The human summary of a conversion (``s``: its ShardSummary)."""
    unit = {"table": "rows", "tokenize": "units"}.get(s.method, "files")
    lines = [f"feedpipe shard: {a.src} -> {s.out}" + (f"   (part {s.part})" if s.part else "")]
    lines += [f"  {line}" for line in s.columns]  # a table source: column -> field
    if s.part:
        count = s.part.split("/")[1]
        lines.append("  merged   all parts -> manifest.json" if s.merged else
                     f"  part     {s.part} done; once all {count} parts are done, run "
                     f"`feedpipe merge {s.out}` (or give the last part --merge)")
    from ..convert._shard import ALREADY_COMPLETE

    kept = f"   ({s.reused_shards} kept from the interrupted run)" if s.reused_shards else ""
    if s.executor == ALREADY_COMPLETE:
        kept = "   (all there already: nothing written)"
    lines += [
        f"  method   {s.method:>10}   ({s.executor}{'; ' + s.why if s.why else ''})",
        f"  shards   {s.shards:>10}{kept}",
        f"  samples  {s.samples:>10}",
        f"  {unit:<5}    {s.files:>10}",
        f"  bytes    {format_size(s.bytes):>10}",
        f"  skipped  {s.skipped:>10}" + ("   (listed in manifest.json)" if s.skipped else ""),
        *([f"  several  {len(s.several_images):>10}   samples of two or more images, one of "
           "them trained (listed in manifest.json)"] if s.several_images else []),
        f"  time     {s.seconds:>9.2f}s   {s.files_per_s:,.0f} {unit}/s   "
        f"{s.mb_per_s:,.1f} MB/s",
    ]
    if s.method == "tokenize":  # a token conversion: its tokens and bad records
        lines.insert(-1, f"  tokens   {s.tokens:>10,}   {s.tokens_per_s:,.0f} tokens/s")
        if s.bad_records:
            lines.insert(-1, "  bad      " + ", ".join(f"{k}: {v}"
                                                    for k, v in s.bad_records.items()))
    lines += [f"  skipped: {sk['path']}: {sk['reason']}" for sk in s.skipped_inputs[:5]]
    several = s.several_images  # samples of files sharing a stem: one image of each trained
    lines += [f"  several images: {' + '.join(e['images'])}: trains with {e['taken']}"
              for e in several[:_SHOWN]]
    if len(several) > _SHOWN:
        lines.append(f"  several images: {len(several) - _SHOWN} more samples (all "
                     f"{len(several)} in manifest.json, created_by.several_images, and --json)")
    return "\n".join(lines)


def add_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="write one manifest for the parts of `shard --part I/N`",
                       description="Join the parts written by `feedpipe shard SRC OUT --part I/N` "
                                   "(I = 0..N-1) under one manifest.json and wids.json. Refuses, "
                                   "naming the part, when a part is missing, unfinished, made "
                                   "from other inputs or options, or has lost a shard, and, "
                                   "naming the key and both shards, when two parts hold one "
                                   "sample key. Parts "
                                   "written by feedpipe.ShardWriter(out, part=(i, n)) merge the "
                                   "same way.",
                       epilog="Examples:\n"
                              "  feedpipe merge ./shards             # after every "
                              "`feedpipe shard SRC ./shards --part I/N`\n"
                              "  feedpipe merge ./shards --parts 8   # refuse unless all 8 "
                              "parts are there\n"
                              "  feedpipe merge ./shards --json | jq .total_samples",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="the directory the parts wrote into")
    p.add_argument("--parts", type=int, default=None, metavar="N",
                   help="the expected number of parts (default: read from the part records)")
    add_json_options(p, out=True)


def cmd_merge(a: argparse.Namespace) -> int:
    from ..convert._merge import merge

    m = merge(a.out, parts=a.parts)
    emit(a, json.loads(m.to_json()),
         f"feedpipe merge: {m.created_by.get('parts')} parts -> {len(m.shards)} shards, "
         f"{m.total_samples} samples, {len(m.skipped)} skipped; wrote manifest.json")
    return 0


def add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index", help="write .idx files and a manifest for existing shards",
        description="Adopt WebDataset shards made by other tools (webdataset's ShardWriter, tar): "
                    "read every tar header once, write a DALI v1.2 .idx beside each shard and a "
                    "manifest.json (with sha256 of each shard) at the dataset root. Every shard "
                    "is checked before anything is written: a truncated or malformed shard, a "
                    "key found twice (in one shard or two), or a cls value outside --classes, "
                    "is named and nothing is written. gzip shards (.tar.gz, .tgz) are indexed "
                    "as they are (their .idx gives offsets in the plain tar inside, which "
                    "readers decompress once into the shard cache); bzip2, xz and zstd ones are "
                    "refused, saying how to convert them. A hard link to an earlier member "
                    "reads as its target's bytes, as tar and Python's tarfile read it; every "
                    "member that makes no sample (a symbolic link, a hidden file such as "
                    ".gitignore, whose key is empty, a device) is listed with its reason in the "
                    "summary and in the manifest's \"skipped\".",
        epilog="Examples:\n"
               "  feedpipe index ./shards                       # every *.tar in the directory\n"
               "  feedpipe index 'shards/train-*.tar' --root shards\n"
               "  feedpipe index ./shards --classes cat,dog,zebra   # what cls 0, 1, 2 mean\n"
               "  feedpipe index ./shards --classes classes.txt     # one name per line\n"
               "  feedpipe index 'shards/*.tar.gz'              # gzip shards, as they are\n"
               "  feedpipe index ./shards --json | jq .total_samples",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="+", metavar="SHARD", help="shard files, globs or directories")
    p.add_argument("--root", default=None,
                   help="dataset root for manifest.json (default: the first shard's directory)")
    p.add_argument("--classes", metavar="NAMES|FILE", default=None,
                   help="class names to record in the manifest (what the 'cls' values index), "
                        "as `feedpipe shard --labels-from-dirs` records them: a comma-separated "
                        "list, or a file with one name per line (an existing file wins; a value "
                        "like a path, e.g. classes.txt, must be one). Every cls value must be "
                        "an index into them")
    p.add_argument("--adopt-interrupted", action="store_true",
                   help="index the shards of a directory whose writer was killed or never "
                        "closed (refused by default: the samples it had not committed are "
                        "lost); the dataset is then what it committed")
    add_json_options(p, out=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_index(a: argparse.Namespace) -> int:
    from ..format._indexer import describe, index_dataset

    r = index_dataset(a.shards, root=a.root, classes=a.classes,
                      show_progress=False if a.no_progress else None,
                      adopt_interrupted=a.adopt_interrupted)
    m = r.manifest

    def text() -> str:
        lines = [f"feedpipe index: {len(m.shards)} shards, {m.total_samples} samples, "
                 f"fields {', '.join(m.fields)}"]
        if m.classes is not None:
            lines.append(f"  classes  {len(m.classes)} from {r.classes_from}: "
                         f"{', '.join(m.classes[:8])}{', ...' if len(m.classes) > 8 else ''}")
        if r.left_out:
            lines.append(f"  left out {len(r.left_out)} member(s) that make no sample "
                         "(manifest.json \"skipped\"):")
            lines += [f"    {describe(x)}" for x in r.left_out]
        lines.append(f"  wrote    {len(r.indexes)} .idx files and {r.root}/manifest.json")
        return "\n".join(lines)

    emit(a, r.to_dict(), text)
    return 0


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check shards against their indexes and the manifest",
        description="Check every shard of a dataset: size and sha256 against the manifest, every "
                    "tar header, every .idx entry against the headers, and that no sample key "
                    "is held by two samples (in one shard or two). Exit 0 when sound, 1 "
                    "with each problem's shard, offset or key, and kind otherwise. Warnings say "
                    "what was not checked: a shard the manifest gives no sha256 for, a .tar "
                    "below the dataset root that the manifest does not list.",
        epilog="Examples:\n"
               "  feedpipe verify ./shards\n"
               "  feedpipe verify s3://bucket/shards\n"
               "  feedpipe verify ./shards --json     # {ok, problems: [{shard, offset, kind, "
               "key, message}], warnings: [...]}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", metavar="DATASET", help="dataset root (path or fsspec URL)")
    add_json_options(p, out=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_verify(a: argparse.Namespace) -> int:
    from ..format._verify import verify

    r = verify(a.dataset, show_progress=False if a.no_progress else None)

    def text() -> str:
        lines = [f"PROBLEM {p}" for p in r.problems] + [f"WARNING {w}" for w in r.warnings]
        verdict = "OK" if r.ok else f"{len(r.problems)} problem(s)"
        if r.warnings:
            verdict += f", {len(r.warnings)} warning{'s' * (len(r.warnings) > 1)} (not checked)"
        lines.append(f"feedpipe verify: {r.shards} shards, {r.samples} samples: {verdict}")
        return "\n".join(lines)

    emit(a, r.to_dict(), text)
    return 0 if r.ok else 1
