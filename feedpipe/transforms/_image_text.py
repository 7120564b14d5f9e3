"""Image-caption pairs for CLIP-style training: :class:`ImageText` (a sample dict in, the image
through an :class:`~feedpipe.ImagePipeline` and one caption as padded token ids out) and the
pieces it is made of, each usable alone: :func:`captions_of`, :func:`caption_draw`,
:class:`CaptionTokens`.

**Captions of a sample.** The caption field (``txt`` by default) holds one caption, or several:
a JSON list of strings (the text starts with ``[``), or one caption per non-empty line
(surrounding whitespace stripped). A ``json`` field's ``"captions"`` list is not read: name the
field holding the captions.

**One caption per epoch.** With several captions, the one taken in an epoch is
:func:`caption_draw`\\ ``(seed, epoch, index, n)``: ``blake2b("feedpipe-caption", seed, epoch,
index)`` modulo ``n``, ``index`` being the sample's global id. So a sample gets the same caption
in a given epoch on any rank or worker and after a resume, and (with ``n > 1``) other captions
in other epochs. The hash's domain differs from the augmentation's
(:mod:`feedpipe.transforms._seeding`), so the caption drawn is independent of the crop.

**Long captions.** Token ids beyond ``max_len`` are cut. With ``end_id`` given, the first
``max_len - 1`` ids are kept and ``end_id`` is put last (so a caption that did not fit still ends
with the end token, as CLIP's tokenizer does); with ``end_id=None`` the first ``max_len`` ids are
kept (plain truncation). A caption that fits is never changed: the tokenizer's own ids, its own
special tokens included. Then ``pad_id`` fills the row up to ``max_len``; ``attention_mask``
is 1 over the caption's ids and 0 over the padding.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import DecodeError, SampleSkipped
from ._pipeline import ImagePipeline
from ._seeding import seed_of
from ._tokenizer import TokenizerRef

__all__ = ["CaptionTokens", "ImageText", "caption_draw", "captions_of"]


def captions_of(value: Any) -> list[str]:
    """The captions a caption field holds (see the module docstring).

    Example:
        >>> captions_of(b"a cat\\n\\n  a small cat \\n")
        ['a cat', 'a small cat']
        >>> captions_of('["a dog", "two dogs"]')
        ['a dog', 'two dogs']
    """
    if isinstance(value, memoryview):
        value = value.tobytes()
    text = value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)
    if text.lstrip().startswith("["):
        try:
            listed = json.loads(text)
        except ValueError as e:
            raise ValueError(f"its captions start with '[' but are no JSON list: {e}") from e
        if not isinstance(listed, list) or not all(isinstance(c, str) for c in listed):
            raise ValueError("its captions start with '[' but are not a JSON list of strings")
        return [c for c in listed if c.strip()]
    return [line.strip() for line in text.splitlines() if line.strip()]


def caption_draw(seed: int, epoch: int, index: int, n: int) -> int:
    """Which of ``n`` captions sample ``index`` takes in ``epoch`` of a run seeded ``seed``.

    Example:
        >>> caption_draw(0, 1, 42, 5) == caption_draw(0, 1, 42, 5)
        True
        >>> len({caption_draw(0, epoch, 42, 5) for epoch in range(20)}) > 1
        True
    """
    if n < 1:
        raise ValueError(f"a caption is drawn from at least one, not {n}")
    if n == 1:
        return 0
    d = hashlib.blake2b(b"feedpipe-caption\0%d\0%d\0%d" % (int(seed), int(epoch), int(index)),
                        digest_size=16).digest()
    return int.from_bytes(d, "little") % n


class CaptionTokens:
    """A caption (text or UTF-8 bytes) -> its token ids as a 1-D ``int64`` array (unpadded), cut
    when longer than ``max_len``: with ``end_id``, the first ``max_len - 1`` ids then ``end_id``;
    without, the first ``max_len``. Deterministic, so it may be memoised by
    :meth:`FunctionIndex.wrap <feedpipe.FunctionIndex.wrap>` (:class:`ImageText` does that with
    ``cache=``). Picklable: a worker process loads the tokenizer once.

    Args:
        tokenizer: a ``tokenizers`` JSON file, a ``tokenizers.Tokenizer``, or a callable taking a
            list of texts and returning each one's ids (the tokenizer of ``feedpipe shard
            --tokenizer``).
        max_len: the most ids a caption keeps.
        end_id: the id put last in a caption that was cut; ``None``: plain truncation.
    """

    def __init__(self, tokenizer: str | os.PathLike[str] | Any, max_len: int,
                 end_id: int | None = None) -> None:
        if int(max_len) < 1 or (end_id is not None and int(max_len) < 2):
            raise ValueError(f"max_len must be at least {1 if end_id is None else 2} "
                             f"(with end_id={end_id!r}), not {max_len!r}")
        self.tokenizer = _reference(tokenizer)
        self.max_len = int(max_len)
        self.end_id = None if end_id is None else int(end_id)

    def __call__(self, caption: Any) -> np.ndarray:
        """The ids of ``caption`` (``str``, UTF-8 ``bytes`` or a ``memoryview`` of them)."""
        if isinstance(caption, memoryview):
            caption = caption.tobytes()
        text = caption.decode("utf-8") if isinstance(caption, (bytes, bytearray)) else caption
        ids = np.asarray(self.tokenizer.encode([text])[0], dtype=np.int64).reshape(-1)
        if len(ids) > self.max_len:
            if self.end_id is None:
                ids = ids[:self.max_len]
            else:
                ids = np.concatenate([ids[:self.max_len - 1], [self.end_id]])
        return ids

    def __fingerprint__(self) -> Any:  # what decides its outputs (FunctionIndex)
        t = self.tokenizer
        return t.json, t.fn, self.max_len, self.end_id

    def __repr__(self) -> str:
        return (f"CaptionTokens({self.tokenizer.name!r}, max_len={self.max_len}, "
                f"end_id={self.end_id!r})")


def _reference(tokenizer: Any) -> TokenizerRef:
    """The :class:`TokenizerRef` of ``tokenizer``. A caption's ids are ``int64`` whatever the
    vocabulary, so a callable without a ``vocab_size`` is not asked for one."""
    if isinstance(tokenizer, TokenizerRef):
        return tokenizer
    plain = callable(tokenizer) and not type(tokenizer).__module__.startswith("tokenizers")
    size = getattr(tokenizer, "vocab_size", None) if plain else None
    return TokenizerRef(tokenizer, vocab_size=(size or np.iinfo(np.int64).max) if plain else None)


class ImageText:
    """Sample dict -> ``{"image", "input_ids", "attention_mask", "caption"}``: an image-caption
    pair for CLIP-style training, ready for the loader's default collation.

    ``image`` is ``image(sample)``, an :class:`~feedpipe.ImagePipeline` without a label
    (``label_field=None``; its ``on_error`` applies to the whole sample).

    **Captions.** The caption field holds one caption, or several: a JSON list of strings (the
    text starts with ``[``), or one a line (empty lines left out, each stripped). The one taken
    in an epoch is ``blake2b("feedpipe-caption", seed, epoch, index)`` modulo their number
    (``index``: the sample's global id), so a sample gets the same caption in a given epoch on
    any rank or worker and after a resume, other captions in other epochs, and a draw
    independent of its crop; ``caption`` is its index.

    **Tokens.** ``input_ids`` and ``attention_mask`` are ``int64`` tensors of ``max_len``: the
    caption tokenised on the fly by :class:`CaptionTokens` (the tokenizer's own ids, special
    tokens included), cut when longer than ``max_len`` (with ``end_id``: the first
    ``max_len - 1`` ids, then ``end_id``; without: the first ``max_len``), padded with
    ``pad_id``; the mask is 1 over the caption's ids. A sample without the caption field, or
    with no caption in it, is a :class:`~feedpipe.errors.DecodeError` naming it (a
    :class:`~feedpipe.errors.SampleSkipped` with the pipeline's ``on_error="skip"``).

    Picklable: give it to ``FeedDataset(transform=...)`` and it runs in the workers.

    Args:
        image: the image transform (its ``label_field`` must be ``None``).
        tokenizer: a ``tokenizers`` JSON file, a ``tokenizers.Tokenizer`` or a callable (see
            :class:`CaptionTokens`).
        max_len: the length of ``input_ids`` and ``attention_mask``.
        pad_id: the id of the padding.
        end_id: the id put last in a caption that was cut; ``None``: plain truncation.
        caption_field: the field holding the caption(s).
        cache: a :class:`~feedpipe.FunctionIndex` memoising the tokenisation (keyed by the
            caption's bytes and the tokenizer); ``None``: tokenise every time.

    Example:
        >>> from feedpipe import FeedDataset, ImagePipeline
        >>> words = {"a": 5, "cat": 6}
        >>> def tokenize(texts):
        ...     return [[1] + [words.get(w, 2) for w in t.split()] for t in texts]
        >>> pair = ImageText(ImagePipeline(32, train=False, label_field=None), tokenize,
        ...                  max_len=4, pad_id=0)
        >>> out = pair({"__key__": "x", "__index__": 0, "txt": b"a cat",
        ...             "jpg": next(iter(FeedDataset("shards/example")))["jpg"]})
        >>> tuple(out["image"].shape), out["input_ids"].tolist(), out["attention_mask"].tolist()
        ((3, 32, 32), [1, 5, 6, 0], [1, 1, 1, 0])
    """

    def __init__(self, image: ImagePipeline, tokenizer: str | os.PathLike[str] | Any, *,
                 max_len: int, pad_id: int = 0, end_id: int | None = None,
                 caption_field: str = "txt", cache: Any = None) -> None:
        if getattr(image, "label_field", None) is not None:
            raise ValueError(f"ImageText's image transform gives the image alone: make it with "
                             f"label_field=None (it has label_field={image.label_field!r})")
        self.image = image
        self.tokens = CaptionTokens(tokenizer, max_len, end_id)
        self.encode: Any = self.tokens if cache is None else cache.wrap(self.tokens)
        self.max_len = int(max_len)
        self.pad_id = int(pad_id)
        self.caption_field = caption_field

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """The pair of ``sample``: its image, the caption drawn for its epoch as ``input_ids``
        and ``attention_mask``, and that caption's index as ``caption``."""
        try:
            if self.caption_field not in sample:
                raise DecodeError(f"has no {self.caption_field!r} caption field (it has "
                                  f"{sorted(k for k in sample if not k.startswith('__'))})")
            captions = captions_of(sample[self.caption_field])
            if not captions:
                raise DecodeError(f"its {self.caption_field!r} field holds no caption")
        except (ValueError, UnicodeDecodeError) as e:
            message = f"sample {sample.get('__key__')!r} of {sample.get('__shard__')!r}: {e}"
            if getattr(self.image, "on_error", "raise") == "skip":
                raise SampleSkipped(message) from e
            raise DecodeError(message) from e
        which = caption_draw(*seed_of(sample), len(captions))
        image = self.image(sample)
        ids = self.encode(captions[which].encode("utf-8"))
        n = len(ids)
        input_ids = torch.full((self.max_len,), self.pad_id, dtype=torch.int64)
        input_ids[:n] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        mask = torch.zeros(self.max_len, dtype=torch.int64)
        mask[:n] = 1
        return {"image": image, "input_ids": input_ids, "attention_mask": mask,
                "caption": which}

    def __repr__(self) -> str:
        return (f"ImageText({self.image!r}, {self.tokens!r}, pad_id={self.pad_id}, "
                f"caption_field={self.caption_field!r})")

