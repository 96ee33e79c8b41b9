//! `megagemma quantize` and `megagemma run --quant`: a checkpoint written by `quantize` runs
//! bit-identically to quantizing the original on load, on every fixture (single-file, sharded,
//! multimodal, MoE); bad arguments give one `error:` line.

mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megagemma-cli-quant-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every fixture with a model (including `moe`, which has no expected.json).
fn model_fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").exists())
        .filter(|p| {
            let cfg: Value = serde_json::from_str(&std::fs::read_to_string(p.join("config.json")).unwrap()).unwrap();
            cfg.get("quantization").is_none()
        })
        .collect();
    v.sort();
    assert!(v.iter().any(|p| p.ends_with("sharded")) && v.iter().any(|p| p.ends_with("moe")), "{v:?}");
    v
}

/// The first case's prompt and length, or a fixed prompt.
fn case(dir: &Path) -> (String, String) {
    match std::fs::read_to_string(dir.join("expected.json")) {
        Ok(t) => {
            let v: Value = serde_json::from_str(&t).unwrap();
            let c = &v["cases"][0];
            let ids: Vec<String> = c["prompt_ids"].as_array().unwrap().iter().map(|x| x.to_string()).collect();
            (ids.join(","), c["max_new_tokens"].to_string())
        }
        Err(_) => ("2,7,8,9,10,11".into(), "12".into()),
    }
}

/// `run --greedy --ignore-eos --output ids --dump-logits`: (ids line, logits file bytes).
fn run(model: &Path, extra: &[&str], dump: &Path, prompt: &str, n: &str) -> (String, Vec<u8>) {
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        prompt,
        "--greedy",
        "--ignore-eos",
        "-n",
        n,
        "--output",
        "ids",
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = megagemma(&args);
    assert!(out.status.success(), "run {} {extra:?} failed: {}", model.display(), stderr(&out));
    (stdout(&out).trim().to_string(), std::fs::read(dump).unwrap())
}

