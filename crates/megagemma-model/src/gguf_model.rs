//! A llama.cpp GGUF file as a megagemma model: metadata → [`ModelConfig`], tensor names →
//! the Hugging Face names the weight loader asks for. Quantized tensors stay quantized
//! ([`GgufMatrix`] dots them straight from the memory map).
//!
//! Supported architectures:
//! * `gemma3` (llama.cpp's converter stores Gemma 3 RMSNorm weights as `1 + w`, so norms are
//!   used as stored);
//! * `gemma4`, dense text models: per-layer embeddings, KV-shared layers, double-wide MLPs,
//!   sliding/full layers with their own head dims and KV head counts, the full layers'
//!   proportional RoPE (the converter's `rope_freqs` tensor), mixture-of-experts blocks (3-D
//!   `ffn_gate_up_exps` / `ffn_down_exps` tensors, one matrix per expert in place). Gemma 4 norms
//!   are stored as is (the converter's norm shift is 0) and used as `x̂·w`.

use crate::config::{
    check_limit, AttnKind, Family, ModelConfig, MoeConfig, RopeSpec, DEFAULT_MAX_POSITIONS, MAX_LAYERS,
};
use crate::gguf::{GgufArray, GgufFile, GgufMatrix, GgufValue};
use crate::matrix::RowDot;
use crate::weights::{Matrix, TensorSource};
use crate::{bail, Error, Result};

/// Build the config from `general.architecture` and its `ARCH.*` keys.
pub fn gguf_config(f: &GgufFile) -> Result<ModelConfig> {
    let arch = f.get_str("general.architecture").ok_or_else(|| Error::msg("GGUF file has no general.architecture"))?;
    // A shard of a split file (llama.cpp's `gguf-split`) holds only some of the tensors.
    if let Some(n) = f.metadata("split.count").and_then(GgufValue::as_u64).filter(|&n| n > 1) {
        bail!(
            "{} is one shard of a GGUF split into {n} files: merge them first (`llama-gguf-split --merge FIRST.gguf \
             OUT.gguf`)",
            f.path().display()
        );
    }
    match arch {
        "gemma3" => gemma3_config(f),
        "gemma4" => gemma4_config(f),
        _ => bail!("unsupported GGUF architecture `{arch}` (supported: gemma3, gemma4)"),
    }
}

/// One architecture's `ARCH.*` metadata, read typed: a missing key is `None` (or an error naming
/// it for `req`), a key of the wrong type or value an error naming it.
struct Meta<'a> {
    f: &'a GgufFile,
    arch: &'static str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    /// Any integer width, converted without truncation.
    fn opt(&self, k: &str) -> Result<Option<usize>> {
        typed(self.f, &self.key(k), "a non-negative integer", |v| v.as_u64()?.try_into().ok())
    }
    /// f32 or f64.
    fn float(&self, k: &str) -> Result<Option<f64>> {
        typed(self.f, &self.key(k), "a float", GgufValue::as_f64)
    }
    fn req(&self, k: &str) -> Result<usize> {
        self.opt(k)?.ok_or_else(|| Error::msg(format!("GGUF metadata is missing `{}`", self.key(k))))
    }
    /// A `tokenizer.ggml.*` token id (the full key).
    fn id(&self, k: &str) -> Result<Option<u32>> {
        typed(self.f, k, "a token id", |v| v.as_u64()?.try_into().ok())
    }

    /// The widths and counts every Gemma file states the same way.
    fn shape(&self) -> Result<Shape> {
        let hidden_size = self.req("embedding_length")?;
        let num_layers = check_limit(&self.key("block_count"), self.req("block_count")?, MAX_LAYERS)?;
        let num_heads = self.req("attention.head_count")?;
        if num_heads == 0 {
            bail!("GGUF metadata `{}` must be positive, got 0", self.key("attention.head_count"));
        }
        let embd = self
            .f
            .tensor("token_embd.weight")
            .ok_or_else(|| Error::msg("GGUF file has no tensor `token_embd.weight`"))?;
        let vocab_size = match embd.shape()[..] {
            [rows, _] => rows,
            ref other => bail!("GGUF tensor `token_embd.weight` has shape {other:?}, expected [vocab, hidden]"),
        };
        Ok(Shape { hidden_size, num_layers, num_heads, vocab_size })
    }

    /// `rope.scaling.*` on the full layers' RoPE (llama.cpp writes linear scaling only).
    fn rope_scaling(&self, rope: &mut RopeSpec) -> Result<()> {
        match self.f.metadata(&self.key("rope.scaling.type")) {
            None => {}
            Some(v) => match v.as_str() {
                Some("none") => {}
                Some("linear") => rope.factor = self.float("rope.scaling.factor")?.unwrap_or(1.0),
                _ => bail!("unsupported GGUF `{}` {v:?} (supported: none, linear)", self.key("rope.scaling.type")),
            },
        }
        Ok(())
    }

    /// End of sequence, and the end-of-turn token instruction-tuned files also name: generation
    /// stops at either.
    fn end_ids(&self) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            ids.extend(self.id(k)?);
        }
        Ok(ids)
    }
}

