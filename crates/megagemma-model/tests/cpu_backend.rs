//! CPU backend invariants that speculative decoding, batching and long generations rely on.

use megagemma_model::backend::{BackendStats, Decode};
use megagemma_model::cpu::CpuBackend;
use megagemma_model::error::ErrorKind;
use megagemma_model::{Backend, Model, SeqId, Want};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
    Arc::new(Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// Greedy-decode `n` tokens one at a time on a fresh sequence: (argmax, logits) per step.
fn greedy(b: &mut CpuBackend, prompt: &[u32], n: usize) -> (SeqId, Vec<(u32, Vec<f32>)>) {
    let seq = b.new_sequence().unwrap();
    let mut s = b.prefill(seq, prompt, Want::Logits).unwrap();
    let mut out = vec![];
    for _ in 0..n {
        out.push((s.argmax, s.logits.clone()));
        s = b.decode(seq, s.argmax, Want::Logits).unwrap();
    }
    (seq, out)
}

#[test]
fn sliding_layers_never_hold_more_than_the_window_plus_one() {
    let m = fixture("sliding_wrap");
    let window = m.config.sliding_window;
    let mut b = CpuBackend::new(m.clone());
    let n = 6 * window + 3;
    let (seq, _) = greedy(&mut b, &[2, 5, 9], n);
    assert_eq!(b.seq_len(seq).unwrap(), 3 + n);
    for (layer, rows) in b.kv(seq).unwrap().resident_rows() {
        match m.plan.layers[layer].window {
            // W + 1: the drafter's query after the newest position sees the W + 1 newest keys.
            Some(w) => assert!(rows <= w + 1, "sliding layer {layer} holds {rows} rows > window {w} + 1"),
            None => assert_eq!(rows, 3 + n, "full layer {layer} holds every position"),
        }
    }
}

/// Fixture `name` quantized to 4 bits on load (on AVX-512 VNNI its products run on the integer
/// byte tiles).
fn fixture_q4(name: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
    let q4 = megagemma_model::quant::load::QuantMode::Q4;
    Arc::new(Model::load_with(&dir, q4).unwrap_or_else(|e| panic!("{name} q4: {e}")))
}

#[test]
fn verify_columns_are_bit_identical_to_decode_steps() {
    let stored = ["ple_shared_dw", "sliding_wrap", "moe", "keqv_global"].map(|n| (n.to_string(), fixture(n)));
    let q4 = ["ple_shared_dw", "sliding_wrap"].map(|n| (format!("{n} q4"), fixture_q4(n)));
    for (name, m) in stored.into_iter().chain(q4) {
        let mut b = CpuBackend::new(m.clone());
        let prompt = [2u32, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let (_, steps) = greedy(&mut b, &prompt, 12);
        // Same continuation, but the last 8 tokens fed through one verify pass.
        let seq = b.new_sequence().unwrap();
        let first = b.prefill(seq, &prompt, Want::Logits).unwrap();
        assert_eq!(first.logits, steps[0].1);
        let mut fed = vec![steps[0].0];
        for (t, _) in &steps[1..4] {
            b.decode(seq, *fed.last().unwrap(), Want::Argmax).unwrap();
            fed.push(*t);
        }
        let pos = b.seq_len(seq).unwrap();
        let block: Vec<u32> = steps[3..11].iter().map(|s| s.0).collect();
        let outs = b.verify(seq, &block, Want::Logits).unwrap();
        assert_eq!(b.seq_len(seq).unwrap(), pos, "{name}: verify must not commit");
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.logits, steps[4 + i].1, "{name}: verify column {i} differs from the decode step");
            assert_eq!(o.argmax, steps[4 + i].0);
        }
        // Accept 3, then decoding continues exactly like plain greedy.
        b.commit(seq, 3).unwrap();
        assert_eq!(b.seq_len(seq).unwrap(), pos + 3);
        let next = b.decode(seq, steps[6].0, Want::Logits).unwrap();
        assert_eq!(next.logits, steps[7].1, "{name}: decode after a partial commit differs");
    }
}

#[test]
fn batched_steps_equal_lone_sequences_bit_for_bit() {
    // Three sequences at different lengths, advanced together: each column must equal the
    // same sequence decoded alone (batch invariance by construction).
    for name in ["ple_shared_dw", "sliding_wrap", "moe"] {
        let m = fixture(name);
        let prompts: [&[u32]; 3] = [&[2, 7, 8], &[2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39], &[2, 99]];
        let mut alone = CpuBackend::new(m.clone());
        let lone: Vec<_> = prompts.iter().map(|p| greedy(&mut alone, p, 10).1).collect();

        let mut b = CpuBackend::new(m.clone());
        let seqs: Vec<SeqId> = prompts.iter().map(|_| b.new_sequence().unwrap()).collect();
        let mut last: Vec<u32> =
            seqs.iter().zip(prompts).map(|(s, p)| b.prefill(*s, p, Want::Argmax).unwrap().argmax).collect();
        for step in 0..9 {
            let batch: Vec<(SeqId, u32)> = seqs.iter().copied().zip(last.iter().copied()).collect();
            let outs = b.step(&batch, Want::Logits).unwrap();
            for (i, o) in outs.iter().enumerate() {
                assert_eq!(o.logits, lone[i][step + 1].1, "{name}: sequence {i} step {step} differs in a batch");
            }
            last = outs.iter().map(|o| o.argmax).collect();
        }
    }
}

