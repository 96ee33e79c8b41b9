//! `Gemma4AssistantForCausalLM` `config.json` → [`AssistantConfig`], and the checks that an
//! assistant fits the target it drafts for.
//!
//! The assistant's `text_config` is an ordinary Gemma 4 text config, parsed by
//! [`ModelConfig::from_json`]; the keys around it (`backbone_hidden_size`, the centroid head) are
//! read here. Every layer of an assistant is KV-shared (`num_kv_shared_layers ==
//! num_hidden_layers`): its donors are the target's layers, so the text config is parsed as if it
//! owned its caches and the sharing is resolved against the target in [`AssistantConfig::donors`].

use crate::config::{AttnKind, Family, ModelConfig};
use crate::plan::ModelPlan;
use crate::{bail, Error, Result};
use serde_json::Value;
use std::path::Path;

/// The LM head of an assistant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadKind {
    /// Logits over the whole vocabulary from the (tied) embedding table.
    Dense,
    /// `use_ordered_embeddings`: score `num_centroids` centroids, then only the tokens of the
    /// `top_k` best ones (spec §6.4).
    Centroids { num_centroids: usize, top_k: usize },
}

#[derive(Clone, Debug)]
pub struct AssistantConfig {
    /// The assistant's own decoder (`text_config`), with `num_kv_shared_layers` set to 0 and
    /// `quantization` / `tie_word_embeddings` taken from the top level.
    pub text: ModelConfig,
    /// Hidden size of the target the assistant was trained with.
    pub backbone_hidden_size: usize,
    pub head: HeadKind,
    /// `num_kv_shared_layers` as written (0 means all, as transformers' `__post_init__` sets it).
    pub num_kv_shared_layers: usize,
}

/// Read `DIR/config.json` of an assistant checkpoint.
pub fn load_assistant_config(dir: &Path) -> Result<AssistantConfig> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| Error::msg(format!("cannot read {}: {e}", path.display())))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| Error::msg(format!("{} is not valid JSON: {e}", path.display())))?;
    AssistantConfig::from_json(&json).map_err(|e| Error::msg(format!("{}: {e}", path.display())))
}

impl AssistantConfig {
    pub fn from_json(root: &Value) -> Result<Self> {
        let obj = root.as_object().ok_or_else(|| Error::msg("config is not a JSON object"))?;
        let architecture = obj.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).unwrap_or("");
        let model_type = obj.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        if architecture != "Gemma4AssistantForCausalLM"
            && !(architecture.is_empty() && model_type == "gemma4_assistant")
        {
            bail!(
                "not an MTP assistant: architecture `{architecture}`, model_type `{model_type}` \
                 (expected Gemma4AssistantForCausalLM / gemma4_assistant)"
            );
        }
        let mut text = obj
            .get("text_config")
            .and_then(|v| v.as_object())
            .cloned()
            .ok_or_else(|| Error::msg("assistant config has no `text_config` object"))?;
        let layers = text.get("num_hidden_layers").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        let shared = match text.get("num_kv_shared_layers") {
            None | Some(Value::Null) => 0,
            Some(v) => {
                v.as_u64().ok_or_else(|| Error::msg("`num_kv_shared_layers` must be a non-negative integer"))? as usize
            }
        };
        // Parsed as a plain Gemma 4 decoder: its sharing points into the target, not into itself.
        text.insert("num_kv_shared_layers".into(), 0.into());
        text.remove("architectures");
        text.insert("model_type".into(), "gemma4_text".into());
        if let Some(tie) = obj.get("tie_word_embeddings").filter(|v| !v.is_null()) {
            text.insert("tie_word_embeddings".into(), tie.clone());
        }
        let mut text =
            ModelConfig::from_json(&Value::Object(text)).map_err(|e| Error::msg(format!("text_config: {e}")))?;
        text.quantization = obj.get("quantization").or_else(|| obj.get("quantization_config")).cloned();

