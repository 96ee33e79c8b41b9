//! The CUDA forward on the GPU, `#[ignore]`d so CI (no GPU) reports them as ignored; on the GPU
//! machine run the test binary with `--include-ignored` (`tools/gpu_session.sh` does): every
//! committed fixture greedy against the CPU reference (ids equal, logits within 1e-3 relative L2),
//! as stored and quantized to 4 bits on load (`q4`: groups of 64, `q4_0`: groups of 32, which
//! take the tensor-core matvec), and multi-token verify columns bit-identical to single decode steps.

use megagemma_cuda::check::{self, compare_greedy, fixture_cases, fixture_dirs, long_prompt, verify_columns};
use megagemma_cuda::{CudaModel, Decode};
use megagemma_model::Model;
use std::path::PathBuf;

fn fixtures() -> Vec<PathBuf> {
    // MEGAGEMMA_FIXTURES: where the fixtures are when the test binary runs away from the source tree.
    let root = std::env::var("MEGAGEMMA_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"));
    let dirs = fixture_dirs(&root).expect("fixtures");
    assert!(!dirs.is_empty(), "no fixtures under {}", root.display());
    dirs
}

/// Every fixture as stored, and the dense ones quantized on load as `q4` and `q4_0`.
fn fixture_models() -> Vec<(PathBuf, String, Model)> {
    let mut out = vec![];
    for dir in fixtures() {
        for (label, model) in check::fixture_models(&dir).unwrap_or_else(|e| panic!("{e}")) {
            out.push((dir.clone(), label, model));
        }
    }
    out
}

