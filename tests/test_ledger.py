"""The delivery ledger (``FeedLoader(ledger=DIR)``, ``feedpipe ledger DIR``): a whole run with
its stops, resumes and changes of world size is proven exactly-once, and each way it can go wrong
is named: a repeat, a loss (also in an epoch the job left early), a part file that cannot be read
or is missing; a restart from an older checkpoint is named as the rollback it is. Ranks
run in lockstep in one process (each a loader with its own ``rank=``/``world_size=``, as the
resume tests do); the kill test runs a real process and SIGKILLs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import run_feedpipe
from hypothesis import given
from hypothesis import strategies as st

from feedpipe import FeedDataset, FeedLoader, StateError, check_ledger

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "shards", "example")
N = 24


def loaders(world: int, ledger: Path, batch: int = 2, **kw: Any) -> list[FeedLoader]:
    return [FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=3, rank=r, world_size=world),
                       batch_size=batch, ledger=ledger, **kw) for r in range(world)]


def step(its: list[Any], n: int) -> list[int]:
    """``n`` lockstep steps over every rank; the ids they delivered."""
    ids: list[int] = []
    for _ in range(n):
        for it in its:
            ids += next(it)["__index__"].tolist()
    return ids


def drain(its: list[Any]) -> list[int]:
    ids: list[int] = []
    for it in its:
        for b in it:
            ids += b["__index__"].tolist()
    return ids


def test_two_epochs_on_one_rank_are_exactly_once(tmp_path: Path) -> None:
    (ld,) = loaders(1, tmp_path, batch=5)
    for _ in range(2):
        assert sorted(i for b in ld for i in b["__index__"].tolist()) == list(range(N))
    r = check_ledger(tmp_path)
    assert r["ok"] and [e["epoch"] for e in r["epochs"]] == [0, 1]
    assert all(e["finished"] and e["exactly_once"] and e["distinct"] == N for e in r["epochs"])
    out = run_feedpipe("ledger", tmp_path)
    assert out.returncode == 0 and "OK: every finished epoch exactly once" in out.stdout


def test_stopped_on_two_ranks_and_resumed_on_three_passes(tmp_path: Path) -> None:
    a = loaders(2, tmp_path)
    seen = step([iter(x) for x in a], 2)
    state = a[0].state_dict()  # every rank's state is the same: rank 0's is saved
    b = loaders(3, tmp_path)
    for x in b:
        x.load_state_dict(state)
    seen += drain([iter(x) for x in b])
    # the 16 left over 3 ranks: 6 each, 2 of them repeated as padding
    assert sorted(set(seen)) == list(range(N)) and len(seen) == N + 2
    r = check_ledger(tmp_path)
    assert r["ok"], r
    (e,) = r["epochs"]
    assert e["finished"] and e["parts"] == 5 and e["repeats"]["count"] == 0
    assert e["losses"]["count"] == 0 and e["rolled_back"] == 0 and e["padding"] == 2
    assert r["runs"][-1]["resumed_from"]["position"] == 8


def test_what_a_killed_run_delivered_after_the_checkpoint_is_rolled_back(tmp_path: Path) -> None:
    a = loaders(2, tmp_path)
    its = [iter(x) for x in a]
    step(its, 2)
    state = a[0].state_dict()
    step(its, 3)  # trained on, then the job died before its next checkpoint
    for x in a:  # the generators' end flushes what they delivered
        x._ledger.end()  # type: ignore[union-attr]
    b = loaders(2, tmp_path)
    for x in b:
        x.load_state_dict(state)
    drain([iter(x) for x in b])
    r = check_ledger(tmp_path)
    assert r["ok"], r
    assert r["epochs"][0]["rolled_back"] == 3 * 2 * 2  # 3 steps of 2 ranks of batch 2


def test_a_checkpoint_resumed_twice_is_a_named_rollback(tmp_path: Path) -> None:
    """A job restarted from an older checkpoint than one saved since trains from the older
    state: what was delivered after it is discarded with the newer model state (rolled back).
    The restart is named; it is no repeat (the ledger cannot know whether the newer checkpoint
    ever reached the disk)."""
    a = loaders(2, tmp_path)
    step([iter(x) for x in a], 2)
    old = a[0].state_dict()
    b = loaders(2, tmp_path)
    for x in b:
        x.load_state_dict(old)
    step([iter(x) for x in b], 2)
    b[0].state_dict()  # a newer checkpoint was saved ...
    c = loaders(2, tmp_path)
    for x in c:
        x.load_state_dict(old)  # ... and the job restarted from the old one
    drain([iter(x) for x in c])
    r = check_ledger(tmp_path)
    assert r["ok"], r
    (rp,) = r["replays"]
    b_runs = {x["run"] for x in r["runs"][2:4]}
    c_runs = {x["run"] for x in r["runs"][4:6]}
    assert rp["runs"][0] in b_runs and rp["runs"][1] in c_runs
    assert "older checkpoint" in rp["why"]
    e = r["epochs"][0]
    assert e["repeats"]["count"] == 0 and e["rolled_back"] == 2 * 2 * 2
    out = run_feedpipe("ledger", tmp_path, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["replays"]
    text = run_feedpipe("ledger", tmp_path)
    assert "restart:" in text.stdout and "8 rolled back" in text.stdout


def test_a_resume_that_skips_samples_is_a_loss(tmp_path: Path) -> None:
    a = loaders(1, tmp_path)
    step([iter(x) for x in a], 2)
    state = dict(a[0].state_dict())
    state["position"] += 6  # a state that points past what was trained
    state["ledger"] = dict(state["ledger"], position=state["position"])
    b = loaders(1, tmp_path)
    b[0].load_state_dict(state)
    drain([iter(b[0])])
    r = check_ledger(tmp_path)
    e = r["epochs"][0]
    assert not r["ok"] and e["losses"]["count"] == 6 and len(e["losses"]["ids"]) == 6
    assert e["repeats"]["count"] == 0


def test_padding_and_drops_are_neither_repeats_nor_losses(tmp_path: Path) -> None:
    drain([iter(x) for x in loaders(5, tmp_path / "pad")])  # 24 over 5 ranks: 1 repeated
    r = check_ledger(tmp_path / "pad")
    assert r["ok"] and r["epochs"][0]["padding"] == 1
    drain([iter(x) for x in loaders(1, tmp_path / "drop", batch=5, drop_last=True)])
    r = check_ledger(tmp_path / "drop")
    assert r["ok"] and r["epochs"][0]["dropped"] == 4 and r["epochs"][0]["distinct"] == 20


def test_an_unfinished_epoch_has_no_losses_yet(tmp_path: Path) -> None:
    a = loaders(1, tmp_path)
    step([iter(a[0])], 3)
    a[0].state_dict()
    r = check_ledger(tmp_path)
    e = r["epochs"][0]
    assert r["ok"] and not e["finished"] and e["losses"] is None and e["distinct"] == 6


def test_an_unreadable_part_fails_the_check_by_name(tmp_path: Path) -> None:
    drain([iter(x) for x in loaders(1, tmp_path)])
    (part,) = tmp_path.glob("r*/*.part")
    part.write_bytes(part.read_bytes()[:-7])  # torn by a copy that stopped short
    r = check_ledger(tmp_path)
    assert not r["ok"] and r["unreadable"][0]["part"].endswith(part.name)
    out = run_feedpipe("ledger", tmp_path)
    assert out.returncode == 1 and "UNREADABLE" in out.stdout


def test_another_datasets_ledger_is_refused(tmp_path: Path) -> None:
    loaders(1, tmp_path)
    with pytest.raises(StateError, match="another dataset or order"):
        FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=4), batch_size=2, ledger=tmp_path)
    out = run_feedpipe("ledger", tmp_path / "nothing")
    assert out.returncode == 2 and "holds no ledger" in out.stderr


CHILD = textwrap.dedent("""
    import json, sys
    from feedpipe import FeedDataset, FeedLoader
    ds = FeedDataset(sys.argv[1], shuffle=True, seed=3)
    loader = FeedLoader(ds, batch_size=1, ledger=sys.argv[2])
    if sys.argv[4] != "-":
        with open(sys.argv[4]) as fh:
            loader.load_state_dict(json.load(fh))
    it = iter(loader)
    for _ in range(5):
        next(it)
    with open(sys.argv[3], "w") as fh:
        json.dump(loader.state_dict(), fh)
    print("saved", flush=True)
    while True:  # trains on, epoch after epoch, until killed
        for _ in it:
            pass
        it = iter(loader)
