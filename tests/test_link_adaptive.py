"""The range controller on a real link: benchmarks/linkstore.py (a store on 127.0.0.1 with a round
trip before each first byte, one token bucket for the node and, where asked, a cap per response)
read by a fresh process, as a training script reads it (its own controller, its own L1 cache).
Where each response is capped, the store counts more responses in flight at once than on the
same link without the cap, and ``stats()["io"]["link"]`` says what the controller aimed at, what
was in flight and what it measured. Every sample arrives exactly once. Behaviour only: no
timings are asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import feedpipe
from feedpipe import FeedDataset
from feedpipe.convert._synth import make_records

HERE = Path(__file__).parent
STORE = HERE.parent / "benchmarks" / "linkstore.py"
RTT = 0.03  # seconds before each response's first byte
NODE = 40e6  # bytes/s shared by every response
CAP = 1e6  # bytes/s of one response, where capped: the node needs 40 of them
CEILING = 48  # FEEDPIPE_REMOTE_STREAMS: room above what the capped link gets to

READ = """
import json, sys
from feedpipe import FeedDataset, FeedLoader
loader = FeedLoader(FeedDataset(sys.argv[1], cache_dir=sys.argv[2], shuffle=True), batch_size=16)
keys = [k for batch in loader for k in batch["__key__"]]
print(json.dumps({"keys": keys, "link": loader.stats()["io"]["link"]}))
"""


class Store:
    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(STORE), str(root), "--rtt", str(RTT), "--node-rate", str(NODE)],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def post(self, path: str, doc: dict | None = None) -> None:  # type: ignore[type-arg]
        req = urllib.request.Request(self.url + path, data=json.dumps(doc or {}).encode(),
                                     method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def stats(self) -> dict:  # type: ignore[type-arg]
        with urllib.request.urlopen(self.url + "/__stats__", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Store, list[str]]]:
    """32 shards of 1 MB (10 samples of 100 kB) under bucket ``bkt``, and the keys they hold."""
    make_records(str(tmp_path / "src"), count=320, size=100_000, per_dir=1000, seed=48)
    feedpipe.shard(str(tmp_path / "src"), str(tmp_path / "root" / "bkt" / "fp"),
                   max_samples=10, workers=1, show_progress=False)
    keys = sorted(s["__key__"] for s in FeedDataset(str(tmp_path / "root" / "bkt" / "fp")))
    s = Store(tmp_path / "root")
    yield s, keys
    s.proc.kill()
    s.proc.wait(10)


def read(store: Store, cache: Path, response_rate: float) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """A fresh process reads the dataset once over the link; what it reported, and what the
    store counted."""
    store.post("/__link__", {"response_rate": response_rate})
    store.post("/__reset__")
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), FEEDPIPE_RANGE_BYTES=str(256 << 10),
               FEEDPIPE_REMOTE_STREAMS=str(CEILING))
    env.pop("FEEDPIPE_REMOTE_STREAMS_MIN", None)
    out = subprocess.run([sys.executable, "-c", READ, f"{store.url}/bkt/fp", str(cache)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), store.stats()


@pytest.mark.slow
def test_capped_responses_get_more_in_flight_than_an_uncapped_link(
        store: tuple[Store, list[str]], tmp_path: Path) -> None:
    s, keys = store
    plain, plain_store = read(s, tmp_path / "c1", 0.0)
    capped, capped_store = read(s, tmp_path / "c2", CAP)
    for got, counted in ((plain, plain_store), (capped, capped_store)):
        assert sorted(got["keys"]) == keys  # exactly once, every sample checked by its key
        link = got["link"]
        # the controller's figures: what it aimed at, what was in flight, what the link gave
        assert 2 <= link["target"] <= CEILING and link["inflight_max"] >= 1
        assert link["rtt_s"] >= RTT  # no response came sooner than the round trip
        assert 0 < link["bandwidth"] and 0 < link["bytes_per_s"]
        # the ceiling, and the index of each shard the read-ahead fetches at once
        assert counted["max_in_flight"] <= CEILING + 16
    # without the cap a few ranges fill the link: far fewer than the ceiling were asked for
    assert plain_store["max_in_flight"] < CEILING
    # each capped response streams at 1/40 of the node: many more of them were asked for at once
    assert capped_store["max_in_flight"] > plain_store["max_in_flight"] + CEILING // 4
    assert capped["link"]["target"] > plain["link"]["target"]
