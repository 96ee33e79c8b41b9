#!/usr/bin/env python3
"""Build tiny random Gemma 4 / Gemma 3 checkpoints and record transformers' float64 greedy outputs.

transformers is the oracle. For every fixture this script
  1. builds a tiny Gemma 4 (or Gemma 3) model exercising one group of architecture features,
  2. randomises every parameter and saves it as a real bf16 checkpoint,
  3. reloads the checkpoint from disk in float64 (eager attention),
  4. records greedy generation (ids and the logits of every step) into expected.json.
The `mlx_q4` fixture is instead saved in MLX's 4-bit layout (packed uint32 codes plus bf16
scales and biases); transformers runs the exactly dequantized weights in float64.
Seeds whose greedy runs are fragile (near-ties in the logits or in MoE expert selection,
repetition loops) are rejected, so any implementation that is correct to ~1e-3 reproduces
the recorded ids.

It also writes models/demo/, a small random model for the CLI's bundled demo, and two MTP
assistants (Gemma4AssistantForCausalLM, dense and centroid head) for the committed ple_shared_dw
target in tests/fixtures/assistants/, with transformers' drafts round by round.

Everything is seeded: re-running the script rewrites byte-identical files.

    python tools/make_fixtures.py            # all fixtures + demo
    python tools/make_fixtures.py --only moe # one fixture
    python tools/make_fixtures.py --only mlx_q4,gemma3  # several (or repeat --only)
    python tools/make_fixtures.py --only assistant_dense,assistant_centroid  # the assistants only
"""

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import jinja2
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 512

# ----------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------

# Fixed ids 0..6, in this order (the trainer assigns special tokens first).
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
PAD_ID, EOS_ID, BOS_ID, END_OF_TURN_ID = 0, 1, 2, 6
STOP_IDS = [EOS_ID, END_OF_TURN_ID]

# Gemma-4 style chat format. `assistant` is rendered as `model`; a system turn appears only
# when the conversation has a system message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\\n' + (message['content'] | trim) + '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)

# Training text for the tiny BPE vocabulary (plain English, written for this project).
CORPUS = """\
The old lighthouse keeper climbed the stairs every evening. There were one hundred and
twelve steps, and he counted each of them out loud, because counting kept his mind calm.
At the top he wiped the glass, trimmed the wick, and watched the sea turn from green to grey.

Ships passed in the night. Some were small fishing boats with a single lamp swinging at
the bow; others were great cargo ships, their decks stacked with containers of red, blue
and yellow. He wrote the name of every ship he could read in a thick notebook.

One winter the storm lasted for three days. The wind howled around the tower, the rain
beat against the windows, and the waves rose higher than the rocks. On the second night
he saw a light that did not belong to any ship he knew. It blinked twice, then three
times, then twice again.

"Who is out there?" he asked the empty room. Nobody answered, of course. He took his coat,
his lantern and a long rope, and he walked down to the harbour.

A small girl was sitting in a rowing boat, holding a torch above her head. She was wet and
cold, but she was smiling. "I followed your light," she said. "My father's boat is stuck
on the sand bank. Can you help us?"

The keeper rang the bell to wake the village. Within minutes, ten people were running to
the shore with ropes, blankets and hot tea. Together they pulled the boat off the sand,
and by morning everyone was safe and warm in the kitchen of the inn.

After that night the girl visited the lighthouse every Sunday. The keeper taught her how
to clean the lens, how to read the weather from the clouds, and how to count the steps
without getting tired. She taught him new songs and how to make pancakes with apples.

Years later, when the keeper was too old to climb the stairs, she became the keeper
herself. She still counts the steps out loud: one, two, three, four, five, six, seven,
eight, nine, ten. And every evening she writes the names of the ships in a new notebook.

Questions and answers: What is the capital of France? Paris. How many days are in a week?
Seven. What colour is the sky on a clear day? Blue. Where does the sun rise? In the east.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 20 42 100 2024. Punctuation: , . ; : ! ? ( ) [ ] { } - _ ' "
"""


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE with exactly VOCAB_SIZE entries; any UTF-8 text round-trips."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # No prefix space: like Gemma, "Hello" at the start of a text is not " Hello".
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A $B",
        special_tokens=[("<bos>", BOS_ID)],
    )
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    # Lossless on text the corpus never saw (accents, CJK, emoji, control characters).
    sample = "Grüße, 東京! 🦀 tabs\tand\nnewlines <|turn>"
    ids = tok.encode(sample).ids
    assert ids[0] == BOS_ID and tok.decode(ids, skip_special_tokens=True) == sample.replace("<|turn>", "")
    assert tok.decode(tok.encode(sample, add_special_tokens=False).ids, skip_special_tokens=False) == sample
    return tok


