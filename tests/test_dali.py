"""The DALI stage: CPU mode (``device_id=None``) here, fed by FeedLoader's planned batches; and
what happens without DALI installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _images import H, W
from _images import cases as image_cases

from feedpipe import FeedDataset, FeedLoader
from feedpipe._helpers import fork_safety
from feedpipe.errors import DecodeError, MissingDependencyError, StartMethodError
from feedpipe.stream._dataset import sample_ids_of
from feedpipe.transforms._dali import DaliStage
from feedpipe.transforms._jpeg import jpeg_size
from feedpipe.transforms._pipeline import ImagePipeline, ImageSpec, rng_of


def _dali_importable() -> bool:
    # checked without importing at collection time; the `dali` fixture imports (or skips)
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:
        return False


@pytest.fixture
def dali(monkeypatch: pytest.MonkeyPatch) -> object:
    """DALI, imported (or the test skipped). A DaliStage that builds its pipeline marks the
    process unsafe to fork from; the mark is undone after the test so that the suite's later
    tests, which fork workers beside these tests' finished pipelines as before, are not refused
    (test_a_built_pipeline_refuses_forking_loaders_process_wide checks the mark itself)."""
    monkeypatch.setattr(fork_safety, "_marks", [])
    return pytest.importorskip("nvidia.dali", reason="nvidia.dali cannot be imported")


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shards",
                       "example")


def loader(batch_size: int = 5, workers: int = 0, epoch: int = 0, **ds_kw: object) -> FeedLoader:
    ds = FeedDataset(EXAMPLE, shuffle=True, seed=11, **ds_kw)  # type: ignore[arg-type]
    fl = FeedLoader(ds, batch_size=batch_size, num_workers=workers)
    fl.set_epoch(epoch)
    return fl


def labels_by_index() -> dict[int, int]:
    return {s["__index__"]: int(bytes(s["cls"])) for s in FeedDataset(EXAMPLE)}


# -- without DALI ----------------------------------------------------------------------------
def test_missing_dali_raises_with_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "nvidia.dali" or m.startswith("nvidia.dali.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali -> ImportError
    stage = DaliStage(loader(), device_id=None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'feedpipe\[dali\]'") as e:
        next(iter(stage))
    assert isinstance(e.value, ImportError)


def test_host_side_crops_are_the_cpu_pipelines_without_dali() -> None:
    """What the stage feeds DALI (crop windows, flips) is the CPU pipeline's geometry."""
    spec = ImageSpec(size=32)
    stage = DaliStage(loader(), spec=spec, device_id=None)
    batch = next(iter(loader()))
    jpegs, anchors, shapes, mirror, labels, index = stage.encode_batch(batch)
    assert len(jpegs) == 5 and index.tolist() == batch["__index__"].tolist()
    assert labels.tolist() == [int(c) for c in batch["cls"]]
    for i, idx in enumerate(index.tolist()):
        sample = {"__index__": idx, "__seed__": 11, "__epoch__": 0}
        assert np.array_equal(jpegs[i], np.frombuffer(batch["jpg"][i], np.uint8))
        box, flip = spec.geometry(*jpeg_size(batch["jpg"][i]), rng_of(sample))
        assert anchors[i].tolist() == [box.left, box.top]
        assert shapes[i].tolist() == [box.width, box.height]
        assert bool(mirror[i]) == flip


def test_bad_batches_are_decode_errors_naming_the_sample() -> None:
    stage = DaliStage([], batch_size=4, device_id=None)
    batch = {"jpg": [b"junk"], "cls": [b"1"], "__key__": ["cls_000/00007"],
             "__index__": torch.tensor([7])}
    with pytest.raises(DecodeError, match=r"'cls_000/00007' \(id 7\)"):
        stage.encode_batch(batch)
    with pytest.raises(DecodeError, match="no 'cls' field"):
        stage.encode_batch({"jpg": [b"junk"]})


def test_stage_needs_a_batch_size() -> None:
    with pytest.raises(TypeError, match="batch_size"):
        DaliStage([], device_id=None)
    with pytest.raises(ValueError):
        DaliStage([], batch_size=0, device_id=None)