fn quantize(input: &Path, mode: &str, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args =
        vec!["quantize", "--model", input.to_str().unwrap(), "--quant", mode, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    megagemma(&args)
}

fn shard_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

#[test]
fn quantized_checkpoint_runs_bit_identically_to_quantize_on_load() {
    let tmp = scratch("ident");
    std::fs::create_dir_all(&tmp).unwrap();
    for dir in model_fixtures() {
        let fx = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (prompt, n) = case(&dir);
        for mode in ["q4", "q4_0"] {
            let tag = format!("{fx}/{mode}");
            let out_dir = tmp.join(format!("{fx}-{mode}"));
            // Shard the sharded fixture's output too.
            let extra: &[&str] = if fx == "sharded" { &["--max-shard-size", "64K"] } else { &[] };
            let q = quantize(&dir, mode, &out_dir, extra);
            assert!(q.status.success(), "{tag}: quantize failed: {}", stderr(&q));
            let cfg: Value =
                serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap()).unwrap();
            let g = if mode == "q4" { 64 } else { 32 };
            assert_eq!(cfg["quantization"]["group_size"], g, "{tag}");
            assert_eq!(cfg["quantization"]["bits"], 4, "{tag}");
            assert_eq!(cfg["quantization_config"], cfg["quantization"], "{tag}");
            for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"] {
                assert_eq!(dir.join(f).exists(), out_dir.join(f).exists(), "{tag}: {f} not copied");
            }
            if fx == "sharded" {
                assert!(
                    shard_files(&out_dir).len() > 1,
                    "{tag}: expected several shards, got {:?}",
                    shard_files(&out_dir)
                );
                assert!(out_dir.join("model.safetensors.index.json").exists(), "{tag}");
            }

            let (want_ids, want_logits) = run(&dir, &["--quant", mode], &tmp.join("a.json"), &prompt, &n);
            let (got_ids, got_logits) = run(&out_dir, &[], &tmp.join("b.json"), &prompt, &n);
            assert_eq!(got_ids, want_ids, "{tag}: ids of the written checkpoint differ from --quant {mode}");
            assert!(
                got_logits == want_logits,
                "{tag}: logits of the written checkpoint are not bit-identical to --quant {mode}"
            );
            assert_eq!(want_ids.split(',').count(), n.parse::<usize>().unwrap(), "{tag}");
            // Quantization really happened: the logits differ from the bf16 model's.
            let (_, dense_logits) = run(&dir, &[], &tmp.join("c.json"), &prompt, &n);
            assert!(dense_logits != want_logits, "{tag}: --quant {mode} gave the bf16 logits");

            // The written checkpoint is smaller than the input.
            let size =
                |d: &Path| -> u64 { shard_files(d).iter().map(|f| std::fs::metadata(d.join(f)).unwrap().len()).sum() };
            assert!(size(&out_dir) < size(&dir), "{tag}: output is not smaller");
            // --quant on an already-quantized checkpoint is refused.
            let again = megagemma(&[
                "run",
                "--model",
                out_dir.to_str().unwrap(),
                "--prompt-ids",
                "2,3",
                "-n",
                "1",
                "--quant",
                mode,
            ]);
            assert_user_error(&again, "already quantized");
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn quantize_refuses_bad_arguments_with_one_line() {
    let fx = fixtures_dir().join("ple_shared_dw");
    let out = scratch("args");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "x").unwrap();
    // A non-empty --out without --force.
    assert_user_error(&quantize(&fx, "q4", &out, &[]), "not empty");
    // --force overwrites (and removes stale shards).
    std::fs::write(out.join("model-00001-of-00009.safetensors"), "stale").unwrap();
    let q = quantize(&fx, "q4", &out, &["--force"]);
    assert!(q.status.success(), "{}", stderr(&q));
    assert_eq!(shard_files(&out), vec!["model.safetensors".to_string()]);
    assert!(out.join("keep.txt").exists());
    // Unknown or missing scheme, `none`, missing paths, the input as output, a GGUF-like file.
    let fresh = scratch("args2");
    assert_user_error(&quantize(&fx, "q8", &fresh, &[]), "expected none, q4 or q4_0");
    assert_user_error(&quantize(&fx, "none", &fresh, &[]), "q4 or --quant q4_0");
    assert_user_error(
        &megagemma(&["quantize", "--model", fx.to_str().unwrap(), "--out", fresh.to_str().unwrap()]),
        "--quant",
    );
    assert_user_error(&megagemma(&["quantize", "--quant", "q4", "--out", fresh.to_str().unwrap()]), "--model");
    assert_user_error(&megagemma(&["quantize", "--quant", "q4", "--model", fx.to_str().unwrap()]), "--out");
    assert_user_error(&quantize(Path::new("/nonexistent/megagemma"), "q4", &fresh, &[]), "does not exist");
    assert_user_error(&quantize(&fx, "q4", &fx, &["--force"]), "is the input directory");
    assert_user_error(&quantize(&fx, "q4", &fresh, &["--max-shard-size", "lots"]), "--max-shard-size");
    // An already-quantized input.
    assert_user_error(&quantize(&out, "q4_0", &fresh, &[]), "already quantized");
    assert!(!fresh.exists(), "nothing is written on error");
    // run --quant with a bad value.
    assert_user_error(
        &megagemma(&["run", "--model", fx.to_str().unwrap(), "--prompt-ids", "2,3", "-n", "1", "--quant", "int8"]),
        "unknown quantization `int8`",
    );
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&fresh);
}

/// The outside oracle: an MLX 4-bit checkpoint converted by mlx-lm, with transformers' greedy ids
/// (and logits) on its dequantized weights, committed in `tests/fixtures/mlx_q4/`.
#[test]
fn mlx_fixture_matches_its_expected_outputs() {
    let dir = fixtures_dir().join("mlx_q4");
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let tmp = scratch("mlx");
    std::fs::create_dir_all(&tmp).unwrap();
    for c in expected["cases"].as_array().unwrap() {
        let prompt: Vec<String> = c["prompt_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
        let want: Vec<String> = c["greedy_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
        let (ids, logits) = run(&dir, &[], &tmp.join("l.json"), &prompt.join(","), &c["max_new_tokens"].to_string());
        assert_eq!(
            ids,
            want.join(","),
            "mlx_q4/{}: greedy ids differ from transformers on the dequantized weights",
            c["name"]
        );
        if let Some(w) = c["logits"].as_array() {
            let got: Vec<Vec<f32>> = serde_json::from_slice(&logits).unwrap();
            for (step, (g, w)) in got.iter().zip(w).enumerate() {
                let w: Vec<f64> = w.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
                let d = rel_l2(g, &w);
                assert!(d < 1e-4, "mlx_q4/{}: step {step}: logits differ by {d:.3e} relative L2", c["name"]);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
