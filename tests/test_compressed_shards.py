"""gzip shards (``.tar.gz``, ``.tgz``), which WebDataset reads directly (issue 34): ``feedpipe
index`` writes their indexes and manifest, and reading decompresses each once into the L1 shard
cache, so random access, shuffle and resume hold. Checked against webdataset reading the same
files. Other compressions are refused by name, never left out in silence."""

from __future__ import annotations

import bz2
import gzip
import logging
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from _data import make_dataset
from _servers import python_server
from conftest import run_feedpipe

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe._helpers.sizes import format_size
from feedpipe.errors import CompressedShardError, ShardFormatError


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """25 image samples in 4 plain shards."""
    return Path(make_dataset(str(tmp_path_factory.mktemp("plain"))))


def packed(plain: Path, out: Path, which: str = "all") -> Path:
    """``plain``'s shards in ``out``: gzip-compressed (the second as ``.tgz``), or with
    ``which="odd"`` only the odd ones, the even ones copied as they are."""
    out.mkdir(parents=True)
    for i, tar in enumerate(sorted(plain.glob("*.tar"))):
        if which == "odd" and i % 2 == 0:
            shutil.copy(tar, out / tar.name)
            continue
        name = tar.stem + (".tgz" if i == 1 else ".tar.gz")
        (out / name).write_bytes(gzip.compress(tar.read_bytes(), mtime=0))
    return out


def samples(ds: FeedDataset) -> dict[str, dict[str, bytes]]:
    return {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
            for s in ds}