# -- DALI on the CPU -------------------------------------------------------------------------
@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("mean", [(0.485, 0.456, 0.406), None])
def test_cpu_stage_shapes_labels_and_plan_order(dali: object, train: bool,
                                                mean: tuple | None) -> None:
    fl = loader(batch_size=5, epoch=2)
    stage = DaliStage(fl, spec=ImageSpec(size=40, train=train, mean=mean), device_id=None)
    batches = list(stage)
    assert [len(b.labels) for b in batches] == [5, 5, 5, 5, 4]
    for b in batches:
        assert b.images.shape[1:] == (3, 40, 40) and b.images.device.type == "cpu"
        assert b.images.dtype == (torch.float32 if mean else torch.uint8)
        assert b.labels.dtype == torch.int64 and b.indices.dtype == torch.int64
    order = torch.cat([b.indices for b in batches]).tolist()
    # the plan's order of the loader's epoch, every sample once
    assert order == sample_ids_of(fl.dataset, fl.epoch).tolist()
    truth = labels_by_index()
    assert torch.cat([b.labels for b in batches]).tolist() == [truth[i] for i in order]


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
@pytest.mark.parametrize("train", [True, False])
def test_cpu_stage_matches_the_cpu_pipeline(dali: object, train: bool) -> None:
    """Same spec, same per-sample seeds: DALI and the CPU ImagePipeline make the same images
    (to within resampling rounding)."""
    spec = ImageSpec(size=32, train=train)
    dali_images = torch.cat([b.images for b in DaliStage(loader(epoch=1), spec=spec,
                                                           device_id=None)])
    cpu = loader(epoch=1, transform=ImagePipeline.from_spec(spec))
    cpu_images = torch.cat([x for x, _ in cpu])
    diff = (dali_images - cpu_images).abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.2  # ~1 and ~10 grey levels


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
def test_epochs_reset_and_early_exit(dali: object) -> None:
    fl = loader(batch_size=6)
    stage = DaliStage(fl, spec=ImageSpec(size=16), device_id=None)
    orders, images = [], []
    for epoch in (0, 1, 0):
        stage.set_epoch(epoch)
        bs = list(stage)
        orders.append(torch.cat([b.indices for b in bs]).tolist())
        images.append(torch.cat([b.images for b in bs]))
        assert sorted(orders[-1]) == list(range(24))
    assert orders[0] != orders[1] and orders[0] == orders[2]
    assert torch.equal(images[0], images[2]) and not torch.equal(images[0], images[1])
    # leave a pass early (DALI holds prefetched batches): the next pass starts clean
    stage.set_epoch(1)
    for _b in stage:
        break
    stage.set_epoch(1)
    assert torch.cat([b.indices for b in stage]).tolist() == orders[1]


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
def test_resume_counts_what_the_stage_handed_out_not_what_dali_prefetched(dali: object) -> None:
    stage = DaliStage(loader(batch_size=4, epoch=3), spec=ImageSpec(size=16), device_id=None,
                      prefetch=3)
    seen = []
    for k, b in enumerate(stage):
        seen += b.indices.tolist()
        if k == 1:
            state = stage.state_dict()
            break
    assert state["position"] == 8 and state["epoch"] == 3
    again = DaliStage(loader(batch_size=4), spec=ImageSpec(size=16), device_id=None)
    again.load_state_dict(state)
    rest = [i for b in again for i in b.indices.tolist()]
    assert len(seen) == 8 and sorted(seen + rest) == list(range(24))
    full = loader(batch_size=4, epoch=3)
    assert seen + rest == sample_ids_of(full.dataset, full.epoch).tolist()


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
def test_fed_by_feedloader_workers_and_by_plain_pairs(dali: object) -> None:
    # worker processes beside DALI's threads start from a forkserver, as the loader is told
    workers = FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=11, max_open_shards=1),
                         batch_size=5, num_workers=2, route="refs-workers",
                         multiprocessing_context="forkserver")
    stage = DaliStage(workers, spec=ImageSpec(size=16, train=False), device_id=None)
    order = torch.cat([b.indices for b in stage]).tolist()
    assert order == sample_ids_of(loader().dataset).tolist()
    assert workers.stats()["start_method"] == "forkserver"
    assert len(workers.stats()["worker_pids"]) == 2
    # forked beside DALI's threads, a worker can inherit a lock one of them held and die: a
    # loader that would fork is refused once a stage feeds from it, naming the fix
    forking = FeedLoader(FeedDataset(EXAMPLE, max_open_shards=1), batch_size=5, num_workers=2,
                         route="refs-workers")
    forked = DaliStage(forking, spec=ImageSpec(size=16, train=False), device_id=None)
    with pytest.raises(StartMethodError, match="multiprocessing_context='forkserver'"):
        next(iter(forked))
    samples = list(FeedDataset(EXAMPLE))
    pairs = [([bytes(s["jpg"]) for s in samples[i:i + 8]],
              [bytes(s["cls"]) for s in samples[i:i + 8]]) for i in range(0, 24, 8)]
    out = list(DaliStage(pairs, batch_size=8, spec=ImageSpec(size=16, mean=None), device_id=None))
    assert [b.images.shape for b in out] == [(8, 3, 16, 16)] * 3
    assert all((b.indices == -1).all() for b in out)
    assert torch.cat([b.labels for b in out]).tolist() == [int(bytes(s["cls"])) for s in samples]


