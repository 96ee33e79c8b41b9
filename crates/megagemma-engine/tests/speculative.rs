//! Speculative decoding is lossless: with any drafter — always wrong, always right, random,
//! n-gram lookup — the emitted ids equal plain greedy decoding's, on every committed fixture,
//! including runs that wrap a small sliding window many times. Greedy speculation never
//! copies a vocab-sized logits vector out of the backend.

use megagemma_engine::generate::{generate, DraftMode, DraftParams, FinishReason, GenerateParams};
use megagemma_model::cpu::CpuBackend;
use megagemma_model::{Backend, Model};
use std::path::PathBuf;
use std::sync::Arc;

const FIXTURES: &[&str] =
    &["ple_shared_dw", "keqv_global", "moe", "sliding_wrap", "conditional", "sharded", "mlx_q4", "gemma3"];

fn fixture(name: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
    Arc::new(Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}")))
}

fn run(b: &mut CpuBackend, prompt: &[u32], params: &GenerateParams) -> Vec<u32> {
    generate(b, prompt, params, |_| true).unwrap().ids
}

fn with_draft(base: &GenerateParams, mode: DraftMode, k: usize) -> GenerateParams {
    GenerateParams { draft: DraftParams { mode, k, trace: false }, ..base.clone() }
}

fn drafters() -> Vec<(DraftMode, usize)> {
    vec![
        (DraftMode::Oracle { acceptance: 0.0, seed: 1 }, 4), // always wrong
        (DraftMode::Oracle { acceptance: 1.0, seed: 2 }, 4), // always right
        (DraftMode::Oracle { acceptance: 0.6, seed: 3 }, 3), // random
        (DraftMode::Oracle { acceptance: 0.8, seed: 4 }, 7),
        (DraftMode::Lookup { max_ngram: 3 }, 4),
        (DraftMode::Lookup { max_ngram: 1 }, 2),
    ]
}

#[test]
fn every_drafter_prints_exactly_the_greedy_ids_on_every_fixture() {
    let prompts: [&[u32]; 3] = [&[2, 7, 8, 9], &[2, 11, 12, 11, 12, 11, 12, 11], &[2, 40, 41, 42, 43, 44, 45, 46, 47]];
    for name in FIXTURES {
        let m = fixture(name);
        let mut b = CpuBackend::new(m);
        let base = GenerateParams::greedy(24);
        for prompt in prompts {
            let greedy = run(&mut b, prompt, &base);
            assert_eq!(greedy.len(), 24);
            for (mode, k) in drafters() {
                let ids = run(&mut b, prompt, &with_draft(&base, mode.clone(), k));
                assert_eq!(ids, greedy, "{name}: {mode:?} k={k} differs from greedy on {prompt:?}");
            }
        }
    }
}

#[test]
fn speculation_stays_exact_across_many_sliding_window_wraps() {
    let m = fixture("sliding_wrap");
    let w = m.config.sliding_window;
    let n = 6 * w + 5; // wraps the ring at least 5 times
    let mut b = CpuBackend::new(m);
    let base = GenerateParams::greedy(n);
    let prompt = [2u32, 5, 9, 5, 9];
    let greedy = run(&mut b, &prompt, &base);
    for (mode, k) in drafters().into_iter().chain([(DraftMode::Oracle { acceptance: 0.5, seed: 9 }, w + 2)]) {
        let ids = run(&mut b, &prompt, &with_draft(&base, mode.clone(), k));
        assert_eq!(ids, greedy, "{mode:?} k={k} differs from greedy across window wraps");
    }
}

