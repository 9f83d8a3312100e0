#!/usr/bin/env bash
# Developer/CI set-up on a fresh machine: torch, packer (editable) + test/plot extras, Pillow-SIMD.
#   TORCH_SPEC: the torch requirement (default torch==2.13.0, the CPU wheel this project's
#   machines carry locally; an unpinned "torch" pulls several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install -q "$TORCH_SPEC"
fi
# packer and its test/plot extras first: matplotlib requires stock Pillow, which the next
# step replaces with Pillow-SIMD (same PIL package; the other order would undo it).
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