PROCESS_WIDE = """
import gc
import sys

from feedpipe import FeedDataset, FeedLoader, StartMethodError
from feedpipe.transforms._dali import DaliStage
from feedpipe.transforms._pipeline import ImageSpec

if __name__ == "__main__":
    example = sys.argv[1]
    other = FeedLoader(FeedDataset(example), batch_size=4, num_workers=2,
                       route="samples-workers")
    assert len(list(other)) == 6  # before DALI runs: forked
    samples = list(FeedDataset(example))
    pairs = [([bytes(s["jpg"]) for s in samples[:8]], [bytes(s["cls"]) for s in samples[:8]])]
    stage = DaliStage(pairs, batch_size=8, spec=ImageSpec(size=16), device_id=None)
    list(stage)
    try:
        next(iter(other))
    except StartMethodError as e:
        print("refused:", e)
    told = FeedLoader(FeedDataset(example), batch_size=4, num_workers=2,
                      route="samples-workers", multiprocessing_context="forkserver")
    print("told:", len(list(told)), told.stats()["start_method"])
    del stage  # its pipeline shuts DALI's threads down: forking is safe again
    gc.collect()
    print("after:", len(list(other)), other.stats()["start_method"])
"""


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
def test_a_built_pipeline_refuses_forking_loaders_process_wide(dali: object,
                                                               tmp_path: Path) -> None:
    """While DALI's threads run in a process, any loader of it that would fork workers is
    refused, not only the one feeding the stage; one told to use a forkserver still runs; once
    the stage is gone, forking is allowed again. In a fresh interpreter: this one has run DALI
    already."""
    script = tmp_path / "process_wide.py"
    script.write_text(PROCESS_WIDE)
    run = subprocess.run([sys.executable, str(script), EXAMPLE], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("refused:") and "DaliStage runs in this process" in line
               and "forkserver" in line for line in lines), run.stdout
    assert "told: 6 forkserver" in lines and "after: 6 fork" in lines, run.stdout


# -- formats: what DALI's decoder reads, and what it does not ----------------------------------
AVIF_HEADER = b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf" + bytes(32)
HEIC_HEADER = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(32)


