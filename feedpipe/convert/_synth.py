"""Deterministic synthetic datasets, for the demo, the example shards, tests and benchmarks."""

from __future__ import annotations

import json
import os
from typing import Any


def _image(rng: Any, h: int, w: int, cls: int) -> Any:
    import numpy as np

    base = np.array([(cls * 53) % 256, (cls * 97) % 256, (cls * 151) % 256], dtype=np.float32)
    yy = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    xx = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    phase = rng.uniform(0, 6.28, size=3).astype(np.float32)
    img = base + 60 * np.sin(6 * xx + phase) * np.cos(4 * yy + phase[::-1])
    img = img + rng.normal(0, 12, size=(h, w, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(
    root: str,
    *,
    classes: int = 4,
    per_class: int = 8,
    min_size: int = 32,
    max_size: int = 64,
    sidecar_every: int = 10,
    quality: int = 85,
    seed: int = 0,
) -> int:
    """Write ``classes`` folders of JPEG images (``cls_003/00012.jpg``) with a JSON sidecar on
    every ``sidecar_every``-th image. Same arguments, same bytes. Returns the number of files."""
    import numpy as np
    import simplejpeg

    rng = np.random.default_rng(seed)
    n = 0
    for c in range(classes):
        d = os.path.join(root, f"cls_{c:03d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
            jpg = simplejpeg.encode_jpeg(_image(rng, h, w, c), quality=quality, colorspace="RGB")
            stem = os.path.join(d, f"{i:05d}")
            with open(stem + ".jpg", "wb") as f:
                f.write(jpg)
            n += 1
            if sidecar_every and i % sidecar_every == 0:
                with open(stem + ".json", "w", encoding="utf-8") as f:
                    json.dump({"class": c, "index": i, "height": h, "width": w}, f, sort_keys=True)
                n += 1
    return n


def make_records(root: str, *, count: int = 1000, size: int = 1024, per_dir: int = 10000,
                 seed: int = 0) -> int:
    """Write ``count`` tiny binary records of ``size`` bytes (``00000/0000012.bin``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for i in range(count):
        d = os.path.join(root, f"{i // per_dir:05d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:07d}.bin"), "wb") as f:
            f.write(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
    return count