""")


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_valid_ledger(tmp_path: Path) -> None:
    """Three runs, each killed with SIGKILL while it trains on past its checkpoint, each
    resumed from the last one's checkpoint, and a last run to the epoch's end: the ledger reads
    whole after every kill and proves the job exactly-once, what the killed runs delivered after
    their checkpoints rolled back."""
    ledger = tmp_path / "ledger"
    previous = "-"
    for attempt in range(3):
        state = tmp_path / f"state{attempt}.json"
        p = subprocess.Popen([sys.executable, "-c", CHILD, EXAMPLE, str(ledger), str(state),
                              previous], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "saved"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        r = check_ledger(ledger)
        assert not r["unreadable"], r  # every part file is a whole flush
        assert not r["replays"] and r["ok"], r
        previous = str(state)
    saved = json.loads(Path(previous).read_text())
    (ld,) = loaders(1, ledger, batch=1)
    ld.load_state_dict(saved)
    drain([iter(ld)])
    r = check_ledger(ledger)
    assert r["ok"], r
    e = next(x for x in r["epochs"] if x["epoch"] == saved["epoch"])
    assert e["finished"] and e["distinct"] == N and e["losses"]["count"] == 0


def test_the_training_loop_pays_no_plan_work_per_batch(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch costs the ledger a counter and a clock read, never a computation of the plan's
    ids: the part records the span of plan positions it delivered, and the checker turns
    positions into ids (benchmarks/bench_versions.py, phases ledger, measures the rest)."""
    from feedpipe.plan._order import Plan, Split
    from feedpipe.stream._ledger import Ledger

    ds = FeedDataset(EXAMPLE, shuffle=True, seed=3)
    ledger = Ledger(tmp_path, {"digest": "d", "counts": list(ds.plan(0).counts), "seed": 3,
                               "shuffle": True, "window": None, "drop_last": False})
    ledger.begin(ds.plan(0), Split(N, 1, 0), 1, None)
    calls: list[int] = []
    real = Plan.sample_ids
    monkeypatch.setattr(Plan, "sample_ids", lambda self, pos: calls.append(len(pos))
                        or real(self, pos))
    for t in range(N):
        ledger.batch(t)
    ledger.end()
    assert calls == []
    monkeypatch.undo()
    r = check_ledger(tmp_path)
    # every batch of the share was received: finished, though the pass never saw its end
    assert r["ok"] and r["epochs"][0]["distinct"] == N and r["epochs"][0]["finished"]


