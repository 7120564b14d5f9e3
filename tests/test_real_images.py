"""Image data as users bring it (issue 34, "Images and image trees"): an ILSVRC-style tree with
upper-case extensions and stray files in its class folders, a forgotten --labels-from-dirs,
JPEGs with stray bytes, decoder outputs of every shape, animated PNGs, corrupt images under
DALI, and the decoders' own lines on stderr. Pixels are compared with Pillow's."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import run_feedpipe
from PIL import Image

from feedpipe import (
    DecodeError,
    EmptyEpochError,
    FeedDataset,
    FeedLoader,
    ImagePipeline,
    ShardWriter,
    shard,
)
from feedpipe._helpers import fork_safety
from feedpipe.diagnostics._pipeline import ImageDecode, image_fields
from feedpipe.format._image_fields import fields_present, image_extension, image_field_of
from feedpipe.format._verify import verify
from feedpipe.transforms._decode import _rgb8, decode_image, image_decoders
from feedpipe.transforms._opencv import quiet_stderr

CLASSES = ["n01440764", "n01443537", "n01484850"]


def _picture(seed: int, h: int = 28, w: int = 36) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 6 + seed * 40, yy * 8, (xx + yy + seed * 17) * 3], -1).astype(np.uint8)


def _encode(img: np.ndarray, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt, **kw)
    return buf.getvalue()


def _pil_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")).astype(int)


def ilsvrc_tree(root: Path, *, clutter: bool = False, lower: bool = False) -> dict[str, int]:
    """Class folders of ``.JPEG`` files (as ILSVRC's train tree), one ``.PNG`` and one ``.JPG``;
    with ``clutter`` also the files a real class folder collects. Returns each image's key ->
    class index."""
    labels = {}
    for c, name in enumerate(CLASSES):
        d = root / name
        d.mkdir(parents=True)
        for i in range(4):
            ext, fmt = [("JPEG", "JPEG"), ("JPEG", "JPEG"), ("PNG", "PNG"), ("JPG", "JPEG")][i]
            ext = ext.lower() if lower else ext
            (d / f"{name}_{i}.{ext}").write_bytes(_encode(_picture(c * 4 + i), fmt))
            labels[f"{name}/{name}_{i}"] = c
    if clutter:
        (root / CLASSES[0] / "notes.txt").write_text("downloaded from the mirror\n")
        (root / CLASSES[0] / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + bytes(60))
        (root / CLASSES[1] / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
        (root / CLASSES[1] / "placeholder").write_bytes(b"")
        (root / CLASSES[2] / "empty.txt").write_bytes(b"")
        # a sidecar beside an image is a field of its sample, not a file to leave out
        (root / CLASSES[2] / f"{CLASSES[2]}_0.json").write_text('{"box": [1, 2, 3, 4]}')
    return labels


def _trained(out: Path, on_error: str, **kw: object) -> dict[str, int]:
    """Every sample an epoch of FeedLoader + ImagePipeline delivers: key -> label."""
    ds = FeedDataset(str(out), transform=lambda s: (pipe(s), s["__key__"]))
    pipe = ImagePipeline(16, on_error=on_error, **kw)  # type: ignore[arg-type]
    got: dict[str, int] = {}
    for (images, labels), keys in FeedLoader(ds, batch_size=4):
        assert images.shape[1:] == (3, 16, 16)
        got.update(zip(keys, labels.tolist()))
    return got


# -- 1. field names from upper- and mixed-case extensions --------------------------------------
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_ilsvrc_tree_of_upper_case_extensions_trains_every_image(tmp_path: Path,
                                                                    on_error: str) -> None:
    labels = ilsvrc_tree(tmp_path / "train")
    out = tmp_path / "shards"
    r = run_feedpipe("shard", tmp_path / "train", out, "--labels-from-dirs")
    assert r.returncode == 0, r.stderr
    # the field names are the extensions as the files have them (the WebDataset rule)
    assert json.loads((out / "manifest.json").read_text())["fields"] == ["JPEG", "JPG", "PNG",
                                                                         "cls"]
    assert _trained(out, on_error) == labels  # every image, with its label


def test_upper_case_image_fields_decode_to_the_same_pixels(tmp_path: Path) -> None:
    img = _encode(_picture(3), "PNG")
    pipe = ImagePipeline(16, train=False)
    base = {"__key__": "k", "__shard__": "s", "cls": b"1"}
    want = pipe({**base, "png": img})
    for field in ("PNG", "Png", "pNg"):
        got = pipe({**base, field: img})
        assert torch.equal(got[0], want[0]) and got[1] == 1
    # an exact match wins over another case, and the list's order over the sample's
    assert image_field_of({"JPG": b"x", "jpg": b"y"}, ("jpg",)) == "jpg"
    assert image_field_of({"PNG": b"x", "Jpeg": b"y"}, ("jpg", "jpeg", "png")) == "Jpeg"
    assert image_field_of({"PNG": None, "cls": b"1"}, ("png",)) is None
    assert fields_present(["cls", "PNG", "jpg", "JPEG"], ("jpg", "jpeg", "png")) == [
        "jpg", "JPEG", "PNG"]
    assert image_extension("TIFF") == "other" and image_extension("txt") is None
    # the probe picks the same fields
    assert image_fields(["cls", "JPEG", "left.PNG"]) == ["JPEG", "left.PNG"]
    decoded = ImageDecode(["JPEG", "cls"])({"JPEG": _encode(_picture(1), "JPEG"), "cls": b"1"})
    assert decoded["JPEG"].shape == (28, 36, 3)


# -- 2. a class folder's files that are not images -------------------------------------------
@pytest.mark.parametrize("workers", [1, 3])
def test_class_folder_files_that_are_not_images_are_left_out_and_reported(
        tmp_path: Path, workers: int, caplog: pytest.LogCaptureFixture) -> None:
    labels = ilsvrc_tree(tmp_path / "train", clutter=True)
    out = tmp_path / "shards"
    with caplog.at_level(logging.WARNING, logger="feedpipe"):
        summary = shard(str(tmp_path / "train"), str(out), labels_from_dirs=True,
                        workers=workers, show_progress=False)
    left = ["n01440764/Thumbs.db", "n01440764/notes.txt", "n01443537/placeholder",
            "n01484850/empty.txt"]
    # then the hidden file, listed too (issue 41)
    hidden = [("n01443537/.DS_Store", "hidden file (its name starts with '.'): left out")]
    assert [s["path"] for s in summary.skipped_inputs] == left + [hidden[0][0]]
    assert summary.skipped == 5
    assert all("not an image file" in s["reason"] for s in summary.skipped_inputs[:4])
    assert [(s["path"], s["reason"]) for s in summary.skipped_inputs[4:]] == hidden
    m = json.loads((out / "manifest.json").read_text())
    assert [s["path"] for s in m["skipped"]] == left + [hidden[0][0]]
    assert m["total_samples"] == len(labels) == 12
    assert m["classes"] == CLASSES
    assert "left out 4 files" in caplog.text and "n01440764/notes.txt" in caplog.text
    assert _trained(out, "raise") == labels
    sidecar = [s for s in FeedDataset(str(out)) if s["__key__"] == "n01484850/n01484850_0"]
    assert bytes(sidecar[0]["json"]) == b'{"box": [1, 2, 3, 4]}'
    assert verify(str(out), show_progress=False).ok


def test_class_folders_without_images_keep_every_file(tmp_path: Path) -> None:
    """Class folders of other files (audio) are samples as before: nothing is left out."""
    src = tmp_path / "audio"
    for c in ("yes", "no"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            (src / c / f"{i}.wav").write_bytes(b"RIFF" + bytes([i]) * 40)
        (src / c / "notes.txt").write_text("recorded in March")
    summary = shard(str(src), str(tmp_path / "out"), labels_from_dirs=True,
                    show_progress=False)
    assert summary.skipped == 0 and summary.samples == 8
    assert verify(str(tmp_path / "out"), show_progress=False).ok
    (src / "no" / "empty.txt").write_bytes(b"")  # still a bad input there, not left out
    with pytest.raises(ValueError, match="no/empty.txt: zero-byte file"):
        shard(str(src), str(tmp_path / "again"), labels_from_dirs=True, show_progress=False)


def test_verify_refuses_an_image_folder_sample_without_an_image(tmp_path: Path) -> None:
    """What an earlier `shard --labels-from-dirs` made of a class folder's notes.txt."""
    out = tmp_path / "old"
    with ShardWriter(str(out)) as w:
        w.write({"__key__": "n01/a", "JPEG": _encode(_picture(0), "JPEG"), "cls": 0})
        w.write({"__key__": "n01/notes", "txt": b"hello", "cls": 0})
        w.write({"__key__": "n01/b", "JPEG": _encode(_picture(1), "JPEG"), "cls": 0})
    assert verify(str(out), show_progress=False).ok  # not an image-folder dataset: any fields
    path = out / "manifest.json"
    m = json.loads(path.read_text())
    m["created_by"]["options"] = {"labels_from_dirs": True}
    path.write_text(json.dumps(m))
    report = verify(str(out), show_progress=False)
    assert not report.ok
    [problem] = report.problems
    assert problem.kind == "no-image" and problem.key == "n01/notes"
    assert "--labels-from-dirs" in problem.message and "['txt', 'cls']" in problem.message
    r = run_feedpipe("verify", out)
    assert r.returncode != 0 and "n01/notes" in r.stdout + r.stderr


# -- 3. a forgotten --labels-from-dirs ---------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_forgetting_labels_from_dirs_names_the_option_and_an_empty_epoch_is_an_error(
        tmp_path: Path, workers: int) -> None:
    ilsvrc_tree(tmp_path / "train", lower=True)
    out = tmp_path / "shards"
    shard(str(tmp_path / "train"), str(out), show_progress=False)  # no --labels-from-dirs
    loader = FeedLoader(FeedDataset(str(out), transform=ImagePipeline(16)), batch_size=4)
    with pytest.raises(DecodeError, match="has no 'cls' field.*--labels-from-dirs") as e:
        list(loader)
    assert "on_error='skip'" not in str(e.value)  # skipping would leave every sample out
    skipping = FeedLoader(FeedDataset(str(out), transform=ImagePipeline(16, on_error="skip")),
                          batch_size=4, num_workers=workers)
    assert len(skipping) == 3
    with pytest.raises(EmptyEpochError, match="no batch.*3 batch.*12 samples skipped.*"
                                              "--labels-from-dirs"):
        for _ in skipping:
            pytest.fail("a batch of samples that have no label")
    assert skipping.stats()["parts"]["executor"] == ("workers" if workers else "inline")
    assert isinstance(EmptyEpochError("x"), RuntimeError)


