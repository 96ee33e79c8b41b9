//! A llama.cpp GGUF file as a megagemma model: metadata → [`ModelConfig`], tensor names →
//! the Hugging Face names the weight loader asks for. Quantized tensors stay quantized
//! ([`GgufMatrix`] dots them straight from the memory map).
//!
//! Supported architectures: `gemma3` (llama.cpp's converter stores Gemma 3 RMSNorm weights as
//! `1 + w`, so norms are used as stored).

use crate::config::{check_limit, AttnKind, Family, ModelConfig, RopeSpec, MAX_LAYERS};
use crate::gguf::{GgufFile, GgufMatrix, GgufValue};
use crate::matrix::RowDot;
use crate::weights::{Matrix, TensorSource};
use crate::{bail, Error, Result};

/// Build the config from `general.architecture` and its `ARCH.*` keys.
pub fn gguf_config(f: &GgufFile) -> Result<ModelConfig> {
    let arch = f.get_str("general.architecture").ok_or_else(|| Error::msg("GGUF file has no general.architecture"))?;
    if arch != "gemma3" {
        bail!("unsupported GGUF architecture `{arch}` (supported: gemma3)");
    }
    let key = |k: &str| format!("{arch}.{k}");
    // Any integer width, converted without truncation; floats as f32 or f64.
    let opt = |k: &str| typed(f, &key(k), "a non-negative integer", |v| v.as_u64()?.try_into().ok());
    let float = |k: &str| typed(f, &key(k), "a float", GgufValue::as_f64);
    let req = |k: &str| -> Result<usize> {
        opt(k)?.ok_or_else(|| Error::msg(format!("GGUF metadata is missing `{}`", key(k))))
    };
    let hidden_size = req("embedding_length")?;
    let num_layers = check_limit(&key("block_count"), req("block_count")?, MAX_LAYERS)?;
    let num_heads = req("attention.head_count")?;
    if num_heads == 0 {
        bail!("GGUF metadata `{}` must be positive, got 0", key("attention.head_count"));
    }
    let num_kv_heads = opt("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = opt("attention.key_length")?.unwrap_or(hidden_size / num_heads);
    let embd =
        f.tensor("token_embd.weight").ok_or_else(|| Error::msg("GGUF file has no tensor `token_embd.weight`"))?;
    let vocab_size = match embd.shape()[..] {
        [rows, _] => rows,
        ref other => bail!("GGUF tensor `token_embd.weight` has shape {other:?}, expected [vocab, hidden]"),
    };
    let sliding_window = opt("attention.sliding_window")?.unwrap_or(4096);
    // llama.cpp's Gemma 3: every 6th layer is global; local layers use RoPE base 10000.
    let layer_types =
        (0..num_layers).map(|i| if (i + 1) % 6 == 0 { AttnKind::Full } else { AttnKind::Sliding }).collect();
    let plain = |theta| RopeSpec { theta, proportional: false, partial_rotary_factor: 1.0, factor: 1.0 };
    let mut rope_full = plain(float("rope.freq_base")?.unwrap_or(1_000_000.0));
    match f.metadata(&key("rope.scaling.type")) {
        None => {}
        Some(v) => match v.as_str() {
            Some("none") => {}
            Some("linear") => rope_full.factor = float("rope.scaling.factor")?.unwrap_or(1.0),
            _ => bail!("unsupported GGUF `{}` {v:?} (supported: none, linear)", key("rope.scaling.type")),
        },
    }
    let id = |k: &str| typed(f, k, "a token id", |v| v.as_u64()?.try_into().ok());
    let mut eos_token_ids = Vec::new();
    // Instruction-tuned files also name an end-of-turn token; generation stops at either.
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        eos_token_ids.extend(id(k)?);
    }
    let config = ModelConfig {
        family: Family::Gemma3,
        architecture: format!("gguf:{arch}"),
        tensor_prefix: String::new(),
        vocab_size,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_layers,
        num_heads,
        layer_types,
        head_dims: vec![head_dim; num_layers],
        kv_heads: vec![num_kv_heads; num_layers],
        sliding_window,
        rope_sliding: plain(10_000.0),
        rope_full,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        final_logit_softcapping: float("final_logit_softcapping")?,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        ple_dim: 0,
        ple_vocab_size: vocab_size,
        num_kv_shared_layers: 0,
        use_double_wide_mlp: false,
        attention_k_eq_v: false,
        moe: None,
        // query_pre_attn_scalar = head_dim for every Gemma 3 size llama.cpp converts but 27B,
        // whose converter writes attention.scale... use it when present.
        attn_scale: match float("attention.scale")? {
            Some(s) => s,
            None => (head_dim as f64).powf(-0.5),
        },
        eos_token_ids,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        pad_token_id: id("tokenizer.ggml.padding_token_id")?,
        quantization: None,
    };
    config.validate()?;
    Ok(config)
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
    fn matrices(&self, hf: &str, _n: usize, _rows: usize, _cols: usize) -> Result<Vec<Matrix>> {
        bail!("GGUF expert tensors (`{hf}`) are not supported")
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
    fn norms_include_one(&self) -> bool {
        true
    }
}
