"""Remote sources through fsspec, against real servers on 127.0.0.1: nginx for http://, moto_server
for s3:// (with signature checking), fsspec's memory:// filesystem, and a misbehaving Python
server for the failure modes (Range ignored, 5xx, missing objects)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _data import make_dataset
from _servers import BUCKET, forget_s3_clients, moto_s3, nginx_binary, nginx_server, python_server
from torch.utils.data import DataLoader

import feedpipe
from feedpipe import FeedDataset
from feedpipe._helpers import retry as retry
from feedpipe._helpers.storage import filesystem
from feedpipe.errors import (
    AccessDeniedError,
    MissingDependencyError,
    RemoteError,
    ShardFormatError,
    SourceNotFoundError,
)

FAST = retry.RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


def fields(sample: dict) -> tuple:  # type: ignore[type-arg]
    return (sample["__index__"], sample["__key__"], sample["__shard__"],
            tuple(sorted((k, bytes(v)) for k, v in sample.items() if not k.startswith("__"))))


def all_samples(ds: FeedDataset) -> list[tuple]:  # type: ignore[type-arg]
    return sorted(fields(s) for s in ds)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/shards`` (25 samples in 4 shards) and its source folder ``root/src``."""
    r = tmp_path_factory.mktemp("remote")
    make_dataset(str(r))
    return r


@pytest.fixture(scope="module")
def expected(root: Path) -> list[tuple]:  # type: ignore[type-arg]
    return all_samples(FeedDataset(str(root / "shards")))