struct Shape {
    hidden_size: usize,
    num_layers: usize,
    num_heads: usize,
    vocab_size: usize,
}

fn plain_rope(theta: f64) -> RopeSpec {
    RopeSpec { theta, proportional: false, partial_rotary_factor: 1.0, factor: 1.0 }
}

fn gemma3_config(f: &GgufFile) -> Result<ModelConfig> {
    let arch = "gemma3";
    let m = Meta { f, arch };
    let Shape { hidden_size, num_layers, num_heads, vocab_size } = m.shape()?;
    let num_kv_heads = m.opt("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = m.opt("attention.key_length")?.unwrap_or(hidden_size / num_heads);
    let sliding_window = m.opt("attention.sliding_window")?.unwrap_or(4096);
    // llama.cpp's Gemma 3: every 6th layer is global; local layers use RoPE base 10000.
    let layer_types =
        (0..num_layers).map(|i| if (i + 1) % 6 == 0 { AttnKind::Full } else { AttnKind::Sliding }).collect();
    let mut rope_full = plain_rope(m.float("rope.freq_base")?.unwrap_or(1_000_000.0));
    m.rope_scaling(&mut rope_full)?;
    let eos_token_ids = m.end_ids()?;
    let config = ModelConfig {
        family: Family::Gemma3,
        architecture: format!("gguf:{arch}"),
        tensor_prefix: String::new(),
        vocab_size,
        hidden_size,
        intermediate_size: m.req("feed_forward_length")?,
        num_layers,
        num_heads,
        layer_types,
        head_dims: vec![head_dim; num_layers],
        kv_heads: vec![num_kv_heads; num_layers],
        sliding_window,
        max_position_embeddings: m.opt("context_length")?.unwrap_or(DEFAULT_MAX_POSITIONS),
        rope_sliding: plain_rope(10_000.0),
        rope_full,
        rms_norm_eps: m.float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        final_logit_softcapping: m.float("final_logit_softcapping")?,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        ple_dim: 0,
        ple_vocab_size: vocab_size,
        num_kv_shared_layers: 0,
        use_double_wide_mlp: false,
        attention_k_eq_v: false,
        moe: None,
        // query_pre_attn_scalar = head_dim for every Gemma 3 size llama.cpp converts but 27B,
        // whose converter writes attention.scale... use it when present.
        attn_scale: match m.float("attention.scale")? {
            Some(s) => s,
            None => (head_dim as f64).powf(-0.5),
        },
        eos_token_ids,
        bos_token_id: m.id("tokenizer.ggml.bos_token_id")?,
        pad_token_id: m.id("tokenizer.ggml.padding_token_id")?,
        quantization: None,
    };
    config.validate()?;
    Ok(config)
}

/// llama.cpp's `gemma4`: the keys its converter writes (TextModel's base set, Gemma3Model's and
/// Gemma4Model's), resolved the way the safetensors path resolves config.json. Values a file may
/// omit default as llama.cpp's loader defaults them (noted where it matters).
fn gemma4_config(f: &GgufFile) -> Result<ModelConfig> {
    let arch = "gemma4";
    let m = Meta { f, arch };
    let key = |k: &str| m.key(k);
    let Shape { hidden_size, num_layers, num_heads, vocab_size } = m.shape()?;

    // Layer types: `attention.sliding_window_pattern`, one bool per layer, true = sliding.
    let pattern_key = key("attention.sliding_window_pattern");
    let layer_types: Vec<AttnKind> = match f.get_bool_array(&pattern_key) {
        Some(p) if p.len() == num_layers => {
            p.iter().map(|&sliding| if sliding { AttnKind::Sliding } else { AttnKind::Full }).collect()
        }
        Some(p) => bail!("GGUF `{pattern_key}` has {} entries for {num_layers} layers", p.len()),
        None => bail!("GGUF metadata is missing `{pattern_key}` (a bool per layer)"),
    };

    // Head dims: key_length is the full layers' (global_head_dim), key_length_swa the sliding
    // layers' (llama.cpp defaults the latter to the former).
    let head_dim_full = m.req("attention.key_length")?;
    let head_dim_swa = m.opt("attention.key_length_swa")?.unwrap_or(head_dim_full);
    for (k, want) in [("attention.value_length", head_dim_full), ("attention.value_length_swa", head_dim_swa)] {
        if let Some(v) = m.opt(k)? {
            if v != want {
                bail!("GGUF `{}` = {v} differs from the key length {want}: unsupported", key(k));
            }
        }
    }
    let head_dims: Vec<usize> =
        layer_types.iter().map(|&t| if t == AttnKind::Full { head_dim_full } else { head_dim_swa }).collect();
    let kv_heads = per_layer(f, &key("attention.head_count_kv"), num_layers)?.unwrap_or(vec![num_heads; num_layers]);

    let num_kv_shared_layers = m.opt("attention.shared_kv_layers")?.unwrap_or(0);
    if num_kv_shared_layers >= num_layers && num_kv_shared_layers > 0 {
        bail!("GGUF `{}` = {num_kv_shared_layers} leaves no layer its own KV cache", key("attention.shared_kv_layers"));
    }
    let first_shared = num_layers - num_kv_shared_layers;

    // feed_forward_length: one value, or per layer (the converter's double-wide MLP: twice the
    // width on the KV-shared layers).
    let ff_key = key("feed_forward_length");
    let ff =
        per_layer(f, &ff_key, num_layers)?.ok_or_else(|| Error::msg(format!("GGUF metadata is missing `{ff_key}`")))?;
    let intermediate_size = ff[0];
    let use_double_wide_mlp = num_kv_shared_layers > 0 && ff[first_shared] == 2 * intermediate_size;
    for (i, &w) in ff.iter().enumerate() {
        let want = intermediate_size * if use_double_wide_mlp && i >= first_shared { 2 } else { 1 };
        if w != want {
            bail!(
                "GGUF `{ff_key}` = {ff:?} is not a Gemma 4 layout (one width, doubled on the KV-shared layers \
                 {first_shared}..): unsupported"
            );
        }
    }

    // Values = keys on full layers without `attn_v` (attention_k_eq_v): llama.cpp reads the
    // absence of the tensor, so does this.
    let owns_v = |i: usize| f.tensor(&format!("blk.{i}.attn_v.weight")).is_some();
    let full_owners: Vec<usize> = (0..first_shared).filter(|&i| layer_types[i] == AttnKind::Full).collect();
    let attention_k_eq_v = full_owners.iter().any(|&i| !owns_v(i));
    if attention_k_eq_v && full_owners.iter().any(|&i| owns_v(i)) {
        bail!("GGUF file has `attn_v` on some full-attention layers but not on others: unsupported");
    }
    if (0..first_shared).any(|i| layer_types[i] == AttnKind::Sliding && !owns_v(i)) {
        bail!("GGUF file lacks `attn_v` on a sliding-attention layer: unsupported");
    }

    // RoPE. Sliding layers: rope.freq_base_swa (llama.cpp defaults it to rope.freq_base), all
    // dims rotated. Full layers: rope.freq_base; the converter writes the proportional partial
    // rotation as `rope_freqs.weight` = [1.0] × rotated pairs + [1e30] × the others.
    let theta_full = m.float("rope.freq_base")?.unwrap_or(1_000_000.0);
    let theta_swa = m.float("rope.freq_base_swa")?.unwrap_or(theta_full);
    for (k, want) in [("rope.dimension_count", head_dim_full), ("rope.dimension_count_swa", head_dim_swa)] {
        if let Some(n) = m.opt(k)? {
            if n != want {
                bail!("GGUF `{}` = {n} (partial rotation over {want}-wide heads) is not supported", key(k));
            }
        }
    }
    let mut rope_full = plain_rope(theta_full);
    if let Some(info) = f.tensor("rope_freqs.weight") {
        let ff = f.tensor_to_f32(info)?;
        let rotated = ff.iter().take_while(|&&x| x == 1.0).count();
        if ff.len() != head_dim_full / 2 || rotated == 0 || ff[rotated..].iter().any(|&x| x < 1e29) {
            bail!(
                "GGUF `rope_freqs.weight` is not a proportional RoPE mask for {head_dim_full}-wide heads \
                 (expected [1.0; n] then [1e30; {} - n]): unsupported",
                head_dim_full / 2
            );
        }
        rope_full.proportional = true;
        rope_full.partial_rotary_factor = (2 * rotated) as f64 / head_dim_full as f64;
    }
    m.rope_scaling(&mut rope_full)?;

    // Mixture of experts (26B-A4B style): every layer has the dense MLP and the routed experts.
    let moe = match m.opt("expert_count")?.unwrap_or(0) {
        0 => {
            if let Some(t) = f.tensors().iter().find(|t| t.name.contains("_exps") || t.name.contains("ffn_gate_inp")) {
                bail!("GGUF tensor `{}` is an expert tensor but `{}` is missing or 0", t.name, key("expert_count"));
            }
            None
        }
        num_experts => Some(MoeConfig {
            num_experts,
            top_k: m.req("expert_used_count")?,
            intermediate_size: m.req("expert_feed_forward_length")?,
        }),
    };

    let ple_dim = m.opt("embedding_length_per_layer_input")?.unwrap_or(0);
    let ple_vocab_size = if ple_dim > 0 {
        let t = f
            .tensor("per_layer_token_embd.weight")
            .ok_or_else(|| Error::msg("GGUF file has no tensor `per_layer_token_embd.weight`"))?;
        match t.shape()[..] {
            [rows, _] => rows,
            ref other => bail!("GGUF tensor `per_layer_token_embd.weight` has shape {other:?}, expected 2-D"),
        }
    } else {
        vocab_size
    };

    let mut eos_token_ids = m.end_ids()?;
    // Gemma 4's end of turn, `<turn|>`: the converter names no id for it (llama.cpp finds it by
    // its text); instruction-tuned configs list it beside <eos>.
    if let Some(t) = f.get_str_array("tokenizer.ggml.tokens").and_then(|t| t.iter().position(|p| p == "<turn|>")) {
        if t < vocab_size && !eos_token_ids.contains(&(t as u32)) {
            eos_token_ids.push(t as u32);
        }
    }
    let config = ModelConfig {
        family: Family::Gemma4,
        architecture: format!("gguf:{arch}"),
        tensor_prefix: String::new(),
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        layer_types,
        head_dims,
        kv_heads,
        // transformers' Gemma 4 default.
        sliding_window: m.opt("attention.sliding_window")?.unwrap_or(512),
        max_position_embeddings: m.opt("context_length")?.unwrap_or(DEFAULT_MAX_POSITIONS),
        rope_sliding: plain_rope(theta_swa),
        rope_full,
        rms_norm_eps: m.float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        final_logit_softcapping: m.float("final_logit_softcapping")?,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        ple_dim,
        ple_vocab_size,
        num_kv_shared_layers,
        use_double_wide_mlp,
        attention_k_eq_v,
        moe,
        attn_scale: 1.0,
        eos_token_ids,
        bos_token_id: m.id("tokenizer.ggml.bos_token_id")?,
        pad_token_id: m.id("tokenizer.ggml.padding_token_id")?,
        quantization: None,
    };
    config.validate()?;
    Ok(config)
}

/// A per-layer integer key: one value for every layer, or an array of `n` (as llama.cpp reads
/// `head_count_kv` and `feed_forward_length`). `None` when absent.
fn per_layer(f: &GgufFile, key: &str, n: usize) -> Result<Option<Vec<usize>>> {
    let Some(v) = f.metadata(key) else { return Ok(None) };
    let bad = || Error::msg(format!("GGUF metadata `{key}` must be a non-negative integer or {n} of them, got {v:?}"));
    if let Some(x) = v.as_u64() {
        let x = usize::try_from(x).map_err(|_| bad())?;
        return Ok(Some(vec![x; n]));
    }
    let values = v.as_array().and_then(GgufArray::as_u64s).ok_or_else(bad)?;
    if values.len() != n {
        return Err(bad());
    }
    values.into_iter().map(|x| usize::try_from(x).map_err(|_| bad())).collect::<Result<Vec<_>>>().map(Some)
}

/// Metadata `key` converted by `conv`: `None` when absent, an error naming the key when its type
/// or value does not convert.
fn typed<T>(f: &GgufFile, key: &str, what: &str, conv: impl Fn(&GgufValue) -> Option<T>) -> Result<Option<T>> {
    match f.metadata(key) {
        None => Ok(None),
        Some(v) => {
            conv(v).map(Some).ok_or_else(|| Error::msg(format!("GGUF metadata `{key}` must be {what}, got {v:?}")))
        }
    }
}

/// GGUF tensors under the HF names the weight loader uses.
pub struct GgufSource<'a> {
    pub file: &'a GgufFile,
}

