#!/usr/bin/env bash
# The GPU-machine evidence in one run: GPU tests, `packer bench --cuda`, and the training
# example, over N photo-like JPEGs generated on the machine itself.
#   usage: benchmarks/gpu_benchmarks.sh [OUT_DIR] [IMAGES]     (needs CUDA, torch, lmdb)
#   STEPS="tests bench train" (default) picks what runs.
set -euo pipefail
out="${1:-./gpu-bench-out}"
images="${2:-20000}"
work="${WORK:-/tmp/packer-gpu-bench}"
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
steps="${STEPS:-tests bench train}"
cores=$(getconf _NPROCESSORS_ONLN)  # not nproc: it obeys OMP_NUM_THREADS=1, set above

echo "== environment"; python3 -m packer doctor | tee "$out/doctor.txt"
echo "== data: $images images"
if [[ ! -d "$work/src" ]]; then
  python3 -c "from packer.demo import make_image_folder as m; m('$work/src', images=$images, classes=100, workers=$cores)"
fi
[[ -f "$work/packed/manifest.json" ]] || python3 -m packer build "$work/src" "$work/packed" -q

if [[ $steps == *tests* ]]; then
echo "== GPU tests"
python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -n 25 | tee "$out/gpu_tests.txt"

fi

if [[ $steps == *bench* ]]; then
echo "== packer bench --cuda"
python3 -m packer bench "$work/packed" --folder "$work/src" --staged /dev/shm/packer-bench \
  --cuda -j "$((cores / 2)),$cores" --seconds 2 --repeats 2 --json "$out/bench.json" \
  2>&1 | tee "$out/bench.txt"
python3 -m packer unstage /dev/shm/packer-bench >/dev/null 2>&1 || true
fi

if [[ $steps == *train* ]]; then
echo "== train_example.py, 1 GPU, ResNet-50"
python3 scripts/train_example.py --data "$work/packed" --stage-to /dev/shm/packer-train \
  --epochs 1 --max-steps 120 --batch-size 256 --amp bf16 --channels-last --log-every 40 \
  2>&1 | tail -n 8 | tee "$out/train_resnet50.txt"
python3 -m packer unstage /dev/shm/packer-train/train >/dev/null 2>&1 || true
fi
