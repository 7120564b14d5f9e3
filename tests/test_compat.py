"""feedpipe shards are plain WebDataset tars: the ``webdataset`` library, GNU ``tar`` and DALI read
them and see exactly what feedpipe's reader sees."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import webdataset as wds

import feedpipe
from feedpipe.format._keys import source_path
from feedpipe.format._manifest import load_manifest
from feedpipe.format._reader import ShardReader

Samples = list[tuple[str, dict[str, bytes]]]


def _feedpipe_samples(root: Path) -> Samples:
    out = []
    for rec in load_manifest(str(root)).shards:
        with ShardReader(str(root / rec.name)) as r:
            for s in r:
                out.append((s["__key__"], {k: bytes(v) for k, v in s.items()
                                           if not k.startswith("__")}))
    return out


def _wds_samples(root: Path) -> Samples:
    urls = [str(root / rec.name) for rec in load_manifest(str(root)).shards]
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in ds]


@pytest.fixture(scope="module")
def odd_sharded(odd_folder: tuple[Path, dict[str, bytes]],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("odd_sharded") / "out"
    feedpipe.shard(str(odd_folder[0]), str(out), max_samples=3, workers=1)
    return out


def test_webdataset_reads_image_shards_identically(sharded: Path) -> None:
    ours = _feedpipe_samples(sharded)
    theirs = _wds_samples(sharded)
    assert len(ours) == 30
    assert theirs == ours


def test_webdataset_reads_odd_names_identically(
    odd_sharded: Path, odd_folder: tuple[Path, dict[str, bytes]]
) -> None:
    ours = _feedpipe_samples(odd_sharded)
    theirs = _wds_samples(odd_sharded)
    assert theirs == ours
    # and what both see is the source, file for file
    rebuilt = {source_path(k, ext): data for k, fields in theirs for ext, data in fields.items()}
    assert rebuilt == odd_folder[1]


def test_gnu_tar_lists_and_extracts(odd_sharded: Path, tmp_path: Path) -> None:
    if shutil.which("tar") is None:
        pytest.skip("no tar binary")
    for rec in load_manifest(str(odd_sharded)).shards:
        tar = odd_sharded / rec.name
        listed = subprocess.run(["tar", "--list", "--quoting-style=literal", "-f", str(tar)],
                                capture_output=True, check=True,
                                env={**os.environ, "LC_ALL": "C.UTF-8"}).stdout
        dest = tmp_path / rec.name
        dest.mkdir()
        subprocess.run(["tar", "-xf", str(tar), "-C", str(dest)], check=True, capture_output=True)
        with ShardReader(str(tar)) as r:
            assert listed.decode().splitlines() == r.index.names
            for s in r:
                for ext, data in s.items():
                    if not ext.startswith("__"):
                        assert (dest / f"{s['__key__']}.{ext}").read_bytes() == data


def _dali_available() -> bool:
    try:  # find_spec imports the parent package: no ``nvidia`` at all raises, not None
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:
        return False


@pytest.mark.dali
@pytest.mark.skipif(not _dali_available(), reason="nvidia-dali not installed")
def test_dali_reads_feedpipe_shards_with_feedpipe_indexes(odd_sharded: Path) -> None:
    """DALI's reader, CPU only, given feedpipe's .idx files, returns the same bytes (member names
    in ustar prefix fields and GNU long-name records included)."""
    from nvidia.dali import fn, pipeline_def, types

    m = load_manifest(str(odd_sharded))
    ours = _feedpipe_samples(odd_sharded)
    tars = [str(odd_sharded / r.name) for r in m.shards]
    exts = m.fields

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
    def pipe():  # type: ignore[no-untyped-def]
        return tuple(fn.readers.webdataset(
            paths=tars, index_paths=[t[:-4] + ".idx" for t in tars], ext=exts,
            missing_component_behavior="empty", random_shuffle=False, name="reader",
            dtypes=[types.UINT8] * len(exts),
        ))

    p = pipe()
    p.build()
    assert p.epoch_size("reader") == len(ours)
    for _key, fields in ours:
        outs = p.run()
        got = {ext: bytes(memoryview(outs[i].at(0))) for i, ext in enumerate(exts)}
        assert got == {ext: fields.get(ext, b"") for ext in exts}
