//! Synthetic models: the real shapes of Gemma 4 E2B / E4B (spec §1.1), 26B-A4B (§1.2: MoE, k_eq_v
//! global layers) or a tiny one, with random 4-bit weights generated on the device, so the decode
//! speed can be measured without a checkpoint.

use crate::weights::{DevLayer, DevMoe, DevPleInput, DevPleLayer, DevWeights, Placer};
use megagemma_model::config::{AttnKind, Family, ModelConfig, MoeConfig, RopeSpec};
use megagemma_model::plan::{LayerPlan, ModelPlan};
use megagemma_model::{bail, Result};

/// Group size of the synthetic 4-bit matrices (MLX's default).
pub const SYNTHETIC_GROUP: usize = 64;

/// The text-decoder config of `name`: `e2b`, `e4b`, `26b-a4b`, `31b` or `tiny`.
pub fn synthetic_config(name: &str) -> Result<ModelConfig> {
    match name {
        "26b-a4b" => return Ok(config_large(name)),
        "31b" => return Ok(config_large(name)),
        _ => {}
    }
    // (layers, hidden, kv heads, kv-shared layers, sliding per full, double-wide MLP)
    let (layers, hidden, kv, shared, period, double) = match name {
        "e2b" => (35, 1536, 1, 20, 5, true),
        "e4b" => (42, 2560, 2, 18, 6, false),
        "tiny" => (6, 256, 1, 2, 3, true),
        other => bail!("unknown synthetic model '{other}' (expected e2b, e4b, 26b-a4b, 31b or tiny)"),
    };
    let tiny = name == "tiny";
    let (vocab, head, global_head, window, ple) =
        if tiny { (4096, 64, 128, 32, 64) } else { (262144, 256, 512, 512, 256) };
    let layer_types = pattern(layers, period);
    let head_dims = layer_types.iter().map(|k| if *k == AttnKind::Full { global_head } else { head }).collect();
    Ok(ModelConfig {
        architecture: format!("synthetic-{name}"),
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: 4 * hidden,
        num_layers: layers,
        num_heads: 8,
        layer_types,
        head_dims,
        kv_heads: vec![kv; layers],
        sliding_window: window,
        ple_dim: ple,
        ple_vocab_size: vocab,
        num_kv_shared_layers: shared,
        use_double_wide_mlp: double,
        ..base_config()
    })
}

/// `period − 1` sliding layers, then a full one, repeated.
fn pattern(layers: usize, period: usize) -> Vec<AttnKind> {
    (0..layers).map(|i| if i % period == period - 1 { AttnKind::Full } else { AttnKind::Sliding }).collect()
}

/// What every synthetic shape shares (Gemma 4 defaults).
fn base_config() -> ModelConfig {
    ModelConfig {
        family: Family::Gemma4,
        architecture: String::new(),
        tensor_prefix: String::new(),
        vocab_size: 262144,
        hidden_size: 0,
        intermediate_size: 0,
        num_layers: 0,
        num_heads: 0,
        layer_types: vec![],
        head_dims: vec![],
        kv_heads: vec![],
        sliding_window: 0,
        // E2B and E4B (spec §1.1); 26B-A4B and 31B set their own.
        max_position_embeddings: 131_072,
        rope_sliding: RopeSpec { theta: 10_000.0, proportional: false, partial_rotary_factor: 1.0, factor: 1.0 },
        rope_full: RopeSpec { theta: 1_000_000.0, proportional: true, partial_rotary_factor: 0.25, factor: 1.0 },
        rms_norm_eps: 1e-6,
        final_logit_softcapping: Some(30.0),
        tie_word_embeddings: true,
        ple_dim: 0,
        ple_vocab_size: 262144,
        num_kv_shared_layers: 0,
        use_double_wide_mlp: false,
        attention_k_eq_v: false,
        moe: None,
        attn_scale: 1.0,
        eos_token_ids: vec![1],
        bos_token_id: Some(2),
        pad_token_id: Some(0),
        quantization: None,
    }
}

/// Gemma 4 26B-A4B and 31B (spec §1.2). 26B-A4B: 30 layers of hidden 2816, 16 heads (8 KV heads
/// on sliding layers, 2 on global ones), a dense MLP of 2112 beside 128 experts of 704, 8 routed
/// per token. 31B: 60 layers of hidden 5376, 32 heads (16 / 4 KV heads), MLP 21504. Both: window
/// 1024, five sliding layers per global one, global layers take V from the K projection, no PLE,
/// no KV sharing.
fn config_large(name: &str) -> ModelConfig {
    let moe = name == "26b-a4b";
    let (layers, hidden, heads, kv, global_kv, inter) =
        if moe { (30, 2816, 16, 8, 2, 2112) } else { (60, 5376, 32, 16, 4, 21504) };
    let layer_types = pattern(layers, 6);
    let head_dims = layer_types.iter().map(|k| if *k == AttnKind::Full { 512 } else { 256 }).collect();
    let kv_heads = layer_types.iter().map(|k| if *k == AttnKind::Full { global_kv } else { kv }).collect();
    ModelConfig {
        architecture: format!("synthetic-{name}"),
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        layer_types,
        head_dims,
        kv_heads,
        sliding_window: 1024,
        max_position_embeddings: 262_144,
        attention_k_eq_v: true,
        moe: moe.then_some(MoeConfig { num_experts: 128, top_k: 8, intermediate_size: 704 }),
        ..base_config()
    }
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
        let mut layer = random_layer(p, h, pd, lp, !lp.is_kv_shared())?;
        if plan.moe_experts > 0 {
            layer.moe = Some(synthetic_moe(p, plan, plan.moe_experts)?);
        }
        layers.push(layer);
    }
    Ok(DevWeights { embed, ple, layers, final_norm: p.vec_const(h, 1.0)?, lm_head })
}

