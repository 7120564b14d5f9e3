"""The ledger of a VideoClips loader: the clips each rank's loop received, checked by recomputing
each epoch's order of clips (feedpipe.plan._clips.ClipOrder) from what ``ledger.json`` holds.
The ground truth is the ``(video, clip)`` pairs the loops received; a fault injected into the
run (a resume point moved back or on, an epoch left early, a rank's part lost) must be named
pair for pair, never said OK."""

from __future__ import annotations

import copy
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("av")

from _videos import make_video  # noqa: E402
from conftest import run_feedpipe  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe import FeedLoader, VideoClips, check_ledger  # noqa: E402
from feedpipe.stream._ledger_check import ledger_text  # noqa: E402

VIDEOS, CLIPS = 7, 2
ALL = Counter((v, c) for v in range(VIDEOS) for c in range(CLIPS))


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("ledger-videos")
    src = root / "src"
    src.mkdir()
    for i in range(VIDEOS):
        (src / f"v{i}.mp4").write_bytes(make_video(12 + i, width=32, height=24))
    feedpipe.shard(str(src), str(root / "out"), max_samples=3, workers=1)
    return str(root / "out")


def clips(path: str, rank: int = 0, world: int = 1, **kw: Any) -> VideoClips:
    return VideoClips(path, frames=2, stride=3, clips_per_video=CLIPS, size=(12, 16), seed=4,
                      rank=rank, world_size=world, **kw)


def pairs(batch: dict[str, Any]) -> list[tuple[int, int]]:
    return [(int(v), int(c)) for v, c in zip(batch["video"], batch["clip"])]


def named(finding: dict[str, Any] | None) -> Counter[tuple[int, int]]:
    """The (video, clip) pairs a finding names, each as many times as named."""
    return Counter((v, c) for v, c in (finding or {}).get("clips", []))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_video_clips_loader_takes_a_ledger_and_proves_its_epochs(videos: str, tmp_path: Path,
                                                                   workers: int) -> None:
    """``FeedLoader(VideoClips(...), ledger=)`` was refused with a ValueError (the source said
    nothing the ledger could recompute its plans from); it now records the clips delivered, in
    this process and from 2 worker processes, and ``feedpipe ledger`` proves two epochs."""
    ld = FeedLoader(clips(videos), batch_size=3, num_workers=workers, ledger=tmp_path / "l")
    got: list[Counter[tuple[int, int]]] = []
    for e in range(2):
        ld.set_epoch(e)
        got.append(Counter(p for b in ld for p in pairs(b)))
    if workers:
        pids = ld.stats()["worker_pids"]
        assert len(set(pids)) == 2 and os.getpid() not in pids
    assert got == [ALL, ALL]
    r = check_ledger(tmp_path / "l")
    assert r["ok"], ledger_text(r)
    n = VIDEOS * CLIPS
    assert [(e["delivered"], e["expected"], e["exactly_once"]) for e in r["epochs"]] == [
        (n, n, True)] * 2
    assert r["clips"] == {"videos": VIDEOS, "clips_per_video": CLIPS, "frames": 2, "stride": 3,
                          "fps": None}
    out = run_feedpipe("ledger", tmp_path / "l")
    assert f"{n} of {n} clips delivered - exactly once" in out.stdout
    assert out.stdout.rstrip().endswith("OK: every finished epoch exactly once")


@pytest.mark.parametrize("moved", [-1, 1])
def test_a_moved_resume_point_names_the_repeated_or_skipped_clips(videos: str, tmp_path: Path,
                                                                  moved: int) -> None:
    """A resume point moved back a batch delivers 3 clips twice; moved on, it never delivers 3:
    the check names exactly those (video, clip) pairs and fails."""
    ld = FeedLoader(clips(videos), batch_size=3, ledger=tmp_path / "l")
    it = iter(ld)
    got = Counter(p for _ in range(2) for p in pairs(next(it)))
    state = ld.state_dict()
    it.close()
    state["position"] += 3 * moved
    again = FeedLoader(clips(videos), batch_size=3, ledger=tmp_path / "l")
    again.load_state_dict(state)
    got.update(p for b in again for p in pairs(b))
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert not r["ok"] and e["finished"] and not e["exactly_once"]
    assert named(e["repeats"]) == got - ALL
    assert named(e["losses"]) == ALL - got
    assert sum((got - ALL).values()) + sum((ALL - got).values()) == 3
    text = ledger_text(r)
    assert ("3 repeated clips" if moved < 0 else "3 lost clips") in text
    assert text.endswith("NOT exactly once: see above")


