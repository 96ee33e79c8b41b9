#!/usr/bin/env bash
# Fuzz one target for SECONDS with one worker process (nightly + cargo-fuzz):
#   bash fuzz/run.sh gguf 600
# Builds the target (skip with FUZZ_NO_BUILD=1 to keep fuzzing an earlier build), then runs it on
# the ignored fuzz/corpus/TARGET plus the committed seeds in fuzz/seeds/TARGET (read only). A
# crash, an input taking > 10 s or an allocation > 2 GB stops the run and is saved under
# fuzz/artifacts/TARGET/. fuzz/TARGET.log ends with the exec count (stat::number_of_executed_units).
set -euo pipefail
target="$1"
seconds="${2:-600}"
cd "$(dirname "$0")"
if [[ "${FUZZ_NO_BUILD:-0}" != 1 ]]; then
    cargo +nightly fuzz build "$target"
fi
mkdir -p "corpus/$target" "artifacts/$target"
rm -f fuzz-0.log
status=0
# -jobs=1 -workers=1: one worker process (libFuzzer writes its output to fuzz-0.log).
"target/x86_64-unknown-linux-gnu/release/$target" "corpus/$target" "seeds/$target" \
    -jobs=1 -workers=1 -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="artifacts/$target/" >/dev/null 2>&1 || status=$?
mv fuzz-0.log "$target.log"
exit "$status"
