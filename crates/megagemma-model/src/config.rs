//! `config.json` → one validated [`ModelConfig`].
//!
//! Accepts Gemma 4 text configs (`Gemma4ForCausalLM`, flat) and multimodal ones
//! (`Gemma4ForConditionalGeneration`, text fields nested under `text_config`), and Gemma 3 text
//! configs. Everything the rest of the crate needs is resolved here — defaults, per-layer
//! overrides, RoPE parameters — so no other code reads raw JSON.

use crate::{bail, Error, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Gemma4,
    Gemma3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    Sliding,
    Full,
}

/// How one attention type computes its rotary frequencies.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    /// `proportional` (Gemma 4 global layers): only the first `partial_rotary_factor` of the
    /// rotation pairs rotate, with frequencies computed over the full head dim.
    pub proportional: bool,
    pub partial_rotary_factor: f64,
    /// Linear position scaling (`rope_scaling.factor` / `rope_parameters.factor`); 1 = none.
    pub factor: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub family: Family,
    /// `architectures[0]` as written in config.json.
    pub architecture: String,
    /// Prefix of the text decoder's tensors: `model.` or `model.language_model.`.
    pub tensor_prefix: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub layer_types: Vec<AttnKind>,
    /// Resolved per layer (after `per_layer_config` / `global_head_dim` overrides).
    pub head_dims: Vec<usize>,
    pub kv_heads: Vec<usize>,
    pub sliding_window: usize,
    /// The longest context the model was trained for (`max_position_embeddings`; GGUF
    /// `context_length`): the default context length.
    pub max_position_embeddings: usize,
    pub rope_sliding: RopeSpec,
    pub rope_full: RopeSpec,
    pub rms_norm_eps: f64,
    pub final_logit_softcapping: Option<f64>,
    pub tie_word_embeddings: bool,
    /// PLE width (`hidden_size_per_layer_input`); 0 = no per-layer embeddings.
    pub ple_dim: usize,
    pub ple_vocab_size: usize,
    pub num_kv_shared_layers: usize,
    pub use_double_wide_mlp: bool,
    pub attention_k_eq_v: bool,
    pub moe: Option<MoeConfig>,
    /// Attention score scale: 1.0 for Gemma 4, `query_pre_attn_scalar^-0.5` for Gemma 3.
    pub attn_scale: f64,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// MLX-style `quantization` entry, when present (group size, bits, per-module overrides).
    pub quantization: Option<Value>,
}

/// Limits far above any Gemma (at most 62 layers, head dims up to 512) that keep the per-layer
/// lists a config implies (layer types, head dims, RoPE tables) small before any weight is read.
pub const MAX_LAYERS: usize = 1024;
pub const MAX_HEAD_DIM: usize = 8192;
/// `max_position_embeddings` when a config names none (transformers' Gemma 3 and Gemma 4 default).
pub const DEFAULT_MAX_POSITIONS: usize = 131_072;
/// Far above any Gemma's context (262,144): keeps cache sizes computed from it far from overflow.
pub const MAX_POSITIONS: usize = 1 << 24;

/// `value` of `key`, or an error when it is above `max`.
pub fn check_limit(key: &str, value: usize, max: usize) -> Result<usize> {
    if value > max {
        bail!("`{key}` {value} is larger than any supported model (at most {max})");
    }
    Ok(value)
}

/// Read and validate `DIR/config.json`.
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| Error::msg(format!("cannot read {}: {e}", path.display())))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| Error::msg(format!("{} is not valid JSON: {e}", path.display())))?;
    ModelConfig::from_json(&json).map_err(|e| Error::msg(format!("{}: {e}", path.display())))
}

/// Typed access to one JSON object with errors that name the key.
struct Obj<'a>(&'a serde_json::Map<String, Value>);

impl<'a> Obj<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn usize_req(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?.ok_or_else(|| Error::msg(format!("missing required key `{k}`")))
    }
    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| Error::msg(format!("key `{k}` must be a non-negative integer, got {v}"))),
        }
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| Error::msg(format!("key `{k}` must be a number, got {v}"))),
        }
    }
    fn bool_or(&self, k: &str, default: bool) -> Result<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| Error::msg(format!("key `{k}` must be a boolean, got {v}"))),
        }
    }
    fn str_opt(&self, k: &str) -> Option<&'a str> {
        self.get(k).and_then(|v| v.as_str())
    }
}

