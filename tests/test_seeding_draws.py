"""The per-sample draws (generator seeding, crop window, flip) are the ones the project has
always made: each is compared with a plain copy of its first implementation, for any seed,
epoch, index, image size and crop parameters. A change to how they are computed must not move
a single crop or flip of any sample, or a resumed run would train on other crops. Also the
per-image glue around them: nested one_thread contexts, into()'s row check, the fingerprint."""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from feedpipe.transforms._geometry import Box, random_resized_crop_box
from feedpipe.transforms._pipeline import ImagePipeline, ImageSpec
from feedpipe.transforms._seeding import sample_rng, scratch_rng


def reference_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The first implementation of the sample's generator."""
    d = hashlib.blake2b(f"feedpipe-augment\0{int(seed)}\0{int(epoch)}\0{int(index)}".encode(),
                        digest_size=32).digest()
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = {"bit_generator": "PCG64",
                               "state": {"state": int.from_bytes(d[:16], "little"),
                                         "inc": int.from_bytes(d[16:], "little") | 1},
                               "has_uint32": 0, "uinteger": 0}
    return rng


def reference_box(height: int, width: int, rng: np.random.Generator,
                  scale: tuple[float, float], ratio: tuple[float, float]) -> Box:
    """The first implementation of the random-resized crop window (NumPy doubles)."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        u_area, u_ratio, u_top, u_left = rng.random(4)
        target = area * (scale[0] + u_area * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u_ratio * (log_hi - log_lo))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return Box(int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        h, w = height, width
    return Box((height - h) // 2, (width - w) // 2, h, w)


def reference_geometry(spec: ImageSpec, height: int, width: int,
                       rng: np.random.Generator) -> tuple[Box, bool]:
    box = reference_box(height, width, rng, spec.scale, spec.ratio)
    return box, bool(rng.random() < spec.flip)


seeds = st.integers(0, 2**64)
sides = st.integers(1, 1 << 15)
fractions = st.floats(0.001, 1.0)


@st.composite
def specs(draw: st.DrawFn) -> ImageSpec:
    lo, hi = sorted((draw(fractions), draw(fractions)))
    r_lo = draw(st.floats(0.05, 20.0))
    r_hi = r_lo * draw(st.floats(1.0, 20.0))
    return ImageSpec(size=8, scale=(lo, hi), ratio=(r_lo, r_hi),
                     flip=draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])))


@settings(max_examples=400, deadline=None)
@given(seeds, seeds, seeds, sides, sides, specs())
@example(0, 1, 5, 1, 3000, ImageSpec(8))  # every try misses: the centred fallback
@example(0, 1, 5, 300, 400, ImageSpec(8, scale=(0.9, 1.0), ratio=(3.0, 4.0)))
def test_crop_and_flip_draws_are_the_first_implementations(
        seed: int, epoch: int, index: int, height: int, width: int, spec: ImageSpec) -> None:
    """Same window, same flip and the generator left at the same place, as the reference."""
    want_rng = reference_rng(seed, epoch, index)
    want = reference_geometry(spec, height, width, want_rng)
    rng = scratch_rng(seed, epoch, index)
    assert spec.geometry(height, width, rng) == want
    assert rng.random() == want_rng.random()
    for make in (sample_rng, scratch_rng):
        want_rng = reference_rng(seed, epoch, index)
        rng = make(seed, epoch, index)
        assert random_resized_crop_box(height, width, rng, spec.scale, spec.ratio) == \
            reference_box(height, width, want_rng, spec.scale, spec.ratio)
        assert rng.random() == want_rng.random()


@settings(max_examples=200, deadline=None)
@given(seeds, seeds, seeds)
def test_sample_generators_are_seeded_as_the_first_implementation(seed: int, epoch: int,
                                                                  index: int) -> None:
    want = reference_rng(seed, epoch, index).random(5).tolist()
    assert sample_rng(seed, epoch, index).random(5).tolist() == want
    assert scratch_rng(seed, epoch, index).random(5).tolist() == want
    # numpy integers (a plan's ids) seed as the ints they hold
    assert scratch_rng(np.uint64(seed % 2**64), np.int64(epoch % 2**63),
                       np.int64(index % 2**63)).random(5).tolist() == reference_rng(
        seed % 2**64, epoch % 2**63, index % 2**63).random(5).tolist()


def test_a_nested_one_thread_context_leaves_the_count_to_the_outer_one() -> None:
    """The loader enters one_thread once a batch; each image's own entry inside it takes no
    count (and no lock), and torch stays at one thread until the outer context ends, even when
    another thread's context ends in between."""
    from feedpipe.transforms import _threads
    from feedpipe.transforms._threads import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        other_in, other_out = threading.Event(), threading.Event()

        def other() -> None:
            with one_thread():
                other_in.set()
                other_out.wait(30)

        t = threading.Thread(target=other)
        with one_thread():
            assert _threads._one_thread_users == 1
            t.start()
            assert other_in.wait(30)
            assert _threads._one_thread_users == 2
            with one_thread():
                assert _threads._one_thread_users == 2
                other_out.set()
                t.join()
                assert _threads._one_thread_users == 1
                assert torch.get_num_threads() == 1
            assert _threads._one_thread_users == 1
            assert torch.get_num_threads() == 1
        assert _threads._one_thread_users == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_into_checks_rows_against_the_current_spec() -> None:
    """ImagePipeline.into's row check follows a spec replaced between epochs (progressive
    resizing): the new size's rows are taken and the old size's refused."""
    p = ImagePipeline(32, mean=None)
    jpg = simplejpeg_image()
    sample = {"jpg": jpg, "cls": b"4", "__key__": "k", "__shard__": "s", "__index__": 3}
    assert p.into(sample, torch.empty((3, 32, 32), dtype=torch.uint8)) == 4
    p.spec = replace(p.spec, size=16)
    row = torch.empty((3, 16, 16), dtype=torch.uint8)
    assert p.into(sample, row) == 4
    assert torch.equal(row, p(sample)[0])
    with pytest.raises(ValueError, match=r"shape \(3, 16, 16\)"):
        p.into(sample, torch.empty((3, 32, 32), dtype=torch.uint8))


def simplejpeg_image() -> bytes:
    import simplejpeg

    rng = np.random.default_rng(0)
    return simplejpeg.encode_jpeg(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))


def test_using_a_pipeline_leaves_its_fingerprint_as_it_was() -> None:
    """The decoded store keys a transform's outputs by its fingerprint (its code and
    attributes), read again each pass: what into() or __call__ might keep between calls (a
    shape worked out once per spec, say) must not enter it, or a pass after a spec change would
    find the previous pass's outputs under another key."""
    from feedpipe.caches._fingerprint import fingerprint

    p = ImagePipeline(32, mean=None)
    sample = {"jpg": simplejpeg_image(), "cls": b"4", "__key__": "k", "__shard__": "s",
              "__index__": 3}
    p.spec = replace(p.spec, size=16)
    before = fingerprint(p)
    p.into(sample, torch.empty((3, 16, 16), dtype=torch.uint8))
    p(sample)
    assert fingerprint(p) == before
