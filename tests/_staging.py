"""One-pass staging by both loops, for the tests that compare them (tests/test_onepass.py,
tests/test_native_fuzz.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from feedpipe.convert import _listing
from feedpipe.convert import _stage_dir as stagedir


def stage_both(root: Path, top: str, cls: int | None, tmp: Path) -> list[Any]:
    """stage_dir of ``root/top`` by the C loop and by the Python loop: per loop, the staging
    file's bytes, the StagedDir's lists, the chunk's rows and counts (None: given back). The
    Python loop runs with the extension patched out for the call only, so Hypothesis tests
    (which cannot take the function-scoped ``monkeypatch``) use it too."""
    got = []
    for loop in ("c", "python"):
        with pytest.MonkeyPatch.context() as m:
            if loop == "python":
                m.setattr(stagedir, "_C", None)
            chunk, stage = tmp / f"{loop}.chunk", tmp / f"{loop}.stage"
            sd = stagedir.stage_dir(str(root), top, cls, str(chunk), str(stage))
            if sd is None:
                got.append((None, stage.exists()))
                continue
            c = sd.chunk
            got.append((stage.read_bytes(), sd.keys, sd.starts, sd.first, sd.exts, sd.names,
                        sd.offsets, sd.sizes, list(_listing.rows(str(chunk))),
                        (c.samples, c.files, c.ignored, c.first, c.last)))
    return got
