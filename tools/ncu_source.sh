#!/usr/bin/env bash
# Per-source-line instruction counts of the decode matvecs, on the GPU machine (docs/perf-notes.md,
# fourteenth session):
#   tools/ncu_source.sh BIN_DIR OUT_DIR [MODEL] [SKIP] [COUNT]
# Runs `megagemma bench --synthetic MODEL --quant q4 --backend cuda --prompt-len 1 --tokens 4`
# without CUDA graphs under Nsight Compute's SourceCounters, skipping SKIP tensor-core matvec
# launches (default 300: into the second decode step) and profiling the next COUNT (default 6: one
# E4B layer's down, PLE gate, PLE projection, Q/K/V, O and gate+up, in that order), then writes to
# OUT_DIR: the report, its per-instruction CSV, the kernel CUBINs it ran and `lines.txt`
# (`tools/ncu_lines.py`: by call site, by source line, the fixed path). Extra environment
# (MEGAGEMMA_KERNELS, MEGAGEMMA_CUDA_DEFINES, knobs) passes through; the kernel sources for the
# line numbers are $MEGAGEMMA_KERNELS's when set, else the repository's. KERNEL (a regex, default
# `matvec_q4t`) picks other kernels, e.g. `KERNEL=attention tools/ncu_source.sh .gpu OUT e4b 84 2`.
set -uo pipefail
BIN=${1:?usage: tools/ncu_source.sh BIN_DIR OUT_DIR [MODEL] [SKIP] [COUNT]}
OUT=${2:?usage: tools/ncu_source.sh BIN_DIR OUT_DIR [MODEL] [SKIP] [COUNT]}
MODEL=${3:-e4b}
SKIP=${4:-300}
COUNT=${5:-6}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$(dirname "$0")/ncu_env.sh"
export NVDISASM=${NVDISASM:-$(command -v nvdisasm || ls /usr/local/cuda*/bin/nvdisasm 2>/dev/null | head -1)}
mkdir -p "$OUT/cubins"
MEGAGEMMA_CUDA_GRAPHS=0 "$NCU" --clock-control none --set none --section SourceCounters --section WarpStateStats \
  --kernel-name "regex:${KERNEL:-matvec_q4t}" --launch-skip "$SKIP" --launch-count "$COUNT" -f -o "$OUT/source" \
  "$BIN/megagemma" bench --synthetic "$MODEL" --quant q4 --backend cuda --prompt-len 1 --tokens 4 > "$OUT/ncu.log" 2>&1 \
  || { tail -20 "$OUT/ncu.log" >&2; exit 1; }
"$NCU" -i "$OUT/source.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" || exit 1
cp "$MEGAGEMMA_CACHE"/kernels/*.cubin "$OUT/cubins/"
kernels=()
[ -n "${MEGAGEMMA_KERNELS:-}" ] && kernels=(--kernels "$MEGAGEMMA_KERNELS")
python3 "$HERE/ncu_lines.py" "$OUT/sass.csv" "$OUT/cubins" "${kernels[@]}" > "$OUT/lines.txt"
grep -E "^(===|[a-z_0-9]+: )" "$OUT/lines.txt"
