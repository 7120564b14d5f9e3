"""Mid-epoch and elastic resumption across real processes: a new interpreter, each rank reading
through real DataLoader worker processes (the ``samples-workers`` route; their pids checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from _data import make_dataset

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("resume")), classes=7, per_class=9,
                        max_samples=10)  # 63 samples, 7 shards


def run(**args) -> dict:  # type: ignore[no-untyped-def]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_ranks.py"), json.dumps(args)],
                          capture_output=True, text=True, timeout=300, cwd=HERE)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stop_save_new_process_resume_equals_uninterrupted(ds_path: str) -> None:
    full = run(path=ds_path, world=1, workers=2, batch=4, epoch=3)
    assert sorted(full["ids"]) == list(range(63))
    first = run(path=ds_path, world=1, workers=2, batch=4, epoch=3, stop=5)
    assert first["state"]["position"] == 20
    rest = run(path=ds_path, world=1, workers=2, batch=4, epoch=3, state=first["state"])
    assert first["ids"] + rest["ids"] == full["ids"]
    for r in (full, first, rest):
        assert len(r["pids"][0]) == 2 and r["pid"] not in r["pids"][0]


@pytest.mark.parametrize("world2,workers2", [pytest.param(3, 1, marks=pytest.mark.slow),
                                              pytest.param(1, 2, marks=pytest.mark.slow),
                                              (2, 2)])
def test_elastic_resume_delivers_the_rest_exactly_once(ds_path: str, world2: int,
                                                       workers2: int) -> None:
    first = run(path=ds_path, world=2, workers=2, batch=4, epoch=0, stop=3)
    assert first["state"]["position"] == 24  # 3 batches x 4 samples x 2 ranks
    rest = run(path=ds_path, world=world2, workers=workers2, batch=5, epoch=0,
               state=first["state"])
    c = Counter(first["ids"] + rest["ids"])
    assert set(c) == set(range(63)), "a sample was lost"
    repeats = sum(c.values()) - 63
    assert repeats == (-(63 - 24) % world2), "only the new world's padding may repeat"
    assert not set(first["ids"]) & set(rest["ids"][: 63 - 24 - world2]), "seen twice"
    # each rank read through its own real worker processes, before and after
    assert [len(p) for p in first["pids"]] == [2, 2]
    assert [len(p) for p in rest["pids"]] == [workers2] * world2