/// A token id: a non-negative integer that fits in `u32`, else an error naming the key.
fn token_id(key: &str, v: &Value) -> Result<u32> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| Error::msg(format!("key `{key}` must be a token id (an integer in 0..2^32), got {v}")))
}

/// `eos_token_id` may be one id or a list.
fn token_ids(key: &str, v: Option<&Value>) -> Result<Vec<u32>> {
    match v {
        None => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(|x| token_id(key, x)).collect(),
        Some(x) => Ok(vec![token_id(key, x)?]),
    }
}

/// An optional single id, looked up in the text config first, then at the top level.
fn optional_token_id(c: &Obj, top: &Obj, key: &str) -> Result<Option<u32>> {
    c.get(key).or_else(|| top.get(key)).map(|v| token_id(key, v)).transpose()
}

impl ModelConfig {
    pub fn from_json(root: &Value) -> Result<Self> {
        let root_obj = root.as_object().ok_or_else(|| Error::msg("config is not a JSON object"))?;
        let architecture = root_obj
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .unwrap_or("")
            .to_string();
        let model_type = root_obj.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let (family, nested) = match (architecture.as_str(), model_type) {
            ("Gemma4ForCausalLM", _) | ("", "gemma4_text") => (Family::Gemma4, false),
            ("Gemma4ForConditionalGeneration", _) | ("", "gemma4") => (Family::Gemma4, true),
            ("Gemma3ForCausalLM", _) | ("", "gemma3_text") => (Family::Gemma3, false),
            ("Gemma3ForConditionalGeneration", _) | ("", "gemma3") => (Family::Gemma3, true),
            ("", _) => bail!("unknown model_type `{model_type}` (supported: gemma4, gemma4_text, gemma3, gemma3_text)"),
            (a, _) => bail!(
                "unsupported architecture `{a}` (supported: Gemma4ForCausalLM, Gemma4ForConditionalGeneration, \
                 Gemma3ForCausalLM, Gemma3ForConditionalGeneration)"
            ),
        };
        let text = if nested {
            root_obj
                .get("text_config")
                .and_then(|v| v.as_object())
                .ok_or_else(|| Error::msg(format!("{architecture} config has no `text_config` object")))?
        } else {
            root_obj
        };
        let c = Obj(text);
        let top = Obj(root_obj);
        let tensor_prefix = if nested { "model.language_model." } else { "model." }.to_string();

        let vocab_size = c.usize_req("vocab_size")?;
        let hidden_size = c.usize_req("hidden_size")?;
        let intermediate_size = c.usize_req("intermediate_size")?;
        let num_layers = check_limit("num_hidden_layers", c.usize_req("num_hidden_layers")?, MAX_LAYERS)?;
        let num_heads = c.usize_req("num_attention_heads")?;
        // Defaults mirror transformers' Gemma3TextConfig / Gemma4TextConfig for keys a config omits.
        let num_kv_heads = c.usize_opt("num_key_value_heads")?.unwrap_or(4);
        let head_dim = c.usize_opt("head_dim")?.unwrap_or(256);
        let rms_norm_eps = c.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
        let sliding_window =
            c.usize_opt("sliding_window")?.unwrap_or(if family == Family::Gemma4 { 512 } else { 4096 });
        // transformers' Gemma3TextConfig and Gemma4TextConfig default.
        let max_position_embeddings = c.usize_opt("max_position_embeddings")?.unwrap_or(DEFAULT_MAX_POSITIONS);
        if let Some(act) = c.str_opt("hidden_activation").or_else(|| c.str_opt("hidden_act")) {
            if act != "gelu_pytorch_tanh" && act != "gelu_tanh" {
                bail!("unsupported hidden_activation `{act}` (only gelu_pytorch_tanh)");
            }
        }

        let layer_types = parse_layer_types(&c, family, num_layers)?;

        // Per-layer head dim / kv heads.
        let mut head_dims = vec![head_dim; num_layers];
        let mut kv_heads = vec![num_kv_heads; num_layers];
        let attention_k_eq_v = c.bool_or("attention_k_eq_v", false)?;
        if family == Family::Gemma4 {
            if let Some(plc) = c.get("per_layer_config") {
                let plc = plc.as_object().ok_or_else(|| Error::msg("`per_layer_config` must be an object"))?;
                for (key, ov) in plc {
                    let Ok(i) = key.parse::<usize>() else { continue }; // keyed by layer index
                    if i >= num_layers {
                        bail!("per_layer_config names layer {i} but the model has {num_layers} layers");
                    }
                    let ov = Obj(ov
                        .as_object()
                        .ok_or_else(|| Error::msg(format!("per_layer_config[{i}] must be an object")))?);
                    if let Some(h) = ov.usize_opt("head_dim")? {
                        head_dims[i] = h;
                    }
                    if let Some(k) = ov.usize_opt("num_key_value_heads")? {
                        kv_heads[i] = k;
                    }
                }
            } else {
                // Hub-style config: global layers take global_head_dim (default 512) and, only with
                // attention_k_eq_v, num_global_key_value_heads.
                let global_head_dim = c.usize_opt("global_head_dim")?.unwrap_or(512);
                let global_kv = c.usize_opt("num_global_key_value_heads")?;
                for i in 0..num_layers {
                    if layer_types[i] == AttnKind::Full {
                        head_dims[i] = global_head_dim;
                        if attention_k_eq_v {
                            if let Some(g) = global_kv {
                                kv_heads[i] = g;
                            }
                        }
                    }
                }
            }
        }

        let (rope_sliding, rope_full) = parse_rope(&c, family)?;

        let moe = if c.bool_or("enable_moe_block", false)? {
            Some(MoeConfig {
                num_experts: c.usize_req("num_experts")?,
                top_k: c.usize_req("top_k_experts")?,
                intermediate_size: c.usize_req("moe_intermediate_size")?,
            })
        } else {
            None
        };

        let num_kv_shared_layers =
            if family == Family::Gemma4 { c.usize_opt("num_kv_shared_layers")?.unwrap_or(0) } else { 0 };
        let ple_dim =
            if family == Family::Gemma4 { c.usize_opt("hidden_size_per_layer_input")?.unwrap_or(256) } else { 0 };

        let attn_scale = match family {
            Family::Gemma4 => 1.0,
            Family::Gemma3 => {
                let q = c.f64_opt("query_pre_attn_scalar")?.unwrap_or(256.0);
                q.powf(-0.5)
            }
        };
        let final_logit_softcapping = c.f64_opt("final_logit_softcapping")?;
        // `attn_logit_softcapping` is deliberately ignored: transformers' Gemma 3 reads it but never
        // applies it (released Gemma 3 configs set it to null), and Gemma 4 has none.
        // `tie_word_embeddings` may live at the top level of multimodal configs.
        let tie_word_embeddings = match c.get("tie_word_embeddings") {
            Some(_) => c.bool_or("tie_word_embeddings", true)?,
            None => top.bool_or("tie_word_embeddings", true)?,
        };
        let eos_token_ids = match c.get("eos_token_id") {
            Some(v) => token_ids("eos_token_id", Some(v))?,
            None => token_ids("eos_token_id", top.get("eos_token_id"))?,
        };
        let bos_token_id = optional_token_id(&c, &top, "bos_token_id")?;
        let pad_token_id = optional_token_id(&c, &top, "pad_token_id")?;
        let quantization = top.get("quantization").or_else(|| top.get("quantization_config")).cloned();

        let config = ModelConfig {
            family,
            architecture,
            tensor_prefix,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            layer_types,
            head_dims,
            kv_heads,
            sliding_window,
            max_position_embeddings,
            rope_sliding,
            rope_full,
            rms_norm_eps,
            final_logit_softcapping,
            tie_word_embeddings,
            ple_dim,
            ple_vocab_size: c.usize_opt("vocab_size_per_layer_input")?.unwrap_or(262_144),
            num_kv_shared_layers,
            use_double_wide_mlp: family == Family::Gemma4 && c.bool_or("use_double_wide_mlp", false)?,
            attention_k_eq_v,
            moe,
            attn_scale,
            eos_token_ids,
            bos_token_id,
            pad_token_id,
            quantization,
        };
        config.validate()?;
        Ok(config)
    }
}

