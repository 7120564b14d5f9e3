"""``import feedpipe`` stays light; the command line answers ``--help``; optional dependencies fail
with the exact pip line; the error hierarchy subclasses the builtins callers catch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import feedpipe
from feedpipe import errors
from feedpipe._helpers.dependency import install_hint, require
from feedpipe.cli._main import build_parser, parse_size


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_import_is_light() -> None:
    r = _python("""
        import json, sys, threading
        before = set(sys.modules)
        import feedpipe
        feedpipe.__version__, dir(feedpipe)
        loaded = set(sys.modules) - before
        report = {
            "threads": threading.active_count(),
            "torch": sorted(m for m in loaded if m == "torch" or m.startswith("torch.")),
            "dali": sorted(m for m in loaded if m.startswith("nvidia")),
            "numpy": "numpy" in loaded,
            "fsspec": "fsspec" in loaded,
        }
        import torch  # only now, to ask it whether anything initialised CUDA
        report["cuda_initialized"] = torch.cuda.is_initialized()
        print(json.dumps(report))
    """)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report == {"threads": 1, "torch": [], "dali": [], "numpy": False, "fsspec": False,
                      "cuda_initialized": False}


def test_foundation_modules_do_not_import_torch() -> None:
    """Converting, reading, indexing and verifying need no torch: `feedpipe shard` starts fast."""
    r = _python("""
        import sys, threading
        import feedpipe.cli._main, feedpipe.convert._shard, feedpipe.format._reader
        import feedpipe.format._indexer, feedpipe.format._verify
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("nvidia")))
        print(threading.active_count())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "1"]


