"""FeedLoader under the real Lightning Trainer and accelerate, with no feedpipe-specific code in
the training script: every sample once per epoch, a new order each epoch, and a mid-epoch
checkpoint resumed by the framework trains exactly the rest of the epoch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from feedpipe import FeedDataset, FeedLoader

N = 25  # ds_path: 25 samples
pl = pytest.importorskip("lightning.pytorch", reason="lightning is in the test extra")

from _lightning_ddp import Recorder  # noqa: E402  (after the skip: it imports lightning)


def loader(path: str, workers: int = 0) -> FeedLoader:
    ds = FeedDataset(path, shuffle=True, seed=5, decode={"cls": int})
    return FeedLoader(ds, batch_size=4, num_workers=workers,
                      route="samples-workers" if workers else "auto")


def trainer(tmp_path: Path, **kw: object) -> pl.Trainer:
    kw.setdefault("devices", 1)
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), **kw)


def by_epoch(seen: list[tuple[int, list[int]]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for epoch, ids in seen:
        out.setdefault(epoch, []).extend(ids)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_fit_two_epochs_every_sample_once_new_order(ds_path: str, tmp_path: Path,
                                                              workers: int) -> None:
    model = Recorder()
    trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(
        model, train_dataloaders=loader(ds_path, workers))
    epochs = by_epoch(model.seen)
    assert sorted(epochs) == [0, 1]
    for ids in epochs.values():
        assert sorted(ids) == list(range(N))
    assert epochs[0] != epochs[1]


def test_lightning_resumes_a_mid_epoch_checkpoint_with_the_rest_of_the_epoch(
        ds_path: str, tmp_path: Path) -> None:
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3,
                                        save_top_k=-1)
    first = Recorder()
    trainer(tmp_path, max_steps=3, callbacks=[ckpt]).fit(first, train_dataloaders=loader(ds_path))
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    rest = Recorder()
    trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(
        rest, train_dataloaders=loader(ds_path), ckpt_path=str(path))
    done = by_epoch(first.seen)[0]
    assert len(done) == 12
    epochs = by_epoch(rest.seen)
    assert Counter(done + epochs[0]) == Counter(range(N)), "the rest of epoch 0, exactly"
    assert sorted(epochs[1]) == list(range(N))
    full = Recorder()
    trainer(tmp_path / "full", max_epochs=2, enable_checkpointing=False).fit(
        full, train_dataloaders=loader(ds_path))
    assert done + epochs[0] == by_epoch(full.seen)[0]  # the uninterrupted order
    assert epochs[1] == by_epoch(full.seen)[1]


def test_accelerate_prepare_save_state_and_load_state(ds_path: str, tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate", reason="accelerate is in the test extra")
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, ld = acc.prepare(model, opt, loader(ds_path))
    acc.register_for_checkpointing(ld)
    it = iter(ld)
    done = [i for _ in range(3) for i in next(it)["__index__"].tolist()]
    acc.save_state(str(tmp_path / "state"))
    del it

    acc2 = accelerate.Accelerator(cpu=True)
    model2 = torch.nn.Linear(1, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
    model2, opt2, ld2 = acc2.prepare(model2, opt2, loader(ds_path))
    acc2.register_for_checkpointing(ld2)
    acc2.load_state(str(tmp_path / "state"))
    rest = [i for b in ld2 for i in b["__index__"].tolist()]
    assert Counter(done + rest) == Counter(range(N))
    full = [i for b in loader(ds_path) for i in b["__index__"].tolist()]
    assert done + rest == full
    nxt = [i for b in ld2 for i in b["__index__"].tolist()]  # the next epoch, by itself
    assert sorted(nxt) == list(range(N)) and nxt != full


@pytest.mark.slow
def test_lightning_ddp_launcher_gives_each_rank_its_share(ds_path: str, tmp_path: Path) -> None:
    """Two ranks started by Lightning's own launcher (strategy="ddp" on CPU, gloo): the
    FeedLoader, made before fit with no rank given, learns the world when it is iterated, so the
    ranks share each epoch instead of each training on all of it."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, "_lightning_ddp.py"), ds_path,
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=here, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [by_epoch(json.loads((tmp_path / f"rank{r}.json").read_text())) for r in (0, 1)]
    for epoch in (0, 1):
        a, b = ranks[0][epoch], ranks[1][epoch]
        assert len(a) == len(b) == 13  # 25 samples over 2 ranks: one repeated as padding
        assert set(a) | set(b) == set(range(N)) and len(set(a) & set(b)) <= 1
    assert ranks[0][0] != ranks[0][1]


def _epoch_in_another_process(ds: FeedDataset, out: object) -> None:
    ds.attach()  # as a loader does before a pass
    ds.set_epoch(7)
    out.put(ds.epoch)  # type: ignore[attr-defined]


def test_a_dataset_sent_to_another_rank_keeps_its_epoch_to_itself(ds_path: str) -> None:
    """A copy of a dataset sent to a spawned process (as Lightning's ddp_spawn sends the loader
    to each rank) shares the sender's epoch memory until it is attached: it takes its own."""
    import torch.multiprocessing as mp

    ds = FeedDataset(ds_path)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_epoch_in_another_process, args=(ds, out))
    p.start()
    assert out.get(timeout=120) == 7
    p.join(timeout=120)
    assert p.exitcode == 0 and ds.epoch == 0


def test_a_world_size_without_a_rank_is_refused_when_iterated(ds_path: str,
                                                              monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ld = loader(ds_path)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 says there are 2 ranks, but neither RANK"):
        next(iter(ld))
