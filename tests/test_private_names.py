"""No module of the package reads another module's private names: an AST scan of feedpipe/.

A private name (``_x``, not ``__x__``) may be used on ``self``/``cls``, on a name defined in the
same module, or where it is an attribute the module's own classes define; private *modules*
(``feedpipe/_x.py``, ``from . import _jpegcrop``) may be imported; what is refused is ``obj._attr``
on an object another module made and ``from .m import _name``. Attributes of third-party objects
whose public API is spelled with an underscore (``namedtuple._make``,
``argparse._SubParsersAction``, torch's ``storage._cdata``) are listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "feedpipe"

# third-party attributes spelled with an underscore, read on purpose
THIRD_PARTY = {"_make", "_SubParsersAction", "_cdata", "_asdict", "_replace", "_fields",
               "_new_shared", "_C", "_utils", "_exit", "_current_frames"}


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {n.name for n in ast.walk(tree)
           if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)}
    # private attributes the module's own classes define (self._x = ..., def _x, __slots__):
    # the module may read them on any of its objects
    mine = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"
            and isinstance(n.ctx, ast.Store)}
    mine |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))}
    mine |= {e.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets)
             for e in ast.walk(n.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    out = []
    rel = path.relative_to(PACKAGE.parent)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and node.module:
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__"):
                    out.append(f"{rel}:{node.lineno}: from .{node.module} import {name}")
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__") or attr in THIRD_PARTY:
            continue
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in own):
            continue
        if attr in mine:
            continue
        out.append(f"{rel}:{node.lineno}: {ast.unparse(base)}.{attr}")
    return out


def test_no_module_reads_another_modules_private_names() -> None:
    found = [v for p in sorted(PACKAGE.rglob("*.py")) for v in violations(p)]
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_the_scan_sees_a_violation(tmp_path: Path) -> None:
    bad = PACKAGE / "__scan_probe.py"  # never committed: written and removed here
    bad.write_text("from .plan import _mix\n\ndef f(reader):\n    return reader._starts\n")
    try:
        got = violations(bad)
    finally:
        bad.unlink()
    assert len(got) == 2 and "_mix" in got[0] and "reader._starts" in got[1]
