//! Crafted or corrupt model files from the internet: each case once panicked, divided by zero,
//! over-allocated or was silently misread. Now each is a non-zero exit with one `error:` line.
//! GGUF cases patch the fuzzers' tiny Gemma 3 seed (`fuzz/seeds/gguf`), which runs as is.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A fresh scratch directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megagemma-untrusted-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A scratch copy of a fixture directory.
fn fixture_copy(fixture: &str, tag: &str) -> PathBuf {
    let dst = scratch(tag);
    for e in std::fs::read_dir(fixtures_dir().join(fixture)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Prefill two tokens and decode two more: enough to reach the attention and the KV ring.
fn run_ids(model: &Path) -> Output {
    let m = model.to_str().unwrap();
    megagemma(&["run", "--model", m, "--prompt-ids", "2,5,6", "--greedy", "-n", "2", "--output", "ids"])
}

fn gguf_seed() -> Vec<u8> {
    std::fs::read(repo_root().join("fuzz/seeds/gguf/gemma3-tiny.gguf")).unwrap()
}

/// Offset of the value of metadata `key` (after its length-prefixed name and type id).
fn value_at(bytes: &[u8], key: &str) -> usize {
    let name = [&(key.len() as u64).to_le_bytes()[..], key.as_bytes()].concat();
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap_or_else(|| panic!("no key {key}"));
    at + name.len() + 4
}

fn set_u32(mut bytes: Vec<u8>, key: &str, v: u32) -> Vec<u8> {
    let at = value_at(&bytes, key);
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    bytes
}

fn write_gguf(tag: &str, bytes: &[u8]) -> PathBuf {
    let p = scratch(tag).join("model.gguf");
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn the_gguf_seed_itself_runs() {
    // The positive control for every GGUF case below.
    let out = run_ids(&write_gguf("seed", &gguf_seed()));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim().split(',').count(), 2);
}

#[test]
fn config_sliding_window_zero() {
    let d = fixture_copy("sliding_wrap", "window0");
    edit_config(&d, |c| c["sliding_window"] = 0.into());
    assert_user_error(&run_ids(&d), "`sliding_window` must be positive, got 0");
}

#[test]
fn gguf_sliding_window_zero() {
    let p = write_gguf("gguf-window0", &set_u32(gguf_seed(), "gemma3.attention.sliding_window", 0));
    assert_user_error(&run_ids(&p), "`sliding_window` must be positive, got 0");
}

#[test]
fn gguf_kv_heads_zero_or_not_dividing() {
    let p = write_gguf("gguf-kv0", &set_u32(gguf_seed(), "gemma3.attention.head_count_kv", 0));
    assert_user_error(&run_ids(&p), "num_key_value_heads 0");
    let p = write_gguf("gguf-kv3", &set_u32(gguf_seed(), "gemma3.attention.head_count_kv", 3));
    assert_user_error(&run_ids(&p), "not a multiple of num_key_value_heads 3");
}

#[test]
fn gguf_heads_zero_and_odd_head_dim() {
    let p = write_gguf("gguf-heads0", &set_u32(gguf_seed(), "gemma3.attention.head_count", 0));
    assert_user_error(&run_ids(&p), "gemma3.attention.head_count` must be positive");
    let p = write_gguf("gguf-hd7", &set_u32(gguf_seed(), "gemma3.attention.key_length", 7));
    assert_user_error(&run_ids(&p), "head_dim 7 must be even");
}

#[test]
fn gguf_zero_dimension_token_embd() {
    // token_embd.weight's info: name, n_dims = 2, dims [16, 32], type, offset. Rewrite it with
    // no dimensions (a scalar), dropping the two dims.
    let b = gguf_seed();
    let name = [&17u64.to_le_bytes()[..], b"token_embd.weight"].concat();
    let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    assert_eq!(&b[at..at + 4], &2u32.to_le_bytes());
    let patched = [&b[..at], &0u32.to_le_bytes()[..], &b[at + 4 + 16..]].concat();
    assert_user_error(&run_ids(&write_gguf("gguf-embd0", &patched)), "token_embd.weight` has shape []");
}

#[test]
fn gguf_token_ids_are_not_truncated() {
    // 2^32 + 1 as a u64 would become id 1 under `as u32`.
    let mut b = gguf_seed();
    let at = value_at(&b, "tokenizer.ggml.eos_token_id");
    b[at - 4..at].copy_from_slice(&10u32.to_le_bytes()); // type u32 → u64 needs 4 more bytes:
                                                         // The directory grows by 4 bytes, so the aligned data section may start 32 bytes later: pad.
    let b = [&b[..at], &(u32::MAX as u64 + 2).to_le_bytes()[..], &b[at + 4..], &[0; 32]].concat();
    assert_user_error(&run_ids(&write_gguf("gguf-eos", &b)), "tokenizer.ggml.eos_token_id");
    let p = write_gguf("gguf-eos-vocab", &set_u32(gguf_seed(), "tokenizer.ggml.eos_token_id", 5000));
    assert_user_error(&run_ids(&p), "`eos_token_id` 5000 is outside the vocabulary");
}

#[test]
fn gguf_huge_metadata_count_is_not_preallocated() {
    // A 256 MiB file (sparse: all zeros after the header) whose metadata count is as large as
    // the file could hold (20M entries). Sizing the entry list by that count took ~2 GB before
    // the first entry was read; under a 1 GiB address-space limit it must still fail cleanly
    // (the zero bytes parse as duplicate empty keys).
    let p = scratch("gguf-count").join("huge.gguf");
    let len: u64 = 256 << 20;
    let mut head = b"GGUF".to_vec();
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&0u64.to_le_bytes());
    head.extend_from_slice(&((len - 24) / 13).to_le_bytes());
    std::fs::write(&p, &head).unwrap();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len).unwrap();
    let script = format!("ulimit -v 1048576; exec \"$0\" info --model \"{}\"", p.display());
    let out =
        std::process::Command::new("bash").args(["-c", &script, env!("CARGO_BIN_EXE_megagemma")]).output().unwrap();
    assert_user_error(&out, "duplicate metadata key");
}

