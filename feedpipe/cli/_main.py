"""The ``feedpipe`` command: a thin shell over the library functions of the same names."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import FeedpipeError
from .._helpers.sizes import format_size


def parse_size(text: str) -> int:
    """``"256MB"`` -> 256000000, ``"1GiB"`` -> 1073741824, ``"4096"`` -> 4096."""
    from .._helpers.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


class _Parser(argparse.ArgumentParser):
    """argparse with one addition: under ``--json`` a usage error is also a JSON record on
    stdout (``{"error": "UsageError", "message": ...}``), exit status 2 as before."""

    json_errors = False

    def error(self, message: str):  # type: ignore[no-untyped-def]
        if _Parser.json_errors:
            _print_json({"error": "UsageError", "message": f"{self.prog}: {message}"})
        super().error(message)


def add_json_options(p: argparse.ArgumentParser, *, out: bool = False) -> None:
    """The machine-readable output options every subcommand that prints a result takes:
    ``--json`` (one JSON document on stdout instead of the text; an error becomes
    ``{"error": <class name>, "message": ...}`` with the same exit status) and, with ``out``,
    ``--json-out FILE`` (the same document written to FILE, the text still printed)."""
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON document on stdout instead of text (an "
                        "error too: {\"error\": CLASS, \"message\": ...}, same exit status)")
    if out:
        p.add_argument("--json-out", metavar="FILE", default=None,
                       help="also write the JSON document to FILE (replaced atomically)")


def _print_json(record: Any) -> None:
    sys.stdout.write(json.dumps(record, indent=1, allow_nan=False) + "\n")


def _write_json_file(path: str, record: Any) -> None:
    """``record`` as JSON at ``path``: written to a temp file beside it, then renamed."""
    import os
    import tempfile

    from ..errors import OutputError

    where = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".feedpipe-json-", dir=where)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the JSON document ({e.strerror})") from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{path}: cannot write the JSON document ({e.strerror})") from e
        raise


def emit(a: argparse.Namespace, record: Any, text: str | Callable[[], str] | None) -> None:
    """Hand a subcommand's result to the user: ``record`` (JSON-serialisable) goes to
    ``--json-out FILE`` when given, then to stdout as JSON under ``--json``, else ``text`` (a
    string, or a function making it, for text that costs something to build; ``None``: the
    command has printed its text already) is printed."""
    out = getattr(a, "json_out", None)
    if out:
        _write_json_file(out, record)
    if getattr(a, "json", False):
        _print_json(record)
    elif text is not None:
        print(text() if callable(text) else text)


_emit = emit  # the name the subcommand owners were told to call


def _add_shard(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "shard",
        help="convert a small-file dataset into WebDataset tar shards",
        description=(
            "Convert a small-file dataset into WebDataset tar shards with DALI indexes and a "
            "manifest.json. Files sharing a relative directory and stem form one sample "
            "(cls/0001.jpg + cls/0001.json); keys are encoded so that dots, spaces and unicode "
            "survive the WebDataset first-dot rule (a/cat.v2.jpg stays one sample, field 'jpg'). "
            "Output is deterministic: the same inputs and options give the same bytes whatever "
            "--workers is."
        ),
        epilog=(
            "Manifest files (--manifest): JSONL objects or CSV rows. Column 'key' (optional) "
            "names the sample; 'path' is a file stored under its own extension; '<ext>_path' "
            "is a file stored as field <ext>; every other column is a scalar field stored as "
            "UTF-8 text. Relative paths are taken from SRC.\n\nExamples:\n"
            "  feedpipe shard ./images ./shards --labels-from-dirs --max-bytes 256MB\n"
            "  feedpipe shard s3://bucket/raw ./shards --manifest rows.jsonl --shuffle --seed 1\n"
            "  feedpipe shard train.parquet ./shards --columns image=jpg,label=cls\n"
            "  feedpipe shard ./images ./shards --resume     # after an interrupted run\n\n"
            "Past one machine:\n"
            "  feedpipe shard SRC OUT --part 2/8 --merge     # part 2 of 0..7, e.g. a Slurm array\n"
            "  feedpipe merge OUT                            # or let the last part --merge\n"
            "  feedpipe shard SRC OUT --dask tcp://sched:8786   # tasks on a Dask cluster\n"
            "--part: N runs (any machines, at once or not) each convert a deterministic share of\n"
            "the inputs into their own shards (PREFIX-pIIIIIofNNNNN-*.tar) in the shared OUT; the\n"
            "merged dataset has the same samples in the same order whatever N is. --dask: SRC\n"
            "and OUT must be at the same paths on every worker; the output is byte-identical to\n"
            "a local run."
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
                        "directories, else the general method (list, plan, write); general or "
                        "one-pass force one (a forced one-pass that cannot serve the tree is "
                        "refused, saying why). Same shards either way")
    p.add_argument("--columns", metavar="COL=FIELD,...", default=None,
                   help="Parquet source: send columns to fields (img=jpg,label=cls,id=__key__; "
                        "COL= drops one); the mapping taken is printed")
    p.add_argument("--classes", metavar="NAMES|FILE", default=None,
                   help="Parquet source: class names of the cls column (a,b,c or a file with "
                        "one per line; default: a categorical column's categories)")
    add_json_options(p, out=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_shard(a: argparse.Namespace) -> int:
    from ..convert._shard import shard
    from ..convert._options import ShardOptions

    opts = ShardOptions(
        max_bytes=a.max_bytes, max_samples=a.max_samples, shuffle=a.shuffle, seed=a.seed,
        on_error=a.on_error, prefix=a.prefix, labels_from_dirs=a.labels_from_dirs,
        manifest=a.manifest, workers=a.workers, resume=a.resume, method=a.method, part=a.part,
        merge=a.merge, dask=a.dask, retries=a.retries,
        show_progress=False if a.no_progress else None, columns=a.columns, classes=a.classes)
    s = shard(a.src, a.out, opts)
    emit(a, s.to_dict(), lambda: _shard_text(a, s))
    return 0


def _shard_text(a: argparse.Namespace, s: Any) -> str:
    """The human summary of a conversion (``s``: its ShardSummary)."""
    unit = "rows" if s.method == "table" else "files"
    lines = [f"feedpipe shard: {a.src} -> {s.out}" + (f"   (part {s.part})" if s.part else "")]
    lines += [f"  {line}" for line in s.columns]  # a table source: column -> field
    if s.part:
        count = s.part.split("/")[1]
        lines.append("  merged   all parts -> manifest.json" if s.merged else
                     f"  part     {s.part} done; once all {count} parts are done, run "
                     f"`feedpipe merge {s.out}` (or give the last part --merge)")
    kept = f"   ({s.reused_shards} kept from the interrupted run)" if s.reused_shards else ""
    lines += [
        f"  method   {s.method:>10}   ({s.executor}{'; ' + s.why if s.why else ''})",
        f"  shards   {s.shards:>10}{kept}",
        f"  samples  {s.samples:>10}",
        f"  {unit:<5}    {s.files:>10}",
        f"  bytes    {format_size(s.bytes):>10}",
        f"  skipped  {s.skipped:>10}" + ("   (listed in manifest.json)" if s.skipped else ""),
        f"  time     {s.seconds:>9.2f}s   {s.files_per_s:,.0f} {unit}/s   "
        f"{s.mb_per_s:,.1f} MB/s",
    ]
    lines += [f"  skipped: {sk['path']}: {sk['reason']}" for sk in s.skipped_inputs[:5]]
    return "\n".join(lines)


def _cmd_merge(a: argparse.Namespace) -> int:
    from ..convert._merge import merge

    m = merge(a.out, parts=a.parts)
    emit(a, json.loads(m.to_json()),
         f"feedpipe merge: {m.created_by.get('parts')} parts -> {len(m.shards)} shards, "
         f"{m.total_samples} samples, {len(m.skipped)} skipped; wrote manifest.json")
    return 0


def _cmd_index(a: argparse.Namespace) -> int:
    from ..format._indexer import index_dataset

    r = index_dataset(a.shards, root=a.root, classes=a.classes,
                      show_progress=False if a.no_progress else None)
    m = r.manifest

    def text() -> str:
        lines = [f"feedpipe index: {len(m.shards)} shards, {m.total_samples} samples, "
                 f"fields {', '.join(m.fields)}"]
        if m.classes is not None:
            lines.append(f"  classes  {len(m.classes)} from {r.classes_from}: "
                         f"{', '.join(m.classes[:8])}{', ...' if len(m.classes) > 8 else ''}")
        lines.append(f"  wrote    {len(r.indexes)} .idx files and {r.root}/manifest.json")
        return "\n".join(lines)

    emit(a, r.to_dict(), text)
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
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


def _cmd_demo(a: argparse.Namespace) -> int:
    from ._demo import demo

    def to_stderr(*x: Any) -> None:  # under --json the running commentary is progress
        print(*x, file=sys.stderr, flush=True)

    r = demo(workdir=a.workdir, keep=a.keep, print_fn=to_stderr if a.json else print)
    emit(a, r, None)
    return 0 if r["exactly_once"] else 1


def _size_list(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from e


def _add_probe(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "probe",
        help="measure storage and pipeline throughput; say what bounds samples/s",
        description=(
            "Probe TARGET (a file, a directory of small files, a shard dataset with\n"
            "manifest.json, or any fsspec URL): sequential read MB/s over block sizes and\n"
            "threads, small-file open+read rate, random read latency p50/p99, cold (pages\n"
            "dropped with posix_fadvise) and warm; on shard datasets each pipeline stage's\n"
            "samples/s (read, JPEG decode per core, batching, host-to-device when CUDA is\n"
            "present) and FeedLoader worker scaling. Ends with the bounding stage, the predicted\n"
            "ceiling, the accelerator utilisation for --step-time, and advice.\n\n"
            "Each phase stops after --duration seconds. Nothing is written except --json-out,\n"
            "--plot and, with --generate, one test file in a temp dir that is deleted afterwards."
        ),
        epilog=(
            "Examples:\n"
            "  feedpipe probe ./shards --step-time 120 --batch-size 256 --workers 8\n"
            "  feedpipe probe ./images --json-out probe.json --plot probe.png\n"
            "  feedpipe probe s3://bucket/shards --duration 10 --json | jq .verdict\n"
            "  feedpipe probe /mnt/nvme --generate 4GiB --block-sizes 1MiB,16MiB --threads 1,8"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="file, directory, shard dataset or fsspec URL (with --generate: the "
                        "directory to generate test data in; default: the system temp dir)")
    add_json_options(p, out=True)
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a PNG: sequential read curves (small-file rates for a "
                        "directory) and the stage bars (needs feedpipe[plot])")
    p.add_argument("--duration", type=float, default=5.0, metavar="S",
                   help="seconds per measurement phase (default: 5; a dataset has about ten)")
    p.add_argument("--step-time", type=float, default=None, metavar="MS",
                   help="accelerator time per batch, for the utilisation figure")
    p.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="samples per batch (default: 64)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="DataLoader workers to plan for (default: usable CPUs); scaling is "
                        "measured at 0, 1, 2 and N")
    p.add_argument("--block-sizes", type=_size_list, default=None, metavar="LIST",
                   help="sequential block sizes (default: 64KiB,256KiB,1MiB,4MiB,16MiB)")
    p.add_argument("--threads", type=_int_list, default=None, metavar="LIST",
                   help="sequential reader threads (default: 1,2,4,8,16)")
    p.add_argument("--random-block", type=parse_size, default=4096, metavar="SIZE",
                   help="bytes per random read (default: 4KiB)")
    p.add_argument("--generate", type=parse_size, default=None, metavar="SIZE",
                   help="write a SIZE test file in a temp dir, probe it, delete it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_probe(a: argparse.Namespace) -> int:
    from ..diagnostics._probe import probe

    r = probe(a.target, duration=a.duration, step_time_ms=a.step_time, batch_size=a.batch_size,
              workers=a.workers, block_sizes=a.block_sizes, threads=a.threads,
              random_block=a.random_block, generate=a.generate, plot_path=a.plot,
              show_progress=False if a.no_progress else None)
    emit(a, r.to_dict(), r.table)
    return 0


def _cmd_cache(a: argparse.Namespace) -> int:
    from ._cache import run

    return run(a)


_DEMO_EXAMPLES = """\
Examples:
  feedpipe demo
  feedpipe demo --workdir ./feedpipe-demo     # keep the images, shards and caches to look at
  feedpipe demo --json | jq .exactly_once     # the figures as JSON; the commentary on stderr

