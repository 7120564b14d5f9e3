"""The tokenizer of ``feedpipe shard --tokenizer`` and of :class:`~feedpipe.ImageText`: a
``tokenizers`` JSON file (or a ``tokenizers.Tokenizer``), or any callable, behind one small
picklable object that each worker process loads once.

The hook for any tokenizer is a callable taking a list of texts and returning, for each, its
token ids (a list or a 1-D integer array); its vocabulary size must be given (``vocab_size=``)
or be the callable's ``vocab_size`` attribute, since it decides the shards' dtype before a
document is read. With ``workers`` above 1 the callable is pickled to the worker processes: a
function defined at module level or an object whose class is (a lambda is refused by pickle).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._helpers.dependency import require

Encode = Callable[[list[str]], Sequence[Any]]

# tokenizers loaded in this process, by the sha256 of their JSON
_LOADED: dict[str, Any] = {}


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds every id below ``vocab_size``.

    Example:
        >>> [str(dtype_for(n)) for n in (256, 257, 65536, 65537)]
        ['uint8', 'uint16', 'uint16', 'uint32']
    """
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


class TokenizerRef:
    """What tokenises, as a worker process gets it: the JSON of a ``tokenizers`` tokenizer (loaded
    once per process) or a callable.

    Args:
        tokenizer: a path to a ``tokenizers`` JSON file, a ``tokenizers.Tokenizer``, or a
            callable (see the module docstring).
        vocab_size: the vocabulary size (default: the tokenizer's, with its added tokens; a
            callable's ``vocab_size`` attribute).
    """

    def __init__(self, tokenizer: str | os.PathLike[str] | Any,
                 vocab_size: int | None = None) -> None:
        self.json: str | None = None
        self.fn: Encode | None = None
        if isinstance(tokenizer, (str, os.PathLike)):
            path = os.fspath(tokenizer)
            try:
                with open(path, encoding="utf-8") as f:
                    self.json = f.read()
            except OSError as e:
                raise FileNotFoundError(f"{path}: cannot read the tokenizer: {e.strerror or e}; "
                                        "give a `tokenizers` JSON file (tokenizer.json)") from e
            self.name = os.path.basename(path)
        elif type(tokenizer).__module__.startswith("tokenizers"):
            self.json = tokenizer.to_str()
            self.name = "tokenizers.Tokenizer"
        elif callable(tokenizer):
            self.fn = tokenizer
            self.name = getattr(tokenizer, "__qualname__", type(tokenizer).__qualname__)
        else:
            raise TypeError(f"tokenizer must be a tokenizers JSON path, a tokenizers.Tokenizer "
                            f"or a callable, not {type(tokenizer).__name__}")
        if self.json is not None:
            self.sha256 = hashlib.sha256(self.json.encode()).hexdigest()
            size = self._loaded().get_vocab_size(with_added_tokens=True)
            vocab_size = size if vocab_size is None else vocab_size
        else:
            self.sha256 = ""
            vocab_size = vocab_size if vocab_size is not None else getattr(
                tokenizer, "vocab_size", None)
            if vocab_size is None:
                raise ValueError(f"tokenizer {self.name}: give vocab_size= (it decides the "
                                 "shards' dtype before any text is read)")
        if int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be at least 1, not {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for(self.vocab_size)

    def _loaded(self) -> Any:
        tok = _LOADED.get(self.sha256)
        if tok is None:
            tokenizers = require("tokenizers", extra="text",
                                 purpose="to tokenise with a tokenizers JSON")
            tok = _LOADED[self.sha256] = tokenizers.Tokenizer.from_str(self.json)
        return tok

    def describe(self) -> dict[str, Any]:
        """What the manifest records of the tokenizer."""
        d: dict[str, Any] = {"name": self.name, "vocab_size": self.vocab_size}
        if self.sha256:
            d["sha256"] = self.sha256
        return d

    def encode(self, texts: list[str]) -> list[Any]:
        """The token ids of each text: ``tokenizer.encode(text).ids`` for each, computed as one
        batch (``encode_batch_fast``, which skips the offsets, where the version has it)."""
        if self.fn is not None:
            return list(self.fn(texts))
        tok = self._loaded()
        enc = getattr(tok, "encode_batch_fast", tok.encode_batch)(texts)
        return [e.ids for e in enc]