def test_an_epoch_left_early_names_its_lost_clips(videos: str, tmp_path: Path) -> None:
    ld = FeedLoader(clips(videos), batch_size=4, ledger=tmp_path / "l")
    it = iter(ld)
    got = Counter(p for _ in range(2) for p in pairs(next(it)))
    it.close()
    ld.set_epoch(1)
    for _ in ld:
        pass
    r = check_ledger(tmp_path / "l")
    e0, e1 = r["epochs"]
    assert not r["ok"] and e0["finished"] and named(e0["losses"]) == ALL - got
    assert e0["losses"]["count"] == VIDEOS * CLIPS - 8 and e1["exactly_once"]


def test_a_rank_whose_part_is_lost_is_never_ok(videos: str, tmp_path: Path) -> None:
    lds = [FeedLoader(clips(videos, r, 2), batch_size=2, ledger=tmp_path / "l") for r in (0, 1)]
    got = Counter(p for batches in zip(*lds) for b in batches for p in pairs(b))
    assert got == ALL
    assert check_ledger(tmp_path / "l")["ok"]
    (part,) = (tmp_path / "l").glob("r00001-*/*.part")
    part.unlink()
    r = check_ledger(tmp_path / "l")
    assert not r["ok"] and "rank 1 of 2 has no part for epoch 0" in ledger_text(r)


def test_a_clip_the_transform_skipped_is_named_apart_not_lost(tmp_path: Path) -> None:
    with feedpipe.ShardWriter(str(tmp_path / "bad")) as w:
        w.write({"__key__": "good", "mp4": make_video(8, width=32, height=24)})
        w.write({"__key__": "broken", "mp4": b"\x00\x00\x00\x18ftypmp42 not a video"})
    ld = FeedLoader(VideoClips(str(tmp_path / "bad"), frames=2, clips_per_video=2,
                               size=(12, 16), on_error="skip"), batch_size=2,
                    ledger=tmp_path / "l")
    got = Counter(p for b in ld for p in pairs(b))
    assert got == Counter({(0, 0): 1, (0, 1): 1})
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert r["ok"] and e["skipped"] == {"count": 2, "ids": [2, 3]}, ledger_text(r)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 3), stop=st.integers(0, 2), moved=st.integers(-4, 4),
       world2=st.integers(1, 3))
def test_the_checker_names_exactly_what_the_loops_received_wrongly(
        videos: str, tmp_path_factory: pytest.TempPathFactory, world: int, stop: int,
        moved: int, world2: int) -> None:
    """Ranks in lockstep for ``stop`` batches, a state whose position is moved by ``moved``
    clips, resumed on ``world2`` ranks to the end: the checker's repeats and losses are the
    pairs the loops received too often or never (padding that evens the ranks aside), and it
    says OK exactly when there are none."""
    root = tmp_path_factory.mktemp("hyp") / "l"
    n = VIDEOS * CLIPS
    lds = [FeedLoader(clips(videos, r, world), batch_size=2, ledger=root) for r in range(world)]
    its = [iter(ld) for ld in lds]
    got: Counter[tuple[int, int]] = Counter()
    for _ in range(stop):
        for it in its:
            got.update(pairs(next(it)))
    state = lds[0].state_dict()
    for it in its:
        it.close()
    state["position"] = min(n, max(0, state["position"] + moved))
    more = [FeedLoader(clips(videos, r, world2), batch_size=2, ledger=root)
            for r in range(world2)]
    rest: Counter[tuple[int, int]] = Counter()
    for ld in more:
        ld.load_state_dict(copy.deepcopy(state))
        rest.update(p for b in ld for p in pairs(b))
    # a rank short of clips repeats its share's first ones to even the ranks: padding
    left = n - state["position"]
    padding = -left % world2
    r = check_ledger(root)
    (e,) = r["epochs"]
    assert e["padding"] == padding
    received = got + rest
    assert sum(received.values()) == 2 * world * stop + left + padding
    loss = ALL - received
    assert named(e["losses"]) == loss
    # the repeats: beyond once, less the padding deliveries (which the checker names apart)
    over = received - ALL
    assert sum(named(e["repeats"]).values()) == sum(over.values()) - padding
    assert named(e["repeats"]) <= over
    assert r["ok"] == (not loss and sum(over.values()) == padding)
