"""``feedpipe probe``: the JSON report's schema (CLI in a subprocess), the verdict's logic (pure,
and end to end with an injected slow decoder), bad targets, page-cache handling, and that the
probe writes nothing but what it is asked to.

Every run uses a fraction of a second per phase; no test asserts a speed."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_feedpipe

import feedpipe
from feedpipe.convert._synth import make_image_folder
from feedpipe.diagnostics import _pagecache as pagecache
from feedpipe.diagnostics._probe import ProbeReport, generate_file, probe
from feedpipe.diagnostics._verdict import Figures, decide
from feedpipe.errors import (
    AccessDeniedError,
    InputError,
    MissingDependencyError,
    RemoteError,
    SourceNotFoundError,
)

QUICK: dict[str, Any] = {"duration": 0.2, "block_sizes": [64 << 10, 1 << 20], "threads": [1, 2],
                         "batch_size": 8, "workers": 1, "show_progress": False}

# -- the JSON document's schema: a type, a tuple of types, a dict of required keys, or a list
NUM = (int, float)
OPT_NUM = (int, float, type(None))
CELL = {"block_bytes": int, "threads": int, "bytes": int, "seconds": NUM, "mb_per_s": OPT_NUM,
        "cache": str}
SMALL = {"cache": str, "threads": int, "files": int, "bytes": int, "seconds": NUM,
         "files_per_s": NUM, "mb_per_s": NUM, "mean_file_bytes": NUM, "errors": int}
RANDOM = {"cache": str, "block_bytes": int, "reads": int, "bytes": int, "p50_ms": NUM,
          "p99_ms": NUM, "mean_ms": NUM, "max_ms": NUM}
STAGE = {"samples": int, "seconds": NUM, "samples_per_s": OPT_NUM}
SCHEMA: dict[str, Any] = {
    "format": str, "version": int, "elapsed_s": NUM,
    "target": {"url": str, "kind": str, "local": bool, "root": str, "files": int, "bytes": int,
               "listing_complete": bool, "samples": (int, type(None)),
               "mean_sample_bytes": OPT_NUM, "fields": [str], "shards": (int, type(None)),
               "generated": (dict, type(None)), "notes": [str]},
    "settings": {"duration": NUM, "block_sizes": [int], "threads": [int], "random_block": int,
                 "batch_size": int, "workers": int, "step_time_ms": OPT_NUM,
                 "decode": (str, type(None))},
    "storage": {
        "basis": (str, type(None)),
        "page_cache": {"remote": bool, "can_drop": bool, "method": (str, type(None)),
                       "resident_at_start": OPT_NUM, "resident_after_drop": OPT_NUM,
                       "resident_before_warm": OPT_NUM, "warm_window_bytes": (int, type(None))},
        "sequential": {"cells": [CELL], "skipped": (str, type(None))},
        "small_files": (dict, type(None)),
        "random_read": dict,
    },
    "pipeline": (dict, type(None)),
    "verdict": {"bounding_stage": (str, type(None)), "ceiling_samples_per_s": OPT_NUM,
                "ceiling_mb_per_s": OPT_NUM, "stage_samples_per_s": dict, "parallelism": int,
                "demand_samples_per_s": OPT_NUM, "accelerator_utilisation": OPT_NUM,
                "measured_loader_samples_per_s": OPT_NUM,
                "measured_loader_workers": (int, type(None)), "advice": [str],
                "bounding_part": (str, type(None)), "bound_basis": (str, type(None)),
                "advice_about": list, "parallelism_note": (str, type(None))},
    "environment": {"cpu_count": int, "memory": {"total_bytes": int, "available_bytes": int},
                    "filesystem": {"type": (str, type(None))}, "platform": str, "python": str,
                    "versions": {"feedpipe": str, "numpy": str, "torch": str}},
    "phases": [{"name": str, "seconds": NUM}],
}
PIPELINE = {"read": {**STAGE, "bytes": int, "mb_per_s": NUM}, "decode": (dict, type(None)),
            "batch": {**STAGE, "batch_size": int}, "h2d": (dict, type(None)),
            "cuda": (bool, type(None)), "notes": [str],
            "loader": [{"workers": int}]}


def check(doc: Any, schema: Any, where: str = "$") -> None:
    """Fail naming the path of the first value that does not fit ``schema``."""
    if isinstance(schema, dict):
        assert isinstance(doc, dict), f"{where}: expected an object, got {doc!r}"
        for key, sub in schema.items():
            assert key in doc, f"{where}: missing key {key!r}"
            check(doc[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(doc, list), f"{where}: expected a list, got {doc!r}"
        for i, item in enumerate(doc):
            check(item, schema[0], f"{where}[{i}]")
    else:
        ok = isinstance(doc, schema) and not (isinstance(doc, bool) and bool not in (
            schema if isinstance(schema, tuple) else (schema,)))
        assert ok, f"{where}: {doc!r} is not {schema}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 JPEG samples (with a cls field) in 4 shards."""
    root = tmp_path_factory.mktemp("probe")
    make_image_folder(str(root / "src"), classes=3, per_class=8, min_size=16, max_size=32)
    feedpipe.shard(str(root / "src"), str(root / "shards"), max_samples=6, labels_from_dirs=True,
                   workers=1, show_progress=False)
    return root / "shards"


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# end to end


