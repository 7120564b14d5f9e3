"""What the caches key a transform by (the L2 function index and the decoded store): its state at
each pass (a change after wrap() or after the store is filled is never served stale, in this
process and in workers), the code of every class it inherits from, a canonical form of sets (one
fingerprint whatever the hash seed), and no random transform frozen in silence (refused when a
known random part is held anywhere, or caught drawing on the first samples stored)."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import FeedDataset, FeedLoader, ImagePipeline, UncacheableTransformError
from feedpipe.caches._fingerprint import fingerprint
from feedpipe.caches.l2._index import FunctionIndex

N = 25  # samples of the ds_path fixture (conftest)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Scale:
    """The length of a sample's image bytes times ``k``: a transform with state."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, sample: Any) -> Any:
        data = sample["jpg"] if isinstance(sample, dict) else sample
        return np.int64(len(bytes(data)) * self.k)


def values(loader: FeedLoader) -> dict[str, int]:
    return {k: int(v) for b in loader for k, v in zip(b["key"], b["v"])}


def keyed(memo: Any) -> Any:
    return lambda s: {"key": s["__key__"], "v": memo(s)}


# -- state at each pass -------------------------------------------------------------------------

def test_a_memo_sees_the_state_changed_after_wrap(tmp_path: Path) -> None:
    scale = Scale(2)
    memo = FunctionIndex(str(tmp_path / "l2")).wrap(scale)
    assert memo(b"xyz") == 6
    scale.k = 3
    assert memo(b"xyz") == 9  # not the stale 6
    scale.k = 2
    assert memo(b"xyz") == 6 and memo.index.stats().misses == 2  # the first entry again


@pytest.mark.parametrize("workers", [0, 2])
def test_a_memo_in_a_loader_sees_the_state_changed_between_epochs(
        ds_path: str, tmp_path: Path, workers: int) -> None:
    scale = Scale(2)
    memo = FunctionIndex(str(tmp_path / "l2")).wrap(scale, fields=["jpg"])
    ds = FeedDataset(ds_path, shuffle=True, seed=1, transform=keyed(memo))
    loader = FeedLoader(ds, batch_size=5, num_workers=workers)
    first = values(loader)
    scale.k = 5
    loader.set_epoch(1)
    later = values(loader)
    assert len(first) == N and later == {k: v // 2 * 5 for k, v in first.items()}


@pytest.mark.parametrize("workers", [0, 2])
def test_the_decoded_store_follows_progressive_resizing(
        ds_path: str, tmp_path: Path, workers: int) -> None:
    pipe = ImagePipeline(8, train=False, mean=None)
    ds = FeedDataset(ds_path, shuffle=True, seed=1, transform=pipe,
                     decoded_cache=tmp_path / "dec")
    loader = FeedLoader(ds, batch_size=5, num_workers=workers)
    assert {tuple(images.shape[1:]) for images, _ in loader} == {(3, 8, 8)}
    assert ds.decoded.complete()
    pipe.spec = dataclasses.replace(pipe.spec, size=16)  # a larger size from this epoch on
    loader.set_epoch(1)
    got = sorted(bytes(x.numpy()) for images, _ in loader for x in images)
    assert {len(x) for x in got} == {3 * 16 * 16}  # not the stored 8 x 8 images
    plain = FeedDataset(ds_path, transform=ImagePipeline(16, train=False, mean=None))
    assert got == sorted(bytes(x.numpy()) for x, _ in plain)
    assert len(os.listdir(tmp_path / "dec")) == 2  # one store per state


class Offset:
    """ImagePipeline (uint8) plus ``offset`` on every pixel: a state change that keeps shapes."""

    def __init__(self) -> None:
        self.pipe, self.offset = ImagePipeline(8, train=False, mean=None), 0

    def __call__(self, sample: Any) -> Any:
        image, label = self.pipe(sample)
        return image + self.offset, label


def test_records_written_after_a_change_during_a_pass_are_not_served(
        ds_path: str, tmp_path: Path) -> None:
    """A change made in the loop body, mid-pass (in-process route): the rest of that pass is
    stored under the old state's name; those records are emptied at the pass's end."""
    t = Offset()
    ds = FeedDataset(ds_path, shuffle=True, seed=1, transform=t, decoded_cache=tmp_path / "dec")
    loader = FeedLoader(ds, batch_size=5)
    for n, _ in enumerate(loader):
        if n == 1:
            t.offset = 1  # during the pass
    t.offset = 0  # back to the first state: its store must not serve offset-1 images
    loader.set_epoch(1)
    got = sorted(bytes(x.numpy()) for images, _ in loader for x in images)
    plain = FeedDataset(ds_path, transform=ImagePipeline(8, train=False, mean=None))
    assert got == sorted(bytes(x.numpy()) for x, _ in plain)


# -- inherited code ------------------------------------------------------------------------------

BASE = """
class Base:
    def scale(self, b):
        return len(b) * {k}
"""
CHILD = """
from base import Base

class Child(Base):
    def __call__(self, b):
        return self.scale(b)
"""
PRINT = "from child import Child; from feedpipe.caches._fingerprint import fingerprint; " \
        "print(fingerprint(Child()).hex())"


def _run(code: str, cwd: Path, **env: str) -> str:
    path = os.pathsep.join([ROOT, str(cwd)])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=cwd, timeout=120,
                          env={**os.environ, "PYTHONPATH": path, **env}).stdout.strip()


