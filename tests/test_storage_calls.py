"""One module family owns the storage calls: an AST scan of feedpipe/ finds no module outside
``feedpipe/_helpers/storage*.py`` that talks to fsspec itself.

What is refused elsewhere:

- importing fsspec (``import fsspec``, ``from fsspec... import``) or naming ``fsspec.x`` or
  ``url_to_fs``;
- importing ``filesystem`` from a storage module (it hands out the raw fsspec filesystem, whose
  methods would then be called outside);
- calling a method only fsspec's filesystems have (``cat_file``, ``pipe_file``,
  ``unstrip_protocol``, ...) on anything;
- calling a filesystem method (``open``, ``size``, ``info``, ``walk``, ``rm``, ...) on an object
  named ``fs`` or ``..._fs`` (``fs.open``, ``self._fs.size``, ``files.fs.walk``).

A mention of fsspec in a docstring, comment or message is fine: strings are not read.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "feedpipe"

# Modules (relative to the repository) that may still call fsspec themselves, each with why.
# Empty: every call goes through feedpipe/_helpers/storage*.py.
ALLOWED: dict[str, str] = {}

# methods no object of the package has but an fsspec filesystem
FSSPEC_ONLY = {"cat_file", "cat_ranges", "pipe_file", "put_file", "get_file", "unstrip_protocol",
               "_strip_protocol", "url_to_fs", "open_files", "get_mapper"}
# methods of an fsspec filesystem that other objects have too: refused on an ``fs`` receiver
# (not ``get``: the probe names a dict of the filesystem under it ``fs``)
FS_METHODS = {"open", "size", "sizes", "info", "exists", "isdir", "isfile", "walk", "ls", "find",
              "glob", "du", "cat", "pipe", "rm", "rm_file", "mkdir", "makedirs", "touch", "mv",
              "copy", "cp", "put", "head", "tail", "read_bytes", "read_text",
              "write_bytes", "write_text", "modified", "checksum", "listdir"}


def is_storage_module(path: Path, package: Path) -> bool:
    rel = path.relative_to(package)
    return rel.parts[:1] == ("_helpers",) and rel.name.startswith("storage")


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_fs(node: ast.expr) -> bool:
    name = _last_name(node)
    return name is not None and (name == "fs" or name.endswith("_fs"))


def violations(path: Path, package: Path = PACKAGE) -> list[str]:
    """``path``'s own calls to fsspec (see the module's docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(package.parent)
    out: list[tuple[int, int, str]] = []

    def say(node: ast.AST, what: str) -> None:
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        out.append((line, col, f"{rel}:{line}: {what}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fsspec":
                    say(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.split(".")[0] == "fsspec":
                say(node, f"from {module} import ...")
            elif module.split(".")[-1].startswith("storage"):
                for alias in node.names:
                    if alias.name == "filesystem":
                        say(node, f"from {'.' * node.level}{module} import filesystem")
        elif isinstance(node, ast.Name) and node.id == "url_to_fs":
            say(node, "url_to_fs")
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "fsspec":
                say(node, ast.unparse(node))
            elif node.attr in FSSPEC_ONLY:
                say(node, ast.unparse(node))
            elif node.attr in FS_METHODS and _is_fs(node.value):
                say(node, ast.unparse(node))
    return [what for _, _, what in sorted(out)]


def scan(package: Path) -> list[str]:
    found = []
    for p in sorted(package.rglob("*.py")):
        if is_storage_module(p, package):
            continue
        found += [v for v in violations(p, package) if v.split(":", 1)[0] not in ALLOWED]
    return found


def test_no_module_outside_the_storage_layer_calls_fsspec() -> None:
    found = scan(PACKAGE)
    assert not found, ("fsspec called outside feedpipe/_helpers/storage*.py (give the storage "
                       "layer a function for it):\n" + "\n".join(found))


def test_the_allow_list_names_modules_that_exist() -> None:
    for rel, why in ALLOWED.items():
        assert (PACKAGE.parent / rel).is_file() and why, rel


def test_the_scan_sees_each_kind_of_call(tmp_path: Path) -> None:
    """Each kind of call the scan refuses, planted in a copy of the package; the storage layer
    itself and mentions in strings pass."""
    package = tmp_path / "feedpipe"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "format" / "__scan_probe.py").write_text(
        '"""Reads through fsspec (a mention: allowed)."""\n'
        "import fsspec.core\n"
        "from fsspec.core import url_to_fs\n"
        "from .._helpers.storage import filesystem, is_local\n"
        "import os\n"
        "\n"
        "def f(url, reader, files):\n"
        "    fs, path = url_to_fs(url)\n"
        "    other = fsspec.filesystem('memory')\n"
        "    with fs.open(path) as stream:\n"
        "        data = stream.read()\n"
        "    return (reader._fs.size(path), files.fs.walk(path), other.cat_file(path),\n"
        "            os.walk(path), data.find(b'x'), reader.open(path), 'fs.open(path)')\n")
    (package / "_helpers" / "storage_scan_probe.py").write_text(
        "import fsspec\n\ndef g(fs):\n    return fs.open('x'), fsspec.filesystem('memory')\n")
    found = scan(package)
    assert not [v for v in found if "storage_scan_probe" in v]
    got = [v.split(": ", 1)[1] for v in found if "__scan_probe" in v]
    assert got == ["import fsspec.core", "from fsspec.core import ...",
                   "from .._helpers.storage import filesystem", "url_to_fs",
                   "fsspec.filesystem", "fs.open", "reader._fs.size", "files.fs.walk",
                   "other.cat_file"], got
