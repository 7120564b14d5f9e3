"""The snippets of README.md and of the documentation pages run as a reader runs them, so that
none can rot.

Every fenced ``python`` block of README.md and then of the pages in ``PAGES`` (the tutorial
first: the others use what it made) runs, in order, each in a fresh interpreter
(``python snippet.py``, so ``if __name__ == "__main__":`` and worker processes behave as in a
user's script), all in one temporary working directory that the tutorial fills (``images/``,
``shards/``, ``ckpt.pt``, ...): a later snippet uses what an earlier one made, as it does for the
reader. A ``bash`` block runs too when the line before its fence is ``<!-- test_readme: run -->``
(an HTML comment: invisible on the rendered page).

A block is skipped, with its reason, when it holds a line
``# not run by tests/test_readme.py: needs <X>`` (a GPU, S3, a cluster, ...), or a line
``# needs the <extra> extra`` and that extra's package is not installed, or a line
``# needs the <package> package (pip install <package>)`` and that package is not installed
(a framework no extra of feedpipe's brings, such as Lightning). Selecting one block
(``-k L123``) first runs the runnable blocks above it, as its setup.

Also checked: the two commands at the top are the ones ``.ci/run`` extracts, the snippets use
only the public API, a snippet importing what the README's install (``pip install -e .``) lacks
says what it needs, every extra named exists, every linked file exists, and neither README.md
nor docs/ holds an absolute path of one machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) if (ROOT / "docs").is_dir() else []
# the pages whose snippets run, in the order a reader meets what they make: the tutorial makes
# images/, shards/ and ckpt.pt; Making shards makes captions/, which Concepts resumes from
PAGES = [README] + [ROOT / "docs" / f"{name}.md" for name in
                    ("tutorial", "converting", "concepts", "probe")]
RUN_MARK = "<!-- test_readme: run -->"
NOT_RUN = re.compile(r"#\s*not run by tests/test_readme\.py:\s*(needs .+)$", re.M)
NEEDS_EXTRA = re.compile(r"#\s*needs the (\w+) extra", re.M)
NEEDS_PACKAGE = re.compile(r"#\s*needs the ([\w-]+) package \(pip install \1\)", re.M)
# the module that tells an extra is installed
EXTRA_MODULE = {"dali": "nvidia.dali", "s3": "s3fs", "gcs": "gcsfs", "http": "aiohttp",
                "dask": "distributed", "images": "pillow_heif", "parquet": "pyarrow",
                "hub": "datasets", "plot": "matplotlib"}
TIMEOUT = 300

DEMO_CMD = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
            "pip install -e . && feedpipe demo")
TEST_CMD = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
            "pip install -e '.[test]' && python -m pytest -q -rs")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, first line number and text."""

    lang: str
    line: int
    text: str
    marked: bool  # preceded by RUN_MARK
    page: str = "README.md"

    @property
    def id(self) -> str:
        stem = "" if self.page == "README.md" else Path(self.page).stem + "-"
        return f"{stem}L{self.line}-{self.lang}"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    def runnable(self) -> bool:
        return self.lang == "python" or (self.lang == "bash" and self.marked)

    def skip_reason(self) -> str | None:
        m = NOT_RUN.search(self.text)
        if m:
            return m.group(1)
        for extra in NEEDS_EXTRA.findall(self.text):
            module = EXTRA_MODULE.get(extra)
            if module is None:
                continue  # an unknown extra is caught by test_extras_named_exist
            if not installed(module):
                return f"needs the {extra} extra (pip install 'feedpipe[{extra}]')"
        for package in NEEDS_PACKAGE.findall(self.text):
            if not installed(package.replace("-", "_")):
                return f"needs the {package} package (pip install {package})"
        return None


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (nvidia for nvidia.dali) is missing
        return False


def blocks(path: Path = README) -> list[Block]:
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        page = path.relative_to(ROOT).as_posix()
        out.append(Block(m.group(1), start + 1, "\n".join(body) + "\n", prev == RUN_MARK, page))
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


