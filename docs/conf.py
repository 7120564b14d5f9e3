"""Sphinx configuration of feedpipe's documentation site.

Build it with ``sphinx-build -W -b html docs docs/_build/html`` (the ``docs`` extra): warnings are
errors, so a docstring Sphinx cannot render, a broken cross-reference or a page left out of the
table of contents fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's feedpipe, also when it is not installed

import feedpipe  # noqa: E402

project = "feedpipe"
author = "the feedpipe authors"
copyright = "the feedpipe authors"
release = version = feedpipe.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Google-style docstrings (the house style), rendered by napoleon
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# the public names live in private modules and are documented under ``feedpipe.<name>``
add_module_names = True
python_use_unqualified_type_names = True

# Markdown pages (tutorial, concepts, performance) keep GitHub's heading anchors, so that their
# links work on GitHub and on the site alike
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"feedpipe {release}"
html_show_sourcelink = False


# The performance page links the result files under benchmarks/ (outside this directory) so that
# the links work on GitHub too. On the site a result file is a download (Sphinx copies it into the
# build), and a link to a folder of results is left as its name: the site holds files only.
_RESULT_LINK = re.compile(r"\[([^\]]+)\]\((\.\./benchmarks/[^)\s]*)\)")


def _result_links(app: object, docname: str, source: list[str]) -> None:
    def repl(m: re.Match[str]) -> str:
        text, target = m.groups()
        if target.endswith("/"):
            return text
        if target.endswith(".md"):
            return f"{{download}}`{text.strip('`')} <{target}>`"
        return m.group(0)

    source[0] = _RESULT_LINK.sub(repl, source[0])


def setup(app: object) -> None:
    app.connect("source-read", _result_links)  # type: ignore[attr-defined]
