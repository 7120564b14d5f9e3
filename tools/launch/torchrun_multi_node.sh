#!/usr/bin/env bash
# Several machines: run this same command on every node (NODE_RANK = 0 .. NNODES-1).
#
#   MASTER_ADDR=node0.example MASTER_PORT=29500 NNODES=2 NODE_RANK=0 NPROC=8 \
#       tools/launch/torchrun_multi_node.sh s3://bucket/shards --epochs 10
#
# The dataset must be reachable from every node: an object store (s3://, gs://, http://) or a
# shared filesystem. Each node keeps its own L1 cache (FEEDPIPE_CACHE_DIR, default a local temp
# dir): feedpipe's plan tells every rank which samples it reads, so a node fetches each shard its
# ranks need once and nothing else (tests/test_multinode.py checks this with 2 nodes x 2 ranks).
# The checkpoint: --ckpt PATH among the options, else train_ddp.py's default
# runs/<dataset name>-<hash>/ckpt.pt under the working directory; only rank 0 (on node 0) writes
# and reads it, so node 0 of the next job must see the same file.
set -euo pipefail
DATASET=${1:?usage: $0 DATASET [train_ddp.py options]}
shift
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
HERE=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${FEEDPIPE_CACHE_DIR:-${TMPDIR:-/tmp}/feedpipe-cache}
exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="${NPROC:-2}" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv_id="${RDZV_ID:-feedpipe}" \
    "$HERE/train_ddp.py" "$DATASET" --cache-dir "$CACHE" "$@"