def webdataset_samples(shards: list[Path]) -> dict[str, dict[str, bytes]]:
    import webdataset as wds

    out = {}
    for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False, empty_check=False):
        out[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
    return out


def test_gzip_shards_are_indexed_and_read_like_webdataset(plain: Path, tmp_path: Path) -> None:
    gz = packed(plain, tmp_path / "gz")
    r = run_feedpipe("index", gz)
    assert r.returncode == 0, r.stderr
    m = feedpipe.load_manifest(str(gz))
    names = [s.name for s in m.shards]
    assert names == ["data-000000.tar.gz", "data-000001.tgz", "data-000002.tar.gz",
                     "data-000003.tar.gz"]
    for s in m.shards:
        assert s.bytes == (gz / s.name).stat().st_size
        assert s.tar_bytes == (plain / (s.name.split(".")[0] + ".tar")).stat().st_size
        assert (gz / (s.name + ".idx")).exists()
    assert feedpipe.verify(str(gz), show_progress=False).ok
    want = webdataset_samples([gz / n for n in names])
    assert len(want) == m.total_samples == 25
    cache = tmp_path / "cache"
    ds = FeedDataset(str(gz), cache_dir=cache, shuffle=True, seed=5)
    assert samples(ds) == want
    # random access by global id, against the plain dataset's
    ref = FeedDataset(str(plain))
    for g in np.random.default_rng(0).permutation(25)[:10].tolist():
        a, b = ds.shards.sample(g), ref.shards.sample(g)
        assert a["__key__"] == b["__key__"]
        assert {k: bytes(v) for k, v in a.items() if not k.startswith("__")} == want[a["__key__"]]
    # each shard decompressed once: its plain tar in the cache, none fetched again
    tars = sorted(p.name for p in cache.glob("*.tar"))
    assert len(tars) == 4 and all(".tar.gz" in t or ".tgz" in t for t in tars), tars
    assert sorted(p.stat().st_size for p in cache.glob("*.tar")) == sorted(
        s.tar_bytes for s in m.shards)


def test_index_help_says_what_it_does_with_compressed_shards(plain: Path, tmp_path: Path) -> None:
    """``feedpipe index --help`` said gzip shards were refused and its example ran gunzip, while
    they are indexed as they are (issue 41); every gzip example of the help runs as written."""
    r = run_feedpipe("index", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "refused: decompress them first" not in text and "gunzip" not in text
    assert "gzip shards (.tar.gz, .tgz) are indexed as they are" in text
    assert "bzip2, xz and zstd ones are refused" in text
    examples = [ln.split("#")[0].split() for ln in r.stdout.splitlines()
                if ln.startswith("  feedpipe index") and ".tar.gz" in ln]
    assert examples == [["feedpipe", "index", "'shards/*.tar.gz'"]]
    gz = sorted(p.name for p in packed(plain, tmp_path / "shards").glob("*.tar.gz"))
    ran = run_feedpipe(*[a.strip("'") for a in examples[0][1:]], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert [s.name for s in feedpipe.load_manifest(str(tmp_path / "shards")).shards] == gz
    (tmp_path / "shards" / "x.tar.xz").write_bytes(b"")
    refused = run_feedpipe("index", tmp_path / "shards")
    assert refused.returncode == 2 and "x.tar.xz" in refused.stderr and "unxz" in refused.stderr


def test_resume_over_gzip_shards_is_exact(plain: Path, tmp_path: Path) -> None:
    gz = packed(plain, tmp_path / "gz")
    feedpipe.index([str(gz)], show_progress=False)
    cache = tmp_path / "cache"

    def loader() -> FeedLoader:
        return FeedLoader(FeedDataset(str(gz), cache_dir=cache, shuffle=True, seed=1),
                          batch_size=3, num_workers=2)

    full = [k for b in loader() for k in b["__key__"]]
    first = loader()
    seen: list[str] = []
    for i, b in enumerate(first):
        seen += b["__key__"]
        if i == 2:
            state = first.state_dict()
            break
    rest = loader()
    rest.load_state_dict(state)
    seen += [k for b in rest for k in b["__key__"]]
    assert seen == full and sorted(seen) == sorted(set(seen)) and len(seen) == 25


def test_a_mixed_folder_reads_gzip_shards_through_the_default_cache(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    mixed = packed(plain, tmp_path / "mixed", which="odd")
    r = run_feedpipe("index", mixed)
    assert r.returncode == 0 and "left out" not in r.stderr, r.stderr
    m = feedpipe.load_manifest(str(mixed))
    assert [s.name for s in m.shards] == ["data-000000.tar", "data-000001.tgz",
                                          "data-000002.tar", "data-000003.tar.gz"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    with caplog.at_level(logging.WARNING, logger="feedpipe.cache"):
        ds = FeedDataset(str(mixed))
    said = [r.getMessage() for r in caplog.records if r.name == "feedpipe.cache"]
    home = tmp_path / "home" / "feedpipe" / "shards"
    assert len(said) == 1 and str(home) in said[0] and "cache_dir=" in said[0], said
    assert samples(ds) == webdataset_samples([mixed / s.name for s in m.shards])
    # the plain shards are read where they are: only the gzip ones are in the cache
    assert sorted(p.name.split("-", 1)[1] for p in home.glob("*.tar")) == [
        "data-000001.tgz.tar", "data-000003.tar.gz.tar"]
    batches = FeedLoader(ds, batch_size=4, num_workers=2)
    assert sorted(k for b in batches for k in b["__key__"]) == sorted(samples(ds))


def test_the_default_cache_of_gzip_shards_holds_its_bound(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Read without ``cache_dir=``, gzip shards are decompressed into the default cache, which
    had no bound and filled the home folder (issue 41). Its bound (``GZIP_CACHE_SIZE``, made
    here two plain shards wide) holds after every pass, the samples are webdataset's, and a
    shard evicted is decompressed again when read again."""
    from feedpipe.caches._shards import ShardCache
    from feedpipe.stream import _shard_set

    gz = packed(plain, tmp_path / "gz")
    feedpipe.index(gz, show_progress=False)
    m = feedpipe.load_manifest(str(gz))
    plain_sizes = [s.tar_size for s in m.shards]
    bound = 2 * max(plain_sizes) + 8192  # two entries (shard + index), not four
    assert sum(plain_sizes) > bound
    monkeypatch.setattr(_shard_set, "GZIP_CACHE_SIZE", bound)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    home = tmp_path / "home" / "feedpipe" / "shards"
    with caplog.at_level(logging.WARNING, logger="feedpipe.cache"):
        ds = FeedDataset(str(gz))
        again = FeedDataset(str(gz))  # the same dataset in this process: said once
    said = [r.getMessage() for r in caplog.records if r.name == "feedpipe.cache"]
    assert len(said) == 1 and f"at most {format_size(bound)}" in said[0], said
    assert "cache_dir=True, cache_size=" in said[0]
    want = webdataset_samples([gz / s.name for s in m.shards])
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(2):
            assert samples(ds) == want
            assert ShardCache(home).usage()["bytes"] <= bound
        assert samples(again) == want
    # the shards this process held open were let go to make room: nothing read "uncached"
    assert [str(w.message) for w in warned if w.category is RuntimeWarning] == []
    # two worker processes hold a shard each while a third is decompressed: a bound of two
    # shards would refuse the third by name (OutputError, "no room for it now"), as it should
    bound = 3 * max(plain_sizes) + 12288
    monkeypatch.setattr(_shard_set, "GZIP_CACHE_SIZE", bound)
    shuffled = FeedDataset(str(gz), shuffle=True, seed=3)
    batches = FeedLoader(shuffled, batch_size=4, num_workers=2)
    for _ in range(2):
        assert sorted(k for b in batches for k in b["__key__"]) == sorted(want)
        assert ShardCache(home).usage()["bytes"] <= bound


def test_the_bound_never_evicts_a_shard_another_reader_holds(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reader holds the first gzip shard open (its iterator is inside it) while another
    reads the whole dataset through the default cache, bounded at one plain shard: the held
    shard stays in the cache, the others are evicted once read, and the first reader goes on
    with the right bytes."""
    from feedpipe.stream import _shard_set

    gz = packed(plain, tmp_path / "gz")
    feedpipe.index(gz, show_progress=False)
    m = feedpipe.load_manifest(str(gz))
    bound = max(s.tar_size for s in m.shards) + 4096
    monkeypatch.setattr(_shard_set, "GZIP_CACHE_SIZE", bound)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    home = tmp_path / "home" / "feedpipe" / "shards"
    want = webdataset_samples([gz / s.name for s in m.shards])
    held = iter(FeedDataset(str(gz)))
    first = next(held)
    assert first["__shard__"] == m.shards[0].name
    assert samples(FeedDataset(str(gz))) == want  # the other reader, start to end
    assert [p.name.split("-", 1)[1] for p in home.glob("*.tar")] == ["data-000000.tar.gz.tar"]
    rest = [first, *held]
    assert {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
            for s in rest} == want


def test_a_damaged_gzip_shard_is_named(plain: Path, tmp_path: Path) -> None:
    gz = packed(plain, tmp_path / "gz")
    feedpipe.index([str(gz)], show_progress=False)
    shard = gz / "data-000002.tar.gz"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(raw))
    report = feedpipe.verify(str(gz), show_progress=False)
    assert not report.ok and all(p.shard == str(shard) for p in report.problems)
    with pytest.raises(ShardFormatError, match=r"data-000002\.tar\.gz: bad gzip data.*The same "
                                               r"on each of 3 fetches into the shard cache"):
        list(FeedDataset(str(gz), cache_dir=tmp_path / "cache"))
    # cut short: index refuses it, naming the shard
    shard.write_bytes(gzip.compress((plain / "data-000002.tar").read_bytes())[:-100])
    with pytest.raises(ShardFormatError, match=r"data-000002\.tar\.gz: the gzip stream ends early"):
        feedpipe.index([str(gz)], show_progress=False)


def test_other_compressions_beside_plain_shards_are_refused_not_left_out(
    plain: Path, tmp_path: Path
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(plain / "data-000000.tar", d)
    (d / "data-000001.tar.bz2").write_bytes(bz2.compress((plain / "data-000001.tar").read_bytes()))
    r = run_feedpipe("index", d)
    assert r.returncode == 2 and "data-000001.tar.bz2" in r.stderr and "bunzip2" in r.stderr
    assert not (d / "manifest.json").exists()
    with pytest.raises(CompressedShardError, match=r"data-000001\.tar\.bz2: compressed shards"):
        feedpipe.index([str(d)], show_progress=False)


def test_a_gzip_shard_opened_as_a_plain_one_says_how_to_read_it(plain: Path,
                                                                 tmp_path: Path) -> None:
    from feedpipe.format._reader import ShardReader

    gz = packed(plain, tmp_path / "gz")
    feedpipe.index([str(gz)], show_progress=False)
    with pytest.raises(CompressedShardError, match=r"data-000000\.tar\.gz: a gzip shard.*"
                                                   r"FeedDataset"):
        ShardReader(str(gz / "data-000000.tar.gz"))


def test_gzip_shards_over_http_are_fetched_and_decompressed_once(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Remote gzip shards, behind a URL with a token, with no cache_dir: each is downloaded once
    into the process's read-ahead directory and read from its plain tar there, epoch after
    epoch."""
    gz = packed(plain, tmp_path / "site" / "gz")
    feedpipe.index([str(gz)], show_progress=False)
    want = webdataset_samples([gz / s.name for s in feedpipe.load_manifest(str(gz)).shards])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    with python_server(tmp_path / "site", "--token", "t0k") as srv:
        url = f"{srv.url}/gz?token=t0k"
        ds = FeedDataset(url, shuffle=True)
        for _ in range(2):
            assert samples(ds) == want
        stats = srv.stats()
        assert feedpipe.verify(url, show_progress=False).ok
    assert sum(v["errors"] for v in stats.values()) == 0
    for name in ("data-000000.tar.gz", "data-000001.tgz"):
        assert stats[f"/gz/{name}"]["bytes"] == (gz / name).stat().st_size
    assert ds.cache is not None
    names = {r.name.rsplit("/", 1)[-1] for r in feedpipe.load_manifest(str(gz)).shards}
    assert len(names) == 4
    assert names <= {p.stem.split("-", 1)[1] for p in Path(ds.cache.path).glob("*.tar")}


@pytest.mark.parametrize("case", ["samples", "samples-workers", "rows-threads", "rows-workers"])
def test_every_route_reads_gzip_shards_as_the_reference_route(
    plain: Path, tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch routes read a gzip shard's plain tar in the cache (in this process, threads and
    worker processes) and deliver what the reference route delivers from the plain dataset.
    (The ``refs`` routes map local shards only: they refuse cached ones by name.)"""
    import torch
    from _routes import ROUTES, make

    mixed = packed(plain, tmp_path / "mixed", which="odd")
    feedpipe.index([str(mixed)], show_progress=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))

    def batches(path: Path, reference: bool) -> list[object]:
        loader = make(case, str(path), workers=2, reference=reference)
        out = []
        for b in loader:
            if ROUTES[case][0] == "img":
                images, labels = b
                out.append((labels.tolist(), images.sum().item()))
            else:
                out.append((list(b["__key__"]), [bytes(x) for x in b["jpg"]]
                            if not isinstance(b["jpg"], torch.Tensor) else b["jpg"].tolist()))
        return out

    assert batches(mixed, reference=False) == batches(plain, reference=True)
