"""Window-only JPEG decoding (the optional C extension ``feedpipe._native._jpegcrop``, behind
``feedpipe.transforms._jpeg.decode_window``): the same pixels as a whole decode sliced to the
window, at every DCT scale, for every chroma subsampling, progressive and restart-marker JPEGs;
errors and hostile bytes are ValueErrors or DecodeErrors, never a crash; the GIL is released while
decoding."""

from __future__ import annotations

import os
import re
import threading

import cv2
import numpy as np
import pytest
import simplejpeg

from feedpipe.convert._synth import _image
from feedpipe.diagnostics import _env as probe_env
from feedpipe.errors import DecodeError
from feedpipe.transforms import _jpeg as image_ops
from feedpipe.transforms._geometry import Box, scale_box
from feedpipe.transforms._jpeg import decode_jpeg, decode_window, jpeg_scale_num, jpeg_size
from feedpipe.transforms._pipeline import ImagePipeline

HAVE_HEADERS = os.path.exists("/usr/include/jpeglib.h")
needs_ext = pytest.mark.skipif(image_ops._jpegcrop is None,
                               reason="feedpipe._native._jpegcrop did not build (no libjpeg "
                               "headers)")


def picture(h: int, w: int, seed: int = 0) -> np.ndarray:
    return _image(np.random.default_rng(seed), h, w, seed % 7)


def encodings(h: int, w: int, seed: int = 0) -> dict[str, bytes]:
    img = picture(h, w, seed)
    out = {sub: simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB", colorsubsampling=sub)
           for sub in ("444", "422", "420", "440", "411")}
    out["gray"] = simplejpeg.encode_jpeg(img[:, :, :1].copy(), quality=90, colorspace="GRAY")
    bgr = np.ascontiguousarray(img[:, :, ::-1])
    out["progressive"] = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    out["restarts"] = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_RST_INTERVAL, 3])[1].tobytes()
    return out


def test_the_extension_builds_where_libjpeg_headers_are() -> None:
    """CI's machine has libjpeg-turbo's headers: a silent build failure there would put every
    user of it back on whole-image decoding."""
    if not HAVE_HEADERS:
        pytest.skip("no /usr/include/jpeglib.h: the extension is optional here")
    assert image_ops._jpegcrop is not None
    assert image_ops._jpegcrop.LIBJPEG_TURBO_VERSION_NUMBER >= 1005000  # skip/crop scanlines
    # the probe's environment (and the benchmarks') say which decoder the figures came from
    assert re.fullmatch(r"libjpeg-turbo \d+\.\d+\.\d+", probe_env.jpeg_window_decoder() or "")


def random_boxes(h: int, w: int, rng: np.random.Generator, n: int) -> list[Box]:
    boxes = [Box(0, 0, h, w), Box(h - 1, w - 1, 1, 1), Box(0, w - 1, h, 1), Box(h - 1, 0, 1, w)]
    # windows 1-3 columns wide at every offset of the first iMCUs: where the region's edges are
    boxes += [Box(int(rng.integers(0, h)), left, 2, width) for left in range(min(w, 34))
              for width in (1, 2, 3) if left + width <= w]
    for _ in range(n):
        bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append(Box(int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)),
                         bh, bw))
    return boxes


@needs_ext
@pytest.mark.parametrize("h,w", [(173, 251), (64, 48), (17, 9), (333, 129)])
def test_window_equals_whole_decode_sliced(h: int, w: int) -> None:
    rng = np.random.default_rng(h * w)
    for name, data in encodings(h, w, seed=h).items():
        whole = decode_jpeg(data)
        if name == "gray":
            assert whole.shape == (h, w, 3)
        for box in random_boxes(h, w, rng, 25):
            got = decode_window(data, h, w, box)
            want = whole[box.top:box.top + box.height, box.left:box.left + box.width]
            assert got.shape == want.shape, (name, box)
            assert np.array_equal(got, want), (name, box)


