"""The documentation site (``docs/``, built by Sphinx): every public name is on it, what it shows
names no private module, it builds with warnings as errors, and a real browser finds its way.

The build and the browser tests need the ``docs`` extra (Sphinx, furo, myst-parser) and Debian's
``chromium``; each skips with the reason where one is missing (``.ci/run`` installs both).
"""

from __future__ import annotations

import html.parser
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import feedpipe

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"
PUBLIC = [n for n in feedpipe.__all__ if n != "__version__"]
DIRECTIVE = re.compile(r"^\.\. auto(?:class|function|exception):: (\w+)\s*$", re.M)
# a private module of feedpipe as a docstring may name it: ``feedpipe.stream._routes``,
# ``~feedpipe.caches._stats.TierStats``, ``feedpipe._helpers``
PRIVATE_MODULE = re.compile(r"\bfeedpipe(?:\.[a-z]\w*)*\._\w+")


def _documented_members(obj: type) -> list[tuple[str, str | None]]:
    """``(name, docstring)`` of each public method and property a class defines (what autodoc's
    ``:members:`` shows, and leaves out when it has no docstring)."""
    out = []
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out.append((name, value.__doc__))
        elif isinstance(value, (staticmethod, classmethod)):
            out.append((name, value.__func__.__doc__))
        elif inspect.isfunction(value):
            out.append((name, value.__doc__))
    return out


def _docstrings() -> list[tuple[str, str]]:
    """``(where, docstring)`` of every public name and of each public member of its classes."""
    out = []
    for name in PUBLIC:
        obj = getattr(feedpipe, name)
        out.append((name, inspect.getdoc(obj) or ""))
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            out += [(f"{name}.{m}", doc or "") for m, doc in _documented_members(obj)]
    return out


def test_every_public_name_is_on_an_api_page_once() -> None:
    """An API page per subpackage lists its names; a name added to ``feedpipe/__init__.py``
    without a page entry (or listed twice) fails here."""
    listed: list[str] = []
    for page in sorted(API.glob("*.rst")):
        listed += DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    assert sorted(listed) == sorted(set(listed)), "a name is listed on two API pages"
    assert set(listed) == set(PUBLIC), (
        f"not on an API page: {sorted(set(PUBLIC) - set(listed))}; "
        f"on a page but not public: {sorted(set(listed) - set(PUBLIC))}")


def test_every_api_page_is_its_subpackages_names() -> None:
    """``docs/api/stream.rst`` holds the names ``feedpipe.stream`` defines, and so on."""
    for page in sorted(API.glob("*.rst")):
        if page.stem == "index":
            continue
        for name in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            module = feedpipe._LAZY[name]
            assert module.split(".")[0] == page.stem, f"{name} ({module}) is on {page.name}"


def test_every_public_name_and_member_has_a_docstring() -> None:
    """autodoc leaves an undocumented member off the page silently: here it fails instead."""
    missing = [where for where, doc in _docstrings() if not doc.strip()]
    assert missing == []


def test_no_public_docstring_names_a_private_module() -> None:
    """The site shows these docstrings; a reader cannot import ``feedpipe.stream._routes``
    (nor should): a public docstring names public names or says it in words."""
    found = [(where, m) for where, doc in _docstrings() for m in PRIVATE_MODULE.findall(doc)]
    assert found == []


def test_the_private_module_check_catches_one() -> None:
    """The pattern above sees the forms docstrings used (a test that cannot fail proves
    nothing)."""
    for text in (":mod:`feedpipe.stream._routes`", ":class:`~feedpipe.caches._stats.TierStats`",
                 "(:mod:`feedpipe._helpers.fork_safety`)"):
        assert PRIVATE_MODULE.search(text), text
    assert not PRIVATE_MODULE.search(":class:`~feedpipe.FeedLoader` and feedpipe.errors")