def test_a_part_another_plan_wrote_is_refused_by_name(tmp_path: Path) -> None:
    """The checker computes a part's ids from its own plan: a part whose writer's plan ordered
    the epoch otherwise (another feedpipe version) is named, never checked against the wrong
    order."""
    drain([iter(x) for x in loaders(1, tmp_path)])
    (part,) = tmp_path.glob("r*/*.part")
    header = json.loads(part.read_bytes())
    header["checked"][1] = header["checked"][1][::-1]
    part.write_text(json.dumps(header) + "\n")
    r = check_ledger(tmp_path)
    assert not r["ok"] and "feedpipe version that wrote it" in r["unreadable"][0]["why"]


def test_a_version_1_part_with_a_bitmap_is_still_read(tmp_path: Path) -> None:
    import zlib

    import numpy as np

    drain([iter(x) for x in loaders(2, tmp_path)])
    first, second = sorted(tmp_path.glob("r*/*.part"))
    header = json.loads(first.read_bytes())
    have = np.zeros(N, dtype=bool)
    ds = FeedDataset(EXAMPLE, shuffle=True, seed=3)
    have[ds.plan(0).sample_ids(np.arange(0, N, 2))] = True  # rank 0 of 2: every other position
    v1 = {k: v for k, v in header.items() if k != "checked"} | {"version": 1}
    first.unlink()  # and written where version 1 wrote it
    old = tmp_path / "e000000" / f"r00000-{header['run']}-000.part"
    old.parent.mkdir()
    old.write_bytes(json.dumps(v1).encode() + b"\n"
                    + zlib.compress(np.packbits(have, bitorder="little").tobytes()))
    r = check_ledger(tmp_path)
    assert r["ok"] and r["epochs"][0]["distinct"] == N and not r["unreadable"], r


