#!/usr/bin/env bash
# Developer/CI set-up on a fresh machine: a torch + torchvision pair that import together
# (with Triton), packer (editable) + test/plot extras, then Pillow-SIMD, last.
#   TORCH_SPEC: the pair (default torch==2.14.1 torchvision==0.29.1: the package index's
#   torchvision wheels are built against its CUDA torch of the same version, so this is the
#   CUDA build, ~3 GB; it runs on machines without a GPU too). A CPU-only torch with those
#   torchvision wheels fails at import ("operator torchvision::nms does not exist").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"

pair_ok() {  # torch and torchvision import together and torchvision's C++ ops load
  "$PYTHON" -c "import torch, torchvision; torchvision.ops.nms" >/dev/null 2>&1
}
if ! pair_ok; then
  echo "Installing $TORCH_SPEC (CUDA builds from the package index, ~3 GB; they run on CPU too)..."
  # shellcheck disable=SC2086  # TORCH_SPEC is a list of requirements
  "$PYTHON" -m pip install -q $TORCH_SPEC
  if ! pair_ok; then
    echo "error: torch and torchvision do not import together after installing $TORCH_SPEC:" >&2
    "$PYTHON" -c "import torch, torchvision; torchvision.ops.nms" >&2 || true
    exit 1
  fi
fi
# packer and its test/plot extras next: torchvision and matplotlib require stock Pillow,
# which the last step replaces with Pillow-SIMD (same PIL package; another order undoes it).
"$PYTHON" -m pip install -q -e ".[test,plot]"
PYTHON="$PYTHON" bash scripts/install_pillow_simd.sh
if command -v apt-get >/dev/null && ! command -v shellcheck >/dev/null; then
  if [[ $(id -u) == 0 ]]; then
    (apt-get update -qq && apt-get install -y -qq shellcheck) >/dev/null || echo "note: shellcheck not installed" >&2
  else
    echo "note: install shellcheck (apt-get install shellcheck) to lint scripts/" >&2
  fi
fi
"$PYTHON" -m packer doctor
