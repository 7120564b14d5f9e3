"""``feedpipe shard --dask`` interrupted (a Ctrl-C, or any error in the client): the tasks the
cluster is running end before the run does, so nothing writes into OUT after the run said it
stopped. A real ``dask.distributed`` cluster of 2 worker processes on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from feedpipe.convert._shard import shard
from feedpipe.convert._synth import make_image_folder

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  host="127.0.0.1", dashboard_address=None) as cluster, \
            distributed.Client(cluster.scheduler_address) as c:
        yield c


def _executing(dask_worker: Any) -> int:
    """On a worker: its tasks still running, cancelled ones included."""
    return int(dask_worker.state.executing_count)


@pytest.mark.slow
def test_an_interrupted_dask_run_ends_its_running_tasks_before_it_returns(
        client: Any, tmp_path: Path) -> None:
    """The client cancelled its futures and returned at once, but a task the cluster is running
    cannot be cancelled: each went on through its remaining shards, committing them into OUT
    after the run had ended (under the eyes of a --resume, or of a user told it stopped). Now
    the tasks are told to start no other shard and the run waits for them: when it ends, no
    task of it runs, and its stop file is gone."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_image_folder(str(src), classes=2, per_class=150)  # 150 shards of 2, ~19 per task

    def stop_at_the_first(rec: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        shard(str(src), str(out), dask=client, max_samples=2, on_shard=stop_at_the_first)
    assert sum(client.run(_executing).values()) == 0
    tars = sorted(p.name for p in out.glob("*.tar"))
    assert 1 <= len(tars) < 150
    assert not [n for n in os.listdir(out) if n.startswith(".feedpipe-dask-stop")]
    s = shard(str(src), str(out), dask=client, max_samples=2, resume=True)
    assert s.shards == 150 and s.reused_shards == len(tars)
