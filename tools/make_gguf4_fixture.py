#!/usr/bin/env python3
"""Turn a tiny Gemma 4 test fixture (tests/fixtures/NAME: config.json + model.safetensors) into a
llama.cpp GGUF file, the way llama.cpp's converter (convert_hf_to_gguf.py, class Gemma4Model on
top of Gemma3Model and TextModel, arch gguf.MODEL_ARCH.GEMMA4) writes Gemma 4 text models.

Written against gguf-py 0.19.0 (`pip install gguf==0.19.0`; it needs only numpy). No torch or
transformers: the safetensors file is read directly, and the converter's uses of transformers'
AutoTokenizer (gguf.LlamaHfVocab) are spelled out below.

What follows the converter:

* metadata `gemma4.*`: TextModel's base keys (context_length, embedding_length, block_count,
  feed_forward_length, attention.head_count / head_count_kv, rope.freq_base = the full layers'
  theta, rope.freq_base_swa = the sliding layers' theta, layer_norm_rms_epsilon, expert counts),
  Gemma3Model's (final_logit_softcapping, sliding_window) and Gemma4Model's:
  attention.shared_kv_layers, embedding_length_per_layer_input, attention.sliding_window_pattern
  (true = sliding), key/value_length = global_head_dim and key/value_length_swa = head_dim,
  per-layer feed_forward_length with use_double_wide_mlp, per-layer head_count_kv when
  num_global_key_value_heads is set, rope.dimension_count = global_head_dim,
  rope.dimension_count_swa = head_dim * partial_rotary_factor, expert_feed_forward_length;
* the extra tensor `rope_freqs.weight` = [1.0] * n_rot + [1e30] * n_unrot (the full layers'
  proportional RoPE as ggml frequency factors);
* tensor names from gguf.get_tensor_name_map(MODEL_ARCH.GEMMA4, n_layers) (`layer_scalar` gets
  `.weight` appended first, as Gemma4Model.filter_tensors does); values unchanged (Gemma 4's
  norm_shift is 0.0; the embedding is cut to the tokenizer's size, a no-op here); MoE:
  `router.scale` -> `blk.N.ffn_gate_inp.scale`, `router.per_expert_scale` ->
  `blk.N.ffn_down_exps.scale`, experts as 3-D tensors;
* tensor types as `--outtype bf16` / `f32` / `q8_0` give them: 1-D tensors (norms, scales) stay
  F32; q8_0 quantizes 2-D and 3-D tensors whose rows are a multiple of 32 (gguf.quants).
  `--outtype q8_0-dequantized` (not a converter option) writes the q8_0 file's values as F32:
  the reference the Q8_0 file is checked against;
* the vocabulary: Gemma4Model.set_vocab (tokenizer.ggml.model = "gemma4", tokens in id order,
  scores -1000, types BYTE for <0xNN> / CONTROL for special ids / NORMAL, the converter's
  USER_DEFINED "visible" tokens, merges, special ids and the chat template through
  gguf.SpecialVocab, add_space_prefix false, add_bos_token true).

Fixture specifics. The fixtures name per-layer head dims / kv heads in `per_layer_config`; they
are read as the hub configs' `global_head_dim` / `num_global_key_value_heads` (the converter
only knows the latter). The fixtures' tokenizer.json is a GPT-2 byte-level BPE, which the
converter refuses (LlamaHfVocab needs a byte-fallback BPE); it is rewritten as a Gemma-4-style
tokenizer with the same ids (SentencePiece-style BPE: " " -> U+2581, byte fallback <0xNN>,
merges unchanged up to that spelling) into OUT_DIR/tokenizer.json, and that file is the one
converted. "Special ids" are, as transformers' all_special_ids, the named special tokens of
tokenizer_config.json plus the added tokens flagged special.

Usage: make_gguf4_fixture.py FIXTURE_DIR OUT_DIR [--outtype bf16|f32|q8_0|q8_0-dequantized] [--name NAME]
Writes OUT_DIR/NAME.gguf (NAME defaults to the fixture's directory name, plus `.OUTTYPE` unless
bf16)
and OUT_DIR/tokenizer.json + tokenizer_config.json.
"""
import argparse
import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
import gguf

VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", "<|\"|>"}
SPACE = "\u2581"


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        buf = data[a:b]
        if meta["dtype"] == "BF16":
            arr = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] == "F32":
            arr = np.frombuffer(buf, dtype="<f4")
        elif meta["dtype"] == "F16":
            arr = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        else:
            raise SystemExit(f"{name}: unsupported dtype {meta['dtype']}")
        out[name] = arr.reshape(meta["shape"]).copy()
    return out


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def gemma4_style_tokenizer(fixture):
    """The fixture's byte-level BPE respelled as a Gemma-4-style tokenizer.json (same ids)."""
    tj = json.loads((fixture / "tokenizer.json").read_text())
    model = tj["model"]
    if model["type"] != "BPE":
        raise SystemExit("fixture tokenizer is not BPE")
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"] for t in tj["added_tokens"]}

    def respell(piece):
        if piece in added:
            return piece
        bs = bytes(byte_of[c] for c in piece)
        if len(bs) == 1 and not 0x20 <= bs[0] <= 0x7E:
            return f"<0x{bs[0]:02X}>"
        return bs.decode("utf-8").replace(" ", SPACE)

    vocab = {respell(p): i for p, i in model["vocab"].items()}
    assert len(vocab) == len(model["vocab"]), "respelling must keep pieces distinct"
    merges = []
    for m in model["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        merges.append([respell(a), respell(b)])
        assert respell(a) + respell(b) in vocab, m
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": tj["added_tokens"],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": tj["post_processor"],
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": model.get("unk_token", "<unk>"),
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def write_vocab(w, tok_dir):
    """Gemma4Model.set_vocab with gguf.LlamaHfVocab's token walk spelled out."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    by_id = {i: p for p, i in vocab.items()}
    for t in tj["added_tokens"]:
        by_id.setdefault(t["id"], t["content"])
    named = [tc.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")]
    special_ids = {vocab[t] for t in named if t in vocab}
    special_ids |= {t["id"] for t in tj["added_tokens"] if t.get("special")}
    tokens, scores, types = [], [], []
    for i in range(len(by_id)):
        text = by_id[i]
        tokens.append(text)
        scores.append(-1000.0)
        if text in VISIBLE_TOKENS:
            types.append(gguf.TokenType.USER_DEFINED)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            types.append(gguf.TokenType.BYTE)
        elif i in special_ids:
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    special = gguf.SpecialVocab(tok_dir, load_merges=True)
    special.add_to_gguf(w)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    return len(tokens)


def hparams_of(fixture):
    cfg = json.loads((fixture / "config.json").read_text())
    h = dict(cfg.get("text_config", cfg))
    h.setdefault("architectures", cfg.get("architectures"))
    # The fixtures' per_layer_config -> the hub keys the converter reads.
    plc = h.pop("per_layer_config", None) or {}
    full = [i for i, t in enumerate(h["layer_types"]) if t == "full_attention"]
    dims = {plc.get(str(i), {}).get("head_dim", h["head_dim"]) for i in full}
    kvs = {plc.get(str(i), {}).get("num_key_value_heads") for i in full}
    assert len(dims) == 1 and len(kvs) == 1, "full layers must share one head dim / kv head count"
    h.setdefault("global_head_dim", dims.pop())
    kv = kvs.pop()
    if kv is not None:
        h["num_global_key_value_heads"] = kv
    for i, t in enumerate(h["layer_types"]):
        if t == "sliding_attention":
            assert not plc.get(str(i)), "sliding-layer overrides have no GGUF spelling"
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fixture")
    ap.add_argument("out_dir")
    ap.add_argument("--outtype", choices=["bf16", "f32", "q8_0", "q8_0-dequantized"], default="bf16")
    ap.add_argument("--name")
    args = ap.parse_args()
    fixture, out_dir = Path(args.fixture), Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or fixture.name + ("" if args.outtype == "bf16" else "." + args.outtype)

    # The Gemma-4-style tokenizer (shared by every fixture: they have one tokenizer).
    tok = gemma4_style_tokenizer(fixture)
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=1) + "\n")
    tc = json.loads((fixture / "tokenizer_config.json").read_text())
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=1) + "\n")

    h = hparams_of(fixture)
    n_layer = h["num_hidden_layers"]
    layer_types = h["layer_types"]
    rope = h["rope_parameters"]
    w = gguf.GGUFWriter(str(out_dir / f"{name}.gguf"), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA4])
    w.add_name(f"megagemma fixture {fixture.name}")

    # TextModel.set_gguf_parameters
    w.add_context_length(h.get("max_position_embeddings", 131072))
    w.add_embedding_length(h["hidden_size"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    if h.get("num_experts") is not None:
        w.add_expert_count(h["num_experts"])
    if h.get("top_k_experts") is not None:
        w.add_expert_used_count(h["top_k_experts"])
    ftype = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q8_0-dequantized": gguf.LlamaFileType.ALL_F32}[args.outtype]
    w.add_file_type(ftype)
    # Gemma3Model.set_gguf_parameters
    if h.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(h["final_logit_softcapping"])
    w.add_sliding_window(h["sliding_window"])
    # Gemma4Model.set_gguf_parameters
    n_shared = h.get("num_kv_shared_layers", 0)
    w.add_shared_kv_layers(n_shared)
    w.add_embedding_length_per_layer_input(h.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in layer_types]
    w.add_sliding_window_pattern(swa)
    w.add_key_length(h["global_head_dim"])
    w.add_value_length(h["global_head_dim"])
    w.add_key_length_swa(h["head_dim"])
    w.add_value_length_swa(h["head_dim"])
    if h.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    if h.get("use_double_wide_mlp"):
        first_shared = n_layer - n_shared
        n_ff = h["intermediate_size"]
        w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in range(n_layer)])
    if h.get("num_global_key_value_heads") is not None:
        w.add_head_count_kv([h["num_key_value_heads"] if s else h["num_global_key_value_heads"] for s in swa])
    w.add_rope_dimension_count(int(h["global_head_dim"]))
    w.add_rope_dimension_count_swa(int(h["head_dim"] * h.get("partial_rotary_factor", 1.0)))

    n_vocab = write_vocab(w, out_dir)

    # Gemma4Model.generate_extra_tensors
    full = rope["full_attention"]
    assert full["rope_type"] == "proportional"
    n_rot = int(h["global_head_dim"] * full["partial_rotary_factor"] / 2)
    n_unrot = int(h["global_head_dim"] / 2) - n_rot
    tensors = [("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * n_unrot, dtype=np.float32))]

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layer)
    for hf, data in read_safetensors(fixture / "model.safetensors").items():
        if hf.endswith("layer_scalar"):
            hf += ".weight"
        m = re.search(r"\.layers\.(\d+)\.", hf)
        bid = int(m.group(1)) if m else None
        if hf.endswith("router.scale"):
            tensors.append((f"blk.{bid}.ffn_gate_inp.scale", data))
            continue
        if hf.endswith(".per_expert_scale"):
            tensors.append((f"blk.{bid}.ffn_down_exps.scale", data))
            continue
        if ".experts." in hf and not hf.endswith(".weight"):
            hf += ".weight"
        if hf.endswith("embed_tokens.weight"):
            data = data[:n_vocab]
        new = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise SystemExit(f"no GGUF name for {hf}")
        tensors.append((new, data))

    for new, data in tensors:
        data = np.ascontiguousarray(data, dtype=np.float32)
        if data.ndim <= 1 or args.outtype == "f32":
            w.add_tensor(new, data)
        elif args.outtype == "bf16":
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16)
            w.add_tensor(new, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif data.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            if args.outtype == "q8_0":
                w.add_tensor(new, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(new, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
        else:
            w.add_tensor(new, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(out_dir / f"{name}.gguf", file=sys.stderr)


if __name__ == "__main__":
    main()