RUNNABLE = [b for b in all_blocks() if b.runnable()]


@dataclass
class Session:
    """The shared working directory and which blocks have run there (and how)."""

    workdir: Path
    env: dict[str, str]
    done: dict[str, str | None] = field(default_factory=dict)  # id -> None (ok) or the error


def _run(block: Block, s: Session) -> str | None:
    """Run ``block`` in the session's directory; ``None`` when it succeeded, else its output."""
    if block.lang == "python":
        script = s.workdir / f"readme_{block.id}.py"
        script.write_text(block.text, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    try:
        r = subprocess.run(cmd, cwd=s.workdir, env=s.env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return f"timed out after {TIMEOUT} s\n{e.stdout or ''}\n{e.stderr or ''}"
    if r.returncode != 0:
        return f"exit status {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    return None


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Session:
    work = tmp_path_factory.mktemp("readme")
    env = dict(os.environ)
    # the venv's bin first (feedpipe, torchrun), the user's caches kept out of the way
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["XDG_CACHE_HOME"] = str(work / ".cache")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTHONPATH", None)
    return Session(work, env)


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_snippet_runs(block: Block, session: Session) -> None:
    reason = block.skip_reason()
    if reason is not None:
        pytest.skip(f"{block.where}: {reason}")
    for earlier in RUNNABLE[:RUNNABLE.index(block)]:  # what the reader ran before this one
        if earlier.id not in session.done and earlier.skip_reason() is None:
            session.done[earlier.id] = _run(earlier, session)
    failed_before = [k for k, v in session.done.items() if v is not None]
    if block.id not in session.done:
        session.done[block.id] = _run(block, session)
    error = session.done[block.id]
    if error is not None:
        note = (f" (earlier snippets failed too: {', '.join(failed_before)})"
                if failed_before else "")
        pytest.fail(f"{block.where} ({block.lang}) failed{note}:\n"
                    f"{block.text}\n{error}")


def test_readme_opens_with_the_two_commands_ci_runs() -> None:
    """The commands under the two opening sentences, byte for byte; ``.ci/run`` extracts the
    second from the first ``bash`` block after "Install and run the tests"."""
    text = README.read_text(encoding="utf-8")
    for sentence, cmd in (("Install and run the demo on a built-in synthetic dataset:", DEMO_CMD),
                          ("Install and run the tests:", TEST_CMD)):
        assert f"{sentence}\n\n```bash\n{cmd}\n```\n" in text, sentence
    first = text.index("```bash")
    assert text.index("Install and run the demo") < first < text.index("Install and run the tests")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "/^Install and run the tests/" in ci


def test_snippets_use_only_the_public_api() -> None:
    """``from feedpipe import ...`` and ``feedpipe.X``: no subpackage or private module path."""
    private = re.compile(r"\bfeedpipe\.(?:_\w+|format|plan|caches|transforms|stream|device|"
                         r"convert|diagnostics|cli|errors)\b")
    for b in all_blocks():
        if b.lang == "python":
            assert not private.search(b.text), f"{b.where}: {private.search(b.text)}"
    import feedpipe

    for b in all_blocks():
        if b.lang != "python":
            continue
        for name in re.findall(r"\bfeedpipe\.([A-Za-z_]\w*)", b.text):
            assert hasattr(feedpipe, name), f"{b.where}: feedpipe.{name} does not exist"
        for names in re.findall(r"^from feedpipe import (\([^)]*\)|.+)$", b.text, re.M):
            for name in names.strip("()").replace("\n", " ").split(","):
                name = name.split(" as ")[0].strip()
                if name:
                    assert hasattr(feedpipe, name), f"{b.where}: {name} is not public"


def _extras() -> set[str]:
    """The extras of pyproject.toml (its ``[project.optional-dependencies]`` keys)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+)\s*=", section, re.M))


def test_extras_named_exist() -> None:
    """Every ``feedpipe[extra]`` the README and docs name is an extra of pyproject.toml, and so is
    every extra a snippet says it needs."""
    extras = _extras()
    assert {"test", "dali", "s3"} <= extras
    for doc in [README, *DOCS]:
        text = doc.read_text(encoding="utf-8")
        for group in re.findall(r"feedpipe\[([\w,]+)\]", text):
            for extra in group.split(","):
                assert extra in extras, f"{doc.name}: feedpipe[{extra}] is not an extra"
        for extra in NEEDS_EXTRA.findall(text):
            assert extra in extras and extra in EXTRA_MODULE, f"{doc.name}: needs the {extra} extra"


# what ``pip install -e .`` installs (after ``pip install torch``), by import name
CORE_MODULES = {"feedpipe", "numpy", "torch", "fsspec", "lmdb", "simplejpeg", "cv2", "tqdm",
                "xxhash"}


def _unnamed_imports(path: Path = README) -> list[tuple[int, str]]:
    """``(line, module)`` of each module a runnable python snippet imports that neither the
    standard library nor the README's install provides, and that the snippet does not name with
    ``# needs the <extra> extra`` or ``# needs the <package> package (pip install ...)``."""
    import ast

    out = []
    for b in blocks(path):
        if b.lang != "python" or NOT_RUN.search(b.text):
            continue
        named = {EXTRA_MODULE.get(e, e).split(".")[0] for e in NEEDS_EXTRA.findall(b.text)}
        named |= {p.replace("-", "_") for p in NEEDS_PACKAGE.findall(b.text)}
        for node in ast.walk(ast.parse(b.text)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in (m.split(".")[0] for m in mods):
                if mod not in sys.stdlib_module_names and mod not in CORE_MODULES | named:
                    out.append((b.line, mod))
    return out


def test_a_snippet_says_what_it_needs_beyond_the_install() -> None:
    """The Lightning and accelerate snippets failed with ModuleNotFoundError after the README's
    own install, saying nothing of what to install."""
    for page in PAGES:
        assert _unnamed_imports(page) == [], page.name


def test_packages_a_snippet_needs_come_with_the_test_extra() -> None:
    """So that the test run of ``pip install -e '.[test]'`` runs those snippets, not skips."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    test_extra = section.split("\ntest = [", 1)[1].split("]\n", 1)[0]
    for package in {p for page in PAGES for p in NEEDS_PACKAGE.findall(page.read_text("utf-8"))}:
        assert f'"{package}' in test_extra, f"{package} is not in the test extra"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of ``doc``'s headings (lower case, punctuation dropped, spaces to -)."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.M | re.S)
    heads = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_every_linked_file_exists_and_no_machine_path() -> None:
    for doc in [README, *DOCS]:
        text = doc.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target:
                continue
            path = doc.parent / target if target else doc
            assert path.exists(), f"{doc.name}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.name}: no heading for #{anchor} in {path}"
        for m in re.finditer(r"(?<![\w.~$])/(?:work|home|Users|root|tmp)/\S*", text):
            pytest.fail(f"{doc.name}: an absolute path of one machine: {m.group(0)}")


def test_readme_snippets_are_found() -> None:
    """The extraction sees the tutorial (a test over zero snippets would pass vacuously)."""
    langs = [b.lang for b in RUNNABLE]
    assert langs.count("python") >= 10 and "bash" in langs
    tutorial = [b for b in RUNNABLE if b.page == "docs/tutorial.md"]
    assert len(tutorial) >= 5 and tutorial[0].lang == "python"


def test_every_page_with_a_snippet_runs_them() -> None:
    """A docs page with a python snippet is in ``PAGES``, so no untested snippet appears."""
    for doc in DOCS:
        if doc not in PAGES:
            notrun = [b for b in blocks(doc) if b.lang == "python" and not NOT_RUN.search(b.text)]
            assert notrun == [], f"{doc.name} has python snippets no test runs"