def test_no_subpackage_is_named_like_a_public_name() -> None:
    """Importing any module of the package leaves every public name what it is: no subpackage or
    module is bound on the package under a public name (there is no class swap to prevent it)."""
    r = _python("""
        import importlib, pkgutil
        import feedpipe
        for m in pkgutil.walk_packages(feedpipe.__path__, "feedpipe."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
        import types
        print(sorted(n for n in feedpipe.__all__ if n != "__version__"
                     and isinstance(getattr(feedpipe, n), types.ModuleType)))
        print(callable(feedpipe.index), callable(feedpipe.verify), callable(feedpipe.shard))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "True True True"]


def test_type_checking_imports_match_the_lazy_map() -> None:
    """The names the type checker sees (the TYPE_CHECKING block of feedpipe/__init__.py) are the
    lazy map's, from the same modules: the two cannot drift."""
    import ast

    tree = ast.parse(Path(feedpipe.__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If)
                 and getattr(n.test, "id", None) == "TYPE_CHECKING")
    seen = {a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for a in node.names}
    assert seen == feedpipe._LAZY
    assert sorted(feedpipe.__all__) == sorted([*feedpipe._LAZY, "__version__"])


def test_lazy_attributes() -> None:
    assert feedpipe.ShardReader.__module__ == "feedpipe.format._reader"
    assert feedpipe.shard.__module__ == "feedpipe.convert._shard"
    assert set(feedpipe.__all__) <= set(dir(feedpipe)) | {"__version__"}
    with pytest.raises(AttributeError, match="no_such_thing"):
        feedpipe.no_such_thing  # noqa: B018


def _feedpipe_cmd() -> list[str]:
    return [sys.executable, "-m", "feedpipe"]


def _subcommands() -> list[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]  # argparse keeps them here
    return sorted(sub.choices)  # type: ignore[arg-type]


def test_top_level_help_and_version() -> None:
    r = subprocess.run([*_feedpipe_cmd(), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    for cmd in _subcommands():
        assert cmd in r.stdout
    r = subprocess.run([*_feedpipe_cmd(), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"feedpipe {feedpipe.__version__}"
    r = subprocess.run(_feedpipe_cmd(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_console_script_exists() -> None:
    script = Path(sys.executable).parent / "feedpipe"
    exe = str(script) if script.exists() else shutil.which("feedpipe")
    assert exe, "the `feedpipe` console script is not installed"
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: feedpipe" in r.stdout


@pytest.mark.parametrize("cmd", _subcommands())
def test_subcommand_help(cmd: str) -> None:
    r = subprocess.run([*_feedpipe_cmd(), cmd, "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: feedpipe {cmd}")
    assert r.stderr == ""


def test_shard_help_documents_every_option() -> None:
    r = subprocess.run([*_feedpipe_cmd(), "shard", "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "200"})
    for opt in ("--max-bytes", "--max-samples", "--workers", "--shuffle", "--seed", "--on-error",
                "--resume", "--prefix", "--labels-from-dirs", "--manifest", "--json"):
        assert opt in r.stdout


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("256MB", 256 * 10**6), ("1GiB", 1 << 30), ("1.5K", 1536), ("2 mib", 2 << 20)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


# --------------------------------------------------------------------------------------------
# optional dependencies and errors


def test_missing_dependency_carries_exact_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # make the import fail
    with pytest.raises(errors.MissingDependencyError) as ei:
        require("nvidia.dali", purpose="GPU decoding")
    e = ei.value
    assert isinstance(e, ImportError) and isinstance(e, errors.FeedpipeError)
    assert "pip install 'feedpipe[dali]'" in str(e)
    assert str(e).endswith("Install it with: pip install 'feedpipe[dali]'")
    assert "GPU decoding" in str(e)
    assert isinstance(e.__cause__, ImportError)


@pytest.mark.parametrize(
    ("module", "extra", "line"),
    [
        ("s3fs", None, "pip install 'feedpipe[s3]'"),
        ("gcsfs", None, "pip install 'feedpipe[gcs]'"),
        ("dask.distributed", None, "pip install 'feedpipe[dask]'"),
        ("feedpipe_no_such_module_xyz", "fast", "pip install 'feedpipe[fast]'"),
        ("feedpipe_no_such_module_xyz.sub", None, "pip install feedpipe_no_such_module_xyz"),
    ],
)
def test_install_hints(module: str, extra: str | None, line: str) -> None:
    assert install_hint(module, extra) == line


def test_require_unknown_module_with_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'feedpipe\[fast\]'$"):
        require("feedpipe_no_such_module_xyz", extra="fast")
    assert require("json").__name__ == "json"


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.ShardFormatError, ValueError),
        (errors.ManifestError, ValueError),
        (errors.KeyClashError, ValueError),
        (errors.InputError, ValueError),
        (errors.SourceNotFoundError, FileNotFoundError),
        (errors.OutputError, OSError),
        (errors.PlanError, ValueError),
        (errors.StateError, ValueError),
        (errors.MissingDependencyError, ImportError),
        (errors.MixtureError, ValueError),
        (errors.PackedFieldError, ValueError),
    ],
)
def test_error_hierarchy(cls: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(cls, errors.FeedpipeError) and issubclass(cls, builtin)
    assert getattr(feedpipe, cls.__name__) is cls


# raised to users, but as the public class they subclass: the subclass only tells feedpipe's own
# code apart (a missing label is the dataset's fault, so it is never skipped as one sample's)
INTERNAL_ERRORS = {"NoLabelError": "DecodeError"}


def test_every_error_feedpipe_defines_is_public_and_on_the_errors_page() -> None:
    """Every ``FeedpipeError`` subclass any module defines is a public name, defined in
    ``feedpipe.errors`` and listed on docs/api/errors.rst, so a user can catch what is raised to
    them by name and read what it means."""
    r = _python("""
        import importlib, pkgutil
        import feedpipe
        from feedpipe.errors import FeedpipeError
        for m in pkgutil.walk_packages(feedpipe.__path__, "feedpipe."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
        seen, todo = set(), [FeedpipeError]
        while todo:
            cls = todo.pop()
            seen.add(cls)
            todo += [c for c in cls.__subclasses__() if c.__module__.startswith("feedpipe")]
        for cls in sorted(seen, key=lambda c: c.__name__):
            print(cls.__name__, cls.__module__, [b.__name__ for b in cls.__mro__[1:]])
    """)
    assert r.returncode == 0, r.stderr
    page = (Path(__file__).resolve().parent.parent / "docs" / "api" / "errors.rst").read_text(
        encoding="utf-8")
    bad = []
    for line in r.stdout.splitlines():
        name, module, bases = line.split(" ", 2)
        if name in INTERNAL_ERRORS:
            assert INTERNAL_ERRORS[name] in bases, line
            continue
        if (name not in feedpipe.__all__ or module != "feedpipe.errors"
                or f".. autoexception:: {name}\n" not in page):
            bad.append(f"{name} ({module})")
    assert len(r.stdout.splitlines()) > 20
    assert bad == []
