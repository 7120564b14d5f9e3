"""``feedpipe shard --dask``: the writing as tasks on a real ``dask.distributed`` cluster of 2 worker
processes on 127.0.0.1; byte-identical to the local path, retried after a failing task and after a
worker dies, resumable, and a clear pip line when dask is missing."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import dir_bytes, run_feedpipe

from feedpipe import cli
from feedpipe.convert import shard
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
    from feedpipe import dask_convert, writer

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
    from feedpipe import dask_convert

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
    assert sorted(committed) == [f"data-{i:06d}.tar" for i in range(5)]
    assert dir_bytes(tmp_path / "out") == dir_bytes(sharded)


@pytest.mark.parametrize("how", ["raise", "die"])
def test_failed_tasks_are_retried(image_folder: Path, sharded: Path, client: Any,
                                  tmp_path: Path, how: str) -> None:
    marker = str(tmp_path / "failed-once")
    client.run(_fail_first_write, marker, how)
    shard(str(image_folder), str(tmp_path / "out"), dask=client, retries=1, **OPTS)
    assert os.path.exists(marker)  # the failure did happen
    assert dir_bytes(tmp_path / "out") == dir_bytes(sharded)


def _remove_before_writing(path: str) -> None:
    """On a worker: delete a source file just before the parts are written (it was listed)."""
    from feedpipe import dask_convert

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
    assert dir_bytes(out) == dir_bytes(sharded)


def test_cli_dask(image_folder: Path, sharded: Path, cluster: Any, tmp_path: Path) -> None:
    r = run_feedpipe("shard", image_folder, tmp_path / "out", "--dask", cluster.scheduler_address,
                     "--labels-from-dirs", "--max-samples", "7", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert dir_bytes(tmp_path / "out") == dir_bytes(sharded)


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
