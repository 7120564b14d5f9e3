"""What the probe tells a user: one voice (no advice that contradicts another), and torch's
worker-count warning once."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from test_probe import _figures

from feedpipe.diagnostics._pipeline import loader_stage
from feedpipe.diagnostics._verdict import decide

EXAMPLE = str(Path(__file__).resolve().parent.parent / "shards" / "example")


def test_a_pipeline_that_keeps_up_frames_the_remedies_as_for_a_shorter_step() -> None:
    """'Enable the decoded store' and 'no change is needed' were two bullets side by side."""
    advice = decide(_figures(step_time_ms=10_000.0)).advice  # decode bounds, far above need
    keeps = [i for i, a in enumerate(advice) if "keeps up" in a]
    store = [i for i, a in enumerate(advice) if "decoded store" in a]
    assert keeps and store and keeps[0] < store[0], advice
    assert "no change is needed for this step time" in advice[keeps[0]]
    assert re.search(r"Only for a step shorter than \d+ ms would the following help:$",
                     advice[keeps[0]]), advice[keeps[0]]


def test_a_pipeline_that_falls_short_gets_the_remedies_as_they_were() -> None:
    advice = decide(_figures(step_time_ms=1.0)).advice
    assert not any("keeps up" in a or "Only for a step" in a for a in advice)
    assert any(a.startswith("Decoding bounds: enable the decoded store") for a in advice)


def test_torch_worker_count_warning_is_said_once() -> None:
    """torch warns from two places of one DataLoader; the probe measured one with more workers
    than CPUs and the user read the same paragraph twice."""
    many = (os.cpu_count() or 1) + 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            loader_stage(EXAMPLE, None, list, 4, many, 0.05)
    about = [w for w in seen if "worker processes in total" in str(w.message)]
    assert len(about) <= 1, [str(w.message) for w in about]
