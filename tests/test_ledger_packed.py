"""The ledger of a Packed loader: the rows each rank's loop received, checked by recomputing each
epoch's rows from the documents' lengths with the plan's own functions (feedpipe.plan._packing).
Every token of the corpus is unique (document ``i``'s token ``j`` is ``i * 1000 + j``), so the
ground truth is the tokens the loops received, and a loss or repeat the checker names as pieces
``(document, start, length)`` is compared token for token."""

from __future__ import annotations

import base64
import copy
import datetime
import json
import os
import socket
import zlib
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp
from conftest import run_feedpipe

from feedpipe import FeedDataset, FeedLoader, Packed, check_ledger
from feedpipe.convert._shard_writer import write_samples
from feedpipe.errors import StateError
from feedpipe.stream._ledger_check import ledger_text

SEQ = 8
LENGTHS = [int(n) for n in np.random.default_rng(7).integers(1, 30, size=24)]


def _doc(i: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) + i * 1000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("packed") / "tok")
    write_samples([{"__key__": f"d{i:03d}", "tokens.npy": _doc(i, n)}
                   for i, n in enumerate(LENGTHS)], root, max_samples=7)
    return root


ALL = Counter(int(t) for i, n in enumerate(LENGTHS) for t in _doc(i, n))


def packed(path: str, rank: int = 0, world: int = 1, **kw: Any) -> Packed:
    return Packed(FeedDataset(path, shuffle=True, seed=3, rank=rank, world_size=world, **kw),
                  SEQ)


def tokens(batch: dict[str, Any]) -> list[int]:
    return batch["input_ids"][batch["labels"] != -100].tolist()


