//! Helpers shared by the CLI integration tests.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

pub fn fixtures_dir() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// Every committed fixture directory (those with an expected.json).
pub fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").exists())
        .collect();
    v.sort();
    assert!(v.len() >= 5, "expected at least 5 fixtures, found {}", v.len());
    v
}

/// The CLI, with its cache (pulled models, the unpacked demo model) in the repository's ignored
/// `.cache/megagemma` rather than the user's.
pub fn megagemma(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megagemma"))
        .args(args)
        .env("MEGAGEMMA_CACHE", repo_root().join(".cache/megagemma"))
        .output()
        .expect("failed to start megagemma")
}

/// `megagemma run` of `model`: `n` greedy tokens past EOS from `prompt_ids` (an `expected.json`
/// case's JSON array), printed as one line of ids, every step's logits written to `dump`.
pub fn greedy_ids_and_logits(
    model: &std::path::Path,
    prompt_ids: &serde_json::Value,
    n: u64,
    dump: &std::path::Path,
) -> Output {
    let prompt: Vec<String> = prompt_ids.as_array().unwrap().iter().map(|v| v.to_string()).collect();
    megagemma(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        &prompt.join(","),
        "--greedy",
        "--ignore-eos",
        "--max-new-tokens",
        &n.to_string(),
        "--output",
        "ids",
        "--dump-logits",
        dump.to_str().unwrap(),
    ])
}

/// The CLI with `input` on its standard input (e.g. a `chat` session). A run that fails at start
/// (a refused flag) may exit before it reads the input.
pub fn megagemma_with_input(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_megagemma"))
        .args(args)
        .env("MEGAGEMMA_CACHE", repo_root().join(".cache/megagemma"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("failed to start megagemma");
    if let Err(e) = child.stdin.take().unwrap().write_all(input) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    child.wait_with_output().unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Relative L2 distance ‖a − b‖ / ‖b‖.
pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// A user error: non-zero exit, exactly one line on stderr starting with `error:`, no panic.
pub fn assert_user_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("note:")).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {err:?}");
    assert!(lines[0].starts_with("error: "), "error line should start with `error: `: {err:?}");
    assert!(
        lines[0].to_lowercase().contains(&needle.to_lowercase()),
        "error line {:?} should mention {needle:?}",
        lines[0]
    );
}