/// Every fixture model (as `fixture_models`) uploaded, with its first case's prompt.
fn uploaded_fixtures() -> impl Iterator<Item = (String, std::sync::Arc<CudaModel>, Vec<u32>)> {
    fixture_models().into_iter().map(|(dir, label, model)| {
        let cm = CudaModel::load(&model).expect("upload");
        let (_, prompt) = fixture_cases(&dir).expect("cases").remove(0);
        (label, cm, prompt)
    })
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn fixtures_match_cpu_reference() {
    for (dir, label, model) in fixture_models() {
        let cm = CudaModel::load(&model).expect("upload");
        let mut cases: Vec<_> = fixture_cases(&dir).expect("cases").into_iter().map(|(n, p)| (n, p, None)).collect();
        // A long prompt (cuBLAS products and batched attention), in one pass and in chunks of 40
        // tokens across sliding-window wraps.
        let long = long_prompt(&cases[0].1, model.plan.vocab_size, 160);
        cases.push(("long".into(), long.clone(), None));
        cases.push(("long/40".into(), long, Some(40)));
        for (name, prompt, chunk) in cases {
            let r = compare_greedy(&model, &cm, &prompt, 16, chunk).expect("greedy");
            assert!(
                r.ok(),
                "{label} {name}: {} of 16 ids equal, max rel L2 {:.2e}\ncpu  {:?}\ncuda {:?}",
                r.ids_equal,
                r.max_rel_l2,
                r.cpu_ids,
                r.cuda_ids
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn verify_columns_equal_decode_steps() {
    for (label, cm, prompt) in uploaded_fixtures() {
        let r = verify_columns(&cm, &prompt, 8).expect("verify");
        assert!(
            r.ok(),
            "{label}: {}/8 columns equal, partial commit exact: {}",
            r.columns_equal,
            r.partial_commit_exact
        );
    }
    let cm = CudaModel::synthetic("tiny", "q4").expect("synthetic");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 + 11) % 4096).collect();
    assert!(verify_columns(&cm, &prompt, 8).expect("verify").ok(), "synthetic tiny");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn megakernel_matches_graph_and_fails_cleanly() {
    for (label, cm, prompt) in uploaded_fixtures() {
        let r = check::megakernel_matches_graph(&cm, &prompt, 8).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(r.identical, 8, "{label}: megakernel steps bit-identical to the graph's");
        assert_eq!(r.verify_identical, check::MK_VERIFY_TOKENS.len(), "{label}: megakernel verify passes");
    }
    let cm = CudaModel::synthetic("tiny", "q4").expect("synthetic");
    let (took, err) = check::megakernel_broken_schedule(&cm, &[1, 2, 3]).expect("the broken schedule is detected");
    assert!(took.as_secs_f64() < 1.5, "a broken schedule took {took:?} to fail");
    assert!(err.contains("megakernel"), "{err}");
}

/// Several sequences in one `step` (one weight pass, a graph or a megakernel launch; nine
/// sequences: a pass of eight and one alone) give every sequence the logits it gets stepped
/// alone, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn batched_steps_equal_lone_steps() {
    for (label, cm, p) in uploaded_fixtures() {
        let prompts: Vec<Vec<u32>> = (1..=9).map(|n| p.iter().cycle().take(n).copied().collect()).collect();
        for decode in [Decode::Graph, Decode::Megakernel] {
            let r = check::batch_matches_lone(&cm, &prompts, 6, decode).unwrap_or_else(|e| panic!("{label}: {e}"));
            assert!(
                r.ok(),
                "{label} {decode:?}: {}/{} batched outputs equal the lone ones, {}/{} passes in the megakernel",
                r.identical,
                r.outputs,
                r.megakernel_passes,
                r.steps
            );
        }
    }
}

/// Top-k sampling's candidates selected on the device are the host's selection from the same
/// logits, in prefill, decode (graph and megakernel), batched steps, verify and on crafted rows.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn candidates_equal_the_host_selection() {
    for (label, cm, prompt) in uploaded_fixtures() {
        for k in [2, 40, megagemma_cuda::MAX_CANDIDATES] {
            match check::candidates_match_host(&cm, &prompt, k) {
                Ok(n) => assert!(n >= 15, "{label} k={k}: only {n} comparisons"),
                Err(e) => panic!("{label} k={k}: {e}"),
            }
        }
    }
}

/// On rows as wide as Gemma's vocabulary (64 blocks' lists merged) the device selects and draws
/// what the host does (`check::wide_rows_match_host`).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn wide_rows_select_and_draw_as_the_host() {
    let cm = CudaModel::synthetic("tiny", "q4").expect("synthetic");
    let n = check::wide_rows_match_host(&cm).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(n, 2 * (4 * 5 + 5 * 3));
}

/// Pipelined sampled decoding draws on the device exactly the tokens the host draws from the same
/// candidates and uniforms (`check::sampled_match_host`: `exp_det` bit for bit, then
/// `conformance::sampled_in_one_call` on the graph and megakernel paths).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn sampled_decoding_draws_what_the_host_draws() {
    for (label, cm, prompt) in uploaded_fixtures() {
        match check::sampled_match_host(&cm, &prompt) {
            Ok(n) => assert_eq!(n, 8, "{label}"),
            Err(e) => panic!("{label}: {e}"),
        }
    }
}