/// HF-relative name → llama.cpp name.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "embed_tokens.weight" => Some("token_embd.weight"),
        "norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        // Gemma 4 per-layer embeddings.
        "embed_tokens_per_layer.weight" => Some("per_layer_token_embd.weight"),
        "per_layer_model_projection.weight" => Some("per_layer_model_proj.weight"),
        "per_layer_projection_norm.weight" => Some("per_layer_proj_norm.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = hf.strip_prefix("layers.")?;
    let (idx, leaf) = rest.split_once('.')?;
    let leaf = match leaf {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
        "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        // Gemma 4.
        "per_layer_input_gate.weight" => "inp_gate.weight",
        "per_layer_projection.weight" => "proj.weight",
        "post_per_layer_input_norm.weight" => "post_norm.weight",
        "layer_scalar" => "layer_output_scale.weight",
        // Gemma 4 mixture of experts.
        "experts.gate_up_proj" => "ffn_gate_up_exps.weight",
        "experts.down_proj" => "ffn_down_exps.weight",
        "router.proj.weight" => "ffn_gate_inp.weight",
        "router.scale" => "ffn_gate_inp.scale",
        "router.per_expert_scale" => "ffn_down_exps.scale",
        "pre_feedforward_layernorm_2.weight" => "pre_ffw_norm_2.weight",
        "post_feedforward_layernorm_1.weight" => "post_ffw_norm_1.weight",
        "post_feedforward_layernorm_2.weight" => "post_ffw_norm_2.weight",
        _ => return None,
    };
    Some(format!("blk.{idx}.{leaf}"))
}

