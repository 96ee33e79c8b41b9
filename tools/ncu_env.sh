# Sourced by the Nsight Compute tools (tools/ncu_decode.sh, ncu_step.sh, ncu_source.sh) on the GPU
# machine: the CUDA libraries, the CUBIN cache, and `$NCU`, the ncu binary (the caller exits with
# its own name when there is none).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MEGAGEMMA_CACHE=${MEGAGEMMA_CACHE:-/tmp/megagemma-cache}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "$0: ncu not found" >&2; exit 2; }
