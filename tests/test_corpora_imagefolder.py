"""Differential test on an ImageNet-style tree: class folders of ``.JPEG`` files (the ILSVRC
train layout) with the strays real trees carry, sharded with ``feedpipe shard
--labels-from-dirs``, against torchvision's ``ImageFolder`` rule for which files are samples and
which label each gets.

torchvision does not import here, so the rule is written out below from its source
(``torchvision/datasets/folder.py``: ``find_classes``, ``make_dataset``,
``has_file_allowed_extension``, ``IMG_EXTENSIONS``): the classes are the top-level directories in
``sorted()`` order, numbered from 0; a class's samples are the files anywhere under its
directory whose lower-cased name ends with one of ``IMG_EXTENSIONS``; everything else is not a
sample. The image bytes are Pillow's test JPEGs (``tests/corpora/pillow``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _corpora import PILLOW, pillow_pixels
from conftest import run_feedpipe

from feedpipe import FeedDataset, ImagePipeline, ImageSpec, load_manifest, source_path
from feedpipe.format._image_fields import IMAGE_FIELDS, image_field_of

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def imagefolder_rule(root: Path) -> tuple[list[str], dict[str, int]]:
    """torchvision's ``ImageFolder`` on ``root``: its classes, and ``{relative path: label}``."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples: dict[str, int] = {}
    for label, name in enumerate(classes):
        for dirpath, _, fnames in sorted(os.walk(root / name, followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    rel = os.path.relpath(os.path.join(dirpath, fname), root)
                    samples[rel.replace(os.sep, "/")] = label
    return classes, samples


IMAGES = {  # ILSVRC-style names -> the Pillow test image whose bytes they hold
    "n01440764/n01440764_10026.JPEG": "hopper.jpg",
    "n01440764/n01440764_10027.JPEG": "hopper_gray.jpg",
    "n01440764/n01440764_10029.JPEG": "pil_sample_cmyk.jpg",
    "n01443537/n01443537_10007.JPEG": "flower.jpg",
    "n01443537/n01443537_10014.JPEG": "app13-multiple.jpg",
    "n01443537/extra/n01443537_2.JPEG": "hopper_orientation_6.jpg",  # a nested folder
    "n01484850/n01484850_10016.jpeg": "hopper_16bit_qtables.jpg",
    "n01484850/n01484850_10036.JPG": "hopper.jpg",
    "n01484850/n01484850_4515.png": "hopper.png",
}
STRAYS = {  # what real class folders also hold
    "n01440764/Thumbs.db": b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504),
    "n01443537/notes.txt": b"collected from the web, 2012\n",
}
# feedpipe ignores hidden files (as ImageFolder does this one: it is no image)
HIDDEN = {"n01484850/.DS_Store": b"\x00\x00\x00\x01Bud1" + bytes(24)}


def _tree(root: Path, strays: bool = True) -> Path:
    for rel, name in IMAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PILLOW / name, root / rel)
    if strays:
        for rel, data in {**STRAYS, **HIDDEN}.items():
            (root / rel).write_bytes(data)
    return root


def _shard(src: Path, out: Path) -> tuple[str, bool]:
    """``feedpipe shard --labels-from-dirs`` as a user runs it: what it said, and whether it
    refused. Leaving the strays
    out (with a report naming them) and refusing (naming them) are both right; after a refusal
    the user takes the strays away and runs it again."""
    r = run_feedpipe("shard", src, out, "--labels-from-dirs", "--workers", "1",
                     "--no-progress")
    said = r.stdout + r.stderr
    if r.returncode != 0:
        for rel in STRAYS:
            (src / rel).unlink()
        shutil.rmtree(out, ignore_errors=True)
        again = run_feedpipe("shard", src, out, "--labels-from-dirs", "--workers", "1",
                             "--no-progress")
        assert again.returncode == 0, again.stderr
    return said, r.returncode != 0


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, bool]:
    root = tmp_path_factory.mktemp("imagenet")
    src = _tree(root / "train")
    said, refused = _shard(src, root / "shards")
    return src, root / "shards", said, refused


def test_the_strays_are_named(sharded: tuple[Path, Path, str, bool]) -> None:
    """Issue 34 (non-image files in class folders): left out with a report naming each, or
    refused naming one (the first it met, say)."""
    _, _, said, refused = sharded
    named = [rel for rel in STRAYS if Path(rel).name in said]
    if refused:
        assert named, f"feedpipe shard refused without naming a stray:\n{said}"
    else:
        assert named == list(STRAYS), f"feedpipe shard left the strays out, naming {named}:\n{said}"


