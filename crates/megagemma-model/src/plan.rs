//! The layer plan: the single place where architecture becomes numbers.
//!
//! For each layer: attention type, head dim, heads, KV heads, which layer's KV cache it reads
//! (itself, or its donor when KV-shared), the sliding window, the RoPE frequencies, the MLP
//! width and which optional blocks (PLE, MoE, k_eq_v) it has. The CPU forward, the KV cache
//! allocator and any future backend read this; none re-derive architecture from the config.

use crate::config::{AttnKind, Family, ModelConfig, RopeSpec};
use crate::{bail, Result};

#[derive(Clone, Debug)]
pub struct LayerPlan {
    pub index: usize,
    pub kind: AttnKind,
    pub head_dim: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// The layer whose KV cache this layer attends over: itself, or its donor when KV-shared.
    pub kv_source: usize,
    /// Sliding window `W` (a query at i sees keys i−W+1 … i); `None` for full attention.
    pub window: Option<usize>,
    /// Inverse RoPE frequencies, one per rotation pair (`head_dim / 2`); zeros do not rotate.
    pub inv_freq: Vec<f32>,
    pub mlp_width: usize,
    pub has_ple: bool,
    pub has_moe: bool,
    /// Values are the (v-normed) key projection: no `v_proj`.
    pub k_eq_v: bool,
}

impl LayerPlan {
    pub fn is_kv_shared(&self) -> bool {
        self.kv_source != self.index
    }
    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

#[derive(Clone, Debug)]
pub struct ModelPlan {
    pub family: Family,
    pub hidden: usize,
    pub vocab_size: usize,
    pub layers: Vec<LayerPlan>,
    pub ple_dim: usize,
    pub eps: f32,
    pub attn_scale: f32,
    /// Gemma 4 RMS-normalises V (no weight); Gemma 3 does not.
    pub v_norm: bool,
    pub embed_scale: f32,
    pub final_softcap: Option<f32>,
    pub tied_embeddings: bool,
    /// Experts per token on MoE layers (0 without MoE).
    pub moe_top_k: usize,
    /// Experts per MoE layer and each expert's MLP width (0 without MoE).
    pub moe_experts: usize,
    pub moe_width: usize,
    /// The model's longest context (`max_position_embeddings`).
    pub max_positions: usize,
}

impl ModelPlan {
    pub fn new(c: &ModelConfig) -> Result<Self> {
        let n = c.num_layers;
        let first_shared = n - c.num_kv_shared_layers;
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let kind = c.layer_types[i];
            let kv_source = if i < first_shared {
                i
            } else {
                // The last non-shared layer of the same attention type owns the cache.
                match (0..first_shared).rev().find(|&j| c.layer_types[j] == kind) {
                    Some(j) => j,
                    None => bail!("layer {i} shares KV but no earlier non-shared layer has type {kind:?}"),
                }
            };
            if kv_source != i && (c.head_dims[kv_source] != c.head_dims[i] || c.kv_heads[kv_source] != c.kv_heads[i]) {
                bail!("layer {i} shares KV with layer {kv_source} but their head shapes differ");
            }
            let head_dim = c.head_dims[i];
            let rope = if kind == AttnKind::Full { &c.rope_full } else { &c.rope_sliding };
            let double = c.use_double_wide_mlp && i >= first_shared;
            layers.push(LayerPlan {
                index: i,
                kind,
                head_dim,
                num_heads: c.num_heads,
                num_kv_heads: c.kv_heads[i],
                kv_source,
                window: (kind == AttnKind::Sliding).then_some(c.sliding_window),
                inv_freq: inv_freq(rope, head_dim),
                mlp_width: c.intermediate_size * if double { 2 } else { 1 },
                has_ple: c.ple_dim > 0,
                has_moe: c.moe.is_some(),
                k_eq_v: c.attention_k_eq_v && kind == AttnKind::Full,
            });
        }
        Ok(ModelPlan {
            family: c.family,
            hidden: c.hidden_size,
            vocab_size: c.vocab_size,
            layers,
            ple_dim: c.ple_dim,
            eps: c.rms_norm_eps as f32,
            attn_scale: c.attn_scale as f32,
            v_norm: c.family == Family::Gemma4,
            // The exact sqrt(H): the reference computes in f32 and is checked against float64 runs.
            embed_scale: (c.hidden_size as f64).sqrt() as f32,
            final_softcap: c.final_logit_softcapping.map(|x| x as f32),
            tied_embeddings: c.tie_word_embeddings,
            moe_top_k: c.moe.as_ref().map_or(0, |m| m.top_k),
            moe_experts: c.moe.as_ref().map_or(0, |m| m.num_experts),
            moe_width: c.moe.as_ref().map_or(0, |m| m.intermediate_size),
            max_positions: c.max_position_embeddings,
        })
    }

    /// `[rows, cols]` of every weight matrix one decode step streams: the LM head, the PLE
    /// context projection, each layer's projections (its own K/V only when it owns a cache; no
    /// V on k_eq_v layers), PLE gate and projection, the MoE router and the `moe_top_k` routed
    /// experts. The embedding and PLE tables are gathered (one row each), not streamed.
    pub fn decode_matrices(&self) -> Vec<(usize, usize)> {
        let h = self.hidden;
        let mut m = vec![(self.vocab_size, h)];
        if self.ple_dim > 0 {
            m.push((self.layers.len() * self.ple_dim, h));
        }
        for l in &self.layers {
            m.push((l.q_width(), h));
            if !l.is_kv_shared() {
                m.push((l.kv_width(), h));
                if !l.k_eq_v {
                    m.push((l.kv_width(), h));
                }
            }
            m.push((h, l.q_width()));
            m.extend([(l.mlp_width, h), (l.mlp_width, h), (h, l.mlp_width)]);
            if l.has_ple {
                m.extend([(self.ple_dim, h), (h, self.ple_dim)]);
            }
            if l.has_moe {
                m.push((self.moe_experts, h));
                for _ in 0..self.moe_top_k.min(self.moe_experts) {
                    m.extend([(self.moe_width, h), (self.moe_width, h), (h, self.moe_width)]);
                }
            }
        }
        m
    }

    /// Weight bytes one decode step streams, given the stored size of a `[rows, cols]` matrix
    /// (e.g. `2·r·c` for bf16): the number every speed figure is measured against.
    pub fn decode_bytes(&self, stored: impl Fn(usize, usize) -> usize) -> usize {
        self.decode_matrices().into_iter().map(|(r, c)| stored(r, c)).sum()
    }

    /// Layers that own a KV cache (not KV-shared).
    pub fn cache_layers(&self) -> impl Iterator<Item = &LayerPlan> {
        self.layers.iter().filter(|l| !l.is_kv_shared())
    }
}

/// Inverse frequencies computed in f32 exactly as the reference does:
/// `1 / theta^(2i / d)` (default) or, for `proportional`, the first
/// `partial·d/2` pairs over denominator `d` and zeros after; divided by the linear factor.
pub fn inv_freq(rope: &RopeSpec, head_dim: usize) -> Vec<f32> {
    let pairs = head_dim / 2;
    let rotated = if rope.proportional { ((rope.partial_rotary_factor * head_dim as f64) as usize) / 2 } else { pairs };
    let theta = rope.theta as f32;
    (0..pairs)
        .map(|i| {
            if i < rotated {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0f32 / theta.powf(exponent) / rope.factor as f32
            } else {
                0.0
            }
        })
        .collect()
}
