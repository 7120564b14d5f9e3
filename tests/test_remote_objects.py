"""The objects of a remote dataset (issue 34): a ``manifest.json`` damaged on the way is fetched
again, as a shard is, then named; a URL's query string (``?token=...``) is carried to every object
it names (manifest, shards, indexes). Against ``tests/_http_server.py`` on 127.0.0.1."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from _data import make_dataset
from _servers import python_server

import feedpipe
from feedpipe import FeedDataset
from feedpipe._helpers import retry as retry
from feedpipe.caches._manifest_copy import copy_path
from feedpipe.errors import InputError, ManifestError, RemoteError

FAST = retry.RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/shards`` (25 samples in 4 shards)."""
    r = tmp_path_factory.mktemp("objects")
    make_dataset(str(r))
    return r


@pytest.fixture(scope="module")
def expected(root: Path) -> list[tuple[str, bytes]]:
    return keyed(FeedDataset(str(root / "shards")))


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)


def keyed(ds: FeedDataset) -> list[tuple[str, bytes]]:
    return sorted((s["__key__"], b"".join(bytes(s[k]) for k in sorted(s)
                                          if not k.startswith("__"))) for s in ds)


# -- a manifest damaged on the way --------------------------------------------------------------
@pytest.mark.parametrize("damage", ["--corrupt", "--cut"])
def test_a_manifest_damaged_once_on_the_way_is_fetched_again(
    root: Path, expected: list[tuple[str, bytes]], damage: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    with python_server(root, damage, "manifest.json:1") as srv:
        url = f"{srv.url}/shards"
        with caplog.at_level(logging.WARNING, logger="feedpipe.format"):
            ds = FeedDataset(url)
        assert keyed(ds) == expected
        assert srv.stats()["/shards/manifest.json"]["requests"] == 2
    said = [r.getMessage() for r in caplog.records if r.name == "feedpipe.format"]
    assert len(said) == 1 and f"{url}/manifest.json" in said[0] and "again" in said[0]


@pytest.mark.parametrize("damage", ["--corrupt", "--cut"])
def test_a_manifest_damaged_on_every_fetch_is_named(root: Path, damage: str) -> None:
    with python_server(root, damage, "manifest.json:2") as srv:
        url = f"{srv.url}/shards/manifest.json"
        with pytest.raises(ManifestError) as e:
            FeedDataset(f"{srv.url}/shards")
        assert srv.stats()["/shards/manifest.json"]["requests"] == 2
    msg = str(e.value)
    assert msg.startswith(url) and f"The same on each of 2 fetches of {url}" in msg
    assert "feedpipe index" in msg


def test_a_damaged_manifest_copy_in_the_cache_is_named_and_removed(
    root: Path, expected: list[tuple[str, bytes]], tmp_path: Path, fast_retries: None
) -> None:
    cache = tmp_path / "cache"
    with python_server(root) as srv:
        url = f"{srv.url}/shards"
        assert keyed(FeedDataset(url, cache_dir=cache)) == expected
    copy = copy_path(str(cache), url)
    text = Path(copy).read_bytes()
    Path(copy).write_bytes(text[: len(text) // 2])  # damaged in the cache directory
    # the storage is gone (its port closed): the copy cannot be replaced, so it is named
    with pytest.raises(RemoteError) as e:
        FeedDataset(url, cache_dir=cache)
    msg = str(e.value)
    assert f"{url}/manifest.json" in msg and copy in msg and "damaged" in msg
    assert "not valid JSON" in msg and not os.path.exists(copy)


def test_a_damaged_manifest_copy_is_replaced_while_the_storage_answers(
    root: Path, expected: list[tuple[str, bytes]], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with python_server(root) as srv:
        url = f"{srv.url}/shards"
        assert keyed(FeedDataset(url, cache_dir=cache)) == expected
        copy = Path(copy_path(str(cache), url))
        copy.write_bytes(b"{\"format\": ")
        assert keyed(FeedDataset(url, cache_dir=cache)) == expected
        assert feedpipe.load_manifest(url).to_json() == copy.read_text()


# -- a query string ------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["{url}/shards?token=s3cr3t", "{url}/shards/?token=s3cr3t#top",
                                  "{url}/shards/manifest.json?token=s3cr3t"])
def test_a_query_string_is_carried_to_every_object(
    root: Path, expected: list[tuple[str, bytes]], tmp_path: Path, form: str
) -> None:
    """A server that wants ``?token=`` on every request: the manifest, each shard and its index
    are asked for with it (none is refused), read directly, through the shard cache, and by
    verify."""
    with python_server(root, "--token", "s3cr3t") as srv:
        url = form.format(url=srv.url)
        assert keyed(FeedDataset(url)) == expected
        cached = FeedDataset(url, cache_dir=tmp_path / "cache", shuffle=True)
        assert keyed(cached) == expected
        assert feedpipe.verify(url, show_progress=False).ok
        stats = srv.stats()
        assert sum(v["errors"] for v in stats.values()) == 0, stats
        names = {os.path.basename(p) for p in stats}
        assert {"manifest.json", "data-000000.tar", "data-000000.idx"} <= names
    # the copy of the manifest is found again under a renewed token
    assert os.path.exists(copy_path(str(tmp_path / "cache"), url.replace("s3cr3t", "other")))


def test_a_query_string_that_cannot_be_carried_is_refused(root: Path) -> None:
    with pytest.raises(InputError, match=r"s3://bucket/shards\?versionId=<redacted>: a query "
                                         r"string \('\?versionId=<redacted>'\) on a s3:// URL"):
        FeedDataset("s3://bucket/shards?versionId=3")
    signed = "https://h.example/shards/manifest.json?X-Amz-Signature=ab&X-Amz-Expires=60"
    with pytest.raises(InputError, match="signed for one object .x-amz-signature"):
        FeedDataset(signed)
