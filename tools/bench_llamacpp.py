#!/usr/bin/env python3
"""Decode speed of llama.cpp (through llama-cpp-python) on a GGUF file, for side-by-side
comparison with `megagemma run` in BENCHMARKS.md.

Usage: bench_llamacpp.py MODEL.gguf PROMPT_IDS(comma-separated) NEW_TOKENS THREADS
Prints one JSON line: {"decode_tokens_per_second": ..., "prefill_tokens_per_second": ..., "ids": [...]}.
"""
import json
import sys
import time

from llama_cpp import Llama


def main(model, prompt_ids, n, threads):
    ids = [int(x) for x in prompt_ids.split(",")]
    n, threads = int(n), int(threads)
    llm = Llama(model_path=model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    out = []
    tok = None
    for i in range(n):
        tok = llm.sample(temp=0.0, top_k=1)
        out.append(int(tok))
        if i + 1 < n:
            llm.eval([tok])
    t2 = time.perf_counter()
    print(json.dumps({
        "prefill_tokens_per_second": len(ids) / (t1 - t0),
        "decode_tokens_per_second": (n - 1) / (t2 - t1),
        "ids": out,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:5])