# -- 4. JPEGs with stray bytes before a marker ---------------------------------------------
def _with_stray_bytes() -> dict[str, tuple[bytes, bytes]]:
    """JPEGs made by Pillow, with bytes inserted where libjpeg warns "N extraneous bytes
    before marker" and skips them; each with the JPEG it was made from."""
    img = _picture(5, 45, 62)
    base = _encode(img, "JPEG", quality=90)
    prog = _encode(img, "JPEG", quality=90, progressive=True)
    dht, sos = base.find(b"\xff\xc4"), base.find(b"\xff\xda")
    second_scan = prog.find(b"\xff\xda", prog.find(b"\xff\xda") + 2)
    before_sos = base[:sos] + b"\x11" + base[sos:]
    dht2 = before_sos.find(b"\xff\xc4")
    return {
        "before-dht": (base[:dht] + b"\x07\x07" + base[dht:], base),
        "before-sos": (before_sos, base),
        "between-scans": (prog[:second_scan] + b"\x05\x06\x07" + prog[second_scan:], prog),
        "two-places": (before_sos[:dht2] + b"\x01" + before_sos[dht2:], base),
    }


@pytest.mark.parametrize("name", sorted(_with_stray_bytes()))
def test_a_jpeg_with_stray_bytes_before_a_marker_decodes_as_pillow_does(name: str) -> None:
    data, made_from = _with_stray_bytes()[name]
    want = _pil_rgb(data)  # Pillow (libjpeg) skips the bytes, with a warning
    assert np.abs(decode_image(data).astype(int) - want).max() <= 1
    # the pipeline (header, window decode at reduced scale) gives the picture it was made from
    pipe = ImagePipeline(16, train=False, mean=None, label_field=None)
    sample = {"__key__": "k", "__shard__": "s"}
    assert torch.equal(pipe({**sample, "jpg": data}), pipe({**sample, "jpg": made_from}))