impl GgufSource<'_> {
    fn info(&self, hf: &str) -> Result<&crate::gguf::GgufTensorInfo> {
        let name = gguf_name(hf).ok_or_else(|| Error::msg(format!("no GGUF tensor corresponds to `{hf}`")))?;
        self.file
            .tensor(&name)
            .ok_or_else(|| Error::msg(format!("{}: missing tensor `{name}`", self.file.path().display())))
    }
}

impl TensorSource for GgufSource<'_> {
    fn matrix(&self, hf: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let info = self.info(hf)?;
        if info.shape() != [rows, cols] {
            bail!("tensor `{}` has shape {:?}, expected {:?}", info.name, info.shape(), [rows, cols]);
        }
        let m = GgufMatrix::from_tensor(self.file, info)?;
        debug_assert_eq!((m.rows(), m.cols()), (rows, cols));
        Ok(Box::new(m))
    }
    /// A 3-D expert tensor `[experts, rows', cols]` as `n` matrices of `rows` rows, in order
    /// (`n × rows = experts × rows'`: the fused gate/up tensor gives two per expert).
    fn matrices(&self, hf: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        let info = self.info(hf)?;
        let shape = info.shape();
        let fits = match shape[..] {
            [e, r, c] => c == cols && e.checked_mul(r) == n.checked_mul(rows),
            _ => false,
        };
        if !fits {
            bail!(
                "tensor `{}` has shape {shape:?}, expected {n} × [{rows}, {cols}] as [experts, rows, cols]",
                info.name
            );
        }
        let all = GgufMatrix::from_tensor(self.file, info)?;
        (0..n).map(|i| Ok(Box::new(all.row_range(i * rows, rows)?) as Matrix)).collect()
    }
    fn vector(&self, hf: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.info(hf)?;
        if info.shape() != [len] {
            bail!("tensor `{}` has shape {:?}, expected [{len}]", info.name, info.shape());
        }
        self.file.tensor_to_f32(info)
    }
    fn contains(&self, hf: &str) -> bool {
        gguf_name(hf).is_some_and(|n| self.file.tensor(&n).is_some())
    }
    /// Gemma 3 files store `1 + w`; Gemma 4 files store `w` (and its loader adds nothing).
    fn norms_include_one(&self) -> bool {
        self.file.architecture() == Some("gemma3")
    }
}