impl ModelConfig {
    /// The one check every config goes through, whatever its source (config.json, GGUF metadata,
    /// a draft model's config): sizes positive and consistent, per-layer lists complete, every
    /// float finite, token ids inside the vocabulary, and every weight shape and layer width
    /// computable without overflow. Errors name the key and the bad value.
    pub fn validate(&self) -> Result<()> {
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("sliding_window", self.sliding_window),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                bail!("`{key}` must be positive, got 0");
            }
        }
        check_limit("max_position_embeddings", self.max_position_embeddings, MAX_POSITIONS)?;
        let n = check_limit("num_hidden_layers", self.num_layers, MAX_LAYERS)?;
        for (key, len) in [
            ("layer_types", self.layer_types.len()),
            ("head_dim", self.head_dims.len()),
            ("num_key_value_heads", self.kv_heads.len()),
        ] {
            if len != n {
                bail!("`{key}` has {len} per-layer entries but num_hidden_layers is {n}");
            }
        }
        for i in 0..n {
            let (kv, hd) = (self.kv_heads[i], self.head_dims[i]);
            if kv == 0 || !self.num_heads.is_multiple_of(kv) {
                bail!(
                    "layer {i}: num_attention_heads {} is not a multiple of num_key_value_heads {kv}",
                    self.num_heads
                );
            }
            if hd == 0 || !hd.is_multiple_of(2) {
                bail!("layer {i}: head_dim {hd} must be even and positive");
            }
            check_limit(&format!("layer {i}: head_dim"), hd, MAX_HEAD_DIM)?;
            sizes_product(
                &format!("layer {i}: num_attention_heads × head_dim"),
                &[self.num_heads, hd, self.hidden_size],
            )?;
        }
        if self.num_kv_shared_layers >= n && self.num_kv_shared_layers > 0 {
            bail!("num_kv_shared_layers {} leaves no layer to own a KV cache ({n} layers)", self.num_kv_shared_layers);
        }
        if self.ple_dim > 0 {
            if self.ple_vocab_size < self.vocab_size {
                bail!(
                    "vocab_size_per_layer_input {} is smaller than vocab_size {}: token ids past it have no \
                     per-layer embedding",
                    self.ple_vocab_size,
                    self.vocab_size
                );
            }
            sizes_product(
                "vocab_size_per_layer_input × num_hidden_layers × hidden_size_per_layer_input",
                &[self.ple_vocab_size, n, self.ple_dim],
            )?;
            sizes_product(
                "num_hidden_layers × hidden_size_per_layer_input × hidden_size",
                &[n, self.ple_dim, self.hidden_size],
            )?;
        }
        sizes_product("vocab_size × hidden_size", &[self.vocab_size, self.hidden_size])?;
        // Double-wide MLP layers have twice intermediate_size.
        sizes_product("2 × intermediate_size × hidden_size", &[2, self.intermediate_size, self.hidden_size])?;
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.intermediate_size == 0 {
                bail!(
                    "num_experts ({}) and moe_intermediate_size ({}) must be positive",
                    m.num_experts,
                    m.intermediate_size
                );
            }
            if m.top_k == 0 || m.top_k > m.num_experts {
                bail!("top_k_experts {} must be in 1..={}", m.top_k, m.num_experts);
            }
            sizes_product(
                "2 × num_experts × moe_intermediate_size × hidden_size",
                &[2, m.num_experts, m.intermediate_size, self.hidden_size],
            )?;
        }
        for (key, rope) in [("sliding_attention rope", &self.rope_sliding), ("full_attention rope", &self.rope_full)] {
            if !(rope.theta.is_finite() && rope.theta > 0.0) {
                bail!("{key}: rope_theta must be a positive number, got {}", rope.theta);
            }
            if !(rope.factor.is_finite() && rope.factor > 0.0) {
                bail!("{key}: factor must be a positive number, got {}", rope.factor);
            }
            if !(rope.partial_rotary_factor > 0.0 && rope.partial_rotary_factor <= 1.0) {
                bail!("{key}: partial_rotary_factor must be in (0, 1], got {}", rope.partial_rotary_factor);
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            bail!("`rms_norm_eps` must be a non-negative number, got {}", self.rms_norm_eps);
        }
        if let Some(cap) = self.final_logit_softcapping {
            if !(cap.is_finite() && cap > 0.0) {
                bail!("`final_logit_softcapping` must be a positive number, got {cap}");
            }
        }
        if !(self.attn_scale.is_finite() && self.attn_scale > 0.0) {
            bail!(
                "attention scale (query_pre_attn_scalar / attention.scale) must be positive, got {}",
                self.attn_scale
            );
        }
        let ids = self.eos_token_ids.iter().map(|&id| ("eos_token_id", id));
        let ids = ids.chain(self.bos_token_id.map(|id| ("bos_token_id", id)));
        for (key, id) in ids.chain(self.pad_token_id.map(|id| ("pad_token_id", id))) {
            if id as usize >= self.vocab_size {
                bail!("`{key}` {id} is outside the vocabulary (vocab_size {})", self.vocab_size);
            }
        }
        if let Some(q) = &self.quantization {
            if !q.is_object() {
                bail!("`quantization` must be an object, got {q}");
            }
        }
        Ok(())
    }
}

