#!/usr/bin/env python3
"""Real weights through the CLI: `megagemma run` on the Gemma 3 270M GGUF prints transformers' greedy ids
(tests/fixtures-gguf/gemma3-270m/expected.json, float64) up to each case's first near tie.

    tools/gguf_check.py --binary target/release/megagemma --model gemma-3-270m-q4_k_m.gguf -- --backend cuda

Everything after `--` goes to `megagemma run` (a backend, `--decode megakernel`, `--draft lookup`, ...).
Steps before the first step whose transformers top-1/top-2 margin is below the recorded threshold must
agree; the near-tie step itself may go either way. One line per case, then a summary; exit 1 on any
difference (or when fewer than 40 ids could be compared), 2 on a usage or run error.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", required=True, help="the megagemma binary")
    p.add_argument("--model", required=True, help="gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--fixture", default=str(Path(__file__).resolve().parent.parent / "tests/fixtures-gguf/gemma3-270m"))
    p.add_argument("run_args", nargs="*", help="extra `megagemma run` arguments (after --)")
    a = p.parse_args()
    expected = json.loads((Path(a.fixture) / "expected.json").read_text())
    threshold, n = expected["near_tie_margin"], expected["max_new_tokens"]
    label = " ".join(a.run_args) or "default backend"
    compared, failed = 0, 0
    for case in expected["cases"]:
        cmd = [a.binary, "run", "--model", a.model, "--prompt-ids", ",".join(map(str, case["prompt_ids"])),
               "--greedy", "--ignore-eos", "--max-new-tokens", str(n), "--output", "ids", *a.run_args]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"gguf_check: {case['name']}: megagemma run failed: {out.stderr.strip()}", file=sys.stderr)
            return 2
        got = [int(x) for x in out.stdout.strip().split(",")]
        want, margins = case["greedy_ids"], case["margins"]
        upto = next((i for i, m in enumerate(margins) if m < threshold), len(want))
        same = got[:upto] == want[:upto]
        compared += upto
        failed += not same
        first_diff = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        print(f"{'ok' if same else 'DIFF'} {case['name']:<10} {upto:>2} ids compared before the first near tie"
              f" (first difference: {'none' if first_diff is None else f'step {first_diff}'}) [{label}]")
        if not same:
            print(f"  want {want[:upto]}\n  got  {got[:upto]}")
    print(f"gguf_check [{label}]: {compared} ids compared, {failed} case(s) differ")
    return 1 if failed or compared < 40 else 0


if __name__ == "__main__":
    sys.exit(main())
