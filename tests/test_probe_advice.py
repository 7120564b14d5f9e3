"""What the probe tells a user: one voice (no advice that contradicts another; one verdict, the
same part the loader's own accounts name; advice about what bounds first; why it ran fewer
workers than asked or a route far slower than its best), and torch's worker-count warning
once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from _servers import python_server
from hypothesis import given, settings
from hypothesis import strategies as st
from test_probe import _figures

from feedpipe import FeedDataset
from feedpipe.convert._synth import make_image_folder
from feedpipe.diagnostics._accounts import fewer_workers, slower_than_best
from feedpipe.diagnostics._pipeline import loader_stage
from feedpipe.diagnostics._probe import probe
from feedpipe.diagnostics._target import resolve
from feedpipe.diagnostics._verdict import PART_OF, STAGES_OF, decide

EXAMPLE = str(Path(__file__).resolve().parent.parent / "shards" / "example")


def test_a_pipeline_that_keeps_up_frames_the_remedies_as_for_a_shorter_step() -> None:
    """'Enable the decoded store' and 'no change is needed' were two bullets side by side."""
    advice = decide(_figures(step_time_ms=10_000.0)).advice  # decode bounds, far above need
    keeps = [i for i, a in enumerate(advice) if "keeps up" in a]
    store = [i for i, a in enumerate(advice) if "decoded store" in a]
    assert keeps and store and keeps[0] < store[0], advice
    assert "no change is needed for this step time" in advice[keeps[0]]
    assert re.search(r"Only for a step shorter than \d+ ms would the following help:$",
                     advice[keeps[0]]), advice[keeps[0]]


def test_a_pipeline_that_falls_short_gets_the_remedies_as_they_were() -> None:
    advice = decide(_figures(step_time_ms=1.0)).advice
    assert not any("keeps up" in a or "Only for a step" in a for a in advice)
    assert any(a.startswith("Decoding bounds: enable the decoded store") for a in advice)


def test_torch_worker_count_warning_is_said_once() -> None:
    """torch warns from two places of one DataLoader; the probe measured one with more workers
    than CPUs and the user read the same paragraph twice."""
    many = (os.cpu_count() or 1) + 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            loader_stage(EXAMPLE, None, list, 4, many, 0.05)
    about = [w for w in seen if "worker processes in total" in str(w.message)]
    assert len(about) <= 1, [str(w.message) for w in about]


# -- one verdict, consistent with the loader's own accounts, and advice about what bounds first.
# Each situation is set up so that its bound is not in doubt (a server delay far longer than
# decoding a small JPEG; JPEGs far slower to decode than to read), then the verdict and the
# ORDER of the advice are checked; the look-alikes, where storage really bounds, must be advised
# about storage.

SERVED = Path(EXAMPLE)  # 24 small JPEG samples in 3 shards
FAST: dict[str, Any] = {"duration": 0.2, "block_sizes": [64 << 10], "threads": [1],
                        "batch_size": 1, "workers": 1, "show_progress": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the example dataset as ``data/``, to be served over HTTP."""
    root = tmp_path_factory.mktemp("served")
    shutil.copytree(SERVED, root / "data")
    return root


@pytest.mark.parametrize("tail", ["/data/", "/data", "/data/manifest.json"])
def test_an_http_folder_url_is_probed_as_the_dataset(served: Path, tail: str) -> None:
    """An HTTP folder URL (as FeedDataset takes it) was probed as one file (a listing page) or
    refused as 'no such object'; only .../manifest.json worked."""
    with python_server(served) as srv:
        t = resolve(srv.url + tail, seconds=5)
        assert len(FeedDataset(srv.url + tail)) == 24  # what FeedDataset makes of the same URL
    assert t.kind == "dataset" and t.samples == 24 and len(t.files) == 3, (t.kind, t.files)
    assert all(p.startswith(srv.url + "/data/data-") for p, _ in t.files)


def test_an_http_url_without_a_manifest_is_still_a_file(served: Path) -> None:
    """The look-alike: a URL naming one object is that object, not a dataset."""
    with python_server(served) as srv:
        t = resolve(srv.url + "/data/data-000000.tar", seconds=5)
    assert t.kind == "file" and t.files[0][1] == (SERVED / "data-000000.tar").stat().st_size