/// The product of `dims`, or an error naming `what` when it overflows.
fn sizes_product(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::msg(format!("{what} = {dims:?} overflows")))
}

fn parse_layer_types(c: &Obj, family: Family, num_layers: usize) -> Result<Vec<AttnKind>> {
    let mut types = match c.get("layer_types") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(AttnKind::Sliding),
                Some("full_attention") => Ok(AttnKind::Full),
                _ => Err(Error::msg(format!("unknown layer type {t} in `layer_types`"))),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(v) => bail!("`layer_types` must be a list, got {v}"),
        None => {
            // Gemma 4 default 5:1; Gemma 3 `sliding_window_pattern` (default 6).
            let pattern = c.usize_opt("sliding_window_pattern")?.unwrap_or(6).max(1);
            (0..num_layers).map(|i| if (i + 1) % pattern == 0 { AttnKind::Full } else { AttnKind::Sliding }).collect()
        }
    };
    if types.len() != num_layers {
        bail!("`layer_types` has {} entries but num_hidden_layers is {num_layers}", types.len());
    }
    // Gemma 4 forces the last layer to full attention.
    if let (Family::Gemma4, Some(last)) = (family, types.last_mut()) {
        *last = AttnKind::Full;
    }
    Ok(types)
}

fn rope_spec(p: &Obj, default_theta: f64) -> Result<RopeSpec> {
    let rope_type = p.str_opt("rope_type").or_else(|| p.str_opt("type")).unwrap_or("default");
    let proportional = match rope_type {
        "default" | "linear" => false,
        "proportional" => true,
        other => bail!("unsupported rope_type `{other}` (supported: default, linear, proportional)"),
    };
    let factor = p.f64_opt("factor")?.unwrap_or(1.0);
    if factor.is_nan() || factor <= 0.0 {
        bail!("rope factor must be positive, got {factor}");
    }
    let partial = p.f64_opt("partial_rotary_factor")?.unwrap_or(1.0);
    if !(partial > 0.0 && partial <= 1.0) {
        bail!("partial_rotary_factor must be in (0, 1], got {partial}");
    }
    Ok(RopeSpec {
        theta: p.f64_opt("rope_theta")?.unwrap_or(default_theta),
        proportional,
        partial_rotary_factor: partial,
        factor,
    })
}

