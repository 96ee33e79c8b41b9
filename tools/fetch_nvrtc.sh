#!/usr/bin/env bash
# Fetch NVRTC 13.0 (the PyPI wheel nvidia-cuda-nvrtc==13.0.88) into .cache/nvrtc so the
# kernels_compile test can compile every CUDA kernel on a machine without a GPU or toolkit.
# Usage: tools/fetch_nvrtc.sh, then MEGAGEMMA_CUDA_LIB_DIR=.cache/nvrtc cargo test -p megagemma-cuda
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/nvrtc"
mkdir -p "$dest"
# One fetch at a time (test processes may start it together): the others wait, then find it done.
exec 9>"$dest/.lock"
flock 9
if [[ -f "$dest/libnvrtc.so.13" && -f "$dest/libnvrtc-builtins.so.13.0" ]]; then
  echo "NVRTC already in $dest"
  exit 0
fi
mkdir -p "$dest/wheel"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dest/wheel" nvidia-cuda-nvrtc==13.0.88
wheel="$(ls "$dest"/wheel/nvidia_cuda_nvrtc-13.0.88-*.whl | head -n1)"
python3 - "$wheel" "$dest" <<'PY'
import sys, zipfile, os
wheel, dest = sys.argv[1], sys.argv[2]
want = {"libnvrtc.so.13", "libnvrtc-builtins.so.13.0"}
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if base in want:
            with z.open(name) as src, open(os.path.join(dest, base), "wb") as out:
                out.write(src.read())
            want.discard(base)
if want:
    sys.exit(f"error: {wheel} lacks {sorted(want)}")
PY
rm -rf "$dest/wheel"
echo "NVRTC in $dest"
