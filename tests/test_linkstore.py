"""benchmarks/linkstore.py, the store the remote benchmarks read over a simulated link, run as its
own process as the benchmark runs it: it serves the bytes asked for (Range, HTTP and S3 alike),
s3fs and boto3 can list it, its token bucket spreads the bytes over at least size / rate of its
own clock, faults happen as asked, and its counters count what was sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _servers import wait_until

HERE = Path(__file__).parent
SCRIPT = HERE.parent / "benchmarks" / "linkstore.py"
CHUNK = 16 << 10  # the send unit the tests ask of the store


class Store:
    def __init__(self, root: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root), *args],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), line
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/__stats__", timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, doc: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(doc or {}).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def get(self, path: str, headers: dict[str, str] | None = None,
            method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(self.url + path, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()


@pytest.fixture
def data(tmp_path: Path) -> dict[str, bytes]:
    blobs = {"bkt/fp/shard-000.tar": os.urandom(300_000), "bkt/fp/shard-001.tar": os.urandom(7),
             "bkt/fp/sub/manifest.json": b'{"x": 1}', "bkt/other.bin": os.urandom(5)}
    for key, blob in blobs.items():
        p = tmp_path / "root" / key
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob)
    return blobs


@pytest.fixture
def store(tmp_path: Path, data: dict[str, bytes]) -> Iterator[Store]:
    s = Store(tmp_path / "root")
    yield s
    s.proc.kill()
    s.proc.wait(10)


def test_ranges_heads_and_missing_keys(store: Store, data: dict[str, bytes]) -> None:
    blob = data["bkt/fp/shard-000.tar"]
    code, headers, body = store.get("/bkt/fp/shard-000.tar", {"Range": "bytes=1000-1999"})
    assert (code, body) == (206, blob[1000:2000])
    assert headers["Content-Range"] == f"bytes 1000-1999/{len(blob)}"
    code, _, body = store.get("/bkt/fp/shard-000.tar", {"Range": "bytes=-10"})
    assert (code, body) == (206, blob[-10:])
    code, _, body = store.get("/bkt/fp/shard-000.tar", {"Range": f"bytes={len(blob) - 3}-"})
    assert (code, body) == (206, blob[-3:])
    code, _, _ = store.get("/bkt/fp/shard-000.tar", {"Range": f"bytes={len(blob)}-"})
    assert code == 416
    code, headers, body = store.get("/bkt/fp/shard-000.tar", method="HEAD")
    assert (code, body) == (200, b"")
    assert int(headers["Content-Length"]) == len(blob)
    assert headers["ETag"].startswith('"') and headers["Last-Modified"]
    code, _, body = store.get("/bkt/fp/shard-000.tar")
    assert (code, body) == (200, blob)
    code, _, body = store.get("/bkt/fp/nope.tar")
    assert code == 404 and b"NoSuchKey" in body
    code, _, body = store.get("/nobucket/x")
    assert code == 404 and b"NoSuchBucket" in body
    st = store.stats()
    assert st["bytes"] == 1000 + 10 + 3 + len(blob)
    assert st["requests"]["get"] == 5 and st["requests"]["head"] == 1
    assert st["per_object"]["/bkt/fp/shard-000.tar"] == {"requests": 6,
                                                         "bytes": 1013 + len(blob)}
    assert st["in_flight"] == 0 and st["max_in_flight"] >= 1
    assert st["timeline"][-1][1] == st["bytes"]
    store.post("/__reset__")
    assert store.stats()["bytes"] == 0


def test_the_node_rate_spreads_the_bytes_over_at_least_size_over_rate(
        store: Store, data: dict[str, bytes]) -> None:
    rate = 1_000_000  # 0.3 MB at 1 MB/s: at least 0.3 s of the store's own 50 ms bins
    store.post("/__link__", {"node_rate": rate, "chunk": CHUNK})
    store.post("/__reset__")
    _, _, body = store.get("/bkt/fp/shard-000.tar")
    assert body == data["bkt/fp/shard-000.tar"]
    st = store.stats()
    assert st["bytes"] == len(body)
    bins = st["timeline"]
    per_bin = [b - a for (_, a), (_, b) in zip([[0, 0], *bins], bins, strict=False)]
    # each bin of bin_s carries no more than the bucket lets through (plus the chunk in flight and
    # the small burst the bucket allows), and so the bytes need at least size / rate of bins
    slack = rate * 0.005 + 2 * CHUNK
    assert max(per_bin) <= rate * st["bin_s"] + slack, per_bin
    assert len(bins) * st["bin_s"] >= (len(body) - slack) / rate


def test_a_response_cap_limits_each_response(store: Store, data: dict[str, bytes]) -> None:
    rate = 1_000_000
    store.post("/__link__", {"response_rate": rate, "chunk": CHUNK})
    store.post("/__reset__")
    _, _, body = store.get("/bkt/fp/shard-000.tar")
    assert body == data["bkt/fp/shard-000.tar"]
    st = store.stats()
    assert len(st["timeline"]) * st["bin_s"] >= (len(body) - 2 * CHUNK) / rate


def test_s3fs_and_boto3_list_and_read_it(store: Store, data: dict[str, bytes]) -> None:
    import boto3
    import s3fs

    fs = s3fs.S3FileSystem(key="k", secret="s", skip_instance_cache=True,
                           client_kwargs={"endpoint_url": store.url, "region_name": "us-east-1"})
    assert sorted(fs.ls("bkt/fp", detail=False)) == ["bkt/fp/shard-000.tar",
                                                     "bkt/fp/shard-001.tar", "bkt/fp/sub"]
    assert sorted(fs.find("bkt")) == sorted(data)
    assert fs.info("bkt/fp/shard-000.tar")["size"] == 300_000
    assert fs.info("bkt/fp/sub")["type"] == "directory"
    assert fs.cat_file("bkt/fp/shard-000.tar", start=5, end=50) == \
        data["bkt/fp/shard-000.tar"][5:50]
    client = boto3.client("s3", endpoint_url=store.url, region_name="us-east-1",
                          aws_access_key_id="k", aws_secret_access_key="s")
    pages = list(client.get_paginator("list_objects_v2").paginate(
        Bucket="bkt", Prefix="fp/", PaginationConfig={"PageSize": 2}))
    assert [o["Key"] for p in pages for o in p.get("Contents", [])] == \
        ["fp/shard-000.tar", "fp/shard-001.tar", "fp/sub/manifest.json"]
    assert len(pages) == 2 and pages[0]["IsTruncated"]
    got = client.get_object(Bucket="bkt", Key="fp/shard-001.tar")["Body"].read()
    assert got == data["bkt/fp/shard-001.tar"]
    st = store.stats()
    assert st["requests"]["list"] >= 4
    assert st["per_object"]["/bkt/fp/shard-001.tar"]["bytes"] == 7


def test_faults_are_injected_and_counted(store: Store) -> None:
    store.post("/__link__", {"fail": 1.0})
    code, _, body = store.get("/bkt/other.bin")
    assert code == 503 and b"SlowDown" in body
    assert store.stats()["errors"] == {"fail": 1, "stall": 0}
    assert store.stats()["bytes"] == 0


def test_stalled_responses_stay_in_flight_and_are_counted(store: Store) -> None:
    store.post("/__link__", {"stall": 1.0, "stall_s": 60})
    socks = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", store.port), timeout=30)
        s.sendall(b"GET /bkt/other.bin HTTP/1.1\r\nHost: x\r\n\r\n")
        socks.append(s)
    try:
        wait_until(lambda: store.stats()["in_flight"] == 3, what="3 stalled responses")
        st = store.stats()
        assert st["max_in_flight"] == 3 and st["errors"]["stall"] == 3
        assert st["requests"]["get"] == 3 and st["bytes"] == 0
    finally:
        for s in socks:
            s.close()
