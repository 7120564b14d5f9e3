"""A Parquet source through the planner and every executor of a file tree: the same shards
whatever writes them, a deterministic ``--shuffle``, a resume after a SIGKILL that keeps the
committed shards, and ``--part`` runs that merge into the single run's dataset.

These options used to be refused for tables (``--workers`` ignored)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from conftest import dataset_bytes, read_dataset, run_feedpipe

import feedpipe
from feedpipe.format._manifest import load_manifest

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (the parquet extra)")
pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (the parquet extra)")

ROWS = 40
OPTS: dict[str, Any] = {"max_samples": 6, "show_progress": False}


def _jpeg(i: int) -> bytes:
    img = np.full((8, 8, 3), i * 5 % 256, dtype=np.uint8)
    return bytes(simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB"))


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Parquet files of several row groups each: images, labels as categories, text."""
    src = tmp_path_factory.mktemp("table") / "t"
    src.mkdir()
    labels = pa.array(["cat", "dog", "emu"])
    for f, (lo, hi) in enumerate([(0, 25), (25, ROWS)]):
        pq.write_table(pa.table({
            "image": pa.array([_jpeg(i) for i in range(lo, hi)], pa.binary()),
            "label": pa.DictionaryArray.from_arrays(
                pa.array([i % 3 for i in range(lo, hi)], pa.int8()), labels),
            "caption": [f"row {i}" * (i % 4 + 1) for i in range(lo, hi)],
        }), src / f"part-{f}.parquet", row_group_size=7)
    return src


@pytest.fixture(scope="module")
def reference(table: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "o"
    s = feedpipe.shard(str(table), str(out), workers=1, method="general", **OPTS)
    assert (s.method, s.samples, s.files) == ("table", ROWS, ROWS)
    assert s.executor == "in this process, one worker"
    return out


@pytest.fixture(scope="module")
def dask_client() -> Iterator[Any]:
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("cloudpickle")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster.scheduler_address) as client:
        yield client


def _keys(out: Path) -> list[str]:
    return [str(s["__key__"]) for s in read_dataset(out)]


def test_the_reference_holds_every_row_in_order(table: Path, reference: Path) -> None:
    got = read_dataset(reference)
    assert _keys(reference) == [f"part-0/{i:08d}" for i in range(25)] + [
        f"part-1/{i:08d}" for i in range(15)]
    assert [s["jpg"] for s in got] == [_jpeg(i) for i in range(ROWS)]
    assert [s["cls"] for s in got] == [str(i % 3).encode() for i in range(ROWS)]
    m = load_manifest(str(reference))
    assert m.classes == ["cat", "dog", "emu"] and m.created_by["columns"]["image"] == "jpg"
    assert [r.samples for r in m.shards] == [6] * 6 + [4]


@pytest.mark.parametrize("executor", ["pool-fork", "pool-spawn",
                                      pytest.param("dask", marks=pytest.mark.slow)])
