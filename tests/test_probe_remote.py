"""The probe over remote URLs: what it measures of the link, what it predicts, what it advises,
and that a slow server does not break its loader stage."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _servers import forget_s3_clients, python_server

from feedpipe import ShardWriter
from feedpipe.diagnostics._probe import probe


def _jpeg(w: int, h: int) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (w, h), (w, h, 7)).save(b, "JPEG")
    return b.getvalue()


@pytest.fixture(scope="module")
def sizes_change_later(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JPEGs all 16x16 for the first 4 samples, then every other one 32x24."""
    out = tmp_path_factory.mktemp("later") / "ds"
    with ShardWriter(str(out), max_samples=8) as w:
        for i in range(48):
            size = (16, 16) if i < 4 or i % 2 else (24, 32)
            w.write({"__key__": f"k{i:03d}", "jpg": _jpeg(*size), "cls": i % 3})
    return out


@pytest.mark.slow
def test_a_slow_server_that_shows_one_image_size_first_does_not_break_the_loader_stage(
        sizes_change_later: Path) -> None:
    """Over a server with a long round trip the read stage sees only the first few samples, all
    of one size, so batches were stacked as they are; the loader stage then met images of
    another size and failed in every run: "stack expects each tensor to be equal size" in the
    process, "Trying to resize storage that is not resizable" in a DataLoader worker."""
    with python_server(sizes_change_later, "--delay", "0.3") as srv:
        doc = probe(srv.url, duration=1.0, batch_size=2, workers=2, block_sizes=[64 << 10],
                    threads=[1], show_progress=False).to_dict()
    read = doc["pipeline"]["read"]
    assert read["samples"] < 48  # the slow link let it see only part of the data
    loader = doc["pipeline"]["loader"]
    assert [r["workers"] for r in loader] == [0, 1, 2]
    for run in loader:
        assert "error" not in run, run["error"]
        assert run["startup_s"] is not None  # batches came
    assert doc["pipeline"]["batch"]["tensors"]["jpg"] == "uint8[2, 16, 16, 3]"


class LinkStore:
    """benchmarks/linkstore.py as its own process: a store behind a link with a round trip."""

    def __init__(self, root: Path, *args: str) -> None:
        script = Path(__file__).resolve().parent.parent / "benchmarks" / "linkstore.py"
        self.proc = subprocess.Popen([sys.executable, str(script), str(root), *args],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/__stats__", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


RTT = 0.2


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 samples of 50 KB random bytes in 4 shards, as bucket ``bkt``, prefix ``fp``."""
    root = tmp_path_factory.mktemp("store")
    with ShardWriter(str(root / "bkt" / "fp"), max_samples=10) as w:
        for i in range(40):
            w.write({"__key__": f"s{i:03d}", "bin": os.urandom(50_000)})
    return root


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_the_probe_measures_the_link_and_says_what_a_cold_epoch_needs(
        bucket: Path, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over s3:// the probe reported a ceiling of 17 samples/s on a 200 MB/s link (each sample
    its own request) and nothing of what the link allows the L1 cache; now it measures the link
    as the cache uses it (latency, one range read, 8 at once) and the advice says what a cold
    epoch of this dataset needs."""
    store = LinkStore(bucket, "--rtt", str(RTT), "--node-rate", "50e6")
    try:
        if scheme == "s3":
            forget_s3_clients()
            for k, v in {"AWS_ENDPOINT_URL_S3": store.url, "AWS_ACCESS_KEY_ID": "k",
                         "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                         "AWS_CONFIG_FILE": os.devnull,
                         "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
                monkeypatch.setenv(k, v)
            url = "s3://bkt/fp"
        else:
            url = f"{store.url}/bkt/fp"
        doc = probe(url, duration=0.5, batch_size=8, workers=1, block_sizes=[1 << 20],
                    threads=[1], show_progress=False).to_dict()
        seen = store.stats()
    finally:
        store.stop()
        forget_s3_clients()
    link = doc["storage"]["link"]
    assert link["latency_s"] >= RTT  # the store waits a round trip before any first byte
    assert link["streams"] == 8 and seen["max_in_flight"] >= 2  # range reads at once
    assert link["one_stream_mb_per_s"] > 0 and link["aggregate_mb_per_s"] > 0
    size = doc["target"]["bytes"]
    assert link["cold_epoch_s"] == pytest.approx(
        link["latency_s"] + size / (link["aggregate_mb_per_s"] * 1e6))
    assert doc["verdict"]["cold_epoch_s"] == link["cold_epoch_s"]
    fetch = [a for a in doc["verdict"]["advice"] if a.startswith("Remote fetches bound")]
    assert len(fetch) == 1 and "cache_dir=" in fetch[0], doc["verdict"]["advice"]
    assert "range reads in flight" in fetch[0]
    assert f"a cold epoch of this dataset's {size / 1e6:,.1f} MB through the L1 cache needs " \
           f"about {link['cold_epoch_s']:.3g} s" in fetch[0]
