"""Packed token rows over a dataset laid out by node: Packed deals rows itself, so its documents
come in the dataset's global order whatever the world, and a resume on another number of ranks
still gives every token once."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from test_packed import _docs, _lockstep, _tokens

import feedpipe
from feedpipe.convert._shard_writer import write_samples


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(3)
    docs = _docs(rng.integers(1, 60, size=40).tolist())
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": d} for i, d in enumerate(docs)],
                  str(tmp_path / "tok"), max_samples=9)
    return str(tmp_path / "tok"), docs


def _loaders(path, world, batch):
    return [feedpipe.FeedLoader(feedpipe.Packed(feedpipe.FeedDataset(
        path, shuffle=True, seed=5, rank=r, world_size=world, node_local=True), 16),
        batch_size=batch) for r in range(world)]


@pytest.mark.parametrize("world,then", [(2, 3), (4, 1)])
def test_packed_over_a_node_layout_resumes_on_another_world_exactly(corpus, world, then):
    path, docs = corpus
    loaders = _loaders(path, world, 2)
    got = _lockstep(loaders, stop=2)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    rest = _loaders(path, then, 2)
    for ld in rest:
        ld.load_state_dict(state)
    tail = _lockstep(rest)
    tokens = [t for per in got + tail for t in _tokens(per)]
    assert Counter(tokens) == Counter(np.concatenate(docs).tolist())
