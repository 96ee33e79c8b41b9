#!/usr/bin/env bash
# Side-by-side CPU speed: megagemma vs llama.cpp's own C++ `llama-bench`, on the same GGUF file and
# thread count, runs alternating. Reports decode (tg128) and prefill (pp512, pp2048) medians and the
# ratios megagemma/llama.cpp.
#
# Usage: tools/bench_cpu_vs_llamacpp.sh MODEL.gguf [THREADS=2] [RUNS=3]
#   MEGAGEMMA    megagemma binary (default target/release/megagemma; `cargo build --release`)
#   LLAMA_BENCH  an existing llama-bench binary; default .cache/llama-bench/build/bin/llama-bench,
#                built on first use from the llama.cpp source vendored in the llama-cpp-python sdist
#                (pinned version and sha256 below), CPU flags as BENCHMARKS.md records (AMX off)
#   JOBS         parallel compile jobs for that build (default 2)
#   PROMPTS      prefill lengths (default "512 2048"); TG decode tokens (default 128)
# Needs python3, a C/C++ compiler, make, curl (or python3's urllib) for the first build; cmake is
# installed with pip into .cache/llama-bench/cmake-venv when not on PATH.
set -euo pipefail

die() { echo "bench_cpu_vs_llamacpp: $*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: $0 MODEL.gguf [THREADS=2] [RUNS=3]"
model=$1; threads=${2:-2}; runs=${3:-3}
prompts=${PROMPTS:-512 2048}; tg=${TG:-128}; jobs=${JOBS:-2}
[ -f "$model" ] || die "model file not found: $model"
[[ $threads =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive integer, got '$threads'"
[[ $runs =~ ^[1-9][0-9]*$ ]] || die "RUNS must be a positive integer, got '$runs'"
[[ $tg =~ ^[1-9][0-9]*$ ]] || die "TG must be a positive integer, got '$tg'"
for p in $prompts; do [[ $p =~ ^[1-9][0-9]*$ ]] || die "PROMPTS must be positive integers, got '$p'"; done
[ -n "${prompts// /}" ] || die "PROMPTS is empty"
command -v python3 >/dev/null || die "python3 not found"

root=$(cd "$(dirname "$0")/.." && pwd)
mg=${MEGAGEMMA:-$root/target/release/megagemma}
[ -x "$mg" ] || die "megagemma binary not found at $mg (run: cargo build --release)"

# ---- llama-bench: built once from the llama-cpp-python sdist's vendored llama.cpp ----
LCP_VERSION=0.3.36
LCP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LCP_URL=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-$LCP_VERSION.tar.gz
# The flag set BENCHMARKS.md records; a flag whose instructions this CPU lacks (per /proc/cpuinfo) is
# turned OFF, since its code would die with SIGILL (e.g. AVX-VNNI on the AVX-512 AMD EPYC host of the dev VM).
# GGML option -> /proc/cpuinfo flags it needs.
FLAG_NEEDS=("AVX:avx" "AVX2:avx2" "FMA:fma" "F16C:f16c" "BMI2:bmi2"
  "AVX512:avx512f avx512cd avx512vl avx512dq avx512bw" "AVX512_VNNI:avx512_vnni" "AVX512_VBMI:avx512vbmi"
  "AVX512_BF16:avx512_bf16" "AVX_VNNI:avx_vnni")
CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
cpu_has=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
for entry in "${FLAG_NEEDS[@]}"; do
  opt=${entry%%:*}; val=ON
  if [ "$cpu_has" != "  " ]; then
    for f in ${entry#*:}; do [[ $cpu_has == *" $f "* ]] || val=OFF; done
  fi
  CPU_FLAGS+=("-DGGML_$opt=$val")
done
cache=$root/.cache/llama-bench
flags_stamp=$cache/build/megagemma-cpu-flags.txt

build_llama_bench() {
  local sdist=$cache/llama_cpp_python-$LCP_VERSION.tar.gz src=$cache/llama.cpp-$LCP_VERSION
  mkdir -p "$cache"
  if [ ! -f "$sdist" ] || [ "$(sha256sum "$sdist" | cut -d' ' -f1)" != "$LCP_SHA256" ]; then
    echo "downloading llama-cpp-python $LCP_VERSION sdist" >&2
    rm -f "$sdist.part"
    if command -v curl >/dev/null; then
      curl -fsSL -o "$sdist.part" "$LCP_URL" || die "download failed: $LCP_URL"
    else
      python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
        "$LCP_URL" "$sdist.part" 2>/dev/null || die "download failed: $LCP_URL"
    fi
    local got; got=$(sha256sum "$sdist.part" | cut -d' ' -f1)
    [ "$got" = "$LCP_SHA256" ] || { rm -f "$sdist.part"; die "sha256 mismatch for the sdist: got $got, want $LCP_SHA256"; }
    mv "$sdist.part" "$sdist"
  fi
  if [ ! -f "$src/CMakeLists.txt" ]; then
    rm -rf "$src" && mkdir -p "$src"
    tar -xzf "$sdist" -C "$src" --strip-components=3 "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" \
      || die "cannot extract vendor/llama.cpp from $sdist"
  fi
  local cmake=cmake
  if ! command -v cmake >/dev/null; then
    cmake=$cache/cmake-venv/bin/cmake
    if [ ! -x "$cmake" ]; then
      echo "installing cmake with pip into $cache/cmake-venv" >&2
      { python3 -m venv "$cache/cmake-venv" && "$cache/cmake-venv/bin/pip" install -q cmake; } >&2 \
        || die "cmake not found and 'pip install cmake' failed"
    fi
  fi
  command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler (c++/g++) found"
  echo "building llama-bench (llama.cpp from llama-cpp-python $LCP_VERSION, -j$jobs); this takes a while" >&2
  echo "CPU flags: ${CPU_FLAGS[*]}" >&2
  "$cmake" -S "$src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "${CPU_FLAGS[@]}" >"$cache/configure.log" 2>&1 \
    || die "cmake configure failed, see $cache/configure.log"
  "$cmake" --build "$cache/build" --target llama-bench -j "$jobs" >"$cache/build.log" 2>&1 \
    || die "llama-bench build failed, see $cache/build.log"
  [ -x "$cache/build/bin/llama-bench" ] || die "build finished but $cache/build/bin/llama-bench is missing"
  echo "${CPU_FLAGS[*]}" >"$flags_stamp"
}

if [ -n "${LLAMA_BENCH:-}" ]; then
  lb=$LLAMA_BENCH
  [ -x "$lb" ] || die "LLAMA_BENCH=$LLAMA_BENCH is not an executable"
else
  lb=$cache/build/bin/llama-bench
  # (Re)build when missing or built with other CPU flags (e.g. the VM moved to another CPU).
  if [ ! -x "$lb" ] || [ "$(cat "$flags_stamp" 2>/dev/null)" != "${CPU_FLAGS[*]}" ]; then
    build_llama_bench
  fi
fi
[ "${BUILD_ONLY:-0}" = 1 ] && { echo "llama-bench: $lb"; exit 0; }

# ---- alternating runs ----
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
res=$tmp/results.jsonl; : >"$res"
pp_csv=$(echo "$prompts" | tr ' ' ',')

# megagemma bench: one process per test; prints its JSON line last.
mg_test() { # NAME PROMPT_LEN TOKENS FIELD RUN
  if "$mg" bench --model "$model" --backend cpu -t "$threads" --prompt-len "$2" --tokens "$3" \
      >"$tmp/mg.out" 2>"$tmp/mg.err"; then
    python3 - "$tmp/mg.out" "$1" "$4" "$5" >>"$res" <<'PY'
import json, sys
out, name, field, run = sys.argv[1:]
line = [l for l in open(out) if l.startswith("{")][-1]
print(json.dumps({"engine": "megagemma", "test": name, "run": int(run), "tok_s": json.loads(line)[field]}))
PY
  else
    python3 - "$tmp/mg.err" "$1" "$5" >>"$res" <<'PY'
import json, sys
err, name, run = sys.argv[1:]
lines = [l.strip() for l in open(err, errors="replace") if l.strip()]
# A panic: its location and message; otherwise megagemma's own (last) error line.
i = next((i for i, l in enumerate(lines) if " panicked at " in l), None)
msg = ("panic at " + lines[i].split(" panicked at ", 1)[1] + " " + lines[i + 1]) if i is not None and i + 1 < len(lines) \
    else (lines[-1] if lines else "exited with an error and no message")
print(json.dumps({"engine": "megagemma", "test": name, "run": int(run), "error": msg}))
PY
  fi
}

lb_tests() { # RUN
  local rc=0
  "$lb" -m "$model" -t "$threads" -p "$pp_csv" -n "$tg" -r 1 -o json >"$tmp/lb.out" 2>"$tmp/lb.err" || rc=$?
  [ "$rc" != 132 ] || die "llama-bench died with SIGILL: built for another CPU (remove $cache/build to rebuild)"
  [ "$rc" = 0 ] || die "llama-bench failed (exit $rc): $(grep -v '^\s*$' "$tmp/lb.err" | tail -1)"
  python3 - "$tmp/lb.out" "$1" >>"$res" <<'PY' || die "cannot parse llama-bench's JSON output"
import json, sys
for r in json.load(open(sys.argv[1])):
    name = f"tg{r['n_gen']}" if r["n_gen"] else f"pp{r['n_prompt']}"
    print(json.dumps({"engine": "llama.cpp", "test": name, "run": int(sys.argv[2]), "tok_s": r["avg_ts"],
                      "build": r.get("build_commit"), "cpu": r.get("cpu_info")}))
PY
}

mg_all() { # RUN
  mg_test "tg$tg" 1 "$tg" decode_tok_s "$1"
  for p in $prompts; do mg_test "pp$p" "$p" 1 prefill_tok_s "$1"; done
}

echo "model $model, $threads threads, $runs alternating runs; megagemma $mg; llama-bench $lb"
# CPU the rest of the machine used during a run, in cores: busy time from /proc/stat minus the CPU
# time of this script's finished children (both engines run as direct children).
cpu_mark() { python3 -c '
import sys
cpu = open("/proc/stat").readline().split()[1:]
busy = sum(map(int, cpu)) - int(cpu[3]) - int(cpu[4])   # all but idle and iowait
f = open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")", 1)[1].split()
print(busy, int(f[13]) + int(f[14]))                     # cutime + cstime of this shell
' "$$" 2>/dev/null || echo "0 0"; }
hz=$(getconf CLK_TCK 2>/dev/null || echo 100)

echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$runs"); do
  read -r busy0 own0 < <(cpu_mark); t0=$(date +%s.%N)
  if [ $((r % 2)) = 1 ]; then mg_all "$r"; lb_tests "$r"; else lb_tests "$r"; mg_all "$r"; fi
  read -r busy1 own1 < <(cpu_mark); t1=$(date +%s.%N)
  python3 - "$res" "$r" "$busy0" "$own0" "$busy1" "$own1" "$t0" "$t1" "$hz" <<'PY'
import json, sys
res, run = sys.argv[1], int(sys.argv[2])
b0, o0, b1, o1 = map(int, sys.argv[3:7]); t0, t1, hz = map(float, sys.argv[7:10])
others = max(0.0, ((b1 - b0) - (o1 - o0)) / hz / (t1 - t0)) if b1 else None
rows = [json.loads(l) for l in open(res)]
fmt = lambda e: "  ".join(f"{x['test']} {x['tok_s']:.1f}" if "tok_s" in x else f"{x['test']} n/a"
                          for x in rows if x["engine"] == e and x["run"] == run)
busy = "" if others is None else f"; other processes used {others:.2f} cores"
print(f"run {run} (tok/s): megagemma {fmt('megagemma')} | llama.cpp {fmt('llama.cpp')}{busy}")
with open(res, "a") as f:
    f.write(json.dumps({"engine": "machine", "run": run, "others_cores": others}) + "\n")
PY
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$res" "$tg" "$prompts" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tests = [f"tg{sys.argv[2]}"] + [f"pp{p}" for p in sys.argv[3].split()]
# Medians over the quiet runs (the rest of the machine used < QUIET cores) when there are 3 or more.
QUIET = 0.25
load = {r["run"]: r["others_cores"] for r in rows if r["engine"] == "machine"}
quiet = {run for run, c in load.items() if c is not None and c < QUIET}
use = quiet if len(quiet) >= 3 else set(load)
if use == quiet:
    print(f"medians over the {len(quiet)} quiet runs (other processes < {QUIET} cores): {sorted(quiet)}")
else:
    print(f"medians over all {len(load)} runs: the machine was busy, only {len(quiet)} quiet runs "
          f"(other processes < {QUIET} cores)")
def med(engine, test):
    v = [r["tok_s"] for r in rows if r["engine"] == engine and r.get("test") == test and "tok_s" in r
         and r["run"] in use]
    return (statistics.median(v), len(v)) if v else (None, 0)
print(f"{'median tok/s':<14}{'megagemma':>11}{'llama.cpp':>11}{'ratio':>8}")
summary = {}
for t in tests:
    (m, nm), (l, nl) = med("megagemma", t), med("llama.cpp", t)
    ratio = m / l if m is not None and l else None
    f = lambda x, d=1: f"{x:.{d}f}" if x is not None else "n/a"
    print(f"{t:<14}{f(m):>11}{f(l):>11}{f(ratio, 2):>8}   (runs: {nm} / {nl})")
    summary[t] = {"megagemma": m, "llama_cpp": l, "ratio": ratio}
for msg in dict.fromkeys(f"megagemma {r['test']} not measured: {r['error']}" for r in rows if "error" in r):
    print(msg)
cpu = next((r.get("cpu") for r in rows if r["engine"] == "llama.cpp"), None)
print(json.dumps({"tests": summary, "runs_used": sorted(use), "others_cores": load, "llama_cpp_cpu": cpu}))
PY