def write_tokenizer_files(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    generation_config = {
        "bos_token_id": BOS_ID,
        "eos_token_id": STOP_IDS,
        "pad_token_id": PAD_ID,
        "transformers_version": transformers.__version__,
    }
    write_json(out / "generation_config.json", generation_config)


def check_tokenizer_files(out: Path, tok: Tokenizer) -> None:
    """transformers loads the written files and agrees with the tokenizer and the template."""
    hf = transformers.AutoTokenizer.from_pretrained(out)
    text = PROMPTS["long"]
    assert hf(text).input_ids == tok.encode(text).ids
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    chat = hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n", repr(chat)


def check_chat_template() -> None:
    """The template renders the documented Gemma 4 turn format."""
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi\n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    got = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    want = (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello.<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n"
    )
    assert got == want, repr(got)
    got = template.render(messages=messages[1:2], bos_token="<bos>", add_generation_prompt=False)
    assert got == "<bos><|turn>user\nHi<turn|>\n", repr(got)


# ----------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------

S, F = "sliding_attention", "full_attention"

# Shared by every fixture: hidden 64, 4 query heads, head dim 16 on sliding layers and 32 on
# full layers (so a loader that ignores per_layer_config fails), E2B/E4B-style RoPE. The MLP
# is narrow only to keep the committed files small.
BASE_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    vocab_size_per_layer_input=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

# E2B-like: per-layer embeddings, KV sharing over a sliding and a full layer, double-wide MLP
# on the shared layers. Layers 0-2 own K/V (stores: 1 sliding, 2 full); 3-5 reuse them.
PLE_SHARED_DW = dict(
    num_hidden_layers=6,
    layer_types=[S, S, F, S, S, F],
    hidden_size_per_layer_input=8,
    num_kv_shared_layers=3,
    use_double_wide_mlp=True,
)

FIXTURES = {
    "ple_shared_dw": dict(text=PLE_SHARED_DW, seed=1000),
    # 31B-like attention: full layers take V from k_proj (no v_proj), with their own KV-head
    # count and head dim; no softcap; separate lm_head.weight.
    "keqv_global": dict(
        text=dict(
            num_hidden_layers=5,
            layer_types=[S, F, S, S, F],
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            final_logit_softcapping=None,
            tie_word_embeddings=False,
        ),
        seed=2000,
    ),
    # 26B-A4B-like: dense MLP plus routed experts in every layer, k_eq_v full layers.
    "moe": dict(
        text=dict(
            num_hidden_layers=4,
            layer_types=[S, F, S, F],
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=16,
        ),
        seed=3000,
    ),
    # A 4-token window that wraps many times during a 64-token generation; layers 0-1 own
    # K/V, layers 2-3 reuse them.
    "sliding_wrap": dict(
        text=dict(
            num_hidden_layers=4,
            layer_types=[S, F, S, F],
            sliding_window=4,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=2,
        ),
        seed=4000,
        new_tokens={"short": 64, "long": 16},
    ),
    # Multimodal wrapper: text weights under model.language_model.*, plus a tiny vision tower
    # whose tensors a text-only loader must skip.
    "conditional": dict(
        text=dict(
            num_hidden_layers=4,
            layer_types=[S, F, S, F],
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=2,
        ),
        conditional=True,
        seed=5000,
    ),
    # ple_shared_dw's architecture split over several safetensors files.
    "sharded": dict(text=PLE_SHARED_DW, seed=6000, max_shard_size="200KB"),
    # ple_shared_dw's architecture in MLX's 4-bit layout (see convert_to_mlx_q4). The per-layer
    # input width is 32 rather than 8 so embed_tokens_per_layer ([512, 6 * 32]) has groups of
    # 64 and gets quantized too; per_layer_projection ([64, 32]) and the single-wide
    # down_proj ([64, 32]) stay dense.
    "mlx_q4": dict(text=dict(PLE_SHARED_DW, hidden_size_per_layer_input=32), seed=8000, mlx_q4=True),
    # Gemma 3 (Gemma3ForCausalLM, see GEMMA3_TEXT).
    "gemma3": dict(family="gemma3", text={}, seed=9000),
}

# Gemma 3: 5:1 sliding/full layers, a 4-token window that wraps, query_pre_attn_scalar (24)
# != head_dim (16), local RoPE theta 1e4 vs global 1e6 with linear scaling 2, attention-logit
# softcap 50 and final softcap 30, tied embeddings, (1 + w) RMSNorms.
GEMMA3_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=7,
    layer_types=[S, S, S, S, S, F, S],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=4,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10000.0},
        F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    },
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

DEMO_TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    layer_types=[S, S, F, S, S, F],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    sliding_window=32,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=2,
)
DEMO_SEED = 7000

# Prompts: text through the tiny tokenizer (BOS added). `short` is ~5 ids; `long` is longer
# than every fixture's sliding window.
PROMPTS = {
    "short": "The old lighthouse keeper",
    "long": "The girl rowed to the lighthouse in the storm and the",
}
NEW_TOKENS = {"short": 20, "long": 24}

# Seed rejection thresholds.
MIN_MARGIN = 0.02  # top-1 minus top-2 logit, at every step
MIN_DISTINCT = 0.4  # fraction of distinct ids among the generated ones
MAX_RUN = 5  # longest run of one repeated id
MIN_ROUTER_GAP = 2e-3  # MoE: k-th minus (k+1)-th router score, for every token and layer
MAX_SEED_TRIES = 400