The JSON document: {"workdir", "kept", "samples", "shards", "streamed", "epochs",
"exactly_once", "tiers": {"l1", "decoded", "l2"}, "device"}."""


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(
        prog="feedpipe",
        description="feedpipe keeps GPUs fed: shard small-file datasets, stream them "
                    "deterministically to every rank and worker, cache, and deliver batches.",
    )
    parser.add_argument("--version", action="version", version=f"feedpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_shard(sub)

    p = sub.add_parser("merge", help="write one manifest for the parts of `shard --part I/N`",
                       description="Join the parts written by `feedpipe shard SRC OUT --part I/N` "
                                   "(I = 0..N-1) under one manifest.json and wids.json. Refuses, "
                                   "naming the part, when a part is missing, unfinished, made "
                                   "from other inputs or options, or has lost a shard.",
                       epilog="Examples:\n"
                              "  feedpipe merge ./shards             # after every "
                              "`feedpipe shard SRC ./shards --part I/N`\n"
                              "  feedpipe merge ./shards --parts 8   # refuse unless all 8 "
                              "parts are there\n"
                              "  feedpipe merge ./shards --json | jq .total_samples\n"
                              "Parts written by feedpipe.ShardWriter(out, part=(i, n)) merge "
                              "the same way.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="the directory the parts wrote into")
    p.add_argument("--parts", type=int, default=None, metavar="N",
                   help="the expected number of parts (default: read from the part records)")
    add_json_options(p, out=True)

    p = sub.add_parser(
        "index", help="write .idx files and a manifest for existing shards",
        description="Adopt WebDataset shards made by other tools (webdataset's ShardWriter, tar): "
                    "read every tar header once, write a DALI v1.2 .idx beside each shard and a "
                    "manifest.json (with sha256 of each shard) at the dataset root. Every shard "
                    "is checked before anything is written: a truncated or malformed shard, or "
                    "a key found twice, is named and nothing is written. Compressed shards "
                    "(.tar.gz, .tgz) are refused: decompress them first.",
        epilog="Examples:\n"
               "  feedpipe index ./shards                       # every *.tar in the directory\n"
               "  feedpipe index 'shards/train-*.tar' --root shards\n"
               "  feedpipe index ./shards --classes cat,dog,zebra   # what cls 0, 1, 2 mean\n"
               "  feedpipe index ./shards --classes classes.txt     # one name per line\n"
               "  gunzip -k shards/*.tar.gz && feedpipe index ./shards\n"
               "  feedpipe index ./shards --json | jq .total_samples",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="+", metavar="SHARD", help="shard files, globs or directories")
    p.add_argument("--root", default=None,
                   help="dataset root for manifest.json (default: the first shard's directory)")
    p.add_argument("--classes", metavar="NAMES|FILE", default=None,
                   help="class names to record in the manifest (what the 'cls' values index), "
                        "as `feedpipe shard --labels-from-dirs` records them: a comma-separated "
                        "list, or a file with one name per line (an existing file wins)")
    add_json_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "verify", help="check shards against their indexes and the manifest",
        description="Check every shard of a dataset: size and sha256 against the manifest, every "
                    "tar header, every .idx entry against the headers. Exit 0 when sound, 1 "
                    "with each problem's shard, offset and kind otherwise. Warnings say what was "
                    "not checked: a shard the manifest gives no sha256 for, a .tar beside the "
                    "shards that the manifest does not list.",
        epilog="Examples:\n"
               "  feedpipe verify ./shards\n"
               "  feedpipe verify s3://bucket/shards\n"
               "  feedpipe verify ./shards --json     # {ok, problems: [{shard, offset, kind, "
               "key, message}], warnings: [...]}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", metavar="DATASET", help="dataset root (path or fsspec URL)")
    add_json_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("demo", help="run the whole pipeline on a small synthetic dataset",
                       description="Make a small synthetic image dataset in a temp dir, shard it,\n"
                                   "stream it, and print what happened. Exit status 1 if an\n"
                                   "epoch did not deliver every sample exactly once.",
                       epilog=_DEMO_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None,
                   help="where to work, kept afterwards (default: a temp dir, removed); a "
                        "directory an earlier demo used is reused: its images/, shards/ and "
                        "cache directories are made anew")
    p.add_argument("--keep", action="store_true", help="keep the temp work directory")
    add_json_options(p, out=True)
    _add_probe(sub)
    from ._cache import add_parser as _add_cache

    _add_cache(sub)
    return parser


_COMMANDS = {"shard": _cmd_shard, "merge": _cmd_merge, "index": _cmd_index, "verify": _cmd_verify,
             "demo": _cmd_demo,
             "probe": _cmd_probe, "cache": _cmd_cache}


def _failed(args: argparse.Namespace, e: BaseException, message: str, status: int) -> int:
    """Say what went wrong on stderr and, under ``--json``, as a JSON record on stdout."""
    print(f"feedpipe {args.command}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_json({"error": type(e).__name__, "message": str(e) or message})
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``feedpipe`` subcommand; returns the exit status.

    0: done; 1: a check found problems (``verify``); 2: bad input or options (the message says
    which); 130: interrupted. A reader that closes stdout early (``feedpipe ... | head``) ends
    the command quietly with status 141, as a shell reports a process ended by SIGPIPE."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = "--json" in argv
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help, --version or a usage error, already printed
            sys.stdout.flush()
            raise
        try:
            status = _COMMANDS[args.command](args)
        except (FeedpipeError, ValueError) as e:  # ValueError: an option value the library refused
            status = _failed(args, e, f"error: {e}", 2)
        except KeyboardInterrupt as e:
            status = _failed(args, e, "interrupted", 130)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        import os

        # the reader is gone: point stdout at /dev/null so that the exit-time flush is silent
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
