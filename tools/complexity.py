"""The size bars of feedpipe's code: no function, method or class graded E or F by radon's
cyclomatic complexity, at most 1% of them graded D, and no module over 500 lines.

A function that keeps growing branches is split into named steps before it reaches E; a module
past 500 lines is split along what its parts do. This prints every block graded D or worse
(file, line, name, grade, complexity), the share graded D, and every module over the line limit,
then exits 1 if any bar is missed.

Usage: ``python tools/complexity.py [PACKAGE_DIR]`` (default: ``feedpipe`` beside this file's
parent). Needs radon (the ``dev`` extra).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 500
MAX_D_SHARE = 0.01  # of all blocks (functions, methods, classes)
FAILING_GRADES = ("E", "F")


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    name: str
    grade: str
    complexity: int


def blocks(root: Path) -> tuple[list[Block], int]:
    """Every block graded D or worse, and how many blocks radon grades in all (as ``radon cc``
    counts them: functions, methods and classes; closures inside functions count with their
    function)."""
    from radon.cli import Config
    from radon.cli.harvest import CCHarvester
    from radon.complexity import SCORE, cc_rank

    config = Config(min="A", max="F", exclude=None, ignore=None, show_complexity=True,
                    average=False, total_average=False, order=SCORE, no_assert=False,
                    show_closures=False, include_ipynb=False, ipynb_cells=False)
    graded: list[Block] = []
    total = 0
    for path, found in CCHarvester([str(root)], config).results:
        if isinstance(found, dict):  # radon could not read the file
            raise SystemExit(f"radon cannot read {path}: {found.get('error', found)}")
        for b in found:
            total += 1
            grade = cc_rank(b.complexity)
            if grade >= "D":
                name = f"{b.classname}.{b.name}" if getattr(b, "classname", None) else b.name
                graded.append(Block(path, b.lineno, name, grade, b.complexity))
    return sorted(graded, key=lambda b: (-b.complexity, b.path, b.line)), total


def long_modules(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """Every .py module under ``root`` over ``limit`` lines, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        with path.open("rb") as f:
            n = sum(1 for _ in f)
        if n > limit:
            found.append((str(path), n))
    return sorted(found, key=lambda t: -t[1])


def _shown(path: str, root: Path) -> str:
    """``path`` relative to the directory holding the package, as a reader types it."""
    try:
        return str(Path(path).resolve().relative_to(root.resolve().parent))
    except ValueError:
        return path


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "feedpipe"
    graded, total = blocks(root)
    failed = False
    for b in graded:
        print(f"{_shown(b.path, root)}:{b.line}: {b.name} - {b.grade} ({b.complexity})")
    bad = [b for b in graded if b.grade in FAILING_GRADES]
    d_or_worse = len(graded)
    share = d_or_worse / total if total else 0.0
    print(f"{total} blocks graded; {d_or_worse} D or worse ({share:.1%}, at most "
          f"{MAX_D_SHARE:.0%} allowed: {int(total * MAX_D_SHARE)}), {len(bad)} E or F (none "
          "allowed)")
    if bad or share > MAX_D_SHARE:
        failed = True
    long = long_modules(root)
    for path, n in long:
        print(f"{_shown(path, root)}: {n} lines (at most {MAX_LINES})")
    print(f"{len(long)} module{'s' if len(long) != 1 else ''} over {MAX_LINES} lines")
    if long:
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
