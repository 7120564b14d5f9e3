"""``feedpipe shard --part I/N`` and ``feedpipe merge``: parts as real subprocesses writing into one
directory at once, the merged dataset equal to a single run's whatever N, and merges that refuse
missing, unfinished or foreign parts with a message naming the part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_dataset, run_feedpipe
from hypothesis import given
from hypothesis import strategies as st

from feedpipe.convert._merge import merge
from feedpipe.convert._parts import parse_part, part_range
from feedpipe.convert._shard import shard
from feedpipe.errors import PartsError
from feedpipe.format._manifest import load_manifest
from feedpipe.format._verify import verify


def samples_of(root: Path) -> list[tuple[str, dict[str, bytes]]]:
    """(key, {field: bytes}) of every sample, in dataset order."""
    return [(str(s["__key__"]), {k: v for k, v in s.items() if not k.startswith("__")})
            for s in read_dataset(root)]


def run_parts(src: Path, out: Path, n: int, *extra: object) -> None:
    """N parts as N concurrent ``feedpipe shard`` processes writing into ``out``."""
    procs = [subprocess.Popen([sys.executable, "-m", "feedpipe", "shard", str(src), str(out),
                               "--part", f"{i}/{n}", "--workers", "1", "--no-progress",
                               *map(str, extra)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    for i, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"part {i}/{n}: {stderr}"


@pytest.mark.parametrize("shuffle", [False, True])
def test_three_parts_give_the_single_runs_samples_and_keys(
        image_folder: Path, tmp_path: Path, shuffle: bool) -> None:
    opts: list[object] = ["--labels-from-dirs", "--max-samples", "4"] + (
        ["--shuffle", "--seed", "7"] if shuffle else [])
    r = run_feedpipe("shard", image_folder, tmp_path / "one", "--workers", "1", "--no-progress",
                     *opts)
    assert r.returncode == 0, r.stderr
    run_parts(image_folder, tmp_path / "three", 3, *opts)
    r = run_feedpipe("merge", tmp_path / "three")
    assert r.returncode == 0, r.stderr
    assert "3 parts" in r.stdout

    one, three = samples_of(tmp_path / "one"), samples_of(tmp_path / "three")
    assert len(one) == 30
    assert one == three  # same samples, keys and bytes, even in the same order
    assert verify(str(tmp_path / "three")).ok
    m1, m3 = load_manifest(str(tmp_path / "one")), load_manifest(str(tmp_path / "three"))
    assert m3.classes == m1.classes and m3.fields == m1.fields
    assert {s.name.split("-")[1] for s in m3.shards} == {"p00000of00003", "p00001of00003",
                                                          "p00002of00003"}
    wids = json.loads((tmp_path / "three" / "wids.json").read_text())
    assert [s["url"] for s in wids["shardlist"]] == [s.name for s in m3.shards]
    for rec in m3.shards:
        assert (tmp_path / "three" / rec.name.replace(".tar", ".idx")).exists()


def test_last_part_merges_and_a_merge_is_idempotent(records_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for i in (1, 0):
        s = shard(str(records_folder), str(out), part=f"{i}/2", merge=True, workers=1,
                  max_samples=64)
        assert s.part == f"{i}/2"
        assert s.merged == (i == 0)
    first = (out / "manifest.json").read_bytes()
    merge(str(out))
    assert (out / "manifest.json").read_bytes() == first
    assert load_manifest(str(out)).total_samples == 400


def test_merge_names_missing_and_unfinished_parts(records_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(PartsError, match="no finished parts"):
        out.mkdir()
        merge(str(out))
    shard(str(records_folder), str(out), part="0/4", workers=1, max_samples=20)

    class Stop(Exception):
        pass

    def stop_after_one(rec: object) -> None:
        raise Stop

    with pytest.raises(Stop):  # part 2 dies after committing one shard
        shard(str(records_folder), str(out), part="2/4", workers=1, max_samples=20,
              on_shard=stop_after_one)
    with pytest.raises(PartsError) as e:
        merge(str(out))
    msg = str(e.value)
    assert "part 1/4 is missing" in msg and "part 3/4 is missing" in msg
    assert "part 2/4 is incomplete (1 shard(s) committed" in msg and "--resume" in msg
    assert "part 0/4" not in msg
    r = run_feedpipe("merge", out)
    assert r.returncode == 2 and "part 2/4 is incomplete" in r.stderr
    assert not (out / "manifest.json").exists()

    s = shard(str(records_folder), str(out), part="2/4", workers=1, max_samples=20, resume=True)
    assert s.reused_shards == 1
    for i in (1, 3):
        shard(str(records_folder), str(out), part=(i, 4), workers=1, max_samples=20)
    assert merge(str(out)).total_samples == 400
    assert verify(str(out)).ok


def test_merge_refuses_parts_of_other_inputs_or_options_and_lost_shards(
        records_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shard(str(records_folder), str(out), part="0/2", workers=1, max_samples=50)
    shard(str(records_folder), str(out), part="1/2", workers=1, max_samples=50, shuffle=True)
    with pytest.raises(PartsError, match=r"part 1/2 was made from other inputs or options"):
        merge(str(out))
    shard(str(records_folder), str(out), part="1/2", workers=1, max_samples=50, resume=True)
    lost = sorted(out.glob("data-p00001of00002-*.tar"))[-1]
    lost.unlink()
    with pytest.raises(PartsError, match=rf"part 1/2: shard {lost.name} is missing"):
        merge(str(out))


def test_a_rerun_part_needs_resume_and_other_parts_files_are_allowed(
        records_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shard(str(records_folder), str(out), part="0/2", workers=1, max_samples=100)
    shard(str(records_folder), str(out), part="1/2", workers=1, max_samples=100)  # not empty: ok
    r = run_feedpipe("shard", records_folder, out, "--part", "1/2", "--max-samples", "100")
    assert r.returncode == 2 and "not empty" in r.stderr
    r = run_feedpipe("shard", records_folder, out, "--part", "1/2", "--max-samples", "100",
                     "--resume", "--merge", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["reused_shards"] == doc["shards"] == 2 and doc["merged"] is True


def test_part_argument_is_checked() -> None:
    assert parse_part("0/1") == (0, 1) and parse_part((3, 4)) == (3, 4)
    for bad in ("3/3", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="part"):
            parse_part(bad)
    r = run_feedpipe("shard", "x", "y", "--part", "4/4")
    assert r.returncode == 2 and "0..N-1" in r.stderr


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_part_ranges_tile_the_order(total: int, n: int) -> None:
    ranges = [part_range(total, i, n) for i in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
