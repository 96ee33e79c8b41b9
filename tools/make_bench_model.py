#!/usr/bin/env python3
"""Write a random Gemma 4 text checkpoint (bf16): by default ~128M parameters, for CPU speed checks.

Not an oracle fixture (nothing is compared with transformers on it): it gives `megagemma run` a
model of realistic size, and with other shapes (`--hidden 2560 --intermediate 10240 ...`) a model
whose matrices are large enough for the GPU kernels' wide-matrix paths, compared against the CPU
backend by `gpu_check fixtures DIR` (`--cases N` writes an expected.json holding N prompts, no ids).
Needs numpy and safetensors. Usage: make_bench_model.py [OUT_DIR] [--layers L --hidden H ...]
"""
import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

H, L, NQ, NKV, HD, I, V, P = 768, 12, 8, 2, 96, 3072, 32768, 0  # the defaults below


def bf16(a):
    """float32 array -> bf16 bit pattern stored as uint16 (round to nearest even)."""
    b = a.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def main(out, H=H, L=L, NQ=NQ, NKV=NKV, HD=HD, I=I, V=V, P=P, cases=0):
    rng = np.random.default_rng(0)
    t = {}

    def w(name, *shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        t[name] = rng.standard_normal(shape, dtype=np.float32) * scale

    w("model.embed_tokens.weight", V, H, scale=1.0)
    t["model.norm.weight"] = np.ones(H, np.float32)
    if P:
        # Per-layer embeddings (PLE) of width P: the PLE gate is then a P × H matrix (E4B: 256 × 2560).
        w("model.embed_tokens_per_layer.weight", V, L * P, scale=1.0)
        w("model.per_layer_model_projection.weight", L * P, H)
        t["model.per_layer_projection_norm.weight"] = np.ones(P, np.float32)
    for i in range(L):
        p = f"model.layers.{i}."
        w(p + "self_attn.q_proj.weight", NQ * HD, H)
        w(p + "self_attn.k_proj.weight", NKV * HD, H)
        w(p + "self_attn.v_proj.weight", NKV * HD, H)
        w(p + "self_attn.o_proj.weight", H, NQ * HD)
        w(p + "mlp.gate_proj.weight", I, H)
        w(p + "mlp.up_proj.weight", I, H)
        w(p + "mlp.down_proj.weight", H, I)
        for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]:
            t[p + n + ".weight"] = np.ones(H, np.float32)
        t[p + "self_attn.q_norm.weight"] = np.ones(HD, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(HD, np.float32)
        t[p + "layer_scalar"] = np.ones(1, np.float32)
        if P:
            w(p + "per_layer_input_gate.weight", P, H)
            w(p + "per_layer_projection.weight", H, P)
            t[p + "post_per_layer_input_norm.weight"] = np.ones(H, np.float32)
    tensors = {k: bf16(v) for k, v in t.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors.numpy has no bf16: save as uint16 and patch the dtype in the header.
    save_file(tensors, str(out / "model.safetensors"))
    raw = (out / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for k, v in header.items():
        if k != "__metadata__":
            v["dtype"] = "BF16"
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    (out / "model.safetensors").write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])
    config = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "vocab_size": V, "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
        "num_attention_heads": NQ, "num_key_value_heads": NKV, "head_dim": HD,
        "per_layer_config": {str(i): {"head_dim": HD} for i in range(L)},
        "hidden_size_per_layer_input": P, "vocab_size_per_layer_input": V, "sliding_window": 512, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True, "eos_token_id": [1], "bos_token_id": 2, "pad_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if cases:
        prompts = [[2] + [int(x) for x in rng.integers(3, V, size=5 + 7 * c)] for c in range(cases)]
        expected = {"cases": [{"name": f"random{c}", "prompt_ids": p} for c, p in enumerate(prompts)]}
        (out / "expected.json").write_text(json.dumps(expected))
    params = sum(v.size for v in t.values())
    print(f"wrote {out} ({params / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=".cache/bench-128m")
    for flag, default in [("hidden", H), ("layers", L), ("heads", NQ), ("kv-heads", NKV), ("head-dim", HD),
                          ("intermediate", I), ("vocab", V), ("ple-dim", P), ("cases", 0)]:
        ap.add_argument(f"--{flag}", type=int, default=default)
    a = ap.parse_args()
    main(a.out, H=a.hidden, L=a.layers, NQ=a.heads, NKV=a.kv_heads, HD=a.head_dim, I=a.intermediate, V=a.vocab,
         P=a.ple_dim, cases=a.cases)
