//! `--model` by name: a Hugging Face repo id found in a local HF cache (its snapshot layout,
//! built here in a temporary directory from a committed fixture), and the errors when a name
//! cannot be found.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const HASH: &str = "3f1c2a9be5d04c8e7a6b1f2e3d4c5b6a79880a1b";

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megagemma-hfcache-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `hub/models--ORG--NAME` as huggingface_hub writes it, holding a fixture's files.
fn fake_hub_entry(hub: &Path, org: &str, name: &str, fixture: &str) {
    let files: Vec<(PathBuf, String)> = std::fs::read_dir(fixtures_dir().join(fixture))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (p, name)
        })
        .collect();
    fake_hub_files(hub, org, name, &files);
}

/// `hub/models--ORG--NAME` with each (source, name) file: the files as blobs, the snapshot's
/// names symlinked to them, `refs/main` holding the snapshot's commit hash.
fn fake_hub_files(hub: &Path, org: &str, name: &str, files: &[(PathBuf, String)]) {
    let repo = hub.join(format!("models--{org}--{name}"));
    let snap = repo.join("snapshots").join(HASH);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    for (i, (from, to)) in files.iter().enumerate() {
        let blob = format!("{i:040x}");
        std::fs::copy(from, repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(to)).unwrap();
    }
    std::fs::write(repo.join("refs/main"), HASH).unwrap();
}

/// The CLI with a controlled environment: no HF variables but those given.
fn megagemma_env(args: &[&str], env: &[(&str, &Path)], offline: bool) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_megagemma"));
    c.args(args).env("MEGAGEMMA_CACHE", repo_root().join(".cache/megagemma"));
    for k in ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE"] {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    if offline {
        c.env("HF_HUB_OFFLINE", "1");
    }
    c.output().expect("failed to start megagemma")
}

fn greedy_ids(model: &str, env: &[(&str, &Path)]) -> Output {
    megagemma_env(
        &["run", "--model", model, "--prompt-ids", "2,318,437,474,335", "--greedy", "-n", "20", "--output", "ids"],
        env,
        false,
    )
}

/// The fixture's first case: transformers' greedy ids.
fn expected_ids(fixture: &str) -> String {
    let text = std::fs::read_to_string(fixtures_dir().join(fixture).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = &v["cases"][0];
    assert_eq!(case["prompt_ids"], serde_json::json!([2, 318, 437, 474, 335]));
    let ids: Vec<String> = case["greedy_ids"].as_array().unwrap().iter().map(|x| x.to_string()).collect();
    ids.join(",")
}

#[test]
fn a_repo_id_runs_from_hf_hub_cache_and_from_hf_home() {
    let root = scratch("ok");
    let hub = root.join("hub");
    fake_hub_entry(&hub, "test-org", "tiny-gemma3", "gemma3");
    let want = expected_ids("gemma3");

    let out = greedy_ids("test-org/tiny-gemma3", &[("HF_HUB_CACHE", &hub)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), want);
    // HF_HOME/hub when HF_HUB_CACHE is not set; the revision named explicitly works too.
    let out = greedy_ids("test-org/tiny-gemma3@main", &[("HF_HOME", &root)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), want);
    let out = greedy_ids(&format!("test-org/tiny-gemma3@{HASH}"), &[("HF_HOME", &root)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), want);
    // `info` resolves names the same way.
    let out = megagemma_env(&["info", "--model", "test-org/tiny-gemma3"], &[("HF_HUB_CACHE", &hub)], true);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("Gemma3"), "{}", stdout(&out));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_missing_repo_is_one_error_line_that_says_how_to_get_it() {
    let root = scratch("missing");
    let hub = root.join("hub");
    std::fs::create_dir_all(&hub).unwrap();
    let out = greedy_ids("google/gemma-3-270m-it", &[("HF_HUB_CACHE", &hub)]);
    assert_user_error(&out, "hf download google/gemma-3-270m-it");
    assert!(stderr(&out).contains(hub.to_str().unwrap()), "names the cache it looked in: {}", stderr(&out));
    // A snapshot that lost its blobs (a broken download) is reported by the loader, not a panic.
    fake_hub_entry(&hub, "test-org", "broken", "gemma3");
    for e in std::fs::read_dir(hub.join("models--test-org--broken/blobs")).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
    let out = greedy_ids("test-org/broken", &[("HF_HUB_CACHE", &hub)]);
    assert!(!out.status.success());
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn offline_a_known_name_must_already_be_pulled() {
    let root = scratch("offline");
    let out = Command::new(env!("CARGO_BIN_EXE_megagemma"))
        .args(["run", "--model", "gemma3-270m", "--prompt-ids", "2,3", "-n", "1"])
        .env("MEGAGEMMA_CACHE", &root)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_user_error(&out, "HF_HUB_OFFLINE is set");
    assert!(std::fs::read_dir(&root).unwrap().next().is_none(), "nothing was fetched into the empty cache");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A GGUF repo as llama.cpp users download them: one file per quantization beside a projector
/// file; `ORG/NAME:QUANT` picks the file, as `-hf ORG/NAME:QUANT` does there.
#[test]
fn a_quant_tag_picks_the_file_of_a_gguf_repo() {
    let root = scratch("gguf");
    let hub = root.join("hub");
    let ggufs = repo_root().join("tests/fixtures-gguf/gemma4");
    let files: Vec<(PathBuf, String)> = [
        ("sliding_wrap.gguf", "tiny-gemma4-BF16.gguf"),
        ("sliding_wrap.q8_0.gguf", "tiny-gemma4-Q8_0.gguf"),
        ("moe.gguf", "mmproj-tiny-gemma4-F16.gguf"),
    ]
    .into_iter()
    .map(|(from, to)| (ggufs.join(from), to.to_string()))
    .collect();
    fake_hub_files(&hub, "test-org", "tiny-gemma4-GGUF", &files);
    let text = std::fs::read_to_string(fixtures_dir().join("sliding_wrap/expected.json")).unwrap();
    let case = &serde_json::from_str::<serde_json::Value>(&text).unwrap()["cases"][0];
    let ids = |key: &str| -> String {
        case[key].as_array().unwrap().iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
    };
    let n = case["greedy_ids"].as_array().unwrap().len().to_string();
    let run = |model: &str| {
        let args = ["run", "--model", model, "--prompt-ids", &ids("prompt_ids"), "--greedy", "--ignore-eos", "-n", &n];
        megagemma_env(&[&args[..], &["--output", "ids"]].concat(), &[("HF_HUB_CACHE", &hub)], true)
    };
    // BF16 holds the fixture's weights exactly: transformers' ids.
    let out = run("test-org/tiny-gemma4-GGUF:bf16");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), ids("greedy_ids"));
    let out = run("test-org/tiny-gemma4-GGUF:Q8_0");
    assert!(out.status.success(), "{}", stderr(&out));
    // Without a tag two model files are ambiguous (the projector is never a candidate); a tag
    // that names no model file, the projector's included, is one error line listing the files.
    assert_user_error(&run("test-org/tiny-gemma4-GGUF"), ":QUANT");
    let out = run("test-org/tiny-gemma4-GGUF:F16");
    assert_user_error(&out, "no .gguf file matches `:F16`");
    assert!(stderr(&out).contains("tiny-gemma4-BF16.gguf, tiny-gemma4-Q8_0.gguf"), "{}", stderr(&out));
    std::fs::remove_dir_all(&root).unwrap();
}
