#!/usr/bin/env bash
# Everything that needs a GPU, in one go (run from the repository root on a CUDA machine):
# the CUDA tests, the demo's device steps, the probe's host-to-device stage, and bench_device.py.
# Results go to ${OUT:-benchmarks/results}. Needs feedpipe's dependencies importable
# (pip install -e '.[test,dali]' or PYTHONPATH), plus a CUDA build of torch.
set -uo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
echo "== CUDA and DALI tests"
$py -m pytest -q -p no:cacheprovider -rs tests/test_device_loader.py tests/test_device_cache.py \
    tests/test_dali.py tests/test_transforms.py tests/test_demo.py \
    "tests/test_dataset.py::test_workers_start_from_a_forkserver_once_cuda_is_initialised" \
    2>&1 | tee "$out/gpu-tests.txt" | tail -n 25
echo "== demo"
$py -m feedpipe demo 2>&1 | tee "$out/gpu-demo.txt" | tail -n 6
echo "== probe on a generated shard dataset"
work=$(mktemp -d)
$py - "$work" <<'PY'
import sys
from feedpipe.convert import shard
from feedpipe.synth import make_image_folder
make_image_folder(sys.argv[1] + "/img", classes=16, per_class=250, min_size=160, max_size=320, seed=0)
shard(sys.argv[1] + "/img", sys.argv[1] + "/shards", labels_from_dirs=True, show_progress=False)
PY
$py -m feedpipe probe "$work/shards" --duration 3 --step-time 50 --batch-size 256 --workers 8 \
    --no-progress --json "$out/probe-gpu.json" 2>&1 | tail -n 40
rm -rf "$work"
echo "== bench_device"
$py benchmarks/bench_device.py --out "$out/device.json" 2>&1 | tail -n 40
