//! `megagemma bench`: the documented figures, as a table and one JSON line, and clear errors.

mod common;
use common::*;

/// `megagemma bench` on the CPU over a short prompt and run (8 prompt tokens, 6 decoded), then `extra`.
fn bench_cpu(model: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let base = ["bench", "--model", model.to_str().unwrap(), "--backend", "cpu", "--prompt-len", "8", "--tokens", "6"];
    megagemma(&[&base[..], extra].concat())
}

#[test]
fn bench_prints_the_table_and_a_json_line() {
    let d = fixtures_dir().join("sliding_wrap");
    let out = bench_cpu(&d, &["--draft", "oracle", "--acceptance", "1", "--k", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for label in ["read bandwidth", "weights/token", "prefill", "decode", "achieved", "verify", "speculative"] {
        assert!(text.lines().any(|l| l.starts_with(label)), "no `{label}` line in:\n{text}");
    }
    let json: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(json["backend"], "cpu");
    assert_eq!(json["verify_columns"], 4);
    assert_eq!(json["spec_mean_accepted"], 3.0, "always-right drafts are all accepted");
    for key in ["read_gbps", "decode_tok_s", "prefill_tok_s", "achieved_gbps", "bandwidth_pct", "verify_ms"] {
        assert!(json[key].as_f64().is_some_and(|v| v > 0.0), "{key} = {}", json[key]);
    }
    assert!(json["weight_bytes_per_token"].as_u64().unwrap() > 0);
    // The graph-path baseline is timed only beside the CUDA megakernel.
    assert!(json["graph_decode_ms_per_token"].is_null() && json["megakernel_over_graph"].is_null());
    assert!(!text.contains("graph path"), "{text}");
    // The figures name the code they measured: the commit this checkout's binary was built from
    // ("unknown" outside a git checkout), also in `--version`.
    let head = std::process::Command::new("git").args(["rev-parse", "--short=9", "HEAD"]).output();
    let head = match head.ok().filter(|o| o.status.success()) {
        Some(o) => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        None => "unknown".to_string(),
    };
    assert_eq!(json["commit"], head);
    let version = stdout(&megagemma(&["--version"]));
    assert!(version.contains(&format!("({head})")), "{version}");
}

/// `--batch N` steps N sequences together and reports their aggregate speed beside the lone one.
#[test]
fn bench_batch_reports_the_aggregate() {
    let d = fixtures_dir().join("sliding_wrap");
    let out = bench_cpu(&d, &["--batch", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.starts_with("batch")).unwrap_or_else(|| panic!("no batch line in:\n{text}"));
    assert!(line.contains("3 sequences"), "{line}");
    let json: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(json["batch"], 3);
    let (ms, tps) = (json["batch_ms_per_step"].as_f64().unwrap(), json["batch_tok_s"].as_f64().unwrap());
    assert!((tps - 3.0 * 1e3 / ms).abs() < 1e-6 * tps, "{ms} ms per step, {tps} tok/s");
    // Without --batch there is no batched figure.
    let json: serde_json::Value = serde_json::from_str(stdout(&bench_cpu(&d, &[])).lines().last().unwrap()).unwrap();
    assert!(json["batch_tok_s"].is_null() && json["batch"] == 1, "{json}");
}

/// `--temperature T` also times sampled decoding: from the k highest logits when top-k is at most
/// 64 (`Want::Candidates`), else from whole rows; without it there is no sampled figure.
#[test]
fn bench_times_sampled_decoding() {
    let d = fixtures_dir().join("sliding_wrap");
    for (k, how) in [("8", "the k highest logits"), ("65", "whole logits rows")] {
        let out = bench_cpu(&d, &["--temperature", "0.8", "--top-k", k, "--top-p", "0.9", "--seed", "3"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        let line =
            text.lines().find(|l| l.starts_with("sampled")).unwrap_or_else(|| panic!("no sampled line:\n{text}"));
        assert!(line.contains(&format!("top-k {k}")) && line.contains(how), "{line}");
        let json: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert!(json["sampled_tok_s"].as_f64().is_some_and(|v| v > 0.0), "{json}");
    }
    let json: serde_json::Value = serde_json::from_str(stdout(&bench_cpu(&d, &[])).lines().last().unwrap()).unwrap();
    assert!(json["sampled_tok_s"].is_null(), "{json}");
}

#[test]
fn bench_errors_are_one_line() {
    let d = fixtures_dir().join("sliding_wrap");
    for (args, needle) in [
        (vec!["bench"], "--model"),
        (vec!["bench", "--synthetic", "e4b", "--backend", "cpu"], "GPU"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--tokens", "0"], "--tokens"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--ctx", "16"], "--ctx"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--batch", "0"], "--batch"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--backend", "cpu", "--trace", "t.json"], "--decode megakernel"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--draft", "mtp"], "--assistant"),
        (vec!["bench", "--synthetic", "e4b", "--draft", "mtp", "--assistant", "x"], "random assistant"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--top-k", "8"], "--temperature"),
        (vec!["bench", "--model", d.to_str().unwrap(), "--backend", "cpu", "--temperature=-1"], "invalid temperature"),
        (
            vec!["bench", "--model", d.to_str().unwrap(), "--backend", "cpu", "--temperature", "1", "--top-p", "0"],
            "top_p",
        ),
    ] {
        let out = megagemma(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = stderr(&out);
        assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `--draft mtp --assistant DIR` times a draft round beside the decode step, and runs speculative
/// decoding with it (the committed assistants' target).
#[test]
fn bench_times_a_draft_round_with_the_assistant() {
    let d = fixtures_dir().join("ple_shared_dw");
    let a = fixtures_dir().join("assistants").join("centroid");
    let out = bench_cpu(&d, &["--draft", "mtp", "--assistant", a.to_str().unwrap(), "--k", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.starts_with("draft")).unwrap_or_else(|| panic!("no draft line in:\n{text}"));
    assert!(line.contains("2 tokens in"), "{line}");
    assert!(text.lines().any(|l| l.starts_with("speculative")), "{text}");
    let json: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(json["draft"], "mtp");
    assert!(json["draft_ms"].as_f64().is_some_and(|v| v > 0.0), "draft_ms = {}", json["draft_ms"]);
}
