"""Import cycles among feedpipe's modules, counting every import: at module level, inside functions
and methods, and under ``if TYPE_CHECKING:`` blocks' ``else`` branches.

import-linter's layers contract sees only the imports it is told about and leaves out imports
between modules of one layer; a function-level import that closes a circle still makes the modules
hard to read and to split. This walks each module's syntax tree (nothing is imported), resolves
every ``import`` and ``from ... import`` to feedpipe modules, and reports the strongly connected
components of that graph. Imports under ``if TYPE_CHECKING:`` are left out: they name types and do
not run.

Usage: ``python tools/import_cycles.py [PACKAGE_DIR]`` (default: ``feedpipe`` beside this file's
parent). Exit status 1 when there is a cycle, each printed with the imports that close it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name of every .py file under the package directory ``root``."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside (``a.b.c`` may name ``a.b``'s c)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {t for alias in node.names if (t := _resolve(alias.name, known))}
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    targets = set()
    for alias in node.names:
        # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
        target = _resolve(f"{prefix}.{alias.name}", known) or _resolve(prefix, known)
        if target:
            targets.add(target)
    return targets


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import of it}; a package's ``__init__`` is
    named by the package."""
    known = module_names(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, int] = {}
        for node in _imports(tree):
            for target in _targets(module, path.name == "__init__.py", node, known):
                if target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _parent_edges(graph: dict[str, dict[str, int]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: those are edges too."""
    edges = {m: set(targets) for m, targets in graph.items()}
    for module, targets in graph.items():
        for target in targets:
            parent = target.rpartition(".")[0]
            while parent and parent in graph and parent != module and not module.startswith(
                parent + "."
            ):
                edges[module].add(parent)
                parent = parent.rpartition(".")[0]
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def cycles(root: Path) -> tuple[list[list[str]], dict[str, dict[str, int]]]:
    graph = import_graph(root)
    return strongly_connected(_parent_edges(graph)), graph


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "feedpipe"
    components, graph = cycles(root)
    for component in components:
        members = set(component)
        print(f"import cycle of {len(component)} modules:")
        for module in component:
            inside = sorted(t for t in graph[module] if t in members)
            for target in inside:
                print(f"  {module} -> {target} (line {graph[module][target]})")
            parents = sorted(
                p for p in members - set(inside) if p != module and any(
                    t.startswith(p + ".") for t in graph[module]
                )
            )
            for parent in parents:
                print(f"  {module} -> {parent} (runs the package's __init__)")
    count = len(components)
    print(f"{count} import cycle{'s' if count != 1 else ''} among {len(graph)} modules "
          "(imports inside functions counted)")
    return 1 if components else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
