#!/usr/bin/env bash
# Stages the folder that a GPU call carries (default .gpu), on this machine, without a GPU:
#   tools/stage_gpu.sh [DIR]
# Builds the release `megagemma`, the `gpu_check` example and the `gpu_forward` test binary (stripped
# copies in DIR; `megagemma --version` names the commit), and DIR/cubins.tar.xz: NVRTC's CUBINs of
# the embedded kernels (the `prebuild_cubins` example) with the default options and with
# tools/gpu_session.sh's SANITIZER_DEFINES, so neither the checks nor the sanitizer compile a kernel
# on the GPU machine (a cold megakernel compile there costs minutes of device time). Run scripts and
# kernel variants already in DIR are kept. VARIANT_DEFINES="LIST …" (space-separated; each a
# MEGAGEMMA_CUDA_DEFINES list, items joined by `;`, e.g. "ORDERED_SUMS ORDERED_SUMS;MK_MARK=1") packs
# those defines' CUBINs too, so a call's A/B of them compiles nothing. On the GPU machine:
#   mkdir -p /tmp/cub && tar -xJf DIR/cubins.tar.xz -C /tmp/cub && export MEGAGEMMA_CUDA_CUBINS=/tmp/cub
# About 3–8 minutes on two cores (each CUBIN set ~2–3 of them).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu}
mkdir -p "$DIR"
tools/fetch_nvrtc.sh > /dev/null
export MEGAGEMMA_CUDA_LIB_DIR=$PWD/.cache/nvrtc
unset MEGAGEMMA_KERNELS MEGAGEMMA_CUDA_DEFINES  # the embedded kernels, default options
cargo build --release -p megagemma -p megagemma-cuda --examples --bin megagemma
# The test binary's path from cargo's own record of it (not its human-readable progress lines).
test_bin=$(cargo test --release -p megagemma-cuda --test gpu_forward --no-run --message-format=json \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("target", {}).get("name") == "gpu_forward" and m.get("executable"):
        print(m["executable"])')
[ -x "$test_bin" ] || { echo "tools/stage_gpu.sh: no gpu_forward test binary built" >&2; exit 1; }
cp target/release/megagemma target/release/examples/gpu_check "$DIR/"
cp "$test_bin" "$DIR/gpu_forward"
strip "$DIR/megagemma" "$DIR/gpu_check" "$DIR/gpu_forward"
san_defines=$(sed -n 's/^SANITIZER_DEFINES=//p' tools/gpu_session.sh)
[ -n "$san_defines" ] || { echo "tools/stage_gpu.sh: no SANITIZER_DEFINES in tools/gpu_session.sh" >&2; exit 1; }
cubins=$(mktemp -d)
trap 'rm -rf "$cubins"' EXIT
target/release/examples/prebuild_cubins "$cubins"
MEGAGEMMA_CUDA_DEFINES=$san_defines target/release/examples/prebuild_cubins "$cubins"
for defines in ${VARIANT_DEFINES:-}; do
  MEGAGEMMA_CUDA_DEFINES=$defines target/release/examples/prebuild_cubins "$cubins"
done
tar -cJf "$DIR/cubins.tar.xz" -C "$cubins" .
echo "$DIR: $("$DIR/megagemma" --version), $(ls "$cubins" | wc -l) CUBINs ($(du -h "$DIR/cubins.tar.xz" | cut -f1) packed)"
