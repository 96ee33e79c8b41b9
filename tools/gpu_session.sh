#!/usr/bin/env bash
# One GPU session's checks and benchmarks, run on the GPU machine from the repository root:
#   tools/gpu_session.sh BIN_DIR
# BIN_DIR holds the release `megagemma` binary built on the CPU machine (and, when present,
# the `gpu_check` example and the `gpu_forward` test binary): tools/stage_gpu.sh stages it, with the
# CUBINs to unpack into $MEGAGEMMA_CUDA_CUBINS. Logs go to $OUT (default /tmp/out).
#  1. GPU tests and gpu_check: stages and fixtures (also long prompts, in one prefill pass and in
#     chunks) against the CPU reference, verify columns; default kernels and CUDA-core 4-bit only;
#     several sequences in one step against each stepped alone (gpu_check batch).
#     Also a random model of E4B's widths (tools/make_bench_model.py), whose matrices reach the
#     tensor-core matvec's split paths, against the CPU backend.
#  2. The CLI on every committed fixture: --backend cuda prints the CPU backend's greedy ids,
#     with and without speculative drafting (lookup, oracle; MTP with the committed assistants,
#     also checked round by round by `gpu_check drafts`), and with the decode megakernel
#     (MoE fixtures included). compute-sanitizer (racecheck,
#     synccheck, memcheck) over a few megakernel steps of one fixture, verify passes of eight
#     tokens and batched steps. The real Gemma 3 270M GGUF
#     (when tools/ship_gguf.sh has sent it) against transformers' ids (tools/gguf_check.py).
#  3. bench --synthetic e4b/e2b (q4): decode tok/s and % of the measured bandwidth; E4B with
#     four sequences stepped together (--batch 4); E4B sampled (temperature 1, top-k 64 from the
#     device's candidates against top-k 65 from whole rows, and drawn on the device); E4B at an
#     8k context; prefill of 2048 tokens; 26B-A4B and 31B; E4B/E2B with the CUDA-core 4-bit
#     kernel only.
#  4. Serving: tools/bench_serve.py on a committed fixture with `serve --backend cuda` (1, 4, 16,
#     32 streaming clients; requests/s, TTFT p50/p99, aggregate tok/s), and tools/serve_fork_check.py
#     (n = 2 and the prefix cache, both forks on the device; graph, megakernel, MTP drafting).
# QUICK=1 keeps every check and the E4B/E2B decode benches (graph and megakernel; the E2B megakernel
# without its trace) but skips the benches that only compare (8k context, prefill, 26B-A4B/31B,
# CUDA-core kernel, serving throughput): about half the device time.
# ONLY_ON=PATTERN (e.g. H200) runs nothing unless the GPU's name contains PATTERN (exit 3): a call that
# may land on another GPU then costs only its start.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
BIN=${1:-.gpu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MEGAGEMMA_CACHE=${MEGAGEMMA_CACHE:-/tmp/megagemma-cache}
MG="$BIN/megagemma"
fail=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${ONLY_ON:-}" ] && ! grep -q -- "$ONLY_ON" "$OUT/gpu.txt"; then
  echo "gpu_session: the GPU is not an $ONLY_ON (ONLY_ON): nothing run"
  exit 3
fi

if [ -x "$BIN/gpu_forward" ]; then
  MEGAGEMMA_FIXTURES=tests/fixtures timeout 300 "$BIN/gpu_forward" --include-ignored 2>&1 | tail -20 | tee "$OUT/gpu_tests.log" || fail=1
fi
if [ -x "$BIN/gpu_check" ]; then
  # gpu_check (fixtures with long prompts, verify) with the default kernels (the tensor-core 4-bit
  # matvec on every tileable matrix) and with the CUDA-core 4-bit kernel everywhere.
  for what in fixtures verify; do
    timeout 300 "$BIN/gpu_check" $what > "$OUT/gpu_check_$what.log" 2>&1 || fail=1
    grep -v " ok$" "$OUT/gpu_check_$what.log"
    echo "gpu_check $what: $(grep -c ' ok$' "$OUT/gpu_check_$what.log") checks ok"
    MEGAGEMMA_CUDA_Q4_MMA=0 timeout 300 "$BIN/gpu_check" $what > "$OUT/gpu_check_${what}_cc.log" 2>&1 || fail=1
    grep -v " ok$" "$OUT/gpu_check_${what}_cc.log"
    echo "gpu_check $what (CUDA-core 4-bit kernel): $(grep -c ' ok$' "$OUT/gpu_check_${what}_cc.log") checks ok"
  done
fi

# The opt-in decode megakernel: every step bit-identical to the graph's, a broken schedule fails
# within a second, and both paths' decode speed.
if [ -x "$BIN/gpu_check" ]; then
  timeout 300 "$BIN/gpu_check" megakernel > "$OUT/gpu_check_megakernel.log" 2>&1 || fail=1
  grep -v " ok$" "$OUT/gpu_check_megakernel.log"
  echo "gpu_check megakernel: $(grep -c ' ok$' "$OUT/gpu_check_megakernel.log") checks ok"
fi

# The MTP drafter on CUDA against the CPU's: every round's drafts and verify argmaxes equal, and
# speculative decoding with CUDA's own drafts prints the greedy ids.
if [ -x "$BIN/gpu_check" ]; then
  timeout 300 "$BIN/gpu_check" drafts > "$OUT/gpu_check_drafts.log" 2>&1 || fail=1
  grep -v " ok$" "$OUT/gpu_check_drafts.log"
  echo "gpu_check drafts: $(grep -c ' ok$' "$OUT/gpu_check_drafts.log") checks ok"
fi

# Several sequences in one step (one weight pass per eight): every output bit-identical to the
# same sequence stepped alone.
if [ -x "$BIN/gpu_check" ]; then
  timeout 300 "$BIN/gpu_check" batch > "$OUT/gpu_check_batch.log" 2>&1 || fail=1
  grep -v " ok$" "$OUT/gpu_check_batch.log"
  echo "gpu_check batch: $(grep -c ' ok$' "$OUT/gpu_check_batch.log") checks ok"
fi

# Shapes the fixtures are too small to reach: a random 2-layer model of E4B's widths (gate/up
# 10240 × 2560, down 2560 × 10240, the PLE gate 256 × 2560), so the tensor-core matvec splits tiles over warps and the down
# projection along its columns; CUDA against the CPU backend, stored / q4 (groups of 64) / q4_0
# (groups of 32), and verify columns.
if [ -x "$BIN/gpu_check" ]; then
  wide=${TMPDIR:-/tmp}/megagemma-wide
  make_wide_model "$wide" || fail=1
  for what in fixtures verify; do
    timeout 300 "$BIN/gpu_check" $what "$wide" > "$OUT/gpu_check_wide_$what.log" 2>&1 || fail=1
    grep -v " ok$" "$OUT/gpu_check_wide_$what.log"
    echo "gpu_check $what on E4B-wide shapes: $(grep -c ' ok$' "$OUT/gpu_check_wide_$what.log") checks ok"
  done
  # How many tiles a virtual block takes (`MmaFill`, src/device.rs) moves no result: every fill
  # gives the same logits, byte for byte, in both decode paths (gate+up is spread here).
  wide_ids=$(prompt_ids "$wide")
  for mode in graph megakernel; do
    for f in 0 1 2; do
      MEGAGEMMA_CUDA_MMA_FILL=$f "$MG" run --model "$wide" --quant q4 --prompt-ids "$wide_ids" --greedy --ignore-eos \
        -n 8 --output ids --backend cuda --decode $mode --dump-logits "$OUT/fill_$f.json" > /dev/null 2>&1 || fail=1
    done
    if cmp -s "$OUT/fill_0.json" "$OUT/fill_1.json" && cmp -s "$OUT/fill_0.json" "$OUT/fill_2.json"; then r=identical; else
      r=DIFFER; fail=1; fi
    echo "logits under MEGAGEMMA_CUDA_MMA_FILL=0/1/2 on E4B-wide shapes ($mode): $r" | tee -a "$OUT/fill_bits.log"
    rm -f "$OUT"/fill_?.json
  done
fi

# CLI: CUDA ids == CPU ids on every fixture and prompt, plain and speculative.
: > "$OUT/cli_fixtures.log"
# CUDA's greedy ids for MODEL from prompt IDS against the CPU's, once per further argument (extra
# `run` flags; "" runs the defaults): one log line each.
cuda_equals_cpu() {
  local model=$1 ids=$2 cpu gpu extra r
  shift 2
  cpu=$("$MG" run --model "$model" --prompt-ids "$ids" --greedy --ignore-eos -n 24 --output ids --backend cpu 2>>"$OUT/cli_fixtures.err")
  for extra in "$@"; do
    gpu=$("$MG" run --model "$model" --prompt-ids "$ids" --greedy --ignore-eos -n 24 --output ids --backend cuda $extra 2>>"$OUT/cli_fixtures.err")
    if [ -n "$cpu" ] && [ "$cpu" = "$gpu" ]; then r=ok; else r=DIFF; fail=1; fi
    echo "$r $(basename "$model") [$ids] ${extra:-plain}" >> "$OUT/cli_fixtures.log"
  done
}
for dir in tests/fixtures/*/; do
  [ -f "$dir/expected.json" ] || continue
  for ids in $(prompt_ids "$dir" 2); do
    extras=("" "--draft lookup" "--draft oracle --acceptance 0.6 --k 4")
    extras+=("--decode megakernel" "--decode megakernel --draft lookup")
    cuda_equals_cpu "$dir" "$ids" "${extras[@]}"
  done
done
# Gemma 4 GGUF files (the fixtures written the converter's way, BF16 and Q8_0, MoE included):
# graph and megakernel.
for f in tests/fixtures-gguf/gemma4/*.gguf; do
  src=tests/fixtures/$(basename "$f" .gguf | sed 's/\..*//')
  ids=$(prompt_ids "$src")
  cuda_equals_cpu "$f" "$ids" "" "--decode megakernel"
done
# MTP drafting on CUDA (--draft mtp): the committed assistants' target, stored and q4, each
# assistant (dense and centroid head), graph and megakernel, 48 tokens (the target's sliding window
# of 8 wraps five times).
mtp_target=tests/fixtures/ple_shared_dw
for ids in $(prompt_ids "$mtp_target" 2); do
  for q in "" "--quant q4"; do
    cpu=$("$MG" run --model "$mtp_target" --prompt-ids "$ids" --greedy --ignore-eos -n 48 --output ids --backend cpu $q 2>>"$OUT/cli_fixtures.err")
    for a in dense centroid; do
      for extra in "" "--decode megakernel"; do
        gpu=$("$MG" run --model "$mtp_target" --prompt-ids "$ids" --greedy --ignore-eos -n 48 --output ids --backend cuda $q \
          --draft mtp --assistant "tests/fixtures/assistants/$a" $extra 2>>"$OUT/cli_fixtures.err")
        if [ -n "$cpu" ] && [ "$cpu" = "$gpu" ]; then r=ok; else r=DIFF; fail=1; fi
        echo "$r ple_shared_dw [$ids] --draft mtp ($a) ${q:-stored} ${extra:-graph}" >> "$OUT/cli_fixtures.log"
      done
    done
  done
done
# Sampled decoding on CUDA (top-k 40, seeded): the pipelined graph path drawing on the device
# (the default) gives the tokens of one step at a time drawn on the host (MEGAGEMMA_CUDA_DEVICE_DRAW=0)
# and of the megakernel.
for dir in tests/fixtures/ple_shared_dw tests/fixtures/gemma3; do
  ids=$(prompt_ids "$dir")
  for q in "" "--quant q4"; do
    run_sampled() { "$MG" run --model "$dir" $q --prompt-ids "$ids" --temperature 1.3 --top-k 40 --top-p 0.95 --seed 5 \
      --ignore-eos -n 40 --output ids --backend cuda "$@" 2>>"$OUT/cli_fixtures.err"; }
    a=$(run_sampled); b=$(MEGAGEMMA_CUDA_DEVICE_DRAW=0 run_sampled); c=$(run_sampled --decode megakernel)
    if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ]; then r=ok; else r=DIFF; fail=1; fi
    echo "$r $(basename "$dir") sampled ${q:-stored}: pipelined = one at a time = megakernel" >> "$OUT/cli_fixtures.log"
  done