def test_host_side_takes_each_samples_first_image_field() -> None:
    """A FeedLoader batch of a mixed dataset has a column per extension, None where a sample
    lacks it: each sample's image is its first field of the stage's list."""
    c = image_cases()
    jpg, png, webp = c["jpeg-rgb"].data, c["png-rgba"].data, c["webp-lossy"].data
    batch = {"jpg": [jpg, None, None], "png": [None, png, None], "webp": [None, None, webp],
             "cls": [b"0", b"1", b"2"], "__index__": torch.tensor([4, 5, 6])}
    stage = DaliStage([], batch_size=3, spec=ImageSpec(size=16, train=False), device_id=None)
    data, anchors, shapes, _, labels, _ = stage.encode_batch(batch)
    assert [bytes(d) for d in data] == [jpg, png, webp] and labels.tolist() == [0, 1, 2]
    side = round(min(H, W) * 0.875)  # the centre crop, from each image's own header
    assert shapes.tolist() == [[side, side]] * 3
    assert anchors.tolist() == [[(W - side) // 2, (H - side) // 2]] * 3
    only_png = DaliStage([], batch_size=3, device_id=None, image_field="png")
    with pytest.raises(DecodeError, match=r"sample None in a batch fed to the DALI stage has "
                                          r"none of the image fields \['png'\]"):
        only_png.encode_batch(batch)
    with pytest.raises(DecodeError, match="none of the image fields"):
        stage.encode_batch({"txt": [b"a"], "cls": [b"1"]})


@pytest.mark.parametrize("data,what", [(AVIF_HEADER, "this AVIF image"),
                                       (HEIC_HEADER, "this HEIC image"),
                                       (b"GIF89a" + bytes(40), r"this data \(it starts with")])
def test_formats_dali_cannot_read_are_refused_with_a_sentence(data: bytes, what: str) -> None:
    stage = DaliStage([], batch_size=2, device_id=None)
    batch = {"jpg": [image_cases()["jpeg-rgb"].data, None], "avif": [None, data],
             "cls": [b"1", b"2"], "__key__": ["a/ok", "a/odd"], "__index__": torch.tensor([3, 8])}
    with pytest.raises(DecodeError, match=rf"sample 'a/odd' \(id 8\) .*DALI's image decoder "
                                          rf"reads JPEG, PNG and WebP, not {what}.*decode such "
                                          rf"images on the CPU with feedpipe.ImagePipeline"):
        stage.encode_batch(batch)


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
@pytest.mark.parametrize("train", [True, False])
def test_cpu_stage_decodes_every_jpeg_png_and_webp_mode_like_the_cpu_pipeline(
        dali: object, train: bool) -> None:
    """Grey, CMYK and YCCK JPEGs; RGB, RGBA, grey, palette and 16-bit PNGs; lossy and lossless
    WebP with and without alpha, in one batch: three channels, alpha dropped, EXIF ignored, and
    the CPU pipeline's pixels to within resampling and 16-bit rounding."""
    c = image_cases()
    names = [n for n in c if n.split("-")[0] in ("jpeg", "png", "webp")]
    assert len(names) >= 15
    spec = ImageSpec(size=24, train=train, mean=None)
    batch = {"img": [c[n].data for n in names], "cls": [b"1"] * len(names),
             "__index__": torch.arange(len(names)), "__epoch__": torch.full((len(names),), 3)}
    out = list(DaliStage([batch], batch_size=len(names), spec=spec, device_id=None,
                         image_field="img"))
    assert len(out) == 1 and out[0].images.shape == (len(names), 3, 24, 24)
    pipe = ImagePipeline.from_spec(spec, image_field="img", label_field=None)
    for i, name in enumerate(names):
        cpu = pipe({"img": c[name].data, "__index__": i, "__epoch__": 3})
        diff = (out[0].images[i].int() - cpu.int()).abs()
        assert float(diff.float().mean()) < 1.5 and int(diff.max()) <= 16, name


# -- DALI on the GPU (runs where CUDA and DALI exist, skips elsewhere) ------------------------
@pytest.mark.dali
@pytest.mark.cuda
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("train", [True, False])
def test_gpu_stage_decodes_on_the_device_and_matches_the_cpu_pipeline(dali: object,
                                                                      train: bool) -> None:
    """nvJPEG ("mixed") decoding: the images come out as CUDA tensors, in the plan's order,
    and equal the CPU ImagePipeline's to within decoder and resampling rounding."""
    spec = ImageSpec(size=32, train=train)
    fl = loader(epoch=1)
    batches = list(DaliStage(fl, spec=spec, device_id=0))
    assert all(b.images.device.type == "cuda" for b in batches)
    order = torch.cat([b.indices for b in batches]).tolist()
    assert order == sample_ids_of(fl.dataset, fl.epoch).tolist()
    gpu_images = torch.cat([b.images for b in batches]).cpu()
    cpu = loader(epoch=1, transform=ImagePipeline.from_spec(spec))
    cpu_images = torch.cat([x for x, _ in cpu])
    diff = (gpu_images - cpu_images).abs()
    # nvJPEG's IDCT differs from libjpeg-turbo's by a grey level or two on top of resampling
    assert float(diff.mean()) < 0.03 and float(diff.max()) < 0.3


@pytest.mark.dali
@pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_finalises_an_inherited_pipeline(dali: object) -> None:
    """Any process forked after a pipeline exists (a process pool's worker, not only a
    DataLoader's) must not run its Shutdown: the child has none of DALI's threads. Seen in CI:
    a worker of feedpipe.shard's listing pool segfaulted in Pipeline.__del__ during a GC."""
    import gc

    stage = DaliStage(loader(batch_size=6), spec=ImageSpec(size=16), device_id=None)
    assert sum(b.images.shape[0] for b in stage) == 24  # a whole pass: the pipeline stays
    assert stage._pipe is not None  # built, its threads running
    pid = os.fork()
    if pid == 0:  # the child drops every reference it has, then collects
        try:
            stage._pipe = None
            gc.collect()
        finally:
            os._exit(0)
    import signal
    import threading

    # a child finalising the pipeline crashes or hangs in Shutdown: wait for it in a thread,
    # blocked in waitpid, and kill it if it has not ended when the join gives up
    exited: list[int] = []
    waiter = threading.Thread(target=lambda: exited.append(os.waitpid(pid, 0)[1]))
    waiter.start()
    waiter.join(timeout=60)
    if waiter.is_alive():
        os.kill(pid, signal.SIGKILL)
        waiter.join()
        pytest.fail("the forked child hung finalising the inherited DALI pipeline")
    status = exited[0]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    stage._pipe = None  # the parent can still finalise its own
    gc.collect()