        let usize_key = |k: &str, default: usize| -> Result<usize> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| Error::msg(format!("key `{k}` must be a non-negative integer, got {v}"))),
            }
        };
        // transformers' Gemma4AssistantConfig defaults.
        let backbone_hidden_size = usize_key("backbone_hidden_size", 1536)?;
        let ordered = match obj.get("use_ordered_embeddings") {
            None | Some(Value::Null) => false,
            Some(v) => v.as_bool().ok_or_else(|| Error::msg("`use_ordered_embeddings` must be a boolean"))?,
        };
        let head = if ordered {
            let num_centroids = usize_key("num_centroids", 2048)?;
            let top_k = usize_key("centroid_intermediate_top_k", 32)?;
            if num_centroids == 0 || !text.vocab_size.is_multiple_of(num_centroids) {
                bail!("num_centroids {num_centroids} must divide vocab_size {}", text.vocab_size);
            }
            if top_k == 0 || top_k > num_centroids {
                bail!("centroid_intermediate_top_k {top_k} must be in 1..={num_centroids}");
            }
            HeadKind::Centroids { num_centroids, top_k }
        } else {
            HeadKind::Dense
        };
        let num_kv_shared_layers = if shared == 0 { layers } else { shared };
        Ok(AssistantConfig { text, backbone_hidden_size, head, num_kv_shared_layers })
    }

    /// The architecture rules transformers enforces, and that the assistant fits `target`.
    /// Returns, per assistant layer, the target layer whose KV cache it reads: the last target
    /// layer of the same attention type that owns a cache.
    pub fn donors(&self, target: &ModelPlan) -> Result<Vec<usize>> {
        let c = &self.text;
        if self.num_kv_shared_layers != c.num_layers {
            bail!(
                "assistant num_kv_shared_layers is {} but every one of its {} layers must read the target's KV",
                self.num_kv_shared_layers,
                c.num_layers
            );
        }
        if c.ple_dim != 0 {
            bail!("assistant hidden_size_per_layer_input must be 0 (no per-layer embeddings), got {}", c.ple_dim);
        }
        if c.moe.is_some() {
            bail!("assistant enable_moe_block must be false");
        }
        if c.use_double_wide_mlp {
            bail!("assistant use_double_wide_mlp must be false");
        }
        if target.family != Family::Gemma4 {
            bail!("an MTP assistant drafts for Gemma 4 targets; this target is {:?}", target.family);
        }
        if self.backbone_hidden_size != target.hidden {
            bail!(
                "assistant backbone_hidden_size {} does not match the target's hidden size {}",
                self.backbone_hidden_size,
                target.hidden
            );
        }
        if c.vocab_size != target.vocab_size {
            bail!("assistant vocab_size {} does not match the target's {}", c.vocab_size, target.vocab_size);
        }
        let target_window = target.layers.iter().find_map(|l| l.window);
        if c.layer_types.contains(&AttnKind::Sliding) && target_window != Some(c.sliding_window) {
            bail!(
                "assistant sliding_window {} does not match the target's {}",
                c.sliding_window,
                target_window.map_or("(no sliding layers)".to_string(), |w| w.to_string())
            );
        }
        let mut donors = Vec::with_capacity(c.num_layers);
        for (i, &kind) in c.layer_types.iter().enumerate() {
            let kind_name = if kind == AttnKind::Full { "full-attention" } else { "sliding" };
            let Some(donor) = target.cache_layers().filter(|l| l.kind == kind).last() else {
                bail!("assistant layer {i} is {kind_name} but the target has no {kind_name} layer with a KV cache");
            };
            if donor.head_dim != c.head_dims[i] {
                bail!(
                    "assistant layer {i} ({kind_name}) has head_dim {} but target layer {} has {}",
                    c.head_dims[i],
                    donor.index,
                    donor.head_dim
                );
            }
            if donor.num_kv_heads != c.kv_heads[i] {
                bail!(
                    "assistant layer {i} ({kind_name}) has {} KV heads but target layer {} has {}",
                    c.kv_heads[i],
                    donor.index,
                    donor.num_kv_heads
                );
            }
            donors.push(donor.index);
        }
        Ok(donors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["Gemma4AssistantForCausalLM"], "backbone_hidden_size": 64,
               "use_ordered_embeddings": true, "num_centroids": 16, "centroid_intermediate_top_k": 4,
               "tie_word_embeddings": true,
               "text_config": {"model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16, "hidden_size_per_layer_input": 0,
                               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                               "full_attention"],
                               "per_layer_config": {"3": {"head_dim": 32}}}})
    }

    #[test]
    fn parses_head_and_all_shared_layers() {
        let c = AssistantConfig::from_json(&base()).unwrap();
        assert_eq!(c.head, HeadKind::Centroids { num_centroids: 16, top_k: 4 });
        assert_eq!(c.num_kv_shared_layers, 4, "0 / absent means every layer, as transformers sets it");
        assert_eq!(c.text.head_dims, vec![16, 16, 16, 32]);
        assert_eq!(c.text.num_kv_shared_layers, 0);
    }

    /// The published E2B / E4B shapes (spec §1.1, §6.1), hub-style configs: the assistants read
    /// the target's store layers 13/14 (E2B) and 22/23 (E4B), with head dims 256 and 512.
    #[test]
    fn e2b_and_e4b_assistants_read_the_store_layers() {
        for (hidden, kv, pattern, shared, donors) in
            [(1536, 1, 5, 20, [13, 13, 13, 14]), (2560, 2, 6, 18, [22, 22, 22, 23])]
        {
            let target = json!({"architectures": ["Gemma4ForCausalLM"], "vocab_size": 262144, "hidden_size": hidden,
                                "intermediate_size": 4 * hidden, "num_hidden_layers": if kv == 1 { 35 } else { 42 },
                                "num_attention_heads": 8, "num_key_value_heads": kv, "head_dim": 256,
                                "sliding_window_pattern": pattern, "num_kv_shared_layers": shared,
                                "use_double_wide_mlp": kv == 1});
            let target = ModelPlan::new(&ModelConfig::from_json(&target).unwrap()).unwrap();
            let assistant = json!({"architectures": ["Gemma4AssistantForCausalLM"], "backbone_hidden_size": hidden,
                                   "use_ordered_embeddings": true, "num_centroids": 2048,
                                   "centroid_intermediate_top_k": 32, "tie_word_embeddings": true,
                                   "text_config": {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 256,
                                                   "intermediate_size": 2048, "num_hidden_layers": 4,
                                                   "num_attention_heads": 4, "num_key_value_heads": kv, "head_dim": 256,
                                                   "global_head_dim": 512, "num_kv_shared_layers": 4,
                                                   "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                                   "final_logit_softcapping": null,
                                                   "layer_types": ["sliding_attention", "sliding_attention",
                                                                   "sliding_attention", "full_attention"]}});
            let c = AssistantConfig::from_json(&assistant).unwrap();
            assert_eq!(c.donors(&target).unwrap(), donors);
            assert_eq!(c.text.head_dims, vec![256, 256, 256, 512]);
            assert_eq!(c.text.final_logit_softcapping, None);
        }
    }

    #[test]
    fn rejects_bad_configs() {
        let mut v = base();
        v["architectures"] = json!(["Gemma4ForCausalLM"]);
        assert!(AssistantConfig::from_json(&v).unwrap_err().to_string().contains("not an MTP assistant"));
        let mut v = base();
        v["num_centroids"] = json!(24);
        assert!(AssistantConfig::from_json(&v).unwrap_err().to_string().contains("must divide vocab_size"));
        let mut v = base();
        v["centroid_intermediate_top_k"] = json!(17);
        assert!(AssistantConfig::from_json(&v).unwrap_err().to_string().contains("centroid_intermediate_top_k"));
    }
}