@given(n=st.integers(0, 60), world=st.integers(1, 7), start=st.integers(0, 60),
       drop_last=st.booleans(), data=st.data())
def test_padding_from_is_where_a_rank_starts_repeating(n: int, world: int, start: int,
                                                        drop_last: bool, data: Any) -> None:
    """The part names its padding from one index instead of testing every position it
    delivered: the index is the first local position past the remaining ones."""
    from feedpipe.plan._order import Split
    from feedpipe.stream._ledger import padding_from

    split = Split(n, world, data.draw(st.integers(0, world - 1)), min(start, n), drop_last)
    pad = [L for L in range(split.length) if L * world + split.rank >= split.remaining]
    assert pad == list(range(padding_from(split), split.length))


def test_a_run_whose_plan_check_is_lost_is_not_checked(tmp_path: Path) -> None:
    (ld,) = loaders(1, tmp_path, batch=5)
    for _ in range(2):
        drain([iter(ld)])
    first, later = sorted(tmp_path.glob("r*/*.part"))
    first.write_bytes(first.read_bytes()[:-7])
    r = check_ledger(tmp_path)
    assert not r["ok"] and [u["part"] for u in r["unreadable"]] == [
        os.path.relpath(p, tmp_path) for p in (first, later)]
    assert "holds the ids its plan gave" in r["unreadable"][1]["why"]


# -- issue 41: the ledger never says OK over a loss ------------------------------------------

def kill(lds: list[FeedLoader]) -> None:
    """SIGKILL, in process: the runs write nothing more (their generators' ends included); what
    is on disk is their last flush."""
    for ld in lds:
        ld._ledger._flush = lambda *a, **k: None  # type: ignore[union-attr, method-assign]


def test_an_epoch_left_early_and_moved_past_is_finished_with_its_losses(tmp_path: Path) -> None:
    (ld,) = loaders(1, tmp_path)
    for e in range(3):  # a loop that takes 2 batches an epoch and moves on
        ld.set_epoch(e)
        for t, _ in enumerate(ld):
            if t == 1:
                break
    r = check_ledger(tmp_path)
    assert not r["ok"]
    e0, e1, e2 = r["epochs"]
    assert e0["finished"] and e1["finished"] and not e2["finished"]
    assert e0["losses"]["count"] == e1["losses"]["count"] == N - 4 and e2["losses"] is None
    out = run_feedpipe("ledger", tmp_path)
    assert out.returncode == 1 and "20 losses" in out.stdout, out.stdout


def test_a_resume_followed_by_set_epoch_next_loses_the_rest_of_the_epoch(tmp_path: Path) -> None:
    (a,) = loaders(1, tmp_path)
    step([iter(a)], 4)
    state = a.state_dict()
    (b,) = loaders(1, tmp_path)
    b.load_state_dict(state)
    b.set_epoch(1)  # the loop's own epoch counter says 1: the resume point of epoch 0 goes
    drain([iter(b)])
    r = check_ledger(tmp_path)
    e0, e1 = r["epochs"]
    assert not r["ok"] and e0["finished"] and e0["losses"]["count"] == N - 8
    assert e1["exactly_once"] and e1["finished"]


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_missing_rank_part_is_never_ok(tmp_path: Path, epochs: int) -> None:
    lds = loaders(2, tmp_path)
    for _ in range(epochs):
        drain([iter(x) for x in lds])
    lost = sorted(tmp_path.glob("r00001-*/e000000-*.part"))
    assert len(lost) == 1
    lost[0].unlink()
    r = check_ledger(tmp_path)
    assert not r["ok"]
    e0 = r["epochs"][0]
    assert not e0["exactly_once"] and [m["rank"] for m in e0["missing"]] == [1]
    out = run_feedpipe("ledger", tmp_path)
    assert out.returncode == 1 and "MISSING" in out.stdout


