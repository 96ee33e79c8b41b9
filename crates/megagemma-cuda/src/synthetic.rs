//! Synthetic models: the real shapes of Gemma 4 E2B / E4B (spec §1.1) or a tiny one, with random
//! 4-bit weights generated on the device, so the decode speed can be measured without a checkpoint.

use crate::weights::{DevLayer, DevPleInput, DevPleLayer, DevWeights, Placer};
use megagemma_model::config::{AttnKind, Family, ModelConfig, RopeSpec};
use megagemma_model::plan::ModelPlan;
use megagemma_model::{bail, Result};

/// Group size of the synthetic 4-bit matrices (MLX's default).
pub const SYNTHETIC_GROUP: usize = 64;

/// The text-decoder config of `name`: `e2b`, `e4b` or `tiny`.
pub fn synthetic_config(name: &str) -> Result<ModelConfig> {
    // (layers, hidden, kv heads, kv-shared layers, sliding per full, double-wide MLP)
    let (layers, hidden, kv, shared, period, double) = match name {
        "e2b" => (35, 1536, 1, 20, 5, true),
        "e4b" => (42, 2560, 2, 18, 6, false),
        "tiny" => (6, 256, 1, 2, 3, true),
        other => bail!("unknown synthetic model '{other}' (expected e2b, e4b or tiny)"),
    };
    let tiny = name == "tiny";
    let (vocab, head, global_head, window, ple) =
        if tiny { (4096, 64, 128, 32, 64) } else { (262144, 256, 512, 512, 256) };
    let layer_types: Vec<AttnKind> =
        (0..layers).map(|i| if i % period == period - 1 { AttnKind::Full } else { AttnKind::Sliding }).collect();
    let head_dims = layer_types.iter().map(|k| if *k == AttnKind::Full { global_head } else { head }).collect();
    Ok(ModelConfig {
        family: Family::Gemma4,
        architecture: format!("synthetic-{name}"),
        tensor_prefix: String::new(),
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: 4 * hidden,
        num_layers: layers,
        num_heads: 8,
        layer_types,
        head_dims,
        kv_heads: vec![kv; layers],
        sliding_window: window,
        rope_sliding: RopeSpec { theta: 10_000.0, proportional: false, partial_rotary_factor: 1.0, factor: 1.0 },
        rope_full: RopeSpec { theta: 1_000_000.0, proportional: true, partial_rotary_factor: 0.25, factor: 1.0 },
        rms_norm_eps: 1e-6,
        final_logit_softcapping: Some(30.0),
        tie_word_embeddings: true,
        ple_dim: ple,
        ple_vocab_size: vocab,
        num_kv_shared_layers: shared,
        use_double_wide_mlp: double,
        attention_k_eq_v: false,
        moe: None,
        attn_scale: 1.0,
        eos_token_ids: vec![1],
        bos_token_id: Some(2),
        pad_token_id: Some(0),
        quantization: None,
    })
}