def test_every_executor_writes_the_reference_bytes(table: Path, reference: Path, tmp_path: Path,
                                                   executor: str, request: Any) -> None:
    out = tmp_path / "o"
    if executor == "dask":
        s = feedpipe.shard(str(table), str(out), dask=request.getfixturevalue("dask_client"),
                           **OPTS)
    else:
        s = feedpipe.shard(str(table), str(out), workers=2, method="general",
                           start_method=executor.split("-")[1], **OPTS)
        assert s.executor == "process pool, 2 workers"
    assert s.method == "table" and s.samples == ROWS
    assert dataset_bytes(out) == dataset_bytes(reference)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_fresh_run_reads_each_row_once_and_writes_the_reference_bytes(
        table: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        workers: int) -> None:
    """The rows are staged as they are listed: no row group is read again to write it (the
    planned route read every row twice, and once more per part in each worker)."""
    from feedpipe.convert import _table_rows

    reads: list[object] = []
    load = _table_rows.TableRows._load
    monkeypatch.setattr(_table_rows.TableRows, "_load",
                        lambda self, *a: reads.append(a) or load(self, *a))
    out = tmp_path / "o"
    s = feedpipe.shard(str(table), str(out), workers=workers, **OPTS)
    assert reads == []
    assert (s.method, s.samples) == ("table", ROWS) and s.executor.startswith("one pass")
    assert dataset_bytes(out) == dataset_bytes(reference)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_shuffle_is_deterministic_and_a_permutation(table: Path, reference: Path,
                                                    tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    feedpipe.shard(str(table), str(a), shuffle=True, seed=1, workers=1, **OPTS)
    feedpipe.shard(str(table), str(b), shuffle=True, seed=1, workers=2, **OPTS)
    feedpipe.shard(str(table), str(c), shuffle=True, seed=2, workers=1, **OPTS)
    assert dataset_bytes(a) == dataset_bytes(b)
    assert sorted(_keys(a)) == _keys(reference) != _keys(a) != _keys(c)
    by_key = {s["__key__"]: s for s in read_dataset(reference)}
    assert all(s == {**by_key[s["__key__"]], "__shard__": s["__shard__"],
                     "__index__": s["__index__"]} for s in read_dataset(a))


_KILLED = textwrap.dedent("""
    import sys, feedpipe
    def wait_after_two(rec, seen=[]):
        seen.append(rec)
        if len(seen) == 2:
            print("two", flush=True)
            sys.stdin.readline()
    feedpipe.shard(sys.argv[1], sys.argv[2], max_samples=6, workers=int(sys.argv[3]),
                   shuffle=True, show_progress=False, on_shard=wait_after_two)
""")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_killed_by_sigkill_resumes_keeping_its_committed_shards(
        table: Path, tmp_path: Path, workers: int) -> None:
    ref = tmp_path / "ref"
    feedpipe.shard(str(table), str(ref), shuffle=True, workers=1, **OPTS)
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", _KILLED, str(table), str(out), str(workers)],
                         env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "two\n"
        os.killpg(p.pid, signal.SIGKILL)  # the run and its pool workers, as an OOM kill would
        assert p.wait() == -signal.SIGKILL
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    committed = {p.name: p.read_bytes() for p in out.glob("data-*.tar")}  # (pool: any two)
    assert len(committed) >= 2
    r = run_feedpipe("verify", out)
    assert r.returncode != 0 and "interrupted" in r.stderr and "--resume" in r.stderr
    s = feedpipe.shard(str(table), str(out), shuffle=True, workers=3 - workers, resume=True,
                       **OPTS)
    assert s.reused_shards == len(committed) and s.samples == ROWS
    assert all((out / n).read_bytes() == b for n, b in committed.items())
    assert dataset_bytes(out) == dataset_bytes(ref)
    with pytest.raises(feedpipe.errors.OutputError, match="cannot resume"):
        feedpipe.shard(str(table), str(out), shuffle=True, resume=True, workers=1,
                       max_samples=5, show_progress=False)


@pytest.mark.parametrize("shuffle", [False, True])
def test_parts_merge_into_the_single_runs_samples(table: Path, tmp_path: Path,
                                                  shuffle: bool) -> None:
    single = tmp_path / "single"
    feedpipe.shard(str(table), str(single), shuffle=shuffle, workers=1, **OPTS)
    out = tmp_path / "parts"
    s = feedpipe.shard(str(table), str(out), part="0/2", merge=True, shuffle=shuffle, workers=2,
                       **OPTS)
    assert s.part == "0/2" and not s.merged
    r = run_feedpipe("shard", table, out, "--part", "1/2", "--max-samples", "6", "--workers",
                     "1", *(["--shuffle"] if shuffle else []), "--merge")
    assert r.returncode == 0, r.stderr
    assert load_manifest(str(out)).total_samples == ROWS
    got, want = read_dataset(out), read_dataset(single)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    assert [s["jpg"] for s in got] == [s["jpg"] for s in want]
    assert load_manifest(str(out)).classes == ["cat", "dog", "emu"]


@pytest.mark.slow
def test_a_hugging_face_dataset_takes_the_same_options(tmp_path: Path) -> None:
    """shard_from wrote a datasets.Dataset in one pass with none of these options."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (the hub extra)")
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": _jpeg(i), "path": None} for i in range(ROWS)],
         "label": [i % 3 for i in range(ROWS)],
         "text": [f"t{i}" * (i % 3 + 1) for i in range(ROWS)]},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=["cat", "dog", "emu"]),
                                    "text": datasets.Value("string")}))
    kw: dict[str, Any] = {"max_samples": 6, "shuffle": True, "seed": 3}
    ref = tmp_path / "ref"
    s = feedpipe.shard_from(ds, str(ref), **kw)
    assert s.samples == ROWS and s.executor == "in this process, one worker"
    assert sorted(_keys(ref)) == [f"{i:08d}" for i in range(ROWS)] != _keys(ref)
    assert load_manifest(str(ref)).classes == ["cat", "dog", "emu"]
    pool = tmp_path / "pool"
    s = feedpipe.shard_from(ds, str(pool), workers=2, **kw)
    assert s.executor == "process pool, 2 workers"
    assert dataset_bytes(pool) == dataset_bytes(ref)

    class Stop(Exception):
        pass

    def stop_after_two(rec: object, seen: list[object] = []) -> None:  # noqa: B006
        seen.append(rec)
        if len(seen) == 2:
            raise Stop

    out = tmp_path / "o"
    with pytest.raises(Stop):
        feedpipe.shard_from(ds, str(out), on_shard=stop_after_two, **kw)
    s = feedpipe.shard_from(ds, str(out), resume=True, **kw)
    assert s.reused_shards == 2 and dataset_bytes(out) == dataset_bytes(ref)
    parts = tmp_path / "parts"
    for i in range(2):
        feedpipe.shard_from(ds, str(parts), part=(i, 2), merge=True, **kw)
    assert _keys(parts) == _keys(ref)
    with pytest.raises(ValueError, match=r"IterableDataset is read once.*: part, shuffle cannot"):
        feedpipe.shard_from(ds.to_iterable_dataset(), str(tmp_path / "it"), shuffle=True,
                            part="0/2")
