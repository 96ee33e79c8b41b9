//! The CUDA forward on the GPU (opt-in: `MEGAGEMMA_GPU_TESTS=1`; prints a skip line otherwise):
//! every committed fixture greedy against the CPU reference (ids equal, logits within 1e-3
//! relative L2), and multi-token verify columns bit-identical to single decode steps.

use megagemma_cuda::check::{compare_greedy, fixture_cases, fixture_dirs, verify_columns};
use megagemma_cuda::CudaModel;
use megagemma_model::Model;
use std::path::PathBuf;

/// A line on the real stderr: the test harness captures `eprintln!`, and a skip must be visible.
macro_rules! skip_line {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

fn enabled(test: &str) -> bool {
    let on = std::env::var("MEGAGEMMA_GPU_TESTS").is_ok_and(|v| v == "1");
    if !on {
        skip_line!("SKIPPED {test}: GPU tests are opt-in (MEGAGEMMA_GPU_TESTS=1)");
    }
    on
}

fn fixtures() -> Vec<PathBuf> {
    // MEGAGEMMA_FIXTURES: where the fixtures are when the test binary runs away from the source tree.
    let root = std::env::var("MEGAGEMMA_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"));
    let dirs = fixture_dirs(&root).expect("fixtures");
    assert!(!dirs.is_empty(), "no fixtures under {}", root.display());
    dirs
}

#[test]
fn fixtures_match_cpu_reference() {
    if !enabled("fixtures_match_cpu_reference") {
        return;
    }
    for dir in fixtures() {
        let model = Model::load(&dir).expect("load");
        let cm = CudaModel::load(&model).expect("upload");
        for (name, prompt) in fixture_cases(&dir).expect("cases") {
            let r = compare_greedy(&model, &cm, &prompt, 16).expect("greedy");
            assert!(
                r.ok(),
                "{} {name}: {} of 16 ids equal, max rel L2 {:.2e}\ncpu  {:?}\ncuda {:?}",
                dir.display(),
                r.ids_equal,
                r.max_rel_l2,
                r.cpu_ids,
                r.cuda_ids
            );
        }
    }
}

#[test]
fn verify_columns_equal_decode_steps() {
    if !enabled("verify_columns_equal_decode_steps") {
        return;
    }
    for dir in fixtures() {
        let model = Model::load(&dir).expect("load");
        let cm = CudaModel::load(&model).expect("upload");
        let (_, prompt) = fixture_cases(&dir).expect("cases").remove(0);
        let r = verify_columns(&cm, &prompt, 8).expect("verify");
        assert!(
            r.ok(),
            "{}: {}/8 columns equal, partial commit exact: {}",
            dir.display(),
            r.columns_equal,
            r.partial_commit_exact
        );
    }
    let cm = CudaModel::synthetic("tiny", "q4").expect("synthetic");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 + 11) % 4096).collect();
    assert!(verify_columns(&cm, &prompt, 8).expect("verify").ok(), "synthetic tiny");
}

#[test]
fn load_without_gpu_is_one_clear_error() {
    if megagemma_cuda::libs::driver_present() {
        skip_line!("SKIPPED load_without_gpu_is_one_clear_error: a CUDA driver is present");
        return;
    }
    let err = CudaModel::synthetic("tiny", "q4").err().expect("no GPU here: loading must fail");
    assert!(err.to_string().starts_with("no CUDA device found:"), "{err}");
}
