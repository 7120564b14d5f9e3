"""``feedpipe demo``, the README's first command, run as a user runs it."""

from __future__ import annotations

import re

from conftest import run_feedpipe


def test_demo_runs_end_to_end_and_reports_what_it_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = run_feedpipe("demo", "--workdir", tmp_path / "w", timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "each delivered every sample exactly once" in out and "PROBLEM" not in out
    assert "epochs 0 and 1 have different orders" in out
    assert re.search(r"resuming with 1 rank instead of 2", out)
    m = re.search(r"FeedLoader\(device='(cpu|cuda)'\).*: 320 images decoded", out)
    assert m, out
    assert re.search(r"waited for data \d+\.\d% of the time", out)
    assert re.search(r"DeviceCache on (cpu|cuda): warm-up put 160 of 320 .* hit ratio 0\.50", out)
    assert re.search(r"L1 shard cache .*: 2 epochs, \d+ downloads .* \d+ reads from the cache", out)
    assert re.search(r"decoded store .* epoch 1 decoded 320 images .* epoch 2 served 320 from", out)
    assert re.search(r"L2 function index .*: 320 computed, 320 hits", out)
    assert (tmp_path / "w" / "shards" / "manifest.json").exists()  # --workdir is kept


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
