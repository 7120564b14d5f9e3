"""The decoded store (memmap of a deterministic transform's outputs) with real DataLoader workers:
later epochs equal the first byte for byte without reading a shard or calling the transform;
invalidation by the transform's parameters; a clear error for a sample of another shape;
concurrent fillers; SIGKILL mid-fill; damage; a full disk."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _data import damage_record, make_dataset
from _servers import python_server
from torch.utils.data import DataLoader

from feedpipe import FeedDataset
from feedpipe.caches.decoded._files import read_recorded
from feedpipe.caches.decoded._store import DecodedStore
from feedpipe.errors import DecodedStoreError
from feedpipe.transforms._pipeline import ImagePipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX = mp.get_context("fork")
N = 25  # samples of make_dataset


class Decode:
    """JPEG decode + deterministic resize to ``size``; appends each sample key it decodes to the
    file ``calls`` (counts calls across worker processes)."""

    deterministic = True  # not run a second time by the stores' check: it counts its calls

    def __init__(self, calls: str, size: int = 8) -> None:
        self.calls = calls
        self.pipeline = ImagePipeline(size, train=False, mean=None)

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        with open(self.calls, "a") as f:
            f.write(sample["__key__"] + "\n")
        image, label = self.pipeline(sample)
        return {"image": image, "label": label, "index": np.int64(sample["__index__"])}


def calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def epoch(ds: FeedDataset, e: int, workers: int = 2) -> dict[int, tuple[bytes, int]]:
    """Sample id -> (image bytes, label) of one epoch, read through a DataLoader."""
    ds.set_epoch(e)
    src = ds if workers == 0 else DataLoader(ds, batch_size=None, num_workers=workers)
    out = {}
    for s in src:
        assert isinstance(s["image"], torch.Tensor) and s["image"].dtype == torch.uint8
        out[int(s["index"])] = (s["image"].numpy().tobytes(), s["label"])
    return out


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("ds")))  # 25 samples, shards of 7


@pytest.fixture(scope="module")
def truth(ds_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[bytes, int]]:
    calls_file = str(tmp_path_factory.mktemp("truth") / "calls")
    return epoch(FeedDataset(ds_path, transform=Decode(calls_file)), 0, workers=0)


def test_later_epochs_equal_the_first_without_shards_or_decoding(
        ds_path: str, truth: dict, tmp_path: Path) -> None:
    data = Path(shutil.copytree(ds_path, tmp_path / "ds"))
    log = tmp_path / "calls"
    ds = FeedDataset(str(data), shuffle=True, seed=1, transform=Decode(str(log)),
                     decoded_cache=tmp_path / "dec")
    first = epoch(ds, 0)
    assert first == truth
    assert sorted(calls(log)) == sorted(set(calls(log))) and len(calls(log)) == N
    for tar in data.glob("*.tar"):  # later epochs must not read a shard at all
        tar.unlink()
    for e in (1, 2):
        assert epoch(ds, e) == first
    assert len(calls(log)) == N  # not one more decode, in any worker
    rec = read_recorded(ds.decoded.path)  # counters recorded by the worker processes
    assert (rec["misses"], rec["fills"], rec["hits"], rec["damaged"]) == (N, N, 2 * N, 0)
    assert ds.decoded.filled() == N and ds.decoded.complete()


def test_over_http_a_complete_store_makes_no_request(ds_path: str, truth: dict,
                                                     tmp_path: Path) -> None:
    """With the L1 cache too: once the store is complete, an epoch fetches and prefetches
    nothing."""
    with python_server(Path(ds_path).parent) as server:
        ds = FeedDataset(f"{server.url}/shards", shuffle=True,
                         transform=Decode(str(tmp_path / "c")), cache_dir=tmp_path / "l1",
                         decoded_cache=tmp_path / "dec")
        assert epoch(ds, 0) == truth
        assert any(v["requests"] for v in server.stats().values())
        server.reset()
        assert epoch(ds, 1) == truth
        assert server.stats() == {}


def test_changing_the_transform_parameters_invalidates(ds_path: str, truth: dict,
                                                       tmp_path: Path) -> None:
    log, dec = tmp_path / "calls", tmp_path / "dec"
    a = FeedDataset(ds_path, transform=Decode(str(log), size=8), decoded_cache=dec)
    assert epoch(a, 0, workers=0) == truth
    b = FeedDataset(ds_path, transform=Decode(str(log), size=6), decoded_cache=dec)
    assert b.decoded.path != a.decoded.path
    got = epoch(b, 0, workers=0)
    assert len(calls(log)) == 2 * N  # recomputed, not served from the size-8 store
    assert {len(v[0]) for v in got.values()} == {3 * 6 * 6}
    same = FeedDataset(ds_path, transform=Decode(str(log), size=8), decoded_cache=dec)
    assert same.decoded.path == a.decoded.path  # equal parameters: the same store again
    assert epoch(same, 1, workers=0) == truth and len(calls(log)) == 2 * N
    assert len(os.listdir(dec)) == 2


class Shift:
    """Decode, then subtract ``mean`` (a tensor): what a normalising transform holds."""

    def __init__(self, mean: torch.Tensor) -> None:
        self.mean = mean
        self.pipeline = ImagePipeline(8, train=False, mean=None)

    def __call__(self, sample: dict[str, Any]) -> torch.Tensor:
        return self.pipeline(sample)[0].float() - self.mean


def test_transforms_holding_other_tensor_values_get_their_own_records(
        ds_path: str, tmp_path: Path) -> None:
    dec = tmp_path / "dec"

    def run(t: Any) -> tuple[str, dict[str, bytes]]:
        ds = FeedDataset(ds_path, transform=t, decoded_cache=dec)
        return ds.decoded.path, {s["__key__"] if isinstance(s, dict) else i: s.numpy().tobytes()
                                 for i, s in enumerate(ds)}

    zero_path, zero = run(Shift(torch.tensor(0.0)))
    fifty_path, fifty = run(Shift(torch.tensor(50.0)))
    assert fifty_path != zero_path
    assert fifty == {i: (np.frombuffer(v, np.float32) - 50).tobytes() for i, v in zero.items()}
    again_path, again = run(Shift(torch.tensor(0.0)))
    assert (again_path, again) == (zero_path, zero)
    versioned = Shift(torch.tensor(0.0))
    versioned.version = 2  # the escape hatch for what the fingerprint cannot see
    assert run(versioned)[0] not in (zero_path, fifty_path)


class Ragged:
    """A fixed (3, 4, 4) array, except for sample ``odd`` whose width is 5."""

    def __init__(self, odd: str) -> None:
        self.odd = odd

    def __call__(self, sample: dict[str, Any]) -> np.ndarray:
        return np.zeros((3, 4, 5 if sample["__key__"] == self.odd else 4), np.uint8)


def test_a_sample_of_another_shape_is_an_error_naming_its_key(ds_path: str,
                                                              tmp_path: Path) -> None:
    keys = [s["__key__"] for s in FeedDataset(ds_path)]
    ds = FeedDataset(ds_path, transform=Ragged(keys[9]), decoded_cache=tmp_path / "dec")
    with pytest.raises(DecodedStoreError, match=keys[9]) as e:
        list(ds)
    assert "ndarray uint8[3, 4, 5]" in str(e.value) and "uint8[3, 4, 4]" in str(e.value)
    assert "data-000001.tar" in str(e.value)  # the shard that holds sample 9
    text = FeedDataset(ds_path, transform=lambda s: s["__key__"], decoded_cache=tmp_path / "t")
    with pytest.raises(DecodedStoreError, match=r"output is a str.*fixed-shape"):
        next(iter(text))


def test_refuses_what_it_cannot_cache(ds_path: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="transform="):
        FeedDataset(ds_path, decoded_cache=tmp_path)
    with pytest.raises(ValueError, match="train=True"):
        FeedDataset(ds_path, transform=ImagePipeline(8), decoded_cache=tmp_path)


def _filler(q: Any, path: str, dec: str, log: str) -> None:
    try:
        ds = FeedDataset(path, shuffle=True, seed=os.getpid(), transform=Decode(log),
                         decoded_cache=dec)
        q.put(epoch(ds, 0))
    except BaseException as e:  # report, never hang the parent
        q.put({"error": repr(e)})


def test_concurrent_fillers_share_one_store(ds_path: str, truth: dict, tmp_path: Path) -> None:
    """Two processes with two workers each fill the same store at once (different orders)."""
    dec, log = str(tmp_path / "dec"), str(tmp_path / "calls")
    q = CTX.Queue()
    procs = [CTX.Process(target=_filler, args=(q, ds_path, dec, log)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert results == [truth, truth]
    ds = FeedDataset(ds_path, transform=Decode(log), decoded_cache=dec)
    assert ds.decoded.complete()
    assert epoch(ds, 1) == truth and len(calls(Path(log))) <= 2 * N
    assert read_recorded(ds.decoded.path).get("damaged", 0) == 0


# A run whose workers die by SIGKILL in the middle of writing a record: the patched pack writes
# the first half of the record, then the worker kills itself, on its 4th record.
KILLED_FILL = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    from feedpipe.caches.decoded import _layout as record_layout
    from test_decoded_store import Decode, epoch
    from feedpipe import FeedDataset
    pack, n = record_layout.Layout.pack, [0]
    def torn(self, rec, leaves):
        n[0] += 1
        if n[0] == 4:
            rec[: self.record // 2] = 0x5A
            os.kill(os.getpid(), signal.SIGKILL)
        pack(self, rec, leaves)
    record_layout.Layout.pack = torn
    ds = FeedDataset(sys.argv[2], transform=Decode(sys.argv[4]), decoded_cache=sys.argv[3])
    epoch(ds, 0)
""")