def text_config(spec: dict):
    if spec.get("family") == "gemma3":
        return Gemma3TextConfig(**dict(GEMMA3_TEXT, **spec["text"]))
    kwargs = dict(BASE_TEXT)
    kwargs.update(spec["text"])
    return Gemma4TextConfig(**kwargs)


def model_class(spec: dict):
    if spec.get("family") == "gemma3":
        return Gemma3ForCausalLM
    return Gemma4ForConditionalGeneration if spec.get("conditional") else Gemma4ForCausalLM


def build_model(spec: dict, seed: int) -> torch.nn.Module:
    text = text_config(spec)
    if spec.get("family") == "gemma3":
        # Gemma 3's RMSNorm multiplies by (1 + w): shift every norm weight down by one so the
        # effective multipliers have the same distribution as Gemma 4's.
        model = Gemma3ForCausalLM(text)
        randomize(model, seed, norm_offset=-1.0)
        return model.eval()
    if spec.get("conditional"):
        vision = Gemma4VisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            patch_size=4,
            pooling_kernel_size=2,
            position_embedding_size=16,
        )
        config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
        model = Gemma4ForConditionalGeneration(config)
    else:
        model = Gemma4ForCausalLM(text)
    randomize(model, seed)
    return model.eval()


# Scales for the token table and the final norm (see randomize()).
TOKEN_TABLE_STD = 0.07
FINAL_NORM_MEAN = 9.0


def randomize(model: torch.nn.Module, seed: int, norm_offset: float = 0.0) -> None:
    """Draw every saved tensor from a seeded generator, scaled so logits have real margins.

    transformers' own init leaves norms at 1, layer scalars at 1 and router scales at 1,
    which would hide loader bugs (a missing or swapped norm weight would change nothing).
    `norm_offset` shifts the mean of every RMSNorm weight (-1 for Gemma 3's x * (1 + w)).
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo

    touched = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
            if name.endswith("per_expert_scale"):
                value = uniform(p.shape, 0.5, 1.5)
            elif name.endswith("router.scale"):
                value = normal(p.shape, 0.3, 1.0)
            elif name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight"):
                # Large final norm: with the small token table below, logits still have std ~5.
                value = normal(p.shape, 0.3 * FINAL_NORM_MEAN, FINAL_NORM_MEAN + norm_offset)
            elif p.dim() == 1 and "norm" in leaf:
                # RMSNorm weights multiply directly (no 1 + w): keep them around 1.
                value = normal(p.shape, 0.3, 1.0 + norm_offset)
            elif leaf in ("embed_tokens", "lm_head"):
                # Small token table so x0 = E * sqrt(H) does not dominate the residual stream:
                # with tied embeddings a dominant x0 makes the input token the top logit, and
                # greedy decoding collapses into repeating it.
                value = normal(p.shape, TOKEN_TABLE_STD)
            elif leaf == "embed_tokens_per_layer":
                # Scaled by sqrt(P) in the forward pass; keep the token part ~1 like the context part.
                value = normal(p.shape, 1.0 / math.sqrt(p.shape[1] / model_num_layers(model)))
            elif name.endswith("router.proj.weight"):
                # Router logits with std ~2 so different tokens pick different experts.
                value = normal(p.shape, 2.0)
            elif name.endswith("experts.gate_up_proj"):
                value = normal(p.shape, 1.0 / math.sqrt(p.shape[2]))
            elif name.endswith("experts.down_proj"):
                value = normal(p.shape, 1.0 / math.sqrt(p.shape[2]))
            elif p.dim() == 2:
                # Linear [out, in]: unit-variance outputs for unit-variance inputs.
                value = normal(p.shape, 1.0 / math.sqrt(p.shape[1]))
            else:
                value = normal(p.shape, 0.5)
            p.copy_(value)
            touched.add(name)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(uniform(b.shape, 0.5, 1.5))
                touched.add(name)
            elif name.endswith("token_ordering"):
                # An MTP assistant's centroid head: which tokens each centroid owns.
                b.copy_(torch.randperm(b.numel(), generator=gen))
                touched.add(name)
    # Every tensor that goes into the checkpoint must have been drawn here.
    missing = [k for k in model.state_dict() if k not in touched and not is_tied_alias(model, k)]
    assert not missing, missing


def model_num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def is_tied_alias(model, key: str) -> bool:
    return key == "lm_head.weight" and model.config.get_text_config().tie_word_embeddings


def save_checkpoint(model, out: Path, tok: Tokenizer, max_shard_size=None) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, **kwargs)
    # Written after save_pretrained, which emits its own generation_config.json.
    write_tokenizer_files(tok, out)


def load_f64(out: Path, cls):
    # Eager kernels: the default grouped-matmul experts path has no float64 support.
    model = cls.from_pretrained(
        out, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


# ----------------------------------------------------------------------------------------
# MLX 4-bit checkpoints
# ----------------------------------------------------------------------------------------

MLX_GROUP_SIZE, MLX_BITS = 64, 4
MLX_QUANTIZATION = {"group_size": MLX_GROUP_SIZE, "bits": MLX_BITS}


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round half away from zero (like Rust's f32::round), exactly: x - trunc(x) is exact."""
    t = np.trunc(x)
    return t + np.where(np.abs(x - t) >= 0.5, np.sign(x), 0).astype(x.dtype)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit pattern as uint16 (round to nearest even; no NaNs here)."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def mlx_quantize(w: np.ndarray):
    """MLX affine quantization of a float32 [rows, cols] matrix, group 64, 4 bits.

    Returns (packed uint32 [rows, cols/8], scales and biases as bf16 bits [rows, cols/64]).
    Nibble j of a row sits at bits 4*(j % 8) of word j // 8.
    """
    rows, cols = w.shape
    n_bins = np.float32((1 << MLX_BITS) - 1)
    g = w.astype(np.float32).reshape(rows, cols // MLX_GROUP_SIZE, MLX_GROUP_SIZE)
    w_min = g.min(axis=-1, keepdims=True)
    w_max = np.maximum(g.max(axis=-1, keepdims=True), np.float32(0))  # MLX's max starts at 0
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    neg_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.where(neg_edge, scale, -scale)
    edge = np.where(neg_edge, w_min, w_max)
    q0 = round_half_away(edge / scale)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale)
    bias = np.where(nonzero, edge, np.float32(0))
    assert scale.dtype == bias.dtype == np.float32
    q = np.clip(round_half_away((g - bias) / scale), 0, n_bins).astype(np.uint32).reshape(rows, cols // 8, 8)
    packed = np.zeros((rows, cols // 8), np.uint32)
    for j in range(8):
        packed |= q[:, :, j] << np.uint32(4 * j)
    return packed, bf16_bits(scale[..., 0]), bf16_bits(bias[..., 0])


def mlx_dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """w = scale * q + bias in float32, from the stored (bf16) scales and biases."""
    rows = packed.shape[0]
    q = np.stack([(packed >> np.uint32(4 * j)) & np.uint32(0xF) for j in range(8)], axis=-1)
    q = q.reshape(rows, -1, MLX_GROUP_SIZE).astype(np.float32)
    w = bf16_to_f32(scales)[..., None] * q + bf16_to_f32(biases)[..., None]
    assert w.dtype == np.float32
    return w.reshape(rows, -1)


def save_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """safetensors.numpy has no bf16: uint16 arrays are saved and then relabelled BF16."""
    save_file(tensors, str(path), metadata=metadata)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] == "U16":
            v["dtype"] = "BF16"
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n :])


