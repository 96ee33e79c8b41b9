//! Bad input: a non-zero exit and one clear `error:` line on stderr, never a panic.

mod common;
use common::*;
use std::path::{Path, PathBuf};

/// A scratch copy of a fixture that a test may break.
fn scratch_copy(fixture: &str, tag: &str) -> PathBuf {
    let src = fixtures_dir().join(fixture);
    let dst = std::env::temp_dir().join(format!("megagemma-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

fn run_ids(model: &Path, ids: &str) -> std::process::Output {
    megagemma(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        ids,
        "--greedy",
        "--max-new-tokens",
        "2",
        "--output",
        "ids",
    ])
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn missing_model_dir() {
    let out = run_ids(Path::new("/nonexistent/megagemma-model"), "2,3");
    assert_user_error(&out, "does not exist");
}

#[test]
fn truncated_safetensors() {
    let d = scratch_copy("ple_shared_dw", "trunc");
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    assert_user_error(&run_ids(&d, "2,3"), "model.safetensors");
    // A header that is not JSON at all.
    let mut junk = 64u64.to_le_bytes().to_vec();
    junk.extend_from_slice(&[b'x'; 80]);
    std::fs::write(&f, &junk).unwrap();
    assert_user_error(&run_ids(&d, "2,3"), "corrupt safetensors header");
    // Too short to have a header.
    std::fs::write(&f, b"abc").unwrap();
    assert_user_error(&run_ids(&d, "2,3"), "not a safetensors file");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn wrong_shapes_name_the_tensor_and_expected_shape() {
    let d = scratch_copy("ple_shared_dw", "shape");
    edit_config(&d, |v| {
        let i = v["intermediate_size"].as_u64().unwrap();
        v["intermediate_size"] = (i + 8).into();
    });
    let out = run_ids(&d, "2,3");
    assert_user_error(&out, "mlp.gate_proj.weight");
    assert_user_error(&out, "expected");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn unknown_architecture() {
    let d = scratch_copy("ple_shared_dw", "arch");
    edit_config(&d, |v| v["architectures"] = serde_json::json!(["LlamaForCausalLM"]));
    assert_user_error(&run_ids(&d, "2,3"), "unsupported architecture `LlamaForCausalLM`");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn token_id_out_of_vocab() {
    let d = fixtures_dir().join("ple_shared_dw");
    let out = run_ids(&d, "2,999999");
    assert_user_error(&out, "token id 999999");
    assert_user_error(&out, "vocab_size");
    assert_user_error(&run_ids(&d, "2,abc"), "invalid token id `abc`");
}

#[test]
fn empty_prompt() {
    let d = fixtures_dir().join("ple_shared_dw");
    assert_user_error(&run_ids(&d, ""), "empty prompt");
    let out = megagemma(&["run", "--model", d.to_str().unwrap(), "--prompt", "   ", "--max-new-tokens", "2"]);
    assert_user_error(&out, "empty prompt");
    let out = megagemma(&["run", "--model", d.to_str().unwrap(), "--max-new-tokens", "2"]);
    assert_user_error(&out, "no prompt");
}

#[test]
fn bad_sampling_parameters() {
    let d = fixtures_dir().join("ple_shared_dw");
    let out = megagemma(&["run", "--model", d.to_str().unwrap(), "--prompt-ids", "2", "--top-p", "1.5"]);
    assert_user_error(&out, "top_p");
}

/// A scratch `.gguf` file with the given bytes.
fn scratch_gguf(tag: &str, bytes: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("megagemma-bad-{tag}-{}.gguf", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn corrupt_gguf_files() {
    let header = |version: u32, tensors: u64, kvs: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&tensors.to_le_bytes());
        b.extend_from_slice(&kvs.to_le_bytes());
        b
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("magic", b"GGML\x03\x00\x00\x00".repeat(4), "bad magic"),
        ("truncated", header(3, 0, 0)[..10].to_vec(), "truncated"),
        ("counts", header(3, 1 << 40, 0), "tensor count"),
        ("kvcount", header(3, 0, 1 << 40), "metadata count"),
        ("version", header(9, 0, 0), "unsupported GGUF version 9"),
        ("empty", header(3, 0, 0), "general.architecture"),
    ];
    for (tag, bytes, needle) in cases {
        let p = scratch_gguf(tag, &bytes);
        assert_user_error(&run_ids(&p, "2,3"), needle);
        std::fs::remove_file(&p).unwrap();
    }
}

#[test]
fn malformed_generation_config() {
    let d = scratch_copy("ple_shared_dw", "genconfig");
    std::fs::write(d.join("generation_config.json"), "{ not json").unwrap();
    assert_user_error(&run_ids(&d, "2,3"), "generation_config.json");
    std::fs::remove_dir_all(&d).unwrap();
}
