"""Differential test on real shards: WebDataset's own test shards (``tests/corpora/webdataset``,
vendored from webdataset/webdataset's ``testdata``) adopted with ``feedpipe index`` and read by
``FeedDataset``, against Python's ``tarfile`` and the ``webdataset`` library reading the same
files. Same keys, same fields, same bytes, in the same order; a shard feedpipe cannot read is
refused by name.

``compressed.tar`` holds a directory member and fields with a dot (``txt.gz``); ``mpdata.tar``
100 msgpack records; ``sample.tgz`` is a gzip-compressed shard of 90 PNG images with ``cls``
labels, which WebDataset reads directly.
"""

from __future__ import annotations

import gzip
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from _corpora import WEBDATASET, pillow_pixels

from feedpipe import (
    FeedDataset,
    FeedpipeError,
    ImagePipeline,
    ImageSpec,
    index,
    load_manifest,
    verify,
)

Samples = list[tuple[str, dict[str, bytes]]]


def tarfile_samples(path: Path) -> Samples:
    """The reference grouping: regular members in archive order, split by the WebDataset rule
    (the key is the path up to the first dot of the last component), consecutive keys merged."""
    out: Samples = []
    with tarfile.open(path) as tar:  # a .tgz too: tarfile detects the compression
        for member in tar:
            if not member.isfile():
                continue
            slash = member.name.rfind("/")
            dot = member.name.find(".", slash + 1)
            key, ext = member.name[:dot], member.name[dot + 1:]
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if out and out[-1][0] == key:
                out[-1][1][ext] = data
            else:
                out.append((key, {ext: data}))
    return out


def webdataset_samples(path: Path) -> Samples:
    ds = wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
            for s in ds]


def feedpipe_samples(root: Path, **kw: object) -> Samples:
    return [(str(s["__key__"]), {k: bytes(v) for k, v in s.items() if not k.startswith("__")})
            for s in FeedDataset(str(root), **kw)]  # type: ignore[arg-type]


def _adopt(name: str, tmp_path: Path) -> Path:
    """A folder holding only the vendored shard ``name``, indexed by feedpipe."""
    root = tmp_path / "ds"
    root.mkdir()
    shutil.copyfile(WEBDATASET / name, root / name)
    index([str(root)])
    return root


@pytest.mark.parametrize("name", ["compressed.tar", "mpdata.tar"])
def test_a_webdataset_shard_reads_as_tarfile_and_webdataset_read_it(
        name: str, tmp_path: Path) -> None:
    want = tarfile_samples(WEBDATASET / name)
    assert want == webdataset_samples(WEBDATASET / name)  # the two references agree
    root = _adopt(name, tmp_path)
    assert load_manifest(str(root)).total_samples == len(want)
    assert feedpipe_samples(root) == want
    report = verify(str(root), show_progress=False)
    assert report.ok and report.samples == len(want), report.to_dict()
    # the shard itself is adopted as it is: not rewritten
    assert (root / name).read_bytes() == (WEBDATASET / name).read_bytes()


def test_a_compressed_webdataset_shard_reads_as_webdataset_reads_it(tmp_path: Path) -> None:
    """Issue 34 (compressed shards): WebDataset reads ``.tgz`` shards directly; feedpipe must
    index and read them, with the same samples."""
    want = tarfile_samples(WEBDATASET / "sample.tgz")
    assert len(want) == 90 and want == webdataset_samples(WEBDATASET / "sample.tgz")
    root = _adopt("sample.tgz", tmp_path)
    assert feedpipe_samples(root, cache_dir=str(tmp_path / "cache")) == want


def test_the_images_of_a_webdataset_shard_decode_as_pillow_decodes_them(tmp_path: Path) -> None:
    """``sample.tgz`` decompressed (what ``feedpipe index`` advises today), its PNGs read
    through ImagePipeline with their labels: Pillow's pixels, the shard's labels."""
    root = tmp_path / "ds"
    root.mkdir()
    (root / "sample.tar").write_bytes(gzip.decompress((WEBDATASET / "sample.tgz").read_bytes()))
    index([str(root)])
    want = dict(tarfile_samples(WEBDATASET / "sample.tgz"))
    seen = 0
    for sample in FeedDataset(str(root)):
        fields = want[str(sample["__key__"])]
        ref = pillow_pixels(fields["png"])
        side = min(ref.shape[:2])
        pipe = ImagePipeline.from_spec(ImageSpec(size=side, train=False, crop_fraction=1.0,
                                                 mean=None))
        image, label = pipe(sample)
        top, left = (ref.shape[0] - side) // 2, (ref.shape[1] - side) // 2
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(),
                                      ref[top:top + side, left:left + side])
        assert label == int(fields["cls"])
        seen += 1
    assert seen == 90


def test_a_truncated_shard_is_refused_by_name(tmp_path: Path) -> None:
    """A WebDataset shard cut short (as a failed copy leaves it) is named, never read short.
    (Python's tarfile reads the same bytes as 55 of the 100 samples, without an error.)"""
    root = tmp_path / "ds"
    root.mkdir()
    data = (WEBDATASET / "mpdata.tar").read_bytes()
    (root / "mpdata.tar").write_bytes(data[:len(data) // 2 + 100])
    with pytest.raises(FeedpipeError, match="mpdata.tar"):
        index([str(root)])


def test_a_real_tar_with_hard_links_reads_as_tarfile_reads_it(tmp_path: Path) -> None:
    """dateutil's zoneinfo tarball (shipped in python-dateutil, which matplotlib needs): 354 zone
    files, 245 hard links to zones earlier in the tar (``GMT0`` -> ``GMT+0``) and 20 directories,
    gzip-compressed, written by a tool that is not feedpipe's. Indexed as it is, every file and
    every hard link is a sample with tarfile's bytes (webdataset drops the links in silence);
    nothing is left out."""
    zoneinfo = pytest.importorskip("dateutil.zoneinfo")
    tarball = Path(zoneinfo.__file__).parent / "dateutil-zoneinfo.tar.gz"
    root = tmp_path / "tz"
    root.mkdir()
    shutil.copyfile(tarball, root / tarball.name)
    m = index(root, show_progress=False)
    with tarfile.open(tarball) as tar:
        want = {t.name: tar.extractfile(t).read()  # type: ignore[union-attr]
                for t in tar if t.isfile() or t.islnk()}
        links = sum(t.islnk() for t in tar)
    assert links > 100 and m.skipped == [] and m.total_samples == len(want)
    got = {str(s["__key__"]): bytes(s[""]) for s in FeedDataset(str(root),
                                                                cache_dir=tmp_path / "cache")}
    assert got == want
