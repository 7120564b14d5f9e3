"""Differential fuzz of the C extensions (Hypothesis): every entry point of
``feedpipe._native._jpegcrop``, ``feedpipe._native._packrows`` and ``feedpipe._native._stagefiles``
gives what its pure-Python fallback or the reference decoder gives, on random inputs and on
damaged ones.

- ``_jpegcrop.decode_crop``: random JPEG kinds (simplejpeg's five subsamplings and grey,
  Pillow's progressive and baseline ones, OpenCV's with restart markers), sizes, qualities,
  windows, DCT scales (1..16) and IDCT methods, whole or truncated (anywhere, or only the EOI
  marker missing) or with bytes overwritten: the window of the whole decode at that scale, and
  at 8/8 simplejpeg's pixels; whether it decodes at all never depends on the window.
- ``decode_window`` (ImagePipeline's path) and ``ImagePipeline`` itself: the same pixels, or the
  same DecodeError, as without the extension.
- ``_jpegcrop.decode_crop_into``: ``decode_crop`` then ``resize_into``, byte for byte; the
  fallback's resize within one grey level (an enlargement: OpenCV) or exactly (torch); nothing
  written into the row when it raises.
- ``_jpegcrop.resize_into``: the fallback's resize (OpenCV's or torch's), from rows with padding,
  flipped or not, at every SIMD level.
- ``_packrows.gather``: the bytes numpy's slices give; a piece outside its map or pieces that do
  not fit are a ValueError with ``out`` untouched.
- ``_stagefiles.stage`` (through ``stage_dir``): the Python loop's staging file, lists and rows.
- ``_stagefiles.image_sizes`` (through ``index_sizes``): the sizes and unread count that Python's
  header parsers give (or the same error), over valid JPEG, PNG, WebP, GIF, BMP and TIFF headers,
  truncated, mangled, zero-sized and random members, and members cut at the map's end.

The default run is short: ``FEEDPIPE_FUZZ_EXAMPLES`` examples a test (20 unless set); the
``slow`` variants run ten times as many. ``tools/sanitize_extensions.sh`` runs this file against
builds of the three extensions with AddressSanitizer and UBSan.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from _staging import stage_both
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from feedpipe.convert import _stage_dir as stagedir
from feedpipe.errors import DecodeError
from feedpipe.format import _image_sizes as image_sizes
from feedpipe.format._index import ShardIndex
from feedpipe.stream import _packed
from feedpipe.transforms import _jpeg as image_ops
from feedpipe.transforms import _resize
from feedpipe.transforms._geometry import Box

EXAMPLES = int(os.environ.get("FEEDPIPE_FUZZ_EXAMPLES", "20"))
RUNS = [pytest.param(EXAMPLES, id="short"),
        pytest.param(10 * EXAMPLES, id="long", marks=pytest.mark.slow)]


def fuzz(examples: int) -> Any:
    """Hypothesis settings for ``examples`` examples: no deadline (a sanitized build is slow),
    no example database (the runs are independent)."""
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


needs_jpegcrop = pytest.mark.skipif(image_ops._jpegcrop is None,
                                    reason="feedpipe._native._jpegcrop did not build (no libjpeg "
                                    "headers)")
needs_packrows = pytest.mark.skipif(_packed._packrows is None,
                                    reason="feedpipe._native._packrows did not build (no C "
                                    "compiler)")
needs_stagefiles = pytest.mark.skipif(stagedir._C is None,
                                      reason="feedpipe._native._stagefiles did not build (no C "
                                      "compiler)")

# -- JPEGs --

KINDS = ["sj-444", "sj-422", "sj-420", "sj-440", "sj-411", "sj-gray", "pil-420-progressive",
         "pil-422-progressive", "pil-444-progressive", "pil-420", "cv2-restarts"]
# sizes around the iMCU edges (8, 16 and 32 columns or rows), where windows were wrong before
EDGY = [n for k in (1, 2, 3, 4) for n in (16 * k - 1, 16 * k, 16 * k + 1, 16 * k + 2, 16 * k + 4)]
SIDES = st.one_of(st.integers(1, 72), st.sampled_from(EDGY))


def encode(img: np.ndarray, kind: str, quality: int) -> bytes:
    """``img`` (HWC RGB) as JPEG bytes of ``kind``."""
    if kind.startswith("sj-"):
        sub = kind[3:]
        if sub == "gray":
            return simplejpeg.encode_jpeg(np.ascontiguousarray(img[:, :, :1]), quality=quality,
                                          colorspace="GRAY")
        return simplejpeg.encode_jpeg(img, quality=quality, colorspace="RGB",
                                      colorsubsampling=sub)
    if kind.startswith("pil-"):
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=quality,
                                  subsampling={"444": 0, "422": 1, "420": 2}[kind[4:7]],
                                  progressive=kind.endswith("progressive"))
        return buf.getvalue()
    import cv2

    ok, enc = cv2.imencode(".jpg", np.ascontiguousarray(img[:, :, ::-1]),
                           [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_RST_INTERVAL, 2])
    assert ok
    return enc.tobytes()


@st.composite
def jpegs(draw: Any) -> tuple[bytes, str]:
    """JPEG bytes, perhaps damaged, and what was done to them (for the failure message)."""
    h, w = draw(SIDES), draw(SIDES)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    else:  # smooth, as photographs are
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(yy * 7 + xx * 3) % 256, (xx * 5) % 256, (yy * 11) % 256], axis=2)
        img = img.astype(np.uint8)
    kind = draw(st.sampled_from(KINDS))
    data = encode(img, kind, draw(st.integers(20, 100)))
    damage = draw(st.sampled_from(["none", "none", "cut", "no-eoi", "bytes"]))
    if damage == "cut":
        data = data[:draw(st.integers(2, len(data) - 1))]
    elif damage == "no-eoi":
        data = data[:-2]
    elif damage == "bytes":
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        data = bytes(raw)
    return data, f"{kind} {h}x{w} {damage}"


@st.composite
def windows(draw: Any, h: int, w: int) -> Box:
    """A window of an ``h`` x ``w`` image; often one to three columns wide at its right edge."""
    if draw(st.integers(0, 3)) == 0:
        width = draw(st.integers(1, min(3, w)))
        left = w - width - draw(st.integers(0, min(2, w - width)))
    else:
        width = draw(st.integers(1, w))
        left = draw(st.integers(0, w - width))
    height = draw(st.integers(1, h))
    return Box(draw(st.integers(0, h - height)), left, height, width)


# On an image this small or smaller on a side, simplejpeg (the fallback) picks another DCT scale
# than feedpipe's jpeg_scale_num when two give the same size (1/4 for 1/8, say): the fallback's
# own difference, not the extension's, so the reduced-scale comparisons leave such images out.
TINY = 6


def header(data: bytes) -> tuple[int, int] | None:
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return int(h), int(w)


def crop(data: bytes, box: Box, k: int = 8, fastdct: bool = False) -> np.ndarray | None:
    """decode_crop's window as an array; None where it raises a ValueError."""
    try:
        pixels, row_width, x = image_ops._jpegcrop.decode_crop(
            data, box.top, box.left, box.height, box.width, k, fastdct)
    except ValueError:
        return None
    rows = np.frombuffer(pixels, np.uint8).reshape(box.height, row_width, 3)
    return rows[:, x:x + box.width]