done
# Only the differences and a count on stdout: the call's output tail is 12,000 characters, and
# the summary lines before this section must still be in it.
grep -v "^ok " "$OUT/cli_fixtures.log"
echo "CLI CUDA ids = CPU ids: $(grep -c '^ok ' "$OUT/cli_fixtures.log") runs ok, $(grep -c '^DIFF ' "$OUT/cli_fixtures.log") differ"

# The real Gemma 3 270M GGUF (Q4_K / Q6_K / Q8_0 rows), sent in pieces by tools/ship_gguf.sh: CUDA's
# greedy ids equal transformers' up to each case's first near tie, plain, with the megakernel and
# with lookup drafting.
GGUF=${REAL_GGUF:-.gpu-gguf/gemma-3-270m-q4_k_m.gguf}
if [ -f "$GGUF" ]; then
  for extra in "" "--decode megakernel" "--draft lookup"; do
    log="$OUT/gguf_check${extra// /_}.log"
    timeout 300 python3 tools/gguf_check.py --binary "$MG" --model "$GGUF" -- --backend cuda $extra > "$log" 2>&1 || fail=1
    grep -v "^ok " "$log"
  done
else
  echo "real 270M GGUF: NOT RUN ($GGUF is absent: tools/ship_gguf.sh sends it)"
