#!/usr/bin/env bash
# Everything that needs a GPU, in one command, from the repository root of a CUDA machine:
#
#   bash benchmarks/gpu_session.sh            # all parts, in this order:
#     setup           carried wheels, feedpipe's C extension, versions     -> gpu.txt
#     tests           the CUDA and DALI tests (pytest -m "cuda or dali", then the device-side
#                     test files whole)                                      -> gpu-tests.txt
#     cache           DeviceCache serving GB/s against device copies       -> device_cache-gpu.*
#     data            the ImageNet-like dataset of bench_train (50,000 JPEGs), made once
#     train-resnet50  bench_train.py, ResNet-50, every system               -> bench_train-resnet50.*
#     train-vit_b_16  bench_train.py, ViT-B/16, every system                -> bench_train-vit_b_16.*
#     demo probe device   the older GPU checks (feedpipe demo, probe, bench_device.py): not in
#                     "all"; name them to run them
#   bash benchmarks/gpu_session.sh tests cache train-resnet50   # some parts (setup always runs)
#
# The device session of a lent GPU machine (15 minutes of device time in all, start and idle
# counted): one command of at most 8 minutes of wall time, so that a rerun still fits:
#   bash benchmarks/gpu_session.sh budget
#     the CUDA and DALI tests (fork after CUDA included), DeviceCache serving bandwidth, a set of
#     20,000 JPEGs of 500x375 in 100 classes (IMAGES=, CLASSES=), then ResNet-50 and ViT-B/16 at
#     batch 256 over systems a, b, d and f (synthetic, torchvision, feedpipe's CPU path, its
#     decoded store and DeviceCache; DALI's wheel cannot travel) without torch.compile (a compile
#     per system process would not fit), 8 warm-up and 30 measured steps; each part under its
#     own time limit, the wall time of each part and of the whole written to budget.txt.
#   QUICK=1 NO_LIMITS=1 bash benchmarks/gpu_session.sh budget
#     its CPU rehearsal (tests/test_gpu_session.py runs it): the same parts and files with
#     bench_train's and bench_device_cache's --quick sizes and the fork-after-CUDA test file;
#     NO_LIMITS=1 records each part's limit without enforcing it (a loaded CPU is no device).
#
# Where one command may run at most 10 minutes, run it as three:
#   bash benchmarks/gpu_session.sh tests cache data
#   bash benchmarks/gpu_session.sh train-resnet50
#   bash benchmarks/gpu_session.sh train-vit_b_16
# (each makes the dataset again if the machine lost it; a part's results are written as it goes.)
#
# Results go to ${OUT:-benchmarks/results}; the dataset to ${ROOT:-<temp dir>/feedpipe-bench-train};
# IMAGES=N makes bench_train's dataset N images instead of 50,000.
# Needs a CUDA build of torch, torchvision, numpy, opencv, psutil, pytest, hypothesis and
# matplotlib importable (the GPU image has them). feedpipe's other dependencies, where the
# machine has no package registry, come as wheels in .whl/ (ignored by git), installed with
# --no-index into a fresh temp dir (mktemp). Made on a machine with pip and a registry, for CPython 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl lmdb simplejpeg webdataset braceexpand
# nvidia-dali-cuda130 (DALI: systems c and e, the DALI tests) is several hundred MB: put its
# wheel in .whl/ too where the transfer allows; without it those systems report their error and
# the DALI tests skip.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
root=${ROOT:-$(python3 -c 'import tempfile, os; print(os.path.join(tempfile.gettempdir(), "feedpipe-bench-train"))')}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests cache data train-resnet50 train-vit_b_16)
status=0

