"""tools/complexity.py: radon's grades and module length, the bars of the package's size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "complexity.py"

# a function of 41 branches: radon grades it F
BRANCHY = "def f(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(40)) \
    + "    return -1\n"


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), str(root)], capture_output=True, text=True)


def test_an_f_function_and_a_long_module_fail_and_are_named(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "branchy.py").write_text(BRANCHY)
    (pkg / "long.py").write_text("".join(f"X{i} = {i}\n" for i in range(501)))
    run = _run(pkg)
    assert run.returncode == 1, run.stdout
    assert "pkg/branchy.py:1: f - F (41)" in run.stdout
    assert "pkg/long.py: 501 lines (at most 500)" in run.stdout
    assert "1 E or F (none allowed)" in run.stdout


def test_a_d_share_over_one_percent_fails_and_small_code_passes(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # 25 branches: D; beside 50 plain functions it is 1 block in 51, about 2%
    d = "def d(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(24)) \
        + "    return -1\n"
    plain = "".join(f"def p{i}():\n    return {i}\n" for i in range(50))
    (pkg / "mod.py").write_text(d + plain)
    run = _run(pkg)
    assert run.returncode == 1, run.stdout
    assert "pkg/mod.py:1: d - D (25)" in run.stdout
    (pkg / "mod.py").write_text(plain)
    run = _run(pkg)
    assert run.returncode == 0, run.stdout
    assert "0 D or worse" in run.stdout and "0 modules over 500 lines" in run.stdout