def test_a_truncated_jpeg_with_stray_bytes_is_still_refused() -> None:
    data = _with_stray_bytes()["before-sos"][0]
    with pytest.raises(DecodeError, match="not a decodable JPEG"):
        decode_image(data[:-120])
    with pytest.raises(DecodeError, match="Premature end"):
        decode_image(_with_stray_bytes()["before-sos"][1][:-120])


# -- 5. every decoder output shape -----------------------------------------------------------
def test_a_grey_pfm_decodes_like_pillow_and_a_bad_one_is_skipped(tmp_path: Path) -> None:
    grey = (np.mgrid[0:20, 0:30][1] * 8.5).astype(np.float32)  # 0..246.5
    pfm = cv2.imencode(".pfm", grey)[1].tobytes()
    img = decode_image(pfm)
    assert img.shape == (20, 30, 3) and img.dtype == np.uint8
    assert np.abs(img.astype(int) - _pil_rgb(pfm)).max() <= 1  # Pillow truncates, OpenCV rounds
    out = tmp_path / "pfm"
    with ShardWriter(str(out)) as w:
        w.write({"__key__": "good", "pfm": pfm, "cls": 0})
        w.write({"__key__": "bad", "pfm": pfm[:40], "cls": 1})
    got = _trained(out, "skip", image_field="pfm")
    assert got == {"good": 0}


