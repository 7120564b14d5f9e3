"""DeviceLoader: structure, order and values; FeedLoader(device=) resumption; clean shutdown; stats.

Every test runs on the CPU; the ``cuda`` parametrisations run where a CUDA device exists and skip
cleanly elsewhere. No test sleeps or asserts a timing: the producer is synchronised with events.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import traceback
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

from feedpipe import DeviceLoader, FeedDataset, FeedLoader
from feedpipe.errors import ShardFormatError

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "shards", "example")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])]
JOIN = 30.0  # seconds a test waits for a condition before failing (never reached when it holds)


class Pair(NamedTuple):
    x: torch.Tensor
    y: Any


def producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("feedpipe-DeviceLoader")]


def nested_batch(i: int) -> dict[str, Any]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + i
    return {
        "img": torch.full((2, 3), i, dtype=torch.uint8),
        "pair": Pair(base.t(), None),  # non-contiguous
        "list": [torch.tensor(i), f"key-{i}", 3.5, torch.zeros(0, dtype=torch.int16)],
        "tuple": (torch.tensor([i % 2 == 0]), (torch.tensor([i], dtype=torch.float16),)),
        "od": OrderedDict(b=torch.tensor([i, i]), a=i),
        "name": f"batch{i}",
    }


def to_cpu(obj: Any) -> Any:
    from feedpipe.device._placement import map_tensors

    return map_tensors(lambda t: t.cpu(), obj)


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def tensors_of(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    from feedpipe.device._placement import map_tensors

    map_tensors(out.append, obj)
    return out


# -- values, structure, order --------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_nested_structures_values_and_order_are_preserved(device: str) -> None:
    batches = [nested_batch(i) for i in range(7)]
    got = list(DeviceLoader(batches, device=device, depth=2))
    assert len(got) == 7
    for g, want in zip(got, batches):
        assert all(t.device.type == device for t in tensors_of(g))
        assert_same(to_cpu(g), want)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_tensors_and_tuples_pass_and_other_values_go_through(device: str) -> None:
    src = [torch.arange(5) * i for i in range(4)] + [(torch.ones(2), "x"), None, 7]
    got = list(DeviceLoader(src, device=device, depth=1))
    assert [to_cpu(g).tolist() for g in got[:4]] == [(torch.arange(5) * i).tolist()
                                                     for i in range(4)]
    assert got[4][1] == "x" and got[4][0].device.type == device
    assert got[5:] == [None, 7]


@pytest.mark.parametrize("device", DEVICES)
def test_pinned_staging_is_allocated_once_and_reused(device: str) -> None:
    # 20 batches of two tensors and a smaller last one: the ring holds depth slots of 2 buffers
    src = [(torch.rand(8, 16), torch.arange(8)) for _ in range(20)]
    src.append((torch.rand(3, 16), torch.arange(3)))
    loader = DeviceLoader(src, device=device, depth=3)
    for g, want in zip(loader, src):
        assert_same(to_cpu(g), want)
    s = loader.stats()
    expected = 2 * 3 if device == "cuda" else 0
    assert s["pinned_allocs"] == expected and s["pinned_buffers"] == expected


def test_cuda_request_without_cuda_falls_back_to_cpu_and_constructor_touches_nothing() -> None:
    threads = set(threading.enumerate())
    loader = DeviceLoader([torch.ones(1)], device="cuda")
    assert not set(threading.enumerate()) - threads  # no thread until iteration
    if not torch.cuda.is_available():
        assert [b.device.type for b in loader] == ["cpu"]
        assert loader.stats()["device"] == "cpu"


def test_import_and_construction_start_no_thread_and_no_cuda() -> None:
    code = (
        "import threading, feedpipe, torch\n"
        "from feedpipe import DeviceLoader, DeviceCache\n"
        "d = DeviceLoader([1, 2], device='cuda'); c = DeviceCache(1 << 20, device='cuda')\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        DeviceLoader([], device="cpu", depth=0)


# -- FeedLoader(device=) -------------------------------------------------------------------------
def ids(batches: list[dict[str, Any]]) -> list[int]:
    return [i for b in batches for i in b["__index__"].tolist()]


class CountingTransform:
    """Raw samples as they are, counted; ``reached`` is set once ``target`` were made."""

    def __init__(self, target: int) -> None:
        self.made, self.target = 0, target
        self.reached = threading.Event()

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.made += 1
        if self.made >= self.target:
            self.reached.set()
        return {"__index__": sample["__index__"]}


def test_feedloader_state_counts_consumed_batches_not_prefetched_ones() -> None:
    # the DeviceLoader's thread runs the in-process route ahead of the loop; the state is what
    # the loop received
    def make(transform: Any) -> FeedLoader:
        fl = FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=7, transform=transform),
                        batch_size=4, device="cpu", depth=3)
        fl.set_epoch(2)
        return fl

    plain = FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=7), batch_size=4)
    plain.set_epoch(2)
    uninterrupted = ids(list(plain))
    assert sorted(uninterrupted) == list(range(24))
    assert ids(list(make(CountingTransform(10**9)))) == uninterrupted

    k = 2
    counting = CountingTransform(target=(k + 2) * 4)
    first = make(counting)
    got = []
    for b in first:
        got.append(b)
        if len(got) == k:
            # the producer has made batches the loop has not received
            assert counting.reached.wait(JOIN)
            break
    assert counting.made >= (k + 2) * 4
    state = first.state_dict()
    assert state["position"] == k * 4
    assert first.stats()["device"]["steps"] == k

    second = make(CountingTransform(10**9))
    second.load_state_dict(state)
    rest = list(second)
    assert ids(got) + ids(rest) == uninterrupted
    assert not producers()


def test_feedloader_stats_report_the_device_only_with_one() -> None:
    assert "device" not in FeedLoader(FeedDataset(EXAMPLE), batch_size=4).stats()
    fl = FeedLoader(FeedDataset(EXAMPLE), batch_size=4, device="cpu")
    list(fl)
    assert fl.stats()["device"]["steps"] == 6


# -- clean shutdown ------------------------------------------------------------------------------
class Endless:
    """An endless source; records that the producer thread closed it."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[torch.Tensor]:
        i = 0
        try:
            while True:
                yield torch.full((4,), i)
                i += 1
        finally:
            self.closed.set()


