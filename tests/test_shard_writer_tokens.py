"""``feedpipe.ShardWriter`` writing token documents: each shard's ``.lengths.npy`` beside it,
named in the manifest as ``feedpipe shard --tokenizer`` names it, so that ``feedpipe.Packed``
plans rows from the lengths without reading a ``.npy`` header, and reads back exactly the tokens
written. A writer of other samples writes no lengths file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import feedpipe
from feedpipe import ShardWriter, write_samples
from feedpipe.stream._token_docs import TokenDocs


def _docs(n: int = 90, seed: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 5000, size=int(rng.integers(1, 60))).astype(np.uint16)
            for _ in range(n)]


def _packed(out: str, seq_len: int = 16, shuffle: bool = False) -> list[list[int]]:
    ds = feedpipe.FeedDataset(out, shuffle=shuffle, seed=3)
    loader = feedpipe.FeedLoader(feedpipe.Packed(ds, seq_len), batch_size=3)
    return [row for b in loader for row in
            np.where(b["labels"] != -100, b["input_ids"], -1).tolist()]


def _real_tokens(rows: list[list[int]]) -> list[int]:
    return [t for row in rows for t in row if t != -1]


def _no_scan(*_a: object, **_k: object) -> None:
    raise AssertionError("a header scan: the lengths files were not used")


def test_packed_reads_a_shardwriter_token_dataset_from_its_lengths_without_a_header(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _docs()
    out = str(tmp_path / "tok")
    with ShardWriter(out, max_samples=20) as w:
        for i, d in enumerate(docs):
            w.write({"__key__": f"{i:06d}", "tokens.npy": d})
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.endswith(".tar")]
    assert len(shards) == 5
    for k, shard in enumerate(shards):
        lengths = np.load(os.path.join(out, shard[:-4] + ".lengths.npy"))
        assert lengths.dtype == np.int64
        assert lengths.tolist() == [len(d) for d in docs[20 * k:20 * k + 20]]
    m = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert m["created_by"]["tokens"] == {"field": "tokens.npy", "dtype": "uint16",
                                         "eos_id": None, "tokenizer": None,
                                         "lengths": "<shard stem>.lengths.npy"}
    with monkeypatch.context() as mp:
        mp.setattr(TokenDocs, "_scan", _no_scan)
        fast = _packed(out)
        fast_shuffled = _packed(out, shuffle=True)
    assert _real_tokens(fast) == [int(t) for d in docs for t in d]
    for n in names:  # the same rows planned from the .npy headers
        if n.endswith(".lengths.npy"):
            os.unlink(os.path.join(out, n))
    assert fast == _packed(out) and fast_shuffled == _packed(out, shuffle=True)


def test_parts_written_by_write_samples_carry_their_lengths(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    docs = _docs(40, seed=9)
    out = str(tmp_path / "tok")
    for i in range(2):
        write_samples(({"__key__": f"{i}-{j:04d}", "tokens.npy": d}
                       for j, d in enumerate(docs[20 * i:20 * i + 20])), out, part=(i, 2),
                      merge=True, max_samples=8)
    assert feedpipe.load_manifest(out).created_by["tokens"]["dtype"] == "uint16"
    with monkeypatch.context() as mp:
        mp.setattr(TokenDocs, "_scan", _no_scan)
        assert _real_tokens(_packed(out)) == [int(t) for d in docs for t in d]


@pytest.mark.parametrize("other", [
    {"tokens.npy": np.arange(6, dtype=np.uint16), "txt": "a caption"},  # a second field
    {"tokens.npy": np.arange(6, dtype=np.int64)},  # another dtype
    {"tokens.npy": np.zeros((2, 3), dtype=np.uint16)},  # not 1-D
    {"jpg": b"\xff\xd8"},  # not a token sample
])
def test_a_writer_of_other_samples_writes_no_lengths(tmp_path: Path,
                                                    other: dict[str, object]) -> None:
    out = str(tmp_path / "mixed")
    with ShardWriter(out, max_samples=2) as w:
        for i in range(3):  # a first shard of token samples, then another sample
            w.write({"__key__": f"{i:03d}", "tokens.npy": np.arange(i + 1, dtype=np.uint16)})
        w.write({"__key__": "999", **other})
    assert not [n for n in os.listdir(out) if n.endswith(".lengths.npy")]
    assert "tokens" not in feedpipe.load_manifest(out).created_by


def test_an_aborted_writer_leaves_no_lengths_file(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    with pytest.raises(RuntimeError), ShardWriter(str(out), max_samples=2) as w:
        for i in range(5):
            w.write({"__key__": f"{i:03d}", "tokens.npy": np.arange(3, dtype=np.uint8)})
        raise RuntimeError("the caller gives up")
    assert not [p.name for p in out.iterdir() if not p.name.startswith(".")]