def convert_to_mlx_q4(out: Path) -> dict:
    """Rewrite the bf16 checkpoint in out/ in MLX's 4-bit layout; return the float64 weights
    transformers must run (quantized matrices exactly dequantized, the rest bf16 as stored).

    Every 2-D weight whose input dim is a multiple of 64 is quantized (token tables included):
    `X.weight` U32 [rows, cols/8], `X.scales` and `X.biases` BF16 [rows, cols/64].
    """
    path = out / "model.safetensors"
    dense = load_file(str(path))
    tensors, weights = {}, {}
    for name, t in dense.items():
        assert t.dtype == torch.bfloat16, (name, t.dtype)
        w = t.float().numpy()
        if name.endswith(".weight") and w.ndim == 2 and w.shape[1] % MLX_GROUP_SIZE == 0:
            base = name[: -len(".weight")]
            packed, scales, biases = mlx_quantize(w)
            tensors[name], tensors[base + ".scales"], tensors[base + ".biases"] = packed, scales, biases
            weights[name] = torch.from_numpy(mlx_dequantize(packed, scales, biases)).double()
        else:
            tensors[name] = t.view(torch.uint16).numpy()
            weights[name] = t.double()
    save_safetensors(tensors, path, {"format": "mlx"})
    config = json.loads((out / "config.json").read_text())
    config["quantization"] = dict(MLX_QUANTIZATION)
    config["quantization_config"] = dict(MLX_QUANTIZATION)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return weights


