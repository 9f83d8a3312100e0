#!/usr/bin/env bash
# Developer/CI set-up on a fresh machine, in a virtual environment: a torch + torchvision pair
# that import together (with Triton), packer (editable) + test/plot extras, then Pillow-SIMD,
# last. It installs no system package and needs no root.
#
# The environment: the active one ($VIRTUAL_ENV), else .venv in the repository (made with
# $BASE_PYTHON -m venv, default python3; reused when it is there). PYTHON=... picks an
# interpreter instead (it must be allowed to pip install: Debian's system python3 is not).
#   TORCH_SPEC: the pair (default torch==2.14.1 torchvision==0.29.1: the package index's
#   torchvision wheels are built against its CUDA torch of the same version, so this is the
#   CUDA build, ~3 GB of the ~5 GB environment; it runs on machines without a GPU too). A
#   CPU-only torch with those torchvision wheels fails at import ("operator torchvision::nms
#   does not exist").
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"

if [[ -z "${PYTHON:-}" && -n "${VIRTUAL_ENV:-}" ]]; then
  PYTHON="$VIRTUAL_ENV/bin/python"
  stale=" (the active virtual environment $VIRTUAL_ENV is gone: deactivate it, or make it anew)"
  echo "Using the active virtual environment $VIRTUAL_ENV"
elif [[ -z "${PYTHON:-}" ]]; then
  base="${BASE_PYTHON:-python3}"
  # A .venv without pip is an interrupted creation (ensurepip runs last): completed.
  if [[ -x .venv/bin/python ]] && ! .venv/bin/python -c "import pip" >/dev/null 2>&1; then
    echo "The virtual environment .venv is incomplete (no pip: an interrupted set-up?); adding pip"
    if ! .venv/bin/python -m ensurepip >/dev/null; then
      echo "error: could not add pip to .venv (python -m ensurepip); on Debian/Ubuntu it needs" \
           "the python3-venv package (sudo apt-get install python3-venv), or remove .venv" >&2
      exit 1
    fi
  fi
  if [[ ! -x .venv/bin/python ]]; then
    if ! command -v "$base" >/dev/null; then
      echo "error: no Python interpreter $base; set BASE_PYTHON to a Python >= 3.9" >&2
      exit 1
    fi
    echo "Creating the virtual environment .venv ..."
    if ! "$base" -m venv .venv; then
      echo "error: could not create .venv with $base -m venv; on Debian/Ubuntu" \
           "it needs the python3-venv package (sudo apt-get install python3-venv), or set" \
           "BASE_PYTHON to another Python >= 3.9" >&2
      rm -rf .venv
      exit 1
    fi
  fi
  PYTHON=.venv/bin/python
fi
if ! command -v "$PYTHON" >/dev/null; then
  echo "error: no Python interpreter $PYTHON${stale:-}" >&2
  exit 1
fi

pair_ok() {  # torch and torchvision import together and torchvision's C++ ops load
  "$PYTHON" -c "import torch, torchvision; torchvision.ops.nms" >/dev/null 2>&1
}
if ! pair_ok; then
  echo "Installing $TORCH_SPEC (CUDA builds from the package index, ~3 GB; they run on CPU too)..."
  # shellcheck disable=SC2086  # TORCH_SPEC is a list of requirements
  if ! "$PYTHON" -m pip install -q $TORCH_SPEC; then
    echo "error: pip could not install TORCH_SPEC='$TORCH_SPEC' (see above)" >&2
    exit 1
  fi
  if ! pair_ok; then  # the error itself, not its traceback
    echo "error: torch and torchvision do not import together after installing $TORCH_SPEC:" \
         "$("$PYTHON" -c "import torch, torchvision; torchvision.ops.nms" 2>&1 | tail -n 1)" >&2
    exit 1
  fi
fi
# packer and its test/plot extras next: torchvision and matplotlib require stock Pillow,
# which the last step replaces with Pillow-SIMD (same PIL package; another order undoes it).
"$PYTHON" -m pip install -q -e ".[test,plot]"
PYTHON="$PYTHON" bash scripts/install_pillow_simd.sh ||
  echo "note: stock Pillow stays (packer works the same, without SIMD resizes); see above" >&2
"$PYTHON" -m packer doctor
echo "Set-up done in $("$PYTHON" -c 'import sys; print(sys.prefix)'). Run the tests with:"
if [[ "$PYTHON" == .venv/bin/python ]]; then
  echo "  .venv/bin/python -m pytest"
else
  echo "  $PYTHON -m pytest"
fi
