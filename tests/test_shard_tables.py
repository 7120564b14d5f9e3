"""Tables as a source: ``feedpipe shard`` of Parquet files written here with ``pyarrow``, and
``feedpipe.shard_from`` of a Hugging Face dataset built here from local files and dicts (nothing
is downloaded). Columns become fields by a printed, overridable mapping; class names come along."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
import webdataset as wds
from conftest import read_dataset, run_feedpipe, write_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe.errors import InputError, KeyClashError, MissingDependencyError
from feedpipe.format._manifest import load_manifest

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (the parquet extra)")
pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (the parquet extra)")


def _jpeg(i: int) -> bytes:
    img = np.full((8, 8, 3), i * 20 % 256, dtype=np.uint8)
    return bytes(simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB"))


def _png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (i, 2 * i, 3 * i)).save(buf, format="PNG")
    return buf.getvalue()


def _table(n: int, start: int = 0) -> Any:
    labels = ["cat", "dog", "zebra"]
    return pa.table({
        "id": [f"img-{i:03d}" for i in range(start, start + n)],
        "image": pa.array([_jpeg(i) for i in range(start, start + n)], pa.binary()),
        "label": pa.DictionaryArray.from_arrays(
            pa.array([i % 3 for i in range(start, start + n)], pa.int8()), pa.array(labels)),
        "caption": [f"a photo {i}" if i % 4 else None for i in range(start, start + n)],
        "score": [i / 4 for i in range(start, start + n)],
        "flag": [i % 2 == 0 for i in range(start, start + n)],
        "bbox": [[i, i + 1, 2, 3] for i in range(start, start + n)],
    })


def _samples(root: Path) -> list[tuple[str, dict[str, bytes]]]:
    return [(str(s["__key__"]), {k: v for k, v in s.items() if not k.startswith("__")})
            for s in read_dataset(root)]  # type: ignore[misc]


def test_a_parquet_file_becomes_samples_by_a_printed_mapping(tmp_path: Path) -> None:
    src = tmp_path / "train.parquet"
    pq.write_table(_table(10), src, row_group_size=4)
    out = tmp_path / "o"
    r = run_feedpipe("shard", src, out, "--max-samples", "4", "--columns", "id=__key__")
    assert r.returncode == 0, r.stderr
    for line in ["column   id -> __key__   (--columns)",
                 "column   image -> jpg   (bytes, field by each row's format: JPG in the first "
                 "row)",
                 "column   label -> cls   (categories as class names)",
                 "column   caption -> caption   (text)", "column   score -> score",
                 "column   flag -> flag   (0/1)", "column   bbox -> bbox.json   (JSON text)",
                 "classes  3 from column 'label'", "rows             10"]:
        assert f"\n  {line}" in r.stdout, (line, r.stdout)
    assert "rows/s" in r.stdout
    m = load_manifest(str(out))
    assert m.classes == ["cat", "dog", "zebra"] and m.total_samples == 10
    assert [s.samples for s in m.shards] == [4, 4, 2]
    assert m.created_by["columns"]["image"] == "jpg"
    got = _samples(out)
    assert got[1] == ("img-001", {"jpg": _jpeg(1), "cls": b"1", "caption": b"a photo 1",
                                  "score": b"0.25", "flag": b"0",
                                  "bbox.json": b"[1, 2, 2, 3]"})
    assert "caption" not in got[0][1]  # a null is no field
    # the webdataset library reads the same samples
    urls = [str(out / rec.name) for rec in m.shards]
    theirs = [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
              for s in wds.WebDataset(urls, shardshuffle=False)]
    assert theirs == got


def test_a_directory_of_parquet_files_and_column_overrides(tmp_path: Path) -> None:
    src = tmp_path / "table"
    src.mkdir()
    t = _table(6).drop_columns(["id"])
    pq.write_table(t.slice(0, 4), src / "part-0.parquet")
    pq.write_table(t.slice(4), src / "part-1.parquet")
    out = tmp_path / "o"
    s = feedpipe.shard(str(src), str(out), columns="caption=txt,score=,bbox=,flag=",
                       workers=1)
    assert s.method == "table" and s.samples == 6 and s.files == 6
    assert "column   score -> (dropped)   (--columns)" in s.columns
    got = _samples(out)
    assert [k for k, _ in got] == [f"part-0/{i:08d}" for i in range(4)] + [
        f"part-1/{i:08d}" for i in range(2)]
    assert set(got[1][1]) == {"jpg", "cls", "txt"} and got[5][1]["cls"] == b"2"
    with pytest.raises(InputError, match=r"columns 'image' and 'caption' would both become "
                                         r"field 'jpg'.*--columns"):
        feedpipe.shard(str(src), str(tmp_path / "o2"), columns="caption=jpg")
    with pytest.raises(InputError, match=r"no column 'img'; the columns are 'image', 'label'"):
        feedpipe.shard(str(src), str(tmp_path / "o3"), columns="img=jpg")


def test_an_integer_label_with_class_names_and_bad_rows(tmp_path: Path) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"png": pa.array([_png(i) for i in range(5)], pa.binary()),
                             "label": pa.array([0, 1, 2, 5, 1], pa.int64())}), src)
    with pytest.raises(InputError, match=r"t\.parquet: row 3: .*class index 5 is outside the "
                                         r"3 class names.*--on-error skip"):
        feedpipe.shard(str(src), str(tmp_path / "o1"), classes="a,b,c")
    s = feedpipe.shard(str(src), str(tmp_path / "o2"), classes=["a", "b", "c"], on_error="skip")
    assert s.samples == 4 and len(s.skipped_inputs) == 1
    assert s.skipped_inputs[0]["path"].endswith("t.parquet: row 3")
    m = load_manifest(str(tmp_path / "o2"))
    assert m.classes == ["a", "b", "c"] and m.fields == ["cls", "png"]
    assert m.skipped == s.skipped_inputs
    # without names: the integers as they are, no class list
    s = feedpipe.shard(str(src), str(tmp_path / "o3"))
    assert s.samples == 5 and load_manifest(str(tmp_path / "o3")).classes is None


def test_options_that_cannot_serve_a_table_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(_table(3), src)
    with pytest.raises(ValueError, match="Parquet source: --labels-from-dirs cannot apply"):
        feedpipe.shard(str(src), str(tmp_path / "o"), labels_from_dirs=True)
    tree = tmp_path / "tree"
    write_tree(tree, ["a/1.jpg"])
    with pytest.raises(ValueError, match="apply to Parquet sources"):
        feedpipe.shard(str(tree), str(tmp_path / "o"), columns="a=b")
    # a duplicate key column is named with both rows
    pq.write_table(pa.table({"key": ["x", "y", "x"], "txt": ["1", "2", "3"]}),
                   tmp_path / "d.parquet")
    with pytest.raises(KeyClashError, match=r"d\.parquet: row 2: duplicate sample key 'x'"):
        feedpipe.shard(str(tmp_path / "d.parquet"), str(tmp_path / "o4"))


def test_a_missing_pyarrow_names_the_pip_line(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(_table(2), src)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an install without it sees
    with pytest.raises(MissingDependencyError, match=r"pip install 'feedpipe\[parquet\]'"):
        feedpipe.shard(str(src), str(tmp_path / "o"))


# -------------------------------------------------------------------------------------------
# Hugging Face datasets


def test_shard_from_a_dataset_built_from_local_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (the hub extra)")
    paths = []
    for i in range(6):
        p = tmp_path / "imgs" / (f"{i}.png" if i % 2 else f"{i}.jpg")
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(_png(i) if i % 2 else _jpeg(i))
        paths.append(str(p))
    features = datasets.Features({
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=["cat", "dog"]),
        "text": datasets.Value("string"),
        "tokens": datasets.Sequence(datasets.Value("int32")),
    })
    ds = datasets.Dataset.from_dict({"image": paths, "label": [i % 2 for i in range(6)],
                                     "text": [f"t{i}" for i in range(6)],
                                     "tokens": [[i, i] for i in range(6)]}, features=features)
    out = tmp_path / "o"
    s = feedpipe.shard_from(ds, str(out), max_samples=4, columns={"image": "img"})
    assert s.samples == 6 and s.shards == 2 and s.method == "table"
    assert "column   label -> cls   (categories as class names)" in s.columns
    m = load_manifest(str(out))
    assert m.classes == ["cat", "dog"] and m.fields == ["cls", "img", "text", "tokens.json"]
    got = _samples(out)
    assert [k for k, _ in got] == [f"{i:08d}" for i in range(6)]
    for i, (_, fields) in enumerate(got):  # the encoded files, byte for byte, not decoded
        assert fields["img"] == Path(paths[i]).read_bytes()
        assert fields["cls"] == str(i % 2).encode()
        assert fields["tokens.json"] == f"[{i}, {i}]".encode()
    # images held as bytes in the dataset; the field is the format found (PNG)
    ds2 = datasets.Dataset.from_dict(
        {"image": [{"bytes": _png(i), "path": None} for i in range(3)]},
        features=datasets.Features({"image": datasets.Image()}))
    s = feedpipe.shard_from(ds2, str(tmp_path / "o2"))
    assert ("column   image -> png   (image, field by each row's format: PNG in the first "
            "row)") in s.columns
    assert [f["png"] for _, f in _samples(tmp_path / "o2")] == [_png(i) for i in range(3)]
    with pytest.raises(InputError, match=r"DatasetDict of splits \['test', 'train'\]; pass one"):
        feedpipe.shard_from(datasets.DatasetDict({"train": ds2, "test": ds2}),
                            str(tmp_path / "o3"))
    doc = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert doc["created_by"]["source"]["source"] == "datasets"


# -------------------------------------------------------------------------------------------
# each row's own image format; class names of a Hugging Face Parquet file; fields by case


def _tiff(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (i, i, i)).save(buf, format="TIFF")
    return buf.getvalue()


@pytest.mark.parametrize("first", ["tiff", "png"])
def test_each_rows_image_field_is_named_from_its_own_bytes(tmp_path: Path, first: str) -> None:
    """The field was the first row's format for every row: a TIFF first row sent JPEGs to a
    field 'image' that ImagePipeline ignores; a PNG first row stored JPEGs as '.png'."""
    make = {"tiff": _tiff, "png": _png, "jpg": _jpeg}
    kinds = [first, "jpg", "png", "jpg", "tiff"]
    blobs = [make[k](i) for i, k in enumerate(kinds)]
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), src)
    r = run_feedpipe("shard", src, tmp_path / "o")
    assert r.returncode == 0, r.stderr
    got = _samples(tmp_path / "o")
    assert [list(f) for _, f in got] == [[k] for k in kinds]
    assert [f[k] for (_, f), k in zip(got, kinds)] == blobs
    pipe = feedpipe.ImagePipeline(4)  # the JPEG and PNG rows decode where their format says
    for s in read_dataset(tmp_path / "o")[1:4]:
        pipe({**s, "cls": b"0"})


def test_the_cli_keeps_the_class_names_of_a_hugging_face_parquet_file(tmp_path: Path) -> None:
    """`shard_from` kept a ClassLabel's names; the same dataset saved as Parquet (names in the
    file's 'huggingface' metadata) lost them through `feedpipe shard`."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (the hub extra)")
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": _jpeg(i), "path": None} for i in range(4)],
         "label": [i % 3 for i in range(4)]},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=["cat", "dog", "emu"])}))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    r = run_feedpipe("shard", tmp_path / "train.parquet", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "classes  3 from column 'label'" in r.stdout
    assert load_manifest(str(tmp_path / "o")).classes == ["cat", "dog", "emu"]
    assert [f["cls"] for _, f in _samples(tmp_path / "o")] == [b"0", b"1", b"2", b"0"]
    feedpipe.shard_from(ds, str(tmp_path / "same"))
    assert load_manifest(str(tmp_path / "same")).classes == ["cat", "dog", "emu"]


def test_columns_equal_but_for_case_are_refused_naming_both(tmp_path: Path) -> None:
    """Columns 'A' and 'a' became fields that webdataset cannot read in one shard."""
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"A": ["x", "y"], "a": ["p", "q"]}), src)
    r = run_feedpipe("shard", src, tmp_path / "o")
    assert r.returncode != 0
    assert "columns 'A' and 'a' would both become fields 'A' and 'a', which differ only in " \
           "case" in r.stderr, r.stderr
    assert run_feedpipe("shard", src, tmp_path / "o2", "--columns", "a=a2").returncode == 0


