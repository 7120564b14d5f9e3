"""The CPU image pipeline: decoding, ops, determinism of the per-sample augmentation, pickling
into DataLoader workers, and BatchCollator's buffer ring."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import simplejpeg
import torch

from feedpipe import FeedDataset, FeedLoader
from feedpipe.convert._synth import _image
from feedpipe.errors import DecodeError
from feedpipe.stream._collator import BatchCollator
from feedpipe.transforms._pipeline import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Compose,
    DecodeJPEG,
    ImagePipeline,
    ImageSpec,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
    rng_of,
    sample_rng,
)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shards",
                       "example")


def jpeg(h: int, w: int, seed: int = 0, quality: int = 85) -> bytes:
    return simplejpeg.encode_jpeg(_image(np.random.default_rng(seed), h, w, seed % 7),
                                  quality=quality, colorspace="RGB")


@pytest.fixture(scope="module")
def example_samples() -> list[dict]:
    return [{k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in s.items()}
            for s in FeedDataset(EXAMPLE)]


@pytest.fixture(scope="module")
def big() -> bytes:
    return jpeg(600, 500, seed=2)


# -- decoding -----------------------------------------------------------------------------
def test_decode_equals_simplejpeg(example_samples: list[dict]) -> None:
    dec = DecodeJPEG()
    for s in example_samples:
        ref = simplejpeg.decode_jpeg(s["jpg"], colorspace="RGB")
        out = dec(memoryview(s["jpg"]))
        assert out.dtype == np.uint8 and out.shape == ref.shape
        assert np.array_equal(out, ref)


@pytest.mark.parametrize("min_size", [1, 40, 75, 76, 150, 151, 300, 499, 500, 800])
def test_reduced_decode_keeps_at_least_the_requested_size(big: bytes, min_size: int) -> None:
    out = DecodeJPEG(min_size=min_size)(big)
    assert min(out.shape[:2]) >= min(min_size, 500)
    if min_size <= 250:  # a factor of 2 or more is possible: it is taken
        assert out.shape[0] <= 300 and out.shape[1] <= 250
    h, w = out.shape[:2]
    assert abs(h / w - 600 / 500) < 0.05


@pytest.mark.parametrize("hw", [(100, 100), (160, 60), (300, 250), (600, 500)])
def test_reduced_decode_by_height_and_width(big: bytes, hw: tuple[int, int]) -> None:
    out = DecodeJPEG(min_size=hw)(big)
    assert out.shape[0] >= hw[0] and out.shape[1] >= hw[1]
    full = DecodeJPEG()(big)
    assert out.shape[0] <= full.shape[0]


def test_reduced_decode_is_close_to_full_decode_then_resize(big: bytes) -> None:
    small = DecodeJPEG(min_size=125)(big)
    assert small.shape[:2] == (150, 125)
    ref = Resize((150, 125))(DecodeJPEG()(big))
    assert np.abs(small.astype(int) - ref.astype(int)).mean() < 4


def test_corrupt_jpeg_is_a_decode_error_naming_the_sample() -> None:
    with pytest.raises(DecodeError, match="not a decodable JPEG"):
        DecodeJPEG()(b"\xff\xd8 definitely not a jpeg")
    pipe = ImagePipeline(32)
    sample = {"__key__": "k/1", "__shard__": "s.tar", "__index__": 3, "jpg": b"junk", "cls": b"1"}
    with pytest.raises(ValueError, match="'k/1' of 's.tar'"):
        pipe(sample)
    with pytest.raises(DecodeError, match="no 'png' field"):
        ImagePipeline(32, image_field="png")(sample)


def test_bad_label_is_a_decode_error(big: bytes) -> None:
    with pytest.raises(DecodeError, match="'x'"):
        ImagePipeline(32)({"__key__": "x", "__index__": 0, "jpg": big, "cls": b"cat"})


# -- ops: shapes, dtypes, values -----------------------------------------------------------
def test_op_shapes_and_dtypes(big: bytes) -> None:
    img = DecodeJPEG()(big)
    rng = np.random.default_rng(0)
    assert img.shape == (600, 500, 3)
    assert RandomResizedCrop(64)(img, rng).shape == (64, 64, 3)
    assert RandomResizedCrop((32, 48))(img, rng).shape == (32, 48, 3)
    assert Resize(100)(img).shape == (120, 100, 3)
    assert Resize((50, 70))(img).shape == (50, 70, 3)
    assert CenterCrop(80)(img).shape == (80, 80, 3)
    assert CenterCrop(1000)(img).shape == (600, 500, 3)
    assert RandomHorizontalFlip(1.0)(img, rng).shape == img.shape
    t = ToTensor()(img)
    assert t.shape == (3, 600, 500) and t.dtype == torch.uint8 and t.is_contiguous()
    f = ToTensor(torch.float32)(img)
    assert f.dtype == torch.float32 and float(f.max()) <= 1.0
    assert torch.allclose(f * 255, t.float())


def test_flip_mirrors_and_center_crop_is_centred() -> None:
    img = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    rng = np.random.default_rng(0)
    assert np.array_equal(RandomHorizontalFlip(1.0)(img, rng), img[:, ::-1])
    assert RandomHorizontalFlip(0.0)(img, rng) is img
    assert np.array_equal(CenterCrop(2)(img), img[1:3, 2:4])


def test_resize_identity_and_constant_images() -> None:
    img = np.full((30, 40, 3), 77, dtype=np.uint8)
    assert Resize((30, 40))(img) is img
    for size in [(7, 9), (60, 80), (30, 10)]:
        out = Resize(size)(img)
        assert out.shape == (*size, 3) and (out == 77).all()


@pytest.mark.parametrize("view", ["packed", "channels-reversed", "one-channel", "four-channel"])
@pytest.mark.parametrize("flip", [False, True])
def test_opencv_enlargement_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch, view: str,
                                                   flip: bool) -> None:
    """Enlargements go through OpenCV; the torch path (taken without OpenCV, and for every
    reduction) gives the same image within one grey level, in the same CHW layout."""
    from feedpipe.transforms import _opencv
    from feedpipe.transforms import _resize as image_ops

    if _opencv.opencv() is None:
        pytest.skip("opencv-python-headless is not installed")
    base = simplejpeg.decode_jpeg(jpeg(90, 70, seed=3), colorspace="RGB")[5:80, 3:60]
    img = {"packed": base, "channels-reversed": base[:, :, ::-1], "one-channel": base[:, :, :1],
           "four-channel": np.concatenate([base, base[:, :, :1]], axis=2)}[view]
    fast = image_ops.resize_to_tensor(img, (224, 200), flip=flip)
    hwc = image_ops.resize_hwc(img, (224, 200))
    monkeypatch.setattr(_opencv, "_CV2", False)  # as if cv2 did not import
    slow = image_ops.resize_to_tensor(img, (224, 200), flip=flip)
    assert fast.shape == slow.shape == (img.shape[2], 224, 200) and fast.is_contiguous()
    assert (fast.int() - slow.int()).abs().max() <= 1
    assert (torch.from_numpy(hwc).permute(2, 0, 1).int() - (slow.flip(2) if flip else slow).int()
            ).abs().max() <= 1
    # a reduction stays on the antialiased torch path, with or without OpenCV
    monkeypatch.setattr(_opencv, "_CV2", None)
    assert torch.equal(image_ops.resize_to_tensor(img, (40, 30)).contiguous(),
                       _torch_resize(img, (40, 30)))


@pytest.mark.parametrize("view", ["window", "packed", "channels-reversed", "one-channel",
                                  "four-channel"])
@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("size", [(40, 30), (100, 40), (75, 57)])
def test_reduction_into_a_batch_row_is_the_torch_paths_image(monkeypatch: pytest.MonkeyPatch,
                                                             view: str, flip: bool,
                                                             size: tuple[int, int]) -> None:
    """A reduction (or a mixed one: one side down, the other up, or no resize at all) written
    into a batch row (``out=``, as ImagePipeline.into does) has exactly the pixels of the
    antialiased torch resize of the flipped crop, with OpenCV doing the flip and the CHW
    write, and without OpenCV."""
    from feedpipe.transforms import _opencv
    from feedpipe.transforms import _resize as image_ops

    whole = simplejpeg.decode_jpeg(jpeg(90, 70, seed=4), colorspace="RGB")
    base = whole[5:80, 3:60]  # a window: rows longer than the crop, as decode_window gives
    img = {"window": base, "packed": np.ascontiguousarray(base),
           "channels-reversed": base[:, :, ::-1], "one-channel": base[:, :, :1],
           "four-channel": np.concatenate([base, base[:, :, :1]], axis=2)}[view]
    want = _torch_resize(img[:, ::-1] if flip else img, size)
    for cv2_state in (None, False):  # with OpenCV (where installed), then as if it were not
        monkeypatch.setattr(_opencv, "_CV2", cv2_state)
        batch = torch.zeros((3, img.shape[2], *size), dtype=torch.uint8)
        got = image_ops.resize_to_tensor(img, size, flip=flip, out=batch[1])
        assert got is batch[1] or got.data_ptr() == batch[1].data_ptr()
        assert torch.equal(batch[1], want), cv2_state
        assert not batch[0].any() and not batch[2].any()  # nothing written beside the row


def test_resized_images_do_not_share_the_resize_scratch_buffers() -> None:
    """Enlargements pass through per-thread scratch arrays on their way to CHW: every result
    (a new tensor or the caller's row) keeps its pixels after later resizes, in this thread
    and in others."""
    import threading

    from feedpipe.transforms import _resize as image_ops

    imgs = [simplejpeg.decode_jpeg(jpeg(90, 70, seed=s), colorspace="RGB")[5:80, 3:60]
            for s in (5, 6, 7)]
    want = [_torch_resize(np.ascontiguousarray(im[:, ::-1]), (120, 100)) for im in imgs]
    rows = torch.zeros((3, 3, 120, 100), dtype=torch.uint8)
    kept = [image_ops.resize_to_tensor(imgs[0], (120, 100), flip=True),
            image_ops.resize_to_tensor(imgs[1], (120, 100), flip=True, out=rows[1])]
    other = threading.Thread(target=image_ops.resize_to_tensor, args=(imgs[2], (120, 100)),
                             kwargs={"flip": True, "out": rows[2]})
    other.start()
    other.join()
    kept.append(image_ops.resize_to_tensor(imgs[2], (120, 100), flip=True))
    for got, ref in zip(kept, want):
        assert (got.int() - ref.int()).abs().max() <= 1  # OpenCV's bilinear: within one level
    assert torch.equal(rows[2], kept[2]) and torch.equal(rows[1], kept[1])
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])


def _torch_resize(img: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(img)).unsqueeze(0).permute(0, 3, 1, 2)
    return torch.nn.functional.interpolate(x, size=size, mode="bilinear", antialias=True,
                                           align_corners=False)[0].contiguous()


def test_normalize_values() -> None:
    img = np.empty((2, 3, 3), dtype=np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 0, 128, 255
    out = Normalize()(ToTensor()(img))
    assert out.dtype == torch.float32 and out.shape == (3, 2, 3)
    for c, v in enumerate((0, 128, 255)):
        expect = (v / 255 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
        assert torch.allclose(out[c], torch.full((2, 3), expect), atol=1e-5)
    as_float = Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))(ToTensor(torch.float32)(img))
    assert torch.allclose(as_float[2], torch.full((2, 3), 2.0), atol=1e-5)
    assert torch.allclose(as_float[0], torch.full((2, 3), -2.0), atol=1e-5)


def test_bad_arguments_are_value_errors() -> None:
    for make in (lambda: RandomResizedCrop(0), lambda: RandomResizedCrop(8, scale=(0.5, 0.2)),
                 lambda: RandomResizedCrop(8, ratio=(0, 1)), lambda: RandomHorizontalFlip(2),
                 lambda: Normalize((0.5,), (0.0,)), lambda: ImageSpec(crop_fraction=0),
                 lambda: ImageSpec(std=None), lambda: CenterCrop((1, 2, 3))):
        with pytest.raises(ValueError):
            make()


def test_random_ops_refuse_to_run_without_a_generator() -> None:
    img = np.zeros((8, 8, 3), np.uint8)
    for op in (RandomResizedCrop(4), RandomHorizontalFlip()):
        with pytest.raises(TypeError, match="sample_rng"):
            op(img)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("mean", [IMAGENET_MEAN, None])
def test_image_pipeline_output(example_samples: list[dict], big: bytes, train: bool,
                               mean: tuple | None) -> None:
    pipe = ImagePipeline(48, train=train, mean=mean)
    for s in [*example_samples[:5], {**example_samples[0], "jpg": big}]:
        x, y = pipe(s)
        assert x.shape == (3, 48, 48) and x.is_contiguous()
        assert x.dtype == (torch.uint8 if mean is None else torch.float32)
        assert y == int(s["cls"])
    assert ImagePipeline(16, label_field=None)(example_samples[0]).shape == (3, 16, 16)


def test_pipeline_has_the_geometry_of_the_composed_ops(example_samples: list[dict]) -> None:
    """Images smaller than the output are never decoded at reduced scale: the fused pipeline
    then equals the composition of the single ops drawing from the same generator."""
    fused = ImagePipeline(64, mean=None, label_field=None)
    ops = Compose([DecodeJPEG(), RandomResizedCrop(64), RandomHorizontalFlip(), ToTensor()])
    for s in example_samples:
        a, b = fused(s), ops(s["jpg"], rng_of(s))
        assert (a.int() - b.int()).abs().max() <= 1


def test_reduced_decode_in_the_pipeline_stays_close(big: bytes) -> None:
    fused = ImagePipeline(64, mean=None, label_field=None)
    ops = Compose([DecodeJPEG(), RandomResizedCrop(64), RandomHorizontalFlip(), ToTensor()])
    diffs = [float((fused({"jpg": big, "__index__": i}).int()
                    - ops(big, sample_rng(0, 0, i)).int()).abs().float().mean())
             for i in range(20)]
    assert max(diffs) < 4


def test_eval_pipeline_is_resize_then_center_crop(big: bytes) -> None:
    ev = ImagePipeline(64, train=False, mean=None, label_field=None)
    ref = Compose([DecodeJPEG(), Resize(round(64 / 0.875)), CenterCrop(64), ToTensor()])(big)
    out = ev({"jpg": big})
    assert (out.int() - ref.int()).abs().float().mean() < 4
    assert torch.equal(out, ev({"jpg": big, "__index__": 5, "__epoch__": 3}))  # no randomness


# -- determinism ---------------------------------------------------------------------------
def test_sample_rng_is_a_function_of_seed_epoch_index() -> None:
    draw = lambda *a: sample_rng(*a).random(4).tolist()  # noqa: E731
    assert draw(1, 2, 3) == draw(1, 2, 3)
    seen = {tuple(draw(s, e, i)) for s in range(3) for e in range(3) for i in range(3)}
    assert len(seen) == 27
    # no seed + epoch aliasing, no digit-concatenation aliasing
    assert draw(1, 0, 5) != draw(0, 1, 5)
    assert draw(1, 12, 0) != draw(11, 2, 0)
    assert draw(-1, 0, 0) != draw(1, 0, 0)


def test_scratch_rng_draws_what_sample_rng_draws_on_every_thread() -> None:
    import threading

    from feedpipe.transforms._pipeline import scratch_rng

    want = {i: sample_rng(7, 1, i).random(6).tolist() for i in range(50)}
    assert [scratch_rng(7, 1, i).random(6).tolist() for i in range(50)] == list(want.values())
    # a partly used scratch generator is fully re-seeded by the next call
    scratch_rng(7, 1, 3).random(3)
    assert scratch_rng(7, 1, 3).random(6).tolist() == want[3]
    # threads interleaving draws each have their own
    got: dict[int, list[float]] = {}
    barrier = threading.Barrier(2)

    def draw(ids: range) -> None:
        for i in ids:
            rng = scratch_rng(7, 1, i)
            first = rng.random(3).tolist()
            barrier.wait()  # the other thread re-seeds its generator in between
            got[i] = first + rng.random(3).tolist()

    ts = [threading.Thread(target=draw, args=(range(k, 50, 2),)) for k in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == want


def test_same_sample_same_epoch_same_tensor(big: bytes) -> None:
    pipe = ImagePipeline(64)
    s = {"jpg": big, "cls": b"2", "__index__": 17, "__epoch__": 4, "__seed__": 9}
    a, b = pipe(s), pickle.loads(pickle.dumps(pipe))(dict(s))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] == 2


@pytest.mark.parametrize("change", [{"__index__": 18}, {"__epoch__": 5}, {"__seed__": 10}])
def test_other_index_epoch_or_seed_other_crop(big: bytes, change: dict) -> None:
    pipe = ImagePipeline(64, label_field=None)
    s = {"jpg": big, "__index__": 17, "__epoch__": 4, "__seed__": 9}
    boxes = [pipe.spec.geometry(600, 500, rng_of(x)) for x in (s, {**s, **change})]
    assert boxes[0] != boxes[1]
    assert not torch.equal(pipe(s), pipe({**s, **change}))


def test_flip_draw_does_not_depend_on_p() -> None:
    """Each op draws the same count whatever its probability, so ops after it are unaffected."""
    rr = RandomResizedCrop(8)
    after = []
    for p in (0.0, 0.5, 1.0):
        rng = sample_rng(0, 0, 1)
        RandomHorizontalFlip(p)(np.zeros((4, 4, 3), np.uint8), rng)
        after.append(rr.box(100, 100, rng))
    assert after[0] == after[1] == after[2]


def test_augmentation_is_the_same_in_any_worker() -> None:
    """The same plan through 0 or 2 worker processes gives identical tensors, epoch by epoch."""
    out = {}
    for workers in (0, 2):
        ds = FeedDataset(EXAMPLE, shuffle=True, seed=5, transform=ImagePipeline(24))
        loader = FeedLoader(ds, batch_size=4, num_workers=workers)
        loader.set_epoch(1)
        out[workers] = [(x.clone(), y.clone()) for x, y in loader]
    assert len(out[0]) == 6
    for (x0, y0), (x2, y2) in zip(out[0], out[2]):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


def test_dataset_epochs_give_different_augmentations() -> None:
    """FeedDataset puts ``__seed__``/``__epoch__`` in every sample, so a sample's crop changes
    with the epoch and the seed, and not with the reading order."""
    def by_index(seed: int, epoch: int, shuffle: bool) -> dict[int, torch.Tensor]:
        ds = FeedDataset(EXAMPLE, shuffle=shuffle, seed=seed,
                         transform=_WithIndex(ImagePipeline(24, label_field=None)))
        ds.set_epoch(epoch)
        return dict(ds)

    e0, e0_again, e1 = by_index(3, 0, True), by_index(3, 0, False), by_index(3, 1, True)
    assert all(torch.equal(e0[i], e0_again[i]) for i in e0)  # order does not matter
    assert sum(not torch.equal(e0[i], e1[i]) for i in e0) >= 20
    other_seed = by_index(4, 0, True)
    assert sum(not torch.equal(e0[i], other_seed[i]) for i in e0) >= 20


class _WithIndex:
    def __init__(self, inner: ImagePipeline) -> None:
        self.inner = inner

    def __call__(self, sample: dict) -> tuple[int, torch.Tensor]:
        return sample["__index__"], self.inner(sample)


# -- pickling ------------------------------------------------------------------------------
def test_every_op_pickles(big: bytes) -> None:
    ops = [DecodeJPEG(min_size=100, fastdct=True), RandomResizedCrop(32, (0.2, 0.9)),
           RandomHorizontalFlip(0.3), Resize(40), CenterCrop(32), ToTensor(torch.float32),
           Normalize((0.1, 0.2, 0.3), (0.4, 0.5, 0.6)), ImagePipeline(32, train=False),
           BatchCollator(4, (3, 8, 8))]
    compose = Compose(ops[:7])
    again = pickle.loads(pickle.dumps(compose))
    assert repr(again) == repr(compose)
    rng_a, rng_b = sample_rng(1, 2, 3), sample_rng(1, 2, 3)
    assert torch.equal(compose(big, rng_a), again(big, rng_b))
    for op in ops[7:]:
        assert repr(pickle.loads(pickle.dumps(op))) == repr(op) or type(op) is BatchCollator


def test_pipeline_in_feedloader_workers_matches_main_process(example_samples: list[dict]) -> None:
    pipe = ImagePipeline(32, train=False)
    loader = FeedLoader(FeedDataset(EXAMPLE, transform=pipe), batch_size=5, num_workers=2)
    xs, ys = zip(*loader)
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.shape == (24, 3, 32, 32) and x.dtype == torch.float32
    assert y.tolist() == [int(s["cls"]) for s in example_samples]
    assert all(torch.equal(x[i], pipe(s)[0]) for i, s in enumerate(example_samples))


# -- BatchCollator ---------------------------------------------------------------------------
def _samples(n: int, value: int, shape: tuple = (3, 4, 4)) -> list:
    return [(torch.full(shape, value + j, dtype=torch.uint8), value + j) for j in range(n)]


def test_collator_fills_and_reuses_the_ring() -> None:
    c = BatchCollator(3, (3, 4, 4), depth=2)
    for k in range(6):
        x, y = c(_samples(3, 10 * k))
        assert x.shape == (3, 3, 4, 4) and y.tolist() == [10 * k, 10 * k + 1, 10 * k + 2]
        assert (x[1] == 10 * k + 1).all()
        del x, y  # the loop lets go of each batch: one buffer serves them all
    assert c.stats() == {"batches": 6, "allocated": 1, "reused": 5, "replaced": 0, "fresh": 0}


def test_collator_allocates_only_as_far_as_batches_are_held() -> None:
    """A loop that keeps the previous batch while the next is collated (``for x in loader``)
    runs on two buffers of a ring of four; the memory of the other two is never allocated."""
    c = BatchCollator(3, (3, 4, 4), depth=4)
    prev = None
    for k in range(8):
        batch = c(_samples(3, 10 * k))
        if prev is not None:
            assert (prev[0][0] == 10 * (k - 1)).all()  # the held batch was never overwritten
        prev = batch
    assert c.stats() == {"batches": 8, "allocated": 2, "reused": 6, "replaced": 0, "fresh": 0}
    assert sum(slot is not None for slot in c._ring) == 2


def test_collator_never_overwrites_a_batch_still_held() -> None:
    c = BatchCollator(2, (3, 4, 4), depth=2)
    held = [c(_samples(2, 10 * k)) for k in range(5)]  # more batches held than buffers
    for k, (x, y) in enumerate(held):
        assert (x[0] == 10 * k).all() and (x[1] == 10 * k + 1).all(), k
        assert y.tolist() == [10 * k, 10 * k + 1]
    assert c.stats()["replaced"] == 3


def test_collator_sees_views_and_single_tensors_kept() -> None:
    c = BatchCollator(2, (3, 2, 2), depth=1)
    x, y = c(_samples(2, 0, (3, 2, 2)))
    view = x[1, 0]  # only a view of the images survives
    del x
    labels = y
    c(_samples(2, 50, (3, 2, 2)))
    assert (view == 1).all() and labels.tolist() == [0, 1]
    del view, labels
    gc.collect()
    c(_samples(2, 90, (3, 2, 2)))
    assert c.stats()["reused"] == 1


def test_collator_sees_a_storage_object_kept_without_its_tensors() -> None:
    # a Python storage object counts in Python's references, not the storage's use count
    c = BatchCollator(2, (3, 2, 2), depth=1)
    x, y = c(_samples(2, 0, (3, 2, 2)))
    storage = x.untyped_storage()
    del x, y
    gc.collect()
    c(_samples(2, 50, (3, 2, 2)))  # the buffer is still held: a fresh one
    assert bytes(storage)[:12] == bytes([0] * 12) and bytes(storage)[12:24] == bytes([1] * 12)
    assert c.stats()["replaced"] == 1 and c.stats()["reused"] == 0
    del storage
    gc.collect()
    c(_samples(2, 90, (3, 2, 2)))
    assert c.stats()["reused"] == 1


def test_collator_partial_batch_bare_images_and_checks() -> None:
    c = BatchCollator(4, (3, 2, 2))
    x = c([torch.ones(3, 2, 2, dtype=torch.uint8)] * 3)
    assert isinstance(x, torch.Tensor) and x.shape == (3, 3, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        c([torch.ones(3, 2, 3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="batch_size 4"):
        c([torch.ones(3, 2, 2)] * 5)
    f = BatchCollator(2, (3, 2, 2), torch.float32)(_samples(2, 3, (3, 2, 2)))[0]
    assert f.dtype == torch.float32 and float(f[1, 0, 0, 0]) == 4.0


def test_collator_pickles_without_its_buffers() -> None:
    c = BatchCollator(2, (3, 2, 2), pin_memory=True)
    held = c(_samples(2, 0, (3, 2, 2)))
    again = pickle.loads(pickle.dumps(c))
    assert again.stats()["batches"] == 0 and again.batch_size == 2 and again.pin_memory
    assert held[0].is_pinned() == torch.cuda.is_available()


def test_collator_as_feedloader_collate_fn_in_and_out_of_workers() -> None:
    pipe = ImagePipeline(16, train=False, mean=None)
    ref = None
    for workers in (0, 2):
        c = BatchCollator(5, (3, 16, 16), torch.uint8, depth=2)
        loader = FeedLoader(FeedDataset(EXAMPLE, transform=pipe), batch_size=5,
                            num_workers=workers, collate_fn=c)
        batches = [(x.clone(), y.clone()) for x, y in loader]
        assert [len(y) for _, y in batches] == [5, 5, 5, 5, 4]
        if workers == 0:
            assert c.stats() == {"batches": 5, "allocated": 2, "reused": 3, "replaced": 0,
                                 "fresh": 0}
            ref = batches
        else:  # the parent's collator never ran; the workers' copies made fresh batches
            assert c.stats()["batches"] == 0
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                       for a, b in zip(ref, batches))


# -- the package stays light ---------------------------------------------------------------
def test_transform_modules_import_no_dali_or_torchvision() -> None:
    code = ("import sys, feedpipe, feedpipe.transforms._pipeline, feedpipe.stream._collator, "
            "feedpipe.transforms._dali\n"
            "bad = [m for m in sys.modules if m.startswith(('nvidia.dali', 'torchvision'))]\n"
            "assert not bad, bad\n"
            "assert not __import__('torch').cuda.is_initialized()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_one_thread_restores_the_thread_count_under_concurrent_use() -> None:
    """The single-thread section is process-wide: overlapping users (threads) must leave torch
    with the thread count it had, whatever order they leave in."""
    import threading

    from feedpipe.transforms._threads import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        inside = threading.Barrier(4)
        seen = []

        def user() -> None:
            with one_thread():
                inside.wait()
                seen.append(torch.get_num_threads())
                inside.wait()

        threads = [threading.Thread(target=user) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [1, 1, 1, 1]
        assert torch.get_num_threads() == 2
        with one_thread(), one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