fi

# The megakernel under compute-sanitizer: no races, no barrier misuse, no bad accesses — in decode
# steps (the lean entry), in verify passes of eight tokens (oracle drafts of 7, every one accepted)
# and in batched steps of three sequences (`gpu_check batch DIR`: the wide entry).
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# A wait may take longer than the megakernel's 1 s under the sanitizer: 60 s here (its own CUBINs,
# compiled once into the kernel cache, or carried: see MEGAGEMMA_CUDA_CUBINS).
# tools/stage_gpu.sh prebuilds CUBINs under SANITIZER_DEFINES too (it reads this line).
SANITIZER_DEFINES=MK_TIMEOUT_NS=60000000000ull
san_env=(env MEGAGEMMA_CUDA_DEFINES=$SANITIZER_DEFINES)
san_ids=$(prompt_ids "tests/fixtures/sliding_wrap")
san_run=("$MG" run --model tests/fixtures/sliding_wrap --quant q4 --prompt-ids "$san_ids" --greedy --ignore-eos
  --output ids --backend cuda --decode megakernel)
# One tool over one command: `sanitize TOOL NAME LABEL CMD...` logs to $OUT/sanitizer_NAME.log.
sanitize() {
  local tool=$1 name=$2 label=$3 r
  shift 3
  timeout 300 "${san_env[@]}" "$SAN" --tool "$tool" --error-exitcode 9 "$@" > "$OUT/sanitizer_$name.log" 2>&1 \
    && r=clean || { r=FAIL; fail=1; }
  echo "compute-sanitizer $tool ($label): $r ($(grep -m1 -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer_$name.log"))"
}
for tool in racecheck synccheck memcheck; do
  sanitize $tool $tool "megakernel, sliding_wrap q4" "${san_run[@]}" -n 4
  sanitize $tool wide_$tool "megakernel verify of 8, sliding_wrap q4" "${san_run[@]}" -n 9 --draft oracle --acceptance 1 --k 7
  [ -x "$BIN/gpu_check" ] && sanitize $tool batch_$tool "batched steps, graph and megakernel, sliding_wrap" \
    "$BIN/gpu_check" batch tests/fixtures/sliding_wrap
