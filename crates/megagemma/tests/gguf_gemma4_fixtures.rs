//! Gemma 4 GGUF files (llama.cpp's `gemma4` architecture), written from the committed tiny
//! fixtures by tools/make_gguf4_fixture.py (which follows llama.cpp's converter) into
//! tests/fixtures-gguf/gemma4/. BF16 tensors hold the fixtures' BF16 weights exactly, so the CLI
//! must reproduce transformers' float64 greedy ids and logits recorded in each source fixture's
//! expected.json (mixture of experts included); the Q8_0 file must match its dequantized values;
//! broken files must fail with one clear error line.

mod common;
use common::*;
use serde_json::Value;
use std::path::PathBuf;

const LOGITS_TOLERANCE: f64 = 1e-4;

fn gguf_dir() -> PathBuf {
    repo_root().join("tests/fixtures-gguf/gemma4")
}

fn expected(fixture: &str) -> Value {
    let path = fixtures_dir().join(fixture).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|x| x.to_string()).collect()
}

/// Runs every case of `fixture`'s expected.json on `gguf`; returns (name, ids, logits) per case.
fn run_cases(gguf: &str, fixture: &str) -> Vec<(String, Vec<String>, Vec<Vec<f32>>)> {
    let model = gguf_dir().join(gguf);
    assert!(model.is_file(), "{} is missing", model.display());
    let tmp = std::env::temp_dir().join(format!("megagemma-gguf4-{}-{gguf}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut out = Vec::new();
    for case in expected(fixture)["cases"].as_array().unwrap() {
        let name = format!("{gguf}/{}", case["name"].as_str().unwrap());
        let dump = tmp.join(format!("{}.json", case["name"].as_str().unwrap()));
        let o = greedy_ids_and_logits(&model, &case["prompt_ids"], case["max_new_tokens"].as_u64().unwrap(), &dump);
        assert!(o.status.success(), "{name}: megagemma failed: {}", stderr(&o));
        let got: Vec<String> = stdout(&o).trim().split(',').map(str::to_string).collect();
        let logits: Vec<Vec<f32>> = serde_json::from_str(&std::fs::read_to_string(&dump).unwrap()).unwrap();
        out.push((name, got, logits));
    }
    let _ = std::fs::remove_dir_all(&tmp);
    out
}

fn want_logits(case: &Value, step: usize) -> Vec<f64> {
    case["logits"][step].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

#[test]
fn bf16_gguf_files_match_transformers_exactly() {
    let mut checked = 0;
    for fixture in ["ple_shared_dw", "keqv_global", "sliding_wrap", "moe"] {
        let exp = expected(fixture);
        let cases = exp["cases"].as_array().unwrap();
        for ((name, got, logits), case) in run_cases(&format!("{fixture}.gguf"), fixture).iter().zip(cases) {
            assert_eq!(*got, ids(&case["greedy_ids"]), "{name}: greedy ids differ from transformers");
            assert_eq!(logits.len(), case["logits"].as_array().unwrap().len(), "{name}: one logits row per step");
            for (step, row) in logits.iter().enumerate() {
                let d = rel_l2(row, &want_logits(case, step));
                assert!(d < LOGITS_TOLERANCE, "{name}: step {step}: logits differ by {d:.3e} relative L2");
            }
            checked += 1;
        }
    }
    assert!(checked >= 8, "only {checked} cases checked");
}

#[test]
fn q8_0_gguf_file_matches_its_dequantized_values() {
    // 8-bit weights move a random tiny model's logits by several percent (its ids drift from
    // transformers' within a few steps), so the Q8_0 file is checked against the same values
    // dequantized and stored as F32 (`--outtype q8_0-dequantized`): only the dot products'
    // summation order differs.
    let quantized = run_cases("sliding_wrap.q8_0.gguf", "sliding_wrap");
    let reference = run_cases("sliding_wrap.q8_0-dequantized.gguf", "sliding_wrap");
    assert_eq!(quantized.len(), reference.len());
    for ((name, got, logits), (_, want, want_logits)) in quantized.iter().zip(&reference) {
        assert_eq!(got, want, "{name}: greedy ids differ from the dequantized F32 file's");
        for (step, (g, w)) in logits.iter().zip(want_logits).enumerate() {
            let w: Vec<f64> = w.iter().map(|&x| x as f64).collect();
            let d = rel_l2(g, &w);
            assert!(d < 1e-3, "{name}: step {step}: logits differ by {d:.3e} relative L2");
        }
    }
}

#[test]
fn text_prompts_through_the_gguf_tokenizer_and_chat_template_match_the_checkpoint() {
    // Tokenizer and chat template come from the file's metadata (`gemma4` tokenizer model,
    // tokenizer.chat_template); the checkpoint directory uses its tokenizer.json and
    // chat_template.jinja. Same prompt ids, same greedy ids.
    let json = |model: &PathBuf| -> Value {
        let o = megagemma(&[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "The keeper climbed the stairs, café ☃",
            "--greedy",
            "-n",
            "12",
            "--output",
            "json",
        ]);
        assert!(o.status.success(), "{}: {}", model.display(), stderr(&o));
        serde_json::from_str(stdout(&o).trim()).unwrap()
    };
    let gguf = json(&gguf_dir().join("ple_shared_dw.gguf"));
    let dir = json(&fixtures_dir().join("ple_shared_dw"));
    assert_eq!(gguf["prompt_tokens"], dir["prompt_tokens"]);
    assert_eq!(gguf["ids"], dir["ids"]);
}

/// A copy of `gguf` with the metadata key `from` renamed to `to` (same length), in a temp dir.
fn with_key_renamed(gguf: &str, from: &str, to: &str) -> PathBuf {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(gguf_dir().join(gguf)).unwrap();
    let mut key = (from.len() as u64).to_le_bytes().to_vec();
    key.extend(from.as_bytes());
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap_or_else(|| panic!("{from} not in {gguf}"));
    bytes[at + 8..at + key.len()].copy_from_slice(to.as_bytes());
    let dir = std::env::temp_dir().join(format!("megagemma-gguf4-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{to}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A copy of `gguf` that says it is shard 1 of 3 (`split.count` = 3, as llama.cpp's `gguf-split`
/// writes): two key-value pairs inserted after the header, 64 bytes in all, so the tensor data
/// stays aligned where its offsets say.
fn as_split_shard(gguf: &str) -> PathBuf {
    let bytes = std::fs::read(gguf_dir().join(gguf)).unwrap();
    let kv = |key: &str, ty: u32, value: &[u8]| -> Vec<u8> {
        let mut e = (key.len() as u64).to_le_bytes().to_vec();
        e.extend(key.as_bytes());
        e.extend(ty.to_le_bytes());
        e.extend(value);
        e
    };
    let mut extra = kv("split.count", 2, &3u16.to_le_bytes()); // GGUF type 2: u16
    extra.extend(kv("megagemma.test.padding.xyz", 0, &[0])); // type 0: u8
    assert_eq!(extra.len(), 64);
    let kv_count = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
    let mut out = bytes[..16].to_vec();
    out.extend((kv_count + 2).to_le_bytes());
    out.extend(&extra);
    out.extend(&bytes[24..]);
    let path = std::env::temp_dir().join(format!("megagemma-gguf4-split-{}-00001-of-00003.gguf", std::process::id()));
    std::fs::write(&path, out).unwrap();
    path
}

#[test]
fn a_split_file_shard_says_to_merge_the_shards() {
    let model = as_split_shard("sliding_wrap.gguf");
    let o = megagemma(&["run", "--model", model.to_str().unwrap(), "--prompt-ids", "2,10", "--max-new-tokens", "1"]);
    assert_user_error(&o, "one shard of a GGUF split into 3 files");
    let _ = std::fs::remove_file(model);
}

#[test]
fn broken_gemma4_files_fail_in_one_line() {
    for (gguf, from, to, needle) in [
        (
            "ple_shared_dw.gguf",
            "gemma4.attention.sliding_window_pattern",
            "gemma4.attention.sliding_window_patterX",
            "missing `gemma4.attention.sliding_window_pattern`",
        ),
        ("moe.gguf", "gemma4.expert_count", "gemma4.expert_counX", "is an expert tensor but `gemma4.expert_count`"),
        ("sliding_wrap.gguf", "gemma4.rope.dimension_count_swa", "gemma4.rope.dimension_count_swX", ""),
    ] {
        let model = with_key_renamed(gguf, from, to);
        let o =
            megagemma(&["run", "--model", model.to_str().unwrap(), "--prompt-ids", "2,10", "--max-new-tokens", "1"]);
        if needle.is_empty() {
            // An optional key: llama.cpp's default (the sliding head dim) applies.
            assert!(o.status.success(), "{to}: {}", stderr(&o));
        } else {
            assert_user_error(&o, needle);
        }
        let _ = std::fs::remove_file(model);
    }
}
