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