done

for m in e4b e2b; do
  timeout 300 "$MG" bench --synthetic $m --quant q4 --backend cuda --prompt-len 64 --tokens 256 2>&1 | tee "$OUT/bench_$m.log" || fail=1
  # Issue 10 asks for E2B's megakernel figure too: QUICK keeps it, without the trace.
  trace=(--trace "$OUT/trace_$m.json")
  [ -n "${QUICK:-}" ] && [ $m = e2b ] && trace=()
  timeout 300 "$MG" bench --synthetic $m --quant q4 --backend cuda --prompt-len 64 --tokens 256 --decode megakernel \
    "${trace[@]}" 2>&1 | tee "$OUT/bench_${m}_megakernel.log" || fail=1
done
timeout 300 "$MG" bench --synthetic e4b --quant q4 --backend cuda --prompt-len 64 --tokens 256 --draft oracle --acceptance 0.8 --k 3 2>&1 | tee "$OUT/bench_e4b_oracle.log" || fail=1
timeout 300 "$MG" bench --synthetic e4b --quant q4 --backend cuda --prompt-len 64 --tokens 128 --batch 4 2>&1 | tee "$OUT/bench_e4b_batch4.log" || fail=1
# Sampled decoding (temperature 1, top-p 0.95): top-k 64 draws on the device, pipelined; "host" takes
# the device's 64 candidates and draws on the host a step at a time (MEGAGEMMA_CUDA_DEVICE_DRAW=0);
# top-k 65 takes whole rows.
for k in 64 65 host; do
  env $([ $k = host ] && echo MEGAGEMMA_CUDA_DEVICE_DRAW=0) timeout 300 "$MG" bench --synthetic e4b --quant q4 \
    --backend cuda --prompt-len 64 --tokens 128 --temperature 1 --top-k ${k/host/64} 2>&1 \
    | tee "$OUT/bench_e4b_sampled_k$k.log" || fail=1
done
if [ -z "${QUICK:-}" ]; then
timeout 300 "$MG" bench --synthetic e4b --quant q4 --backend cuda --prompt-len 8000 --tokens 128 --ctx 8400 2>&1 | tee "$OUT/bench_e4b_8k.log" || fail=1
# Prefill of a 2048-token prompt (long passes on cuBLAS), and the prefill path against the matvecs
# (MEGAGEMMA_CUDA_CUBLAS=0) at a few prompt lengths.
for m in e4b e2b; do
  timeout 300 "$MG" bench --synthetic $m --quant q4 --backend cuda --prompt-len 2048 --tokens 64 2>&1 | tee "$OUT/bench_${m}_2k.log" || fail=1
