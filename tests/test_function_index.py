"""The L2 function index: memo, dedup, invalidation, concurrency, crashes, damage, disk full."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe.caches._fingerprint import fingerprint
from feedpipe.caches.l2._codec import decode, encode
from feedpipe.caches.l2._index import FunctionIndex
from feedpipe.caches.l2._record import content_hash, unpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checksum(data):  # type: ignore[no-untyped-def]
    b = bytes(data)
    return np.frombuffer(b, dtype=np.uint8).astype(np.int64).sum(), len(b)


def test_hit_after_miss_and_persistence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    idx = FunctionIndex(str(tmp_path / "l2"))
    f = idx.wrap(checksum)
    assert f(b"abc") == checksum(b"abc")
    assert f(b"abc") == checksum(b"abc")
    s = idx.stats()
    assert (s.misses, s.hits, s.entries) == (1, 1, 1)
    idx.close()
    again = FunctionIndex(str(tmp_path / "l2"), lru_items=0)
    g = again.wrap(checksum)
    assert g(b"abc") == checksum(b"abc")
    s = again.stats()
    assert (s.misses, s.hits) == (0, 1)


CALLS: list[str] = []  # a global: the state of a function that appended to its own would change


def test_identical_inputs_are_computed_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls = CALLS
    calls.clear()

    def size(sample):  # type: ignore[no-untyped-def]
        CALLS.append(sample["__key__"])
        return len(bytes(sample["jpg"]))

    size.deterministic = True  # type: ignore[attr-defined]  # counted: not run twice to check
    idx = FunctionIndex(str(tmp_path / "l2"))
    f = idx.wrap(size)
    a = {"__key__": "a", "jpg": b"same bytes"}
    b = {"__key__": "b", "jpg": b"same bytes"}
    c = {"__key__": "c", "jpg": b"other"}
    assert [f(a), f(b), f(c)] == [10, 10, 5]
    assert calls == ["a", "c"]
    s = idx.stats()
    assert s.dedup == 1 and s.entries == 2


def test_code_and_parameter_changes_invalidate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns1: dict = {}
    ns2: dict = {}
    exec("def resize(b, size=224):\n    return len(b) * size", ns1)
    exec("def resize(b, size=224):\n    return len(b) * size + 1", ns2)
    assert fingerprint(ns1["resize"]) != fingerprint(ns2["resize"])
    idx = FunctionIndex(str(tmp_path / "l2"))
    assert idx.wrap(ns1["resize"])(b"xx") == 448
    assert idx.wrap(ns2["resize"])(b"xx") == 449  # not the stale 448
    assert idx.wrap(ns1["resize"], params={"size": 256})(b"xx") == 448
    assert idx.stats().misses == 3

    class Scale:
        def __init__(self, k: int) -> None:
            self.k = k

        def __call__(self, b):  # type: ignore[no-untyped-def]
            return len(b) * self.k

    assert fingerprint(Scale(2)) != fingerprint(Scale(3))
    assert fingerprint(Scale(2)) == fingerprint(Scale(2))


def _scaled(k):  # type: ignore[no-untyped-def]
    return lambda b: float(b[0]) * float(k)


def test_closures_over_tensors_of_other_values_are_other_functions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    idx = FunctionIndex(str(tmp_path / "l2"))
    assert idx.wrap(_scaled(torch.tensor(1.0)))(b"\x02") == 2.0
    assert idx.wrap(_scaled(torch.tensor(100.0)))(b"\x02") == 200.0  # not the stale 2.0
    assert idx.wrap(_scaled(torch.tensor(1.0)))(b"\x02") == 2.0
    assert idx.stats().misses == 2 and idx.stats().hits == 1


def test_the_fingerprint_sees_what_a_transform_commonly_holds() -> None:
    """Tensor values, dtype and shape (not where they live or whether they need grad), module
    parameters and buffers, dataclass fields, slots."""
    t = torch.arange(6, dtype=torch.float32)
    same = [(t, t.clone()), (t, t.clone().requires_grad_()), (t, t.reshape(2, 3).reshape(6)),
            (t[::2], torch.tensor([0.0, 2.0, 4.0]))]
    for a, b in same:
        assert fingerprint(a) == fingerprint(b)
    for other in (t.double(), t.reshape(2, 3), t + 1, torch.zeros(6, dtype=torch.bfloat16)):
        assert fingerprint(other) != fingerprint(t)

    def linear(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))

    assert fingerprint(linear(0)) == fingerprint(linear(0))
    assert fingerprint(linear(0)) != fingerprint(linear(1))  # parameters
    m = linear(0)
    m[1].running_mean += 1  # a buffer
    assert fingerprint(m) != fingerprint(linear(0))
    m = linear(0)
    m[1].eps = 0.5  # a plain attribute of a submodule
    assert fingerprint(m) != fingerprint(linear(0))

    @dataclasses.dataclass(frozen=True, slots=True)
    class Norm:
        mean: torch.Tensor
        std: float

    assert fingerprint(Norm(torch.zeros(3), 1.0)) == fingerprint(Norm(torch.zeros(3), 1.0))
    assert fingerprint(Norm(torch.zeros(3), 1.0)) != fingerprint(Norm(torch.ones(3), 1.0))
    assert fingerprint(Norm(torch.zeros(3), 1.0)) != fingerprint(Norm(torch.zeros(3), 2.0))
    big = torch.zeros(5000)
    changed = big.clone()
    changed[2500] = 1  # where a tensor's repr shows "..."
    assert fingerprint(Norm(big, 1.0)) != fingerprint(Norm(changed, 1.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fingerprint_of_a_tensor_does_not_depend_on_its_device() -> None:
    t = torch.linspace(0, 1, 7)
    assert fingerprint(t.cuda()) == fingerprint(t)
    assert fingerprint(torch.nn.Linear(3, 2).cuda()) != fingerprint(t)


FINGERPRINT = textwrap.dedent("""
    import dataclasses, sys, torch
    from feedpipe.caches._fingerprint import fingerprint
    @dataclasses.dataclass
    class T:
        mean: torch.Tensor
        net: torch.nn.Module
        def __call__(self, x):
            return self.net(x - self.mean)
    torch.manual_seed(0)
    print(fingerprint(T(torch.tensor([0.5, 1.5]), torch.nn.Linear(2, 2))).hex())
