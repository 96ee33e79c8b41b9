#!/usr/bin/env bash
# The 64-bit sums' checks and A/B on the GPU machine (docs/perf-notes.md, "Fifty-seventh" to "Fifty-ninth
# session"), from the repository root with BIN_DIR staged with the ordered combine's CUBINs
# (`VARIANT_DEFINES=ORDERED_SUMS tools/stage_gpu.sh`):
#   tools/fixed_sums_check.sh [BIN_DIR]
# The default combines a split launch's column parts as 64-bit sums (FIXED_SUMS); ORDERED_SUMS is the
# older combine in part order. Checks with the default (the E4B-wide random model reaches the split
# launches; the fixtures do not), the graph and megakernel logits byte for byte, then the decode A/B
# against ORDERED_SUMS in the same run, and one traced E4B megakernel step of each compared stage by stage.
# Logs in $OUT (default /tmp/out). QUICK=1 (a short call): the wide model's fixtures, verify and megakernel
# checks and one graph round of the A/B only; NO_AB=1: the checks only.
set -u
source "$(dirname "$0")/gpu_common.sh"
BIN=${1:-.gpu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $name"
mkdir -p /tmp/cub && tar -xJf $BIN/cubins.tar.xz -C /tmp/cub
export MEGAGEMMA_CUDA_CUBINS=/tmp/cub MEGAGEMMA_CACHE=/tmp/mgc LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib
t0=$(date +%s)
wide=/tmp/megagemma-wide
make_wide_model "$wide" || echo "make_bench_model failed"
ids=$(prompt_ids "$wide")
F=MEGAGEMMA_CUDA_DEFINES=ORDERED_SUMS
wide_checks="fixtures verify batch megakernel" checks="fixtures verify" rounds=2
[ -n "${QUICK:-}" ] && wide_checks="fixtures verify megakernel" checks="" rounds=1
for w in $wide_checks; do
  timeout 120 $BIN/gpu_check $w $wide > $OUT/fx_wide_$w.log 2>&1; echo "wide $w rc=$? ok=$(grep -c ' ok$' $OUT/fx_wide_$w.log) FAIL=$(grep -c FAIL $OUT/fx_wide_$w.log)"
  grep -v " ok$" $OUT/fx_wide_$w.log | head -5
done
for w in $checks; do
  timeout 120 $BIN/gpu_check $w > $OUT/fx_$w.log 2>&1; echo "$w rc=$? ok=$(grep -c ' ok$' $OUT/fx_$w.log) FAIL=$(grep -c FAIL $OUT/fx_$w.log)"
done
for v in ordered fixed; do for mode in graph megakernel; do
  env $([ $v = ordered ] && echo $F) $BIN/megagemma run --model $wide --quant q4 --prompt-ids "$ids" --greedy --ignore-eos -n 8 \
    --output ids --backend cuda --decode $mode --dump-logits $OUT/l_${v}_$mode.json > $OUT/ids_${v}_$mode.txt 2> $OUT/ids_${v}_$mode.err
done; done
cmp -s $OUT/l_fixed_graph.json $OUT/l_fixed_megakernel.json && echo "graph = megakernel logits: identical" || echo "graph vs megakernel: DIFFER"
cmp -s $OUT/ids_ordered_graph.txt $OUT/ids_fixed_graph.txt && echo "ids ordered = fixed" || echo "ids ordered vs fixed DIFFER"
python3 - $OUT <<'PY'
import json, sys, math
d = sys.argv[1]
a = json.load(open(f"{d}/l_ordered_graph.json")); b = json.load(open(f"{d}/l_fixed_graph.json"))
def rows(x): return x["logits"] if isinstance(x, dict) and "logits" in x else x
ra, rb = rows(a), rows(b)
try:
    num = sum((p - q) ** 2 for r1, r2 in zip(ra, rb) for p, q in zip(r1, r2)); den = sum(p * p for r in ra for p in r)
    print(f"logits rel L2 fixed vs ordered: {math.sqrt(num / den):.3e}")
except Exception as e: print("logit compare:", e)
PY
echo "checks took $(( $(date +%s) - t0 )) s"
[ -n "${NO_AB:-}" ] && exit 0
ROUNDS=$rounds MODELS="e2b e4b" DECODES="graph" TOKENS=256 timeout $(( 330 - ($(date +%s) - t0) )) tools/gpu_ab.sh $BIN fixed ordered:$F 2>&1 | tee $OUT/ab.log | grep --line-buffered -v "^fixed:\|^ordered:"
[ -n "${QUICK:-}" ] || ROUNDS=2 MODELS="e2b e4b" DECODES="megakernel" TOKENS=256 timeout $(( 480 - ($(date +%s) - t0) )) tools/gpu_ab.sh $BIN fixed ordered:$F 2>&1 | tee $OUT/ab_mk.log | grep --line-buffered -v "^fixed:\|^ordered:"
# One traced E4B megakernel step each, compared stage by stage (tools/mk_trace.py --against).
if [ -z "${QUICK:-}" ]; then
  for v in ordered fixed; do
    env $([ $v = ordered ] && echo $F) timeout 60 $BIN/megagemma bench --synthetic e4b --quant q4 --backend cuda \
      --decode megakernel --prompt-len 64 --tokens 32 --trace $OUT/trace_$v.json > $OUT/trace_$v.log 2>&1
  done
  python3 tools/mk_trace.py $OUT/trace_ordered.json --against $OUT/trace_fixed.json > $OUT/trace_compare.txt 2>&1
  sed -n '/^A: /,$p' $OUT/trace_compare.txt | head -30
fi
echo "took $(( $(date +%s) - t0 )) s"
