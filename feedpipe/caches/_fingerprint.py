"""Fingerprints of functions: a stable hash of a callable's code and the values it holds.

Used by the L2 function index (:class:`~feedpipe.caches.l2._index.FunctionIndex`) and
the decoded store (``FeedDataset(decoded_cache=)``). Their entries are keyed by the fingerprint.
So changing a function's code, its default arguments, the values it closes over, or (for callable
objects and ``functools.partial``) its parameters makes its old entries unreachable. The same
value gives the same fingerprint in every process and on every machine.

**What it sees**, recursively: code (of functions, lambdas, methods, and of the classes of
callable objects with every class they inherit from); numbers, strings, bytes, containers (a set
or dict in an order of its own, the same whatever the hash seed, set literals in code too); NumPy
arrays and torch tensors (values, dtype and shape; not their device, strides or
``requires_grad``); ``torch.nn.Module`` state (parameters, buffers, plain attributes, submodules,
train/eval mode); dataclass fields, ``__slots__`` and ``__dict__`` of any object, or what its
class's ``__fingerprint__()`` returns where it has one (the values that decide its outputs, when
it also keeps counters or caches); attributes set on a function.

A fingerprint is of the state *now*: the caches take it again at each pass
(:mod:`feedpipe.caches._passes`), so a transform changed between epochs keys new values.

**What it cannot see**: module globals a function reads (``co_names`` gives their names, not
their values), files or environment variables read at call time, the code of C extensions. Nor
the state of objects that have none of the above: their ``repr``, when it shows a memory
address, differs in every process, so such entries are never found again (a warning says so).
When something it cannot see changes, change something it can:
``FunctionIndex.wrap(fn, version=2)``, or a ``version`` attribute on the transform object (or
function) given to ``decoded_cache=``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import os
import sys
import types
import warnings
import weakref
from typing import Any

import numpy as np

_unseen: set[str] = set()  # types already warned about
_DEPTH = 100  # nesting of containers and objects followed


def _code(h: Any, code: types.CodeType, depth: int) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code(h, c, depth + 1)
        else:  # a set literal is a frozenset constant: its repr's order follows the hash seed
            _value(h, c, depth + 1, set())


def _unordered(h: Any, items: Any, depth: int, seen: set[int]) -> None:
    """The members of a set (or a dict's ``(key, value)`` pairs), in an order that is the same
    in every process: sorted by each one's own hash, not by its repr (a set inside shows its
    members in an order that follows the hash seed)."""
    digests = []
    for x in items:
        sub = hashlib.blake2b(digest_size=16)
        _value(sub, x, depth + 1, seen)
        digests.append(sub.digest())
    for d in sorted(digests):
        h.update(d)


def _value(h: Any, v: Any, depth: int, seen: set[int]) -> None:
    if depth > _DEPTH or id(v) in seen:
        h.update(b"<cycle>")
        return
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
        return
    seen = seen | {id(v)}
    if _container(h, v, depth, seen):
        return
    torch = sys.modules.get("torch")  # a torch value exists only where torch was imported
    if torch is not None and isinstance(v, torch.Tensor):
        _tensor(h, v, torch)
        return
    if _callable(h, v, depth, seen):
        return
    if isinstance(v, enum.Enum):
        h.update(f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}".encode())
        return
    if isinstance(v, os.PathLike):
        h.update(f"path:{type(v).__name__}:{os.fspath(v)!r}".encode())
        return
    _instance(h, v, depth, seen, torch)


def _container(h: Any, v: Any, depth: int, seen: set[int]) -> bool:
    """Hash ``v`` if it is a tuple, list, set, dict or numpy value; whether it was one."""
    if isinstance(v, (tuple, list)):
        h.update(f"{type(v).__name__}[{len(v)}]".encode())
        for x in v:
            _value(h, x, depth + 1, seen)
    elif isinstance(v, (frozenset, set)):
        h.update(f"{type(v).__name__}[{len(v)}]".encode())
        _unordered(h, v, depth, seen)
    elif isinstance(v, dict):
        h.update(f"dict[{len(v)}]".encode())
        _unordered(h, v.items(), depth, seen)
    elif isinstance(v, np.ndarray):
        h.update(f"ndarray{v.dtype.str}{v.shape}".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    elif isinstance(v, np.generic):
        h.update(f"np:{v.dtype.str}:{v!r}".encode())
    else:
        return False
    return True


def _callable(h: Any, v: Any, depth: int, seen: set[int]) -> bool:
    """Hash ``v`` if it is a partial, a method, a function, a builtin, a class or a module;
    whether it was one."""
    if isinstance(v, functools.partial):
        h.update(b"partial")
        _value(h, v.func, depth + 1, seen)
        _value(h, v.args, depth + 1, seen)
        _value(h, v.keywords, depth + 1, seen)
    elif isinstance(v, types.MethodType):
        _value(h, v.__func__, depth + 1, seen)
        _value(h, v.__self__, depth + 1, seen)
    elif isinstance(v, types.FunctionType):
        _function(h, v, depth, seen)
    elif isinstance(v, (types.BuiltinFunctionType, type, types.ModuleType)):
        module = getattr(v, "__module__", "")
        name = getattr(v, "__qualname__", getattr(v, "__name__", ""))
        h.update(f"{type(v).__name__}:{module}.{name}".encode())
    else:
        return False
    return True


def _function(h: Any, v: types.FunctionType, depth: int, seen: set[int]) -> None:
    """A function by its name, code, defaults, the values it closes over and its attributes."""
    h.update(f"fn:{v.__module__}.{v.__qualname__}".encode())
    _code(h, v.__code__, 0)
    _value(h, v.__defaults__, depth + 1, seen)
    _value(h, v.__kwdefaults__, depth + 1, seen)
    for cell in v.__closure__ or ():
        try:
            _value(h, cell.cell_contents, depth + 1, seen)
        except ValueError:  # empty cell
            h.update(b"<empty>")
    if v.__dict__:  # attributes set on the function (a version, functools.wraps' target)
        _value(h, v.__dict__, depth + 1, seen)


def _tensor(h: Any, t: Any, torch: Any) -> None:
    """Values, dtype and shape: the same for a copy on another device, with other strides, or
    that requires grad."""
    h.update(f"tensor:{t.dtype}:{tuple(t.shape)};".encode())
    if t.device.type == "meta":  # no values
        h.update(b"<meta>")
        return
    x = t.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    if x.is_quantized:
        x = x.dequantize()
    x = x.resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    h.update(x.view(torch.uint8).numpy().data)


_CLASS_CODE: weakref.WeakKeyDictionary[type, bytes] = weakref.WeakKeyDictionary()


def _class_code(cls: type) -> bytes:
    """A class's name and code, with the code of every class it inherits from (its MRO but
    ``object``), once per class: the source of each class of the program; for a class of an
    installed library or of the standard library, the bytes of the file that defines it (they
    change with its version; finding one class's source in a long library module costs a parse
    of the whole module); else its functions' byte code."""
    try:
        return _CLASS_CODE[cls]
    except (KeyError, TypeError):
        pass
    h = hashlib.blake2b(digest_size=16)
    for klass in cls.__mro__:
        if klass is object:
            continue
        h.update(f"obj:{klass.__module__}.{klass.__qualname__}".encode())
        library = _library_file(klass)
        try:
            h.update(_file_digest(library) if library else inspect.getsource(klass).encode())
        except (OSError, TypeError):
            for name in sorted(vars(klass)):
                attr = vars(klass)[name]
                if isinstance(attr, types.FunctionType):
                    _code(h, attr.__code__, 0)
    digest = h.digest()
    try:
        _CLASS_CODE[cls] = digest
    except TypeError:  # a type that takes no weak reference: not kept
        pass
    return digest


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "purelib", "platlib")
                  if paths.get(k)})