#[test]
fn stop_ids_and_budget_end_speculation_where_greedy_ends() {
    let m = fixture("ple_shared_dw");
    let mut b = CpuBackend::new(m);
    let prompt = [2u32, 7, 8, 9];
    let free = run(&mut b, &prompt, &GenerateParams::greedy(30));
    // Make a token in the middle of the continuation a stop id: greedy stops right after it.
    let stop_at = 9;
    let params = GenerateParams { stop_ids: vec![free[stop_at]], ignore_eos: false, ..GenerateParams::greedy(30) };
    let plain = generate(&mut b, &prompt, &params, |_| true).unwrap();
    assert_eq!(plain.finish_reason, FinishReason::Stop);
    for (mode, k) in drafters() {
        let spec = generate(&mut b, &prompt, &with_draft(&params, mode.clone(), k), |_| true).unwrap();
        assert_eq!(spec.ids, plain.ids, "{mode:?}: stop id");
        assert_eq!(spec.finish_reason, FinishReason::Stop);
        // Budgets of every size end exactly at the budget.
        for n in [1, 2, 3, 5, 8] {
            let p = with_draft(&GenerateParams::greedy(n), mode.clone(), k);
            assert_eq!(run(&mut b, &prompt, &p), free[..n].to_vec(), "{mode:?}: budget {n}");
        }
    }
}

#[test]
fn greedy_speculation_copies_no_logits_and_frees_its_sequences() {
    let m = fixture("moe");
    let mut b = CpuBackend::new(m);
    let prompt = [2u32, 7, 8, 9];
    for (mode, k) in drafters() {
        let before = b.stats().logits_copies;
        let g = generate(&mut b, &prompt, &with_draft(&GenerateParams::greedy(16), mode, k), |_| true).unwrap();
        assert_eq!(b.stats().logits_copies, before, "greedy speculation copied full logits");
        let spec = g.spec.expect("speculation counters");
        assert!(spec.rounds > 0 && spec.accepted <= spec.drafted);
    }
    assert_eq!(b.live_sequences(), 0, "every sequence a generation opened was freed");
}

#[test]
fn always_right_drafts_are_all_accepted_and_always_wrong_ones_never() {
    let m = fixture("keqv_global");
    let mut b = CpuBackend::new(m);
    let prompt = [2u32, 7, 8, 9];
    let right = generate(
        &mut b,
        &prompt,
        &with_draft(&GenerateParams::greedy(21), DraftMode::Oracle { acceptance: 1.0, seed: 0 }, 4),
        |_| true,
    )
    .unwrap();
    let s = right.spec.unwrap();
    // 21 tokens = 1 from prefill + 4 rounds of (4 accepted + 1).
    assert_eq!((s.rounds, s.drafted, s.accepted), (4, 16, 16));
    let wrong = generate(
        &mut b,
        &prompt,
        &with_draft(&GenerateParams::greedy(9), DraftMode::Oracle { acceptance: 0.0, seed: 0 }, 4),
        |_| true,
    )
    .unwrap();
    assert_eq!(wrong.spec.unwrap().accepted, 0);
}

/// Speculative sampling draws every token from exactly the distribution plain sampling draws
/// from. Exact joint distribution of the first two generated tokens (from the model's logits
/// through the same sampling transforms) against the empirical one over thousands of seeded
/// speculative runs: a chi-square bound that a biased accept rule fails by far.
#[test]
fn speculative_sampling_matches_the_sampling_distribution() {
    use megagemma_engine::sampling::{Sampler, SamplingParams};
    use megagemma_model::Want;
    use std::collections::HashMap;

    let m = fixture("ple_shared_dw");
    let mut b = CpuBackend::new(m);
    let prompt = [2u32, 7, 8, 9];
    let sampling = SamplingParams { temperature: 1.5, top_k: 4, top_p: 1.0, min_p: 0.0, seed: None };
    let mut dist = Sampler::new(sampling.clone()).unwrap();

    // Exact P(t1, t2) = P(t1) · P(t2 | t1).
    let seq = b.new_sequence().unwrap();
    let first = b.prefill(seq, &prompt, Want::Logits).unwrap();
    let mut exact: HashMap<(u32, u32), f64> = HashMap::new();
    for (t1, p1) in dist.distribution(&first.logits).unwrap() {
        let s = b.fork(seq).unwrap();
        let second = b.decode(s, t1, Want::Logits).unwrap();
        b.free(s).unwrap();
        for (t2, p2) in dist.distribution(&second.logits).unwrap() {
            exact.insert((t1, t2), p1 * p2);
        }
    }
    b.free(seq).unwrap();

    let runs = 2500;
    for (mode, k) in
        [(DraftMode::Oracle { acceptance: 0.5, seed: 11 }, 1), (DraftMode::Oracle { acceptance: 1.0, seed: 12 }, 2)]
    {
        let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
        for seed in 0..runs {
            let params = GenerateParams {
                sampling: SamplingParams { seed: Some(seed as u64), ..sampling.clone() },
                ..with_draft(&GenerateParams::greedy(3), DraftMode::Oracle { acceptance: 0.0, seed: 0 }, k)
            };
            let params = GenerateParams { draft: DraftParams { mode: mode.clone(), k, trace: false }, ..params };
            let ids = generate(&mut b, &prompt, &params, |_| true).unwrap().ids;
            *counts.entry((ids[0], ids[1])).or_default() += 1;
        }
        assert!(counts.keys().all(|k| exact.contains_key(k)), "{mode:?}: a token outside the sampling support");
        let chi2: f64 = exact
            .iter()
            .map(|(key, p)| {
                let e = p * runs as f64;
                let o = *counts.get(key).unwrap_or(&0) as f64;
                (o - e).powi(2) / e
            })
            .sum();
        // 15 degrees of freedom: P(chi2 > 45) < 1e-4.
        assert!(chi2 < 45.0, "{mode:?}: chi-square {chi2:.1} over {} cells", exact.len());
    }
}

