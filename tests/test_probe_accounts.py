"""``feedpipe probe`` runs the real thing: the FeedLoader a script gets (the route it chooses, or
each route named with ``--route``), with its per-part times, bound and bytes and requests per
epoch from ``stats()``; a remote dataset's requests, bytes and cost per epoch; a storage verdict
that quotes the cold (device) rate with the warm one beside it; the per-part times drawn.

Every run uses a fraction of a second per phase; no test asserts a speed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _servers import python_server
from conftest import run_feedpipe

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe.convert._synth import make_image_folder
from feedpipe.diagnostics import _pagecache as pagecache
from feedpipe.diagnostics._accounts import epoch_cost
from feedpipe.diagnostics._pipeline import ImageDecode, choose_collate
from feedpipe.diagnostics._probe import probe

QUICK: dict[str, Any] = {"duration": 0.3, "block_sizes": [64 << 10], "threads": [1],
                         "batch_size": 8, "workers": 1, "show_progress": False}
EXAMPLE = Path(__file__).resolve().parent.parent / "shards" / "example"
TIME_KEYS = {"startup", "fetch", "compute", "sink", "wait", "step", "wall", "parts_in"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 JPEG samples (with a cls field) in 4 shards."""
    root = tmp_path_factory.mktemp("probe")
    make_image_folder(str(root / "src"), classes=3, per_class=8, min_size=16, max_size=32)
    feedpipe.shard(str(root / "src"), str(root / "shards"), max_samples=6, labels_from_dirs=True,
                   workers=1, show_progress=False)
    return root / "shards"


def test_the_probe_runs_the_loader_a_script_gets(dataset: Path) -> None:
    report = probe(str(dataset), **QUICK)
    (run,) = report.to_dict()["pipeline"]["accounts"]
    # the loader a script writes for the same data, decoder and worker count chooses the same
    decode = ImageDecode(["jpg"])
    ds = FeedDataset(str(dataset), transform=decode)
    collate, _ = choose_collate([decode(ds.sample(i)) for i in range(24)], 8)
    script = FeedLoader(ds, batch_size=8, num_workers=1, collate_fn=collate)
    assert run["asked"] == "auto" and run["route"] == script.route.name
    assert set(run["time"]) == TIME_KEYS and run["time"]["wall"] > 0
    assert run["bound"] in {"startup", "fetch", "compute", "sink", "step"}
    assert run["samples"] > 0 and 0 < run["epoch_fraction"] <= 1
    assert run["io"]["local_bytes"] > 0 and run["io"]["remote"]["requests"] == 0
    table = report.table()
    assert f"route {script.route.name} (its choice)" in table and "bound: " in table