def _library_file(klass: type) -> str | None:
    """The file defining ``klass`` when it belongs to an installed library (or the standard
    library), else ``None``."""
    module = sys.modules.get(klass.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    path = os.path.realpath(path)
    return path if path.startswith(_library_dirs()) else None


@functools.lru_cache(maxsize=256)
def _file_digest(path: str) -> bytes:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=16).digest()


_MODULE_PARTS = ("_parameters", "_buffers", "_modules", "_compiled_call_impl")


def _module(h: Any, v: Any, depth: int, seen: set[int]) -> None:
    """Every submodule, flat (a deep network is not a deep recursion): its class's code, its
    plain attributes (hook tables left out: handles are numbered per process), parameters and
    buffers by name."""
    for name, m in v.named_modules(remove_duplicate=False):
        h.update(f"module:{name};".encode())
        h.update(_class_code(type(m)))
        attrs = {k: x for k, x in vars(m).items() if k not in _MODULE_PARTS and "hook" not in k}
        _value(h, attrs, depth + 1, seen)
        for kind in ("_parameters", "_buffers"):
            for pname, t in getattr(m, kind).items():
                h.update(f"{kind}:{pname};".encode())
                _value(h, t, depth + 1, seen)


def _instance(h: Any, v: Any, depth: int, seen: set[int], torch: Any) -> None:
    """A callable object or any other instance: its class's code and its state (what its
    class's ``__fingerprint__()`` returns, where it has one: e.g. a memoised function, whose
    bookkeeping changes at every pass, but not what it computes)."""
    if torch is not None and isinstance(v, torch.nn.Module):
        _module(h, v, depth, seen)
        return
    cls = type(v)
    h.update(_class_code(cls))
    own = getattr(cls, "__fingerprint__", None)
    if own is not None:
        _value(h, own(v), depth + 1, seen)
        return
    state: dict[str, Any] = {}
    if dataclasses.is_dataclass(v):
        state.update((f.name, getattr(v, f.name)) for f in dataclasses.fields(v))
    for klass in cls.__mro__:
        for name in _slots(klass):
            if name not in ("__dict__", "__weakref__") and hasattr(v, name):
                state[name] = getattr(v, name)
    attrs = getattr(v, "__dict__", None)
    if attrs is not None:
        state.update(attrs)
    if state or attrs is not None:
        _value(h, state, depth + 1, seen)
        return
    text = repr(v)
    if " at 0x" in text and cls.__qualname__ not in _unseen:
        _unseen.add(cls.__qualname__)
        warnings.warn(
            f"the function fingerprint cannot see the state of a {cls.__module__}."
            f"{cls.__qualname__} (no __dict__, slots or dataclass fields; its repr holds a memory "
            "address): memoised entries of a function holding one are not found by another "
            "process. Hold plain values instead, or give FunctionIndex.wrap(version=...)",
            RuntimeWarning, stacklevel=4)
    h.update(text.encode())


def _slots(klass: type) -> tuple[str, ...]:
    slots = vars(klass).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def fingerprint(fn: Any, params: Any = None) -> bytes:
    """16-byte fingerprint of a callable (code and parameters) and optional extra ``params``.

    Example:
        >>> def f(x, k=2): return x * k
        >>> def g(x, k=3): return x * k
        >>> fingerprint(f) == fingerprint(f), fingerprint(f) == fingerprint(g)
        (True, False)
    """
    h = hashlib.blake2b(digest_size=16, person=b"feedpipe-fn-v1")
    _value(h, fn, 0, set())
    if params is not None:
        _value(h, params, 0, set())
    return h.digest()
