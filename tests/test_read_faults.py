"""Faults while reading (issue 23): a wrong index under verify=True, a shard truncated in place
during an epoch (no SIGBUS, the named error on every route, also from worker processes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from feedpipe import DecodeError, FeedDataset, FeedLoader, ShardFormatError


def idx_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.idx"))


def keys_match_bytes(ds: FeedDataset, src: Path) -> None:
    """Every sample's jpg is its key's source file (what verify=True must guarantee)."""
    from feedpipe.format._keys import source_path

    for s in ds:
        want = (src / source_path(s["__key__"], "jpg")).read_bytes()
        assert bytes(s["jpg"]) == want, s["__key__"]


def test_verify_refuses_an_index_copied_from_another_shard(sharded_copy: Path,
                                                           image_folder: Path) -> None:
    a, b = idx_files(sharded_copy)[:2]
    shutil.copyfile(b, a)
    with pytest.raises(ShardFormatError, match=rf"matches no tar member \(.*{a.name}"):
        list(FeedDataset(str(sharded_copy), verify=True))
    with pytest.raises(ShardFormatError, match=a.name):
        list(FeedLoader(FeedDataset(str(sharded_copy), verify=True), batch_size=4))


def test_verify_refuses_shifted_offsets(sharded_copy: Path) -> None:
    idx = idx_files(sharded_copy)[1]
    lines = idx.read_text().splitlines()
    shifted = [lines[0]]
    for line in lines[1:]:
        parts = line.split(" ")
        for g in range(0, len(parts), 4):  # <ext> <offset> <size> <name>
            parts[g + 1] = str(int(parts[g + 1]) + 512)
        shifted.append(" ".join(parts))
    idx.write_text("\n".join(shifted) + "\n")
    with pytest.raises(ShardFormatError, match=idx.name):
        list(FeedDataset(str(sharded_copy), verify=True))


def test_verify_serves_a_healthy_dataset_byte_for_byte(sharded: Path, image_folder: Path) -> None:
    keys_match_bytes(FeedDataset(str(sharded), verify=True), image_folder)


SCRIPT = textwrap.dedent("""
    import glob, os, sys
    from feedpipe import FeedDataset, FeedLoader, ShardFormatError
    path, workers, transform = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"

    def shard_of(sample):
        return sample["__shard__"] + str(len(bytes(sample["jpg"])))[:0]

    if __name__ == "__main__":
        ds = FeedDataset(path, shuffle=True, transform=shard_of if transform else None)
        it = iter(FeedLoader(ds, batch_size=2, num_workers=workers))
        tars = glob.glob(os.path.join(path, "*.tar"))
        seen = set()
        while len(seen) < len(tars):  # every shard open (and mapped) somewhere
            batch = next(it)
            seen.update(batch if transform else batch["__shard__"])
        for tar in tars:
            os.truncate(tar, os.path.getsize(tar) // 3)
        try:
            for _ in it:
                pass
        except ShardFormatError as e:
            print("named:", type(e).__name__, str(e).splitlines()[-1][:300])
            sys.exit(0)
        print("no error")
        sys.exit(3)
""")


@pytest.mark.parametrize("workers,transform", [
    (0, False), pytest.param(2, False, marks=pytest.mark.slow),
    pytest.param(0, True, marks=pytest.mark.slow), (2, True)])
def test_a_shard_truncated_in_place_is_an_error_not_a_signal(sharded_copy: Path, tmp_path: Path,
                                                             workers: int,
                                                             transform: bool) -> None:
    script = tmp_path / "truncate.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(sharded_copy), str(workers),
                           str(int(transform))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "named: ShardFormatError" in proc.stdout and ".tar" in proc.stdout
    assert "changed while it was being read" in proc.stdout or "truncated" in proc.stdout


def test_worker_errors_keep_their_class_and_message(sharded_copy: Path) -> None:
    tar = sorted(sharded_copy.glob("*.tar"))[2]
    os.truncate(tar, tar.stat().st_size - 700)
    ld = FeedLoader(FeedDataset(str(sharded_copy), transform=lambda s: 0), batch_size=2,
                    num_workers=2)
    with pytest.raises(ShardFormatError, match=tar.name):
        list(ld)


class CutsItsShard:
    """A transform that, at sample ``at``, cuts that sample's shard to 512 bytes and then reads
    the sample's bytes: past the new end of the map, which kills its process with SIGBUS. The
    race of a shard cut between a batch's size check and its decode, made certain."""

    def __init__(self, root: str, at: int) -> None:
        self.root, self.at = root, at

    def __call__(self, sample: dict) -> int:
        if sample["__index__"] == self.at:
            os.truncate(os.path.join(self.root, sample["__shard__"]), 512)
        return len(bytes(sample["jpg"]))


def test_a_worker_killed_reading_a_cut_shard_is_the_named_error(sharded_copy: Path) -> None:
    ds = FeedDataset(str(sharded_copy), transform=CutsItsShard(str(sharded_copy), at=3))
    # one worker: with two, the other may find the cut first with its own size check (also a
    # ShardFormatError naming the shard, but not the path of a worker that died)
    ld = FeedLoader(ds, batch_size=2, num_workers=1, route="samples-workers")
    with pytest.raises(ShardFormatError, match=r"data-000000\.tar: the shard changed") as e:
        list(ld)
    assert "a worker process died reading it" in str(e.value)


class CutsItsShardAndFailsToDecode:
    """A transform that, at sample ``at``, cuts that sample's shard in half and then fails as a
    decoder fails on what it read (a member across the new end reads zeros in the last page,
    no ``SIGBUS``): the race of a shard cut between a batch's size check and its decode, made
    certain, where the decoder's error comes first."""

    def __init__(self, root: str, at: int) -> None:
        self.root, self.at = root, at

    def __call__(self, sample: dict) -> int:
        if sample["__index__"] == self.at:
            tar = os.path.join(self.root, sample["__shard__"])
            os.truncate(tar, os.path.getsize(tar) // 2)
            raise DecodeError(f"sample {sample['__key__']!r} cannot be decoded")
        return len(bytes(sample["jpg"]))


def test_a_decode_error_in_a_worker_over_a_cut_shard_is_the_named_error(
        sharded_copy: Path) -> None:
    ds = FeedDataset(str(sharded_copy), transform=CutsItsShardAndFailsToDecode(
        str(sharded_copy), at=3))
    ld = FeedLoader(ds, batch_size=2, num_workers=1, route="samples-workers")
    with pytest.raises(ShardFormatError, match=r"data-000000\.tar: the shard changed") as e:
        list(ld)
    assert "cannot be decoded" in str(e.value) and isinstance(e.value.__cause__, DecodeError)


THREADS_SCRIPT = textwrap.dedent("""
    import glob, os, sys, threading
    from feedpipe import BatchCollator, FeedDataset, FeedLoader, ShardFormatError

    path = sys.argv[1]
    cut = threading.Event()

    class WaitsForTheCut:
        # the samples of the second batch are decoded on a pool thread only once the test has
        # cut every shard: the race of a shard cut while the pool works ahead, made certain
        def __call__(self, sample):
            if sample["__index__"] in (2, 3):
                cut.wait(60)
            return bytes(sample["jpg"])[-4:]

    ld = FeedLoader(FeedDataset(path, transform=WaitsForTheCut()), batch_size=2,
                    transform_threads=2, collate_fn=list)
    it = iter(ld)
    next(it)
    for tar in glob.glob(os.path.join(path, "*.tar")):
        os.truncate(tar, 512)
    cut.set()
    try:
        for _ in it:
            pass
    except ShardFormatError as e:
        print("named:", str(e)[:200])
        sys.exit(0)
    print("no error")
    sys.exit(3)
""")


def test_transform_threads_never_read_a_shard_cut_under_them(sharded_copy: Path,
                                                             tmp_path: Path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(sharded_copy)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "named:" in proc.stdout and ".tar" in proc.stdout


def test_verify_says_which_shards_it_cannot_hash(sharded_copy: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A manifest entry without a sha256 cannot be checked byte for byte: verify=True says so,
    naming the shard, instead of serving it as verified."""
    import json

    manifest = sharded_copy / "manifest.json"
    m = json.loads(manifest.read_text())
    m["shards"][1]["sha256"] = None
    manifest.write_text(json.dumps(m))
    with caplog.at_level("WARNING", logger="feedpipe"):
        FeedDataset(str(sharded_copy), verify=True)
    said = [r.getMessage() for r in caplog.records if "sha256" in r.getMessage()]
    assert len(said) == 1 and m["shards"][1]["name"] in said[0] and "feedpipe index" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="feedpipe"):
        FeedDataset(str(sharded_copy))  # nothing claimed without verify=True
    assert not [r for r in caplog.records if "sha256" in r.getMessage()]


class _Shards:
    """A shard set's check of its shards (ShardSet.changed), as the training process asks it."""

    def __init__(self, why: str | None) -> None:
        self.why = why

    def changed(self) -> str | None:
        return self.why


@pytest.mark.parametrize("err", [EOFError(), ConnectionResetError(104, "Connection reset by peer")],
                         ids=["eof", "reset"])
def test_a_worker_dying_while_its_batch_is_taken_over_a_cut_shard_is_the_named_error(
        err: Exception) -> None:
    """A worker killed by a SIGBUS under a cut shard while this process took a batch's shared
    memory from it (torch's resource sharer: rebuild_storage_fd) surfaced as a bare EOFError
    (route samples-workers:thirdfn in a CI rehearsal's route suite), not torch's RuntimeError
    for a dead worker, and the shard was not named."""
    from feedpipe.stream._worker_source import WorkerBatches

    def messages():  # type: ignore[no-untyped-def]
        raise err
        yield

    cut = WorkerBatches(None, None, {}, shards=_Shards(
        "data-000000.tar: the shard changed since the epoch began"))
    with pytest.raises(ShardFormatError, match=r"data-000000\.tar: the shard changed") as e:
        cut._next(messages())
    assert e.value.__cause__ is err
    intact = WorkerBatches(None, None, {}, shards=_Shards(None))  # no shard cut: its own error
    with pytest.raises(type(err)):
        intact._next(messages())