def test_every_docs_page_is_in_the_table_of_contents() -> None:
    """Sphinx only warns on a page outside every toctree; the build below makes that an error,
    and this says which page without building."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        if page.stem != "index":
            assert f"\n{page.stem}\n" in index, f"docs/{page.name} is not in index.md's toctree"


# ---------------------------------------------------------------- the built site, in a browser

def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as CI builds it (``sphinx-build -W``), once for this module."""
    for module in ("sphinx", "furo", "myst_parser"):
        if not _have(module):
            pytest.skip(f"the docs extra is not installed ({module} is missing): "
                        "pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site") / "html"
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(DOCS), str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"sphinx-build -W failed:\n{r.stdout}\n{r.stderr}"
    return out


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium here (Debian: apt-get install chromium)")


def _browse(url: str, *extra: str, scripts: bool = True) -> str:
    """Headless Chromium on ``url``. With ``scripts``, the DOM once its scripts have run (Sphinx's
    search fills its results from JavaScript): a virtual-time budget, which ends when the page is
    idle rather than after a wait. Without, the page as its load event leaves it (screenshots)."""
    budget = ["--virtual-time-budget=20000"] if scripts else []
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           *budget, *extra, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"chromium failed on {url}:\n{r.stderr[-2000:]}"
    return r.stdout


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "a" and a.get("href"):
            self.hrefs.append(str(a["href"]))


def _parse(text: str) -> _Links:
    p = _Links()
    p.feed(text)
    return p


@pytest.mark.slow
def test_search_for_feedloader_lands_on_its_page(site: Path) -> None:
    """What a reader does: type ``FeedLoader`` in the search box, follow the first hit, and be
    on the part of the API page that documents the class."""
    dom = _browse((site / "search.html").as_uri() + "?q=FeedLoader", "--dump-dom")
    hits = [h for h in _parse(dom).hrefs if "#feedpipe.FeedLoader" in h]
    assert hits, "the search page lists no FeedLoader result"
    first = hits[0]
    page, anchor = first.split("#", 1)
    assert anchor == "feedpipe.FeedLoader", f"the first hit is {first}"
    landed = _browse((site / page).as_uri() + "#" + anchor, "--dump-dom")
    parsed = _parse(landed)
    assert anchor in parsed.ids
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", landed[landed.index(f'id="{anchor}"'):]))
    assert text.startswith(f'id="{anchor}"> class feedpipe.FeedLoader('), text[:200]


@pytest.mark.slow
def test_every_internal_link_resolves(site: Path) -> None:
    """Every link of every page to another page of the site (or a downloaded result file) finds
    its file, and its ``#anchor`` an element with that id."""
    pages = sorted(site.rglob("*.html"))
    ids = {p: _parse(p.read_text(encoding="utf-8")).ids for p in pages}
    broken = []
    for page in pages:
        for href in _parse(page.read_text(encoding="utf-8")).hrefs:
            parts = urlsplit(href)
            if parts.scheme or href.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href}")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in ids.get(target, set()):
                    broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert broken == []
    assert len(pages) >= 15  # the pages were found (a check over none would pass)


def test_python_torch_and_numpy_types_link_to_their_documentation(site: Path) -> None:
    """The types the API pages show from Python, torch and numpy are links to those projects'
    pages (the inventories docs/conf.py writes), not plain text."""
    html_text = "".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    for url in ("https://docs.python.org/3/library/os.html#os.PathLike",
                "https://docs.pytorch.org/docs/stable/tensor_attributes.html#torch.device",
                "https://numpy.org/doc/stable/reference/generated/numpy.ndarray.html#numpy.ndarray"):
        assert f'href="{url}"' in html_text, url


