#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora (fuzz/seeds/TARGET/*) from the committed fixtures.

Multi-part inputs join their parts with a NUL byte (JSON never contains a raw one):
  config     config.json NUL generation_config.json NUL tokenizer_config.json
  safetensors  safetensors JSON header [NUL model.safetensors.index.json]
  load_dir   config.json NUL safetensors JSON header (the harness fills the data with zeros)
  gguf       a whole GGUF file: a Gemma 3 layout shrunk to a few KB, with a small vocabulary
Standard library only; deterministic.
"""
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fuzz" / "seeds"


def fixture_dirs():
    dirs = sorted(p for p in (ROOT / "tests" / "fixtures").iterdir() if (p / "config.json").exists())
    return dirs + [ROOT / "models" / "demo"]


def safetensors_header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n]


def read(path):
    return path.read_bytes() if path.exists() else b""


def write(target, name, data):
    d = SEEDS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, ty, value):
    out = gguf_string(key) + struct.pack("<I", ty)
    if ty == 4:
        return out + struct.pack("<I", value)
    if ty == 5:
        return out + struct.pack("<i", value)
    if ty == 6:
        return out + struct.pack("<f", value)
    if ty == 8:
        return out + gguf_string(value)
    raise ValueError(ty)


def gguf_array(key, elem_ty, values):
    out = gguf_string(key) + struct.pack("<I", 9) + struct.pack("<IQ", elem_ty, len(values))
    for v in values:
        if elem_ty == 8:
            out += gguf_string(v)
        elif elem_ty == 6:
            out += struct.pack("<f", v)
        elif elem_ty == 5:
            out += struct.pack("<i", v)
    return out


def tiny_gguf():
    """Gemma 3 as llama.cpp writes it (F32 tensors), with the gemma3 fixture's layout shrunk."""
    cfg = json.loads((ROOT / "tests" / "fixtures" / "gemma3" / "config.json").read_text())
    h, heads, kv, hd, inter, layers = 16, 2, 1, 8, 16, 2
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + ["\u2581" + c for c in "abcdefghijklmnop"] + list("abcdefghijkl")
    types = [3, 3, 3, 2] + [1] * (len(tokens) - 4)
    vocab = len(tokens)
    kvs = [
        gguf_kv("general.architecture", 8, "gemma3"),
        gguf_kv("gemma3.embedding_length", 4, h),
        gguf_kv("gemma3.block_count", 4, layers),
        gguf_kv("gemma3.feed_forward_length", 4, inter),
        gguf_kv("gemma3.attention.head_count", 4, heads),
        gguf_kv("gemma3.attention.head_count_kv", 4, kv),
        gguf_kv("gemma3.attention.key_length", 4, hd),
        gguf_kv("gemma3.attention.value_length", 4, hd),
        gguf_kv("gemma3.attention.sliding_window", 4, cfg["sliding_window"]),
        gguf_kv("gemma3.rope.freq_base", 6, 1e6),
        gguf_kv("gemma3.attention.layer_norm_rms_epsilon", 6, cfg["rms_norm_eps"]),
        gguf_kv("tokenizer.ggml.model", 8, "llama"),
        gguf_array("tokenizer.ggml.tokens", 8, tokens),
        gguf_array("tokenizer.ggml.scores", 6, [-float(i) for i in range(vocab)]),
        gguf_array("tokenizer.ggml.token_type", 5, types),
        gguf_kv("tokenizer.ggml.bos_token_id", 4, cfg["bos_token_id"]),
        gguf_kv("tokenizer.ggml.eos_token_id", 4, cfg["eos_token_id"]),
        gguf_kv("tokenizer.ggml.padding_token_id", 4, cfg["pad_token_id"]),
        gguf_kv("tokenizer.ggml.unknown_token_id", 4, 3),
    ]
    tensors = [("token_embd.weight", [h, vocab]), ("output_norm.weight", [h])]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", [h]),
            (b + "attn_q.weight", [h, heads * hd]),
            (b + "attn_k.weight", [h, kv * hd]),
            (b + "attn_v.weight", [h, kv * hd]),
            (b + "attn_output.weight", [heads * hd, h]),
            (b + "attn_q_norm.weight", [hd]),
            (b + "attn_k_norm.weight", [hd]),
            (b + "post_attention_norm.weight", [h]),
            (b + "ffn_norm.weight", [h]),
            (b + "post_ffw_norm.weight", [h]),
            (b + "ffn_gate.weight", [h, inter]),
            (b + "ffn_up.weight", [h, inter]),
            (b + "ffn_down.weight", [inter, h]),
        ]
    infos, data = b"", b""
    for k, (name, dims) in enumerate(tensors):
        n = 1
        for d in dims:
            n *= d
        infos += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", 0, len(data))
        values = [((k * 7 + j * 13) % 17 - 8) / 64.0 for j in range(n)]
        data += struct.pack(f"<{n}f", *values)
        data += b"\0" * (-len(data) % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + infos
    return head + b"\0" * (-len(head) % 32) + data


def main():
    for d in fixture_dirs():
        name = d.name
        config = read(d / "config.json")
        generation = read(d / "generation_config.json")
        tokenizer_config = read(d / "tokenizer_config.json")
        write("config", name, config + b"\0" + generation + b"\0" + tokenizer_config)
        index = d / "model.safetensors.index.json"
        shards = sorted(d.glob("*.safetensors"))
        header = safetensors_header(shards[0])
        write("safetensors", name, header + (b"\0" + index.read_bytes() if index.exists() else b""))
        if len(shards) == 1:
            write("load_dir", name, config + b"\0" + header)
    write("gguf", "gemma3-tiny.gguf", tiny_gguf())


if __name__ == "__main__":
    main()