@pytest.mark.parametrize("shape,dtype", [((9, 7), np.uint8), ((9, 7, 1), np.uint8),
                                         ((9, 7, 2), np.uint8), ((9, 7, 4), np.uint8),
                                         ((9, 7, 3), np.uint16), ((9, 7), np.float32),
                                         ((9, 7, 4), np.uint16)])
def test_every_decoder_output_shape_becomes_three_8_bit_channels(shape: tuple[int, ...],
                                                                 dtype: type) -> None:
    rng = np.random.default_rng(1)
    top = 65535 if dtype == np.uint16 else 255
    arr = rng.integers(0, top, shape).astype(dtype)
    out = _rgb8(arr, b"", "png")
    assert out.shape == (9, 7, 3) and out.dtype == np.uint8
    eight = arr >> 8 if dtype == np.uint16 else arr
    grey = eight if len(shape) == 2 else eight[:, :, 0]
    want = eight[:, :, :3] if len(shape) == 3 and shape[2] >= 3 else np.stack([grey] * 3, -1)
    assert np.array_equal(out, want.astype(np.uint8))


def test_a_decoder_output_of_another_shape_is_a_decode_error() -> None:
    for bad in (np.zeros((4, 4, 5), np.uint8), np.zeros((0, 4, 3), np.uint8),
                np.zeros((2, 2, 2, 3), np.uint8), np.zeros((4, 4), np.complex64)):
        with pytest.raises(DecodeError, match="decoder gave"):
            _rgb8(bad, b"", "png")


