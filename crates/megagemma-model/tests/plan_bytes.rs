//! The bytes one decode step streams, from the layer plan alone, equal what the loaded weights
//! of each committed fixture store for the same matrices.

use megagemma_model::Model;
use std::path::PathBuf;

#[test]
fn plan_decode_bytes_equal_the_loaded_weights() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut checked = 0;
    for name in ["ple_shared_dw", "keqv_global", "moe", "sliding_wrap", "conditional", "sharded", "gemma3"] {
        let m = Model::load(&root.join(name)).unwrap();
        let head = m.weights.lm_head.as_ref().unwrap_or(&m.weights.embed);
        // Every dense fixture stores one dtype: bytes per element from the head.
        let elem = head.stored_bytes() / (head.rows() * head.cols());
        let from_plan = m.plan.decode_bytes(|r, c| r * c * elem);
        assert_eq!(from_plan, m.weights.decode_bytes(m.plan.moe_top_k), "{name}");
        checked += 1;
    }
    assert_eq!(checked, 7);
}

/// `ModelWeights::matrices` (the matrices the CPU backend prepares its kernel layouts for) lists
/// exactly the matrices a decode step streams, with every MoE expert counted.
#[test]
fn every_multiplied_matrix_is_listed_once() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for name in ["ple_shared_dw", "keqv_global", "moe", "sliding_wrap", "gemma3"] {
        let m = Model::load(&root.join(name)).unwrap();
        let experts = m.weights.layers.iter().filter_map(|l| l.moe.as_ref()).map(|moe| moe.experts.len()).max();
        let listed: usize = m.weights.matrices().iter().map(|w| w.stored_bytes()).sum();
        assert_eq!(listed, m.weights.decode_bytes(experts.unwrap_or(0)), "{name}");
    }
}