def test_samples_a_transform_skipped_are_counted_apart_and_named(tmp_path: Path) -> None:
    from feedpipe import SampleSkipped

    bad = {3, 7, 11, 19}

    def transform(x: dict[str, Any]) -> dict[str, Any]:
        if x["__index__"] in bad:
            raise SampleSkipped(f"sample {x['__index__']} is broken")
        return {"i": x["__index__"]}

    ld = FeedLoader(FeedDataset(EXAMPLE, shuffle=True, seed=3, transform=transform),
                    batch_size=4, ledger=tmp_path)
    got = [i for b in ld for i in b["i"].tolist()]
    assert len(got) == N - 4
    r = check_ledger(tmp_path)
    (e,) = r["epochs"]
    assert r["ok"] and e["distinct"] == N - 4 and e["delivered"] == N - 4
    assert e["skipped"]["count"] == 4 and sorted(e["skipped"]["ids"]) == sorted(bad)
    text = run_feedpipe("ledger", tmp_path).stdout
    assert f"{N - 4} of {N} delivered" in text and "4 skipped" in text, text


def test_a_kill_between_state_dict_and_the_checkpoint_write_is_a_rollback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state was taken (its mark is on record) but the checkpoint never reached the disk:
    the job restarts from the checkpoint before it, or from nothing: either way what the killed
    run delivered after that point is rolled back, never a replay with repeats."""
    from feedpipe.stream import _ledger

    monkeypatch.setattr(_ledger, "FLUSH_SECONDS", 0.0)  # every batch on disk: exact counts
    for older in (False, True):
        root = tmp_path / str(older)
        a = loaders(2, root)
        its = [iter(x) for x in a]
        step(its, 1)
        saved = a[0].state_dict() if older else None
        step(its, 2)
        a[0].state_dict()  # ... and the job died before the file was written
        step(its, 1)
        kill(a)
        b = loaders(2, root)
        if saved is not None:
            for x in b:
                x.load_state_dict(saved)
        drain([iter(x) for x in b])
        r = check_ledger(root)
        assert r["ok"], r
        (e,) = r["epochs"]
        assert e["repeats"]["count"] == 0 and e["losses"]["count"] == 0
        assert e["rolled_back"] == (3 if older else 4) * 2 * 2
        assert run_feedpipe("ledger", root).returncode == 0


def test_two_ranks_killed_right_after_rank_0s_checkpoint_lose_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only rank 0 calls state_dict(); rank 1's part was last flushed before the checkpoint
    (parts flush about once a second): resumed, the job is exactly-once."""
    from feedpipe.stream import _ledger

    monkeypatch.setattr(_ledger, "FLUSH_SECONDS", float("inf"))
    a = loaders(2, tmp_path)
    its = [iter(x) for x in a]
    step(its, 3)
    state = a[0].state_dict()
    kill(a)
    del its
    b = loaders(2, tmp_path)
    for x in b:
        x.load_state_dict(state)
    drain([iter(x) for x in b])
    r = check_ledger(tmp_path)
    assert r["ok"], r
    assert r["epochs"][0]["losses"]["count"] == 0


def test_json_lists_every_id_of_a_finding(tmp_path: Path) -> None:
    a = loaders(1, tmp_path)
    step([iter(x) for x in a], 2)
    state = dict(a[0].state_dict())
    state["position"] += 8
    state["ledger"] = dict(state["ledger"], position=state["position"])
    b = loaders(1, tmp_path)
    b[0].load_state_dict(state)
    drain([iter(b[0])])
    out = run_feedpipe("ledger", tmp_path, "--json")
    e = json.loads(out.stdout)["epochs"][0]
    assert out.returncode == 1 and e["losses"]["count"] == 8 and len(e["losses"]["ids"]) == 8


def test_the_help_names_every_key_of_the_json_document(tmp_path: Path) -> None:
    drain([iter(x) for x in loaders(2, tmp_path)])
    doc = json.loads(run_feedpipe("ledger", tmp_path, "--json").stdout)
    text = " ".join(run_feedpipe("ledger", "--help").stdout.split())
    keys = set(doc) | set(doc["epochs"][0]) | set(doc["runs"][0])
    assert {k for k in keys if f'"{k}"' not in text} == set()