#[test]
fn forked_sequences_continue_like_the_original() {
    let m = fixture("sliding_wrap");
    let mut b = CpuBackend::new(m);
    let (_, steps) = greedy(&mut b, &[2, 5, 9], 20);
    let seq = b.new_sequence().unwrap();
    b.prefill(seq, &[2, 5, 9], Want::Argmax).unwrap();
    for s in &steps[..10] {
        b.decode(seq, s.0, Want::Argmax).unwrap();
    }
    let fork = b.fork(seq).unwrap();
    b.free(seq).unwrap();
    assert!(b.seq_len(seq).is_err(), "a freed sequence is gone");
    let next = b.decode(fork, steps[10].0, Want::Logits).unwrap();
    assert_eq!(next.logits, steps[11].1);
}

#[test]
fn rejected_candidates_leave_no_trace_in_the_sliding_ring() {
    // Verify a block longer than the window with wrong tokens, commit none, and check the
    // continuation is unchanged: staged rows must not have overwritten live ring slots.
    let m = fixture("sliding_wrap");
    let w = m.config.sliding_window;
    let mut b = CpuBackend::new(m.clone());
    let (_, steps) = greedy(&mut b, &[2, 5, 9, 4, 3], 2 * w + 4);
    let seq = b.new_sequence().unwrap();
    b.prefill(seq, &[2, 5, 9, 4, 3], Want::Argmax).unwrap();
    for step in &steps[..w + 2] {
        b.decode(seq, step.0, Want::Argmax).unwrap();
    }
    let junk: Vec<u32> = (0..(w as u32 + 3)).map(|i| 20 + i).collect();
    b.verify(seq, &junk, Want::Argmax).unwrap();
    b.commit(seq, 0).unwrap();
    let again = b.decode(seq, steps[w + 2].0, Want::Logits).unwrap();
    assert_eq!(again.logits, steps[w + 3].1);
}

#[test]
fn truncate_rolls_back_full_and_sliding_caches() {
    let m = fixture("ple_shared_dw");
    let mut b = CpuBackend::new(m.clone());
    let (_, steps) = greedy(&mut b, &[2, 7, 8], 6);
    // Roll back one committed token and redo it: same logits.
    let seq = b.new_sequence().unwrap();
    b.prefill(seq, &[2, 7, 8], Want::Argmax).unwrap();
    b.decode(seq, steps[0].0, Want::Argmax).unwrap();
    b.decode(seq, steps[1].0, Want::Argmax).unwrap();
    let pos = b.seq_len(seq).unwrap();
    b.truncate(seq, pos - 1).unwrap();
    let redo = b.decode(seq, steps[1].0, Want::Logits).unwrap();
    assert_eq!(redo.logits, steps[2].1);
    assert!(b.truncate(seq, pos + 10).is_err(), "cannot truncate forward");
    b.truncate(seq, 0).unwrap();
    assert_eq!(b.seq_len(seq).unwrap(), 0);
}

#[test]
fn truncating_past_the_sliding_window_is_a_clear_error() {
    let m = fixture("sliding_wrap");
    let w = m.config.sliding_window;
    let mut b = CpuBackend::new(m);
    let (seq, _) = greedy(&mut b, &[2, 5, 9], 3 * w);
    let pos = b.seq_len(seq).unwrap();
    let err = b.truncate(seq, pos - w).unwrap_err().to_string();
    assert!(err.contains("sliding-window"), "{err}");
}

#[test]
fn bad_input_and_capacity_errors_have_kinds() {
    let m = fixture("moe");
    let v = m.plan.vocab_size as u32;
    let mut b = CpuBackend::new(m).with_max_context(8);
    let seq = b.new_sequence().unwrap();
    let e = b.prefill(seq, &[], Want::Argmax).unwrap_err();
    assert!(e.to_string().contains("empty") && e.kind() == ErrorKind::InvalidInput, "{e}");
    let e = b.prefill(seq, &[2, v], Want::Argmax).unwrap_err();
    assert!(e.to_string().contains("out of range") && e.kind() == ErrorKind::InvalidInput, "{e}");
    assert!(b.commit(seq, 1).is_err(), "nothing staged");
    let e = b.prefill(SeqId(77), &[2], Want::Argmax).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    b.prefill(seq, &[2, 3, 4, 5, 6, 7], Want::Argmax).unwrap();
    let e = b.verify(seq, &[1, 2, 3], Want::Argmax).unwrap_err();
    assert!(e.to_string().contains("context") && e.kind() == ErrorKind::Capacity, "{e}");
    // The failed call left the sequence intact.
    assert_eq!(b.seq_len(seq).unwrap(), 6);
    b.decode(seq, 3, Want::Argmax).unwrap();
}

