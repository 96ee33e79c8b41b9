#!/usr/bin/env bash
# Fetch nvcc (with cicc, ptxas and the runtime headers), cuobjdump and nvdisasm from PyPI into
# .cache/cuda-tools, so probes (tools/probes/*.cu) compile and kernels' SASS can be read on a machine
# without a GPU or toolkit. Nothing here runs a kernel: that needs the GPU machine.
# Usage: tools/fetch_cuda_tools.sh, then
#   T=.cache/cuda-tools; $T/bin/nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -I$T/include -L$T/lib \
#     -o /tmp/p tools/probes/mma_layer_shapes.cu            # compile-check a probe
#   $T/bin/cuobjdump -sass -fun megakernel_lean FILE.cubin   # SASS of a CUBIN from examples/dump_cubin
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/cuda-tools"
if [[ -x "$dest/bin/nvcc" && -x "$dest/bin/cuobjdump" && -x "$dest/bin/nvdisasm" && -d "$dest/include/cccl" ]]; then
  echo "CUDA tools already in $dest"
  exit 0
fi
mkdir -p "$dest/wheels"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dest/wheels" nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime nvidia-cuda-cuobjdump \
  nvidia-cuda-nvdisasm nvidia-cuda-cccl
# Every wheel holds nvidia/cu13/{bin,include,lib,nvvm}: merge them into one tree.
python3 - "$dest" <<'PY'
import glob, os, stat, sys, zipfile
dest = sys.argv[1]
for wheel in glob.glob(os.path.join(dest, "wheels", "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if len(parts) < 4 or parts[0] != "nvidia" or name.endswith("/"):
                continue
            out = os.path.join(dest, *parts[2:])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as f:
                f.write(src.read())
            if parts[2] in ("bin", "nvvm") and ("/bin/" in name or parts[2] == "bin"):
                os.chmod(out, os.stat(out).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
rm -rf "$dest/wheels"
echo "CUDA tools in $dest"