# -- 6. animated PNGs ----------------------------------------------------------------------
def _apng(**kw: object) -> bytes:
    frames = [Image.fromarray(_picture(i, 10, 12)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "PNG", save_all=True, append_images=frames[1:], **kw)
    return buf.getvalue()


@pytest.mark.parametrize("kw", [{"default_image": True}, {},
                                {"default_image": True, "disposal": 1, "blend": 1}])
def test_an_animated_png_decodes_to_pillows_default_image(kw: dict[str, object]) -> None:
    data = _apng(**kw)
    assert np.array_equal(decode_image(data), _pil_rgb(data).astype(np.uint8))
    assert np.array_equal(decode_image(data), _picture(0, 10, 12))


def test_an_animated_png_without_pillow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from feedpipe import MissingDependencyError

    data = _apng(default_image=True)
    monkeypatch.setitem(sys.modules, "PIL", None)  # as where Pillow is not installed
    with pytest.raises(MissingDependencyError, match=r"APNG.*pip install 'feedpipe\[images\]'"):
        decode_image(data)


# -- 7. DALI on a corrupt image --------------------------------------------------------------
@pytest.fixture
def dali(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(fork_safety, "_marks", [])  # as in test_dali.py
    return pytest.importorskip("nvidia.dali", reason="nvidia.dali cannot be imported")


def _dataset_with_a_corrupt_jpeg(out: Path, bad: set[int]) -> None:
    with ShardWriter(str(out), max_samples=5) as w:
        for i in range(12):
            jpg = _encode(_picture(i), "JPEG")
            if i in bad:  # its header reads; its data stops short
                jpg = jpg[:jpg.find(b"\xff\xda") + 40]
            w.write({"__key__": f"s{i:02d}", "JPEG": jpg, "cls": i})


@pytest.mark.dali
@pytest.mark.skipif(importlib.util.find_spec("nvidia") is None, reason="no DALI")
def test_dali_names_a_sample_it_cannot_decode_and_can_skip_it(dali: object,
                                                              tmp_path: Path) -> None:
    from feedpipe import DaliStage
    from feedpipe.transforms._pipeline import ImageSpec

    out = tmp_path / "bad"
    _dataset_with_a_corrupt_jpeg(out, {6})
    spec = ImageSpec(size=16, train=False)

    def stage(on_error: str) -> DaliStage:
        return DaliStage(FeedLoader(FeedDataset(str(out)), batch_size=4), spec=spec,
                         device_id=None, on_error=on_error)

    with pytest.raises(DecodeError, match=r"sample 's06' of 'data-000001.tar'.*DALI cannot "
                                          r"decode.*on_error='skip'"):
        list(stage("raise"))
    skipping = stage("skip")
    labels = [b.labels.tolist() for b in skipping]
    assert labels == [[0, 1, 2, 3], [4, 5, 7], [8, 9, 10, 11]]  # in order, s06 left out
    assert skipping.skipped == 1


@pytest.mark.dali
@pytest.mark.skipif(importlib.util.find_spec("nvidia") is None, reason="no DALI")
def test_dali_skips_a_whole_batch_of_corrupt_images_and_unreadable_headers(
        dali: object, tmp_path: Path) -> None:
    from feedpipe import DaliStage
    from feedpipe.transforms._pipeline import ImageSpec

    out = tmp_path / "bad"
    _dataset_with_a_corrupt_jpeg(out, {4, 5, 6, 7})
    loader = FeedLoader(FeedDataset(str(out)), batch_size=4)
    batches = [{**b, "JPEG": [j if i != 1 else j[:30] for i, j in enumerate(b["JPEG"])]}
               if b["__key__"][0] == "s00" else b for b in loader]  # s01: no header
    stage = DaliStage(batches, batch_size=4, spec=ImageSpec(size=16, train=False),
                      device_id=None, on_error="skip")
    assert [b.labels.tolist() for b in stage] == [[0, 2, 3], [8, 9, 10, 11]]
    assert stage.skipped == 5


@pytest.mark.dali
@pytest.mark.skipif(importlib.util.find_spec("nvidia") is None, reason="no DALI")
def test_dali_decodes_jpegs_with_stray_bytes_as_the_cpu_pipeline_does(dali: object) -> None:
    from feedpipe import DaliStage
    from feedpipe.transforms._pipeline import ImageSpec

    cases = _with_stray_bytes()
    names = sorted(cases)
    spec = ImageSpec(size=45, train=False, mean=None, crop_fraction=1.0)

    def first(which: int) -> torch.Tensor:
        batch = {"jpg": [cases[n][which] for n in names], "cls": [0] * 4, "__key__": names}
        return next(iter(DaliStage([batch], batch_size=4, spec=spec, device_id=None))).images

    assert torch.equal(first(0), first(1))  # as the JPEGs they were made from


# -- 8. the decoders' own lines on stderr ------------------------------------------------------
def test_a_corrupt_png_leaves_no_decoder_lines_on_stderr(capfd: pytest.CaptureFixture[str]
                                                        ) -> None:
    png = bytearray(cv2.imencode(".png", _picture(2))[1].tobytes())
    png[png.find(b"IDAT") + 20] ^= 0xFF  # a bad zlib stream
    for data in (bytes(png), bytes(png[:len(png) // 2])):
        with pytest.raises(DecodeError, match="cannot decode this PNG"):
            decode_image(data)
    err = capfd.readouterr().err
    assert "libpng" not in err and "WARN" not in err, err
    with quiet_stderr():  # what else is written meanwhile comes through
        os.write(2, b"libpng error: dropped\nkept line\n")
    assert capfd.readouterr().err == "kept line\n"


def test_an_opencv_error_message_leaves_no_blank_lines_on_stderr(
        capfd: pytest.CaptureFixture[str]) -> None:
    # OpenCV's error messages end in a newline, which its logger follows with another
    with quiet_stderr():
        os.write(2, b"[ERROR:0@0.027] global loadsave.cpp:1390 imdecode_ imdecode_(''): can't "
                    b"read data: OpenCV(5.0.0) error: (-2:Unspecified error) in function "
                    b"'readBlock'\n\nkept line\n\nlibpng error: dropped\n")
    assert capfd.readouterr().err == "kept line\n\n"


# -- 9. JPEG ICC segments libjpeg cannot read --------------------------------------------------
def _with_bad_icc() -> tuple[bytes, bytes]:
    """A JPEG made by Pillow with an ICC profile segment, and the same with that segment
    repeated after the frame header (libjpeg warns "bad ICC marker", as on Pillow's
    icc-after-SOF.jpg)."""
    base = _encode(_picture(3, 40, 56), "JPEG", quality=90, icc_profile=bytes(200))
    app2 = base.find(b"\xff\xe2")
    segment = base[app2:app2 + 2 + int.from_bytes(base[app2 + 2:app2 + 4], "big")]
    sof = base.find(b"\xff\xc0")
    after = sof + 2 + int.from_bytes(base[sof + 2:sof + 4], "big")
    return base[:after] + segment + base[after:], base


def test_a_jpeg_with_a_bad_icc_marker_decodes_as_pillow_does(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from feedpipe.transforms import _jpeg

    data, made_from = _with_bad_icc()
    monkeypatch.setattr(_jpeg, "_said", set())
    with caplog.at_level(logging.WARNING, logger="feedpipe"):
        assert np.abs(decode_image(data).astype(int) - _pil_rgb(data)).max() <= 1
        assert np.array_equal(decode_image(data), decode_image(made_from))
    assert [r.getMessage() for r in caplog.records if "ICC" in r.getMessage()] == [
        "feedpipe: a JPEG with ICC profile segments libjpeg cannot assemble (its \"bad ICC "
        "marker\" warning: a segment after the frame header, or a repeated or missing part) was "
        "decoded without them, to the pixels libjpeg and Pillow give (feedpipe applies no ICC "
        "profile) (said once per process)"]
    pipe = ImagePipeline(16, train=False, mean=None, label_field=None)
    sample = {"__key__": "k", "__shard__": "s"}
    assert torch.equal(pipe({**sample, "jpg": data}), pipe({**sample, "jpg": made_from}))
    with pytest.raises(DecodeError, match="not a decodable JPEG"):
        decode_image(data[:-100])  # still refused when truncated too
    dht = data.find(b"\xff\xc4")  # stray bytes before the bad ICC segment's warning, too
    both = data[:dht] + b"\x07\x07" + data[dht:]
    assert np.array_equal(decode_image(both), decode_image(made_from))
    assert np.array_equal(decode_image(both[:dht] + b"\x01" + both[dht:]),
                          decode_image(made_from))


# -- 10. GIF and TIFF: Pillow's pixels -------------------------------------------------------
def _transparent_gif() -> bytes:
    """A GIF whose transparent index (1, red) is not its background (0, green)."""
    index = np.zeros((4, 6), np.uint8)
    index[1:3, 1:5] = 1
    img = Image.fromarray(index, "P")
    img.putpalette([0, 255, 0, 255, 0, 0] + [0] * (3 * 254))
    buf = io.BytesIO()
    img.save(buf, "GIF", transparency=1, background=0)
    return buf.getvalue()


def _unassociated_alpha_tiff() -> bytes:
    return _encode(np.dstack([_picture(1, 8, 10), np.full((8, 10), 64, np.uint8)]), "TIFF")


def test_gif_transparency_and_tiff_alpha_keep_the_stored_colours() -> None:
    for data in (_transparent_gif(), _unassociated_alpha_tiff()):
        assert np.array_equal(decode_image(data), _pil_rgb(data))
    assert decode_image(_transparent_gif())[1, 1].tolist() == [255, 0, 0]
    assert image_decoders()["gif"] == image_decoders()["tiff"] == "pillow"
    assert np.array_equal(decode_image(_unassociated_alpha_tiff()), _picture(1, 8, 10))


def test_gif_and_tiff_without_pillow_are_opencvs_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from feedpipe.transforms import _decode

    gif, tiff = _transparent_gif(), _unassociated_alpha_tiff()
    monkeypatch.setitem(sys.modules, "PIL", None)  # as where Pillow is not installed
    monkeypatch.setattr(_decode, "_PILLOW", [])
    with caplog.at_level(logging.WARNING, logger="feedpipe"):
        gif = decode_image(gif)
        decode_image(tiff)
    assert gif[1, 1].tolist() == [0, 255, 0]  # OpenCV's: the background colour
    assert image_decoders()["gif"] == image_decoders()["tiff"] == "opencv"
    said = [r.getMessage() for r in caplog.records if "Pillow is not installed" in r.getMessage()]
    assert len(said) == 1 and "pip install 'feedpipe[images]'" in said[0], said


# -- 11. DALI on animated PNGs and bad ICC markers -------------------------------------------
@pytest.mark.dali
@pytest.mark.skipif(importlib.util.find_spec("nvidia") is None, reason="no DALI")
def test_dali_gives_an_animated_pngs_default_image_and_names_a_broken_one(dali: object) -> None:
    from feedpipe import DaliStage
    from feedpipe.transforms._pipeline import ImageSpec

    apng = _apng(default_image=True)  # default image: picture 0; animation: pictures 1 and 2
    bad_icc, made_from = _with_bad_icc()
    spec = ImageSpec(size=10, train=False, mean=None, crop_fraction=1.0)

    def first(jpg: bytes) -> torch.Tensor:
        batch = {"png": [apng, None], "jpg": [None, jpg], "cls": [0, 1], "__key__": ["a", "b"]}
        return next(iter(DaliStage([batch], batch_size=2, spec=spec, device_id=None))).images

    got = first(bad_icc)
    assert torch.equal(got[0], torch.from_numpy(_picture(0, 10, 12)[:, 1:11]).permute(2, 0, 1))
    assert torch.equal(got[1], first(made_from)[1])  # as the JPEG it was made from
    short = apng[:apng.find(b"IDAT") + 20]  # the default image's data stops short
    broken = {"png": [short, apng], "cls": [0, 1], "__key__": ["short", "whole"],
              "__shard__": ["s.tar", "s.tar"]}
    with pytest.raises(DecodeError, match=r"sample 'short' of 's.tar'"):
        next(iter(DaliStage([broken], batch_size=2, spec=spec, device_id=None)))
    skipping = DaliStage([broken], batch_size=2, spec=spec, device_id=None, on_error="skip")
    assert [b.labels.tolist() for b in skipping] == [[1]] and skipping.skipped == 1
