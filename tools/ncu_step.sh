#!/usr/bin/env bash
# Nsight Compute over every launch of one decode step, on the GPU machine (docs/perf-notes.md method):
#   tools/ncu_step.sh BIN_DIR [MODEL] [COUNT]
# Runs `megagemma bench --synthetic MODEL --quant q4 --backend cuda --prompt-len 1 --tokens 4
# $BENCH_ARGS` without
# CUDA graphs (each stage its own launch, no programmatic overlap), profiles its first COUNT launches
# (default 2000) with caches left as the previous kernel left them, cuts them into passes at each
# `embed_gather` and prints the last complete pass of one token: one line per launch (kernel, grid,
# µs, MB read from DRAM) and a table per kernel (launches, µs, share, MB, TB/s). The sum is the
# step's time inside kernels; a step's measured time minus it is what launches and waits cost.
# Passes of other launch counts (verify passes, e.g. BENCH_ARGS="--draft oracle --k 2") get a table
# each too: the last pass of each count.
set -uo pipefail
BIN=${1:?usage: tools/ncu_step.sh BIN_DIR [MODEL] [COUNT]}
MODEL=${2:-e4b}
COUNT=${3:-2000}
. "$(dirname "$0")/ncu_env.sh"
csv=$(mktemp)
MEGAGEMMA_CUDA_GRAPHS=0 MEGAGEMMA_CUDA_PIPELINE=0 "$NCU" --clock-control none --cache-control none --csv \
  --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
  --launch-count "$COUNT" \
  "$BIN/megagemma" bench --synthetic "$MODEL" --quant q4 --backend cuda --prompt-len 1 --tokens 4 ${BENCH_ARGS:-} > "$csv" 2>&1
python3 - "$csv" "$(cd "$(dirname "$0")" && pwd)" <<'PY'
import collections, sys
sys.path.insert(0, sys.argv[2])
from ncu_csv import launches
seq = [(name.split("(")[0], m) for name, m in launches(sys.argv[1], "tools/ncu_step.sh")]
starts = [i for i, (n, _) in enumerate(seq) if n == "embed_gather"]
if len(starts) < 3:
    sys.exit(f"tools/ncu_step.sh: fewer than two complete passes in {len(seq)} launches")
# the last complete pass of one token, then the last pass of every other launch count
passes = [seq[a:b] for a, b in zip(starts, starts[1:])]
lengths = collections.Counter(len(p) for p in passes)
common = lengths.most_common(1)[0][0]
def table(step, lines):
    total_us = total_mb = 0.0
    by = collections.OrderedDict()
    for name, m in step:
        us = float(m.get("gpu__time_duration.sum", 0)) / 1e3
        mb = float(m.get("dram__bytes_read.sum", 0)) / 1e6
        total_us, total_mb = total_us + us, total_mb + mb
        g = by.setdefault(name, [0, 0.0, 0.0])
        g[0] += 1; g[1] += us; g[2] += mb
        if lines:
            print(f"{name[:28]:28s} grid {m.get('launch__grid_size', '?'):>5s} {us:8.2f} us {mb:8.2f} MB")
    print(f"\n{len(step)} launches in the pass (passes seen: {[len(p) for p in passes]})")
    print(f"{'kernel':28s} {'n':>4s} {'us':>9s} {'share':>6s} {'MB':>8s} {'TB/s':>5s}")
    for name, (n, us, mb) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:28]:28s} {n:4d} {us:9.1f} {100 * us / total_us:5.1f}% {mb:8.1f} {mb / us if us else 0:5.2f}")
    print(f"{'sum':28s} {len(step):4d} {total_us:9.1f} {100.0:5.1f}% {total_mb:8.1f} {total_mb / total_us:5.2f}")
table([p for p in passes if len(p) == common][-1], True)
for n in sorted(lengths):
    if n != common:
        print(f"\n=== the last pass of {n} launches")
        table([p for p in passes if len(p) == n][-1], False)
PY
rm -f "$csv"
