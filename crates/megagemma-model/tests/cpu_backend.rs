//! CPU backend invariants that speculative decoding and long generations rely on.

use megagemma_model::cpu::CpuBackend;
use megagemma_model::{Backend, Model};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
    Arc::new(Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// Greedy-decode `n` tokens one at a time.
fn greedy(b: &mut CpuBackend, prompt: &[u32], n: usize) -> Vec<(u32, Vec<f32>)> {
    b.reset();
    let mut s = b.prefill(prompt).unwrap();
    let mut out = vec![];
    for _ in 0..n {
        out.push((s.argmax, s.logits.clone()));
        s = b.decode(s.argmax).unwrap();
    }
    out
}

#[test]
fn sliding_layers_never_hold_more_than_the_window() {
    let m = fixture("sliding_wrap");
    let window = m.config.sliding_window;
    let mut b = CpuBackend::new(m.clone());
    let n = 6 * window + 3;
    greedy(&mut b, &[2, 5, 9], n);
    assert_eq!(b.position(), 3 + n);
    for (layer, rows) in b.kv().resident_rows() {
        match m.plan.layers[layer].window {
            Some(w) => assert!(rows <= w, "sliding layer {layer} holds {rows} rows > window {w}"),
            None => assert_eq!(rows, b.position(), "full layer {layer} holds every position"),
        }
    }
}

#[test]
fn verify_columns_are_bit_identical_to_decode_steps() {
    for name in ["ple_shared_dw", "sliding_wrap", "moe", "keqv_global"] {
        let m = fixture(name);
        let mut b = CpuBackend::new(m.clone());
        let prompt = [2u32, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let steps = greedy(&mut b, &prompt, 12);
        // Same continuation, but the last 8 tokens fed through one verify pass.
        b.reset();
        let first = b.prefill(&prompt).unwrap();
        assert_eq!(first.logits, steps[0].1);
        let mut fed = vec![steps[0].0];
        for (t, _) in &steps[1..4] {
            b.decode(*fed.last().unwrap()).unwrap();
            fed.push(*t);
        }
        let pos = b.position();
        let block: Vec<u32> = steps[3..11].iter().map(|s| s.0).collect();
        let outs = b.verify(&block).unwrap();
        assert_eq!(b.position(), pos, "{name}: verify must not commit");
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.logits, steps[4 + i].1, "{name}: verify column {i} differs from the decode step");
        }
        // Accept 3, then decoding continues exactly like plain greedy.
        b.commit(3).unwrap();
        assert_eq!(b.position(), pos + 3);
        let next = b.decode(steps[6].0).unwrap();
        assert_eq!(next.logits, steps[7].1, "{name}: decode after a partial commit differs");
    }
}

#[test]
fn rejected_candidates_leave_no_trace_in_the_sliding_ring() {
    // Verify a block longer than the window with wrong tokens, commit none, and check the
    // continuation is unchanged: staged rows must not have overwritten live ring slots.
    let m = fixture("sliding_wrap");
    let w = m.config.sliding_window;
    let mut b = CpuBackend::new(m.clone());
    let steps = greedy(&mut b, &[2, 5, 9, 4, 3], 2 * w + 4);
    b.reset();
    let mut s = b.prefill(&[2, 5, 9, 4, 3]).unwrap();
    for step in &steps[..w + 2] {
        s = b.decode(step.0).unwrap();
    }
    let junk: Vec<u32> = (0..(w as u32 + 3)).map(|i| 20 + i).collect();
    b.verify(&junk).unwrap();
    b.commit(0).unwrap();
    let _ = s;
    let again = b.decode(steps[w + 2].0).unwrap();
    assert_eq!(again.logits, steps[w + 3].1);
}

#[test]
fn truncate_rolls_back_full_and_sliding_caches() {
    let m = fixture("ple_shared_dw");
    let mut b = CpuBackend::new(m.clone());
    let steps = greedy(&mut b, &[2, 7, 8], 6);
    // Roll back one committed token and redo it: same logits.
    b.reset();
    b.prefill(&[2, 7, 8]).unwrap();
    b.decode(steps[0].0).unwrap();
    b.decode(steps[1].0).unwrap();
    let pos = b.position();
    b.truncate_to(pos - 1).unwrap();
    let redo = b.decode(steps[1].0).unwrap();
    assert_eq!(redo.logits, steps[2].1);
    assert!(b.truncate_to(pos + 10).is_err(), "cannot truncate forward");
    b.truncate_to(0).unwrap();
    assert_eq!(b.position(), 0);
}

#[test]
fn truncating_past_the_sliding_window_is_a_clear_error() {
    let m = fixture("sliding_wrap");
    let w = m.config.sliding_window;
    let mut b = CpuBackend::new(m);
    greedy(&mut b, &[2, 5, 9], 3 * w);
    let pos = b.position();
    let err = b.truncate_to(pos - w).unwrap_err().to_string();
    assert!(err.contains("sliding-window"), "{err}");
}

#[test]
fn bad_tokens_are_errors_not_panics() {
    let m = fixture("moe");
    let v = m.plan.vocab_size as u32;
    let mut b = CpuBackend::new(m);
    assert!(b.prefill(&[]).unwrap_err().to_string().contains("empty"));
    assert!(b.prefill(&[2, v]).unwrap_err().to_string().contains("out of range"));
    assert!(b.commit(1).is_err(), "nothing staged");
}
