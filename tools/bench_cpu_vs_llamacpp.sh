#!/usr/bin/env bash
# Side-by-side CPU decode speed: megagemma vs llama.cpp (llama-cpp-python) on the same GGUF,
# same prompt ids, same thread count, alternating runs. Prints one line per run and the medians.
# Usage: tools/bench_cpu_vs_llamacpp.sh MODEL.gguf [THREADS=2] [NEW_TOKENS=128] [RUNS=3]
# Needs: target/release/megagemma (cargo build --release) and a Python with llama-cpp-python
# (LLAMACPP_PYTHON, default .cache/llamacpp-venv/bin/python; see BENCHMARKS.md for the build flags).
set -euo pipefail
model=$1; threads=${2:-2}; n=${3:-128}; runs=${4:-3}
py=${LLAMACPP_PYTHON:-.cache/llamacpp-venv/bin/python}
ids=2,818,5279,529,7001,563   # "<bos>The capital of France is" (official Gemma tokenizer)
mg=(); lc=()
for r in $(seq "$runs"); do
  m=$(./target/release/megagemma run --model "$model" --prompt-ids "$ids" --greedy --ignore-eos -n "$n" --output json -t "$threads" 2>/dev/null \
      | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["tokens_per_second"], 2))')
  l=$("$py" tools/bench_llamacpp.py "$model" "$ids" "$n" "$threads" 2>/dev/null \
      | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["decode_tokens_per_second"], 2))')
  echo "run $r: megagemma $m tok/s, llama.cpp $l tok/s"
  mg+=("$m"); lc+=("$l")
done
python3 - "${mg[*]}" "${lc[*]}" <<'PY'
import statistics, sys
mg = [float(x) for x in sys.argv[1].split()]; lc = [float(x) for x in sys.argv[2].split()]
m, l = statistics.median(mg), statistics.median(lc)
print(f"median: megagemma {m:.1f} tok/s, llama.cpp {l:.1f} tok/s, ratio {m / l:.2f}")
PY