#[test]
fn ple_vocab_smaller_than_vocab() {
    let d = fixture_copy("ple_shared_dw", "plevocab");
    edit_config(&d, |c| c["vocab_size_per_layer_input"] = 256.into());
    assert_user_error(&run_ids(&d), "vocab_size_per_layer_input 256 is smaller than vocab_size 512");
}

#[test]
fn safetensors_byte_size_overflow() {
    // A shape whose element count fits but whose byte count (× 4 for F32) overflows usize.
    let d = fixture_copy("gemma3", "stoverflow");
    let header = br#"{"model.norm.weight":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0; 4]);
    std::fs::write(d.join("model.safetensors"), file).unwrap();
    assert_user_error(&run_ids(&d), "overflows the byte size");
}

#[test]
fn config_token_ids_are_checked_not_truncated() {
    let d = fixture_copy("gemma3", "eos-big");
    edit_config(&d, |c| c["eos_token_id"] = serde_json::json!([1, 4294967297u64]));
    assert_user_error(&run_ids(&d), "`eos_token_id` must be a token id");
    let d = fixture_copy("gemma3", "bos-str");
    edit_config(&d, |c| c["bos_token_id"] = "two".into());
    assert_user_error(&run_ids(&d), "`bos_token_id` must be a token id");
    let d = fixture_copy("gemma3", "pad-vocab");
    edit_config(&d, |c| c["pad_token_id"] = 512.into());
    assert_user_error(&run_ids(&d), "`pad_token_id` 512 is outside the vocabulary");
}

#[test]
fn config_sizes_that_overflow() {
    let d = fixture_copy("gemma3", "overflow");
    edit_config(&d, |c| c["vocab_size"] = serde_json::json!(u64::MAX / 2));
    assert_user_error(&run_ids(&d), "vocab_size × hidden_size");
    let d = fixture_copy("gemma3", "inter");
    edit_config(&d, |c| c["intermediate_size"] = serde_json::json!(1u64 << 62));
    assert_user_error(&run_ids(&d), "2 × intermediate_size × hidden_size");
}

#[test]
fn mlx_quantization_group_size_zero() {
    let d = fixture_copy("mlx_q4", "mlx-g0");
    edit_config(&d, |c| c["quantization"]["group_size"] = 0.into());
    assert_user_error(&run_ids(&d), "`group_size` must be a positive integer, got 0");
}

#[test]
fn layer_counts_beyond_any_model_are_refused_before_allocating() {
    // Found by the gguf fuzzer: block_count 637,534,210 sized per-layer lists of 5 GB.
    let p = write_gguf("gguf-layers", &set_u32(gguf_seed(), "gemma3.block_count", 0x2600_0002));
    assert_user_error(&run_ids(&p), "`gemma3.block_count` 637534210 is larger than any supported model");
    let d = fixture_copy("gemma3", "layers");
    edit_config(&d, |c| {
        c["num_hidden_layers"] = 1_000_000_000.into();
        c.as_object_mut().unwrap().remove("layer_types");
    });
    assert_user_error(&run_ids(&d), "`num_hidden_layers` 1000000000 is larger than any supported model");
    let d = fixture_copy("gemma3", "headdim-big");
    edit_config(&d, |c| c["head_dim"] = (1u64 << 30).into());
    assert_user_error(&run_ids(&d), "head_dim` 1073741824 is larger than any supported model");
}
