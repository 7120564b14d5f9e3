"""benchmarks/render_results.py on committed result sets, rendered into a temporary directory: the
Markdown names the benchmark, says where and when it ran and carries the JSON's own figures; the
chart is a PNG. The figures are read from the JSON, so a re-run benchmark does not break this."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
# imported with benchmarks/ on the path only for the import: left there, its datasets.py would
# stand in for Hugging Face's `datasets` in every test that runs later
sys.path.insert(0, str(BENCH))
try:
    import render_results
    from result_tables import number
finally:
    sys.path.remove(str(BENCH))

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _render(name: str, out: Path) -> tuple[dict[str, Any], str]:
    src = BENCH / "results" / f"{name}.json"
    doc = json.loads(src.read_text(encoding="utf-8"))
    written = render_results.render(str(src), out_dir=str(out))
    assert sorted(Path(p).name for p in written) == [f"{name}.md", f"{name}.png"]
    png = (out / f"{name}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    return doc, (out / f"{name}.md").read_text(encoding="utf-8")


def _environment_is_stated(doc: dict[str, Any], md: str) -> None:
    env = doc["environment"]
    line = next(ln for ln in md.splitlines() if ln.startswith("**Environment:** "))
    assert env["date_utc"][:10] in line
    assert f"{env['cpu_count']} CPUs" in line
    assert env["git"]["revision"][:12] in line
    assert ("uncommitted changes" in line) == bool(env["git"]["dirty"])


def test_dask_set(tmp_path: Path) -> None:
    doc, md = _render("bench_dask", tmp_path)
    assert md.startswith("# bench_dask: conversion on a Dask cluster\n")
    _environment_is_stated(doc, md)
    assert f"| files | {doc['params']['files']:,} |" in md
    rates = {s: r["files_per_s"] for s, r in doc["stats"].items() if r["files_per_s"]}
    assert len(rates) == 5
    for system, rate in rates.items():
        row = next(ln for ln in md.splitlines() if ln.startswith(f"| {system} |"))
        assert f"| {number(rate)} |" in row
    assert "![bench_dask](bench_dask.png)" in md


def test_hash_set(tmp_path: Path) -> None:
    doc, md = _render("hash", tmp_path)
    assert md.startswith("# hash: content hash of the L2 function index\n")
    _environment_is_stated(doc, md)
    for size, algos in doc["summary"].items():
        assert f"### summary › {size}" in md
        for algo, r in algos.items():
            assert f"| {algo} | {number(r['us'])} | {number(r['gb_per_s'])} |" in md
    assert "(`times_s`) are in `hash.json`" in md  # per-round times stay in the JSON


def test_cache_budget_set_keeps_the_summary_text(tmp_path: Path) -> None:
    doc, md = _render("cache_budget", tmp_path)
    assert md.startswith("# cache_budget: L1 cache budget node-wide\n")
    _environment_is_stated(doc, md)
    assert f"Command: `{doc['command']}`" in md
    assert "```text\n" + doc["summary_text"].strip("\n") + "\n```" in md
    budget_row = next(ln for ln in md.splitlines() if ln.startswith("| budget |"))
    assert f"| {doc['results']['budget']['peak_bytes']:,} |" in budget_row


def test_existing_files_are_kept_unless_forced(tmp_path: Path) -> None:
    src = str(BENCH / "results" / "resize.json")
    assert len(render_results.render(src, out_dir=str(tmp_path))) == 2
    (tmp_path / "resize.md").write_text("kept\n", encoding="utf-8")
    assert render_results.render(src, out_dir=str(tmp_path)) == []
    assert (tmp_path / "resize.md").read_text(encoding="utf-8") == "kept\n"
    assert len(render_results.render(src, out_dir=str(tmp_path), force=True)) == 2
    assert (tmp_path / "resize.md").read_text(encoding="utf-8").startswith("# resize: ")
