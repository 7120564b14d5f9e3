"""benchmarks/bench_train.py --quick, run as a user runs it (a subprocess, on the CPU, into a
temporary directory), so that the training benchmark cannot rot: every CPU system trains a whole
epoch and must deliver every sample once, and the results carry every figure the report needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, os.pardir, "benchmarks", "bench_train.py")
SYSTEMS = ["synthetic", "torchvision", "feedpipe", "feedpipe-store", "feedpipe-cache"]
IMAGES, CLASSES = 96, 8


@pytest.mark.slow
def test_quick_run_trains_every_cpu_system_on_every_sample(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--root", str(tmp_path / "root"), "--out", str(out),
         "--images", str(IMAGES), "--batch", "16", "--workers", "1"],
        check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "bench_train-quick.json").read_text())
    assert (out / "bench_train-quick.md").read_text().startswith("# bench_train (quick, cpu")
    assert (out / "bench_train-quick.png").stat().st_size > 0
    assert not (tmp_path / "root" / "scratch").exists() or \
        not any((tmp_path / "root" / "scratch").iterdir())  # the decoded store is removed
    assert doc["quick"] is True and doc["device"] == "cpu"
    assert doc["data"]["spec"]["images"] == IMAGES
    assert list(doc["results"]) == ["tiny"]
    res = doc["results"]["tiny"]
    assert list(res) == SYSTEMS
    for name, sysres in res.items():
        assert "error" not in sysres, (name, sysres.get("error"), sysres.get("traceback"))
        assert sysres["delivered"] == IMAGES, name  # the whole epoch, once
        assert sysres["steps_done"] > 0 and sysres["images_per_s"] > 0
        assert 0.0 <= sysres["wait_fraction"] <= 1.0
        assert sysres["wait_measure"] == "wall clock (CPU)"
        assert sysres["cores_busy"] >= 0.0 and sysres["peak_rss_bytes"] > 0
        assert sysres["first_batch_s"] >= 0.0 and sysres["setup"]
        if name != "synthetic":  # real labels: each class once per image of it
            assert sysres["label_counts"] == [IMAGES // CLASSES] * CLASSES, name
    assert res["feedpipe-store"]["fill"]["samples"] == IMAGES  # epoch 0 filled the store
    assert res["feedpipe-cache"]["prepare"]["resident"] == IMAGES
    assert res["feedpipe-cache"]["stats"]["cache"]["hit_ratio"] == 1.0
    bars = doc["bars"]["tiny"]
    assert len(bars) == 3 and all(b["counts"] is False for b in bars)  # CPU: shown, not judged


@pytest.mark.slow
@pytest.mark.dali
def test_quick_run_of_the_dali_systems(tmp_path: Path) -> None:
    """The DALI systems (c) and (e), in DALI's CPU mode, train a whole epoch on every sample
    once (the CPU run leaves them out: DALI is an extra)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace at all
        found = False
    if not found:
        pytest.skip("nvidia.dali is not installed (the `dali` extra)")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--root", str(tmp_path / "root"), "--out", str(out),
         "--images", str(IMAGES), "--batch", "16", "--workers", "1",
         "--systems", "dali,feedpipe-dali"],
        check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "bench_train-quick.json").read_text())["results"]["tiny"]
    assert list(res) == ["dali", "feedpipe-dali"]
    for name, sysres in res.items():
        assert "error" not in sysres, (name, sysres.get("error"), sysres.get("traceback"))
        assert sysres["delivered"] == IMAGES, name
        assert sysres["label_counts"] == [IMAGES // CLASSES] * CLASSES, name
