"""The L1 shard cache checks every file it serves, the ``.idx`` as the ``.tar``: on fetch (a file
corrupted in transit is fetched again, a bounded number of times, then named) and on reuse (a file
damaged in the cache directory is checked again and fetched again), against a counting HTTP server
on 127.0.0.1 that corrupts bodies on demand."""

from __future__ import annotations

import hashlib
import os
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
from _servers import python_server

import feedpipe
from feedpipe import FeedDataset
from feedpipe.caches._shards import ShardCache
from feedpipe.caches.l1._entry import FETCH_ATTEMPTS, entry_key
from feedpipe.caches.l1._integrity import stamp
from feedpipe.convert._synth import make_records
from feedpipe.errors import ShardFormatError
from feedpipe.format._manifest import load_manifest

SHARDS, PER_SHARD = 6, 10


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ds``: 6 shards of 10 records of 300 bytes (every shard the same sample count)."""
    r = tmp_path_factory.mktemp("integrity")
    make_records(str(r / "src"), count=SHARDS * PER_SHARD, size=300, per_dir=1000, seed=11)
    feedpipe.shard(str(r / "src"), str(r / "ds"), max_samples=PER_SHARD, workers=1,
                   show_progress=False)
    return r


@pytest.fixture(scope="module")
def expected(data: Path) -> dict[str, bytes]:
    return {s["__key__"]: bytes(s["bin"]) for s in FeedDataset(str(data / "ds"))}


def wrong(ds: FeedDataset, expected: dict[str, bytes]) -> tuple[int, int]:
    """(samples read, samples whose bytes are not their key's in the source)."""
    n = bad = 0
    for s in ds:
        n += 1
        bad += bytes(s["bin"]) != expected[s["__key__"]]
    return n, bad


def requests(server: Any, suffix: str) -> dict[str, int]:
    return {p.rsplit("/", 1)[-1]: v["requests"] for p, v in server.stats().items()
            if p.endswith(suffix)}


def cached(cache: Path, suffix: str) -> dict[str, bytes]:
    """Cached files by their source name (``<hash>-data-000000.idx`` -> ``data-000000.idx``)."""
    return {p.name.split("-", 1)[1]: p.read_bytes() for p in sorted(cache.iterdir())
            if p.name.endswith(suffix)}


def source_files(root: Path, suffix: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name.endswith(suffix)}


# -- on fetch ------------------------------------------------------------------------------------
def test_an_index_corrupted_in_transit_is_fetched_again_and_never_stored(
        data: Path, expected: dict[str, bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the fill's checks: a first batch read by range is checked as an uncached read is (size
    # only, docs/concepts.md), so it is left out here
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    with python_server(data, "--corrupt", ".idx:2") as srv:
        ds = FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c")
        assert wrong(ds, expected) == (SHARDS * PER_SHARD, 0)
        assert sum(requests(srv, ".idx").values()) == SHARDS + 2  # two fetched twice
    assert cached(tmp_path / "c", ".idx") == source_files(data / "ds", ".idx")
    assert ds.cache.stats.refetched == 2
    # a later run against the healthy server is served from the cache, no error
    with python_server(data) as srv:
        again = FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c")
        assert wrong(again, expected) == (SHARDS * PER_SHARD, 0)
        assert requests(srv, ".idx") == {} and requests(srv, ".tar") == {}


def test_an_index_corrupted_on_every_fetch_is_named_after_bounded_fetches(
        data: Path, tmp_path: Path) -> None:
    with python_server(data, "--corrupt", ".idx:1000") as srv, \
            pytest.raises(ShardFormatError) as e:
        try:
            list(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c"))
        finally:
            first = requests(srv, ".idx")
    msg = str(e.value)
    assert f"{srv.url}/ds/data-000000.idx" in msg and "UTF-8" in msg
    assert f"{FETCH_ATTEMPTS} " in msg and str(tmp_path / "c") in msg
    assert not isinstance(e.value.__cause__, UnicodeDecodeError)
    # the prefetcher's tries and the reader's, and one by the first batch's early range read
    # (caches/_early.py), which gives up after one bad index and waits for the shard
    assert max(first.values()) <= 2 * FETCH_ATTEMPTS + 1
    assert cached(tmp_path / "c", ".idx") == {} and cached(tmp_path / "c", ".part") == {}


def test_a_shard_corrupted_in_transit_is_fetched_again(
        data: Path, expected: dict[str, bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")  # the fill's checks (as above)
    with python_server(data, "--corrupt", ".tar:1") as srv:  # no prefetch: the reader re-fetches
        ds = FeedDataset(f"{srv.url}/ds", cache_dir=ShardCache(tmp_path / "c", prefetch=0))
        assert wrong(ds, expected) == (SHARDS * PER_SHARD, 0)
        assert sum(requests(srv, ".tar").values()) == SHARDS + 1
    assert cached(tmp_path / "c", ".tar") == source_files(data / "ds", ".tar")


def test_a_shard_corrupted_on_every_fetch_is_named(data: Path, tmp_path: Path) -> None:
    with python_server(data, "--corrupt", ".tar:1000") as srv, \
            pytest.raises(ShardFormatError, match="content hash mismatch") as e:
        list(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c"))
    assert f"{srv.url}/ds/data-0000" in str(e.value) and f"{FETCH_ATTEMPTS} " in str(e.value)
    assert cached(tmp_path / "c", ".tar") == {} and cached(tmp_path / "c", ".part") == {}


def test_an_index_of_another_shard_at_the_source_is_named_not_served(
        data: Path, tmp_path: Path) -> None:
    """Every shard holds 10 samples, so the sample count alone cannot tell; the tar's headers do."""
    src = tmp_path / "src"
    shutil.copytree(data / "ds", src / "ds")
    shutil.copyfile(src / "ds" / "data-000001.idx", src / "ds" / "data-000000.idx")
    with python_server(src) as srv, \
            pytest.raises(ShardFormatError, match="the tar holds") as e:
        list(FeedDataset(f"{srv.url}/ds", cache_dir=tmp_path / "c"))
    assert f"{srv.url}/ds/data-000000.idx" in str(e.value)


def test_an_index_that_differs_from_the_manifests_index_hash_is_refused(
        data: Path, tmp_path: Path) -> None:
    """A manifest that records the index's sha256 is the reference, before the tar's headers."""
    m = load_manifest(str(data / "ds"))
    rec = m.shards[0]
    good = (data / "ds" / "data-000000.idx").read_bytes()
    with python_server(data) as srv:
        url = f"{srv.url}/ds/{rec.name}"
        ok = types.SimpleNamespace(**vars(rec), index_sha256=hashlib.sha256(good).hexdigest())
        lease = ShardCache(tmp_path / "a").acquire(url, ok)  # type: ignore[arg-type]
        assert lease is not None
        assert Path(lease.path).with_suffix(".idx").read_bytes() == good
        lease.release()
        bad = types.SimpleNamespace(**vars(rec), index_sha256="0" * 64)
        with pytest.raises(ShardFormatError, match="index hash") as e:
            ShardCache(tmp_path / "b").acquire(url, bad)  # type: ignore[arg-type]
        assert f"{srv.url}/ds/data-000000.idx" in str(e.value)
        assert requests(srv, "data-000000.idx")["data-000000.idx"] == 1 + FETCH_ATTEMPTS


# -- on reuse ------------------------------------------------------------------------------------
def _damage(idx: Path, other: Path, keep_mtime: bool) -> None:
    st = idx.stat()
    idx.write_bytes(other.read_bytes())
    if keep_mtime:  # damage that leaves the stamp in place
        os.utime(idx, (st.st_atime, st.st_mtime))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_an_index_damaged_in_the_cache_is_fetched_again(
        data: Path, expected: dict[str, bytes], tmp_path: Path, keep_mtime: bool) -> None:
    cache = tmp_path / "c"
    with python_server(data) as srv:
        url = f"{srv.url}/ds"
        assert wrong(FeedDataset(url, cache_dir=cache), expected)[1] == 0
        idx = min(cache.glob("*-data-000000.idx"))
        _damage(idx, min(cache.glob("*-data-000003.idx")), keep_mtime)
        srv.reset()
        again = FeedDataset(url, cache_dir=cache)
        assert wrong(again, expected) == (SHARDS * PER_SHARD, 0)
        assert requests(srv, ".idx") == {"data-000000.idx": 1} and requests(srv, ".tar") == {}
    assert idx.read_bytes() == (data / "ds" / "data-000000.idx").read_bytes()
    assert again.cache.stats.refetched == 1


def test_an_index_stamp_depends_on_its_content(data: Path, tmp_path: Path) -> None:
    """The index stamp is not the shard's: a copied index never passes for a checked one."""
    rec = load_manifest(str(data / "ds")).shards[0]
    key = entry_key(rec, str(data / "ds" / rec.name))
    a = (data / "ds" / "data-000000.idx").read_bytes()
    b = (data / "ds" / "data-000001.idx").read_bytes()
    assert len({stamp(key), stamp(key, a), stamp(key, b)}) == 3