fn parse_rope(c: &Obj, family: Family) -> Result<(RopeSpec, RopeSpec)> {
    let plain = |theta| RopeSpec { theta, proportional: false, partial_rotary_factor: 1.0, factor: 1.0 };
    let (default_sliding, default_full) = match family {
        Family::Gemma4 => {
            (plain(10_000.0), RopeSpec { proportional: true, partial_rotary_factor: 0.25, ..plain(1_000_000.0) })
        }
        Family::Gemma3 => (plain(10_000.0), plain(1_000_000.0)),
    };
    // Current configs: `rope_parameters` keyed by layer type.
    if let Some(rp) = c.get("rope_parameters") {
        let rp = rp.as_object().ok_or_else(|| Error::msg("`rope_parameters` must be an object"))?;
        let get = |k: &str, d: RopeSpec| -> Result<RopeSpec> {
            match rp.get(k).and_then(|v| v.as_object()) {
                Some(o) => rope_spec(&Obj(o), d.theta),
                None => Ok(d),
            }
        };
        return Ok((get("sliding_attention", default_sliding)?, get("full_attention", default_full)?));
    }
    if family == Family::Gemma4 {
        return Ok((default_sliding, default_full));
    }
    // Older Gemma 3 configs: global `rope_theta` with optional linear `rope_scaling`; local
    // layers use `rope_local_base_freq`, never scaled.
    let mut full = plain(c.f64_opt("rope_theta")?.unwrap_or(default_full.theta));
    if let Some(Value::Object(rs)) = c.get("rope_scaling") {
        full.factor = rope_spec(&Obj(rs), full.theta)?.factor;
    }
    let sliding = plain(c.f64_opt("rope_local_base_freq")?.unwrap_or(default_sliding.theta));
    Ok((sliding, full))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["Gemma4ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4})
    }

    #[test]
    fn hub_style_config_resolves_like_transformers() {
        // No layer_types / per_layer_config: 5:1 pattern, last layer forced to full, global layers
        // take global_head_dim (default 512); kv-head override only with attention_k_eq_v.
        let mut v = base();
        v["num_global_key_value_heads"] = json!(1);
        let c = ModelConfig::from_json(&v).unwrap();
        use AttnKind::*;
        assert_eq!(c.layer_types, vec![Sliding, Sliding, Sliding, Sliding, Sliding, Full, Full]);
        assert_eq!(c.head_dims, vec![256, 256, 256, 256, 256, 512, 512]);
        assert_eq!(c.kv_heads, vec![4; 7], "num_global_key_value_heads ignored without k_eq_v");
        assert_eq!(c.ple_dim, 256, "transformers' default hidden_size_per_layer_input");
        assert!(c.rope_full.proportional && c.rope_full.partial_rotary_factor == 0.25);
        v["attention_k_eq_v"] = json!(true);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.kv_heads, vec![4, 4, 4, 4, 4, 1, 1]);
    }

    #[test]
    fn per_layer_config_wins_over_global_keys() {
        let mut v = base();
        v["global_head_dim"] = json!(512);
        v["per_layer_config"] = json!({"5": {"head_dim": 32, "num_key_value_heads": 2}, "6": {"head_dim": 32}});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.head_dims, vec![256, 256, 256, 256, 256, 32, 32]);
        assert_eq!(c.kv_heads, vec![4, 4, 4, 4, 4, 2, 4]);
    }

    #[test]
    fn nested_text_config_and_errors() {
        let v = json!({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": base()});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.tensor_prefix, "model.language_model.");
        let err = ModelConfig::from_json(&json!({"architectures": ["Gemma4ForConditionalGeneration"]})).unwrap_err();
        assert!(err.to_string().contains("text_config"), "{err}");
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("not a multiple"));
        let mut v = base();
        v["rope_parameters"] = json!({"full_attention": {"rope_type": "yarn"}});
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("unsupported rope_type"));
    }

    #[test]
    fn gemma3_defaults() {
        let v = json!({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                       "rope_scaling": {"rope_type": "linear", "factor": 8.0}});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.layer_types[5], AttnKind::Full);
        assert_eq!(c.attn_scale, 256f64.powf(-0.5));
        assert_eq!((c.rope_full.theta, c.rope_full.factor), (1e6, 8.0));
        assert_eq!((c.rope_sliding.theta, c.rope_sliding.factor), (1e4, 1.0));
        assert_eq!(c.ple_dim, 0);
        assert_eq!(c.max_position_embeddings, DEFAULT_MAX_POSITIONS);
        let mut v = v;
        v["max_position_embeddings"] = json!(32768);
        assert_eq!(ModelConfig::from_json(&v).unwrap().max_position_embeddings, 32768);
        for bad in [0, MAX_POSITIONS + 1] {
            v["max_position_embeddings"] = json!(bad);
            let e = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(e.contains("max_position_embeddings"), "{bad}: {e}");
        }
    }
}