@pytest.mark.slow
def test_route_compares_routes_and_names_those_that_cannot_serve(dataset: Path) -> None:
    r = run_feedpipe("probe", dataset, "--duration", "0.3", "--block-sizes", "64KiB",
                     "--threads", "1", "--batch-size", "8", "--workers", "1",
                     "--route", "samples,samples-workers,refs", "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    runs = json.loads(r.stdout)["pipeline"]["accounts"]
    assert [x["asked"] for x in runs] == ["samples", "samples-workers", "refs"]
    assert [x.get("route") for x in runs[:2]] == ["samples", "samples-workers"]
    assert "1 worker processes" in runs[1]["time"]["parts_in"]
    assert all(x["bound"] in {"startup", "fetch", "compute", "sink", "step"} for x in runs[:2])
    assert "cannot serve" in runs[2]["error"] and "transform" in runs[2]["error"]


def test_an_unknown_route_is_refused_with_the_list() -> None:
    with pytest.raises(ValueError, match=r"--route fast: no such route; the routes are .*refs"):
        probe(str(EXAMPLE), route="fast", **QUICK)


def first_batch_bytes(batch: int) -> int:
    """The most a first batch read by range fetches: the spans (first member's first byte to
    last member's last) of its ``batch`` largest samples, and where samples of a shard lie
    close together (caches._early.spans: one request for them) the bytes between them too,
    so at most each shard's stretch from its first sample to its last."""
    from feedpipe.format._index import parse_index

    spans, stretch = [], 0
    for path in sorted(EXAMPLE.glob("*.idx")):
        index = parse_index(path.read_bytes(), str(path))
        ends = [(index.starts[i], index.starts[i + 1]) for i in range(len(index))]
        spans += [int(index.offsets[b - 1] + index.sizes[b - 1] - index.offsets[a])
                  for a, b in ends]
        stretch += int(index.end - index.offsets[0])
    return max(sum(sorted(spans)[-batch:]), stretch)


@pytest.mark.slow
def test_a_remote_dataset_reports_requests_bytes_and_cost_per_epoch() -> None:
    total = sum(s["bytes"] for s in json.loads((EXAMPLE / "manifest.json").read_text())["shards"])
    with python_server(EXAMPLE) as srv:
        report = probe(srv.url + "/manifest.json", route="samples", price_per_gb=2.0,
                       price_per_1k_requests=0.5, **{**QUICK, "duration": 3.0})
    (run,) = report.to_dict()["pipeline"]["accounts"]
    # a whole epoch in the time given: 3 s, where 1 s held a third of it on a loaded machine
    # (each of the probe's stages takes the duration, so more costs the test that much again)
    assert run["epoch_fraction"] == 1
    remote = run["io_per_epoch"]["remote"]
    # a cold epoch through an empty L1 directory of the run's own: whole shards (in ranges) and
    # their indexes, however warm the probe's earlier stages left the process's read-ahead
    idx = sum(p.stat().st_size for p in EXAMPLE.glob("*.idx"))
    assert remote["requests"] >= 3  # a range at least for each of the 3 shards
    # and the reader's first batch, read by range while its shards arrive (caches/_early.py),
    # with the indexes once more where that read's GET did not meet the fill's
    early = first_batch_bytes(QUICK["batch_size"]) + idx
    assert total <= remote["bytes"] <= total + idx + early
    # the samples are then read from the L1 copies: each shard filled once
    assert run["io_per_epoch"]["l1"]["fills"] == 3
    assert 0 < run["io_per_epoch"]["local_bytes"] <= total
    assert run["cost_per_epoch"] == pytest.approx(remote["bytes"] / 1e9 * 2.0
                                                  + remote["requests"] / 1e3 * 0.5)
    assert re.search(r"per epoch: .* \d+ remote requests, .* remote, about [\d.e-]+ per epoch",
                     report.table()), report.table()


def test_prices_are_checked_and_said_unused_off_a_dataset() -> None:
    with pytest.raises(ValueError, match="price per GB must be 0 or more, not -1"):
        probe(str(EXAMPLE), price_per_gb=-1.0, **QUICK)
    report = probe(generate=1 << 20, route="samples", price_per_gb=0.1, **QUICK)
    notes = report.to_dict()["target"]["notes"]
    assert notes == ["--route, --price-per-gb: for a shard dataset's FeedLoader; not used on a "
                     "file"]
    assert notes[0] in report.table()


def test_epoch_cost_needs_a_price() -> None:
    io = {"remote": {"requests": 10, "bytes": 10**9}}
    assert epoch_cost(io, None, None) is None
    assert epoch_cost(io, 1.0, None) == 1.0 and epoch_cost(io, None, 1.0) == 0.01


def test_the_storage_verdict_quotes_the_cold_rate_with_the_warm_beside() -> None:
    if not pagecache.can_drop():
        pytest.skip("this filesystem cannot drop a file's pages: no cold figures")
    report = probe(generate=8 << 20, **QUICK)
    v, cells = report.verdict, report.to_dict()["storage"]["sequential"]["cells"]
    cold = max(c["mb_per_s"] for c in cells if c["cache"] == "cold")
    warm = max(c["mb_per_s"] for c in cells if c["cache"] == "warm")
    assert v["bounding_stage"] == "storage"
    assert v["ceiling_mb_per_s"] == v["storage_cold_mb_per_s"] == cold
    assert v["storage_warm_mb_per_s"] == warm
    line = next(x for x in report.table().splitlines() if x.startswith("Verdict:"))
    assert f"bounds at {cold:,.0f} MB/s (cold" in line or f"bounds at {cold:,.1f} MB/s (cold" \
        in line, line
    assert "warm, from the page cache" in line


@pytest.mark.slow
def test_plot_draws_the_per_part_times(dataset: Path) -> None:
    pytest.importorskip("matplotlib")
    from feedpipe.diagnostics._plot import figure

    doc = probe(str(dataset), route="samples,samples-workers", **QUICK).to_dict()
    fig = figure(doc)
    try:
        titles = [ax.get_title() for ax in fig.axes]
        assert "FeedLoader parts (stats()['time'])" in titles
        ax = fig.axes[titles.index("FeedLoader parts (stats()['time'])")]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["startup", "fetch", "compute",
                                                                "sink", "wait", "step"]
        assert len(ax.patches) == 2 * 6  # a bar per part per route
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
