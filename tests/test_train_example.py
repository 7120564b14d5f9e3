"""tools/train_ddp.py under torchrun, as its docstring and the launch script document it:
checkpoint mid-epoch, resume on another world size, on the example data and on another dataset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import feedpipe
from feedpipe.convert._synth import make_image_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def docstring_commands() -> list[str]:
    """The shell lines of train_ddp.py's walk-through, as printed (comments stripped)."""
    import ast

    with open(os.path.join(TOOLS, "train_ddp.py"), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    lines = [line.strip() for line in doc.splitlines() if line.startswith("    ")]
    return [line.split("  #")[0].strip() for line in lines
            if line.startswith(("python ", "torchrun "))]


def bash(cmd: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` in bash in ``cwd``, with this interpreter's bin directory (python, torchrun)
    first on PATH."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PATH": path, **env}, check=False)


def sh(cmd: str, cwd: Path, **env: str) -> str:
    """:func:`bash`, failing the test on a non-zero exit; returns stdout."""
    proc = bash(cmd, cwd, **env)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A working directory laid out like the checkout (tools/ copied), so that the commands'
    relative paths (tools/..., shards/example, runs/...) land in the test's temp dir."""
    shutil.copytree(TOOLS, tmp_path / "tools")
    return tmp_path


def other_dataset(where: Path) -> Path:
    """40 images in 5 classes: another size and another class count than the example."""
    make_image_folder(str(where / "other-src"), classes=5, per_class=8, min_size=16,
                      max_size=24, seed=3)
    feedpipe.shard(str(where / "other-src"), str(where / "other"), max_samples=9,
                   labels_from_dirs=True, workers=1, show_progress=False)
    return where / "other"


def exactly_once(log: Path, samples: int) -> None:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    for epoch in (0, 1):
        c = Counter(i for r in rows if r["epoch"] == epoch for i in r["ids"])
        assert set(c) == set(range(samples)) and max(c.values()) == 1, (epoch, c)


@pytest.mark.slow
def test_the_docstring_walkthrough_runs_as_written_then_on_another_dataset(
        checkout: Path) -> None:
    """The walk-through as printed; then its commands on another dataset with the default
    checkpoint path (the example's checkpoint in runs/ is not resumed) and --stop-after 5, the
    epoch's last step, the case whose resume used to fail with UnboundLocalError."""
    cmds = docstring_commands()
    assert [c.split()[0] for c in cmds] == ["python", "torchrun", "torchrun"], cmds
    outs = [sh(c, checkout) for c in cmds]
    assert (checkout / "shards" / "example" / "manifest.json").exists()
    assert "checkpoint at epoch 1 step 2" in outs[1]
    assert "resumed from runs/example.pt at epoch 1, position 16" in outs[2]
    assert "epoch 1: 2 steps per rank" in outs[2]  # 8 samples left, 1 rank, batches of 4
    # the ids log lies in runs/, which no one made beforehand (every rank crashed with
    # FileNotFoundError at its first step); it shows both epochs exactly once over both jobs
    exactly_once(checkout / "runs" / "ids.jsonl", 24)

    data = other_dataset(checkout)
    log = checkout / "ids.jsonl"
    first, second = (c.replace("shards/example", str(data)).replace(" --ckpt runs/example.pt", "")
                     .replace("runs/ids.jsonl", str(log)) for c in cmds[1:])
    out = sh(first.replace("--stop-after 2", "--stop-after 5"), checkout)
    assert "no checkpoint at runs/other-" in out and "checkpoint at epoch 1 step 5" in out
    out = sh(second, checkout)
    # a state saved after an epoch's last batch is the start of the next epoch
    assert "resumed from runs/other-" in out and "at epoch 2, position 0" in out
    assert "all 2 epochs are done" in out
    exactly_once(log, 40)
    bad = bash(f"torchrun --nproc_per_node=1 tools/train_ddp.py {data} --ckpt runs/example.pt "
               "--workers 0", checkout)
    assert bad.returncode != 0
    assert "runs/example.pt: cannot resume" in bad.stderr
    assert "belongs to another run" in bad.stderr


@pytest.mark.slow
def test_single_node_launcher_reads_local_shards_in_place_and_resumes_elastically(
        checkout: Path, tmp_path: Path) -> None:
    data = other_dataset(checkout)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    log = checkout / "ids.jsonl"
    launch = f"bash tools/launch/torchrun_single_node.sh {data}"
    env = {"TMPDIR": str(tmpdir), "FEEDPIPE_CACHE_DIR": ""}
    out = sh(f"{launch} 2 --stop-after 2 --ids-log {log}", checkout, **env)
    assert "no checkpoint at runs/other-" in out and "checkpoint at epoch 1 step 2" in out
    out = sh(f"{launch} 1 --ids-log {log} --workers 1", checkout, **env)
    assert "resumed from runs/other-" in out and "position 16" in out
    exactly_once(log, 40)
    assert not [p for p in tmpdir.iterdir() if "feedpipe" in p.name]  # no cache of local shards
    assert [p.name for p in (checkout / "runs").iterdir()] == [
        Path(os.path.dirname(out.split("resumed from ")[1].split(" at epoch")[0])).name]


@pytest.mark.slow
def test_a_ledger_proves_a_stopped_and_resumed_run_exactly_once(checkout: Path) -> None:
    """The walk-through's two jobs (2 ranks stopped mid-epoch, the rest on 1 rank) given one
    --ledger directory: `feedpipe ledger` finds both epochs delivered exactly once."""
    data = other_dataset(checkout)
    ledger = checkout / "runs" / "ledger"
    train = (f"torchrun --nproc_per_node={{}} tools/train_ddp.py {data} --ckpt runs/x.pt "
             f"--ledger {ledger}")
    assert "checkpoint at epoch 1 step 2" in sh(train.format(2) + " --stop-after 2", checkout)
    assert "position 16" in sh(train.format(1) + " --workers 1", checkout)
    out = sh(f"{sys.executable} -m feedpipe ledger {ledger}", checkout)
    assert "OK: every finished epoch exactly once" in out, out
    assert ("epoch 1 (finished: every rank reached the end of its share, 3 parts): 40 of 40 "
            "delivered - exactly once") in out, out