def test_sigkill_mid_fill_then_a_rerun_serves_correct_data(ds_path: str, truth: dict,
                                                           tmp_path: Path) -> None:
    dec, log = tmp_path / "dec", tmp_path / "calls"
    run = subprocess.run([sys.executable, "-c", KILLED_FILL, ROOT, ds_path, str(dec), str(log)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    # a worker died mid-fill; the loader fails (how it words it varies: a lost worker, a reset
    # connection to it), and what the store shows is what counts
    assert run.returncode != 0, run.stdout
    ds = FeedDataset(ds_path, transform=Decode(str(log)), decoded_cache=dec)
    filled = ds.decoded.filled()
    assert 0 < filled < N
    # the torn records (written half, never committed) are on disk but not marked filled
    m = ds.decoded._m  # mapped by filled()
    assert m is not None
    torn = [i for i in range(N) if m.state[i] == 0 and (m.records[i] == 0x5A).any()]
    assert torn
    before = len(calls(log))
    assert epoch(ds, 1) == truth
    assert len(calls(log)) - before == N - filled  # only what was missing is decoded again


def test_a_damaged_record_is_recomputed_not_served(ds_path: str, truth: dict,
                                                   tmp_path: Path) -> None:
    log = tmp_path / "calls"
    ds = FeedDataset(ds_path, transform=Decode(str(log)), decoded_cache=tmp_path / "dec")
    assert epoch(ds, 0, workers=0) == truth
    damage_record(ds.decoded.path, 3, N)
    again = FeedDataset(ds_path, transform=Decode(str(log)), decoded_cache=tmp_path / "dec")
    assert epoch(again, 1, workers=0) == truth
    assert again.decoded.stats.damaged == 1 and len(calls(log)) == N + 1


DISK_FULL = textwrap.dedent("""
    import os, resource, signal, sys, warnings
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    from test_decoded_store import Decode, epoch
    from feedpipe import FeedDataset
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a dead process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # smaller than the store's files
    ds = FeedDataset(sys.argv[2], transform=Decode(sys.argv[4]), decoded_cache=sys.argv[3])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = epoch(ds, 0, workers=0)
    print(sorted(got) == list(range(25)), any("no room for the decoded store" in str(x.message)
                                               for x in w))
""")


def test_disk_full_degrades_to_computing_with_a_warning(ds_path: str, truth: dict,
                                                        tmp_path: Path) -> None:
    dec, log = tmp_path / "dec", tmp_path / "calls"
    out = subprocess.run([sys.executable, "-c", DISK_FULL, ROOT, ds_path, str(dec), str(log)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
    assert len(calls(log)) == N
    leftovers = [p.name for p in dec.rglob("*") if p.suffix in (".bin", ".json")]
    assert leftovers == []  # no half-allocated store, nothing marked filled
    ds = FeedDataset(ds_path, transform=Decode(str(log)), decoded_cache=dec)
    assert epoch(ds, 0, workers=0) == truth and ds.decoded.complete()  # with room: it fills


def test_store_api_round_trips_every_leaf_type(tmp_path: Path) -> None:
    st = DecodedStore(tmp_path / "s", samples=3)
    out = {"t": torch.arange(6, dtype=torch.int16).reshape(2, 3), "a": np.ones(2, np.float32),
           "s": np.float32(2.5), "i": 7, "f": 0.5, "b": True, "l": [1, (2, 3)], "__key__": "x"}
    first = st.put(1, out, key="x", shard="s.tar")
    again = st.get(1)
    for got in (first, again):
        assert "__key__" not in got  # metadata is not part of a record
        assert torch.equal(got["t"], out["t"]) and got["t"].dtype == torch.int16
        assert got["a"].tolist() == [1.0, 1.0] and type(got["s"]) is np.float32
        assert (got["i"], got["f"], got["b"], got["l"]) == (7, 0.5, True, [1, (2, 3)])
    assert st.get(0) is None and st.filled() == 1 and not st.complete()
    st.close()


def test_feedloader_serves_a_complete_store_in_process_with_the_same_batches(
        ds_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every output is stored, FeedLoader(num_workers=2) reads the store in its own process
    (no worker would add anything but a pickle and a pipe): same batches, same order, the same
    resume positions, and no worker started."""
    from feedpipe import FeedLoader

    log = tmp_path / "calls"

    def loader() -> FeedLoader:
        ds = FeedDataset(ds_path, shuffle=True, seed=4, transform=Decode(str(log)),
                         decoded_cache=str(tmp_path / "store"))
        return FeedLoader(ds, batch_size=4, num_workers=2)

    def ids(batches: list[Any]) -> list[list[int]]:
        return [b["index"].tolist() for b in batches]

    first = loader()
    first.set_epoch(3)
    filled = list(first)  # through the workers: fills the store
    assert len(calls(log)) == N and first.dataset.decoded.complete()

    import torch.utils.data.dataloader as dl

    def no_workers(*a: Any, **k: Any) -> Any:
        raise AssertionError("a worker process was started for a complete store")
    monkeypatch.setattr(dl, "_MultiProcessingDataLoaderIter", no_workers)
    again = loader()
    again.set_epoch(3)
    served = list(again)
    assert ids(served) == ids(filled) and len(calls(log)) == N
    for a, b in zip(served, filled):
        assert torch.equal(a["image"], b["image"]) and a["label"].tolist() == b["label"].tolist()

    part = loader()
    part.set_epoch(3)
    it = iter(part)
    head = [next(it), next(it)]
    state = part.state_dict()
    it.close()
    rest = loader()
    rest.load_state_dict(state)
    assert ids(head) + ids(list(rest)) == ids(filled)


def test_hits_reuse_a_record_buffer_only_once_nothing_refers_to_it(tmp_path: Path) -> None:
    st = DecodedStore(tmp_path / "s", samples=40)
    for i in range(40):
        st.put(i, {"x": np.full((16, 16), i, np.uint8), "t": torch.full((3,), i)}, key=str(i),
               shard="s.tar")
    kept = st.get(5)  # a sample the caller keeps: its buffer must never be reused
    kept_t = kept["t"]  # a tensor sharing the record's memory
    del kept
    seen = set()
    for rnd in range(3):
        for i in range(40):
            got = st.get(i)
            assert (got["x"] == i).all() and got["t"].tolist() == [i] * 3, (rnd, i)
            seen.add(got["x"].__array_interface__["data"][0])  # where its bytes lie
            del got  # dropped: its buffer may serve a later hit
        assert kept_t.tolist() == [5] * 3  # untouched by 120 later hits
    held = [st.get(i) for i in range(40)]  # all alive at once: each its own buffer
    assert [int(h["x"][0, 0]) for h in held] == list(range(40))
    assert len(seen) < 40  # buffers were recycled
    st.close()
