"""Per-sample seeding of augmentation, from the plan.

Every random draw for a sample comes from its own generator,
:func:`sample_rng`\\ ``(seed, epoch, index)``: a ``PCG64`` whose 128-bit state and increment
are the two halves of the 256-bit ``blake2b("feedpipe-augment", seed, epoch, index)`` digest,
``index`` being the sample's global id (``__index__``). A sample therefore gets the same crop
and flip in a given epoch whichever rank or worker reads it, however many there are, and after
a resume. Another epoch or another sample gets independent draws. Hashing the three integers
avoids the ``seed + epoch`` aliasing, as the plan does. The dataset puts ``__seed__`` and
``__epoch__`` in each sample; a sample without them is treated as seed 0, epoch 0.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np


def _seed_state(seed: int, epoch: int, index: int) -> dict[str, Any]:
    """The PCG64 state of sample ``index``'s generator: state and increment straight from a
    256-bit blake2b digest, cheaper per sample than seeding through ``SeedSequence``
    (``benchmarks/bench_peers.py``, decode phase)."""
    state, inc = _state_inc(seed, epoch, index)
    return {"bit_generator": "PCG64", "state": {"state": state, "inc": inc},
            "has_uint32": 0, "uinteger": 0}


_MASK128 = (1 << 128) - 1


def _state_inc(seed: int, epoch: int, index: int) -> tuple[int, int]:
    """The PCG64 state and increment of :func:`_seed_state`: the digest's low and high 128
    bits (little-endian), the increment made odd."""
    d = int.from_bytes(_blake2b(b"feedpipe-augment\0%d\0%d\0%d" % (
        int(seed), int(epoch), int(index)), digest_size=32).digest(), "little")
    return d & _MASK128, (d >> 128) | 1


_blake2b = hashlib.blake2b


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of sample ``index``'s augmentation in ``epoch`` of a run seeded ``seed``.

    Example:
        >>> a = sample_rng(0, 1, 42).random()
        >>> a == sample_rng(0, 1, 42).random(), a == sample_rng(0, 2, 42).random()
        (True, False)
    """
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = _seed_state(seed, epoch, index)
    return rng


_SCRATCH = threading.local()  # each thread's reused generator (scratch_rng)


class _Scratch:
    """A thread's :func:`scratch_rng` generator, with the state dict its bit generator is set
    from: only the two numbers in it change from sample to sample."""

    __slots__ = ("rng", "bits", "whole", "numbers")

    def __init__(self) -> None:
        self.bits = np.random.PCG64()
        self.rng = np.random.Generator(self.bits)
        self.numbers: dict[str, int] = {"state": 0, "inc": 1}
        self.whole = {"bit_generator": "PCG64", "state": self.numbers, "has_uint32": 0,
                      "uinteger": 0}


def scratch_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """:func:`sample_rng`'s generator, same draws, but this thread's one generator re-seeded.

    Re-seeding is cheaper than creating a ``PCG64`` (``benchmarks/bench_peers.py``, decode
    phase). The generator is valid only until the thread's next call, so this is for a caller
    that draws everything it needs at once (:class:`~feedpipe.ImagePipeline`, the DALI stage)
    and keeps no reference."""
    s = getattr(_SCRATCH, "s", None)
    if s is None:
        s = _SCRATCH.s = _Scratch()
    numbers = s.numbers
    numbers["state"], numbers["inc"] = _state_inc(seed, epoch, index)
    s.bits.state = s.whole
    return s.rng


def seed_of(sample: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(seed, epoch, index)`` of a sample dict, seed and epoch 0 where it has none."""
    if "__index__" not in sample:
        raise KeyError("a random transform needs the sample's '__index__' (its global id) to seed "
                       "its augmentation; samples from FeedDataset carry it")
    return sample.get("__seed__", 0), sample.get("__epoch__", 0), sample["__index__"]


def rng_of(sample: Mapping[str, Any]) -> np.random.Generator:
    """:func:`sample_rng` of a sample dict (``__seed__``, ``__epoch__``, ``__index__``)."""
    return sample_rng(*seed_of(sample))
