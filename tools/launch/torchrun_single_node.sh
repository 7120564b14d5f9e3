#!/usr/bin/env bash
# One machine, NPROC ranks (one per GPU; gloo on CPU), around tools/train_ddp.py.
#
#   tools/launch/torchrun_single_node.sh DATASET [NPROC] [extra train_ddp.py options]
#   tools/launch/torchrun_single_node.sh shards/example 2 --epochs 2
#   tools/launch/torchrun_single_node.sh s3://bucket/shards 8 --ckpt runs/s3-run/ckpt.pt
#
# The checkpoint: --ckpt if given, else train_ddp.py's default, runs/<dataset name>-<hash of its
# path or URL>/ckpt.pt under the working directory: one per dataset, so a run on another dataset
# starts afresh instead of resuming this one. Run the same command again to resume.
#
# A remote DATASET (s3://, gs://, http://...) is fetched once into the node-local cache
# ($FEEDPIPE_CACHE_DIR, default $TMPDIR/feedpipe-cache) and shared by every rank and worker; a
# local one is read in place (setting FEEDPIPE_CACHE_DIR caches it too, e.g. from a slow NFS).
set -euo pipefail
DATASET=${1:?usage: $0 DATASET [NPROC] [train_ddp.py options]}
NPROC=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
HERE=$(cd "$(dirname "$0")/.." && pwd)
CACHE=()
if [[ "$DATASET" == *://* || -n "${FEEDPIPE_CACHE_DIR:-}" ]]; then
  CACHE=(--cache-dir "${FEEDPIPE_CACHE_DIR:-${TMPDIR:-/tmp}/feedpipe-cache}")
fi
exec torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" \
    "$HERE/train_ddp.py" "$DATASET" ${CACHE[@]+"${CACHE[@]}"} "$@"
