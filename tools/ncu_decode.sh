#!/usr/bin/env bash
# Nsight Compute over the decode matvecs of one token, on the GPU machine (docs/perf-notes.md method):
#   tools/ncu_decode.sh BIN_DIR [MODEL] [SKIP] [COUNT]
# Runs `megagemma bench --synthetic MODEL --quant q4 --backend cuda --prompt-len 1 --tokens 4` without
# CUDA graphs (each stage its own launch), skips the first SKIP tensor-core matvec launches (default
# 300: the one-token prompt and the first decode step) and profiles the next COUNT (default 260,
# about one E4B token: six a layer and the LM head), caches flushed between kernels as for cold
# weights. Prints one line per launch (kernel, grid, µs, MB read from DRAM, TB/s) and the sum. Extra
# environment (knobs, MEGAGEMMA_KERNELS) passes through.
set -uo pipefail
BIN=${1:?usage: tools/ncu_decode.sh BIN_DIR [MODEL] [SKIP] [COUNT]}
MODEL=${2:-e4b}
SKIP=${3:-300}
COUNT=${4:-260}
. "$(dirname "$0")/ncu_env.sh"
csv=$(mktemp)
MEGAGEMMA_CUDA_GRAPHS=0 "$NCU" --clock-control none --csv --print-units base \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
  --kernel-name regex:matvec_q4t --launch-skip "$SKIP" --launch-count "$COUNT" \
  "$BIN/megagemma" bench --synthetic "$MODEL" --quant q4 --backend cuda --prompt-len 1 --tokens 4 > "$csv" 2>&1
python3 - "$csv" "$(cd "$(dirname "$0")" && pwd)" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
from ncu_csv import launches
launches = launches(sys.argv[1], "tools/ncu_decode.sh")
total_us = total_mb = 0.0
for name, m in launches:
    us = float(m.get("gpu__time_duration.sum", 0)) / 1e3
    mb = float(m.get("dram__bytes_read.sum", 0)) / 1e6
    total_us, total_mb = total_us + us, total_mb + mb
    print(f"{name[:24]:24s} grid {m.get('launch__grid_size', '?'):>5s} {us:8.2f} us {mb:8.2f} MB {mb / us if us else 0:5.2f} TB/s")
print(f"{len(launches)} launches: {total_us:.1f} us, {total_mb:.1f} MB ({total_mb / total_us if total_us else 0:.2f} TB/s)")
PY
rm -f "$csv"