def load_dequantized(out: Path, cls, weights: dict):
    """Build the model from out/config.json in float64 and load the given weights into it."""
    config = json.loads((out / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)  # MLX's entries, not a transformers quantizer
    config = cls.config_class.from_dict(config)
    model = cls._from_config(config, dtype=torch.float64, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert all(is_tied_alias(model, k) for k in missing), missing
    if model.config.get_text_config().tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return model.eval()


# ----------------------------------------------------------------------------------------
# Greedy decoding, two ways
# ----------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_no_cache(model, prompt: list, n: int):
    """Reference: recompute the whole sequence at every step, take the last position."""
    ids = list(prompt)
    steps = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        steps.append(logits.clone())
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :], torch.stack(steps)


@torch.no_grad()
def greedy_generate(model, prompt: list, n: int):
    """transformers' cached decoding; must agree with the no-cache recomputation."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=None,  # exactly n tokens, never stop early
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    out = model.generate(torch.tensor([prompt]), generation_config=config)
    ids = out.sequences[0, len(prompt) :].tolist()
    assert len(ids) == n, (len(ids), n)
    return ids, torch.stack([l[0] for l in out.logits])


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-step relative L2 distance, the measure the Rust tests use for logits."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def step_margins(logits: torch.Tensor) -> torch.Tensor:
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def longest_run(ids: list) -> int:
    best = run = 1
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


@torch.no_grad()
def min_router_gap(model, ids: list) -> float:
    """Smallest gap between the last chosen and the first unchosen expert's router score.

    A near-tie there would let rounding noise swap an expert, a discontinuous change that
    no logit tolerance absorbs. Measured over one full pass of the whole sequence.
    """
    k = model.config.get_text_config().top_k_experts
    gaps = []

    def hook(module, inputs, scores):
        top = torch.topk(scores.reshape(-1, scores.shape[-1]), k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])

    handles = [m.proj.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "Gemma4TextRouter"]
    model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in handles:
        h.remove()
    return float(torch.cat(gaps).min())


def rejection_reason(ids: list, margins: torch.Tensor):
    if float(margins.min()) < MIN_MARGIN:
        return f"margin {float(margins.min()):.4f}"
    if len(set(ids)) < MIN_DISTINCT * len(ids):
        return f"{len(set(ids))} distinct of {len(ids)}"
    if longest_run(ids) > MAX_RUN:
        return f"run of {longest_run(ids)}"
    # A generator that stops at <eos>/<turn|> must still produce the whole recorded run.
    if any(i in STOP_IDS for i in ids):
        return "stop token generated"
    return None


# ----------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------


def make_fixture(name: str, spec: dict, tok: Tokenizer, out_root: Path) -> dict:
    out = out_root / name
    cls = model_class(spec)
    moe = bool(spec["text"].get("enable_moe_block"))
    new_tokens = dict(NEW_TOKENS, **spec.get("new_tokens", {}))
    prompts = {case: tok.encode(text).ids for case, text in PROMPTS.items()}
    window = text_config(spec).sliding_window
    assert len(prompts["long"]) > window, (len(prompts["long"]), window)

    for seed in range(spec["seed"], spec["seed"] + MAX_SEED_TRIES):
        save_checkpoint(build_model(spec, seed), out, tok, spec.get("max_shard_size"))
        check_tokenizer_files(out, tok)
        if spec.get("mlx_q4"):
            model = load_dequantized(out, cls, convert_to_mlx_q4(out))
        else:
            model = load_f64(out, cls)
        cases, reason, worst_cache_err, worst_router_gap = [], None, 0.0, math.inf
        for case, prompt in prompts.items():
            n = new_tokens[case]
            ids, logits = greedy_no_cache(model, prompt, n)
            margins = step_margins(logits)
            reason = rejection_reason(ids, margins)
            if not reason and moe:
                gap = min_router_gap(model, prompt + ids[:-1])
                worst_router_gap = min(worst_router_gap, gap)
                if gap < MIN_ROUTER_GAP:
                    reason = f"router gap {gap:.1e}"
            if reason:
                break
            cached_ids, cached_logits = greedy_generate(model, prompt, n)
            assert cached_ids == ids, f"{name}/{case}: generate() {cached_ids} != no-cache {ids}"
            # Not bit-equal: eager softmax and RoPE run in float32 even in a float64 model.
            cache_err = float(rel_l2(cached_logits, logits).max())
            assert cache_err < 1e-5, f"{name}/{case}: cached logits differ by {cache_err:.2e} (rel. L2)"
            worst_cache_err = max(worst_cache_err, cache_err)
            cases.append(
                {
                    "name": case,
                    "prompt_ids": prompt,
                    "max_new_tokens": n,
                    "greedy_ids": ids,
                    "logits": logits,
                    "min_margin": float(margins.min()),
                }
            )
        if reason:
            print(f"  {name}: seed {seed} rejected ({reason})")
            continue
        expected = {
            **provenance(),
            **({"weights": "dequantized MLX 4-bit, group 64"} if spec.get("mlx_q4") else {}),
            "architecture": type(model).__name__,
            "seed": seed,
            "cases": cases,
        }
        write_expected(out / "expected.json", expected)
        margins = ", ".join(f"{c['name']} {c['min_margin']:.4f}" for c in cases)
        router = f"; min router gap {worst_router_gap:.1e}" if moe else ""
        print(f"{name}: seed {seed}, min margins {margins}; cached vs no-cache rel. L2 {worst_cache_err:.1e}{router}")
        return expected
    raise SystemExit(f"{name}: no acceptable seed in {MAX_SEED_TRIES} tries")


def make_demo(tok: Tokenizer, out: Path) -> None:
    model = build_model({"text": DEMO_TEXT}, DEMO_SEED)
    save_checkpoint(model, out, tok)
    # Smoke test: the demo loads and generates.
    model = load_f64(out, Gemma4ForCausalLM)
    ids, _ = greedy_no_cache(model, tok.encode(PROMPTS["short"]).ids, 8)
    print(f"demo: {out}, sample {tok.decode(ids)!r}")


# ----------------------------------------------------------------------------------------
# MTP assistants (Gemma4AssistantForCausalLM) for a committed target
# ----------------------------------------------------------------------------------------

# Drafters for the committed ple_shared_dw target (hidden 64, window 8; its KV store layers are
# 1 (sliding) and 2 (full), 2 KV heads, head dims 16 and 32). An E2B-like assistant: four q-only
# layers [S, S, S, F] of width 32 that attend the target's K/V, no PLE, no softcap.
ASSISTANT_TEXT = dict(
    BASE_TEXT,
    vocab_size_per_layer_input=0,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    layer_types=[S, S, S, F],
    num_kv_shared_layers=4,
    final_logit_softcapping=None,
)

# Written to tests/fixtures/assistants/<dir>/, beside (not among) the target fixtures.
ASSISTANT_FIXTURES = {
    # Dense LM head tied to the assistant's own embed_tokens (26B-A4B / 31B assistants).
    "assistant_dense": dict(dir="dense", target="ple_shared_dw", seed=11000),
    # Centroid head (E2B / E4B assistants): 16 centroids of 32 tokens, the top 4 scored.
    "assistant_centroid": dict(
        dir="centroid", target="ple_shared_dw", seed=12000, num_centroids=16, centroid_top_k=4
    ),
}
DRAFT_TOKENS = 3  # drafts per round (`num_assistant_tokens`)
ASSISTANT_NEW_TOKENS = {"short": 12, "long": 16}
LOGGED_ROUNDS = 3  # rounds per case whose drafter logits are recorded
MIN_CENTROID_GAP = 2e-3  # centroid head: k-th minus (k+1)-th centroid score, at every step


def build_assistant(spec: dict, seed: int, backbone_hidden: int):
    config = transformers.Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**ASSISTANT_TEXT),
        backbone_hidden_size=backbone_hidden,
        use_ordered_embeddings="num_centroids" in spec,
        num_centroids=spec.get("num_centroids", 2048),
        centroid_intermediate_top_k=spec.get("centroid_top_k", 32),
        tie_word_embeddings=True,
    )
    model = transformers.Gemma4AssistantForCausalLM(config)
    randomize(model, seed)
    return model.eval()


def save_assistant(model, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    generation_config = {
        "num_assistant_tokens": DRAFT_TOKENS,
        "num_assistant_tokens_schedule": "constant",
        "transformers_version": transformers.__version__,
    }
    write_json(out / "generation_config.json", generation_config)


@torch.no_grad()
def draft_round(target, assistant, seq: list, p: int, k: int, at_last_committed: bool = False):
    """k draft steps of transformers' assistant for the token at position p, seeing the target's
    K/V exactly as committed (positions 0..p-1), as transformers' candidate generator feeds it:
    the query at position p, sliding layers admitting the W+1 newest keys.

    `at_last_committed`: vLLM's and SGLang's convention instead, the query at p-1 with the
    target's own sliding window there (the W newest keys).

    Returns the draft ids, the drafter's logits of each step and the smallest centroid gap.
    """
    out = target(
        input_ids=torch.tensor([seq[:p]]),
        use_cache=False,
        output_hidden_states=True,
        return_shared_kv_states=True,
    )
    shared = dict(out.shared_kv_states)
    query_pos = p
    if at_last_committed:
        query_pos, window = p - 1, target.config.sliding_window
        keys, values = shared["sliding_attention"]
        shared["sliding_attention"] = (keys[:, :, -window:], values[:, :, -window:])
    hidden = out.hidden_states[-1][:, -1:]  # final-normed hidden of position p-1
    token = torch.tensor([[seq[p]]])
    embed = target.get_input_embeddings()  # the target's scaled embedding
    mask = torch.ones(1, p + 1, dtype=torch.long)
    gaps = []
    hook = None
    if assistant.masked_embedding is not None:
        top_k = assistant.config.centroid_intermediate_top_k

        def record_gap(module, inputs, scores):
            top = torch.topk(scores.reshape(-1), top_k + 1).values
            gaps.append(float(top[top_k - 1] - top[top_k]))

        hook = assistant.masked_embedding.centroids.register_forward_hook(record_gap)
    ids, logits = [], []
    for _ in range(k):
        x = torch.cat([embed(token), hidden], dim=-1)
        o = assistant(
            inputs_embeds=x, attention_mask=mask, position_ids=torch.tensor([[query_pos]]), shared_kv_states=shared
        )
        token = o.logits.argmax(dim=-1)
        hidden = o.last_hidden_state  # post_projection of the normed output
        ids.append(int(token))
        logits.append(o.logits[0, 0].clone())
    if hook:
        hook.remove()
    return ids, torch.stack(logits), min(gaps, default=math.inf)


def accepted_prefix(drafts: list, seq: list, p: int) -> int:
    """Leading drafts equal to the greedy continuation after position p."""
    n = 0
    while n < len(drafts) and p + 1 + n < len(seq) and drafts[n] == seq[p + 1 + n]:
        n += 1
    return n


@torch.no_grad()
def speculative_rounds(target, assistant, seq: list, prompt_len: int):
    """Greedy speculative decoding of seq[prompt_len:] with the drafts of `draft_round`: each
    round starts at the position p of the target's last token, drafts min(k, budget) tokens and
    advances by the accepted ones plus the target's own token. The number of drafts follows
    transformers (`max_length - len(input_ids) - 1`)."""
    rounds, p = [], prompt_len
    while (k := min(DRAFT_TOKENS, len(seq) - p - 2)) > 0:
        ids, logits, gap = draft_round(target, assistant, seq, p, k)
        ids_vllm, logits_vllm, gap_vllm = draft_round(target, assistant, seq, p, k, at_last_committed=True)
        n = accepted_prefix(ids, seq, p)
        rounds.append(
            {
                "position": p,
                "token": seq[p],
                "draft_ids": ids,
                "accepted": n,
                "draft_ids_at_last_committed": ids_vllm,
                "logits": logits,
                "margins": torch.cat([step_margins(logits), step_margins(logits_vllm)]),
                "gap": min(gap, gap_vllm),
            }
        )
        p += n + 1
    return rounds


@torch.no_grad()
def assisted_generate(target, assistant, prompt: list, n: int):
    """transformers' own assisted generation; returns its ids and the drafts of every round."""
    rounds = []
    cls = transformers.generation.candidate_generator.SinglePositionMultiTokenCandidateGenerator
    original = cls.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            length = input_ids.shape[1]
            rounds.append({"position": length - 1, "token": int(input_ids[0, -1]), "draft_ids": candidates[0, length:].tolist()})
        return candidates, logits

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=None,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        use_cache=True,
    )
    cls.get_candidates = spy
    try:
        out = target.generate(torch.tensor([prompt]), assistant_model=assistant, generation_config=config)
    finally:
        cls.get_candidates = original
    return out[0, len(prompt) :].tolist(), rounds