def scaled(h: int, w: int, k: int) -> tuple[int, int]:
    return -(-h * k // 8), -(-w * k // 8)


@needs_jpegcrop
@pytest.mark.parametrize("examples", RUNS)
def test_decode_crop_is_the_whole_decode_sliced(examples: int) -> None:
    @fuzz(examples)
    @given(jpeg=jpegs(), k=st.integers(1, 16), fastdct=st.booleans(), data=st.data())
    def check(jpeg: tuple[bytes, str], k: int, fastdct: bool, data: st.DataObject) -> None:
        raw, what = jpeg
        size = header(raw)
        if size is None:  # the header does not parse: no window decodes
            assert crop(raw, Box(0, 0, 1, 1), k) is None, what
            return
        dh, dw = scaled(*size, k)
        box = data.draw(windows(dh, dw))
        whole = crop(raw, Box(0, 0, dh, dw), k, fastdct)  # no cropping: libjpeg's whole decode
        got = crop(raw, box, k, fastdct)
        assert (got is None) == (whole is None), (what, k, box, "the verdict depends on it")
        if whole is not None:
            want = whole[box.top:box.top + box.height, box.left:box.left + box.width]
            assert np.array_equal(got, want), (what, k, fastdct, box)
        if k == 8:  # the reference decoder, strict as the extension is
            try:
                ref = simplejpeg.decode_jpeg(raw, colorspace="RGB", fastdct=fastdct)
            except ValueError:
                ref = None
            assert (ref is None) == (whole is None), (what, "simplejpeg's verdict differs")
            if ref is not None:
                assert np.array_equal(whole, ref), (what, fastdct)

    check()


def without_extension(fn: Any) -> Any:
    """``fn()`` with feedpipe's fallbacks instead of ``feedpipe._native._jpegcrop``."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(image_ops, "_jpegcrop", None)
        m.setattr(_resize, "_resize_into", None)
        return fn()


def outcome(fn: Any) -> Any:
    """``fn()``, or the DecodeError class where it raises one."""
    try:
        return fn()
    except DecodeError:
        return DecodeError


@needs_jpegcrop
@pytest.mark.parametrize("examples", RUNS)
def test_decode_window_is_what_the_fallback_gives(examples: int) -> None:
    """ImagePipeline's window decode: the pixels, or the DecodeError, of simplejpeg's whole
    decode, for every window and reduced scale."""
    @fuzz(examples)
    @given(jpeg=jpegs(), data=st.data())
    def check(jpeg: tuple[bytes, str], data: st.DataObject) -> None:
        raw, what = jpeg
        size = header(raw)
        if size is None:
            return
        h, w = size
        box = data.draw(windows(h, w))
        mins = data.draw(st.sampled_from([(0, 0), (h // 2, w // 3), (h // 5, 1), (h, w)]))
        if min(h, w) <= TINY:
            mins = (0, 0)

        def run() -> Any:
            return image_ops.decode_window(raw, h, w, box, min_height=mins[0],
                                           min_width=mins[1])

        got, want = outcome(run), outcome(lambda: without_extension(run))
        if want is DecodeError or got is DecodeError:
            assert got is want, (what, box, mins)
        else:
            assert np.array_equal(got, want), (what, box, mins)

    check()


@needs_jpegcrop
@pytest.mark.parametrize("examples", RUNS)
def test_the_pipeline_gives_the_fallbacks_tensors(examples: int) -> None:
    """ImagePipeline end to end (its one C call, decode_crop_into, where it can): the tensor of
    the pipeline without the extension within one grey level (OpenCV's enlargement), or the
    same DecodeError."""
    from feedpipe.transforms._pipeline import ImagePipeline

    @fuzz(examples)
    @given(jpeg=jpegs(), size=st.integers(1, 64), index=st.integers(0, 10**6))
    def check(jpeg: tuple[bytes, str], size: int, index: int) -> None:
        raw, what = jpeg
        dims = header(raw)
        assume(dims is None or min(dims) > TINY)  # (see TINY)
        pipe = ImagePipeline(size, mean=None, label_field=None)
        sample = {"jpg": raw, "__index__": index, "__epoch__": 1}
        got, want = outcome(lambda: pipe(sample)), outcome(lambda: without_extension(
            lambda: pipe(sample)))
        if want is DecodeError or got is DecodeError:
            assert got is want, what
        else:
            diff = (got.int() - want.int()).abs().max().item()
            assert diff <= 1, (what, size, index, diff)

    check()


def fallback_resize(img: np.ndarray, size: tuple[int, int], flip: bool) -> np.ndarray:
    """feedpipe's resize into CHW without the extension (OpenCV's or torch's)."""
    return without_extension(lambda: _resize.resize_to_tensor(img, size, flip=flip).numpy())


def assert_like_fallback(got: np.ndarray, src: np.ndarray, flip: bool, what: Any) -> None:
    """``got`` (3 x H x W) is the fallback's resize of ``src``: within one level where both axes
    grow or stay (OpenCV's bilinear, in fixed point either way), else exactly (torch's)."""
    want = fallback_resize(src, got.shape[1:], flip)
    diff = np.abs(got.astype(int) - want.astype(int)).max()
    enlarged = src.shape[0] <= got.shape[1] and src.shape[1] <= got.shape[2]
    assert diff <= (1 if enlarged else 0), (what, src.shape, got.shape, flip, diff)


@needs_jpegcrop
@pytest.mark.parametrize("examples", RUNS)
def test_decode_crop_into_is_decode_crop_then_the_resize(examples: int) -> None:
    ext = image_ops._jpegcrop

    @fuzz(examples)
    @given(jpeg=jpegs(), k=st.sampled_from([1, 2, 3, 4, 8, 9, 16]), flip=st.booleans(),
           out_h=st.integers(1, 48), out_w=st.integers(1, 48), data=st.data())
    def check(jpeg: tuple[bytes, str], k: int, flip: bool, out_h: int, out_w: int,
              data: st.DataObject) -> None:
        raw, what = jpeg
        size = header(raw)
        if size is None:
            return
        dh, dw = scaled(*size, k)
        box = data.draw(windows(dh, dw))
        window = crop(raw, box, k)
        row = np.full((3, out_h, out_w), 7, np.uint8)
        try:
            ext.decode_crop_into(raw, box.top, box.left, box.height, box.width, row, out_h,
                                 out_w, flip, k)
        except ValueError:
            assert window is None, (what, box, "decode_crop decoded it")
            assert (row == 7).all(), (what, "a failed decode wrote into the row")
            return
        assert window is not None, (what, box, "decode_crop refused it")
        want = np.empty_like(row)
        ext.resize_into(window, want, flip)
        assert np.array_equal(row, want), (what, k, box, flip)
        assert_like_fallback(row, window, flip, what)

    check()


@needs_jpegcrop
@pytest.mark.parametrize("examples", RUNS)
def test_resize_into_is_the_fallbacks_resize(examples: int) -> None:
    ext = image_ops._jpegcrop

    @fuzz(examples)
    @given(h=st.integers(1, 80), w=st.integers(1, 80), pad=st.integers(0, 5),
           out_h=st.integers(1, 80), out_w=st.integers(1, 80), flip=st.booleans(),
           simd=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**32 - 1))
    def check(h: int, w: int, pad: int, out_h: int, out_w: int, flip: bool, simd: int,
              seed: int) -> None:
        rng = np.random.default_rng(seed)
        wide = rng.integers(0, 256, (h, w + pad, 3), dtype=np.uint8)
        src = wide[:, pad // 2:pad // 2 + w]  # rows 3 * (w + pad) bytes apart
        out = np.empty((3, out_h, out_w), np.uint8)
        was = ext._use_simd(simd)
        try:
            ext.resize_into(src, out, flip)
        finally:
            ext._use_simd(was)
        plain = np.empty_like(out)
        was = ext._use_simd(0)
        try:
            ext.resize_into(src, plain, flip)
        finally:
            ext._use_simd(was)
        assert np.array_equal(out, plain), ("the vector code differs", simd)
        assert_like_fallback(out, src, flip, "resize_into")

    check()


# -- _packrows --


@st.composite
def gathers(draw: Any) -> tuple[Any, ...]:
    """Maps, pieces (valid, or one of them not: ``bad``) and the out array's size."""
    itemsize = draw(st.integers(1, 8))
    maps = tuple(np.frombuffer(draw(st.binary(min_size=0, max_size=200)), np.uint8)
                 for _ in range(draw(st.integers(1, 4))))
    pieces = []
    for _ in range(draw(st.integers(0, 12))):
        which = draw(st.integers(0, len(maps) - 1))
        n = len(maps[which])
        start = draw(st.integers(0, n))
        count = draw(st.integers(0, (n - start) // itemsize))
        pieces.append((which, start, count))
    room = sum(c for _, _, c in pieces) * itemsize
    bad = None
    if pieces and draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(pieces) - 1))
        which, start, count = pieces[i]
        n = len(maps[which])
        bad = draw(st.sampled_from(["map", "negative map", "start", "negative start", "count",
                                    "negative count", "room"]))
        pieces[i] = {"map": (len(maps), start, count), "negative map": (-1, start, count),
                     "start": (which, n + 1, 0), "negative start": (which, -1, count),
                     "count": (which, start, (n - start) // itemsize + 1),
                     "negative count": (which, start, -1), "room": pieces[i]}[bad]
    if bad == "room":
        if room == 0:
            bad = None
        else:
            room -= 1
    return maps, pieces, itemsize, room, bad


@needs_packrows
@pytest.mark.parametrize("examples", RUNS)
def test_gather_copies_what_numpy_slices_hold(examples: int) -> None:
    gather = _packed._packrows.gather

    @fuzz(examples)
    @given(case=gathers())
    def check(case: tuple[Any, ...]) -> None:
        maps, pieces, itemsize, room, bad = case
        which = np.array([p[0] for p in pieces], np.int64)
        start = np.array([p[1] for p in pieces], np.int64)
        count = np.array([p[2] for p in pieces], np.int64)
        out = np.full(room, 0xA5, np.uint8)
        if bad is not None:
            with pytest.raises(ValueError):
                gather(out, maps, which, start, count, itemsize)
            assert (out == 0xA5).all(), bad
            return
        got = gather(out, maps, which, start, count, itemsize)
        want = b"".join(maps[w][s:s + c * itemsize].tobytes() for w, s, c in pieces)
        assert got == sum(c for _, _, c in pieces)
        assert out.tobytes() == want

    check()


# -- _stagefiles --

NAME_CHARS = st.sampled_from(list("abcxyz019_-") + ["é", "ü", "水", " "])


@st.composite
def trees(draw: Any) -> tuple[list[tuple[str, bytes]], bool]:
    """Files of one top-level directory (relative paths and bytes) and whether labels are on:
    sizes around a tar block and the read's guess, empty ones, names around the ustar name
    field's 100 bytes, sidecars of one key, a subdirectory."""
    g = stagedir._GUESS
    files = {}
    for _ in range(draw(st.integers(1, 7))):
        stem = "".join(draw(st.lists(NAME_CHARS, min_size=1, max_size=draw(
            st.sampled_from([8, 40, 100])))))
        sub = draw(st.sampled_from(["", "", "s/"]))
        for ext in draw(st.lists(st.sampled_from(["bin", "jpg", "json", "txt"]), min_size=1,
                                 max_size=2, unique=True)):
            size = draw(st.one_of(st.sampled_from([1, 2, 511, 512, 513, g - 1, g, g + 1, 0]),
                                  st.integers(1, 3000)))
            files[f"t/{sub}{stem}.{ext}"] = bytes([len(files) % 251 + 1]) * size
    return sorted(files.items()), draw(st.booleans())


@needs_stagefiles
@pytest.mark.parametrize("examples", RUNS)
def test_the_c_staging_loop_stages_what_the_python_loop_stages(examples: int) -> None:
    @fuzz(max(1, examples // 2))  # (each example writes a tree to disk)
    @given(tree=trees())
    def check(tree: tuple[list[tuple[str, bytes]], bool]) -> None:
        files, labels = tree
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "src"
            for rel, body in files:
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(body)
            c, py = stage_both(root, "t", 0 if labels else None, root.parent)
            assert c == py, [rel for rel, _ in files]

    check()


# -- _stagefiles.image_sizes --

def png(w: int, h: int) -> bytes:
    """A PNG's signature and IHDR chunk (no more: only the header is read)."""
    return b"\x89PNG\r\n\x1a\n" + b"\0\0\0\x0dIHDR" + w.to_bytes(4, "big") + h.to_bytes(4, "big")


def jpeg_head(w: int, h: int, marker: int) -> bytes:
    """A JPEG's markers up to a frame header ``marker`` (0xC4: not a start of frame), with an
    APP0 segment, fill bytes and a restart marker before it."""
    app0 = b"\xff\xe0\x00\x10JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    return (b"\xff\xd8" + app0 + b"\xff\xff" + b"\xff\xd0" + bytes([0xFF, marker, 0, 17, 8])
            + h.to_bytes(2, "big") + w.to_bytes(2, "big") + b"\x03" + bytes(9) + b"\xff\xd9")


def webp(w: int, h: int, chunk: str) -> bytes:
    """A WebP's RIFF header and first ``chunk``'s size fields (``ALPH``: one not read)."""
    head = b"RIFF" + bytes(4) + b"WEBP" + chunk.encode()
    if chunk == "VP8 ":
        return head + bytes(10) + (w & 0xFFFF).to_bytes(2, "little") + (h & 0xFFFF).to_bytes(
            2, "little")
    if chunk == "VP8L":
        v = (w - 1) & 0x3FFF | ((h - 1) & 0x3FFF) << 14
        return head + bytes(5) + v.to_bytes(4, "little")
    return head + bytes(8) + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")


SIDE32 = st.one_of(st.integers(0, 70000), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))


@st.composite
def image_members(draw: Any) -> bytes:
    """One member's bytes: a valid header of each format read without Pillow (sizes around
    zero, the 14/16/24-bit fields and int32's edge), one Pillow reads (TIFF), then perhaps
    truncated, mangled or replaced by random bytes."""
    side = st.one_of(st.sampled_from([0, 1, 16383, 16384, 65535, 65536]), st.integers(0, 70000))
    w, h = draw(side), draw(side)
    kind = draw(st.sampled_from(["png", "jpeg", "webp", "gif", "bmp", "tiff", "random", "empty"]))
    if kind == "png":
        data = png(draw(SIDE32), draw(SIDE32))
    elif kind == "jpeg":
        data = jpeg_head(w % 65536, h % 65536, draw(st.sampled_from([0xC0, 0xC2, 0xC4, 0xCF])))
    elif kind == "webp":
        data = webp(max(w, 1) % 2**24, max(h, 1) % 2**24,
                    draw(st.sampled_from(["VP8 ", "VP8L", "VP8X", "ALPH"])))
    elif kind == "gif":
        data = b"GIF89a" + (w % 65536).to_bytes(2, "little") + (h % 65536).to_bytes(2, "little")
    elif kind == "bmp":
        bh = draw(st.one_of(st.integers(-70000, 70000), st.just(-2**31)))
        data = (b"BM" + bytes(16) + (w - 35000).to_bytes(4, "little", signed=True)
                + bh.to_bytes(4, "little", signed=True))
    elif kind == "tiff":
        from PIL import Image

        f = io.BytesIO()
        Image.new("L", (w % 50 + 1, h % 50 + 1)).save(f, format="TIFF")
        data = f.getvalue()
    elif kind == "random":
        data = draw(st.binary(max_size=64))
    else:
        data = b""
    damage = draw(st.sampled_from(["none", "none", "truncate", "mangle"]))
    if damage == "truncate" and data:
        # (often at a length one of the parsers checks for)
        data = data[:draw(st.one_of(st.integers(0, len(data)), st.sampled_from(
            [len(data) - 1, 2, 6, 9, 10, 11, 12, 15, 16, 23, 24, 25, 26, 29, 30])))]
    elif damage == "mangle" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at + 1:]
    return data


def python_outcome(buffer: bytes, idx: Any, members: list[int]) -> Any:
    """The Python path's sizes and unread count, or the type of what it raised."""
    try:
        got, unread = image_sizes.python_sizes(buffer, idx, members)
        return list(got), unread
    except Exception as e:  # noqa: BLE001 (the same error is what the C path must give)
        return type(e)


def c_outcome(buffer: bytes, idx: Any) -> Any:
    """``index_sizes`` (the C parse, Python for what it lists) as :func:`python_outcome`."""
    try:
        got, unread = image_sizes.index_sizes(buffer, idx)
        return list(got), unread
    except Exception as e:  # noqa: BLE001
        return type(e)


@needs_stagefiles
@pytest.mark.filterwarnings("ignore::UserWarning")  # (Pillow's, on a mangled TIFF, both paths)
@pytest.mark.parametrize("examples", RUNS)
def test_c_image_sizes_are_what_python_reads(examples: int) -> None:
    @fuzz(5 * examples)
    @given(samples=st.lists(st.tuples(image_members(), st.sampled_from(
        [("jpg",), ("cls", "png"), ("txt",), ("webp", "json"), ("bmp",)])), max_size=8),
        cut=st.integers(0, 40))
    # the edges each parser checks: a GIF header one byte short, sizes int32 does not hold
    @example(samples=[(b"GIF89a\x01\x00\x01", ("jpg",)), (b"GIF87a\x02\x00\x03\x00", ("jpg",))],
             cut=30)
    @example(samples=[(png(2**31, 1), ("jpg",))], cut=30)
    @example(samples=[(b"BM" + bytes(16) + (5).to_bytes(4, "little")
                       + (-2**31).to_bytes(4, "little", signed=True), ("bmp",))], cut=30)
    @example(samples=[(png(7, 9)[:23], ("jpg",)), (jpeg_head(0, 5, 0xC0), ("jpg",)),
                      (webp(3, 4, "VP8L")[:24], ("jpg",))], cut=30)
    def check(samples: list[tuple[bytes, tuple[str, ...]]], cut: int) -> None:
        idx = ShardIndex([], [0], [], [], [], [])
        body = b""
        for n, (data, exts) in enumerate(samples):
            idx.keys.append(f"k{n}")
            for e in exts:
                member = data if e not in ("cls", "txt", "json") else b"1"
                body += bytes(3)  # (members not at the buffer's start)
                idx.exts.append(e)
                idx.offsets.append(len(body))
                idx.sizes.append(len(member))
                idx.names.append(f"k{n}.{e}")
                body += member
            idx.starts.append(len(idx.exts))
        # the last member may run past the end of the map (cut), as a memoryview slice is cut
        buffer = body[:max(0, len(body) - cut)] if cut < 20 else body
        members = image_sizes.image_members(idx)
        assert c_outcome(buffer, idx) == python_outcome(buffer, idx, members)

    check()