/// Top-k speculative sampling verifies with each column's k highest logits: the same tokens, seed
/// for seed, as with whole rows (`keep_logits` asks for those), and no vocab-sized copy.
#[test]
fn speculative_sampling_from_candidates_draws_what_whole_rows_draw() {
    use megagemma_engine::sampling::SamplingParams;
    let m = fixture("ple_shared_dw");
    let mut b = CpuBackend::new(m);
    let prompt = [2u32, 7, 8, 9];
    let mut differ = 0;
    for (mode, k) in drafters() {
        for seed in 0..6u64 {
            let sampling = SamplingParams { temperature: 1.2, top_k: 8, top_p: 0.9, min_p: 0.0, seed: Some(seed) };
            let base = GenerateParams { sampling, ..with_draft(&GenerateParams::greedy(24), mode.clone(), k) };
            let before = b.stats().logits_copies;
            let cands = run(&mut b, &prompt, &base);
            assert_eq!(b.stats().logits_copies, before, "{mode:?}: top-k speculative sampling copied full logits");
            let rows = run(&mut b, &prompt, &GenerateParams { keep_logits: true, ..base.clone() });
            assert_eq!(cands, rows, "{mode:?} seed {seed}");
            differ += usize::from(cands != run(&mut b, &prompt, &GenerateParams::greedy(24)));
        }
    }
    assert!(differ > 0, "every sampled run gave the greedy ids: the check would not see a wrong draw");
}

/// The MTP assistant (transformers-made fixtures, dense and centroid heads) drafting from the
/// target's own KV cache and hidden state: exactly the greedy ids, across many window wraps.
#[test]
fn mtp_drafts_print_exactly_the_greedy_ids() {
    use megagemma_model::assistant::AssistantModel;
    use megagemma_model::quant::load::QuantMode;
    let m = fixture("ple_shared_dw");
    let w = m.config.sliding_window;
    for head in ["dense", "centroid"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/assistants").join(head);
        let asst = Arc::new(AssistantModel::load(&dir, &m, QuantMode::Stored).unwrap());
        let mut b = CpuBackend::new(m.clone()).with_assistant(asst);
        let base = GenerateParams::greedy(6 * w + 3);
        for prompt in [&[2u32, 7, 8, 9][..], &[2, 11, 12, 11, 12, 11, 12, 11, 40, 41]] {
            let greedy = run(&mut b, prompt, &base);
            for k in [1, 3, 6] {
                let g = generate(&mut b, prompt, &with_draft(&base, DraftMode::Mtp, k), |_| true).unwrap();
                assert_eq!(g.ids, greedy, "{head} k={k} differs from greedy on {prompt:?}");
                let s = g.spec.unwrap();
                assert!(s.rounds > 0 && s.drafted >= s.rounds, "{head}: the assistant drafted");
            }
        }
        assert_eq!(b.stats().logits_copies, 0, "greedy MTP speculation copied no logits");
    }
}