@pytest.fixture(scope="module")
def nginx(root: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if nginx_binary() is None:
        pytest.skip("nginx is not installed (Debian: apt-get install nginx-light; .ci/run does)")
    with nginx_server(root, tmp_path_factory.mktemp("nginx")) as url:
        yield url


@pytest.fixture(scope="module")
def s3(root: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("s3fs", reason="s3fs is in the test extra: pip install -e '.[test]'")
    pytest.importorskip("boto3", reason="moto[server] is in the test extra")
    with moto_s3({"shards": root / "shards", "src": root / "src"}) as env:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            forget_s3_clients()
            yield env
        forget_s3_clients()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)


# -- the same samples from every backend --------------------------------------------------------
def test_http_through_nginx_equals_local(nginx: str, expected: list) -> None:  # type: ignore[type-arg]
    assert all_samples(FeedDataset(f"{nginx}/shards")) == expected
    ds = FeedDataset(f"{nginx}/shards/manifest.json", shuffle=True, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(fields(s) for s in loader) == expected
    # The forked workers inherited this process's pooled HTTP connection (the manifest's) and
    # must have left it alone: a request that reuses it still completes (it used to hang).
    from fsspec.asyn import sync

    fs, _ = filesystem(nginx)
    assert sync(fs.loop, fs._exists, f"{nginx}/src", timeout=30)
    assert b"feedpipe-manifest" in sync(fs.loop, fs._cat_file, f"{nginx}/shards/manifest.json",
                                         timeout=30)


def test_s3_through_moto_equals_local(s3: dict, expected: list) -> None:  # type: ignore[type-arg]
    assert all_samples(FeedDataset(f"s3://{BUCKET}/shards", shuffle=True, seed=1)) == expected


def test_a_forked_worker_reads_s3_without_decoding_botocore_models_again(
        s3: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    """s3fs made a botocore session per process: a DataLoader worker decoded botocore's JSON
    models (the S3 service, its endpoint rules) again before its first request. The session the
    parent read with is inherited: the child's first s3:// read loads no model file."""
    import multiprocessing

    import botocore.loaders

    from feedpipe._helpers.storage import read_bytes

    loads: list[str] = []
    plain = botocore.loaders.JSONFileLoader.load_file

    def counted(self: object, path: str) -> object:
        loads.append(path)
        return plain(self, path)  # type: ignore[arg-type]

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counted)
    monkeypatch.setenv("FEEDPIPE_S3_CLIENT", "s3fs")
    url = f"s3://{BUCKET}/shards/manifest.json"
    parent = read_bytes(url)  # loads the models, unless an earlier test of this process did

    def child(q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
        loads.clear()
        q.put((read_bytes(url) == parent, list(loads)))

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    same, child_loads = q.get(timeout=60)
    p.join(60)
    assert same
    assert child_loads == []


def test_s3_read_with_obstore_in_the_parent_and_two_forked_workers_exactly_once(
        s3: dict, expected: list, monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
        caplog: pytest.LogCaptureFixture) -> None:
    """The credentials come from the environment (the fixture's AWS_* keys, no ~/.aws): s3:// is
    read with obstore, which says so. obstore's runtime does not survive a fork: the workers
    read with s3fs (a worker that used the inherited runtime crashed), every sample once."""
    from feedpipe._helpers import storage_clients as storage

    monkeypatch.setattr(storage, "_said", set())
    with caplog.at_level("INFO", logger="feedpipe"):
        ds = FeedDataset(f"s3://{BUCKET}/shards", shuffle=True, seed=2)
    assert any("read with obstore (credentials from the environment)" in r.getMessage()
               for r in caplog.records)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(fields(s) for s in loader) == expected


def test_s3_keeps_s3fs_where_a_profile_may_say_otherwise(
        s3: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:  # type: ignore[type-arg]
    """obstore reads no ~/.aws files: with a profile named, or a credentials file present, s3fs
    (botocore) reads s3://, and the log says why; FEEDPIPE_S3_CLIENT overrides."""
    from feedpipe._helpers import storage_clients as storage

    url = f"s3://{BUCKET}/shards/manifest.json"
    monkeypatch.setattr(storage, "_said", set())
    assert storage.object_store(url) is not None
    monkeypatch.setenv("AWS_PROFILE", "team")
    monkeypatch.setattr(storage, "_said", set())
    with caplog.at_level("INFO", logger="feedpipe"):
        assert storage.object_store(url) is None
    assert any("read with s3fs (AWS_PROFILE names a profile)" in r.getMessage()
               for r in caplog.records)
    monkeypatch.delenv("AWS_PROFILE")
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = other\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    assert storage.object_store(url) is None
    monkeypatch.setenv("FEEDPIPE_S3_CLIENT", "obstore")
    assert storage.object_store(url) is not None
    monkeypatch.setenv("FEEDPIPE_S3_CLIENT", "s3fs")
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE")
    assert storage.object_store(url) is None


def test_file_url_equals_local(root: Path, expected: list) -> None:  # type: ignore[type-arg]
    assert all_samples(FeedDataset(f"file://{root / 'shards'}")) == expected


def test_memory_filesystem_equals_local(root: Path, expected: list) -> None:  # type: ignore[type-arg]
    fs, _ = filesystem("memory://")
    for p in (root / "shards").iterdir():
        fs.pipe_file(f"/fp-remote/shards/{p.name}", p.read_bytes())
    try:
        assert all_samples(FeedDataset("memory://fp-remote/shards")) == expected
    finally:
        fs.rm("/fp-remote", recursive=True)


def convert_like_local(root: Path, tmp_path: Path, sources: dict[str, str]) -> None:
    local = tmp_path / "local"
    feedpipe.shard(str(root / "src"), str(local), max_samples=7, labels_from_dirs=True,
                   workers=1, show_progress=False)
    for name, src in sources.items():
        out = tmp_path / name
        feedpipe.shard(src, str(out), max_samples=7, labels_from_dirs=True, workers=1,
                       show_progress=False)
        for shard in sorted(local.glob("*.tar")) + sorted(local.glob("*.idx")):
            assert (out / shard.name).read_bytes() == shard.read_bytes(), (name, shard.name)


def test_shard_converts_remote_sources_like_local_ones(root: Path, s3: dict,
                                                       tmp_path: Path) -> None:
    fs, _ = filesystem("memory://")
    for p in (root / "src").rglob("*"):
        if p.is_file():
            fs.pipe_file(f"/fp-src/{p.relative_to(root / 'src').as_posix()}", p.read_bytes())
    try:
        convert_like_local(root, tmp_path, {"s3": f"s3://{BUCKET}/src",
                                            "memory": "memory://fp-src",
                                            "file": f"file://{root / 'src'}"})
    finally:
        fs.rm("/fp-src", recursive=True)


def test_shard_converts_an_http_directory_listing(root: Path, nginx: str, tmp_path: Path) -> None:
    convert_like_local(root, tmp_path, {"http": f"{nginx}/src"})  # nginx autoindex pages


# -- missing backends ---------------------------------------------------------------------------
def test_missing_backend_names_its_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'feedpipe\[gcs\]'"):
        FeedDataset("gs://some-bucket/dataset")
    # s3fs is installed here: hide it in a fresh interpreter, where fsspec has not loaded it yet
    code = textwrap.dedent("""
        import sys
        sys.modules["s3fs"] = None
        from feedpipe._helpers.storage import filesystem
        filesystem("s3://bucket/dataset")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "MissingDependencyError" in r.stderr and "pip install 'feedpipe[s3]'" in r.stderr


# -- misbehaving servers ------------------------------------------------------------------------
def test_server_ignoring_range_is_an_error_not_corruption(root: Path, expected: list,
                                                          tmp_path: Path) -> None:  # type: ignore[type-arg]
    with python_server(root, "--ignore-range") as srv:
        ds = FeedDataset(f"{srv.url}/shards", cache_dir=False)  # one range per sample
        with pytest.raises(ShardFormatError, match="ignores Range") as e:
            list(ds)
        assert f"{srv.url}/shards/data-" in str(e.value)
        # through the L1 cache whole shards are fetched with plain GETs: correct data
        cached = FeedDataset(f"{srv.url}/shards", cache_dir=tmp_path / "cache")
        assert all_samples(cached) == expected
        # and through the read-ahead of a dataset given no cache_dir
        assert all_samples(FeedDataset(f"{srv.url}/shards")) == expected


def test_transient_5xx_is_retried(root: Path, expected: list, fast_retries: None) -> None:  # type: ignore[type-arg]
    with python_server(root, "--fail-first", "3") as srv:
        assert all_samples(FeedDataset(f"{srv.url}/shards")) == expected
        assert sum(v["errors"] for v in srv.stats().values()) == 3


def test_persistent_5xx_is_reported_with_the_url_after_bounded_retries(
        root: Path, fast_retries: None) -> None:
    with python_server(root, "--fail-first", "1000000") as srv:
        url = f"{srv.url}/shards/manifest.json"
        with pytest.raises(RemoteError, match="still failing after 4 attempt") as e:
            FeedDataset(url)
        assert url in str(e.value)
        assert srv.stats()["/shards/manifest.json"]["requests"] == FAST.attempts
    assert isinstance(e.value, OSError)


def test_connection_refused_is_retried_then_reported(fast_retries: None) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteError, match=f"127.0.0.1:{port}"):
        FeedDataset(f"http://127.0.0.1:{port}/shards")


def test_an_unresolvable_host_is_a_remote_error_naming_the_url(fast_retries: None) -> None:
    """``.invalid`` never resolves (RFC 2606): the resolver's answer, not a raw aiohttp error."""
    url = "http://feedpipe-no-such-host.invalid/shards"
    with pytest.raises(RemoteError) as e:
        FeedDataset(url)
    assert f"{url}/manifest.json" in str(e.value) and "resolve" in str(e.value)
    assert isinstance(e.value, OSError)


def test_a_server_without_range_suggests_the_shard_cache(root: Path, expected: list,
                                                          tmp_path: Path) -> None:  # type: ignore[type-arg]
    """``python -m http.server`` answers a Range request with the whole file."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind",
                             "127.0.0.1", "--directory", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (...) ..."
        url = f"http://127.0.0.1:{line.split(' port ')[1].split()[0]}/shards"
        with pytest.raises(ShardFormatError) as e:
            list(FeedDataset(url, cache_dir=False))
        assert "Range" in str(e.value) and "cache_dir=" in str(e.value)
        assert f"{url}/data-" in str(e.value)
        assert all_samples(FeedDataset(url, cache_dir=tmp_path / "c")) == expected
    finally:
        proc.kill()
        proc.wait(10)


def test_missing_object_fails_at_once(root: Path, tmp_path: Path, fast_retries: None) -> None:
    with python_server(root) as srv:
        with pytest.raises(SourceNotFoundError, match=f"{srv.url}/nope: does not exist"):
            FeedDataset(f"{srv.url}/nope")
        assert srv.stats()["/nope/manifest.json"]["requests"] == 1  # not retried
    # a shard missing from a dataset whose manifest exists
    broken = tmp_path / "broken"
    shutil.copytree(root / "shards", broken)
    os.unlink(broken / "data-000001.tar")
    with python_server(tmp_path) as srv:
        # (uncached: the process's read-ahead holds this shard's content from other tests)
        with pytest.raises(SourceNotFoundError, match="data-000001.tar"):
            list(FeedDataset(f"{srv.url}/broken", cache_dir=False))


def test_http_403_fails_at_once(root: Path, fast_retries: None) -> None:
    with python_server(root, "--deny") as srv:
        with pytest.raises(AccessDeniedError, match=f"{srv.url}/shards/manifest.json"):
            FeedDataset(f"{srv.url}/shards")
        assert srv.stats()["/shards/manifest.json"]["requests"] == 1  # not retried


def test_s3_missing_object_and_bad_credentials_fail_at_once(
        s3: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    with pytest.raises(SourceNotFoundError, match=f"s3://{BUCKET}/nope"):
        FeedDataset(f"s3://{BUCKET}/nope")
    forget_s3_clients()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    try:
        with pytest.raises(AccessDeniedError, match="credentials") as e:
            FeedDataset(f"s3://{BUCKET}/shards")
        assert f"s3://{BUCKET}/shards/manifest.json" in str(e.value)
        assert isinstance(e.value, PermissionError)
    finally:
        forget_s3_clients()


def test_s3_reads_each_object_without_a_head_request(
        s3: dict, expected: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    """s3fs asks an object's size (HEAD) before reading it whole: a round trip per manifest,
    index and shard. Through the L1 cache and with sizes from the manifest: GETs only, a few
    per shard."""
    import s3fs

    calls: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(method if isinstance(method, str) else method.__name__)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    monkeypatch.setenv("FEEDPIPE_S3_CLIENT", "s3fs")  # obstore makes no HEAD either: s3fs here
    # the fills' requests alone: the first batch's own ranges are tests/test_remote_first_batch.py
    monkeypatch.setenv("FEEDPIPE_FIRST_BATCH_RANGES", "0")
    ds = FeedDataset(f"s3://{BUCKET}/shards", cache_dir=tmp_path / "c")
    assert all_samples(ds) == expected
    shards = len(ds.manifest.shards)
    assert set(calls) == {"get_object"}, calls
    assert len(calls) == 1 + 2 * shards  # the manifest, then each shard's index and bytes
