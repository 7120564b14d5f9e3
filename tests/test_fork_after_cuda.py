"""Workers fork from a training process that has initialised CUDA, as DataLoader workers do, and
that is safe because they touch neither CUDA nor DALI: a laptop script (lambda transform, no
``__main__`` guard) runs unchanged on the GPU box. The ``cuda`` case is the proof on a GPU
machine (the script makes a CUDA context before its loaders, and each worker reports that it
was forked from it); the ``cpu`` case runs the same script everywhere so that it cannot rot.
A process that is not safe to fork from (DALI's threads) is refused with a sentence:
tests/test_dataset.py::test_the_start_method_is_the_users."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from feedpipe._helpers.fork_safety import default_start_method

SCRIPT = Path(__file__).with_name("_fork_script.py")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FORK = pytest.mark.skipif(default_start_method() != "fork",
                          reason=f"the platform starts processes by {default_start_method()!r}, "
                                 "not fork: a guard-less script with a lambda cannot run there")


@FORK
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])])
def test_a_laptop_script_runs_unchanged_after_cuda_init(ds_path: str, tmp_path: Path,
                                                        device: str) -> None:
    log = tmp_path / "imports.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(SCRIPT), ds_path, device, str(log)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # the guard-less script ran once: no worker imported it again
    assert log.read_text().split() == [str(got["parent"])]
    assert got["cuda_initialised"] is (device == "cuda")
    for route in ("samples-workers", "rows-workers", "refs-workers"):
        r = got[route]
        assert r["same"], route
        assert r["samples"] == 25, route
        assert r["start_method"] == "fork", route
        assert len(r["worker_pids"]) == 2 and got["parent"] not in r["worker_pids"], route
        assert r["total"] > 0, route
    lam = got["samples-workers"]
    # the lambda ran in the worker processes, each of them forked from a process with CUDA
    # initialised exactly when the parent had it (torch marks such a child a "bad fork")
    assert set(lam["transform_pids"]) <= set(lam["worker_pids"]) and lam["transform_pids"]
    assert set(lam["workers_saw_cuda_in_bad_fork"]) == {device == "cuda"}
