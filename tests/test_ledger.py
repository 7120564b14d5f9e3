"""The delivery ledger (``FeedLoader(ledger=DIR)``, ``feedpipe ledger DIR``): a whole run with
its stops, resumes and changes of world size is proven exactly-once, and each way it can go wrong
is named: a repeat, a loss, a checkpoint resumed twice, a part file that cannot be read. Ranks
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


def test_a_checkpoint_resumed_twice_is_named(tmp_path: Path) -> None:
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
    assert not r["ok"]
    (rp,) = r["replays"]
    b_runs = {x["run"] for x in r["runs"][2:4]}
    c_runs = {x["run"] for x in r["runs"][4:6]}
    assert rp["runs"][0] in b_runs and rp["runs"][1] in c_runs
    assert "old checkpoint" in rp["why"]
    e = r["epochs"][0]
    assert e["repeats"]["count"] == 2 * 2 * 2 and e["repeats"]["parts"]
    out = run_feedpipe("ledger", tmp_path, "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["replays"]
    text = run_feedpipe("ledger", tmp_path)
    assert "REPLAY" in text.stdout and "8 repeats" in text.stdout


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
    assert not r["ok"] and e["losses"]["count"] == 6 and len(e["losses"]["ids"]) == 5
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
    (part,) = tmp_path.glob("e*/*.part")
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
