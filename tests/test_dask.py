"""``feedpipe shard --dask``: the writing as tasks on a real ``dask.distributed`` cluster of 2
worker processes on 127.0.0.1; byte-identical to the local path (whole-shard tasks and shards split
over tasks), retried after a failing task and after a worker dies, resumable, and a clear pip line
when dask is missing. The grouping of parts into tasks is a pure function, checked with
Hypothesis."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import dataset_bytes, run_feedpipe
from hypothesis import given
from hypothesis import strategies as st

from feedpipe.cli import _main as cli
from feedpipe.convert import _dask as dask_convert
from feedpipe.convert import _shard_run
from feedpipe.convert._dask import plan_tasks
from feedpipe.convert._shard import shard
from feedpipe.convert._sources import FileRef, SampleSpec
from feedpipe.errors import InputError, MissingDependencyError

distributed = pytest.importorskip("distributed")
cloudpickle = pytest.importorskip("cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/

OPTS: dict[str, Any] = {"labels_from_dirs": True, "max_samples": 7}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  host="127.0.0.1", dashboard_address=None) as c:
        yield c


def _restore_write_part() -> None:
    from feedpipe.convert import _dask as dask_convert
    from feedpipe.convert import _writer as writer

    dask_convert.write_part = writer.write_part


@pytest.fixture
def client(cluster: Any) -> Iterator[Any]:
    """A client; what a test patched on the workers is undone afterwards."""
    with distributed.Client(cluster.scheduler_address) as c:
        yield c
        c.run(_restore_write_part)


def _fail_first_write(marker: str, how: str) -> None:
    """On a worker: make the first part write in the whole cluster fail (``how="raise"``: a
    transient error; ``"die"``: the worker process dies), once (``marker`` decides)."""
    from feedpipe.convert import _dask as dask_convert

    original = dask_convert.write_part

    def flaky(*args: Any, **kw: Any) -> Any:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return original(*args, **kw)
        if how == "die":
            os._exit(1)
        raise OSError("injected transient failure")

    dask_convert.write_part = flaky


def test_dask_output_is_byte_identical_to_the_local_path(
        image_folder: Path, sharded: Path, cluster: Any, tmp_path: Path) -> None:
    committed: list[str] = []
    s = shard(str(image_folder), str(tmp_path / "out"), dask=cluster.scheduler_address,
              on_shard=lambda rec: committed.append(rec.name), **OPTS)
    assert s.shards == 5 and s.samples == 30
    assert s.method == "general" and s.executor.startswith("tasks on the Dask cluster")
    assert sorted(committed) == [f"data-{i:06d}.tar" for i in range(5)]
    assert dataset_bytes(tmp_path / "out") == dataset_bytes(sharded)


def _split_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan on the client so that every shard is cut into parts of 2 samples, written by tasks
    of at most 2 files, and joined by a task of its own."""
    monkeypatch.setattr(_shard_run, "PART_SAMPLES", 2)
    monkeypatch.setattr(dask_convert, "TASK_FILES", 2)


