"""The default collation of samples into a batch, the per-field decoding of raw samples, and
the batch a transform left wholly out."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import get_worker_info

from ..errors import DecodeError, EmptyEpochError

Decoder = Callable[[bytes], Any]


class LeftOut:
    """What the batch loop makes of a batch whose every sample its transform left out
    (:class:`~feedpipe.errors.SampleSkipped`): a batch of the plan with nothing in it.
    :class:`~feedpipe.FeedLoader` counts it where it counts batches (so that a resume point
    stays exact) and yields nothing for it. ``samples``: how many were left out; ``why``: the
    last one's error."""

    __slots__ = ("samples", "why")

    def __init__(self, samples: int, why: str) -> None:
        self.samples, self.why = samples, why

    def __reduce__(self) -> Any:
        return LeftOut, (self.samples, self.why)


def left_out_error(batch: LeftOut, rank: int, world_size: int, how: str) -> DecodeError:
    """The refusal of a left-out batch on one of several ranks: that rank would deliver less
    than the others, and their collectives (DDP's gradient all-reduce) would wait forever."""
    return DecodeError(
        f"rank {rank}: every one of the {batch.samples} samples of a batch was left out by the "
        f"transform (the last: {batch.why}); with {world_size} ranks, {how}, this rank would "
        "yield fewer batches than the others and their collectives would wait forever. Read "
        "through FeedLoader with a larger batch_size (a batch that keeps one sample keeps its "
        "place), or rewrite the dataset without the broken files (`feedpipe shard SRC OUT "
        "--on-error skip`; `feedpipe verify OUT`).")


def empty_epoch_error(stats: Mapping[str, Any], why: str) -> EmptyEpochError:
    """The refusal of an epoch that delivered no batch: every batch was left out whole
    (``stats``: the pass's), so a training loop would run zero steps and say nothing."""
    return EmptyEpochError(
        f"the epoch delivered no batch: the transform left out every sample of its "
        f"{stats.get('left_out')} batch(es) ({stats.get('skipped')} samples skipped; the last: "
        f"{why}). Fix what that message names: leaving every sample out trains nothing")


_NAMED: dict[Any, Decoder] = {
    int: int,
    float: float,
    str: lambda b: b.decode("utf-8"),
    "int": int,
    "float": float,
    "str": lambda b: b.decode("utf-8"),
    "text": lambda b: b.decode("utf-8"),
    "json": json.loads,
}


def decoders(spec: Mapping[str, Any] | None) -> dict[str, Decoder]:
    """The per-field decoders of ``FeedDataset(decode=...)``: a field name to ``int``, ``float``,
    ``str`` (UTF-8 text), ``"json"`` or any callable taking the field's ``bytes``.

    Example:
        >>> d = decoders({"cls": int, "txt": str})
        >>> d["cls"](b"3"), d["txt"](b"hi")
        (3, 'hi')
    """
    out: dict[str, Decoder] = {}
    for name, how in (spec or {}).items():
        if how in (int, float, str) or isinstance(how, str):
            fn = _NAMED.get(how)
        else:
            fn = how if callable(how) else None
        if fn is None:
            raise ValueError(f"decode={{{name!r}: {how!r}}}: a field decodes with int, float, "
                             "str, 'json' or a callable taking the field's bytes")
        out[str(name)] = fn
    return out


def decode_fields(sample: dict[str, Any], decode: Mapping[str, Decoder]) -> None:
    """Decode ``sample``'s fields named in ``decode`` in place (the sample's key and shard name
    the field in the error of one that fails)."""
    for name, fn in decode.items():
        v = sample.get(name)
        if v is None:
            continue
        try:
            sample[name] = fn(bytes(v))
        except Exception as e:
            from ..errors import DecodeError

            raise DecodeError(f"sample {sample.get('__key__')!r} of {sample.get('__shard__')!r}: "
                              f"field {name!r} does not decode with {fn!r}: {e}") from e


def collate_samples(samples: Sequence[Any], fields: Sequence[str] = ()) -> Any:
    """Default collation: tensors and numbers are stacked as by torch's ``default_collate``; raw
    bytes fields (``bytes``/``memoryview``) become lists of ``bytes``; keys stay lists of str. A
    field that only some samples have becomes a list with ``None`` where it is missing. Each of
    ``fields`` (the manifest's fields, for raw samples) is in every batch, all ``None`` where no
    sample of the batch has it.

    In a DataLoader worker, integer fields of sample dicts (``__index__``, ``__epoch__``,
    ``__seed__``, labels) become ``int64`` numpy arrays instead. A tensor leaves a worker as a
    shared-memory file descriptor with a socket handshake each, which for a few bytes costs more
    than pickling them. The loader turns them into tensors in the training process.

    Example:
        >>> b = collate_samples([{"cls": 1, "jpg": b"a"}, {"cls": 2}], fields=["jpg", "json"])
        >>> b["cls"].tolist(), b["jpg"], b["json"]
        ([1, 2], [b'a', None], [None, None])
    """
    first = samples[0]
    if isinstance(first, dict):
        out: dict[str, Any] = {}
        keys = dict.fromkeys(k for s in samples for k in s)
        for f in fields:
            keys.setdefault(f, None)
        in_worker = get_worker_info() is not None
        for k in keys:
            out[k] = column([s.get(k) for s in samples], in_worker)
        return out
    if isinstance(first, (bytes, bytearray, memoryview)):
        return [bytes(c) for c in samples]
    from torch.utils.data import default_collate

    return default_collate(list(samples))


def column(col: list[Any], in_worker: bool = False) -> Any:
    """One field's values over a batch, collated as :func:`collate_samples` does."""
    from torch.utils.data import default_collate

    v = col[0]
    if in_worker and type(v) is int and all(type(c) is int for c in col):
        return np.array(col, dtype=np.int64)
    if any(c is None for c in col):
        return [bytes(c) if isinstance(c, memoryview) else c for c in col]
    if isinstance(v, (bytes, bytearray, memoryview)):
        return [bytes(c) for c in col]
    if isinstance(v, str):
        return col
    if isinstance(v, dict):
        return collate_samples(col)
    return default_collate(col)