""")


def test_the_fingerprint_is_the_same_in_every_process() -> None:
    """No memory address or other per-process value in it: a new process finds the entries."""
    runs = {subprocess.run([sys.executable, "-c", FINGERPRINT], capture_output=True, text=True,
                           check=True, cwd=ROOT, timeout=120).stdout for _ in range(2)}
    assert len(runs) == 1 and len(runs.pop().strip()) == 32


TABLE = {"k": 1}


def _lookup(b):  # type: ignore[no-untyped-def]
    return TABLE["k"] * len(b)


def test_version_is_the_escape_hatch_for_what_the_fingerprint_cannot_see(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    idx = FunctionIndex(str(tmp_path / "l2"))
    assert idx.wrap(_lookup)(b"xy") == 2
    monkeypatch.setitem(TABLE, "k", 5)  # a module global: the fingerprint cannot see it
    assert idx.wrap(_lookup)(b"xy") == 2  # the documented limit: the old entry is served
    assert idx.wrap(_lookup, version=2)(b"xy") == 10


def test_values_round_trip_without_pickle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    value = {"img": np.arange(12, dtype=np.uint8).reshape(3, 4), "t": torch.ones(2, 3),
             "meta": [1, 2.5, "x", None, (True, b"raw")]}
    out = decode(encode(value))
    assert np.array_equal(out["img"], value["img"]) and torch.equal(out["t"], value["t"])
    assert out["meta"] == value["meta"]
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(ValueError):
        decode(b"\x0b\xff\xff\xff\xff")


def test_damaged_entry_is_recomputed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "l2")
    idx = FunctionIndex(path)
    f = idx.wrap(checksum)
    f(b"payload")
    idx.close()
    env = lmdb.open(path)
    with env.begin(write=True) as txn:
        key, raw = next(iter(txn.cursor()))
        txn.put(key, raw[:-3] + b"XYZ")  # flip the payload's last bytes
    env.close()
    idx2 = FunctionIndex(path, lru_items=0)
    assert idx2.wrap(checksum)(b"payload") == checksum(b"payload")
    s = idx2.stats()
    assert s.damaged == 1 and s.misses == 1
    assert FunctionIndex(path, lru_items=0).wrap(checksum)(b"payload") == checksum(b"payload")


def _hammer(path: str, start: int, n: int, q) -> None:  # type: ignore[no-untyped-def]
    idx = FunctionIndex(path, map_size=32 << 10, batch_writes=4)  # tiny map: forces growth
    f = idx.wrap(_big_value)
    bad = 0
    for i in range(start, start + n):
        data = i.to_bytes(4, "little")
        if not np.array_equal(f(data), _big_value(data)):
            bad += 1
    idx.close()
    q.put(bad)


def _big_value(data):  # type: ignore[no-untyped-def]
    seed = int.from_bytes(bytes(data), "little")
    return np.random.default_rng(seed).integers(0, 255, size=2000, dtype=np.uint8)


def test_many_processes_read_and_write_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "l2")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    # 4 writers over overlapping ranges: 0..149, 50..199, 100..249, 150..299
    procs = [ctx.Process(target=_hammer, args=(path, 50 * k, 150, q)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert [q.get(timeout=10) for _ in procs] == [0, 0, 0, 0]
    idx = FunctionIndex(path, lru_items=0)
    assert idx.stats().entries == 300
    f = idx.wrap(_big_value)
    for i in (0, 149, 299):
        assert np.array_equal(f(i.to_bytes(4, "little")), _big_value(i.to_bytes(4, "little")))
    assert idx.stats().misses == 0


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from feedpipe.caches.l2._index import FunctionIndex
    def value(b):
        return np.full(5000, b[0], dtype=np.uint8)
    idx = FunctionIndex(sys.argv[1], map_size=1 << 20, batch_writes=1)
    f = idx.wrap(value)
    i = 0
    while True:
        f(bytes([i % 256, i // 256 % 256, 7]))
        i += 1
        if i == 50:
            print("ready", flush=True)
""")


