"""Regenerate ``shards/example`` byte-identically: 24 tiny JPEGs in 3 classes, 3 shards.

    python tools/make_example.py            # rewrite shards/example
    python tools/make_example.py --check    # exit 1 if the committed copy differs
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEST = os.path.join(HERE, "..", "shards", "example")


def build(dest: str) -> None:
    from feedpipe import shard
    from feedpipe.convert._synth import make_image_folder

    with tempfile.TemporaryDirectory() as tmp:
        old = os.getcwd()
        os.chdir(tmp)  # relative paths: the manifest records "src", not a temp path
        try:
            make_image_folder("src", classes=3, per_class=8, min_size=16, max_size=32,
                              sidecar_every=4, seed=0)
            shard("src", "out", max_samples=10, labels_from_dirs=True, workers=1,
                  show_progress=False)
        finally:
            os.chdir(old)
        if os.path.exists(dest):
            shutil.rmtree(dest)
        shutil.copytree(os.path.join(tmp, "out"), dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed copy")
    a = ap.parse_args()
    if not a.check:
        build(DEST)
        print(f"wrote {os.path.normpath(DEST)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = os.path.join(tmp, "example")
        build(fresh)
        names = sorted(os.listdir(fresh))
        _, mismatch, errors = filecmp.cmpfiles(fresh, DEST, names, shallow=False)
        if mismatch or errors or names != sorted(os.listdir(DEST)):
            print(f"differs: {mismatch + errors}", file=sys.stderr)
            return 1
    print("shards/example is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