#[test]
fn outputs_are_what_was_asked_for() {
    let m = fixture("ple_shared_dw");
    let mut b = CpuBackend::new(m);
    let seq = b.new_sequence().unwrap();
    let full = b.prefill(seq, &[2, 7, 8], Want::Logits).unwrap();
    assert_eq!(b.stats(), BackendStats { logits_copies: 1, passes: 1 });
    let seq2 = b.new_sequence().unwrap();
    let top = b.prefill(seq2, &[2, 7, 8], Want::TopLogprobs(5)).unwrap();
    assert!(top.logits.is_empty());
    assert_eq!(top.top_logprobs.len(), 5);
    assert_eq!(top.top_logprobs[0].0, full.argmax);
    // Log-probabilities are the log-softmax of the full logits, in decreasing order.
    let max = full.logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_z = max + full.logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    for w in top.top_logprobs.windows(2) {
        assert!(w[0].1 >= w[1].1);
    }
    for &(id, lp) in &top.top_logprobs {
        assert!((lp as f64 - (full.logits[id as usize] as f64 - log_z)).abs() < 1e-5);
    }
    let arg = b.decode(seq, full.argmax, Want::Argmax).unwrap();
    assert!(arg.logits.is_empty() && arg.top_logprobs.is_empty());
    assert_eq!(b.stats().logits_copies, 1, "argmax-only calls copy no logits");
}

/// A prompt longer than one prefill chunk (512 tokens) prefills in chunks whose earlier parts
/// keep no outputs, and gives what feeding it in two arbitrary parts gives. (A chunk with no kept
/// position once sent an empty batch to the LM head, which divided by zero.)
#[test]
fn prompts_longer_than_one_prefill_chunk_prefill() {
    for name in ["gemma3", "ple_shared_dw"] {
        let m = fixture(name);
        let vocab = m.plan.vocab_size as u32;
        let prompt: Vec<u32> = (0..1100u32).map(|i| 2 + (i * 7 + i / 3) % (vocab - 2)).collect();
        let mut b = CpuBackend::new(m.clone());
        let whole = b.new_sequence().unwrap();
        let a = b.prefill(whole, &prompt, Want::Logits).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(b.seq_len(whole).unwrap(), prompt.len());
        let parts = b.new_sequence().unwrap();
        b.prefill(parts, &prompt[..300], Want::Argmax).unwrap();
        let c = b.prefill(parts, &prompt[300..], Want::Logits).unwrap();
        assert_eq!(a.argmax, c.argmax, "{name}");
        let diff = a.logits.iter().zip(&c.logits).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-4, "{name}: logits differ by {diff}");
    }
}

/// `decode_sampled`'s contract (`conformance::sampled_in_one_call`), which the CUDA backend's
/// pipelined override (the draw on the device) is held to on the GPU too.
#[test]
fn sampled_decoding_in_one_call_is_decode_and_draw_in_a_loop() {
    let mut b = CpuBackend::new(fixture("sliding_wrap")).with_max_context(40);
    let params = megagemma_model::draw::DrawParams { temperature: 1.5, top_k: 8, top_p: 0.95, min_p: 0.01 };
    megagemma_model::conformance::sampled_in_one_call(&mut b, &[2, 5, 9], &params).unwrap_or_else(|e| panic!("{e}"));
}

/// `decode_greedy`'s contract (`conformance::greedy_in_one_call`), which the CUDA backend's
/// pipelined override is held to on the GPU too.
#[test]
fn greedy_decoding_in_one_call_is_decode_in_a_loop() {
    let mut b = CpuBackend::new(fixture("sliding_wrap")).with_max_context(40);
    megagemma_model::conformance::greedy_in_one_call(&mut b, &[2, 5, 9]).unwrap_or_else(|e| panic!("{e}"));
}

/// `--decode graph|megakernel` names a way to launch decode steps; the CPU backend has one way,
/// and asking it for another is an input error, not a silent no-op.
#[test]
fn decode_launch_modes_parse_and_the_cpu_has_one_way() {
    for d in [Decode::Graph, Decode::Megakernel] {
        assert_eq!(d.to_string().parse::<Decode>().unwrap(), d);
    }
    let e = "warp".parse::<Decode>().unwrap_err();
    assert!(e.to_string().contains("unknown decode mode `warp`"), "{e}");
    let mut b = CpuBackend::new(fixture("sliding_wrap"));
    assert_eq!(b.decode_launch(), None);
    let e = b.set_decode_launch(Decode::Graph).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
}
