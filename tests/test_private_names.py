"""No module of the package reads another module's private names: an AST scan of feedpipe/.

A private name (``_x``, not ``__x__``) may be used on ``self``/``cls``, on a name defined in the
same module, or where it is an attribute that only the module's own classes define (no other
module of the package defines an attribute of that name); private *modules* (``feedpipe/_x.py``,
``from . import _jpegcrop``) may be imported. What is refused: ``obj._attr`` on an object
another module made, ``getattr(obj, "_attr")`` (and ``setattr``/``hasattr``/``delattr``), and
``from .m import _name`` / ``from feedpipe.m import _name`` of a name that is not a module.
Attributes of third-party objects whose public API is spelled with an underscore
(``namedtuple._make``, ``argparse._SubParsersAction``, torch's ``storage._cdata``) are listed.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "feedpipe"

# third-party attributes spelled with an underscore, read on purpose
THIRD_PARTY = {"_make", "_SubParsersAction", "_cdata", "_asdict", "_replace", "_fields",
               "_new_shared", "_C", "_utils", "_exit", "_current_frames",
               "_registry", "_storage_Use_Count", "_pipes",
               # torch's DataLoader: the one way to stop an iterator's workers as an error
               # leaves it, and to drop the persistent iterator that error left behind
               "_shutdown_workers", "_iterator"}
REFLECTION = {"getattr", "setattr", "hasattr", "delattr"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_attributes(tree: ast.AST) -> set[str]:
    """Private attributes a module's own classes define: ``self._x = ...``, ``def _x``,
    ``__slots__``."""
    mine = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"
            and isinstance(n.ctx, ast.Store)}
    mine |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))}
    mine |= {e.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets)
             for e in ast.walk(n.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return {a for a in mine if private(a)}


def is_module(package: Path, directory: Path, name: str) -> bool:
    """Whether ``name`` in ``directory`` (inside ``package``) is a module or subpackage."""
    return ((directory / f"{name}.py").is_file() or (directory / name / "__init__.py").is_file()
            or any(directory.glob(f"{name}.*.so")) or (directory / f"{name}.c").is_file())


def imported_from(package: Path, path: Path, node: ast.ImportFrom) -> Path | None:
    """The package directory an ``import from`` reads (``None``: outside the package)."""
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
    elif node.module and (node.module == package.name
                          or node.module.startswith(package.name + ".")):
        base, rest = package, node.module.split(".")[1:]
        return base.joinpath(*rest)
    else:
        return None
    return base.joinpath(*node.module.split(".")) if node.module else base


def violations(path: Path, package: Path = PACKAGE, others: set[str] | None = None
               ) -> list[str]:
    """``path``'s reads of private names of other modules. ``others``: the private attributes
    other modules of ``package`` define (a name only this module defines may be read on any
    object; a name others define too must be read on ``self``/``cls``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {n.name for n in ast.walk(tree)
           if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)}
    mine = defined_attributes(tree) - (others or set())
    out = []
    rel = path.relative_to(package.parent)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            where = imported_from(package, path, node)
            for alias in node.names if where is not None else ():
                if private(alias.name) and not is_module(package, where, alias.name):
                    out.append(f"{rel}:{node.lineno}: from {'.' * node.level}"
                               f"{node.module or ''} import {alias.name}")
            continue
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in REFLECTION and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attr, base = node.args[1].value, node.args[0]
            where = f"{node.func.id}({ast.unparse(base)}, {attr!r})"
        elif isinstance(node, ast.Attribute):
            attr, base = node.attr, node.value
            where = f"{ast.unparse(base)}.{attr}"
        else:
            continue
        if not private(attr) or attr in THIRD_PARTY:
            continue
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in own):
            continue
        if attr in mine:
            continue
        out.append(f"{rel}:{node.lineno}: {where}")
    return out


def scan(package: Path) -> list[str]:
    files = sorted(package.rglob("*.py"))
    defined = {p: defined_attributes(ast.parse(p.read_text(encoding="utf-8"))) for p in files}
    found = []
    for p in files:
        others = set().union(*(d for q, d in defined.items() if q != p))
        found += violations(p, package, others)
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    found = scan(PACKAGE)
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_the_scan_sees_a_violation(tmp_path: Path) -> None:
    """Each kind of read the scan refuses, planted in a copy of the package."""
    package = tmp_path / "feedpipe"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "plan" / "__scan_probe.py").write_text(
        "from . import _order, _mix\n"  # a private module (allowed), a private name
        "from ._order import _mix as m\n"
        "from feedpipe.plan._order import _mix as n\n"
        "from ..stream import _dataset\n"  # allowed
        "\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "        self._world_given = 2\n"  # FeedDataset defines _world_given too
        "\n"
        "def f(reader, ds, mine):\n"
        "    return (reader._starts, getattr(ds, '_world_given'), ds._world_given, mine._own,\n"
        "            hasattr(ds, 'public'))\n")
    got = [v.split(": ", 1)[1] for v in scan(package)]
    assert got == ["from . import _mix", "from ._order import _mix",
                   "from feedpipe.plan._order import _mix", "reader._starts",
                   "getattr(ds, '_world_given')", "ds._world_given"], got