/// Random 4-bit weights for every matrix of the plan (PLE table and embedding included), unit norms.
pub fn place_synthetic(p: &mut Placer, plan: &ModelPlan) -> Result<DevWeights> {
    let (h, g) = (plan.hidden, SYNTHETIC_GROUP);
    let (l, pd) = (plan.layers.len(), plan.ple_dim);
    let embed = p.q4_random(plan.vocab_size, h, g, false)?;
    // Tied head: random like the embedding, in the matvec layout (same bytes per token).
    let lm_head = p.q4_random(plan.vocab_size, h, g, true)?;
    let ple = if pd > 0 {
        Some(DevPleInput {
            table: p.q4_random(plan.vocab_size, l * pd, g, false)?,
            proj: p.q4_random(l * pd, h, g, true)?,
            norm: p.vec_const(pd, 1.0)?,
        })
    } else {
        None
    };
    let mut layers = Vec::with_capacity(l);
    for lp in &plan.layers {
        let owns = !lp.is_kv_shared();
        let (qw, kvw, i) = (lp.q_width(), lp.kv_width(), lp.mlp_width);
        layers.push(DevLayer {
            input_norm: p.vec_const(h, 1.0)?,
            q: p.q4_random(qw, h, g, true)?,
            q_norm: p.vec_const(lp.head_dim, 1.0)?,
            k: if owns { Some(p.q4_random(kvw, h, g, true)?) } else { None },
            v: if owns { Some(p.q4_random(kvw, h, g, true)?) } else { None },
            k_norm: if owns { Some(p.vec_const(lp.head_dim, 1.0)?) } else { None },
            o: p.q4_random(h, qw, g, true)?,
            post_attn_norm: p.vec_const(h, 1.0)?,
            pre_ffn_norm: p.vec_const(h, 1.0)?,
            gate: p.q4_random(i, h, g, true)?,
            up: p.q4_random(i, h, g, true)?,
            down: p.q4_random(h, i, g, true)?,
            post_ffn_norm: p.vec_const(h, 1.0)?,
            ple: if pd > 0 {
                Some(DevPleLayer {
                    gate: p.q4_random(pd, h, g, true)?,
                    proj: p.q4_random(h, pd, g, true)?,
                    post_norm: p.vec_const(h, 1.0)?,
                })
            } else {
                None
            },
            moe: None,
            layer_scalar: 1.0,
            inv_freq: p.vec(&lp.inv_freq)?,
        });
    }
    Ok(DevWeights { embed, ple, layers, final_norm: p.vec_const(h, 1.0)?, lm_head })
}

/// Bytes of a `[rows, cols]` 4-bit matrix as stored on disk (codes plus a bf16 scale and bias
/// per group), the convention of `RowDot::stored_bytes`.
fn q4_stored(rows: usize, cols: usize) -> usize {
    rows * cols / 2 + rows * cols / SYNTHETIC_GROUP * 4
}

/// Weight bytes one decode step streams (as `ModelWeights::decode_bytes`: everything but the gathers).
pub fn synthetic_decode_bytes(plan: &ModelPlan) -> usize {
    let h = plan.hidden;
    let mut b = q4_stored(plan.vocab_size, h);
    if plan.ple_dim > 0 {
        b += q4_stored(plan.layers.len() * plan.ple_dim, h);
    }
    for lp in &plan.layers {
        b += q4_stored(lp.q_width(), h) + q4_stored(h, lp.q_width());
        if !lp.is_kv_shared() {
            b += 2 * q4_stored(lp.kv_width(), h);
        }
        b += 3 * q4_stored(lp.mlp_width, h);
        if lp.has_ple {
            b += 2 * q4_stored(plan.ple_dim, h);
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_plans_match_the_spec() {
        let e4b = ModelPlan::new(&synthetic_config("e4b").unwrap()).unwrap();
        assert_eq!(e4b.layers.len(), 42);
        let full: Vec<usize> = e4b.layers.iter().filter(|l| l.kind == AttnKind::Full).map(|l| l.index).collect();
        assert_eq!(full, [5, 11, 17, 23, 29, 35, 41]);
        assert_eq!(e4b.layers[30].kv_source, 22);
        assert_eq!(e4b.layers[41].kv_source, 23);
        let e2b = ModelPlan::new(&synthetic_config("e2b").unwrap()).unwrap();
        assert_eq!(e2b.layers[14].mlp_width, 6144);
        assert_eq!(e2b.layers[15].mlp_width, 12288);
        assert_eq!(e2b.layers[20].kv_source, 13);
        assert_eq!(e2b.layers[34].kv_source, 14);
        assert!(synthetic_config("e9b").is_err());
    }

    #[test]
    fn e4b_q4_streams_two_to_four_gigabytes_per_token() {
        let plan = ModelPlan::new(&synthetic_config("e4b").unwrap()).unwrap();
        let gb = synthetic_decode_bytes(&plan) as f64 / 1e9;
        assert!((2.0..4.0).contains(&gb), "{gb} GB");
    }
}
