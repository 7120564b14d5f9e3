"""Two real torch.distributed ranks (gloo on 127.0.0.1), each reading through two real
DataLoader worker processes (the ``samples-workers`` route; their pids are checked)."""

from __future__ import annotations

import json
import socket
from collections import Counter

import pytest
import torch.multiprocessing as mp
from _data import make_dataset
from _ranks import ddp_rank


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("ddp")), classes=5, per_class=5,
                        max_samples=6)  # 25 samples: odd, so ranks need padding or a drop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.slow
def test_two_gloo_ranks_exactly_once_equal_batches(ds_path: str, tmp_path, drop_last: bool) -> None:  # type: ignore[no-untyped-def]
    out = str(tmp_path / "result.json")
    mp.spawn(ddp_rank, args=(2, free_port(), ds_path, out, drop_last), nprocs=2, join=True)
    with open(out) as f:
        ranks = json.load(f)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["len"]
    for r in ranks:  # each rank's batches came from two worker processes of its own
        assert len(set(r["workers"])) == 2 and r["pid"] not in r["workers"]
    assert not set(ranks[0]["workers"]) & set(ranks[1]["workers"])
    c = Counter(ranks[0]["ids"] + ranks[1]["ids"])
    if drop_last:
        assert len(ranks[0]["ids"]) == len(ranks[1]["ids"]) == 12
        assert max(c.values()) == 1 and len(c) == 24
    else:
        assert len(ranks[0]["ids"]) == len(ranks[1]["ids"]) == 13
        assert set(c) == set(range(25)) and sum(c.values()) == 26