def test_breaking_out_stops_the_producer_and_closes_the_source() -> None:
    before = set(threading.enumerate())  # threads other tests left may end meanwhile
    src = Endless()
    loader = DeviceLoader(src, device="cpu", depth=2)
    for i, b in enumerate(loader):
        assert b.tolist() == [i] * 4
        if i == 3:
            break
    # the loop's iterator was released at the break: its close() joined the producer
    assert not producers()
    assert not set(threading.enumerate()) - before
    assert src.closed.is_set()
    assert loader.stats()["steps"] == 4


def test_an_abandoned_iterator_is_cleaned_up_by_garbage_collection() -> None:
    before = set(threading.enumerate())  # threads other tests left may end meanwhile
    loader = DeviceLoader(Endless(), device="cpu", depth=2)
    it = iter(loader)
    next(it)
    assert len(producers()) == 1
    ref = weakref.ref(loader)
    del it, loader
    gc.collect()
    assert ref() is None
    assert not producers() and not set(threading.enumerate()) - before


def test_loader_is_freed_after_del_and_releases_its_batches() -> None:
    loader = DeviceLoader(Endless(), device="cpu")
    b = next(iter(loader))
    ref, bref = weakref.ref(loader), weakref.ref(b)
    del loader, b
    gc.collect()
    assert ref() is None and bref() is None


def test_context_manager_and_close_stop_a_pass_in_progress() -> None:
    with DeviceLoader(Endless(), device="cpu") as loader:
        it = iter(loader)
        next(it)
        assert len(producers()) == 1
    assert not producers()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


def test_a_new_pass_stops_the_previous_one() -> None:
    loader = DeviceLoader(Endless(), device="cpu")
    first = iter(loader)
    assert next(first).tolist() == [0] * 4
    second = iter(loader)
    assert next(second).tolist() == [0] * 4
    assert len(producers()) == 1
    with pytest.raises(RuntimeError, match="closed"):
        next(first)
    loader.close()
    assert not producers()


def failing_source(n: int, exc: BaseException) -> Iterator[torch.Tensor]:
    for i in range(n):
        yield torch.tensor([i])
    raise exc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exc", [ValueError("bad sample 3"),
                                 ShardFormatError("data-000001.tar: truncated at offset 512")])
def test_a_producer_exception_reaches_the_loop_with_its_traceback(device: str,
                                                                  exc: Exception) -> None:
    before = set(threading.enumerate())  # threads other tests left may end meanwhile
    loader = DeviceLoader(failing_source(3, exc), device=device)
    got = []
    with pytest.raises(type(exc)) as info:
        for b in loader:
            got.append(b.item())
    assert got == [0, 1, 2]
    assert info.value is exc and str(info.value) == str(exc)
    text = "".join(traceback.format_exception(info.value))
    assert "failing_source" in text and "_produce" in text  # the producer thread's frames
    assert not producers() and not set(threading.enumerate()) - before


def test_an_empty_source_ends_at_once() -> None:
    loader = DeviceLoader([], device="cpu")
    assert list(loader) == []
    s = loader.stats()
    assert s["steps"] == 0 and s["starvation"] == 0.0 and s["wait_s"] == 0.0


