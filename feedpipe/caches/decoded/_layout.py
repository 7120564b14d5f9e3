"""The fixed record layout of a transform's output, as the decoded store keeps it. Pure.

A transform's output is a tree of containers (``tuple``, ``list``, ``dict`` with ``str`` keys)
whose leaves are CPU tensors, numpy arrays, numpy scalars and Python ``bool``/``int``/``float``.
:func:`flatten` splits it into a JSON-able *tree* and its leaves as numpy arrays; a
:class:`Layout` places the leaves in one fixed-size record (each at a 64-byte aligned offset)
and rebuilds the same tree, with the same leaf types, from a record's bytes.

Dict entries whose key starts with ``__`` (a sample's ``__key__``, ``__index__`` ...) are metadata:
they are not part of the record, so a cached dict output never carries them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

ALIGN = 64
_PY = {bool: ("bool", np.bool_), int: ("int", np.int64), float: ("float", np.float64)}


class LayoutError(ValueError):
    """An output that cannot be stored in a fixed record (the store adds the sample's key)."""


def flatten(out: Any) -> tuple[Any, list[tuple[str, np.ndarray]]]:
    """``(tree, [(kind, array), ...])`` of a transform output.

    Example:
        >>> tree, leaves = flatten((np.zeros((2, 3), np.uint8), 7))
        >>> tree, [(k, a.dtype.str, a.shape) for k, a in leaves]
        (['tuple', ['leaf', 'leaf']], [('ndarray', '|u1', (2, 3)), ('int', '<i8', ())])
    """
    leaves: list[tuple[str, np.ndarray]] = []
    return _flatten(out, leaves, "output"), leaves


def _flatten(x: Any, leaves: list[tuple[str, np.ndarray]], where: str) -> Any:
    if isinstance(x, np.ndarray):
        leaves.append(("ndarray", x))
        return "leaf"
    torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise LayoutError(f"{where} is a tensor on {x.device}; the store keeps CPU tensors")
        try:
            leaves.append(("tensor", x.detach().numpy()))
        except TypeError as e:
            raise LayoutError(f"{where} is a {x.dtype} tensor, which numpy cannot hold") from e
        return "leaf"
    if type(x) in _PY:
        kind, dtype = _PY[type(x)]
        try:
            leaves.append((kind, np.asarray(x, dtype=dtype)))
        except OverflowError as e:
            raise LayoutError(f"{where} is an int too large for int64: {x}") from e
        return "leaf"
    if isinstance(x, np.generic):
        leaves.append(("scalar", np.asarray(x)))
        return "leaf"
    if isinstance(x, (tuple, list)):
        kind = "tuple" if isinstance(x, tuple) else "list"
        return [kind, [_flatten(v, leaves, f"{where}[{i}]") for i, v in enumerate(x)]]
    if isinstance(x, dict):
        items = []
        for k, v in x.items():
            if not isinstance(k, str):
                raise LayoutError(f"{where} has a non-string key {k!r}")
            if not k.startswith("__"):
                items.append([k, _flatten(v, leaves, f"{where}[{k!r}]")])
        return ["dict", items]
    raise LayoutError(
        f"{where} is a {type(x).__name__}; the store keeps fixed-shape arrays, tensors and numbers "
        "(in tuples, lists and dicts)"
    )


@dataclass(frozen=True)
class Leaf:
    kind: str  # ndarray, tensor, scalar, bool, int, float
    dtype: str  # numpy dtype string, e.g. '|u1'
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def describe(self) -> str:
        return f"{self.kind} {np.dtype(self.dtype).name}{list(self.shape)}"


@dataclass(frozen=True)
class Layout:
    """Where each leaf of an output lies in a record of ``record`` bytes.

    Example:
        >>> out = {"image": np.full((2, 2), 5, np.uint8), "label": 3}
        >>> lay = Layout.of(*flatten(out))
        >>> rec = np.zeros(lay.record, np.uint8)
        >>> lay.pack(rec, flatten(out)[1])
        >>> back = lay.unpack(rec)
        >>> back["image"].tolist(), back["label"], lay.record
        ([[5, 5], [5, 5]], 3, 128)
    """

    tree: Any
    leaves: tuple[Leaf, ...]
    record: int

    @classmethod
    def of(cls, tree: Any, leaves: list[tuple[str, np.ndarray]]) -> Layout:
        placed, off = [], 0
        for kind, a in leaves:
            placed.append(Leaf(kind, a.dtype.str, tuple(int(n) for n in a.shape), off, a.nbytes))
            off += -(-max(a.nbytes, 1) // ALIGN) * ALIGN
        return cls(tree, tuple(placed), max(off, ALIGN))

    # -- (de)serialisation and comparison ------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"tree": self.tree, "record": self.record,
                "leaves": [[f.kind, f.dtype, list(f.shape), f.offset, f.nbytes]
                           for f in self.leaves]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Layout:
        leaves = tuple(Leaf(k, d, tuple(s), o, n) for k, d, s, o, n in doc["leaves"])
        return cls(doc["tree"], leaves, int(doc["record"]))

    def ident(self) -> str:
        """A stable text of the layout (names the store's files)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def mismatch(self, tree: Any, leaves: list[tuple[str, np.ndarray]]) -> str | None:
        """What differs between this layout and an output (``None``: it fits)."""
        if tree != self.tree or len(leaves) != len(self.leaves):
            return (f"an output structured {_short(tree)} where the store holds "
                    f"{_short(self.tree)}")
        for i, ((kind, a), f) in enumerate(zip(leaves, self.leaves)):
            if kind != f.kind or a.dtype.str != f.dtype or a.shape != f.shape:
                got = f"{kind} {a.dtype.name}{list(a.shape)}"
                return f"leaf {i} is {got} where the store holds {f.describe()}"
        return None

    # -- records ----------------------------------------------------------------------------
    def pack(self, rec: np.ndarray, leaves: list[tuple[str, np.ndarray]]) -> None:
        """Write the leaves into ``rec`` (a ``uint8`` array of ``record`` bytes)."""
        for (_, a), f in zip(leaves, self.leaves):
            rec[f.offset:f.offset + f.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)

    def unpack(self, rec: np.ndarray) -> Any:
        """The output held in ``rec`` (a writable ``uint8`` array the result may share)."""
        values = [self._leaf(rec, f) for f in self.leaves]
        return _build(self.tree, iter(values))

    @staticmethod
    def _leaf(rec: np.ndarray, f: Leaf) -> Any:
        a = rec[f.offset:f.offset + f.nbytes].view(np.dtype(f.dtype)).reshape(f.shape)
        if f.kind == "ndarray":
            return a
        if f.kind == "tensor":
            import torch

            return torch.from_numpy(a)
        if f.kind == "scalar":
            return a[()]
        return {"bool": bool, "int": int, "float": float}[f.kind](a[()])


def _build(tree: Any, values: Any) -> Any:
    if tree == "leaf":
        return next(values)
    kind, items = tree
    if kind == "dict":
        return {k: _build(sub, values) for k, sub in items}
    built = [_build(sub, values) for sub in items]
    return tuple(built) if kind == "tuple" else built


def _short(tree: Any) -> str:
    text = json.dumps(tree, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."