/// Without a GPU loading is one clear error; with one, it works.
#[test]
fn load_is_one_clear_error_without_a_gpu() {
    let loaded = CudaModel::synthetic("tiny", "q4");
    if megagemma_cuda::libs::driver_present() {
        loaded.expect("a CUDA driver is present: the tiny synthetic model must load");
    } else {
        let err = loaded.err().expect("no GPU here: loading must fail");
        assert!(err.to_string().starts_with("no CUDA device found:"), "{err}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn forked_sequences_continue_like_the_original() {
    for (dir, label, model) in fixture_models() {
        let cm = CudaModel::load(&model).expect("upload");
        let (_, prompt) = fixture_cases(&dir).expect("cases").remove(0);
        // Also past several sliding-window wraps, so the copied rings are read in full.
        let long = long_prompt(&prompt, model.plan.vocab_size, 160);
        for p in [prompt, long] {
            let r = check::fork_matches(&cm, &p, 12).expect("fork");
            assert!(
                r.ok(),
                "{label} ({} tokens): {}/{} steps identical, ids equal a fresh run: {}",
                p.len(),
                r.identical,
                r.steps,
                r.ids_equal_fresh
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn mtp_drafts_equal_the_cpu_drafter() {
    use megagemma_model::assistant::AssistantModel;
    use megagemma_model::quant::load::QuantMode;
    use std::sync::Arc;
    let root = fixtures()[0].parent().expect("fixtures root").to_path_buf();
    let target = root.join("ple_shared_dw");
    let model = Arc::new(Model::load_with(&target, QuantMode::Stored).expect("target"));
    let (_, prompt) = fixture_cases(&target).expect("cases").remove(0);
    for kind in ["dense", "centroid"] {
        let asst =
            Arc::new(AssistantModel::load(&root.join("assistants").join(kind), &model, QuantMode::Stored).expect(kind));
        let r = check::drafts_match(&model, &asst, &prompt, 3, 40).expect("drafts");
        assert!(
            r.ok(),
            "{kind}: {}/{} rounds equal, {}/{} verifies equal, step equal {}, speculative = greedy {}, probabilities' \
             ids equal {} (rel L2 {:.2e}); first diff {:?}",
            r.rounds_equal,
            r.rounds,
            r.verifies_equal,
            r.verifies,
            r.step_equal,
            r.speculative_equals_greedy,
            r.probs_ids_equal,
            r.probs_rel_l2,
            r.first_diff
        );
    }
}

/// Pipelined greedy decoding gives `step`'s ids and cache, also when the caller stops it early
/// (the step queued ahead taken back), across sliding-window wraps, in the graph and the megakernel.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn pipelined_decoding_equals_steps() {
    for (label, cm, prompt) in uploaded_fixtures() {
        let long = long_prompt(&prompt, cm.plan().vocab_size, 100);
        for decode in [Decode::Graph, Decode::Megakernel] {
            for p in [&prompt, &long] {
                let r =
                    check::pipeline_matches(&cm, p, 40, decode).unwrap_or_else(|e| panic!("{label} {decode:?}: {e}"));
                assert!(
                    r.ok(),
                    "{label} {decode:?} ({} tokens): one call {}, pieces {}, cache {}",
                    p.len(),
                    r.one_call_equal,
                    r.pieces_equal,
                    r.cache_equal
                );
            }
        }
    }
}

/// The CUDA backend keeps `decode_greedy`'s contract (`conformance::greedy_in_one_call`: the ids of
/// `decode` in a loop, early stops, the context's end) on the pipelined graph and megakernel paths.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn greedy_decoding_in_one_call_is_decode_in_a_loop() {
    for (label, cm, prompt) in uploaded_fixtures() {
        for decode in [Decode::Graph, Decode::Megakernel] {
            let mut b = megagemma_cuda::CudaBackend::new(cm.clone(), prompt.len() + 24).with_decode(decode);
            if let Err(e) = megagemma_model::conformance::greedy_in_one_call(&mut b, &prompt) {
                panic!("{label} {decode:?}: {e}");
            }
        }
    }
}

/// A sequence the backend reuses after a longer request gives a fresh sequence's logits, bit for
/// bit, in steps, pipelined greedy decoding and a fork, on the graph and megakernel paths.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn reused_sequences_equal_fresh_ones() {
    for (label, cm, prompt) in uploaded_fixtures() {
        for decode in [Decode::Graph, Decode::Megakernel] {
            let r =
                check::reuse_matches(&cm, &prompt, 12, decode).unwrap_or_else(|e| panic!("{label} {decode:?}: {e}"));
            assert!(
                r.ok(),
                "{label} {decode:?}: reused {}, {}/{} rows identical, greedy equal {}, fork identical {}",
                r.reused,
                r.identical,
                r.rows,
                r.greedy_equal,
                r.fork_identical
            );
        }
    }
}