/// One decoder layer of random 4-bit weights (groups of [`SYNTHETIC_GROUP`]) and unit norms, of
/// width `h`, with per-layer embeddings of `pd` (0: none) and, when `owns_kv`, its K/V projections;
/// no MoE (the caller adds it).
pub fn random_layer(p: &mut Placer, h: usize, pd: usize, lp: &LayerPlan, owns_kv: bool) -> Result<DevLayer> {
    let g = SYNTHETIC_GROUP;
    let (qw, kvw, i) = (lp.q_width(), lp.kv_width(), lp.mlp_width);
    Ok(DevLayer {
        input_norm: p.vec_const(h, 1.0)?,
        q: p.q4_random(qw, h, g, true)?,
        q_norm: p.vec_const(lp.head_dim, 1.0)?,
        k: if owns_kv { Some(p.q4_random(kvw, h, g, true)?) } else { None },
        v: if owns_kv && !lp.k_eq_v { Some(p.q4_random(kvw, h, g, true)?) } else { None },
        k_norm: if owns_kv { Some(p.vec_const(lp.head_dim, 1.0)?) } else { None },
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
    })
}

/// Random router and experts (row-major: the routed-expert kernel reads them by row), unit norms
/// and scales.
fn synthetic_moe(p: &mut Placer, plan: &ModelPlan, experts: usize) -> Result<DevMoe> {
    let (h, w, g) = (plan.hidden, plan.moe_width, SYNTHETIC_GROUP);
    let mats: Vec<[crate::device::DevMat; 3]> = (0..experts)
        .map(|_| Ok([p.q4_random(w, h, g, false)?, p.q4_random(w, h, g, false)?, p.q4_random(h, w, g, false)?]))
        .collect::<Result<_>>()?;
    Ok(DevMoe {
        router: p.q4_random(experts, h, g, true)?,
        router_scale: p.vec_const(h, 1.0)?,
        per_expert_scale: p.vec_const(experts, 1.0)?,
        table: p.expert_table(&mats)?,
        experts: mats,
        pre_norm_2: p.vec_const(h, 1.0)?,
        post_norm_1: p.vec_const(h, 1.0)?,
        post_norm_2: p.vec_const(h, 1.0)?,
    })
}

/// Bytes of a `[rows, cols]` 4-bit matrix as stored on disk (codes plus a bf16 scale and bias
/// per group), the convention of `RowDot::stored_bytes`.
fn q4_stored(rows: usize, cols: usize) -> usize {
    rows * cols / 2 + rows * cols / SYNTHETIC_GROUP * 4
}

/// Weight bytes one decode step streams: the plan's decode matrices (everything but the gathers;
/// the router and the routed experts of MoE layers) as stored.
pub fn synthetic_decode_bytes(plan: &ModelPlan) -> usize {
    plan.decode_bytes(q4_stored)
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
        let moe = ModelPlan::new(&synthetic_config("26b-a4b").unwrap()).unwrap();
        assert_eq!(
            (moe.layers.len(), moe.hidden, moe.moe_experts, moe.moe_top_k, moe.moe_width),
            (30, 2816, 128, 8, 704)
        );
        assert!(moe.layers[5].k_eq_v && !moe.layers[4].k_eq_v && !moe.layers[29].is_kv_shared());
        assert_eq!((moe.layers[5].num_kv_heads, moe.layers[4].num_kv_heads), (2, 8));
    }

    #[test]
    fn q4_bytes_per_token_match_the_model_sizes() {
        // E4B ≈ 4B streamed parameters at ~4.5 bits; 26B-A4B ≈ 4B active ones; 31B ≈ 31B.
        for (name, lo, hi) in [("e4b", 2.0, 4.0), ("26b-a4b", 1.5, 3.0), ("31b", 15.0, 20.0)] {
            let plan = ModelPlan::new(&synthetic_config(name).unwrap()).unwrap();
            let gb = synthetic_decode_bytes(&plan) as f64 / 1e9;
            assert!((lo..hi).contains(&gb), "{name}: {gb} GB");
        }
    }
}