@needs_ext
@pytest.mark.parametrize("mins", [(40, 0), (0, 70), (100, 90), (20, 20), (250, 10)])
def test_window_at_reduced_scale_equals_the_scaled_decode_sliced(mins: tuple[int, int]) -> None:
    h, w = 480, 400
    rng = np.random.default_rng(sum(mins))
    for name, data in encodings(h, w, seed=5).items():
        scaled = decode_jpeg(data, min_height=mins[0], min_width=mins[1])
        k = jpeg_scale_num(h, w, *mins)
        assert scaled.shape[:2] == (-(-h * k // 8), -(-w * k // 8))
        for box in random_boxes(h, w, rng, 10):
            got = decode_window(data, h, w, box, min_height=mins[0], min_width=mins[1])
            sb = scale_box(box, scaled.shape[0] / h, scaled.shape[1] / w, *scaled.shape[:2])
            want = scaled[sb.top:sb.top + sb.height, sb.left:sb.left + sb.width]
            assert np.array_equal(got, want), (name, k, box)


@needs_ext
def test_pipeline_gives_the_same_tensors_without_the_extension(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = ImagePipeline(96, mean=None, label_field=None)
    data = [jpeg for h, w in [(300, 200), (160, 320), (900, 700)]
            for jpeg in encodings(h, w, seed=w).values()]
    samples = [{"jpg": d, "__index__": i, "__epoch__": 3} for i, d in enumerate(data)]
    with_ext = [pipe(s) for s in samples]
    monkeypatch.setattr(image_ops, "_jpegcrop", None)
    without = [pipe(s) for s in samples]
    for s, a, b in zip(samples, with_ext, without):
        assert a.equal(b), s["__index__"]


def pillow_jpeg(img: np.ndarray, subsampling: int, progressive: bool) -> bytes:
    """``img`` as Pillow writes it (subsampling 0: 4:4:4, 1: 4:2:2, 2: 4:2:0)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90, subsampling=subsampling,
                              progressive=progressive)
    return buf.getvalue()


def crop_of(data: bytes, top: int, left: int, height: int, width: int,
            scale_num: int = 8) -> np.ndarray:
    """decode_crop's window as an array."""
    pixels, row_width, x = image_ops._jpegcrop.decode_crop(data, top, left, height, width,
                                                           scale_num)
    return np.frombuffer(pixels, np.uint8).reshape(height, row_width, 3)[:, x:x + width]


@needs_ext
@pytest.mark.parametrize("progressive", [True, False], ids=["progressive", "baseline"])
@pytest.mark.parametrize("w", [18, 34, 66, 82, 98])
def test_a_window_in_a_two_column_last_imcu_is_the_whole_decodes(progressive: bool,
                                                                  w: int) -> None:
    """A 4:2:0 image 16k + 2 wide ends in an iMCU two columns wide: a window there made
    libjpeg-turbo crop to a region one chroma sample wide, where it swaps the smooth upsampler
    for the plain one, and the window's pixels were 18-53 levels off a whole decode's. Every
    window of the last columns, through decode_window (ImagePipeline's path) too."""
    h = 24
    img = np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    data = pillow_jpeg(img, 2, progressive)
    whole = decode_jpeg(data)
    for left in range(w - 18, w):
        for width in range(1, w - left + 1):
            got = decode_window(data, h, w, Box(0, left, h, width))
            assert np.array_equal(got, whole[:, left:left + width]), (left, width)


@needs_ext
@pytest.mark.parametrize("scale_num", [5, 7, 9, 10, 12, 13, 16])
@pytest.mark.parametrize("subsampling", ["420", "422", "411", "444", "440"])
def test_at_every_dct_scale_a_window_is_the_whole_decode_at_that_scale(scale_num: int,
                                                                       subsampling: str) -> None:
    """The scales the pipeline does not pick (5/8 to 7/8, and above 8/8) give exact windows
    too: against the whole image decoded at that scale (the same call without cropping), every
    window one to three columns wide in the last iMCUs and at the left edge, at image widths
    that end an iMCU one to four columns in."""
    for w in (17, 18, 19, 20, 33, 34, 35, 36):
        h = 12
        img = np.random.default_rng(w * scale_num).integers(0, 256, (h, w, 3), dtype=np.uint8)
        data = simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB",
                                      colorsubsampling=subsampling)
        dh, dw = -(-h * scale_num // 8), -(-w * scale_num // 8)
        whole = crop_of(data, 0, 0, dh, dw, scale_num)
        for left in [*range(0, 4), *range(max(0, dw - 2 * scale_num * 4), dw)]:
            for width in (1, 2, 3):
                if left + width <= dw:
                    got = crop_of(data, 0, left, dh, width, scale_num)
                    assert np.array_equal(got, whole[:, left:left + width]), (w, left, width)


@needs_ext
def test_window_outside_the_image_or_empty_is_a_value_error() -> None:
    data = encodings(50, 40)["420"]
    ext = image_ops._jpegcrop
    with pytest.raises(ValueError, match="outside"):
        ext.decode_crop(data, 40, 0, 11, 40)
    with pytest.raises(ValueError, match="outside"):
        ext.decode_crop(data, 0, 1, 50, 40)
    with pytest.raises(ValueError, match="empty"):
        ext.decode_crop(data, 0, 0, 0, 40)
    with pytest.raises(ValueError, match="scale_num"):
        ext.decode_crop(data, 0, 0, 5, 5, 0)
    pixels, row_width, x = ext.decode_crop(data, 10, 20, 5, 7)
    assert len(pixels) == 5 * row_width * 3 and 0 <= x and x + 7 <= row_width <= 40


@needs_ext
@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_jpeg_is_an_error_not_grey_rows(cut: float) -> None:
    """libjpeg fills the missing rows with grey and warns; like simplejpeg's strict mode, the
    extension makes the warning an error, and decode_window a DecodeError."""
    data = encodings(200, 160)["420"]
    short = data[:int(len(data) * cut)]
    with pytest.raises(ValueError, match="libjpeg"):
        image_ops._jpegcrop.decode_crop(short, 150, 0, 50, 160)
    with pytest.raises(DecodeError):
        decode_window(short, 200, 160, Box(150, 0, 50, 160))


@needs_ext
@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
@pytest.mark.parametrize("cut", [0.5, 0.9, -2], ids=["half", "90%", "no-EOI"])
def test_a_truncated_jpeg_is_an_error_whatever_the_window(progressive: bool, cut: float) -> None:
    """The verdict on a file does not depend on the crop: windows wholly above the cut (which
    decoded when only the window's rows were read) raise too, as the whole decode does, through
    every entry point; a row given to decode_crop_into is left as it was."""
    h, w = 200, 160
    data = pillow_jpeg(picture(h, w, 1), 2, progressive)
    short = data[:int(len(data) * cut)] if cut > 0 else data[:int(cut)]
    with pytest.raises(DecodeError):
        decode_jpeg(short)
    rng = np.random.default_rng(len(short))
    boxes = [Box(0, 0, 1, 1), Box(0, 0, 8, w), Box(0, w - 1, 16, 1)]
    boxes += random_boxes(h, w, rng, 60)[4:]
    ext = image_ops._jpegcrop
    row = np.full((3, 32, 32), 7, np.uint8)
    for box in boxes:
        with pytest.raises(DecodeError):
            decode_window(short, h, w, box)
        with pytest.raises(ValueError, match="libjpeg"):
            ext.decode_crop(short, box.top, box.left, min(box.height, h - box.top), box.width)
        with pytest.raises(ValueError, match="libjpeg"):
            ext.decode_crop_into(short, box.top, box.left, min(box.height, h - box.top),
                                 box.width, row, 32, 32, False)
    assert (row == 7).all()


@needs_ext
@pytest.mark.parametrize("marker", [b"\xff\xd3", b"\xff\xd9", b"\xff\xc4"],
                         ids=["stray-RST", "early-EOI", "stray-DHT"])
def test_corrupt_data_below_the_window_is_an_error_whatever_the_window(marker: bytes) -> None:
    """Not only a cut: a marker in the entropy-coded data near the end of a baseline JPEG (libjpeg
    warns that the data is corrupt) is a DecodeError for a window at the top too, as for the
    whole decode."""
    h, w = 200, 160
    data = bytearray(pillow_jpeg(picture(h, w, 2), 2, False))
    at = int(len(data) * 0.9)
    data[at:at + 2] = marker
    bad = bytes(data)
    with pytest.raises(DecodeError):
        decode_jpeg(bad)
    for box in [Box(0, 0, 16, w), Box(0, 0, 1, 1), Box(40, 30, 50, 60), Box(0, w - 1, h, 1)]:
        with pytest.raises(DecodeError):
            decode_window(bad, h, w, box)


@needs_ext
def test_mangled_bytes_never_crash_the_process() -> None:
    """Fatal libjpeg errors longjmp out of its error handler; random damage to a JPEG must give
    either pixels of the right shape or an error, a thousand times over."""
    data = bytearray(encodings(120, 90)["420"])
    h, w = jpeg_size(bytes(data))
    rng = np.random.default_rng(7)
    ok = errors = 0
    for _ in range(1000):
        bad = bytearray(data)
        for pos in rng.integers(0, len(bad), size=int(rng.integers(1, 6))):
            bad[pos] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            bad = bad[:int(rng.integers(2, len(bad)))]
        try:
            pixels, row_width, x = image_ops._jpegcrop.decode_crop(bytes(bad), 30, 20, 60, 50)
        except ValueError:
            errors += 1
        else:
            assert len(pixels) == 60 * row_width * 3
            ok += 1
    assert ok and errors  # both paths ran


@needs_ext
def test_cmyk_or_other_refusals_fall_back_to_simplejpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the extension refuses, simplejpeg decodes (or raises its own error)."""
    data = encodings(64, 64)["444"]

    class Refusing:
        @staticmethod
        def decode_crop(*args: object) -> None:
            raise ValueError("libjpeg: Unsupported color conversion request")

    monkeypatch.setattr(image_ops, "_jpegcrop", Refusing)
    got = decode_window(data, 64, 64, Box(3, 5, 20, 30))
    assert np.array_equal(got, decode_jpeg(data)[3:23, 5:35])
    with pytest.raises(DecodeError):
        decode_window(b"\xff\xd8 not a jpeg", 64, 64, Box(0, 0, 8, 8))


@needs_ext
@pytest.mark.parametrize("into", [False, True], ids=["decode_crop", "decode_crop_into"])
def test_decoding_releases_the_gil(into: bool) -> None:
    """Transform threads (FeedLoader(transform_threads=N)) rely on it. The extension's test hook
    holds a decode_crop call at the point where it has given up the GIL, until this thread lets it
    go: this thread runs Python code (and sees the decode still held) in the meantime, which it
    could not if the decoding thread still held the GIL (it would run only after the held decode
    gave up, at the hook's 60 s limit, and then see nothing held)."""
    ext = image_ops._jpegcrop
    h, w = 96, 80
    data = simplejpeg.encode_jpeg(picture(h, w, 3), quality=95)
    result: dict[str, object] = {}

    row = np.zeros((3, h, w), np.uint8)

    def decode() -> None:
        try:
            if into:  # the resize into the row runs without the GIL too (same section)
                ext.decode_crop_into(data, 0, 0, h, w, row, h, w, False)
            else:
                result["pixels"] = ext.decode_crop(data, 0, 0, h, w)
        except ValueError as e:
            result["error"] = e

    ext._hold_next()
    t = threading.Thread(target=decode)
    try:
        t.start()
        assert ext._wait_until_held()  # the decode reached the hold...
        seen_held = ext._is_held()  # ...and Python code runs here while it waits there
    finally:
        ext._let_go()
        t.join()
    assert seen_held
    assert not ext._is_held() and "error" not in result
    if into:  # the held decode went on to the right pixels
        assert np.array_equal(row, decode_jpeg(data).transpose(2, 0, 1))
        return
    pixels, row_width, x = result["pixels"]
    rows = np.frombuffer(pixels, np.uint8).reshape(h, row_width, 3)[:, x:x + w]
    assert np.array_equal(rows, decode_jpeg(data))


# -- the resize into a batch row (resize_into, decode_crop_into) --

SIMD_LEVELS = {"avx2": 2, "ssse3": 1, "plain": 0}


@pytest.fixture(params=list(SIMD_LEVELS))
def simd(request: pytest.FixtureRequest) -> object:
    """Each resize test runs with the AVX2 code, the SSSE3 code (where the CPU has them) and the
    plain C loops only (what other CPUs run)."""
    ext = image_ops._jpegcrop
    was = ext._use_simd(2)
    if SIMD_LEVELS[request.param] > ext._use_simd(SIMD_LEVELS[request.param]):
        ext._use_simd(was)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    ext._use_simd(was)


def opencv_rows(img: np.ndarray, size: tuple[int, int], flip: bool) -> np.ndarray:
    """What the module did before the C resize: cv2.resize (bilinear), flip, split into CHW."""
    out = cv2.resize(np.ascontiguousarray(img), (size[1], size[0]),
                     interpolation=cv2.INTER_LINEAR).reshape(size[0], size[1], 3)
    return np.ascontiguousarray((out[:, ::-1] if flip else out).transpose(2, 0, 1))


def enlargements(rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    cases = [(1, 1, 1, 1), (1, 1, 224, 224), (224, 224, 224, 224), (5, 3, 7, 4),
             (150, 140, 224, 224), (223, 17, 224, 224), (2, 200, 3, 201), (7, 7, 200, 9)]
    for _ in range(n):
        h, w = int(rng.integers(1, 240)), int(rng.integers(1, 240))
        cases.append((h, w, int(rng.integers(h, 260)), int(rng.integers(w, 260))))
    return cases


@needs_ext
def test_the_one_pass_resize_is_opencvs_bilinear_within_one_level(simd: str) -> None:
    """resize_into replaces cv2.resize + cv2.flip + cv2.split: every pixel within one grey level
    of theirs, on sources with padded rows (a window of a wider decode), flipped or not; and on
    average far closer than that."""
    ext = image_ops._jpegcrop
    rng = np.random.default_rng(11)
    diffs = []
    for h, w, oh, ow in enlargements(rng, 300):
        wide = rng.integers(0, 256, (h, w + 6, 3), dtype=np.uint8)
        img = wide[:, 2:2 + w]  # rows 3 * (w + 6) bytes apart
        for flip in (False, True):
            out = np.full((3, oh, ow), 7, np.uint8)
            ext.resize_into(img, out, flip)
            diff = np.abs(out.astype(int) - opencv_rows(img, (oh, ow), flip))
            assert diff.max() <= 1, (h, w, oh, ow, flip)
            diffs.append(diff.mean())
    assert np.mean(diffs) < 0.1


@needs_ext
def test_the_vector_and_the_plain_resize_give_the_same_bytes() -> None:
    """AVX2, SSSE3 and plain C: the same bytes (levels the CPU lacks run the next one down)."""
    ext = image_ops._jpegcrop
    rng = np.random.default_rng(12)
    for h, w, oh, ow in enlargements(rng, 200):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for flip in (False, True):
            got = []
            for level in (2, 1, 0):
                was = ext._use_simd(level)
                out = np.empty((3, oh, ow), np.uint8)
                ext.resize_into(img, out, flip)
                ext._use_simd(was)
                got.append(out)
            assert np.array_equal(got[0], got[2]), (h, w, oh, ow, flip)
            assert np.array_equal(got[1], got[2]), (h, w, oh, ow, flip)


@needs_ext
def test_a_copy_is_the_pixels_and_a_flip_reverses_them(simd: str) -> None:
    img = np.random.default_rng(13).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    out = np.empty((3, 37, 53), np.uint8)
    image_ops._jpegcrop.resize_into(img, out, False)
    assert np.array_equal(out, img.transpose(2, 0, 1))
    image_ops._jpegcrop.resize_into(img, out, True)
    assert np.array_equal(out, img[:, ::-1].transpose(2, 0, 1))


@needs_ext
@pytest.mark.parametrize("scale_num", [8, 4])
def test_decode_crop_into_is_decode_crop_then_resize_into(simd: str, scale_num: int) -> None:
    """The one call gives the bytes of the two steps it replaces, for every subsampling,
    progressive and restart-marker JPEGs, at full and reduced DCT scale, enlarged or reduced."""
    ext = image_ops._jpegcrop
    h, w = 173, 251
    rng = np.random.default_rng(scale_num)
    for name, data in encodings(h, w, seed=4).items():
        dh, dw = -(-h * scale_num // 8), -(-w * scale_num // 8)
        for box in random_boxes(dh, dw, rng, 12):
            if box.top + box.height > dh:  # random_boxes' two-row boxes may reach past it
                continue
            size = (int(rng.integers(1, 230)), int(rng.integers(1, 230)))  # either way
            flip = bool(rng.integers(0, 2))
            pixels, row_width, x = ext.decode_crop(data, box.top, box.left, box.height,
                                                   box.width, scale_num)
            window = np.frombuffer(pixels, np.uint8).reshape(box.height, row_width, 3)
            want = np.empty((3, *size), np.uint8)
            ext.resize_into(window[:, x:x + box.width], want, flip)
            got = np.empty((3, *size), np.uint8)
            ext.decode_crop_into(data, box.top, box.left, box.height, box.width, got, *size,
                                 flip, scale_num)
            assert np.array_equal(got, want), (name, box, size, flip)


@needs_ext
@pytest.mark.parametrize("cut", [0.3, 0.95])
def test_a_failed_decode_writes_nothing_into_the_row(cut: float) -> None:
    """ImagePipeline.into's promise: a bad sample raises before anything is written into the
    batch row."""
    data = encodings(200, 160)["420"]
    out = np.full((3, 224, 224), 7, np.uint8)
    with pytest.raises(ValueError, match="libjpeg"):
        image_ops._jpegcrop.decode_crop_into(data[:int(len(data) * cut)], 100, 0, 100, 160, out,
                                             224, 224, True)
    assert (out == 7).all()


def torch_antialiased(img: np.ndarray, size: tuple[int, int], flip: bool) -> np.ndarray:
    """What resize_to_tensor did for a reduction before the C resize: the flipped source through
    torch's uint8 antialiased bilinear (channels-last), as CHW."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(img[:, ::-1] if flip else img))
    x = x.permute(2, 0, 1)[None].contiguous(memory_format=torch.channels_last)
    if (x.shape[2], x.shape[3]) != size:
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return x[0].contiguous().numpy()


@needs_ext
def test_a_reduction_is_torchs_antialiased_bilinear_exactly(simd: str) -> None:
    """Any resize that reduces an axis (the other one may grow) gives torch's pixels, byte for
    byte, flipped or not, from sources with padded rows."""
    import torch

    torch.set_num_threads(1)
    ext = image_ops._jpegcrop
    rng = np.random.default_rng(14)
    cases = [(2, 1, 1, 1), (300, 280, 224, 224), (230, 200, 224, 224), (224, 225, 224, 224),
             (17, 400, 60, 3), (500, 9, 224, 224), (1, 300, 1, 7)]
    while len(cases) < 250:
        h, w = int(rng.integers(1, 420)), int(rng.integers(1, 420))
        oh, ow = int(rng.integers(1, 260)), int(rng.integers(1, 260))
        if h > oh or w > ow:
            cases.append((h, w, oh, ow))
    for h, w, oh, ow in cases:
        img = rng.integers(0, 256, (h, w + 5, 3), dtype=np.uint8)[:, 3:3 + w]
        for flip in (False, True):
            out = np.full((3, oh, ow), 7, np.uint8)
            ext.resize_into(img, out, flip)
            assert np.array_equal(out, torch_antialiased(img, (oh, ow), flip)), (h, w, oh, ow,
                                                                                 flip)


@needs_ext
def test_a_wrong_row_or_window_is_a_value_error_naming_it() -> None:
    ext = image_ops._jpegcrop
    data = encodings(50, 40)["420"]
    row = np.zeros((3, 32, 32), np.uint8)
    with pytest.raises(ValueError, match="3 x 30 x 32 bytes"):
        ext.decode_crop_into(data, 0, 0, 10, 10, row, 30, 32, False)
    with pytest.raises(ValueError, match="outside"):
        ext.decode_crop_into(data, 45, 0, 10, 10, row, 32, 32, False)
    with pytest.raises(ValueError, match="empty"):
        ext.decode_crop_into(data, 0, 0, 0, 10, row, 32, 32, False)
    with pytest.raises(ValueError, match="empty"):
        ext.resize_into(np.zeros((0, 10, 3), np.uint8), row, False)
    with pytest.raises(ValueError, match="packed pixels"):
        ext.resize_into(np.zeros((10, 10, 4), np.uint8), row, False)
    with pytest.raises(ValueError, match="packed pixels"):
        ext.resize_into(np.zeros((10, 10, 3), np.uint8)[:, ::-1], row, False)
    with pytest.raises(ValueError, match="3 x H x W"):
        ext.resize_into(np.zeros((10, 10, 3), np.uint8), np.zeros((32, 32, 3), np.uint8), False)
    with pytest.raises((ValueError, BufferError)):  # read-only: never written
        ext.resize_into(np.zeros((10, 10, 3), np.uint8), bytes(3 * 32 * 32), False)
    assert not row.any()


@needs_ext
def test_mangled_bytes_into_a_row_never_crash_the_process() -> None:
    data = bytearray(encodings(120, 90)["420"])
    rng = np.random.default_rng(8)
    row = np.empty((3, 96, 96), np.uint8)
    ok = errors = 0
    for _ in range(500):
        bad = bytearray(data)
        for pos in rng.integers(0, len(bad), size=int(rng.integers(1, 6))):
            bad[pos] = int(rng.integers(0, 256))
        try:
            image_ops._jpegcrop.decode_crop_into(bytes(bad), 30, 20, 60, 50, row, 96, 96, True)
        except ValueError:
            errors += 1
        else:
            ok += 1
    assert ok and errors


@needs_ext
def test_the_pipeline_one_call_gives_the_two_steps_pixels(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """ImagePipeline decodes, resizes, flips and writes a JPEG crop into the batch row in one
    call where it can: the same tensors as decode_window then resize_to_tensor, normalised or
    not, into a row or a new tensor."""
    from feedpipe.transforms import _pipeline
    data = [jpeg for h, w in [(300, 200), (160, 320), (120, 90)]
            for jpeg in encodings(h, w, seed=w).values()]
    samples = [{"jpg": d, "cls": b"3", "__index__": i, "__epoch__": 1}
               for i, d in enumerate(data)]
    calls = []
    one_call = _pipeline.decode_window_into

    def counted(*args: object, **kwargs: object) -> bool:
        done = one_call(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(done)
        return done

    for mean in (None, (0.5, 0.4, 0.3)):
        pipe = ImagePipeline(224, mean=mean, std=None if mean is None else (0.2, 0.2, 0.2))
        monkeypatch.setattr(_pipeline, "decode_window_into", counted)
        rows = torch_rows(pipe, samples)
        fresh = [pipe(s)[0] for s in samples]
        monkeypatch.setattr(_pipeline, "decode_window_into", lambda *a, **k: False)
        two_steps = [pipe(s)[0] for s in samples]
        for i, (a, b, c) in enumerate(zip(rows, fresh, two_steps)):
            assert a.equal(c) and b.equal(c), (mean, i)
    assert calls.count(True) >= len(samples)  # the one call did most of them


def torch_rows(pipe: ImagePipeline, samples: list[dict[str, object]]) -> list[object]:
    import torch
    batch = torch.empty((len(samples), *pipe.out_shape), dtype=pipe.out_dtype)
    for i, s in enumerate(samples):
        assert pipe.into(s, batch[i]) == 3
    return list(batch)


@needs_ext
def test_threads_resizing_at_once_each_get_their_own_pixels() -> None:
    """Each thread keeps its own scratch blocks for the decoded window and the resize's
    intermediate planes: four threads decoding and resizing different JPEGs at once (the GIL
    released) give the bytes each gives alone, reductions and enlargements mixed."""
    ext = image_ops._jpegcrop
    rng = np.random.default_rng(15)
    jobs = []
    for n in range(24):
        h, w = int(rng.integers(120, 360)), int(rng.integers(120, 360))
        data = encodings(h, w, seed=n)["444" if n % 2 else "420"]
        size = (int(rng.integers(60, 300)), int(rng.integers(60, 300)))
        jobs.append((data, Box(0, 0, h, w), size, bool(n % 3)))

    def run(job: tuple[bytes, Box, tuple[int, int], bool]) -> np.ndarray:
        data, b, size, flip = job
        out = np.empty((3, *size), np.uint8)
        ext.decode_crop_into(data, b.top, b.left, b.height, b.width, out, *size, flip)
        return out

    alone = [run(j) for j in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            for got, want in zip(pool.map(run, jobs), alone):
                assert np.array_equal(got, want)


def test_without_the_extension_a_log_record_says_once_what_runs_instead(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where feedpipe._native._jpegcrop did not build, JPEG crops are decoded whole and resized by
    OpenCV or torch (pixels within one grey level): said once a process, not chosen silently."""
    import logging

    import torch

    from feedpipe._helpers import dependency
    from feedpipe.transforms import _resize

    monkeypatch.setattr(dependency, "UNBUILT_SAID", set())
    monkeypatch.setattr(image_ops, "_jpegcrop", None)
    monkeypatch.setattr(_resize, "_resize_into", None)
    data = encodings(64, 48)["420"]
    with caplog.at_level(logging.INFO, logger="feedpipe"):
        for _ in range(3):
            window = decode_window(data, 64, 48, Box(8, 4, 20, 30))
            _resize.resize_to_tensor(window, (40, 40), flip=True)
        _resize.resize_to_tensor(np.zeros((5, 5, 3), np.uint8), (9, 9),
                                 out=torch.empty((3, 9, 9), dtype=torch.uint8))
    said = [r.getMessage() for r in caplog.records
            if "feedpipe._native._jpegcrop" in r.getMessage()]
    assert len(said) == 1, said
    assert "was not built" in said[0] and "libjpeg" in said[0]
