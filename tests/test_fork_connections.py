"""A forked DataLoader worker keeps its parent's HTTP sessions alive (so that it never closes
the parent's pooled connections: tests/test_remote.py's forked-worker cases) without walking
every object of the process: that walk (``gc.get_objects``, some 200,000 objects with torch
imported) cost each worker a fraction of a second of CPU before its first request."""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import pytest

from feedpipe._helpers import storage_clients


def _child(found: Any, parent_fs_id: int) -> None:
    held = [id(o) for o in storage_clients._INHERITED]
    found.put((parent_fs_id in held, WALKS[0]))


WALKS = [0]


def test_a_forked_child_holds_the_parents_filesystems_without_walking_every_object(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("aiohttp")
    fs, _ = storage_clients.filesystem("http://127.0.0.1:9/feedpipe-fork-test")  # the hook too
    real = gc.get_objects

    def counted(*a: Any, **k: Any) -> list[Any]:
        WALKS[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(gc, "get_objects", counted)
    ctx = multiprocessing.get_context("fork")
    found = ctx.Queue()
    p = ctx.Process(target=_child, args=(found, id(fs)))
    p.start()
    held, walks = found.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    assert walks == 0  # no walk over every object of the process
    assert held  # the parent's filesystem (its session, its connector) stays referenced
