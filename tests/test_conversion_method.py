"""The conversion method: chosen by one pure function, forced with ``method=``/``--method``
(refused with a sentence when it cannot serve the input), reported in the summary, the printed
summary and the manifest; the options dataclass and its keyword overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import dataset_bytes, method_of, run_feedpipe, write_tree

import feedpipe
from feedpipe.convert._method import Facts, choose_method
from feedpipe.convert._options import ShardOptions
from feedpipe.errors import MethodError


@pytest.mark.parametrize(("facts", "method", "executor"), [
    (Facts(workers=2), "one-pass", "staged"),
    (Facts(workers=1), "one-pass", "staged"),
    (Facts(requested="one-pass", workers=2), "one-pass", "staged"),
    (Facts(requested="general", workers=2), "general", "pool"),
    (Facts(requested="general", workers=1), "general", "serial"),
    (Facts(resume=True, workers=2), "general", "pool"),
    (Facts(part=True, workers=1), "general", "serial"),
    (Facts(shuffle=True, workers=2), "general", "pool"),
    (Facts(source="manifest", workers=2), "general", "pool"),
    (Facts(local=False, workers=2), "general", "pool"),
    (Facts(dask=True, workers=8), "general", "dask"),
    (Facts(gave_back="files at the top", workers=2), "general", "pool"),
    (Facts(source="table", workers=2), "table", "staged"),
    (Facts(source="table", workers=1), "table", "staged"),
    (Facts(source="table", requested="one-pass"), "table", "staged"),
    (Facts(source="table", requested="general", workers=2), "table", "pool"),
    (Facts(source="table", workers=2, resume=True), "table", "pool"),
    (Facts(source="table", workers=2, local=False), "table", "pool"),
    (Facts(source="table", workers=1, resume=True, shuffle=True), "table", "serial"),
    (Facts(source="table", dask=True, part=True), "table", "dask"),
])
def test_the_table_of_choices(facts: Facts, method: str, executor: str) -> None:
    got = choose_method(facts)
    assert (got.method, got.executor) == (method, executor)
    assert bool(got.why) == (facts.gave_back is not None)


@pytest.mark.parametrize(("facts", "match"), [
    (Facts(requested="one-pass", resume=True), r"one-pass cannot serve this run: --resume"),
    (Facts(requested="one-pass", part=True, shuffle=True), r"--part; --shuffle"),
    (Facts(requested="one-pass", source="manifest"), r"--manifest"),
    (Facts(requested="one-pass", local=False), r"not a local directory"),
    (Facts(requested="one-pass", dask=True), r"cannot run on a Dask cluster"),
    (Facts(requested="one-pass", gave_back="files at the top"),
     r"cannot convert this tree: files at the top; use --method auto or general"),
    (Facts(requested="one-pass", source="table", shuffle=True),
     r"one-pass cannot serve this table: --shuffle"),
    (Facts(requested="one-pass", source="table", dask=True), r"cannot run on a Dask cluster"),
])
def test_a_forced_method_that_cannot_serve_is_refused_saying_why(facts: Facts,
                                                                 match: str) -> None:
    with pytest.raises(MethodError, match=match):
        choose_method(facts)


def _tree(root: Path) -> Path:
    write_tree(root, [f"{d}/{i}.jpg" for d in "abc" for i in range(4)])
    return root


def test_the_method_is_in_the_summary_the_printed_summary_and_the_manifest(
        tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    outs = {}
    for method, executor in [("auto", "one pass, 2 workers"),
                             ("general", "process pool, 2 workers")]:
        out = tmp_path / method
        r = run_feedpipe("shard", src, out, "--workers", "2", "--max-samples", "5",
                         "--method", method)
        assert r.returncode == 0, r.stderr
        taken = "one-pass" if method == "auto" else "general"
        assert f"  method   {taken:>10}   ({executor})\n" in r.stdout, r.stdout
        assert method_of(out) == taken
        outs[method] = dataset_bytes(out)
        r = run_feedpipe("shard", src, tmp_path / f"{method}-json", "--workers", "2",
                         "--max-samples", "5", "--method", method, "--json")
        doc = json.loads(r.stdout)
        assert (doc["method"], doc["executor"], doc["why"]) == (taken, executor, "")
    assert outs["auto"] == outs["general"]  # the same bytes but the recorded method
    # auto falls back to the general method and says why; forced one-pass is refused instead
    (src / "top.txt").write_text("x")
    s = feedpipe.shard(str(src), str(tmp_path / "fallback"), workers=2, max_samples=5)
    assert (s.method, s.executor) == ("general", "process pool, 2 workers")
    assert s.why == ("one pass gave the tree back: files at the top of the tree (one-pass "
                     "stages top-level directories)")
    r = run_feedpipe("shard", src, tmp_path / "forced", "--method", "one-pass")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--method one-pass cannot convert this tree: files at the top" in r.stderr
    assert not (tmp_path / "forced").exists()  # made for nothing: removed again
    r = run_feedpipe("shard", src, tmp_path / "fallback", "--max-samples", "5", "--resume",
                     "--method", "one-pass")
    assert r.returncode == 2 and "--resume (the general method keeps" in r.stderr, r.stderr


def test_forced_one_pass_into_a_full_output_says_what_is_wrong_with_it(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.txt").write_text("x")
    with pytest.raises(feedpipe.OutputError, match="not empty"):
        feedpipe.shard(str(src), str(full), method="one-pass", workers=2)


def test_options_dataclass_and_keyword_overrides(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    opts = ShardOptions(max_samples=5, workers=1, method="general")
    a = feedpipe.shard(str(src), str(tmp_path / "a"), opts)
    b = feedpipe.shard(str(src), str(tmp_path / "b"), opts, workers=2)  # an override
    feedpipe.shard(str(src), str(tmp_path / "c"), max_samples=5, workers=2,
                       method="general")
    assert (a.executor, b.executor) == ("in this process, one worker",
                                        "process pool, 2 workers")
    assert dataset_bytes(tmp_path / "a") == dataset_bytes(tmp_path / "b") == dataset_bytes(
        tmp_path / "c")
    assert opts.output_options() == {
        "max_bytes": 256 << 20, "max_samples": 5, "shuffle": False, "seed": 0,
        "on_error": "raise", "prefix": "data", "labels_from_dirs": False, "manifest": None}
    with pytest.raises(TypeError, match="unknown option.*max_sample\\b"):
        feedpipe.shard(str(src), str(tmp_path / "d"), max_sample=5)
    for bad, match in [({"method": "fast"}, "method must be one of auto, general, one-pass"),
                       ({"workers": 0}, "workers must be at least 1"),
                       ({"start_method": "thread"}, "start_method must be one of")]:
        with pytest.raises(ValueError, match=match):
            ShardOptions(**bad)  # type: ignore[arg-type]
    r = run_feedpipe("shard", src, tmp_path / "e", "--method", "fast")
    assert r.returncode == 2 and "invalid choice: 'fast'" in r.stderr