# -- stats ---------------------------------------------------------------------------------------
def check_stats(s: dict[str, Any], steps: int) -> None:
    assert s["steps"] == steps
    for k in ("wait_s", "first_wait_s", "max_wait_s", "mean_wait_s", "wall_s"):
        assert s[k] >= 0.0
    assert s["first_wait_s"] <= s["wait_s"] and s["max_wait_s"] <= s["wait_s"] <= s["wall_s"]
    assert 0.0 <= s["starvation"] <= 1.0 and 0.0 <= s["steady_starvation"] <= 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_stats_are_present_and_sane(device: str) -> None:
    loader = DeviceLoader([torch.rand(64, 64) for _ in range(10)], device=device, depth=2,
                          time_gpu=True)
    for b in loader:
        b.sum()  # a little work per step
    s = loader.stats()
    check_stats(s, 10)
    assert s["device"].startswith(device) and s["depth"] == 2
    assert (s["gpu_wait_s"] is None) == (device == "cpu")


def test_a_loop_that_must_wait_for_every_batch_reports_waiting() -> None:
    asked = threading.Event()

    def gated() -> Iterator[torch.Tensor]:
        for i in range(5):
            assert asked.wait(JOIN)  # produce only once the loop has asked for the batch
            asked.clear()
            yield torch.tensor([i])

    class Asking:
        def __iter__(self) -> Iterator[torch.Tensor]:
            return gated()

    loader = DeviceLoader(Asking(), device="cpu", depth=1)
    it = iter(loader)
    got = []
    for _ in range(5):
        asked.set()
        got.append(next(it).item())
    assert got == list(range(5))
    s = loader.stats()
    check_stats(s, 5)
    assert s["wait_s"] > 0.0
    it.close()
    assert not producers()


@CUDA
@pytest.mark.cuda
def test_cuda_hand_off_on_a_non_default_stream() -> None:
    src = [torch.full((256, 256), i, dtype=torch.float32) for i in range(8)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        loader = DeviceLoader(src, device="cuda", depth=2)
        sums = [b.sum() for b in loader]  # kernels queued on `stream`, after wait_event
    torch.cuda.synchronize()
    assert [int(s.item()) for s in sums] == [256 * 256 * i for i in range(8)]


def test_cuda_path_control_flow_with_mocked_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's Python control flow on any machine: CUDA streams and events are mocked and
    the ``meta`` device stands in for the GPU. Checks the hand-off protocol (one wait_event per
    batch, record_stream on every device tensor made, slot events waited on before reuse) and
    that the pinned ring is allocated once and reused; the CUDA semantics themselves are tested by
    the ``cuda`` parametrisations on a GPU machine."""
    import contextlib

    from feedpipe.device._stager import PinnedStager

    calls = Counter()

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            calls["event"] += 1

        def record(self, stream: Any = None) -> None:
            calls["record"] += 1

        def synchronize(self) -> None:
            calls["event_sync"] += 1

        def query(self) -> bool:
            return True

        def elapsed_time(self, other: Any) -> float:
            return 1.0

    class Stream:
        def __init__(self, device: Any = None) -> None:
            pass

        def wait_event(self, event: Any) -> None:
            calls["wait_event"] += 1

    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kw: Any) -> torch.Tensor:
        calls["pinned_alloc"] += bool(pin_memory)
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: calls.update(["record_stream"]), raising=False)
    monkeypatch.setattr(torch, "empty", empty)
    real_init = PinnedStager.__init__
    monkeypatch.setattr(PinnedStager, "__init__",
                        lambda self, device, depth: real_init(self, torch.device("meta"), depth))

    src = [(torch.rand(8, 16), {"y": torch.arange(8), "s": "x"}) for _ in range(20)]
    src.append((torch.rand(3, 16), {"y": torch.arange(3), "s": "x"}))
    loader = DeviceLoader(src, device="cuda", depth=3, time_gpu=True)
    loader._device = torch.device("cuda", 0)  # take the CUDA path; the stager stages to meta
    got = list(loader)
    assert [(tuple(b[0].shape), b[0].device.type, b[1]["s"]) for b in got] == \
        [(tuple(s[0].shape), "meta", "x") for s in src]
    s = loader.stats()
    assert s["steps"] == 21 and s["pinned_allocs"] == 6 == calls["pinned_alloc"]
    assert calls["wait_event"] == 21 and calls["record_stream"] == 42
    assert calls["event_sync"] == 21 - 3  # every slot reuse waited for the slot's last copy
    assert s["gpu_wait_s"] == pytest.approx(21e-3)
    loader.close()
    assert not producers()