def test_cli_json_schema_on_a_shard_dataset(dataset: Path) -> None:
    before = snapshot(dataset)
    r = run_feedpipe("probe", dataset, "--duration", "0.25", "--block-sizes", "64KiB,1MiB",
                     "--threads", "1,2", "--batch-size", "8", "--workers", "2",
                     "--step-time", "50", "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is the JSON document alone
    check(doc, SCHEMA)
    check(doc["pipeline"], PIPELINE)
    assert doc["format"] == "feedpipe-probe"
    assert doc["target"]["kind"] == "dataset" and doc["target"]["samples"] == 24
    assert {c["cache"] for c in doc["storage"]["sequential"]["cells"]} == {"cold", "warm"}
    assert {(c["block_bytes"], c["threads"]) for c in doc["storage"]["sequential"]["cells"]} == {
        (64 << 10, 1), (64 << 10, 2), (1 << 20, 1), (1 << 20, 2)}
    assert set(doc["storage"]["random_read"]) == {"cold", "warm"}
    assert [x["workers"] for x in doc["pipeline"]["loader"]] == [0, 1, 2]
    assert all(x.get("samples_per_s") for x in doc["pipeline"]["loader"]), doc["pipeline"]
    assert doc["pipeline"]["decode"]["samples"] > 0  # image fields: the default decoder ran
    v = doc["verdict"]
    assert v["bounding_stage"] in v["stage_samples_per_s"]
    assert v["demand_samples_per_s"] == pytest.approx(8 / 0.05)
    assert 0 < v["accelerator_utilisation"] <= 1
    assert v["accelerator_utilisation"] == pytest.approx(
        min(1.0, v["ceiling_samples_per_s"] / v["demand_samples_per_s"]))
    assert v["advice"]
    assert doc["environment"]["versions"]["feedpipe"] == feedpipe.__version__
    assert snapshot(dataset) == before  # the probe read, it did not write


@pytest.mark.slow
def test_a_slow_decoder_makes_decode_the_bounding_stage(dataset: Path) -> None:
    def identity(sample: dict[str, Any]) -> dict[str, Any]:
        return sample

    def slow(sample: dict[str, Any]) -> dict[str, Any]:
        # deterministic CPU work standing in for an expensive decode (no sleeping)
        hashlib.pbkdf2_hmac("sha256", bytes(sample["jpg"]), b"probe", 5_000)
        return sample

    fast = probe(str(dataset), decode=identity, **QUICK).verdict
    assert fast["bounding_stage"] not in (None, "decode")
    slowed = probe(str(dataset), decode=slow, **QUICK).verdict
    assert slowed["bounding_stage"] == "decode"
    assert any("decoded store" in a for a in slowed["advice"])
    import torch

    # the fields are JPEG: GPU decoding is advised where the probe found a GPU, and only there
    assert any("DALI" in a for a in slowed["advice"]) == torch.cuda.is_available()


def test_directory_of_small_files_advises_sharding(tmp_path: Path) -> None:
    make_image_folder(str(tmp_path), classes=2, per_class=6, min_size=16, max_size=24)
    r = probe(str(tmp_path), json_path=str(tmp_path.parent / "d.json"), **QUICK)
    doc = json.loads((tmp_path.parent / "d.json").read_text())
    check(doc, SCHEMA)
    assert doc["target"]["kind"] == "directory"
    assert doc["storage"]["sequential"]["skipped"]  # no large file to stream
    for runs in doc["storage"]["small_files"].values():
        check(runs, [SMALL])
    assert doc["storage"]["small_files"].keys() >= {"warm"}
    check(doc["storage"]["random_read"]["warm"], RANDOM)
    assert any(f"feedpipe shard {tmp_path}" in a for a in r.verdict["advice"])
    assert doc["pipeline"]["decode"]["samples"] > 0
    assert "Small files" in r.table()


def test_generate_probes_a_file_and_removes_it(tmp_path: Path) -> None:
    r = probe(str(tmp_path), generate=2 << 20, block_sizes=[1 << 20], threads=[1],
              duration=0.1, show_progress=False)
    doc = r.to_dict()
    assert doc["target"]["kind"] == "file" and doc["target"]["bytes"] == 2 << 20
    assert doc["target"]["generated"]["bytes"] == 2 << 20
    assert Path(doc["target"]["generated"]["dir"]).parent == tmp_path
    assert list(tmp_path.iterdir()) == []  # the temp dir and its file are gone
    assert doc["verdict"]["bounding_stage"] == "storage"
    assert doc["verdict"]["ceiling_mb_per_s"] > 0
    if pagecache.can_drop() and pagecache.resident_fraction([(__file__, 1)]) is not None:
        # the generated file was fsync'ed, so its pages were clean and could be dropped
        assert doc["storage"]["page_cache"]["resident_after_drop"] < 0.5
        assert {c["cache"] for c in doc["storage"]["sequential"]["cells"]} == {"cold", "warm"}


def test_remote_fsspec_dataset(dataset: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for p in dataset.iterdir():
        fs.pipe(f"/probe-remote/{p.name}", p.read_bytes())
    try:
        doc = probe("memory://probe-remote", **QUICK).to_dict()
    finally:
        fs.rm("/probe-remote", recursive=True)
    check(doc, SCHEMA)
    assert doc["target"]["local"] is False and doc["target"]["kind"] == "dataset"
    assert {c["cache"] for c in doc["storage"]["sequential"]["cells"]} == {"remote"}
    assert doc["storage"]["page_cache"]["remote"] is True
    assert doc["pipeline"]["read"]["samples"] > 0


# --------------------------------------------------------------------------------------------
# bad targets and options


def test_missing_target(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="no such file"):
        probe(str(tmp_path / "nope"), duration=0.1)
    r = run_feedpipe("probe", tmp_path / "nope", "--duration", "0.1")
    assert r.returncode == 2
    assert "feedpipe probe: error:" in r.stderr and "nope" in r.stderr
    assert "Traceback" not in r.stderr


def test_empty_directory_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="empty directory"):
        probe(str(tmp_path), duration=0.1)
    (tmp_path / "zero.bin").write_bytes(b"")
    with pytest.raises(InputError, match="empty"):
        probe(str(tmp_path / "zero.bin"), duration=0.1)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root reads files whatever their permissions")
def test_permission_denied(tmp_path: Path) -> None:
    f = tmp_path / "secret.bin"
    f.write_bytes(b"x" * 4096)
    f.chmod(0)
    try:
        with pytest.raises(AccessDeniedError, match="permission denied"):
            probe(str(f), duration=0.1)
    finally:
        f.chmod(0o600)


def test_permission_denied_as_any_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same refusal, made by the OS for whoever runs the tests (root reads anything)."""
    f = tmp_path / "secret.bin"
    f.write_bytes(b"x" * 4096)
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if os.fspath(path) == str(f):
            raise PermissionError(13, "Permission denied", str(f))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(AccessDeniedError, match="permission denied") as e:
        probe(str(f), duration=0.1)
    assert isinstance(e.value, PermissionError)


def test_unreachable_url() -> None:
    pytest.importorskip("aiohttp")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteError, match="cannot reach"):
        probe(f"http://127.0.0.1:{port}/data.bin", duration=0.1)


def test_a_shard_missing_from_its_dataset(dataset: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(dataset, tmp_path / "ds"))
    next(copy.glob("*.tar")).unlink()
    with pytest.raises(SourceNotFoundError, match="missing"):
        probe(str(copy), duration=0.1)


@pytest.mark.parametrize("kw", [{"duration": 0}, {"duration": -1}, {"threads": [0]},
                                {"block_sizes": [10]}, {"batch_size": 0}, {"step_time_ms": 0}])
def test_bad_settings_are_refused_before_measuring(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        probe(str(tmp_path / "never-looked-at"), **kw)


def test_generate_refuses_to_fill_the_disk(tmp_path: Path) -> None:
    from feedpipe.errors import OutputError

    with pytest.raises(OutputError, match="more than half"):
        probe(str(tmp_path), generate=1 << 60, duration=0.1)
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_fails_before_measuring(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'feedpipe\[plot\]'"):
        probe(str(tmp_path / "not-even-resolved"), plot_path=str(tmp_path / "p.png"))


def test_batch_stage_stacks_tensors_of_images_of_different_sizes(dataset: Path) -> None:
    """The batch stage times the copy into tensors a training batch is; images of different
    sizes (16 to 32 px here) go into slots of one shape. It used to time building a list."""
    import torch

    from feedpipe.diagnostics import _pipeline as pp
    from feedpipe.format._manifest import load_manifest

    _, kept = pp.read_stage(str(dataset), load_manifest(str(dataset)), 0.05)
    _, decoded = pp.decode_stage(kept, pp.ImageDecode(["jpg"]), 0.05)
    assert len({d["jpg"].shape for d in decoded}) > 1
    collate, note = pp.choose_collate(decoded, 8)
    assert "differ in size" in note
    batch = collate(decoded[:8])
    assert isinstance(batch["jpg"], torch.Tensor) and batch["jpg"].dtype == torch.uint8
    h, w, c = batch["jpg"].shape[1:]
    assert c == 3 and 16 <= h <= 32 and 16 <= w <= 32
    for i, d in enumerate(decoded[:8]):  # each image sits in its slot, centre-cropped
        a = d["jpg"]
        hh, ww = min(h, a.shape[0]), min(w, a.shape[1])
        y, x = (a.shape[0] - hh) // 2, (a.shape[1] - ww) // 2
        assert (batch["jpg"][i, :hh, :ww].numpy() == a[y:y + hh, x:x + ww]).all()
    fig = pp.batch_stage(decoded, collate, 8, 0.05)
    assert fig["tensors"]["jpg"] == f"uint8[8, {h}, {w}, 3]"
    assert fig["tensor_bytes"] >= 8 * h * w * 3


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README tutorial's kind of tree: JPEGs with a PNG every 5th sample, in 3 classes."""
    import cv2
    import numpy as np

    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog", "zebra"):
        (root / "images" / c).mkdir(parents=True)
        for i in range(10):
            img = rng.integers(0, 256, size=(24 + i % 3, 32, 3), dtype=np.uint8)
            cv2.imwrite(str(root / "images" / c / f"{i:04d}.{'png' if i % 5 == 0 else 'jpg'}"),
                        img)
    feedpipe.shard(str(root / "images"), str(root / "shards"), max_samples=8,
                   labels_from_dirs=True, workers=1, show_progress=False)
    return root / "shards"


def test_batch_stage_stacks_the_image_whichever_field_holds_it(mixed: Path) -> None:
    """Samples holding a ``jpg`` or a ``png``: every sample's image is decoded and goes into one
    uint8 tensor, as ImagePipeline takes the first image field a sample has. The batch stage
    used to stack only ``__index__`` there, with no note, and time building lists."""
    import torch

    from feedpipe.diagnostics import _pipeline as pp
    from feedpipe.format._manifest import load_manifest
    from feedpipe.transforms._decode import decode_image

    manifest = load_manifest(str(mixed))
    assert {"jpg", "png"} <= set(manifest.fields)
    _, kept = pp.read_stage(str(mixed), manifest, 0.05)
    decode = pp.ImageDecode(manifest.fields)
    assert decode.fields == ["jpg", "png"]
    decoded = [decode(s) for s in kept]
    collate, note = pp.choose_collate(decoded, 8)
    assert "jpg" in note and "png" in note and "image" in note, note
    rows = [s for s in kept if s.get("png") is not None][:2] + [
        s for s in kept if s.get("jpg") is not None][:6]
    batch = collate([decode(s) for s in rows])
    image = batch["image"]
    assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
    assert tuple(image.shape[::3]) == (8, 3)
    h, w = image.shape[1:3]
    for i, s in enumerate(rows):  # each sample's own image, centre-cropped into its slot
        a = decode_image(s["png"] if s.get("png") is not None else s["jpg"])
        hh, ww = min(h, a.shape[0]), min(w, a.shape[1])
        y, x = (a.shape[0] - hh) // 2, (a.shape[1] - ww) // 2
        assert (image[i, :hh, :ww].numpy() == a[y:y + hh, x:x + ww]).all()
    assert "jpg" not in batch and "png" not in batch  # not also left behind as lists


def test_probe_of_a_tree_mixing_jpg_and_png_batches_every_image(mixed: Path) -> None:
    doc = probe(str(mixed), **QUICK).to_dict()
    tensors = doc["pipeline"]["batch"]["tensors"]
    images = [t for t in tensors.values() if t.startswith("uint8[8, ")]
    assert len(images) == 1 and images[0].endswith(", 3]"), tensors
    assert doc["pipeline"]["decode"]["samples"] > 0
    assert doc["settings"]["decode"] and "png" in doc["settings"]["decode"]


def test_a_batch_that_leaves_decoded_arrays_unstacked_says_so() -> None:
    """Whatever the batch cannot stack, a note says the figure leaves it out (never silence)."""
    import numpy as np

    from feedpipe.diagnostics import _pipeline as pp

    decoded = [{"__index__": i, "depth": np.zeros((2, 3), np.float32) if i % 2 else None}
               for i in range(8)]
    collate, note = pp.choose_collate(decoded, 8)
    assert "depth" in note and "not" in note, note
    assert not pp.describe_batch(collate(decoded))["tensors"].get("depth")


@pytest.mark.slow
def test_plot_panels_fit_what_was_measured(dataset: Path, tmp_path: Path) -> None:
    """A directory gets its small-file rates, not an empty sequential panel; legends sit below
    their axes, not over the curves; stage bars start at zero on a linear axis."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from feedpipe.diagnostics._plot import figure

    make_image_folder(str(tmp_path / "img"), classes=2, per_class=4, min_size=16, max_size=24)
    for target, titles in ((tmp_path / "img", ["Small files", "Pipeline stages"]),
                           (dataset, ["Sequential read", "Pipeline stages",
                                      "FeedLoader parts (stats()['time'])"])):
        doc = probe(str(target), step_time_ms=50, **QUICK).to_dict()
        fig = figure(doc)
        try:
            axes = fig.axes
            assert [ax.get_title().split(":")[0] for ax in axes] == titles
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            for ax in axes:
                assert ax.has_data()
                legend = ax.get_legend()
                if legend is not None:
                    assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(
                        renderer).y0
            stages = axes[titles.index("Pipeline stages")]
            assert stages.get_xscale() == "linear" and stages.get_xlim()[0] == 0
            assert all(p.get_x() == 0 for p in stages.patches)
        finally:
            plt.close(fig)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "probe.png"
    probe(generate=2 << 20, block_sizes=[1 << 20], threads=[1], duration=0.1,
          plot_path=str(out), show_progress=False)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# the verdict (pure)


def _figures(**kw: Any) -> Figures:
    base: dict[str, Any] = {"kind": "dataset", "target": "/data/shards", "cpus": 8, "workers": 8,
                            "batch_size": 64, "storage": 50_000.0, "storage_mb_per_s": 500.0,
                            "storage_basis": "sequential, cold", "read": 40_000.0,
                            "decode": 5_000.0, "batch": 100_000.0}
    base.update(kw)
    return Figures(**base)


def test_verdict_names_the_slowest_stage_and_the_combined_cpu_ceiling() -> None:
    v = decide(_figures())
    assert v.bounding_stage == "decode"
    assert v.ceiling_samples_per_s == pytest.approx(8 / (1 / 40_000 + 1 / 5_000 + 1 / 100_000))
    assert v.stage_samples_per_s["decode"] == pytest.approx(40_000)
    assert v.ceiling_mb_per_s == pytest.approx(v.ceiling_samples_per_s * 500 / 50_000)


def test_verdict_storage_bound_advises_the_l1_cache() -> None:
    v = decide(_figures(storage=100.0, storage_mb_per_s=1.0))
    assert v.bounding_stage == "storage" and v.ceiling_samples_per_s == 100.0
    assert any("L1 shard cache" in a for a in v.advice)
    v = decide(_figures(storage=100.0, fits_in_memory=True))
    assert any("/dev/shm" in a for a in v.advice)


def test_verdict_advises_more_workers_only_when_cores_are_idle() -> None:
    few = decide(_figures(workers=2))
    assert few.parallelism == 2
    assert any("num_workers=8" in a for a in few.advice)
    assert not any("more DataLoader workers" in a for a in decide(_figures()).advice)


def test_verdict_worker_advice_follows_what_was_measured() -> None:
    """The figures of a probe on a 2-core machine (--workers 1): 0 workers measured fastest. The
    advice used to say "Use more DataLoader workers" (a prediction from the stage rates) and, in
    the next line, that num_workers=0 was fastest."""
    measured = {0: 33_903.0, 1: 21_284.0, 2: 24_469.0}
    v = decide(_figures(cpus=2, workers=1, loader=measured))
    assert v.bounding_stage == "decode"
    assert not any("more DataLoader workers" in a or "would raise" in a for a in v.advice), v.advice
    fastest = [a for a in v.advice if "num_workers=0 was fastest" in a]
    assert len(fastest) == 1 and "21,284 at num_workers=1" in fastest[0], v.advice
    # measurements that agree with the prediction: more workers, with the measured figure
    agree = decide(_figures(cpus=8, workers=1, loader={0: 900.0, 1: 1_000.0, 2: 1_900.0}))
    more = [a for a in agree.advice if "more DataLoader workers" in a]
    assert len(more) == 1 and "num_workers=2" in more[0] and "1,900" in more[0], agree.advice
    assert not any("was fastest" in a for a in agree.advice if a not in more)
    # nothing measured beyond the planned count: the prediction alone, as before
    assert any("num_workers=8 would raise" in a
               for a in decide(_figures(workers=2, loader={0: 1.0, 1: 2.0, 2: 3.0})).advice)


def test_verdict_names_the_caches_as_the_readme_glossary_does() -> None:
    """L1 is the shard cache (cache_dir=); decoded samples go to the decoded store
    (decoded_cache=). The decode advice called the decoded store "the L1 memmap"."""
    advice = [a for kw in ({}, {"storage": 100.0}, {"storage": 100.0, "fits_in_memory": True},
                           {"read": 100.0})
              for a in decide(_figures(**kw)).advice]
    assert any("decoded_cache=" in a for a in advice)
    for a in advice:
        if "L1" in a:
            assert a.count("L1") == a.count("L1 shard cache") and "cache_dir=" in a, a
        assert "memmap" not in a, a


def test_verdict_host_to_device_and_utilisation() -> None:
    v = decide(_figures(h2d=10.0, h2d_pinned_gb_per_s=1.0, h2d_pageable_gb_per_s=0.5,
                        step_time_ms=100.0))
    assert v.bounding_stage == "h2d"
    assert v.demand_samples_per_s == pytest.approx(640.0)
    assert v.accelerator_utilisation == pytest.approx(10.0 / 640.0)
    assert any("pinned" in a and "DeviceLoader" in a for a in v.advice)
    fed = decide(_figures(step_time_ms=10_000.0))
    assert fed.accelerator_utilisation == 1.0
    assert any("keeps up" in a for a in fed.advice)


def test_verdict_dali_advice_only_for_jpeg_and_small_file_advice_for_directories() -> None:
    assert any("DALI" in a for a in decide(_figures(jpeg=True, cuda=True)).advice)
    assert not any("DALI" in a for a in decide(_figures(jpeg=False, cuda=True)).advice)
    v = decide(_figures(kind="directory", target="/data/img", small_files_per_s=900.0,
                        small_file_mb_per_s=90.0, mean_file_bytes=100e3,
                        sequential_mb_per_s=2000.0))
    assert any("feedpipe shard /data/img OUT" in a for a in v.advice)


def test_verdict_gives_no_gpu_advice_on_a_machine_without_one() -> None:
    cpu_only = decide(_figures(jpeg=True, cuda=False))
    assert cpu_only.bounding_stage == "decode"
    assert not any("GPU" in a or "DALI" in a or "nvJPEG" in a for a in cpu_only.advice)
    assert any("Decode fewer pixels" in a for a in cpu_only.advice)


def test_verdict_with_nothing_measured() -> None:
    v = decide(Figures(kind="dataset", target="x", cpus=2, workers=2, batch_size=1))
    assert v.bounding_stage is None and v.ceiling_samples_per_s is None and v.advice


# --------------------------------------------------------------------------------------------
# the page cache helpers and the package surface


@pytest.mark.skipif(not pagecache.can_drop(), reason="no posix_fadvise on this platform")
def test_dropping_a_files_pages_makes_it_cold(tmp_path: Path) -> None:
    f = tmp_path / "data.bin"
    generate_file(str(f), 8 << 20)
    f.read_bytes()
    hot = pagecache.resident_fraction([(str(f), 8 << 20)])
    if hot is None:
        pytest.skip("mincore unavailable")
    assert hot > 0.9
    fd = os.open(f, os.O_RDONLY)
    try:
        assert pagecache.drop_fd(fd)
    finally:
        os.close(fd)
    assert pagecache.resident_fraction([(str(f), 8 << 20)]) < 0.1


def test_public_names() -> None:
    assert callable(feedpipe.probe) and feedpipe.probe is probe
    assert feedpipe.ProbeReport is ProbeReport


def test_the_batch_slot_skips_fields_left_undecoded() -> None:
    """A sample whose first image field is still bytes (no decoder for it) gives its slot the
    next decoded image, or a zero row."""
    import numpy as np

    from feedpipe.diagnostics._pipeline import SlotCollate

    img = np.full((4, 4, 3), 7, np.uint8)
    collate = SlotCollate({"image": (("heic", "png"), (4, 4, 3))})
    out = collate([{"heic": b"undecoded", "png": img, "__index__": 0},
                   {"heic": b"undecoded", "__index__": 1}])
    assert out["image"][0].eq(7).all() and out["image"][1].eq(0).all()


def test_undecodable_images_still_get_the_install_hint(dataset: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every image field of a format no library here decodes (HEIC without the images extra):
    the note says which and how to install a decoder."""
    from feedpipe.diagnostics import _pipeline
    from feedpipe.transforms import _decode

    monkeypatch.setattr(_decode, "image_decoders", lambda: {})
    report = feedpipe.probe(str(dataset), duration=0.05, batch_size=4, workers=1,
                            show_progress=False)
    notes = report.to_dict()["pipeline"]["notes"]
    assert any("jpg" in n and "feedpipe[images]" in n for n in notes), notes
    assert _pipeline.ImageDecode(["jpg"]).skipped == ["jpg"]
