"""Image-caption pairs (``feedpipe.ImageText``) against a reference written plainly, one sample at
a time, on data no one here made.

The corpus: five of Pillow's own test images (``tests/corpora/pillow``) paired with the ten real
COCO val2014 captions of ``tests/corpora/coco_captions`` (five COCO images' captions, one to four
each; they describe COCO's photos, not these images: the pairing is arbitrary, the texts and
pixels are real). The reference: Pillow's ``Image.open(...).convert("RGB")``, the centred square,
Pillow's bilinear resize where the image is not already the output size; the tokenizer's own
``encode(caption).ids``, cut and padded by the rule ImageText documents; the caption drawn by the
hash the docs give, written here again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from _corpora import CORPORA, PILLOW, pillow_pixels, sha256, vendored
from hypothesis import given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe import (
    DecodeError,
    FeedDataset,
    FeedLoader,
    FunctionIndex,
    ImagePipeline,
    ImageSpec,
    ImageText,
)

tokenizers = pytest.importorskip("tokenizers")
PIL = pytest.importorskip("PIL")

COCO = CORPORA / "coco_captions"
IMAGES = ["hopper.jpg", "hopper.png", "hopper.webp", "hopper_gray.jpg", "flower2.webp"]
SIZE = 128
MAX_LEN = 12


def coco_captions() -> list[tuple[int, list[str]]]:
    """The vendored COCO captions grouped by image, in the order of their first caption."""
    data = json.loads((COCO / "captions_val2014.json_samples.json").read_text())
    groups: dict[int, list[str]] = defaultdict(list)
    for a in data["annotations"]:
        groups[a["image_id"]].append(a["caption"])
    return list(groups.items())


def test_the_vendored_captions_are_the_upstream_bytes():
    for name, digest in vendored(COCO).items():
        assert sha256(COCO / name) == digest, name


def trained_tokenizer():
    """A BPE tokenizer trained here on the captions, which wraps each caption in [BOS] ... [EOS]
    (as CLIP's does), so the end token of a cut caption is visible."""
    from tokenizers import models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [c for _, cs in coco_captions() for c in cs]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[BOS]", "[EOS]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 2), ("[EOS]", 3)])
    return tok


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    trained_tokenizer().save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A folder with sidecars: ``NAME.EXT`` (the image), ``NAME.txt`` (its captions, one a line),
    ``NAME.json`` (COCO's image id)."""
    root = tmp_path_factory.mktemp("pairs")
    for (image_id, captions), name in zip(coco_captions(), IMAGES):
        stem, ext = name.rsplit(".", 1)
        (root / f"{stem}_{ext}.{ext}").write_bytes((PILLOW / name).read_bytes())
        (root / f"{stem}_{ext}.txt").write_text("\n".join(captions) + "\n")
        (root / f"{stem}_{ext}.json").write_text(json.dumps({"coco_image_id": image_id}))
    return root


@pytest.fixture(scope="module")
def shards(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "pairs"
    feedpipe.shard(str(source), str(out), max_samples=2)
    return str(out)


def pipeline() -> ImagePipeline:
    return ImagePipeline.from_spec(ImageSpec(size=SIZE, train=False, crop_fraction=1.0,
                                             mean=None), label_field=None)


def pairs(tokenizer, **kw) -> ImageText:
    return ImageText(pipeline(), tokenizer, max_len=MAX_LEN, pad_id=0, end_id=3, **kw)


# -- the reference, one sample at a time ------------------------------------------------------

def reference_draw(seed: int, epoch: int, index: int, n: int) -> int:
    if n == 1:
        return 0
    d = hashlib.blake2b(f"feedpipe-caption\0{seed}\0{epoch}\0{index}".encode(),
                        digest_size=16).digest()
    return int.from_bytes(d, "little") % n


def reference_pixels(data: bytes) -> np.ndarray:
    """CHW uint8: Pillow's pixels, centred square, Pillow's bilinear resize to SIZE."""
    from PIL import Image

    img = pillow_pixels(data)
    h, w = img.shape[:2]
    side = min(h, w)
    img = img[(h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side]
    if side != SIZE:
        img = np.asarray(Image.fromarray(img).resize((SIZE, SIZE), Image.BILINEAR))
    return np.ascontiguousarray(img.transpose(2, 0, 1))


def reference_ids(tok, caption: str, max_len: int, end_id: int | None) -> tuple[list, list]:
    ids = tok.encode(caption).ids
    if len(ids) > max_len:
        ids = ids[:max_len] if end_id is None else ids[:max_len - 1] + [end_id]
    return ids + [0] * (max_len - len(ids)), [1] * len(ids) + [0] * (max_len - len(ids))


def reference(source: Path, key: str, seed: int, epoch: int, index: int, tok) -> dict:
    name = next(p for p in source.iterdir() if p.stem == key and p.suffix not in (".txt",
                                                                                   ".json"))
    captions = [c for c in (source / f"{key}.txt").read_text().splitlines() if c.strip()]
    which = reference_draw(seed, epoch, index, len(captions))
    ids, mask = reference_ids(tok, captions[which], MAX_LEN, 3)
    return {"pixels": reference_pixels(name.read_bytes()), "ids": ids, "mask": mask,
            "caption": which}


def assert_pixels_close(got: np.ndarray, want: np.ndarray, key: str) -> None:
    """Pillow's pixels: exactly where no resize is needed (the decoders agree on these files),
    within one grey level where torch's antialiased bilinear and Pillow's differ in rounding."""
    assert got.shape == want.shape, key
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, key


def check_against_reference(samples, source, tok, seed, epoch):
    for s in samples:
        ref = reference(source, s["key"], seed, epoch, s["index"], tok)
        assert s["input_ids"].tolist() == ref["ids"], s["key"]
        assert s["attention_mask"].tolist() == ref["mask"], s["key"]
        assert s["caption"] == ref["caption"], s["key"]
        assert_pixels_close(s["image"].numpy(), ref["pixels"], s["key"])


class Keyed:
    """ImageText's output with the sample's key, global id and the pid that made it (picklable
    into the workers)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, sample):
        out = self.inner(sample)
        out.update(key=sample["__key__"], index=sample["__index__"], pid=os.getpid())
        return out


def unbatch(batches) -> list[dict]:
    rows = []
    for b in batches:
        for i in range(len(b["key"])):
            rows.append({k: (v[i] if k != "caption" else int(v[i])) for k, v in b.items()})
    return rows


# -- the tests --------------------------------------------------------------------------------

def test_images_of_the_output_size_give_pillows_pixels_exactly(shards, tokenizer_json):
    ds = FeedDataset(shards, shuffle=False, transform=Keyed(pairs(tokenizer_json)))
    got = {s["key"]: s for s in ds}
    for name in IMAGES[:4]:  # the 128 x 128 ones
        image = got[name.replace(".", "_")]["image"].numpy()
        assert np.array_equal(image, reference_pixels((PILLOW / name).read_bytes())), name


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_match_the_reference(shards, source, tokenizer_json, workers):
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    ds = FeedDataset(shards, seed=7, transform=Keyed(pairs(tokenizer_json)))
    loader = FeedLoader(ds, batch_size=2, num_workers=workers)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        rows = unbatch(loader)
        assert sorted(r["key"] for r in rows) == sorted(
            f"{n.rsplit('.', 1)[0]}_{n.rsplit('.', 1)[1]}" for n in IMAGES)
        check_against_reference(rows, source, tok, seed=7, epoch=epoch)
        pids = {int(r["pid"]) for r in rows}
        if workers:
            assert os.getpid() not in pids and len(pids) == 2
        else:
            assert pids == {os.getpid()}


def test_the_caption_drawn_follows_seed_epoch_and_sample(shards, tokenizer_json):
    """Same seed, epoch and sample: the same caption, in a loader of 0 or 2 workers; other
    epochs: other captions for the sample with four."""
    def drawn(epoch, workers, seed=3):
        ds = FeedDataset(shards, seed=seed, transform=Keyed(pairs(tokenizer_json)))
        loader = FeedLoader(ds, batch_size=2, num_workers=workers)
        loader.set_epoch(epoch)
        return {r["key"]: r["caption"] for r in unbatch(loader)}

    assert drawn(0, 0) == drawn(0, 2)
    four = [drawn(epoch, 0)["hopper_webp"] for epoch in range(8)]  # 322141: four captions
    assert len(set(four)) > 1 and all(0 <= c < 4 for c in four)


def test_resume_mid_epoch_gives_exactly_the_rest(shards, tokenizer_json):
    def loader():
        ds = FeedDataset(shards, seed=5, transform=Keyed(pairs(tokenizer_json)))
        return FeedLoader(ds, batch_size=2, num_workers=2)

    whole = loader()
    whole.set_epoch(1)
    want = unbatch(whole)
    first = loader()
    first.set_epoch(1)
    it = iter(first)
    seen = unbatch([next(it)])
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    rest = unbatch(again)
    got = seen + rest
    assert [r["key"] for r in got] == [r["key"] for r in want]
    for a, b in zip(got, want):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["caption"] == b["caption"]
        assert torch.equal(a["image"], b["image"])


def test_a_long_caption_keeps_its_end_token_or_is_cut_plainly(tokenizer_json):
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    caption = "This is a blue and white bathroom with a wall sink and a lifesaver on the wall."
    full = tok.encode(caption).ids
    assert len(full) > 6
    sample = {"__key__": "k", "__index__": 0, "txt": caption.encode(),
              "png": (PILLOW / "hopper.png").read_bytes()}
    with_end = ImageText(pipeline(), tokenizer_json, max_len=6, end_id=3)(sample)
    assert with_end["input_ids"].tolist() == full[:5] + [3]
    plain = ImageText(pipeline(), tokenizer_json, max_len=6)(sample)
    assert plain["input_ids"].tolist() == full[:6]
    assert plain["attention_mask"].tolist() == [1] * 6
    roomy = ImageText(pipeline(), tokenizer_json, max_len=40, pad_id=0, end_id=3)(sample)
    assert roomy["input_ids"].tolist() == full + [0] * (40 - len(full))
    assert roomy["attention_mask"].tolist() == [1] * len(full) + [0] * (40 - len(full))


def test_captions_as_a_json_list_and_a_callable_tokenizer():
    words: dict[str, int] = {}

    def tokenize(texts):
        return [[words.setdefault(w, len(words) + 1) for w in t.split()] for t in texts]

    pair = ImageText(pipeline(), tokenize, max_len=4)
    base = {"__key__": "k", "png": (PILLOW / "hopper.png").read_bytes(),
            "txt": json.dumps(["one two", "three four five six seven"]).encode()}
    seen = set()
    for epoch in range(10):
        out = pair({**base, "__index__": 4, "__epoch__": epoch})
        want = tokenize([json.loads(base["txt"])[out["caption"]]])[0][:4]
        assert out["input_ids"].tolist() == want + [0] * (4 - len(want))
        seen.add(out["caption"])
    assert seen == {0, 1}


def test_a_sample_without_a_caption_is_named(tokenizer_json):
    pair = pairs(tokenizer_json)
    png = (PILLOW / "hopper.png").read_bytes()
    with pytest.raises(DecodeError, match="'nocap'.*no 'txt' caption field"):
        pair({"__key__": "nocap", "__shard__": "s.tar", "__index__": 0, "png": png})
    with pytest.raises(DecodeError, match="'blank'.*holds no caption"):
        pair({"__key__": "blank", "__index__": 0, "png": png, "txt": b"\n  \n"})
    with pytest.raises(ValueError, match="label_field=None"):
        ImageText(ImagePipeline(SIZE), tokenizer_json, max_len=4)


def test_tokenisation_is_memoised_by_a_function_index(shards, tokenizer_json, tmp_path):
    with FunctionIndex(str(tmp_path / "memo")) as index:
        ds = FeedDataset(shards, seed=1, transform=Keyed(pairs(tokenizer_json, cache=index)))
        plain = FeedDataset(shards, seed=1, transform=Keyed(pairs(tokenizer_json)))
        first = unbatch(FeedLoader(ds, batch_size=2))
        assert index.counts() == (0, len(IMAGES))
        again = unbatch(FeedLoader(ds, batch_size=2))  # the same epoch: the same captions
        assert index.counts() == (len(IMAGES), len(IMAGES))
        want = unbatch(FeedLoader(plain, batch_size=2))
        for a, b, c in zip(first, again, want):
            assert a["input_ids"].tolist() == b["input_ids"].tolist() == c["input_ids"].tolist()


def test_shards_written_by_webdataset_read_as_pairs(source, tokenizer_json, tmp_path):
    """jpg + txt + json samples written by webdataset's own TarWriter, adopted by feedpipe.index,
    read as the folder's are."""
    wds = pytest.importorskip("webdataset")
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    out = tmp_path / "wds"
    out.mkdir()
    keys = []
    with wds.TarWriter(str(out / "pairs-000000.tar")) as sink:
        for p in sorted(source.glob("*.jpg")):
            keys.append(p.stem)
            sink.write({"__key__": p.stem, "jpg": p.read_bytes(),
                        "txt": (source / f"{p.stem}.txt").read_text(),
                        "json": json.loads((source / f"{p.stem}.json").read_text())})
    feedpipe.index(str(out))
    ds = FeedDataset(str(out), seed=2, transform=Keyed(pairs(tokenizer_json)))
    rows = unbatch(FeedLoader(ds, batch_size=2))
    assert sorted(r["key"] for r in rows) == sorted(keys)
    check_against_reference(rows, source, tok, seed=2, epoch=0)


def test_a_table_with_image_bytes_and_captions_shards_into_pairs(source, tokenizer_json,
                                                                  tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    names = sorted(p for p in source.iterdir() if p.suffix not in (".txt", ".json"))
    table = datasets.Dataset.from_dict({
        "key": [p.stem for p in names],
        "image": [{"bytes": p.read_bytes(), "path": None} for p in names],
        "caption": [(source / f"{p.stem}.txt").read_text() for p in names]},
        features=datasets.Features({"key": datasets.Value("string"), "image": datasets.Image(),
                                    "caption": datasets.Value("string")}))
    feedpipe.shard_from(table, str(tmp_path / "from-table"), columns={"caption": "txt"})
    ds = FeedDataset(str(tmp_path / "from-table"), seed=4,
                     transform=Keyed(pairs(tokenizer_json)))
    rows = unbatch(FeedLoader(ds, batch_size=2))
    assert sorted(r["key"] for r in rows) == sorted(p.stem for p in names)
    check_against_reference(rows, source, tok, seed=4, epoch=0)


def test_the_folder_shards_keep_each_pairs_metadata(shards):
    got = {s["__key__"]: s for s in FeedDataset(shards, shuffle=False)}
    for (image_id, _), name in zip(coco_captions(), IMAGES):
        key = name.replace(".", "_")
        assert json.loads(bytes(got[key]["json"])) == {"coco_image_id": image_id}
        assert set(got[key]) >= {"txt", "json", name.rsplit(".", 1)[1]}



def test_a_table_whose_image_column_holds_paths_shards_the_files_bytes(source, tokenizer_json,
                                                                       tmp_path):
    """A string column of file paths, cast to ``datasets.Image(decode=False)`` as the docs say
    (no bytes in the table): the shards hold each file's bytes, read as the folder's pairs."""
    datasets = pytest.importorskip("datasets")
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    names = sorted(p for p in source.iterdir() if p.suffix not in (".txt", ".json"))
    table = datasets.Dataset.from_dict({
        "key": [p.stem for p in names], "image_path": [str(p) for p in names],
        "caption": [(source / f"{p.stem}.txt").read_text() for p in names]})
    table = table.cast_column("image_path", datasets.Image(decode=False))
    assert table[0]["image_path"]["bytes"] is None
    feedpipe.shard_from(table, str(tmp_path / "paths"), columns={"caption": "txt"})
    ds = FeedDataset(str(tmp_path / "paths"), seed=6, transform=Keyed(pairs(tokenizer_json)))
    rows = unbatch(FeedLoader(ds, batch_size=2))
    assert sorted(r["key"] for r in rows) == sorted(p.stem for p in names)
    check_against_reference(rows, source, tok, seed=6, epoch=0)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), index=st.integers(0, 2**40), n=st.integers(1, 9))
def test_the_draw_is_in_range_repeatable_and_varies_over_epochs(seed, index, n):
    from feedpipe.transforms._image_text import caption_draw

    draws = [caption_draw(seed, epoch, index, n) for epoch in range(40)]
    assert all(0 <= d < n for d in draws)
    assert draws == [caption_draw(seed, epoch, index, n) for epoch in range(40)]
    assert draws == [reference_draw(seed, epoch, index, n) for epoch in range(40)]
    if n > 1:  # 40 draws all alike has probability n**-39
        assert len(set(draws)) > 1


def _drop_pid(rows):
    return [{k: v for k, v in r.items() if k != "pid"} for r in rows]


def _same_rows(got, want):
    assert [r["key"] for r in got] == [r["key"] for r in want]
    for a, b in zip(got, want):
        assert a["caption"] == b["caption"] and int(a["index"]) == int(b["index"])
        for k in ("image", "input_ids", "attention_mask"):
            assert torch.equal(a[k], b[k]), (a["key"], k)


@pytest.mark.parametrize("kw", [dict(transform_threads=2), dict(num_workers=2)])
def test_every_route_gives_the_inline_routes_batches(shards, tokenizer_json, kw):
    def rows(**kw):
        ds = FeedDataset(shards, seed=9, transform=Keyed(pairs(tokenizer_json)))
        loader = FeedLoader(ds, batch_size=2, **kw)
        loader.set_epoch(2)
        return _drop_pid(unbatch(loader)), loader.route.name

    want, inline = rows()
    got, route = rows(**kw)
    assert inline == "samples" and route != inline
    _same_rows(got, want)


def test_a_state_from_two_workers_resumes_on_none(shards, tokenizer_json):
    def loader(workers):
        ds = FeedDataset(shards, seed=5, transform=Keyed(pairs(tokenizer_json)))
        return FeedLoader(ds, batch_size=2, num_workers=workers)

    whole = loader(0)
    whole.set_epoch(3)
    want = _drop_pid(unbatch(whole))
    first = loader(2)
    first.set_epoch(3)
    it = iter(first)
    seen = unbatch([next(it)])
    state = first.state_dict()
    del it
    again = loader(0)
    again.load_state_dict(state)
    _same_rows(_drop_pid(seen + unbatch(again)), want)


def test_worker_processes_fill_one_function_index(shards, tokenizer_json, tmp_path):
    with FunctionIndex(str(tmp_path / "memo")) as index:
        ds = FeedDataset(shards, seed=1, transform=Keyed(pairs(tokenizer_json, cache=index)))
        rows = unbatch(FeedLoader(ds, batch_size=2, num_workers=2))
        assert len({int(r["pid"]) for r in rows} - {os.getpid()}) == 2
        assert index.stats().entries == len({r["input_ids"].numpy().tobytes() for r in rows})


def test_a_parquet_file_of_image_bytes_and_captions_shards_into_pairs(source, tokenizer_json,
                                                                      tmp_path):
    """A Parquet file written by pyarrow (a binary image column, a string caption column)
    through ``feedpipe.shard``, as ``feedpipe shard data.parquet OUT`` converts it."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    names = sorted(p for p in source.iterdir() if p.suffix not in (".txt", ".json"))
    pq.write_table(pa.table({
        "key": [p.stem for p in names],
        "image": pa.array([p.read_bytes() for p in names], type=pa.binary()),
        "caption": [(source / f"{p.stem}.txt").read_text() for p in names]}),
        str(tmp_path / "pairs.parquet"))
    feedpipe.shard(str(tmp_path / "pairs.parquet"), str(tmp_path / "from-parquet"),
                   columns={"caption": "txt"})
    ds = FeedDataset(str(tmp_path / "from-parquet"), seed=8,
                     transform=Keyed(pairs(tokenizer_json)))
    rows = unbatch(FeedLoader(ds, batch_size=2))
    assert sorted(r["key"] for r in rows) == sorted(p.stem for p in names)
    check_against_reference(rows, source, tok, seed=8, epoch=0)