def make_assistant_fixture(name: str, spec: dict, tok: Tokenizer, out_root: Path) -> dict:
    out = out_root / "assistants" / spec["dir"]
    target_dir = out_root / spec["target"]
    target = load_f64(target_dir, Gemma4ForCausalLM)
    backbone_hidden = target.config.hidden_size
    prompts = {case: tok.encode(text).ids for case, text in PROMPTS.items()}
    greedy = {}
    for case, prompt in prompts.items():
        ids, _ = greedy_no_cache(target, prompt, ASSISTANT_NEW_TOKENS[case])
        greedy[case] = ids

    for seed in range(spec["seed"], spec["seed"] + MAX_SEED_TRIES):
        save_assistant(build_assistant(spec, seed, backbone_hidden), out)
        assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(
            out, dtype=torch.float64, attn_implementation="eager"
        ).eval()
        assistant.generation_config.num_assistant_tokens = DRAFT_TOKENS
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        cases, reason = [], None
        for case, prompt in prompts.items():
            seq = prompt + greedy[case]
            rounds = speculative_rounds(target, assistant, seq, len(prompt))
            margins = torch.cat([r["margins"] for r in rounds])
            gap = min(r["gap"] for r in rounds)
            if float(margins.min()) < MIN_MARGIN:
                reason = f"draft margin {float(margins.min()):.4f}"
            elif gap < MIN_CENTROID_GAP:
                reason = f"centroid gap {gap:.1e}"
            if reason:
                break
            hf_ids, hf_rounds = assisted_generate(target, assistant, prompt, len(greedy[case]))
            assert hf_ids == greedy[case], f"{name}/{case}: assisted {hf_ids} != greedy {greedy[case]}"
            # Where transformers' generator sees the target's K/V exactly as committed (its first
            # round, and rounds after every draft was accepted) its drafts are the recorded ones.
            # After a rejection it also sees the rejected drafts' K/V, which megagemma does not.
            committed = True
            for r in hf_rounds:
                r["kv_as_committed"] = committed
                if committed:
                    ids, _, _ = draft_round(target, assistant, seq, r["position"], len(r["draft_ids"]))
                    assert ids == r["draft_ids"], f"{name}/{case} at {r['position']}: {ids} != {r['draft_ids']}"
                committed = accepted_prefix(r["draft_ids"], seq, r["position"]) == len(r["draft_ids"])
            cases.append(
                {
                    "name": case,
                    "prompt_ids": prompt,
                    "greedy_ids": greedy[case],
                    "assisted_ids": hf_ids,
                    "rounds": rounds,
                    "transformers_rounds": hf_rounds,
                    "min_margin": float(margins.min()),
                    "min_centroid_gap": gap,
                }
            )
        if reason:
            print(f"  {name}: seed {seed} rejected ({reason})")
            continue
        expected = {
            **provenance(),
            "architecture": type(assistant).__name__,
            "target": f"tests/fixtures/{spec['target']}",
            "draft_tokens": DRAFT_TOKENS,
            "seed": seed,
            "cases": cases,
        }
        write_assistant_expected(out / "expected.json", expected)
        stats = ", ".join(
            f"{c['name']}: {len(c['rounds'])} rounds, {sum(r['accepted'] for r in c['rounds'])} accepted, "
            f"margin {c['min_margin']:.4f}"
            for c in cases
        )
        print(f"{name}: seed {seed}; {stats}")
        return expected
    raise SystemExit(f"{name}: no acceptable seed in {MAX_SEED_TRIES} tries")


