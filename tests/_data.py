"""Small datasets for the streaming tests (built once per session by the fixtures that use them)."""

from __future__ import annotations

import os

import feedpipe
from feedpipe.convert._synth import make_image_folder


def make_dataset(root: str, *, classes: int = 5, per_class: int = 5, max_samples: int = 7) -> str:
    """An image dataset of ``classes * per_class`` samples in shards of ``max_samples``."""
    src, out = os.path.join(root, "src"), os.path.join(root, "shards")
    make_image_folder(src, classes=classes, per_class=per_class, min_size=8, max_size=16, seed=1)
    feedpipe.shard(src, out, max_samples=max_samples, labels_from_dirs=True, workers=1,
                   show_progress=False)
    return out


def damage_record(store_path: str, index: int, samples: int) -> None:
    """Flip one pixel byte of record ``index`` of the decoded store under ``store_path`` (of
    ``samples`` records) behind the store's back."""
    from pathlib import Path

    data = next(Path(store_path).glob("data-*.bin"))
    at = index * (data.stat().st_size // samples) + 5
    with open(data, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
