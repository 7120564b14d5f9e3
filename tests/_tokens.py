"""A corpus of short documents and a real BPE tokenizer trained on it, shared by the token-shard
tests."""

from __future__ import annotations

import numpy as np


def texts(n: int = 120, seed: int = 7) -> list[str]:
    """``n`` documents of 1 to 39 words (accents, Greek, an emoji), each ending in its number."""
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta", "the", "of", "🙂", "tok"]
    rng = np.random.default_rng(seed)
    return [" ".join(words[k] for k in rng.integers(0, len(words), size=int(rng.integers(1, 40))))
            + f" doc{i}" for i in range(n)]


def train_tokenizer(corpus: list[str], path: str) -> str:
    """A byte-level BPE of 400 ids (``[UNK]`` 0, ``<eos>`` 1) trained on ``corpus``, saved as
    tokenizers JSON at ``path``; returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return path
