"""``feedpipe demo``, the README's first command, run as a user runs it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import run_feedpipe


def test_demo_runs_end_to_end_and_reports_what_it_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = run_feedpipe("demo", "--workdir", tmp_path / "w", timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "each delivered every sample exactly once" in out and "PROBLEM" not in out
    assert "epochs 0 and 1 have different orders" in out
    assert re.search(r"resuming with 1 rank instead of 2", out)
    # epoch 1 ran on 2 ranks up to the stop and on 1 rank after the resume: the line says so
    # (it said "320 samples over ranks [160, 160] per rank")
    assert re.search(r"epoch 0: 320 samples over 2 ranks \(\[160, 160\] per rank\)", out), out
    assert re.search(r"epoch 1: 320 samples, \[80, 80\] on 2 ranks before the stop and 160 on "
                     r"1 rank after the resume", out), out
    m = re.search(r"FeedLoader\(device='(cpu|cuda)'\).*: 320 images decoded", out)
    assert m, out
    # the steady figure first (a long run's), the whole run's with the workers' start after it
    assert re.search(r"waited for data \d+\.\d% of the time after the first batch "
                     r"\(\d+\.\d% counting the first", out), out
    assert re.search(r"DeviceCache on (cpu|cuda): warm-up put 160 of 320 .* hit ratio 0\.50", out)
    assert re.search(r"L1 shard cache .*: 2 epochs, \d+ downloads .* \d+ reads from the cache", out)
    assert re.search(r"decoded store .* epoch 1 decoded 320 images .* epoch 2 served 320 from", out)
    assert re.search(r"L2 function index .*: 320 computed, 320 hits", out)
    assert (tmp_path / "w" / "shards" / "manifest.json").exists()  # --workdir is kept
    lines = out.strip().splitlines()
    assert f"work directory: {tmp_path / 'w'}, kept afterwards" in lines[0]
    assert lines[-2] == f"kept {tmp_path / 'w'}"
    assert lines[-1].startswith("verdict: OK, every epoch delivered every sample exactly once")
    assert "next: the tutorial (docs/tutorial.md)" in lines[-1]


def test_demo_in_a_temp_dir_says_it_removes_it() -> None:
    r = run_feedpipe("demo", timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    m = re.match(r"feedpipe demo \(work directory: (\S+), removed at the end; --keep or "
                 r"--workdir DIR keeps it\)", lines[0])
    assert m, lines[0]
    assert lines[-2] == f"removed {m.group(1)}" and not Path(m.group(1)).exists()
    assert lines[-1].startswith("verdict: OK")


@pytest.mark.slow
def test_demo_runs_again_in_the_same_workdir_with_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A second run with the same --workdir replaces the first run's output (it used to stop
    at `feedpipe shard` suggesting --resume, an option demo does not have)."""
    import json

    w = tmp_path / "w"
    for _ in range(2):
        r = run_feedpipe("demo", "--workdir", w, "--json", timeout=300)
        assert r.returncode == 0, r.stderr
    assert "an earlier demo ran here" in r.stderr and "--resume" not in r.stderr
    doc = json.loads(r.stdout)  # stdout is the JSON document alone; the commentary is on stderr
    assert doc["workdir"] == str(w) and doc["kept"] is True
    assert doc["samples"] == 320 and doc["exactly_once"] is True
    assert doc["epochs"] == {"0": 320, "1": 320}
    assert set(doc["tiers"]) == {"l1", "decoded", "l2"} and doc["device"]["delivered"] == 320
    starvation = doc["device"]["starvation"]  # measured: it was null, read from the wrong level
    assert isinstance(starvation, float) and 0.0 <= starvation <= 1.0
    steady = doc["device"]["steady_starvation"]
    assert f"waited for data {steady:.1%} of the time after the first batch " \
           f"({starvation:.1%} counting the first" in r.stderr
    assert sorted(p.name for p in w.iterdir()) == [
        ".feedpipe-demo", "decoded", "images", "l1", "l2", "shards"]


def test_demo_refuses_a_workdir_holding_someone_elses_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    mine = tmp_path / "shards" / "mine.txt"
    mine.parent.mkdir()
    mine.write_text("not the demo's")
    r = run_feedpipe("demo", "--workdir", tmp_path, "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["error"] == "OutputError"
    assert f"{tmp_path}: already holds shards/ that feedpipe demo did not make" in doc["message"]
    assert "new or empty directory" in r.stderr and "Traceback" not in r.stderr
    assert mine.read_text() == "not the demo's" and sorted(tmp_path.iterdir()) == [mine.parent]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> str:
    """64 JPEGs in 4 classes, shards of 16: what the demo's device steps read."""
    from feedpipe.convert._shard import shard
    from feedpipe.convert._synth import make_image_folder

    root = tmp_path_factory.mktemp("demo-device")
    make_image_folder(str(root / "images"), classes=4, per_class=16, min_size=48, max_size=64)
    shard(str(root / "images"), str(root / "shards"), max_samples=16, labels_from_dirs=True,
          workers=1, show_progress=False)
    return str(root / "shards")


def _spy_on_stats(monkeypatch: pytest.MonkeyPatch,
                  change: Any = None) -> list[dict[str, Any]]:
    """Record what ``FeedLoader.stats()`` returns to the demo (``change`` may alter it first)."""
    from feedpipe.stream._loader import FeedLoader

    seen: list[dict[str, Any]] = []
    real = FeedLoader.stats

    def stats(self: FeedLoader) -> dict[str, Any]:
        out = real(self)
        if change is not None:
            change(out)
        seen.append(out)
        return out

    monkeypatch.setattr(FeedLoader, "stats", stats)
    return seen


def test_demo_reports_the_starvation_the_device_loader_measured(
        labelled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The printed fraction and the JSON figure are the DeviceLoader's own (under
    ``stats()["device"]``); the demo read a top-level key that does not exist and always
    printed 0.0% (JSON: null)."""
    from feedpipe.cli._demo import _device_steps

    seen = _spy_on_stats(monkeypatch)
    lines: list[str] = []
    doc = _device_steps(labelled, lines.append)
    measured = seen[-1]["device"]
    assert measured["steps"] > 1
    assert doc["starvation"] == measured["starvation"]
    assert doc["steady_starvation"] == measured["steady_starvation"]
    text = "\n".join(lines)
    assert (f"waited for data {measured['steady_starvation']:.1%} of the time after the first "
            f"batch ({measured['starvation']:.1%} counting the first") in text, text


def test_demo_says_when_starvation_could_not_be_measured(
        labelled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader whose figures measured nothing (no step timed) is reported as such, never as
    0.0% of the time."""
    from feedpipe.cli._demo import _device_steps

    def untimed(stats: dict[str, Any]) -> None:
        stats["device"].update(steps=0, wall_s=0.0, starvation=0.0, steady_starvation=0.0)

    _spy_on_stats(monkeypatch, untimed)
    lines: list[str] = []
    doc = _device_steps(labelled, lines.append)
    text = "\n".join(lines)
    assert doc["starvation"] is None and doc["steady_starvation"] is None
    assert "waited for data" not in text and "0.0%" not in text
    assert "time spent waiting for data could not be measured" in text, text
