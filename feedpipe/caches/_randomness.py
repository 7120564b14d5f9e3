"""Random transforms under a cache: found in what a transform holds, or caught drawing.

A cache keyed by a transform and its input (the L2 function index, the decoded store) serves
one output per sample for good; a transform that draws (a random crop, ``random.random()``,
``np.random``, ``torch.rand``, an rng seeded by the sample's ``__epoch__``) would have its
first draw frozen. Two checks refuse it with :class:`~feedpipe.errors.UncacheableTransformError`:

* :func:`random_part`, when the cache is made and when the transform's state changes: a part
  known to draw, anywhere in what the transform holds (the closure, defaults and attributes of a
  function, the module globals its code names, an object's attributes, containers,
  ``functools.partial``):
  an object whose ``spec.train`` is ``True`` (:class:`~feedpipe.ImagePipeline`,
  :class:`~feedpipe.DaliStage`) and torchvision's ``Random*`` transforms (and the few others
  of its that draw: ``ColorJitter``, ``RandAugment``, ...).
* :class:`DrawCheck`, on the first samples a process stores: the transform is run once more on
  a copy of the sample with ``__epoch__`` and ``__seed__`` moved on (another epoch's draw), and
  its output must be the same, bit for bit.

A transform (object or function) whose attribute ``deterministic`` is ``True`` is taken at its
word and not run twice (for one whose calls have effects: a log of the samples it decoded); the
first check still applies to it.

**What they cannot see**: a transform that draws rarely enough to give the same output on
those few samples (a flip with probability 0.01), one whose draw depends on something else
that changes between epochs (a counter it keeps, the time, a file), and one that changes the
sample it is given so that the second run fails (then the check is skipped, with a warning).
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from typing import Any

import numpy as np

from ..errors import UncacheableTransformError

CHECKED = 4  # samples run twice per process and fingerprint
_NODES = 10_000  # objects looked at by random_part, at most
_ITEMS = 1_000  # members of one container looked at, at most
_DEPTH = 12
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, memoryview, type,
           types.ModuleType, types.BuiltinFunctionType, types.CodeType, np.ndarray, np.generic)


def random_part(transform: Any) -> str | None:
    """What in ``transform`` draws at random (e.g. ``"ImagePipeline with train=True (in the
    closure of f)"``), or ``None`` when no known random part is found.

    Example:
        >>> from feedpipe import ImagePipeline
        >>> def make():
        ...     pipe = ImagePipeline(32, train=True)
        ...     return lambda s: pipe(s)
        >>> random_part(make())
        'ImagePipeline with train=True (in the closure of make.<locals>.<lambda>)'
        >>> random_part(ImagePipeline(32, train=False)) is None
        True
    """
    walk = _Walk()
    return walk.visit(transform, "", 0)


class _Walk:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.torch = sys.modules.get("torch")

    def visit(self, v: Any, where: str, depth: int) -> str | None:
        if isinstance(v, _LEAVES) or depth > _DEPTH or id(v) in self.seen \
                or len(self.seen) >= _NODES:
            return None
        if self.torch is not None and isinstance(v, self.torch.Tensor):
            return None
        self.seen.add(id(v))
        found = _drawer(v)
        if found is not None:
            return found + where
        return self.inside(v, where, depth + 1)

    def each(self, items: Any, where: str, depth: int) -> str | None:
        for n, x in enumerate(items):
            if n >= _ITEMS:
                break
            found = self.visit(x, where, depth)
            if found is not None:
                return found
        return None

    def inside(self, v: Any, where: str, depth: int) -> str | None:
        if isinstance(v, dict):
            return self.each(v.values(), where, depth)
        if isinstance(v, (list, tuple, set, frozenset)):
            return self.each(v, where, depth)
        if isinstance(v, functools.partial):
            return self.each((v.func, *v.args, *v.keywords.values()), where, depth)
        if isinstance(v, types.MethodType):
            return self.each((v.__self__, v.__func__), where, depth)
        if isinstance(v, types.FunctionType):
            return self.function(v, where, depth)
        return self.instance(v, where, depth)

    def function(self, f: types.FunctionType, where: str, depth: int) -> str | None:
        here = where or f" (in the closure of {f.__qualname__})"
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        parts = [*cells, *(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values(),
                 *vars(f).values()]
        found = self.each(parts, here, depth)
        if found is not None:
            return found
        names = _names(f.__code__)
        g = f.__globals__
        return self.each((g[n] for n in names if n in g),
                         where or f" (a global that {f.__qualname__} reads, in {f.__module__})",
                         depth)

    def instance(self, v: Any, where: str, depth: int) -> str | None:
        parts: list[Any] = []
        attrs = getattr(v, "__dict__", None)
        if isinstance(attrs, dict):
            parts += attrs.values()
        for klass in type(v).__mro__:
            slots = vars(klass).get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__"):
                    parts.append(getattr(v, name, None))
        here = where or f" (in a {type(v).__name__})"
        return self.each(parts, here, depth)


# torchvision transforms that draw, besides its Random* ones
_TORCHVISION = {"ColorJitter", "RandAugment", "AutoAugment", "TrivialAugmentWide", "AugMix",
                "ElasticTransform", "GaussianBlur", "GaussianNoise"}


def _drawer(v: Any) -> str | None:
    """``v`` itself, when it is a part known to draw at random."""
    cls = type(v)
    try:
        spec = getattr(v, "spec", None)
        training = spec is not None and getattr(spec, "train", False) is True
    except Exception:  # an attribute that fails to compute: not one of ours
        training = False
    if training:
        return f"{cls.__name__} with train=True"
    if str(cls.__module__).startswith("torchvision.transforms") and (
            cls.__name__.startswith("Random") or cls.__name__ in _TORCHVISION):
        return f"torchvision's {cls.__name__}"
    return None


def _names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _names(c)
    return names


class DrawCheck:
    """Runs a transform a second time on the first :data:`CHECKED` samples of a process, with
    another epoch's ``__epoch__`` and ``__seed__``, and refuses it when the outputs differ.

    Args:
        what: the cache, for the message (``"decoded_cache="``, ``"FunctionIndex.wrap()"``).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.left = CHECKED

    def __getstate__(self) -> dict[str, Any]:  # a worker checks its own first samples
        return {"what": self.what, "left": CHECKED}

    def rearm(self) -> None:
        """Check the next samples again (the transform's state changed)."""
        self.left = CHECKED

    def check(self, transform: Any, sample: Any, out: Any) -> None:
        """Raise :class:`~feedpipe.errors.UncacheableTransformError` when ``transform`` run on
        another epoch's copy of ``sample`` does not give ``out`` again."""
        if self.left <= 0 or getattr(transform, "deterministic", False) is True:
            return
        self.left -= 1
        again = _another_epoch(sample)
        try:
            other = transform(again)
        except Exception as e:  # e.g. the first run changed the sample it was given
            warnings.warn(
                f"{self.what}: could not run the transform a second time on sample "
                f"{_key(sample)} to check that it draws nothing at random ({type(e).__name__}: "
                f"{e}); a random transform would be frozen at its first draw", RuntimeWarning,
                stacklevel=4)
            self.left = 0
            return
        if not same(out, other):
            raise UncacheableTransformError(
                f"{self.what}: the transform gave another output for sample {_key(sample)} when "
                "run again with another epoch's __epoch__/__seed__: it draws at random (or "
                "depends on the epoch), and a cache would serve its first draw every epoch. "
                "Cache a deterministic transform and augment after it, or drop the cache.")


def _key(sample: Any) -> str:
    if isinstance(sample, dict) and "__key__" in sample:
        shard = sample.get("__shard__")
        return repr(sample["__key__"]) + (f" of {shard!r}" if shard is not None else "")
    return "(not a sample dict)"


def _another_epoch(sample: Any) -> Any:
    if not isinstance(sample, dict):
        return sample
    again = dict(sample)
    for name in ("__epoch__", "__seed__"):
        if isinstance(again.get(name), int):
            again[name] += 1
    return again


def _same_tensor(torch: Any, a: Any, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = (t.detach().cpu().contiguous().reshape(-1) for t in (a, b))
    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))


def _same_array(a: Any, b: Any) -> bool:
    if not isinstance(b, (np.ndarray, np.generic)):
        return False
    x, y = np.asarray(a), np.asarray(b)
    return x.dtype == y.dtype and x.shape == y.shape and \
        np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


def same(a: Any, b: Any) -> bool:
    """Whether two outputs are equal bit for bit (arrays and tensors: dtype, shape, bytes)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return _same_tensor(torch, a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return _same_array(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # both NaN
        return True
    try:
        return bool(a == b)
    except Exception:
        return a is b