done
if [ -x "$BIN/gpu_check" ]; then
  for n in 16 64 256; do
    timeout 300 "$BIN/gpu_check" prefill e4b $n | grep '^prefill' || fail=1
    MEGAGEMMA_CUDA_CUBLAS=0 timeout 300 "$BIN/gpu_check" prefill e4b $n | sed 's/^prefill/prefill (matvecs)/' | grep '^prefill' || fail=1
  done
fi
# The larger shapes (26B-A4B: MoE with routed experts; 31B dense).
for m in 26b-a4b 31b; do
  timeout 300 "$MG" bench --synthetic $m --quant q4 --backend cuda --prompt-len 64 --tokens 128 2>&1 | tee "$OUT/bench_$m.log" || fail=1
done
# The CUDA-core 4-bit kernel alone, for comparison in the same run.
for m in e4b e2b; do
  MEGAGEMMA_CUDA_Q4_MMA=0 timeout 300 "$MG" bench --synthetic $m --quant q4 --backend cuda --prompt-len 64 --tokens 256 2>&1 | tee "$OUT/bench_${m}_cuda_cores.log" || fail=1
done
fi
if [ -z "${QUICK:-}" ]; then
  timeout 300 python3 tools/bench_serve.py --binary "$MG" --model tests/fixtures/gemma3 --backend cuda \
    --max-tokens 64 --requests-per-client 8 --json "$OUT/bench_serve_fixture.json" 2>&1 | tee "$OUT/bench_serve.log" || fail=1
fi
# The server's forks on CUDA: n = 2 greedy choices equal, and the prefix cache's fork gives the same text.
timeout 300 python3 tools/serve_fork_check.py --binary "$MG" --model tests/fixtures/gemma3 --backend cuda 2>&1 \
  | grep -v '^starting' | tee "$OUT/serve_fork.log"
[ "${PIPESTATUS[0]}" = 0 ] || fail=1
# The same with the megakernel (`serve --decode megakernel`): n = 2 steps both choices in one
# batched megakernel launch.
timeout 300 python3 tools/serve_fork_check.py --binary "$MG" --model tests/fixtures/gemma3 --backend cuda \
  --serve-arg=--decode --serve-arg=megakernel 2>&1 | grep -v '^starting' | tee -a "$OUT/serve_fork.log"
[ "${PIPESTATUS[0]}" = 0 ] || fail=1
# The same with MTP drafting on the device: the lone greedy request is answered speculatively.
timeout 300 python3 tools/serve_fork_check.py --binary "$MG" --model tests/fixtures/ple_shared_dw --backend cuda \
  --serve-arg=--draft --serve-arg=mtp --serve-arg=--assistant --serve-arg=tests/fixtures/assistants/centroid 2>&1 \
  | grep -v '^starting' | tee -a "$OUT/serve_fork.log"
[ "${PIPESTATUS[0]}" = 0 ] || fail=1
# The summary again at the end (the call's output tail is 12,000 characters and the benches' tables
# push the check lines out of it): every check's count, the sanitizer, each bench's figures.
{
  grep -h "test result" "$OUT/gpu_tests.log" 2>/dev/null | sed 's/^/GPU tests: /'
  for f in "$OUT"/gpu_check_*.log; do
    [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -c ' ok$' "$f") checks ok"
  done
  [ -f "$OUT/fill_bits.log" ] && cat "$OUT/fill_bits.log"
  [ -f "$OUT/cli_fixtures.log" ] && echo "CLI CUDA ids = CPU ids: $(grep -c '^ok ' "$OUT/cli_fixtures.log") runs ok, $(grep -c '^DIFF ' "$OUT/cli_fixtures.log") differ"
  for f in "$OUT"/sanitizer_*.log; do
    [ -f "$f" ] && echo "compute-sanitizer $(basename "$f" .log | sed 's/^sanitizer_//'): $(grep -m1 -E "ERROR SUMMARY|RACECHECK SUMMARY" "$f")"
  done
  for f in "$OUT"/bench_*.log; do
    [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E '^(build|decode|achieved|verify|speculative|batch|sampled|graph path) ' "$f" | tr -s ' ' | paste -sd ';')"
  done
  echo "gpu_session: $([ $fail = 0 ] && echo all passed || echo FAILURES)"
} | tee "$OUT/summary.txt"
exit $fail
