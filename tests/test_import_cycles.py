"""tools/import_cycles.py: circles of imports among feedpipe's modules, imports inside functions
counted (import-linter's layers contract leaves out imports within one layer)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
assert _spec is not None and _spec.loader is not None
import_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_cycles)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_an_import_inside_a_function_that_closes_a_circle_is_a_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from . import a\n    return a\n",
        "c.py": "from pkg.a import f\n",
    })
    components, graph = import_cycles.cycles(root)
    assert components == [["pkg.a", "pkg.b"]]
    assert graph["pkg.b"] == {"pkg.a": 2}


def test_type_checking_imports_and_one_way_imports_make_no_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"
                "def f():\n    from .sub.c import g\n",
        "sub/__init__.py": "",
        "sub/c.py": "def g():\n    import os\n",
    })
    assert import_cycles.cycles(root)[0] == []


def test_a_module_importing_its_package_whose_init_imports_it_is_a_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from .c import g\n",
        "sub/c.py": "def g():\n    pass\n",
        "d.py": "from .sub.c import g\n",
        "sub/e.py": "from ..d import g\n",
    })
    # importing pkg.sub.c runs pkg/sub/__init__ first; it does not import e, so no circle
    assert import_cycles.cycles(root)[0] == []
    (root / "sub" / "__init__.py").write_text("from .e import g\n")
    assert import_cycles.cycles(root)[0] == [["pkg.d", "pkg.sub", "pkg.sub.e"]]


def test_feedpipe_has_no_import_cycle() -> None:
    # convert/_shard with _tables/_table_rows, format/_tar with _compression and a circle of 9
    # modules in stream/ (closed by assemble()'s imports inside functions) were circles
    components, graph = import_cycles.cycles(ROOT / "feedpipe")
    assert components == [], [{m: sorted(set(graph[m]) & set(c)) for m in c} for c in components]


def test_the_import_linter_acyclic_contract_covers_every_package() -> None:
    # lint-imports checks the same bar: its acyclic contract starts at the root package and
    # leaves no package (stream/ included) out
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    acyclic = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    assert len(acyclic) == 1
    assert acyclic[0]["ancestors"] == ["feedpipe"]
    assert not acyclic[0].get("skip_descendants")
    assert acyclic[0].get("depth", 10) >= 3  # feedpipe.caches.l1._entry is three levels down


def test_the_command_names_the_imports_of_a_cycle_and_fails(tmp_path: Path) -> None:
    root = _package(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n",
                               "b.py": "def f():\n    import pkg.a\n"})
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(root)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "pkg.a -> pkg.b (line 1)" in run.stdout
    assert "pkg.b -> pkg.a (line 2)" in run.stdout
    clean = _package(tmp_path / "clean", {"__init__.py": "", "a.py": "import pkg.b\n",
                                          "b.py": "import os\n"})
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(clean)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
