#!/usr/bin/env bash
# A/B decode benchmarks on the GPU machine, every variant in one run (docs/perf-notes.md method:
# change one thing, measure it against the baseline in the same machine session):
#   tools/gpu_ab.sh BIN_DIR VARIANT...
# A VARIANT is `label` or `label:ENV=VAL[,ENV=VAL...]`; `label@DIR` runs DIR/megagemma instead of
# BIN_DIR's (two builds side by side), e.g.
#   tools/gpu_ab.sh .gpu base waves3:MEGAGEMMA_CUDA_MMA_WAVES=3 att16:MEGAGEMMA_CUDA_ATT_SPLIT_KEYS=16 \
#     k64:MEGAGEMMA_KERNELS=.gpu/k/variant main@.gpu/main
# Each (round, model, decode mode, variant) runs `megagemma bench --synthetic MODEL --quant q4
# --backend cuda --prompt-len 64 --tokens TOKENS --decode MODE` (TOKENS default 128) and prints one line. MODELS (default
# "e4b"), DECODES (default "graph megakernel") and ROUNDS (default 2) choose the grid; variants
# alternate within each round. BENCH_ARGS adds bench arguments to every run (e.g. "--batch 4" or
# "--draft oracle --acceptance 0.8 --k 2", "--temperature 1"); their batch, verify, speculative and sampled lines are kept. A kernel variant compiles on first use (NVRTC: over a minute for
# megakernel.cu on a cold cache), hence the generous per-run timeout.
set -uo pipefail
BIN=${1:?usage: tools/gpu_ab.sh BIN_DIR VARIANT...}
shift
[ $# -gt 0 ] || { echo "tools/gpu_ab.sh: no variants given" >&2; exit 2; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MEGAGEMMA_CACHE=${MEGAGEMMA_CACHE:-/tmp/megagemma-cache}
# A variant's label, binary folder and environment (label[@DIR][:ENV=VAL,...]).
parse_variant() {
  label=${1%%:*}
  bin=$BIN
  if [[ $label == *@* ]]; then bin=${label#*@}; label=${label%%@*}; fi
  envs=()
  if [[ $1 == *:* ]]; then IFS=, read -r -a envs <<< "${1#*:}"; fi
}
# Which code each binary is (a stale binary is the costliest mistake on a metered machine).
for variant in "$@"; do
  parse_variant "$variant"
  echo "${variant%%:*}: $("$bin/megagemma" --version 2>&1)"
done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for model in ${MODELS:-e4b}; do
    for mode in ${DECODES:-graph megakernel}; do
      for variant in "$@"; do
        parse_variant "$variant"
        line=$(env "${envs[@]}" timeout 240 "$bin/megagemma" bench --synthetic "$model" --quant q4 --backend cuda \
          --prompt-len 64 --tokens "${TOKENS:-128}" --decode "$mode" ${BENCH_ARGS:-} 2>&1 \
          | grep -E '^decode|^launches|^batch|^verify|^speculative|^sampled|rror' | tr -s ' ' | tr '\n' ' ')
        printf 'round %s %-4s %-10s %-12s %s\n' "$round" "$model" "$mode" "$label" "${line:-no output (timed out?)}"
      done
    done
  done
done