def named(finding: dict[str, Any] | None) -> Counter[int]:
    """The tokens a finding's pieces name, each as many times as named."""
    out: Counter[int] = Counter()
    for d, s, k in (finding or {}).get("pieces", []):
        out.update(range(d * 1000 + s, d * 1000 + s + k))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_loader_takes_a_ledger_and_proves_its_epochs(corpus: str, tmp_path: Path,
                                                              workers: int) -> None:
    """``FeedLoader(Packed(...), ledger=)`` was refused with a ValueError; it now records the
    rows delivered, in this process and from 2 worker processes (route packed-workers),
    and ``feedpipe ledger`` proves every token of two epochs once."""
    route = "packed-workers" if workers else "auto"
    ld = FeedLoader(packed(corpus), batch_size=3, num_workers=workers, route=route,
                    ledger=tmp_path / "l")
    got: Counter[int] = Counter()
    for e in range(2):
        ld.set_epoch(e)
        got.update(t for b in ld for t in tokens(b))
    if workers:
        pids = ld.stats()["worker_pids"]
        assert len(set(pids)) == 2 and os.getpid() not in pids
    assert got == Counter({t: 2 for t in ALL})
    r = check_ledger(tmp_path / "l")
    assert r["ok"] and [e["finished"] and e["exactly_once"] for e in r["epochs"]] == [True] * 2
    rows = -(-sum(LENGTHS) // SEQ)
    assert [(e["delivered"], e["expected"]) for e in r["epochs"]] == [(rows, rows)] * 2
    assert r["packed"] == {"seq_len": SEQ, "packing": "concatenate", "field": "tokens.npy",
                           "documents": len(LENGTHS), "tokens": sum(LENGTHS)}
    out = run_feedpipe("ledger", tmp_path / "l")
    assert f"{rows} of {rows} rows delivered - exactly once" in out.stdout
    assert out.stdout.rstrip().endswith("OK: every finished epoch exactly once")


def test_an_epoch_left_early_names_its_lost_tokens_as_pieces(corpus: str,
                                                             tmp_path: Path) -> None:
    ld = FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    it = iter(ld)
    got = Counter(t for _ in range(3) for t in tokens(next(it)))
    it.close()
    ld.set_epoch(1)  # the job moved past epoch 0: what it did not deliver is lost
    for _ in ld:
        pass
    r = check_ledger(tmp_path / "l")
    e0 = r["epochs"][0]
    assert not r["ok"] and e0["finished"] and not e0["exactly_once"]
    assert named(e0["losses"]) == ALL - got and e0["losses"]["tokens"] == sum(LENGTHS) - 3 * 16
    assert e0["losses"]["ids"] == list(range(6, e0["expected"]))  # rows 6, 7, ... lost
    text = ledger_text(r)
    assert "lost rows, rows [6, 7, 8, 9, 10] and" in text and "tokens [" in text
    assert text.endswith("NOT exactly once: see above")
    assert r["epochs"][1]["exactly_once"]


@pytest.mark.parametrize("moved", [-1, 1])
def test_a_moved_resume_point_names_repeated_or_lost_pieces(corpus: str, tmp_path: Path,
                                                            moved: int) -> None:
    ld = FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    it = iter(ld)
    got = Counter(t for _ in range(4) for t in tokens(next(it)))
    state = ld.state_dict()
    state["position"] += 2 * moved  # a batch delivered again (-1) or never (+1)
    again = FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    again.load_state_dict(state)
    got.update(t for b in again for t in tokens(b))
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert not r["ok"] and e["finished"]
    assert named(e["repeats"]) == got - ALL  # the tokens received twice, once each
    assert named(e["losses"]) == ALL - got
    assert (e["repeats"]["count"], e["losses"]["count"]) == ((2, 0) if moved < 0 else (0, 2))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_padding_rows_are_neither_losses_nor_repeats(corpus: str, tmp_path: Path,
                                                          world: int) -> None:
    """The rows are made a multiple of the world size with rows of padding only: the ledger
    counts them as padding. The ranks step in lockstep; a resume on another world size."""
    lds = [FeedLoader(packed(corpus, r, world), batch_size=2, ledger=tmp_path / "l")
           for r in range(world)]
    its = [iter(ld) for ld in lds]
    got = Counter(t for _ in range(2) for it in its for t in tokens(next(it)))
    state = lds[0].state_dict()
    for it in its:
        it.close()
    more = [FeedLoader(packed(corpus, r, 5 - world), batch_size=2, ledger=tmp_path / "l")
            for r in range(5 - world)]
    for ld in more:
        ld.load_state_dict(copy.deepcopy(state))
    for batches in zip(*more):
        got.update(t for b in batches for t in tokens(b))
    r = check_ledger(tmp_path / "l")
    (e,) = r["epochs"]
    assert got == ALL and r["ok"] and e["exactly_once"], ledger_text(r)
    rows, rest = -(-sum(LENGTHS) // SEQ), -(-sum(LENGTHS) // SEQ) - 2 * 2 * world
    assert e["delivered"] == rows and e["padding"] == -(-rest // (5 - world)) * (5 - world) - rest


def test_a_ledger_of_other_documents_or_packing_is_refused(corpus: str, tmp_path: Path) -> None:
    FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    with pytest.raises(StateError, match="another dataset or order"):
        FeedLoader(Packed(FeedDataset(corpus, shuffle=True, seed=3), SEQ + 1), batch_size=2,
                   ledger=tmp_path / "l")


def test_damaged_lengths_are_said_not_trusted(corpus: str, tmp_path: Path) -> None:
    ld = FeedLoader(packed(corpus), batch_size=4, ledger=tmp_path / "l")
    for _ in ld:
        pass
    meta = tmp_path / "l" / "ledger.json"
    info = json.loads(meta.read_text())
    raw = bytearray(zlib.decompress(base64.b64decode(info["lengths"]["zlib"])))
    raw[0] ^= 1  # one document's length changed: the rows would be other rows
    info["lengths"]["zlib"] = base64.b64encode(zlib.compress(bytes(raw))).decode()
    meta.write_text(json.dumps(info))
    with pytest.raises(StateError, match="do not match their digest"):
        check_ledger(tmp_path / "l")


def test_the_help_names_every_key_of_a_packed_json_document(corpus: str,
                                                            tmp_path: Path) -> None:
    ld = FeedLoader(packed(corpus), batch_size=2, ledger=tmp_path / "l")
    it = iter(ld)
    next(it)
    it.close()
    ld.set_epoch(1)
    for _ in ld:
        pass
    doc = json.loads(run_feedpipe("ledger", tmp_path / "l", "--json").stdout)
    text = " ".join(run_feedpipe("ledger", "--help").stdout.split())
    keys = set(doc["packed"]) | set(doc["epochs"][0]["losses"])
    assert {"pieces", "tokens"} <= keys
    assert {k for k in keys if f'"{k}"' not in text} == set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_rank(rank: int, world: int, port: int, path: str, ledger: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        ds = FeedDataset(path, shuffle=True, seed=3)  # the world is torch.distributed's
        loader = FeedLoader(Packed(ds, SEQ), batch_size=2, num_workers=2,
                            route="packed-workers", ledger=ledger)
        got: list[int] = []
        for batch in loader:
            got += tokens(batch)
            dist.all_reduce(torch.ones(1))  # a DDP step: every rank takes as many
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"tokens": got, "pid": os.getpid(),
                                          "workers": loader.stats()["worker_pids"]})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_with_two_workers_each_are_proved_exactly_once(corpus: str,
                                                                      tmp_path: Path) -> None:
    out, ledger = str(tmp_path / "out.json"), str(tmp_path / "l")
    mp.spawn(gloo_rank, args=(2, _free_port(), corpus, ledger, out), nprocs=2, join=True)
    with open(out) as f:
        ranks = json.load(f)
    for r in ranks:
        assert len(set(r["workers"])) == 2 and r["pid"] not in r["workers"]
    assert Counter(ranks[0]["tokens"] + ranks[1]["tokens"]) == ALL
    r = check_ledger(ledger)
    assert r["ok"] and {x["rank"] for x in r["runs"]} == {0, 1}, ledger_text(r)
    assert r["epochs"][0]["finished"] and r["epochs"][0]["exactly_once"]


def test_a_packed_mixture_whose_epochs_differ_is_proved_per_epoch(tmp_path: Path) -> None:
    """A Packed over a Mixture that draws other documents each epoch (``epoch_size`` below the
    sources' size): each epoch has its own rows, recomputed from the mixture's plan and the
    lengths; an epoch left early names its lost tokens, the others are exactly once."""
    from feedpipe import Mixture

    lengths = [int(n) for n in np.random.default_rng(4).integers(3, 40, size=30)]
    for name, lo, hi in (("web", 0, 20), ("books", 20, 30)):
        write_samples([{"__key__": f"{name}{i:03d}", "tokens.npy": _doc(i, lengths[i])}
                       for i in range(lo, hi)], str(tmp_path / name), max_samples=6)

    def mixture() -> Mixture:
        return Mixture({n: FeedDataset(str(tmp_path / n), shuffle=True) for n in ("web", "books")},
                       weights={"web": 3, "books": 1}, epoch_size=12, seed=3)

    ld = FeedLoader(Packed(mixture(), SEQ), batch_size=2, ledger=tmp_path / "l")
    got: dict[int, Counter[int]] = {}
    for e in range(3):
        ld.set_epoch(e)
        it = iter(ld)
        stop = 2 if e == 1 else None  # epoch 1 left after 2 batches
        got[e] = Counter(t for b in islice(it, stop) for t in tokens(b))
        it.close()
    mix = mixture()
    r = check_ledger(tmp_path / "l")
    assert [x["exactly_once"] for x in r["epochs"]] == [True, False, True]
    rows = []
    for e in range(3):
        drawn = mix.plan(e).sample_ids(np.arange(12)).tolist()
        want = Counter(t for g in drawn for t in _doc(g, lengths[g]).tolist())
        assert named(r["epochs"][e]["losses"]) == want - got[e]
        rows.append(r["epochs"][e]["expected"])
    assert len(set(rows)) > 1  # the epochs do have other row counts


def test_a_part_whose_writer_made_other_rows_is_unreadable_not_trusted(corpus: str,
                                                                       tmp_path: Path) -> None:
    """Each part records its epoch's rows as its writer packed them: a writer whose packing
    made another row count than this feedpipe's (of the same lengths) is named, never OK."""
    ld = FeedLoader(packed(corpus), batch_size=4, ledger=tmp_path / "l")
    for e in range(2):
        ld.set_epoch(e)
        for _ in ld:
            pass
    assert check_ledger(tmp_path / "l")["ok"]
    part = sorted((tmp_path / "l").glob("r*/*.part"))[-1]  # epoch 1's: no plan ids in it
    head = json.loads(part.read_text())
    assert "checked" not in head and head["epoch"] == 1
    head["positions"] += 1
    part.write_text(json.dumps(head) + "\n")
    r = check_ledger(tmp_path / "l")
    assert not r["ok"] and [u["why"] for u in r["unreadable"]] == [
        f"the packing that wrote it made {head['positions'] - 1} rows of epoch 1, this "
        f"feedpipe's makes {head['positions'] - 2}: check this ledger with the feedpipe version "
        "that wrote it"]
