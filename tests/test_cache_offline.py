"""A warm L1 cache serves an epoch while the object store is down: an epoch over ``s3://`` (moto
on 127.0.0.1) with ``cache_dir=``, then the server stopped and a new process runs the epoch from
the cache, with one warning that says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _data import make_dataset
from _servers import BUCKET, moto_s3

from feedpipe import FeedDataset

# One epoch in a fresh process: every sample's digest, the log records and warnings it gave.
EPOCH = textwrap.dedent("""
    import hashlib, json, logging, sys, warnings
    from feedpipe import FeedDataset
    from feedpipe._helpers import retry as retry
    retry.DEFAULT_POLICY = retry.RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01)
    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append(f"{r.levelname} {r.name}: {r.getMessage()}")
    logging.getLogger().addHandler(Keep(logging.WARNING))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = FeedDataset(sys.argv[1], cache_dir=sys.argv[2], shuffle=True, seed=3)
        got = {s["__key__"]: hashlib.sha256(b"".join(
            bytes(s[k]) for k in sorted(s) if not k.startswith("__"))).hexdigest() for s in ds}
    print(json.dumps({"got": got, "logs": records, "warnings": [str(x.message) for x in w]}))
""")


# botocore's own retries of a refused connection down to one (a user's setting, through the
# standard environment), so that the outage is noticed in seconds
FEW_RETRIES = {"AWS_MAX_ATTEMPTS": "1"}


def run_epoch(url: str, cache: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", EPOCH, url, str(cache)], check=False,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env, **FEW_RETRIES})


def epoch(url: str, cache: Path, env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    out = run_epoch(url, cache, env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def digests(root: str) -> dict[str, str]:
    import hashlib

    return {s["__key__"]: hashlib.sha256(b"".join(
        bytes(s[k]) for k in sorted(s) if not k.startswith("__"))).hexdigest()
        for s in FeedDataset(root)}


@pytest.mark.slow
def test_a_warm_cache_runs_the_epoch_while_the_store_is_down(tmp_path: Path) -> None:
    pytest.importorskip("s3fs", reason="s3fs is in the test extra: pip install -e '.[test]'")
    pytest.importorskip("boto3", reason="moto[server] is in the test extra")
    root = make_dataset(str(tmp_path / "data"))
    want = digests(root)
    url, cache = f"s3://{BUCKET}/shards", tmp_path / "cache"
    with moto_s3({"shards": Path(root)}) as env:
        warm = epoch(url, cache, env)
    assert warm["got"] == want and warm["logs"] == [] and warm["warnings"] == []
    # the server is stopped: nothing listens on its endpoint any more
    down = epoch(url, cache, env)
    assert down["got"] == want
    assert len(down["logs"]) == 1, down["logs"]
    line = down["logs"][0]
    assert line.startswith("WARNING feedpipe.cache")
    assert "unreachable" in line and str(cache) in line and url in line
    assert down["warnings"] == []
    # a cache that never held this dataset: the outage is the error it always was
    cold = run_epoch(url, tmp_path / "cold", env)
    assert cold.returncode != 0
    assert "RemoteError" in cold.stderr and f"{url}/manifest.json" in cold.stderr
