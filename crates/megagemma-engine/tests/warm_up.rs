//! The warm-up pass `serve` runs before its first request leaves nothing behind: a backend that
//! ran it decodes exactly as a fresh one, and it fits short contexts.

use megagemma_engine::backends::warm_up;
use megagemma_engine::generate::{generate, GenerateParams};
use megagemma_model::cpu::CpuBackend;
use megagemma_model::{Backend, Model};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
    Arc::new(Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}")))
}

#[test]
fn a_warmed_up_backend_decodes_as_a_fresh_one() {
    for name in ["ple_shared_dw", "sliding_wrap", "gemma3"] {
        let model = fixture(name);
        let prompt: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % model.plan.vocab_size as u32).collect();
        let params = GenerateParams::greedy(24);
        let fresh = generate(&mut CpuBackend::new(model.clone()), &prompt, &params, |_| true).unwrap().ids;
        let mut warm = CpuBackend::new(model.clone());
        warm_up(&mut warm).unwrap();
        let ids = generate(&mut warm, &prompt, &params, |_| true).unwrap().ids;
        assert_eq!(ids, fresh, "{name}");
        assert_eq!(fresh.len(), 24, "{name}: the run must decode every token asked for");
    }
}

#[test]
fn warm_up_fits_short_contexts() {
    let model = fixture("gemma3");
    for ctx in [1, 2, 3, 10, 30, 45, 46, 47] {
        let mut b = CpuBackend::new(model.clone()).with_max_context(ctx);
        warm_up(&mut b).unwrap_or_else(|e| panic!("context {ctx}: {e}"));
        // The throwaway sequence was freed: a new one starts empty and takes the whole context.
        let seq = b.new_sequence().unwrap();
        assert_eq!(b.seq_len(seq).unwrap(), 0);
        let full: Vec<u32> = vec![1; ctx];
        b.prefill(seq, &full, megagemma_model::backend::Want::Argmax).unwrap();
    }
}