def test_sigkill_mid_write_recovers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "l2")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"  # it is writing now
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    env = lmdb.open(path)
    with env.begin() as txn:
        assert txn.stat()["entries"] >= 50
        for _, raw in txn.cursor():
            value, _ = unpack(raw)  # every committed entry is whole
            assert value.shape == (5000,)
    env.close()
    idx = FunctionIndex(path, lru_items=0)
    f = idx.wrap(lambda b: b[0])
    assert f(b"\x05") == 5  # and the index keeps working


DISK_FULL = textwrap.dedent("""
    import resource, signal, sys, warnings, numpy as np
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    from feedpipe.caches.l2._index import FunctionIndex
    idx = FunctionIndex(sys.argv[1], map_size=8 << 20, batch_writes=4)
    f = idx.wrap(lambda b: np.full(20000, b[0], dtype=np.uint8))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ok = all(int(f(bytes([i]))[0]) == i for i in range(100))
        idx.flush()
    print(ok, any("cannot store" in str(x.message) for x in w))
""")


def test_disk_full_degrades_to_computing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "l2")
    out = subprocess.run([sys.executable, "-c", DISK_FULL, path], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
    # what was stored before the disk filled is intact: some entries, each whole and right
    byte_of = {content_hash(bytes([i])): i for i in range(100)}
    env = lmdb.open(path, readonly=True, lock=False)
    with env.begin() as txn:
        stored = {byte_of[bytes(k)[16:]]: unpack(bytes(v))[0]
                  for k, v in txn.cursor()}
    env.close()
    assert 0 < len(stored) < 100
    for i, value in stored.items():
        assert value.shape == (20000,) and value.dtype == np.uint8 and (value == i).all()
    idx = FunctionIndex(path, lru_items=0)
    assert idx.stats().entries == len(stored)
    f = idx.wrap(lambda b: b[0])
    assert f(b"\x09") == 9  # and the index keeps working


def _count_calls(sample):  # type: ignore[no-untyped-def]
    with open(os.environ["FEEDPIPE_TEST_CALLS"], "a") as fh:
        fh.write(sample["__key__"] + "\n")
    return checksum(sample["jpg"])


_count_calls.deterministic = True  # type: ignore[attr-defined]  # counted: not run twice to check


def test_as_a_transform_in_dataloader_workers(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FEEDPIPE_TEST_CALLS", str(calls))
    idx = FunctionIndex(str(tmp_path / "l2"))
    ds = FeedDataset(os.path.join(ROOT, "shards", "example"), shuffle=True,
                     transform=idx.wrap(_count_calls, fields=["jpg"]))
    loader = FeedLoader(ds, batch_size=5, num_workers=2, collate_fn=list)
    for epoch in range(2):
        loader.set_epoch(epoch)
        got = [v for b in loader for v in b]
        assert len(got) == 24
    # the second epoch computed nothing: every call happened once, in epoch 0
    assert len(calls.read_text().splitlines()) == 24
    assert FunctionIndex(str(tmp_path / "l2")).stats().entries == 24