def test_a_tree_without_strays_gets_imagefolders_labels(tmp_path: Path) -> None:
    src = _tree(tmp_path / "train", strays=False)
    classes, want = imagefolder_rule(src)
    r = run_feedpipe("shard", src, tmp_path / "shards", "--labels-from-dirs", "--workers", "1",
                     "--no-progress")
    assert r.returncode == 0, r.stderr
    assert load_manifest(str(tmp_path / "shards")).classes == classes
    got = {}
    for s in FeedDataset(str(tmp_path / "shards")):
        (field,) = [k for k in s if not k.startswith("__") and k != "cls"]
        got[source_path(str(s["__key__"]), field)] = int(bytes(s["cls"]))
    assert got == want


def test_the_samples_and_labels_are_imagefolders(sharded: tuple[Path, Path, str, bool]) -> None:
    """Issue 34 (non-image files in class folders): the strays are not samples."""
    src, out, _, _ = sharded
    classes, want = imagefolder_rule(src)
    assert load_manifest(str(out)).classes == classes
    got = {}
    for s in FeedDataset(str(out)):
        fields = sorted(k for k in s if not k.startswith("__") and k != "cls")
        assert len(fields) == 1, (s["__key__"], fields)
        got[source_path(str(s["__key__"]), fields[0])] = int(bytes(s["cls"]))
    assert got == want


def test_every_image_of_the_tree_reaches_training(
        sharded: tuple[Path, Path, str, bool]) -> None:
    """Issue 34 (``.JPEG`` field names): the default ImagePipeline reads every image, upper-case
    extensions included, with ImageFolder's label and Pillow's pixels (an evaluation crop of
    the whole shorter side, at its own size)."""
    src, out, _, _ = sharded
    _, want = imagefolder_rule(src)
    seen = {}
    for s in FeedDataset(str(out)):
        (field,) = [k for k in s if not k.startswith("__") and k != "cls"]
        rel = source_path(str(s["__key__"]), field)
        if rel not in want:
            continue  # a stray: test_the_samples_and_labels_are_imagefolders
        ref = pillow_pixels((src / rel).read_bytes())
        side = min(ref.shape[:2])
        pipe = ImagePipeline.from_spec(ImageSpec(size=side, train=False, crop_fraction=1.0,
                                                 mean=None))
        image, label = pipe(s)
        top, left = (ref.shape[0] - side) // 2, (ref.shape[1] - side) // 2
        crop = ref[top:top + side, left:left + side].astype(int)
        assert abs(image.permute(1, 2, 0).numpy().astype(int) - crop).max() <= 3, rel
        seen[rel] = label
    assert seen == want


# Issue 41: images sharing a stem in a class folder (photo.bmp, photo.jpg, photo.png) are one
# sample, whose image ImagePipeline takes is one of them, where ImageFolder counts each; the
# warning named one example
SAME_STEM = {
    "n01440764/photo.jpg": "hopper.jpg",
    "n01440764/photo.png": "hopper.png",
    "n01440764/photo.bmp": "hopper.bmp",
    "n01440764/other.jpg": "flower.jpg",
    "n01443537/x.JPEG": "hopper_gray.jpg",
    "n01443537/x.png": "hopper.png",
    "n01443537/y.jpg": "hopper.jpg",
}


@pytest.mark.parametrize("method", ["one-pass", "general"])
def test_every_sample_of_several_images_is_named(tmp_path: Path, method: str) -> None:
    """Each image ImageFolder counts is either the image a sample trains with or named, with
    its sample, in the summary, --json and the manifest."""
    src = tmp_path / "train"
    for rel, name in SAME_STEM.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PILLOW / name, src / rel)
    _, want = imagefolder_rule(src)
    assert len(want) == 7
    out = tmp_path / "shards"
    r = run_feedpipe("shard", src, out, "--labels-from-dirs", "--workers", "2", "--method",
                     method, "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["method"] == method
    several = [
        {"key": "n01440764/photo", "taken": "n01440764/photo.jpg",
         "images": ["n01440764/photo.bmp", "n01440764/photo.jpg", "n01440764/photo.png"]},
        {"key": "n01443537/x", "taken": "n01443537/x.png",
         "images": ["n01443537/x.JPEG", "n01443537/x.png"]},
    ]
    assert s["several_images"] == several
    assert load_manifest(str(out)).created_by["several_images"] == several
    trained = set()
    for x in FeedDataset(str(out)):
        field = image_field_of(x, IMAGE_FIELDS)
        assert field is not None
        trained.add(source_path(str(x["__key__"]), field))
    named = {p for e in several for p in e["images"] if p != e["taken"]}
    assert trained | named == set(want) and not trained & named
    text = run_feedpipe("shard", src, tmp_path / "text", "--labels-from-dirs", "--workers", "2",
                        "--method", method, "--no-progress")
    assert text.returncode == 0, text.stderr
    assert "  several           2   samples of two or more images, one of them trained " \
        "(listed in manifest.json)" in text.stdout, text.stdout
    for e in several:
        assert f"  several images: {' + '.join(e['images'])}: trains with {e['taken']}" \
            in text.stdout, text.stdout
