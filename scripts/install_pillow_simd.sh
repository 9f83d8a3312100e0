#!/usr/bin/env bash
# Replace stock Pillow with Pillow-SIMD: the same `PIL` package, with SIMD (SSE4/AVX2)
# resize, convert and filters. Both install into site-packages/PIL, so only one may be
# present; a pip run that resolves a requirement on "pillow" (packer-lmdb's own, torchvision's,
# matplotlib's) brings stock Pillow back: run this script again afterwards. `packer doctor`
# says which one is active (docs/tuning.md: why stock Pillow is the dependency).
#
# usage: scripts/install_pillow_simd.sh [--check]
#   PYTHON=.venv/bin/python scripts/install_pillow_simd.sh   # pick the interpreter (python3)
# Needs a C compiler and the libjpeg-turbo + zlib headers
# (Debian/Ubuntu: apt-get install -y gcc libjpeg62-turbo-dev zlib1g-dev).
# If the build fails, stock Pillow stays as it was (it is removed only once Pillow-SIMD is
# built), and the script exits 1 with the reason.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VERSION_SPEC="${PILLOW_SIMD_SPEC:-pillow-simd>=9.1}"

is_simd() {  # judged from the imported module, as `packer doctor` does: pip's record can lie
  "$PYTHON" - <<'PY' 2>/dev/null
import sys
try:
    import PIL
    from PIL import _imaging
    with open(_imaging.__file__, "rb") as f:
        kernel = b"ImagingResampleHorizontalConvolution8u4x" in f.read()
    sys.exit(0 if kernel or ".post" in PIL.__version__ else 1)
except Exception:
    sys.exit(1)
PY
}

if [[ "${1:-}" == "--check" ]]; then
  if is_simd; then echo "Pillow-SIMD is active"; exit 0; fi
  echo "Pillow-SIMD is not active"; exit 1
fi

if is_simd; then
  echo "Pillow-SIMD already active: $("$PYTHON" -c 'import PIL; print(PIL.__version__)')"
  exit 0
fi

cc_flags=""
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  cc_flags="-mavx2"  # Pillow-SIMD uses AVX2 paths only when compiled for them
fi

# Built first, into a folder of its own: stock Pillow is removed only once the wheel exists,
# so a failed build (or no network) leaves the environment as it was.
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
echo "Building Pillow-SIMD from source (about a minute)..."
if ! CC="${CC:-cc} ${cc_flags}" "$PYTHON" -m pip wheel -q --no-cache-dir --no-deps \
       --no-binary pillow-simd -w "$wheels" "$VERSION_SPEC"; then
  echo "Pillow-SIMD failed to build (missing compiler or libjpeg/zlib headers, or no network?);" \
       "stock Pillow stays, untouched: packer works the same, without SIMD resizes." >&2
  exit 1
fi
echo "Replacing stock Pillow (if any) with it..."
"$PYTHON" -m pip uninstall -y -q pillow pillow-simd >/dev/null 2>&1 || true
if "$PYTHON" -m pip install -q --no-index --no-deps "$wheels"/*.whl; then
  echo "Pillow-SIMD installed: $("$PYTHON" -c 'import PIL; print(PIL.__version__)')"
  exit 0
fi
echo "Pillow-SIMD failed to install; installing stock Pillow again so packer still works." >&2
"$PYTHON" -m pip install -q "Pillow>=9.1"
exit 1