def test_an_edit_to_an_inherited_method_changes_the_fingerprint_across_runs(
        tmp_path: Path) -> None:
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "base.py").write_text(BASE.format(k=2))
    before = _run(PRINT, tmp_path)
    (tmp_path / "base.py").write_text(BASE.format(k=3))  # the next run, after an edit
    assert _run(PRINT, tmp_path) != before


def test_inherited_code_without_source_is_in_the_fingerprint() -> None:
    def make(k: int) -> type:
        ns: dict[str, Any] = {}
        exec(BASE.format(k=k) + CHILD.replace("from base import Base", ""), ns)
        return ns["Child"]

    assert fingerprint(make(2)()) != fingerprint(make(3)())
    assert fingerprint(make(2)()) == fingerprint(make(2)())


# -- sets and the hash seed ----------------------------------------------------------------------

SETS = textwrap.dedent("""
    from types import SimpleNamespace
    from feedpipe.caches.decoded._store import DecodedStore
    from feedpipe.caches._fingerprint import fingerprint

    def is_pet(s):
        return s["cls"] in {"cat", "dog", "bird", "fish", "ant", "owl"}

    class Lookup:
        def __init__(self):
            names = ["cat", "dog", "bird", "fish", "ant", "owl"]
            self.ids = {frozenset(names[:i]): i for i in range(1, 6)}  # built at run time
            self.groups = {frozenset({"a", "b", "c"}), frozenset({"x", "y", "z"})}
        def __call__(self, s):
            return self.ids.get(frozenset(s), 0)

    manifest = SimpleNamespace(total_samples=1, shards=[
        SimpleNamespace(name="a.tar", samples=1, sha256="00", bytes=1)])
    print(fingerprint(is_pet).hex(), fingerprint(Lookup()).hex(),
          DecodedStore.for_transform("stores", Lookup(), manifest).path)
""")


def test_sets_give_one_fingerprint_and_one_store_whatever_the_hash_seed(tmp_path: Path) -> None:
    runs = {_run(SETS, tmp_path, PYTHONHASHSEED=str(seed)) for seed in range(1, 5)}
    assert len(runs) == 1, runs


# -- random transforms ---------------------------------------------------------------------------

TRAIN = ImagePipeline(8, train=True, mean=None)


def _global_train(sample: Any) -> Any:
    return TRAIN(sample)