def test_a_reference_the_site_cannot_link_fails_the_build(tmp_path: Path) -> None:
    """With docs/conf.py's settings (``nitpicky``) and ``-W``, a reference to nothing fails the
    build, and so does a property whose docstring's first line napoleon would show as its type
    (``Type: The size of it``); the Python and torch names the inventories list do not."""
    for module in ("sphinx", "furo", "myst_parser"):
        if not _have(module):
            pytest.skip(f"the docs extra is not installed ({module} is missing): "
                        "pip install -e '.[docs]'")
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import runpy\nglobals().update(runpy.run_path({str(DOCS / 'conf.py')!r}))\n",
        encoding="utf-8")
    (tmp_path / "fp_nitpick_probe.py").write_text(
        'class Thing:\n    """A thing."""\n\n    @property\n    def size(self) -> int:\n'
        '        """The size of it: in bytes."""\n        return 1\n', encoding="utf-8")
    (src / "index.rst").write_text(
        "Probe\n=====\n\n.. currentmodule:: feedpipe\n\nSee :class:`NoSuchThing`, "
        ":class:`os.PathLike`, :class:`torch.device` and :class:`torch.Tensor`.\n\n"
        ".. autoclass:: fp_nitpick_probe.Thing\n   :members:\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(src), str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode != 0
    warnings = [line for line in r.stderr.splitlines() if "WARNING" in line]
    assert any("NoSuchThing" in w for w in warnings), r.stderr
    assert any("The size" in w for w in warnings), r.stderr
    assert not [w for w in warnings if "os.PathLike" in w or "torch." in w], warnings


@pytest.mark.slow
def test_the_browser_renders_the_home_page_and_feedloader(site: Path, tmp_path: Path) -> None:
    """Screenshots of the two pages a newcomer sees first come out as images of real size (the
    eye still has to look at them: ``chromium --headless --screenshot``)."""
    for name, url in (("home", (site / "index.html").as_uri()),
                      ("feedloader", (site / "api" / "stream.html").as_uri())):  # it leads
        shot = tmp_path / f"{name}.png"
        _browse(url, f"--screenshot={shot}", "--window-size=1280,1000", scripts=False)
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name


# ---------------------------------------------------------------- the performance claims

PERFORMANCE = DOCS / "performance.md"


def _readme_performance() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text[text.index("## Performance\n"):text.index("\n## ", text.index("## Performance\n"))]


def test_every_readme_figure_is_the_write_ups() -> None:
    """A ratio in the README's table is one docs/performance.md gives (for the same run: the
    row links the same result file), so the short table cannot be kinder than the long one."""
    section = _readme_performance()
    write_up = PERFORMANCE.read_text(encoding="utf-8")
    rows = [line for line in section.splitlines() if line.startswith("| ") and "](" in line]
    assert len(rows) >= 5
    for row in rows:
        for figure in re.findall(r"\d+(?:\.\d+)?x(?: / \d+(?:\.\d+)?x)?", row):
            assert figure in write_up, f"README's {figure} is not in docs/performance.md: {row}"
        for result in re.findall(r"\(benchmarks/results/([\w.-]+)\)", row):
            assert result in write_up, f"{result} is not linked from docs/performance.md"


def test_every_readme_row_says_what_was_compared() -> None:
    """A row is a sentence naming the peer and the measure, not a bare label."""
    for row in _readme_performance().splitlines():
        if row.startswith("| ") and "](" in row:
            what = row.split("|")[1]
            assert len(what.split()) >= 12 and "against" in what, what


def test_the_performance_page_reads_as_documentation() -> None:
    """No changelog in the write-up: no issue numbers, no commits (the result files it links
    hold them), no story of how the code got here."""
    text = PERFORMANCE.read_text(encoding="utf-8")
    for pattern in (r"\b[Ii]ssue \d+", r"\bgit [0-9a-f]{7,}", r"\b(?:tree at|before) [0-9a-f]{7,}",
                    r"slow spell", r"before the rewrite", r"\brewrite\b", r"\bolder code\b"):
        assert not re.search(pattern, text), f"docs/performance.md: {re.search(pattern, text)}"