def test_slow_http_storage_is_named_fetch_and_advised_a_cache_dir_first(served: Path) -> None:
    """Over a slow link the probe said 'read' and never mentioned cache_dir= while the loader's
    own accounts said 'fetch'."""
    with python_server(served, "--delay", "0.05") as srv:
        report = probe(srv.url + "/data/", **FAST)
    doc = report.to_dict()
    v = doc["verdict"]
    (run,) = doc["pipeline"]["accounts"]
    assert run["loop_bound"] == "fetch", run["time"]  # what the loader's stats() say
    assert run["bound"] in {"fetch", "startup"}, run["time"]
    assert v["bounding_part"] == "fetch", v
    assert v["advice_about"][0] == "fetch" and "cache_dir=" in v["advice"][0], v["advice"]
    assert v["advice"][0].startswith("Remote fetches bound"), v["advice"]
    verdict = next(x for x in report.table().splitlines() if x.startswith("Verdict:"))
    assert verdict.startswith("Verdict: fetch (the read stage) bounds"), verdict


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain folder of large JPEGs: decoding one costs far more than reading it."""
    root = tmp_path_factory.mktemp("photos")
    make_image_folder(str(root), classes=2, per_class=3, min_size=1024, max_size=1024,
                      sidecar_every=1000)
    return root


def test_a_jpeg_folder_is_advised_about_decoding_first(photos: Path) -> None:
    """On a plain JPEG folder the first advice was about storage (shard the small files), which
    did not bound the run."""
    v = probe(str(photos), **FAST).verdict
    assert v["bounding_stage"] == "decode" and v["bounding_part"] == "compute", v
    assert v["advice_about"][0] == "compute", v["advice"]
    assert v["advice"][0].startswith("Decoding bounds"), v["advice"]
    shard = [i for i, a in enumerate(v["advice"]) if a.startswith("Shard the small files")]
    assert shard and shard[0] > 0, v["advice"]  # still said, after what bounds


def test_a_folder_whose_storage_bounds_is_advised_about_storage_first() -> None:
    """The look-alike: slow small files, fast decoding: sharding comes first."""
    v = decide(_figures(kind="directory", target="/data/img", storage=50.0,
                        small_files_per_s=60.0, small_file_mb_per_s=6.0, read=None,
                        batch=None, jpeg=True))
    assert v.bounding_stage == "storage" and v.bounding_part == "fetch"
    assert v.advice[0].startswith("Shard the small files"), v.advice
    assert v.advice_about[0] == "fetch"


def test_a_local_dataset_whose_storage_bounds_is_advised_about_storage_first() -> None:
    v = decide(_figures(storage=100.0, storage_mb_per_s=1.0, workers=2))  # cores idle too
    assert v.bounding_part == "fetch" and v.advice[0].startswith("Storage bounds"), v.advice
    assert not any("Remote fetches" in a for a in v.advice)  # local: no remote advice


def test_remote_fetches_with_a_cache_dir_are_not_told_to_set_one() -> None:
    v = decide(_figures(remote=True, read=5.0, cache_dir=True, loader_bound="fetch"))
    assert v.bounding_part == "fetch" and "cache_dir=LOCAL" not in v.advice[0], v.advice


def test_the_loaders_accounts_decide_where_the_stage_rates_disagree() -> None:
    """The stage rates say decoding; the FeedLoader a script gets spent its time fetching: one
    verdict, the measured one, said as such, its advice first."""
    f = _figures(loader_bound="fetch", loader_time={"fetch": 9.0, "compute": 1.0, "sink": 0.1,
                                                    "wait": 10.0})
    v = decide(f)
    assert v.bounding_part == "fetch" and v.bounding_stage in {"read", "storage"}, v
    assert "the verdict follows that measurement" in (v.bound_basis or "")
    assert v.advice_about[0] == "fetch", v.advice
    # the ceiling stays the least of the stage rates: no part delivers more than that
    assert v.ceiling_samples_per_s == decide(_figures()).ceiling_samples_per_s
    agree = decide(_figures(loader_bound="compute"))
    assert agree.bounding_stage == "decode" and "names the same part" in (agree.bound_basis or "")
    # the device copy is outside the loader's accounts: they do not overrule it
    h2d = decide(_figures(h2d=10.0, loader_bound="compute"))
    assert h2d.bounding_stage == "h2d" and h2d.bounding_part == "h2d"


def test_fewer_workers_than_asked_and_a_slow_route_say_why() -> None:
    assert fewer_workers(8, 8, 16) is None and fewer_workers(None, 2, 2) is None
    said = fewer_workers(8, 2, 2)
    assert said is not None and "not the 8 asked for" in said and "2 usable CPU" in said
    run = {"samples_per_s": 10.0, "workers": 2, "seconds": 2.0, "route": "rows-workers",
           "time": {"startup": 3.0, "fetch": 0.1, "compute": 0.4, "sink": 0.1}}
    why = slower_than_best(run, [{"workers": 8, "samples_per_s": 300.0}])
    assert why is not None and "start-up took 3 s" in why and "num_workers=8" in why, why
    assert slower_than_best(run, [{"workers": 2, "samples_per_s": 15.0}]) is None  # near best


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_more_workers_than_cores_are_explained_in_text_and_json(tmp_path: Path) -> None:
    """`--workers 8` on a 2-core machine reported 2 workers 'as a script gets it' and a route
    far slower than its best, without saying why. Here the probe runs on one core."""
    def one_core() -> None:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    out = tmp_path / "probe.json"
    r = subprocess.run(
        [sys.executable, "-m", "feedpipe", "probe", EXAMPLE, "--workers", "2", "--duration",
         "0.2", "--batch-size", "4", "--block-sizes", "64KiB", "--threads", "1",
         "--no-progress", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, preexec_fn=one_core)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    (run,) = doc["pipeline"]["accounts"]
    assert run["workers"] == 1 and "not the 2 asked for" in run["workers_note"], run
    v = doc["verdict"]
    assert v["parallelism"] == 1 and "2 workers asked for" in v["parallelism_note"], v
    assert run["workers_note"] in r.stdout and v["parallelism_note"] in r.stdout, r.stdout
    if "slower_note" in run:
        assert run["slower_note"] in r.stdout


rates = st.one_of(st.none(), st.floats(1.0, 1e6))


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["dataset", "directory"]), storage=rates, read=rates, decode=rates,
       batch=rates, h2d=rates, remote=st.booleans(), cache_dir=st.booleans(),
       workers=st.integers(1, 16), cpus=st.integers(1, 16),
       loader_bound=st.sampled_from([None, "fetch", "compute", "sink"]),
       small=st.one_of(st.none(), st.floats(1.0, 1e5)),
       step=st.one_of(st.none(), st.floats(1.0, 1e4)),
       loader=st.dictionaries(st.integers(0, 16), st.floats(1.0, 1e5), max_size=4))
def test_the_verdict_names_one_part_and_advises_it_first(**kw: Any) -> None:
    """Whatever was measured: the bounding part is the bounding stage's part of the loader's
    accounts; where the loader's accounts name a part measured here (and no device copy
    bounds), that part; and the first advice that addresses a part addresses that one."""
    small = kw.pop("small")
    step = kw.pop("step")
    f = _figures(**kw, small_files_per_s=small, small_file_mb_per_s=small, step_time_ms=step)
    v = decide(f)
    assert len(v.advice) == len(v.advice_about) >= 1
    if v.bounding_stage is None:
        assert v.bounding_part is None
        return
    assert v.bounding_part == PART_OF[v.bounding_stage]
    measured = f.loader_bound is not None and any(
        v.stage_samples_per_s.get(s) for s in STAGES_OF[f.loader_bound])
    if measured and v.bounding_stage != "h2d":
        assert v.bounding_part == f.loader_bound, v
    first = next(a for a in v.advice_about if a is not None)
    assert first == v.bounding_part, (v.bounding_stage, v.advice)
