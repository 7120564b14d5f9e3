"""The ``feedpipe`` command's common surface, subcommand by subcommand, in real subprocesses:
``--json`` prints one JSON document on stdout (an error too, as ``{"error", "message"}`` with the
same exit status), ``--json-out FILE`` writes it, a reader that closes stdout early ends the
command quietly, and every ``--help`` ends with examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_feedpipe

from feedpipe.cli._main import build_parser

# subcommands whose --help must end with an Examples: block (every one)
WITH_EXAMPLES = ["cache", "demo", "index", "ledger", "merge", "probe", "shard", "verify"]


def run_into_closed_pipe(*args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``feedpipe ARGS`` with stdout a pipe whose reader has already gone (what ``| head -c1``
    becomes once head has its byte): every write to stdout fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "feedpipe", *map(str, args)], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=timeout, check=False)
    finally:
        os.close(w)


def subcommands() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(sub.choices)  # type: ignore[union-attr]


def test_the_subcommands_this_file_covers() -> None:
    assert subcommands() == ["cache", "demo", "index", "ledger", "merge", "probe", "shard",
                             "verify"]
    assert WITH_EXAMPLES == subcommands()


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_help_ends_with_examples(name: str) -> None:
    h = run_feedpipe(name, "--help")
    assert h.returncode == 0, h.stderr
    examples = h.stdout[h.stdout.rindex("Examples:"):]
    assert examples.count(f"feedpipe {name}") >= 2, examples
    # the block ends the help: nothing but indented example lines after its heading
    assert all(line.startswith("  ") for line in examples.splitlines()[1:]), examples
    assert "--json" in h.stdout


@pytest.mark.parametrize("args", [
    ("shard", "{tmp}/nope", "{tmp}/out"),
    ("merge", "{tmp}/nope"),
    ("index", "{tmp}/nope.tar"),
    ("verify", "{tmp}/nope"),
    ("probe", "{tmp}/nope"),
    ("cache", "stats", "{tmp}/nope"),
    ("ledger", "{tmp}/nope"),
])
def test_an_error_under_json_is_a_json_record_with_the_same_status(
        args: tuple[str, ...], tmp_path: Path) -> None:
    argv = [a.format(tmp=tmp_path) for a in args]
    plain = run_feedpipe(*argv)
    r = run_feedpipe(*argv, "--json")
    assert plain.returncode == r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"error", "message"}
    assert doc["error"].endswith("Error") and doc["message"]
    assert str(tmp_path / "nope") in doc["message"]
    assert doc["message"] in r.stderr and doc["message"] in plain.stderr
    assert "Traceback" not in r.stderr


def test_a_usage_error_under_json_is_a_json_record(tmp_path: Path) -> None:
    r = run_feedpipe("probe", tmp_path, "--duration", "soon", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout) == {
        "error": "UsageError",
        "message": "feedpipe probe: argument --duration: invalid float value: 'soon'"}
    assert "usage: feedpipe probe" in r.stderr


def test_probe_json_is_the_document_alone_and_json_out_writes_it(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"x" * 8192)
    quick = ["--duration", "0.05", "--no-progress"]
    r = run_feedpipe("probe", tmp_path / "d", *quick, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "feedpipe-probe" and doc["target"]["kind"] == "directory"
    assert "Verdict:" not in r.stdout + r.stderr  # no table under --json
    out = tmp_path / "probe.json"
    t = run_feedpipe("probe", tmp_path / "d", *quick, "--json-out", out)
    assert t.returncode == 0, t.stderr
    assert "Verdict:" in t.stdout  # the table, and the file beside it
    assert json.loads(out.read_text())["target"]["kind"] == "directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "probe.json"]  # no temp file left
    bad = run_feedpipe("probe", tmp_path / "d", *quick, "--json-out", tmp_path / "no" / "p.json")
    assert bad.returncode == 2 and "cannot write the JSON document" in bad.stderr


@pytest.mark.slow
def test_a_closed_stdout_ends_every_subcommand_quietly(sharded: Path, image_folder: Path,
                                                       tmp_path: Path) -> None:
    """``feedpipe ... | head -c1``: no BrokenPipeError traceback, for a result, an error record,
    --help and the plain text alike."""
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.bin").write_bytes(b"x" * 8192)
    runs = {
        "shard": ["shard", image_folder, tmp_path / "out", "--json", "--no-progress",
                  "--workers", "1"],
        "merge": ["merge", tmp_path / "nope", "--json"],
        "index": ["index", tmp_path / "nope.tar", "--json"],
        "verify": ["verify", sharded, "--json", "--no-progress"],
        "demo": ["demo", "--workdir", tmp_path / "demo", "--json"],
        "probe": ["probe", small, "--duration", "0.05", "--no-progress", "--json"],
        "cache": ["cache", "stats", tmp_path, "--json"],
        "ledger": ["ledger", tmp_path / "nope", "--json"],
        "cache (text)": ["cache", "stats", tmp_path],
        "verify (text)": ["verify", sharded, "--no-progress"],
    }
    assert {k.split()[0] for k in runs} == set(subcommands())
    runs.update({f"{name} --help": [name, "--help"] for name in subcommands()})
    for what, argv in runs.items():
        r = run_into_closed_pipe(*argv)
        # 141: ended by the closed pipe; argparse's --help ignores a failed write (status 0)
        assert r.returncode == (0 if what.endswith("--help") else 141), (what, r.stderr)
        assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, (what, r.stderr)
        assert "Exception ignored" not in r.stderr, (what, r.stderr)
