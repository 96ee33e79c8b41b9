//! A `gemma4` GGUF file's metadata resolves to the same [`ModelConfig`] as the config.json it was
//! converted from (tests/fixtures-gguf/gemma4/, written by tools/make_gguf4_fixture.py following
//! llama.cpp's converter), and loads into the same plan.

use megagemma_model::config::{load_config, ModelConfig};
use megagemma_model::gguf::GgufFile;
use megagemma_model::gguf_model::gguf_config;
use megagemma_model::plan::ModelPlan;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn configs(name: &str) -> (ModelConfig, ModelConfig) {
    let file = GgufFile::open(root().join(format!("tests/fixtures-gguf/gemma4/{name}.gguf"))).unwrap();
    (gguf_config(&file).unwrap(), load_config(&root().join("tests/fixtures").join(name)).unwrap())
}

#[test]
fn gguf_metadata_resolves_like_config_json() {
    for name in ["ple_shared_dw", "keqv_global", "sliding_wrap", "moe"] {
        let (g, c) = configs(name);
        assert_eq!(g.family, c.family, "{name}");
        assert_eq!(
            (g.vocab_size, g.hidden_size, g.intermediate_size, g.num_layers, g.num_heads),
            (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads),
            "{name}: sizes"
        );
        assert_eq!(g.layer_types, c.layer_types, "{name}: layer types");
        assert_eq!(g.head_dims, c.head_dims, "{name}: head dims");
        assert_eq!(g.kv_heads, c.kv_heads, "{name}: kv heads");
        assert_eq!(g.sliding_window, c.sliding_window, "{name}: window");
        // GGUF `context_length`; the fixtures' config.json says 4,096 (the default would be 131,072).
        assert_eq!((g.max_position_embeddings, c.max_position_embeddings), (4096, 4096), "{name}: context");
        assert_eq!(g.rope_sliding, c.rope_sliding, "{name}: sliding rope");
        assert_eq!(g.rope_full, c.rope_full, "{name}: full rope");
        // GGUF stores the epsilon as f32.
        assert_eq!(g.rms_norm_eps as f32, c.rms_norm_eps as f32, "{name}: eps");
        assert_eq!(g.final_logit_softcapping, c.final_logit_softcapping, "{name}: softcap");
        assert_eq!(g.tie_word_embeddings, c.tie_word_embeddings, "{name}: tied");
        assert_eq!((g.ple_dim, g.ple_vocab_size), (c.ple_dim, c.ple_vocab_size), "{name}: PLE");
        assert_eq!(g.num_kv_shared_layers, c.num_kv_shared_layers, "{name}: shared KV");
        assert_eq!(g.use_double_wide_mlp, c.use_double_wide_mlp, "{name}: double-wide");
        assert_eq!(g.attention_k_eq_v, c.attention_k_eq_v, "{name}: k_eq_v");
        assert_eq!(g.attn_scale, c.attn_scale, "{name}: attention scale");
        assert_eq!(g.moe, c.moe, "{name}: experts");
        assert_eq!((g.bos_token_id, g.pad_token_id), (c.bos_token_id, c.pad_token_id), "{name}: ids");
        // <eos>, then Gemma 4's end of turn <turn|> found by its text.
        assert_eq!(g.eos_token_ids, [1, 6], "{name}: stop ids");
        let (gp, cp) = (ModelPlan::new(&g).unwrap(), ModelPlan::new(&c).unwrap());
        for (a, b) in gp.layers.iter().zip(&cp.layers) {
            assert_eq!(
                (a.kv_source, a.mlp_width, a.k_eq_v, &a.inv_freq),
                (b.kv_source, b.mlp_width, b.k_eq_v, &b.inv_freq),
                "{name}: layer {}",
                a.index
            );
        }
    }
}

#[test]
fn the_fixtures_cover_every_gemma4_text_feature() {
    let (p, _) = configs("ple_shared_dw");
    assert!(p.ple_dim > 0 && p.num_kv_shared_layers > 0 && p.use_double_wide_mlp);
    assert!(p.rope_full.proportional && p.rope_full.partial_rotary_factor == 0.25);
    assert_ne!(p.head_dims.iter().min(), p.head_dims.iter().max(), "sliding and full head dims differ");
    let (k, _) = configs("keqv_global");
    assert!(k.attention_k_eq_v && !k.tie_word_embeddings);
    assert_ne!(k.kv_heads.iter().min(), k.kv_heads.iter().max(), "per-layer kv heads");
}

#[test]
fn moe_metadata_names_the_experts() {
    let (m, _) = configs("moe");
    let moe = m.moe.expect("moe.gguf has experts");
    assert_eq!((moe.num_experts, moe.top_k, moe.intermediate_size), (8, 2, 16));
}
