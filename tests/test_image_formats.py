"""Images as people have them: every format and mode (written as real files with OpenCV, Pillow,
simplejpeg, pillow-heif) decodes to three RGB channels, through ``decode_image`` and
``ImagePipeline``; the image field is chosen from a list; a mixed JPEG/PNG/WebP dataset streams
through FeedLoader; a corrupt image is a DecodeError naming the sample, or SampleSkipped with
``on_error="skip"``."""

from __future__ import annotations

import io
import os
import sys
from typing import Any

import numpy as np
import pytest
import torch
from _images import Case, H, W, cases, have_pillow_heif, picture, write_files

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe.errors import DecodeError, MissingDependencyError, SampleSkipped
from feedpipe.stream._collator import BatchCollator
from feedpipe.transforms._decode import (
    IMAGE_FIELDS,
    DecodeImage,
    decode_image,
    image_decoders,
    image_format,
    image_size,
)
from feedpipe.transforms._pipeline import ImagePipeline

pytest.importorskip("PIL", reason="the expected pixels come from Pillow (the images extra)")

CASES = cases()
OPTIONAL = {"avif": "Pillow without its AVIF plugin", "heic": "pillow-heif is not installed"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The cases as files in a temp dir, read back: the decoders see what a disk holds."""
    paths = write_files(str(tmp_path_factory.mktemp("formats")), CASES)
    out = {}
    for name, path in paths.items():
        with open(path, "rb") as f:
            out[name] = f.read()
    return out


def all_case_names() -> list[object]:
    names: list[object] = list(CASES)
    for name, reason in OPTIONAL.items():
        if name not in CASES:  # an optional decoder missing here: say so
            names.append(pytest.param(name, marks=pytest.mark.skip(reason=reason)))
    return names


def sample(data: bytes, field: str = "png", index: int = 0, **extra: object) -> dict:
    return {"__key__": f"cls_1/img{index}", "__shard__": "data-000003.tar", "__index__": index,
            "__epoch__": 2, field: data, "cls": b"1", **extra}


# -- decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", all_case_names())
def test_every_format_and_mode_decodes_to_three_rgb_channels(files: dict[str, bytes],
                                                             name: str) -> None:
    case: Case = CASES[name]
    img = decode_image(memoryview(files[name]))  # a shard's zero-copy view, as samples have
    assert img.shape == (H, W, 3) and img.dtype == np.uint8 and img.flags.writeable
    diff = np.abs(img.astype(np.int16) - case.expected.astype(np.int16))
    assert int(diff.max()) <= case.tolerance, name
    if case.lossless_of_picture:  # alpha dropped (not composited), 16 bits -> the high byte
        assert np.array_equal(img, picture())


def test_formats_are_read_from_the_bytes_and_sizes_from_the_headers(
        files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert image_format(data) == name.split("-")[0], name
        if name.split("-")[0] in ("jpeg", "png", "webp"):  # lossy alpha WebP is VP8X, too
            assert image_size(data) == (H, W), name
    assert image_format(b"") == image_format(b"GIF89a...") == "unknown"
    ftyp = b"\x00\x00\x00\x1cftyp"
    assert image_format(ftyp + b"avif\x00\x00\x00\x00mif1miaf") == "avif"
    assert image_format(ftyp + b"mif1\x00\x00\x00\x00mif1avif") == "avif"
    assert image_format(ftyp + b"mif1\x00\x00\x00\x00mif1heic") == "heic"
    assert image_format(ftyp + b"heic\x00\x00\x00\x00mif1heic") == "heic"
    with pytest.raises(DecodeError, match="cannot read the size of an image of unknown format"):
        image_size(b"GIF89a" + bytes(40))


def test_exif_orientation_is_not_applied(files: dict[str, bytes]) -> None:
    """Pixels as stored: OpenCV would rotate a PNG or WebP with an EXIF orientation of 6 (90
    degrees) unless told not to; the JPEG path never reads it."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6
    saves: list[tuple[str, dict[str, Any]]] = [("JPEG", {"quality": 95}), ("PNG", {}),
                                              ("WEBP", {"lossless": True})]
    for fmt, kw in saves:
        buf = io.BytesIO()
        Image.fromarray(picture()).save(buf, fmt, exif=exif.tobytes(), **kw)
        with Image.open(io.BytesIO(buf.getvalue())) as im:
            assert im.getexif()[0x0112] == 6  # the tag is there
        img = decode_image(buf.getvalue())
        assert img.shape == (H, W, 3), fmt
        if fmt != "JPEG":
            assert np.array_equal(img, picture()), fmt
        pipe = ImagePipeline(24, mean=None, label_field=None)
        plain = files["jpeg-rgb" if fmt == "JPEG" else "png-rgb"]
        if fmt != "JPEG":
            assert torch.equal(pipe(sample(buf.getvalue())), pipe(sample(plain)))


def test_decode_image_op_and_the_decoder_report() -> None:
    png = CASES["png-rgba"].data
    assert np.array_equal(DecodeImage()(png), picture())
    report = image_decoders()
    assert report["png"] == report["webp"] == "opencv"
    assert report["jpeg"] in ("feedpipe._native._jpegcrop", "simplejpeg")
    assert (report["avif"] is not None) == ("avif" in CASES or report["avif"] == "opencv")
    assert (report["heic"] == "pillow-heif") == have_pillow_heif()


# -- ImagePipeline ----------------------------------------------------------------------------
@pytest.mark.parametrize("train", [True, False])
def test_pipeline_gives_one_tensor_for_every_lossless_encoding(files: dict[str, bytes],
                                                               train: bool) -> None:
    """PNG RGB, RGBA, 16-bit, WebP lossless with and without alpha: the same pixels, so the same
    crop, flip and tensor (the geometry depends on the sample's seed and the image size only)."""
    pipe = ImagePipeline(24, train=train)
    names = [n for n, c in CASES.items() if c.lossless_of_picture]
    assert len(names) >= 6
    for index in range(4):
        ref, label = pipe(sample(files["png-rgb"], index=index))
        assert ref.shape == (3, 24, 24) and ref.dtype == torch.float32 and label == 1
        for name in names:
            assert torch.equal(pipe(sample(files[name], index=index))[0], ref), (name, index)
        # a JPEG of the same picture: the same crop, pixels within JPEG's loss
        jpeg = pipe(sample(files["jpeg-rgb"], index=index))[0]
        assert float((jpeg - ref).abs().mean()) < 0.1  # ~ 6 grey levels / (255 * 0.225)


@pytest.mark.parametrize("name", all_case_names())
def test_into_writes_what_call_returns_for_every_format(files: dict[str, bytes],
                                                        name: str) -> None:
    pipe = ImagePipeline(20, train=True, mean=None)
    s = sample(files[name], index=5)
    row = torch.full(pipe.out_shape, 7, dtype=pipe.out_dtype)
    assert pipe.into(s, row) == 1
    assert torch.equal(row, pipe(s)[0])


def test_image_field_default_takes_the_first_image_field_present(
        files: dict[str, bytes]) -> None:
    pipe = ImagePipeline(16, train=False, mean=None, label_field=None)
    assert pipe.image_field == IMAGE_FIELDS == ("jpg", "jpeg", "png", "webp", "avif", "heic",
                                                "heif", "bmp", "tif", "tiff", "ppm", "pgm")
    png, webp, jpg = files["png-rgb"], files["webp-lossless"], files["jpeg-rgb"]
    from_png = pipe(sample(png, "png"))
    assert torch.equal(pipe(sample(webp, "webp")), from_png)  # same pixels
    assert torch.equal(pipe(sample(png, "jpg")), from_png)  # a PNG stored as .jpg
    both = sample(jpg, "jpg", png=png)
    assert torch.equal(pipe(both), pipe(sample(jpg, "jpg")))  # jpg comes first
    assert torch.equal(ImagePipeline(16, train=False, mean=None, label_field=None,
                                     image_field=("png", "jpg"))(both), from_png)
    assert torch.equal(pipe(sample(png, "png", jpg=None)), from_png)  # None counts as absent
    only = ImagePipeline(16, train=False, mean=None, label_field=None, image_field="webp")
    assert only.image_field == ("webp",)
    with pytest.raises(DecodeError, match=r"'cls_1/img0' of 'data-000003.tar': has no 'webp' "
                                          r"field \(it has \['cls', 'jpg', 'png'\]\)"):
        only(both)
    with pytest.raises(DecodeError, match=r"has no image field \(looked for 'jpg', 'jpeg', "
                                          r"'png', 'webp', 'avif', 'heic', 'heif', 'bmp', "
                                          r"'tif', 'tiff', 'ppm', 'pgm'\)"):
        pipe(sample(png, "gif"))
    for bad in ((), "", ("png", 3)):
        with pytest.raises(ValueError, match="image_field"):
            ImagePipeline(16, image_field=bad)  # type: ignore[arg-type]
    again = eval(repr(only), {"ImagePipeline": ImagePipeline,
                              "ImageSpec": feedpipe.transforms._pipeline.ImageSpec})
    assert again.image_field == ("webp",) and again.on_error == "raise"


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An ImageFolder tree mixing JPEG, PNG (RGB, RGBA, palette, 16-bit, grey) and WebP, sharded
    by `feedpipe.shard`."""
    root = tmp_path_factory.mktemp("mixed")
    src = root / "src"
    names = ["jpeg-rgb", "png-rgb", "png-rgba", "jpeg-grey", "png-palette", "webp-lossy",
             "png-rgb16", "webp-lossless-alpha", "jpeg-cmyk", "png-grey"]
    for i, name in enumerate(names):
        write_files(str(src / f"class_{i % 2}"), {f"{name}-{i:02d}": CASES[name]})
    out = str(root / "shards")
    feedpipe.shard(str(src), out, max_samples=4, labels_from_dirs=True, workers=1,
                   show_progress=False)
    return out


def test_mixed_formats_in_one_batch_through_feedloader(mixed_dataset: str) -> None:
    pipe = ImagePipeline(20, train=True, mean=None)
    raw = list(FeedDataset(mixed_dataset, seed=3))
    assert {k for s in raw for k in s if not k.startswith("__")} == {"jpg", "png", "webp", "cls"}
    want = torch.stack([pipe(s)[0] for s in raw])
    labels = [int(bytes(s["cls"])) for s in raw]
    batches = list(FeedLoader(FeedDataset(mixed_dataset, seed=3, transform=pipe), batch_size=4))
    assert torch.equal(torch.cat([x for x, _ in batches]), want)
    assert torch.cat([y for _, y in batches]).tolist() == labels
    # the in-place route: ImagePipeline.into rows of a BatchCollator's buffers
    collator = BatchCollator(4, pipe.out_shape, pipe.out_dtype)
    rows = list(FeedLoader(FeedDataset(mixed_dataset, seed=3, transform=pipe), batch_size=4,
                           collate_fn=collator))
    assert torch.equal(torch.cat([x for x, _ in rows]), want)
    assert any({"png", "jpg"} <= {k for s in raw[i:i + 4] for k in s} for i in (0, 4, 8))


# -- bad images ------------------------------------------------------------------------------
def corrupt_cases() -> dict[str, bytes]:
    png = bytearray(CASES["png-rgb"].data)
    png[60] ^= 0xFF  # inside the image data: its CRC no longer matches
    out = {"garbage": b"definitely not an image", "empty": b"",
           "jpeg-truncated": CASES["jpeg-rgb"].data[:300],
           "png-truncated": CASES["png-rgba"].data[: len(CASES["png-rgba"].data) // 2],
           "png-damaged": bytes(png),
           "webp-truncated": CASES["webp-lossy"].data[:40],
           "webp-lossless-truncated": CASES["webp-lossless"].data[:-20]}
    for name in ("avif", "heic"):
        if name in CASES:
            out[f"{name}-truncated"] = CASES[name].data[:len(CASES[name].data) // 2]
    return out


@pytest.mark.parametrize("name", list(corrupt_cases()))
def test_a_corrupt_image_is_a_decode_error_naming_the_sample(name: str) -> None:
    data = corrupt_cases()[name]
    pipe = ImagePipeline(16)
    with pytest.raises(DecodeError) as raised:
        pipe(sample(data, "png", index=7))
    e = raised.value
    assert type(e) is DecodeError  # not SampleSkipped: the default stops the epoch
    assert str(e).startswith("sample 'cls_1/img7' of 'data-000003.tar': ")
    assert any(w in str(e) for w in ("corrupt", "not a decodable JPEG", "nor another format"))
    assert str(e).endswith("(ImagePipeline(on_error='skip') leaves such samples out of their "
                           "batch)")
    skip = ImagePipeline(16, on_error="skip")
    with pytest.raises(SampleSkipped) as skipped:
        skip(sample(data, "png", index=7))
    # the same message, less the advice to skip
    assert isinstance(skipped.value, DecodeError) and str(e).startswith(str(skipped.value) + " (")


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_into_raises_before_writing_into_the_row(on_error: str) -> None:
    pipe = ImagePipeline(16, mean=None, on_error=on_error)
    for data, label in [(corrupt_cases()["png-truncated"], b"1"),
                        (corrupt_cases()["jpeg-truncated"], b"1"),
                        (CASES["png-rgb"].data, b"not a number")]:
        row = torch.full(pipe.out_shape, 7, dtype=torch.uint8)
        with pytest.raises(SampleSkipped if on_error == "skip" else DecodeError,
                           match="'cls_1/img0' of 'data-000003.tar'"):
            pipe.into(sample(data, "png", cls=label), row)
        assert bool((row == 7).all())


def test_skip_covers_a_missing_image_and_a_bad_label_too() -> None:
    skip = ImagePipeline(16, on_error="skip")
    with pytest.raises(SampleSkipped, match="has no image field"):
        skip(sample(CASES["png-rgb"].data, "txt"))
    with pytest.raises(SampleSkipped, match="'cls' field is not an integer label"):
        skip(sample(CASES["png-rgb"].data, "png", cls=b"cat"))
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        ImagePipeline(16, on_error="warn")


def test_heic_without_its_decoder_names_the_pip_line_and_is_never_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    heic = CASES["heic"].data if "heic" in CASES else (
        b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64))
    monkeypatch.setitem(sys.modules, "pillow_heif", None)  # import pillow_heif -> ImportError
    for on_error in ("raise", "skip"):
        with pytest.raises(MissingDependencyError,
                           match=r"pip install 'feedpipe\[images\]'") as raised:
            ImagePipeline(16, on_error=on_error)(sample(heic, "heic"))
        assert not isinstance(raised.value, DecodeError)


def test_pipeline_modules_import_no_pillow_or_opencv_until_a_non_jpeg_image() -> None:
    import subprocess

    code = ("import sys\nfrom feedpipe import ImagePipeline\n"
            "assert not {'PIL', 'cv2', 'pillow_heif'} & set(sys.modules), sys.modules.keys()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.abspath(__file__)), check=False)
    assert r.returncode == 0, r.stderr
