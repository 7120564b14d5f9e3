"""Sphinx configuration of feedpipe's documentation site.

Build it with ``sphinx-build -W -b html docs docs/_build/html`` (the ``docs`` extra): warnings are
errors, so a docstring Sphinx cannot render, a broken cross-reference or a page left out of the
table of contents fails the build.
"""

from __future__ import annotations

import atexit
import re
import shutil
import sys
import tempfile
import zlib
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
    "sphinx.ext.intersphinx",
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

# Every cross-reference must resolve (with -W a dangling one fails the build): a type or name the
# pages show unlinked is a reader left to guess where it is documented.
nitpicky = True

# The Python, torch and numpy names the API pages show link to those projects' own documentation.
# Their published inventories (objects.inv) would be fetched over the network at every build, and
# CI builds offline; so the few names used here are listed below, each with its page on the real
# site, and written as small inventories at build time. A name that the API gains and this table
# lacks fails the build (nitpicky), and is added here with its address.
EXTERNAL = {
    "python": ("https://docs.python.org/3/", {
        "os.PathLike": ("py:class", "library/os.html#$"),
        "collections.abc.Callable": ("py:class", "library/collections.abc.html#$"),
        "collections.abc.Iterable": ("py:class", "library/collections.abc.html#$"),
        "collections.abc.Mapping": ("py:class", "library/collections.abc.html#$"),
        "collections.abc.Sequence": ("py:class", "library/collections.abc.html#$"),
        "mmap.mmap": ("py:class", "library/mmap.html#$"),
        "tarfile": ("py:module", "library/tarfile.html#module-$"),
        "print": ("py:function", "library/functions.html#$"),
    }),
    "torch": ("https://docs.pytorch.org/docs/stable/", {
        "torch.device": ("py:class", "tensor_attributes.html#$"),
        "torch.dtype": ("py:class", "tensor_attributes.html#$"),
        "torch.Tensor": ("py:class", "tensors.html#$"),
    }),
    "numpy": ("https://numpy.org/doc/stable/", {
        "numpy.ndarray": ("py:class", "reference/generated/numpy.ndarray.html#$"),
    }),
}


def _inventory(project: str, names: dict[str, tuple[str, str]]) -> bytes:
    """An ``objects.inv`` (Sphinx's inventory format, version 2) listing ``names``."""
    head = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: \n"
            "# The remainder of this file is compressed using zlib.\n")
    body = "".join(f"{name} {role} 1 {uri} -\n" for name, (role, uri) in sorted(names.items()))
    return head.encode() + zlib.compress(body.encode())


_INVENTORIES = Path(tempfile.mkdtemp(prefix="feedpipe-docs-inventories-"))
atexit.register(shutil.rmtree, _INVENTORIES, ignore_errors=True)
intersphinx_mapping = {}
for _name, (_url, _names) in EXTERNAL.items():
    (_INVENTORIES / f"{_name}.inv").write_bytes(_inventory(_name, _names))
    intersphinx_mapping[_name] = (_url, str(_INVENTORIES / f"{_name}.inv"))

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
