"""tools/train_ddp.py under torchrun: checkpoint mid-epoch, resume on another world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "tools", "train_ddp.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_train_checkpoint_resume_elastic(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt, log = str(tmp_path / "ckpt.pt"), str(tmp_path / "ids.jsonl")
    data = os.path.join(ROOT, "shards", "example")
    out = torchrun(2, data, "--ckpt", ckpt, "--ids-log", log, "--stop-after", "2")
    assert "checkpoint at epoch 1 step 2" in out
    out = torchrun(1, data, "--ckpt", ckpt, "--ids-log", log, "--workers", "1")
    assert "resumed at epoch 1, position 16" in out
    rows = [json.loads(line) for line in open(log)]
    for epoch in (0, 1):
        c = Counter(i for r in rows if r["epoch"] == epoch for i in r["ids"])
        assert set(c) == set(range(24)) and max(c.values()) == 1, (epoch, c)