# ----------------------------------------------------------------------------------------
# JSON output
# ----------------------------------------------------------------------------------------


def provenance() -> dict:
    """The first keys of every expected.json: what recorded it, in which dtype."""
    return {
        "generator": "tools/make_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float64",
    }


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def fmt_float(x: float) -> str:
    # 8 significant digits: far below the ~1e-6 noise of the float64 reference itself.
    return repr(float(f"{x:.8g}"))


def expected_head(expected: dict) -> list:
    """The first lines of an expected.json: every key but "cases" on one line each, then the
    opening of "cases"."""
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in expected.items() if k != "cases"]
    return lines + ['  "cases": [']


def write_expected_lines(path: Path, lines: list) -> None:
    """Closes "cases" and the object, writes the file and checks it parses."""
    path.write_text("\n".join(lines + ["  ]", "}"]) + "\n")
    json.loads(path.read_text())  # well-formed


def write_expected(path: Path, expected: dict) -> None:
    """Pretty JSON, with each step's logits on one line to keep files small and diffable."""
    lines = expected_head(expected)
    for ci, case in enumerate(expected["cases"]):
        lines.append("    {")
        for k in ("name", "prompt_ids", "max_new_tokens", "greedy_ids"):
            lines.append(f"      {json.dumps(k)}: {json.dumps(case[k])},")
        lines.append('      "logits": [')
        rows = case["logits"].tolist()
        for ri, row in enumerate(rows):
            sep = "," if ri + 1 < len(rows) else ""
            lines.append("        [" + ",".join(fmt_float(x) for x in row) + "]" + sep)
        lines.append("      ],")
        lines.append(f'      "min_margin": {fmt_float(case["min_margin"])}')
        lines.append("    }" + ("," if ci + 1 < len(expected["cases"]) else ""))
    write_expected_lines(path, lines)


