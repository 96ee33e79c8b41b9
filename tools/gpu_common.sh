# Shell helpers the GPU-machine scripts share (sourced by tools/gpu_session.sh and tools/fixed_sums_check.sh).

# prompt_ids DIR [N]: the prompt ids of the first N (default 1) cases of DIR/expected.json, one case a
# line, comma-separated (the form `run --prompt-ids` takes).
prompt_ids() {
  python3 -c 'import json, sys
for c in json.load(open(sys.argv[1] + "/expected.json"))["cases"][:int(sys.argv[2])]:
    print(",".join(map(str, c["prompt_ids"])))' "$1" "${2:-1}"
}

# make_wide_model DIR: a random 2-layer model of E4B's widths (gate/up 10240 × 2560, down 2560 × 10240,
# the PLE gate 256 × 2560), whose matrices reach the tensor-core matvec's split tiles and column parts.
make_wide_model() {
  python3 tools/make_bench_model.py "$1" --hidden 2560 --layers 2 --heads 8 --kv-heads 2 --head-dim 256 --ple-dim 256 \
    --intermediate 10240 --vocab 4096 --cases 2 > /dev/null
}
