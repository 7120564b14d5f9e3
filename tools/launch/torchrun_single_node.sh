#!/usr/bin/env bash
# One machine, NPROC ranks (one per GPU; gloo on CPU), around tools/train_ddp.py.
#
#   tools/launch/torchrun_single_node.sh DATASET [NPROC] [extra train_ddp.py options]
#   tools/launch/torchrun_single_node.sh shards/example 2 --ckpt /tmp/ckpt.pt --epochs 2
#
# DATASET is a local path or a URL (s3://, gs://, http://). For a remote dataset the shards are
# fetched once into the node-local cache (--cache-dir) and shared by every rank and worker.
set -euo pipefail
DATASET=${1:?usage: $0 DATASET [NPROC] [train_ddp.py options]}
NPROC=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
HERE=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${FEEDPIPE_CACHE_DIR:-${TMPDIR:-/tmp}/feedpipe-cache}
exec torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" \
    "$HERE/train_ddp.py" "$DATASET" --cache-dir "$CACHE" --ckpt "${CKPT:-/tmp/feedpipe-ckpt.pt}" "$@"