def write_assistant_expected(path: Path, expected: dict) -> None:
    """Like write_expected: one line per round, each drafter step's logits on one line."""
    lines = expected_head(expected)
    for ci, case in enumerate(expected["cases"]):
        lines.append("    {")
        for k in ("name", "prompt_ids", "greedy_ids", "assisted_ids"):
            lines.append(f"      {json.dumps(k)}: {json.dumps(case[k])},")
        for k in ("min_margin", "min_centroid_gap"):
            value = case[k]
            lines.append(f"      {json.dumps(k)}: {fmt_float(value) if math.isfinite(value) else 'null'},")
        lines.append('      "transformers_rounds": [')
        for ri, r in enumerate(case["transformers_rounds"]):
            sep = "," if ri + 1 < len(case["transformers_rounds"]) else ""
            lines.append("        " + json.dumps(r) + sep)
        lines.append("      ],")
        lines.append('      "rounds": [')
        for ri, r in enumerate(case["rounds"]):
            fields = {k: r[k] for k in ("position", "token", "draft_ids", "accepted", "draft_ids_at_last_committed")}
            body = json.dumps(fields)[:-1]
            if ri < LOGGED_ROUNDS:
                steps = ",\n".join(
                    "            [" + ",".join(fmt_float(x) for x in row) + "]" for row in r["logits"].tolist()
                )
                body += ', "logits": [\n' + steps + "\n          ]"
            sep = "," if ri + 1 < len(case["rounds"]) else ""
            lines.append("        " + body + "}" + sep)
        lines.append("      ]")
        lines.append("    }" + ("," if ci + 1 < len(expected["cases"]) else ""))
    write_expected_lines(path, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        action="append",
        help="fixture names, comma-separated or repeated (e.g. --only mlx_q4,gemma3); 'demo' for the demo model",
    )
    parser.add_argument("--out", type=Path, default=ROOT, help="repository root to write into")
    args = parser.parse_args()

    if transformers.__version__ != "5.24.0":
        print(f"warning: fixtures were recorded with transformers 5.24.0, this is {transformers.__version__}")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)  # module construction draws from the global generator
    check_chat_template()
    tok = build_tokenizer()

    wanted = [n for arg in args.only for n in arg.split(",") if n] if args.only else [*FIXTURES, *ASSISTANT_FIXTURES, "demo"]
    for name in wanted:
        if name == "demo":
            make_demo(tok, args.out / "models" / "demo")
        elif name in FIXTURES:
            make_fixture(name, FIXTURES[name], tok, args.out / "tests" / "fixtures")
        elif name in ASSISTANT_FIXTURES:
            make_assistant_fixture(name, ASSISTANT_FIXTURES[name], tok, args.out / "tests" / "fixtures")
        else:
            sys.exit(f"unknown fixture {name!r}; known: {', '.join([*FIXTURES, *ASSISTANT_FIXTURES])}, demo")


if __name__ == "__main__":
    main()