class Holder:
    def __init__(self) -> None:
        self.steps = [ImagePipeline(8, train=False, mean=None), ImagePipeline(8, mean=None)]

    def __call__(self, sample: Any) -> Any:
        return self.steps[1](sample)


def _wrapped_trainers() -> list[Any]:
    pipe = ImagePipeline(8, train=True, mean=None)
    return [lambda s: pipe(s), _global_train, Holder(), functools.partial(lambda p, s: p(s), pipe),
            pipe]


def test_a_training_pipeline_anywhere_in_the_transform_is_refused(
        ds_path: str, tmp_path: Path) -> None:
    for t in _wrapped_trainers():
        with pytest.raises(UncacheableTransformError, match="ImagePipeline with train=True"):
            FeedDataset(ds_path, transform=t, decoded_cache=tmp_path / "dec")
        with pytest.raises(UncacheableTransformError, match="ImagePipeline with train=True"):
            FunctionIndex(str(tmp_path / "l2")).wrap(t)


def test_a_pipeline_switched_to_training_after_the_store_is_filled_is_refused(
        ds_path: str, tmp_path: Path) -> None:
    pipe = ImagePipeline(8, train=False, mean=None)
    ds = FeedDataset(ds_path, transform=pipe, decoded_cache=tmp_path / "dec")
    loader = FeedLoader(ds, batch_size=5)
    assert sum(1 for _ in loader) == 5
    pipe.spec = dataclasses.replace(pipe.spec, train=True)
    loader.set_epoch(1)
    with pytest.raises(UncacheableTransformError, match="train=True"):
        list(loader)


def _image(sample: Any) -> np.ndarray:
    return np.frombuffer(bytes(sample["jpg"])[:12], dtype=np.uint8).copy()


DRAWERS = {
    "random.random": lambda s: _image(s) + np.uint8(random.random() * 255),
    "np.random": lambda s: _image(s) + np.random.randint(0, 255, 12, dtype=np.uint8),
    "torch.rand": lambda s: torch.from_numpy(_image(s)) + (torch.rand(12) * 255).byte(),
    "the epoch": lambda s: _image(s) + np.uint8(s["__epoch__"] % 7),
    "rng_of": lambda s: np.roll(_image(s), int(np.random.default_rng(
        [s["__seed__"], s["__epoch__"], s["__index__"]]).integers(1, 12))),
}


@pytest.mark.parametrize("name", list(DRAWERS))
def test_a_transform_caught_drawing_is_refused_by_the_decoded_store(
        ds_path: str, tmp_path: Path, name: str) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=1, transform=DRAWERS[name],
                     decoded_cache=tmp_path / "dec")
    with pytest.raises(UncacheableTransformError, match="draws at random") as e:
        list(FeedLoader(ds, batch_size=5))
    assert "data-0000" in str(e.value)  # names the sample and its shard


@pytest.mark.parametrize("name", list(DRAWERS))
def test_a_transform_caught_drawing_is_refused_by_the_memo(
        ds_path: str, tmp_path: Path, name: str) -> None:
    memo = FunctionIndex(str(tmp_path / "l2")).wrap(DRAWERS[name], fields=["jpg"])
    ds = FeedDataset(ds_path, shuffle=True, seed=1, transform=memo)
    with pytest.raises(UncacheableTransformError, match="draws at random"):
        list(FeedLoader(ds, batch_size=5, collate_fn=list))


@pytest.mark.slow
def test_a_drawing_transform_is_refused_in_worker_processes(ds_path: str, tmp_path: Path) -> None:
    ds = FeedDataset(ds_path, shuffle=True, seed=1, transform=DRAWERS["np.random"],
                     decoded_cache=tmp_path / "dec")
    with pytest.raises(UncacheableTransformError, match="draws at random"):
        list(FeedLoader(ds, batch_size=5, num_workers=2))