def test_a_column_named_like_metadata_is_stored_under_a_field_it_can_be(tmp_path: Path) -> None:
    """Issue 41: a column between double underscores became a field of that name, which
    WebDataset takes for metadata (``__key__``): mapped, and never written. Sent there with
    --columns, it is refused."""
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"__meta__": ["x", "y"], "v": [1, 2], "____": [3, 4]}), src)
    r = run_feedpipe("shard", src, tmp_path / "o", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "column   __meta__ -> meta   (text)" in r.stdout
    assert "column   ____ -> field   (number as text)" in r.stdout
    assert [s for _, s in _samples(tmp_path / "o")] == [
        {"meta": b"x", "v": b"1", "field": b"3"}, {"meta": b"y", "v": b"2", "field": b"4"}]
    r = run_feedpipe("shard", src, tmp_path / "o2", "--columns", "v=__v__")
    assert r.returncode != 0
    assert "--columns: '__v__' cannot be a field name: a name between double underscores" \
        in r.stderr, r.stderr


@pytest.mark.parametrize("method", ["auto", "general"])
def test_hidden_files_of_a_parquet_directory_are_listed_as_left_out(tmp_path: Path,
                                                                     method: str) -> None:
    """Issue 41: as a tree's, a Parquet directory's hidden files (Spark's .crc checksums, a
    .DS_Store) are left out and each listed with its reason, a hidden directory once."""
    src = tmp_path / "table"
    (src / "y=1").mkdir(parents=True)
    pq.write_table(_table(3), src / "y=1" / "part-0.parquet")
    for rel in [".DS_Store", "y=1/.part-0.parquet.crc", ".cache/a.bin", ".cache/b/c.bin"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(b"x")
    s = feedpipe.shard(str(src), str(tmp_path / "o"), method=method, workers=1)
    assert s.samples == 3 and s.skipped == 3
    want = [(".DS_Store", "hidden file (its name starts with '.'): left out"),
            (".cache/", "hidden directory (its name starts with '.'): its 2 files left out"),
            ("y=1/.part-0.parquet.crc", "hidden file (its name starts with '.'): left out")]
    assert [(x["path"], x["reason"]) for x in s.skipped_inputs] == want
    m = load_manifest(str(tmp_path / "o"))
    assert [(x["path"], x["reason"]) for x in m.skipped] == want


_COLUMN_NAMES = st.sampled_from(
    ["__meta__", "__key__", "key", "index", "Index", "__index_level_0__", "__index_level_1__",
     "a b", "v", "V", ".x", "cls", "label", "____", "__url__", "jpg", "meta"])


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(_COLUMN_NAMES, min_size=1, max_size=5, unique=True),
       numbers=st.lists(st.booleans(), min_size=5, max_size=5))
def test_every_column_mapped_is_in_every_sample_or_the_table_is_refused(
        tmp_path: Path, names: list[str], numbers: list[bool]) -> None:
    """Issue 41 (invariant): whatever the column names, each column the printed mapping sends
    to a field is that field of every sample, holding the row's value as text (or the sample's
    key); else the conversion is refused, naming a column (or saying none is left)."""
    import shutil

    rows = 3
    columns = {n: [i + 10 * j for i in range(rows)] if number else [f"{n}-{i}" for i in
                                                                      range(rows)]
               for j, (n, number) in enumerate(zip(names, numbers))}
    src = tmp_path / "t.parquet"
    out = tmp_path / "o"
    shutil.rmtree(out, ignore_errors=True)
    pq.write_table(pa.table(columns), src)
    try:
        s = feedpipe.shard(str(src), str(out), workers=1, show_progress=False)
    except InputError as e:
        assert any(repr(n) in str(e) for n in names) or "no column becomes a field" in str(e), e
        return
    mapped = {}
    for line in s.columns:
        if line.startswith("column   "):
            column, _, rest = line[len("column   "):].partition(" -> ")
            mapped[column] = rest.split("   ")[0]
    assert set(mapped) == set(names)
    samples = read_dataset(out)
    assert len(samples) == rows
    for i, sample in enumerate(samples):
        for column, field in mapped.items():
            value = str(columns[column][i])
            if field == "__key__":
                assert sample["__key__"] == value
            elif field != "(dropped)":  # (a class index is stored as its number too)
                assert sample.get(field) == value.encode(), (column, field, sample)