setup() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d -t feedpipe-site.XXXXXX)
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .whl/*.whl && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  # the optional window decoder (needs libjpeg headers); feedpipe decodes whole JPEGs without it
  build_log=$(mktemp -t feedpipe-build-ext.XXXXXX)
  $py setup.py -q build_ext --inplace >"$build_log" 2>&1 \
    || echo "feedpipe._jpegcrop did not build (whole-image decode): $(tail -n 1 "$build_log")"
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
for m in ("torchvision", "nvidia.dali", "simplejpeg", "lmdb", "webdataset", "cv2", "psutil"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "ok"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING:", type(e).__name__, e)
from feedpipe.diagnostics._env import jpeg_window_decoder
print("jpeg_window_decoder", jpeg_window_decoder())
PY
  } 2>&1 | tee "$out/gpu.txt"
}

run_part() {
  case "$1" in
    tests)
      echo "== CUDA and DALI tests"
      {
        $py -m pytest -q -p no:cacheprovider -rs -m "cuda or dali" \
          --continue-on-collection-errors tests/
        echo "== the device-side test files, whole"
        $py -m pytest -q -p no:cacheprovider -rs tests/test_device_loader.py \
          tests/test_device_cache.py tests/test_device_cache_serving.py tests/test_dali.py \
          tests/test_transforms.py tests/test_demo.py \
          tests/test_fork_after_cuda.py "tests/test_dataset.py::test_the_start_method_is_the_users"
      } 2>&1 | tee "$out/gpu-tests.txt" | tail -n 30 ;;
    cache)
      echo "== DeviceCache serving bandwidth"
      $py benchmarks/bench_device_cache.py --name device_cache-gpu --out "$out" 2>&1 \
        | tail -n 20 ;;
    data)
      echo "== bench_train dataset under $root"
      $py benchmarks/train_data.py --root "$root" ${IMAGES:+--images "$IMAGES"} | tail -n 12 ;;
    train-*)
      model=${1#train-}
      echo "== bench_train $model"
      $py benchmarks/bench_train.py --models "$model" --root "$root" --out "$out" \
        --name "bench_train-$model" ${IMAGES:+--images "$IMAGES"} 2>&1 | tail -n 40 ;;
    budget)
      budget ;;
    demo)
      $py -m feedpipe demo 2>&1 | tee "$out/gpu-demo.txt" | tail -n 6 ;;
    probe)
      $py benchmarks/train_data.py --root "$root" >/dev/null
      shards=$($py -c "import sys; sys.path.insert(0, 'benchmarks'); import train_data as t; print(t.ensure('$root', t.FULL, verbose=False)['shards'])")
      $py -m feedpipe probe "$shards" --duration 3 --step-time 50 --batch-size 256 --workers 8 \
        --no-progress --json "$out/probe-gpu.json" 2>&1 | tail -n 40 ;;
    device)
      $py benchmarks/bench_device.py --out "$out/device.json" 2>&1 | tail -n 40 ;;
    *)
      echo "unknown part $1" >&2; return 2 ;;
  esac
}

# One part's wall time, appended to budget.txt: name, seconds, its limit, exit status. The limit
# is the device session's: a part past it is killed there (rc 124). NO_LIMITS=1 (the CPU
# rehearsal on a shared machine, whose speed says nothing of the device's) records the limit
# without enforcing it.
timed() {
  local name=$1 limit=$2 t0=$SECONDS rc=0
  shift 2
  if [ -n "${NO_LIMITS:-}" ]; then
    "$@" || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" || rc=$?
  fi
  echo "$name $((SECONDS - t0)) s (limit $limit s) rc=$rc" | tee -a "$out/budget.txt"
  return $rc
}

budget() {
  local t0=$SECONDS rc=0 bench cache tests model
  : > "$out/budget.txt"
  if [ -n "${QUICK:-}" ]; then
    bench=(--quick --images "${IMAGES:-96}" --batch 16 --workers 1)
    cache=(--quick --device cpu)
    tests=(tests/test_fork_after_cuda.py)
    models=(tiny)
  else
    bench=(--images "${IMAGES:-20000}" --classes "${CLASSES:-100}" --compile off --warmup 8
           --steps 30 --timeout 75
           --systems synthetic,torchvision,feedpipe,feedpipe-store,feedpipe-cache)
    cache=()
    tests=(-m "cuda or dali" tests/)
    models=(resnet50 vit_b_16)
  fi
  timed tests 120 $py -m pytest -q -p no:cacheprovider -rs --slow "${tests[@]}" \
    > "$out/gpu-tests.txt" 2>&1 || rc=1
  tail -n 3 "$out/gpu-tests.txt"
  timed cache 40 $py benchmarks/bench_device_cache.py "${cache[@]}" --name device_cache-gpu \
    --out "$out" > "$out/device_cache-gpu.log" 2>&1 || rc=1
  for model in "${models[@]}"; do
    timed "train-$model" 150 $py benchmarks/bench_train.py --models "$model" --root "$root" \
      --out "$out" --name "bench_train-$model" "${bench[@]}" \
      > "$out/bench_train-$model.log" 2>&1 || rc=1
    tail -n 12 "$out/bench_train-$model.log"
  done
  echo "budget $((SECONDS - t0)) s wall in all" | tee -a "$out/budget.txt"
  return $rc
}

setup
for p in "${parts[@]}"; do
  run_part "$p" || { echo "part $p FAILED" >&2; status=1; }
done
exit $status
