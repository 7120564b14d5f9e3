"""``QUICK=1 NO_LIMITS=1 bash benchmarks/gpu_session.sh budget``: the CPU rehearsal of the
one-command device session, run as a person runs it, so that the script cannot rot between the
sessions that are lent a GPU: every part runs, writes its results, and records its wall time beside
the limit it has on the device, and the whole reports its wall time. The limits are not enforced
here: how long a part takes on a loaded CPU says nothing of the device (time belongs in
benchmarks, not in a test that gates)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils' timeout")
def test_budget_rehearsal_runs_every_part_and_records_its_time(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # PYTHON: the interpreter running the tests (the script's default, python3 on the PATH, is
    # another one where the venv is not activated)
    env = {**os.environ, "QUICK": "1", "NO_LIMITS": "1", "OUT": str(out),
           "ROOT": str(tmp_path / "root"), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh"), "budget"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = (out / "budget.txt").read_text().splitlines()
    parts = {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
             for m in (re.match(r"(\S+) (\d+) s \(limit (\d+) s\) rc=(\d+)$", x) for x in lines)
             if m}
    assert set(parts) == {"tests", "cache", "train-tiny"}, lines
    for name, (_took, _limit, rc) in parts.items():
        assert rc == 0, (name, rc)
    assert re.fullmatch(r"budget \d+ s wall in all", lines[-1]), lines
    assert "passed" in (out / "gpu-tests.txt").read_text()
    train = json.loads((out / "bench_train-tiny.json").read_text())
    assert all("error" not in r for r in train["results"]["tiny"].values())
    assert json.loads((out / "device_cache-gpu.json").read_text())
