"""Lightning's own DDP launcher over FeedLoader (tests/test_frameworks.py runs this script; the
launcher runs it again for rank 1 with LOCAL_RANK set). Each rank writes the ids it trained on.

Usage: python _lightning_ddp.py DATASET OUT
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch

from feedpipe import FeedDataset, FeedLoader


class Recorder(pl.LightningModule):
    """A tiny model that records the ids of every batch it trains on, per epoch (tests/
    test_frameworks.py uses it in-process too); with ``out``, each rank writes them there when
    training ends."""

    def __init__(self, out: str | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, list[int]]] = []
        self.out = out

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["__index__"].tolist()))
        x = batch["cls"].float().unsqueeze(1)
        return torch.nn.functional.mse_loss(self.layer(x), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        if self.out is None:
            return
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(self.seen, f)


if __name__ == "__main__":
    path, out = sys.argv[1], sys.argv[2]
    # made before fit, no rank given: the ranks are known only once Lightning has started them
    loader = FeedLoader(FeedDataset(path, shuffle=True, seed=5, decode={"cls": int}),
                        batch_size=4)
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, default_root_dir=out).fit(
        Recorder(out), train_dataloaders=loader)
    # Lightning leaves the gloo process group up after fit; torch's gloo threads can then abort
    # the interpreter's exit (SIGABRT, "terminate called without an active exception": seen once
    # in CI, not in 9 runs here; pytorch/pytorch#190489). Each rank takes it down itself, as
    # torch's distributed docs ask of every trainer process.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
