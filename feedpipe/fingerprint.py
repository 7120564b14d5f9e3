"""Fingerprints of functions: a stable hash of a callable's code and parameters.

Used by the L2 function index: entries of a memoised function are keyed by its fingerprint, so
changing the function's code, its default arguments, the values it closes over, or (for callable
objects and ``functools.partial``) its parameters makes its old entries unreachable.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from typing import Any

import numpy as np


def _code(h: Any, code: types.CodeType, depth: int) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code(h, c, depth + 1)
        else:
            h.update(repr(c).encode())


def _value(h: Any, v: Any, depth: int, seen: set[int]) -> None:
    if depth > 20 or id(v) in seen:
        h.update(b"<cycle>")
        return
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
        return
    seen = seen | {id(v)}
    if isinstance(v, (tuple, list, frozenset, set)):
        h.update(f"{type(v).__name__}[{len(v)}]".encode())
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        for x in items:
            _value(h, x, depth + 1, seen)
        return
    if isinstance(v, dict):
        h.update(f"dict[{len(v)}]".encode())
        for k in sorted(v, key=repr):
            _value(h, k, depth + 1, seen)
            _value(h, v[k], depth + 1, seen)
        return
    if isinstance(v, np.ndarray):
        h.update(f"ndarray{v.dtype.str}{v.shape}".encode())
        h.update(np.ascontiguousarray(v).tobytes())
        return
    if isinstance(v, np.generic):
        h.update(f"np:{v.dtype.str}:{v!r}".encode())
        return
    if isinstance(v, functools.partial):
        h.update(b"partial")
        _value(h, v.func, depth + 1, seen)
        _value(h, v.args, depth + 1, seen)
        _value(h, v.keywords, depth + 1, seen)
        return
    if isinstance(v, types.MethodType):
        _value(h, v.__func__, depth + 1, seen)
        _value(h, v.__self__, depth + 1, seen)
        return
    if isinstance(v, types.FunctionType):
        h.update(f"fn:{v.__module__}.{v.__qualname__}".encode())
        _code(h, v.__code__, 0)
        _value(h, v.__defaults__, depth + 1, seen)
        _value(h, v.__kwdefaults__, depth + 1, seen)
        for cell in v.__closure__ or ():
            try:
                _value(h, cell.cell_contents, depth + 1, seen)
            except ValueError:  # empty cell
                h.update(b"<empty>")
        return
    if isinstance(v, (types.BuiltinFunctionType, type, types.ModuleType)):
        h.update(f"{type(v).__name__}:{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', getattr(v, '__name__', ''))}".encode())
        return
    # a callable object or any other instance: its class's code and its state
    cls = type(v)
    h.update(f"obj:{cls.__module__}.{cls.__qualname__}".encode())
    try:
        h.update(inspect.getsource(cls).encode())
    except (OSError, TypeError):
        for name in sorted(vars(cls)):
            attr = vars(cls)[name]
            if isinstance(attr, types.FunctionType):
                _code(h, attr.__code__, 0)
    state = getattr(v, "__dict__", None)
    if state is not None:
        _value(h, state, depth + 1, seen)
    else:
        h.update(repr(v).encode())


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