def test_shards_split_over_tasks_are_byte_identical(
        image_folder: Path, sharded: Path, client: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _split_shards(monkeypatch)
    committed: list[str] = []
    s = shard(str(image_folder), str(tmp_path / "out"), dask=client,
              on_shard=lambda rec: committed.append(rec.name), **OPTS)
    assert s.shards == 5
    assert sorted(committed) == [f"data-{i:06d}.tar" for i in range(5)]
    assert dataset_bytes(tmp_path / "out") == dataset_bytes(sharded)


@pytest.mark.parametrize("how,split", [("raise", False), ("die", False), ("raise", True)])
def test_failed_tasks_are_retried(image_folder: Path, sharded: Path, client: Any,
                                  tmp_path: Path, how: str, split: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if split:
        _split_shards(monkeypatch)
    marker = str(tmp_path / "failed-once")
    client.run(_fail_first_write, marker, how)
    shard(str(image_folder), str(tmp_path / "out"), dask=client, retries=1, **OPTS)
    assert os.path.exists(marker)  # the failure did happen
    assert dataset_bytes(tmp_path / "out") == dataset_bytes(sharded)


def _remove_before_writing(path: str) -> None:
    """On a worker: delete a source file just before the parts are written (it was listed)."""
    from feedpipe.convert import _dask as dask_convert

    original = dask_convert.write_part

    def removing(*args: Any, **kw: Any) -> Any:
        if os.path.exists(path):
            os.unlink(path)
        return original(*args, **kw)

    dask_convert.write_part = removing


def test_failure_after_retries_names_the_file(image_folder: Path, sharded: Path, client: Any,
                                              tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder, src)
    client.run(_remove_before_writing, str(src / "cls_001" / "00004.jpg"))
    with pytest.raises(InputError, match=r"cls_001/00004\.jpg: cannot read"):
        shard(str(src), str(tmp_path / "out"), dask=client, retries=1, **OPTS)
    assert not (tmp_path / "out" / "manifest.json").exists()
    for p in (tmp_path / "out").glob("*.tar"):  # shards that did commit are whole
        assert p.read_bytes() == (sharded / p.name).read_bytes()


def test_interrupted_dask_run_resumes_to_the_same_bytes(
        image_folder: Path, sharded: Path, client: Any, tmp_path: Path) -> None:
    class Stop(Exception):
        pass

    seen: list[str] = []

    def stop_after_two(rec: Any) -> None:
        seen.append(rec.name)
        if len(seen) == 2:
            raise Stop

    out = tmp_path / "out"
    with pytest.raises(Stop):
        shard(str(image_folder), str(out), dask=client, on_shard=stop_after_two, **OPTS)
    assert not (out / "manifest.json").exists()
    s = shard(str(image_folder), str(out), dask=client, resume=True, **OPTS)
    assert s.reused_shards >= 2
    assert dataset_bytes(out) == dataset_bytes(sharded)


def test_cli_dask(image_folder: Path, sharded: Path, cluster: Any, tmp_path: Path) -> None:
    r = run_feedpipe("shard", image_folder, tmp_path / "out", "--dask", cluster.scheduler_address,
                     "--labels-from-dirs", "--max-samples", "7", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert dataset_bytes(tmp_path / "out") == dataset_bytes(sharded)


def test_missing_dask_names_the_pip_line(image_folder: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'feedpipe\[dask\]'"):
        shard(str(image_folder), str(tmp_path / "out"), dask="tcp://127.0.0.1:1")
    assert cli.main(["shard", str(image_folder), str(tmp_path / "out"), "--dask",
                     "tcp://127.0.0.1:1"]) == 2
    assert "pip install 'feedpipe[dask]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # failed before touching anything


def _spec(k: int, files: int) -> SampleSpec:
    return SampleSpec(f"{k:05d}", [FileRef(f"f{n}", f"{k}.f{n}", 100) for n in range(files)])


plans = st.lists(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=5), min_size=1,
                          max_size=6), min_size=1, max_size=8)


@given(plans, st.integers(1, 5), st.integers(1, 12))
def test_plan_tasks_covers_every_part_once_in_order(shape: list[list[list[int]]], slots: int,
                                                    max_files: int) -> None:
    k = iter(range(10**6))
    plan = [[[_spec(next(k), n) for n in part] for part in shard] for shard in shape]
    todo = [i for i in range(len(plan)) if i % 3 != 1]  # as if the rest were resumed
    tasks = plan_tasks(plan, todo, slots=slots, max_files=max_files)
    units = [u for t in tasks for u in t]
    assert all(t for t in tasks)
    assert [(u.shard, j) for u in units for j in range(u.first, u.end)] == [
        (i, j) for i in todo for j in range(len(plan[i]))]
    for t in tasks:
        assert all(u.whole for u in t) or len(t) == 1  # a split shard's tasks hold only it
        files = sum(len(s.files) for u in t for p in plan[u.shard][u.first:u.end] for s in p)
        if len(t) > 1:
            assert files <= max_files
    for u in units:
        assert u.whole == (u.first == 0 and u.end == len(plan[u.shard])
                           and not [v for v in units if v.shard == u.shard and v is not u])


def test_plan_tasks_is_coarse_when_there_is_work_enough() -> None:
    """20,000 one-file samples, 256 a part and 2,000 a shard, on 2 workers: whole shards, two
    to a task (4,000 files of ~0.5 s), not one task per 256-sample part."""
    plan = [[[_spec(s * 2000 + p * 256 + n, 1) for n in range(min(256, 2000 - p * 256))]
             for p in range(8)] for s in range(10)]
    tasks = plan_tasks(plan, range(10), slots=1)
    assert [[u.shard for u in t] for t in tasks] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert len(plan_tasks(plan, range(10), slots=2)) == 10  # 4 tasks a worker
    with pytest.raises(ValueError, match="slots must be at least 1"):
        plan_tasks(plan, [0], slots=0)
