//! `megagemma run` behaviour beyond exact outputs: the demo model, text and JSON output,
//! chat templating, seeded sampling, stop ids.

mod common;
use common::*;

#[test]
fn demo_model_runs_and_says_its_weights_are_random() {
    let out = megagemma(&["run", "--prompt", "Hello there", "--max-new-tokens", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("random"), "the demo must say its weights are random: {}", stderr(&out));
}

#[test]
fn json_output_has_the_documented_fields() {
    let d = fixtures_dir().join("ple_shared_dw");
    let out = megagemma(&[
        "run",
        "--model",
        d.to_str().unwrap(),
        "--prompt",
        "the cat",
        "--raw",
        "--greedy",
        "--ignore-eos",
        "-n",
        "5",
        "--output",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("stdout is one JSON object");
    assert_eq!(v["ids"].as_array().unwrap().len(), 5);
    assert!(v["text"].is_string());
    assert!(v["prompt_tokens"].as_u64().unwrap() >= 2, "raw prompt gets BOS + text tokens");
    assert!(v["tokens_per_second"].as_f64().unwrap() > 0.0);
}

#[test]
fn chat_prompt_is_templated_unless_raw() {
    let d = fixtures_dir().join("ple_shared_dw");
    let get = |extra: &[&str]| {
        let mut a = vec![
            "run",
            "--model",
            d.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--greedy",
            "--ignore-eos",
            "-n",
            "3",
            "--output",
            "json",
        ];
        a.extend_from_slice(extra);
        let out = megagemma(&a);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str::<serde_json::Value>(stdout(&out).trim()).unwrap()
    };
    let chat = get(&[]);
    let raw = get(&["--raw"]);
    assert!(chat["prompt_tokens"].as_u64() > raw["prompt_tokens"].as_u64(), "chat template adds turn markers");
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_matters() {
    let d = fixtures_dir().join("ple_shared_dw");
    let run = |seed: &str| {
        let out = megagemma(&[
            "run",
            "--model",
            d.to_str().unwrap(),
            "--prompt-ids",
            "2,10,11",
            "--temperature",
            "1.0",
            "--top-k",
            "50",
            "--seed",
            seed,
            "--ignore-eos",
            "-n",
            "24",
            "--output",
            "ids",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"), "different seeds should give different samples over 24 tokens");
}

#[test]
fn stops_at_eos_unless_ignored() {
    // Find the greedy continuation, then declare its 3rd token an EOS via a scratch config.
    let src = fixtures_dir().join("ple_shared_dw");
    let dst = std::env::temp_dir().join(format!("megagemma-eos-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    let ids = |extra: &[&str]| {
        let mut a = vec![
            "run",
            "--model",
            dst.to_str().unwrap(),
            "--prompt-ids",
            "2,10,11",
            "--greedy",
            "-n",
            "8",
            "--output",
            "ids",
        ];
        a.extend_from_slice(extra);
        let out = megagemma(&a);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).trim().split(',').map(|s| s.parse::<u32>().unwrap()).collect::<Vec<_>>()
    };
    let full = ids(&["--ignore-eos"]);
    let stop = full[2];
    let first = full.iter().position(|&t| t == stop).unwrap();
    std::fs::write(dst.join("generation_config.json"), format!("{{\"eos_token_id\": [{stop}], \"bos_token_id\": 2}}"))
        .unwrap();
    assert_eq!(ids(&[]), full[..=first].to_vec(), "generation must stop right after the EOS id");
    assert_eq!(ids(&["--ignore-eos"]).len(), 8);
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn info_prints_the_layer_plan() {
    let d = fixtures_dir().join("ple_shared_dw");
    let out = megagemma(&["info", "--model", d.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // Layers 3..5 share KV: sliding ones read layer 1's cache, the full one layer 2's.
    let row = |i: usize| text.lines().find(|l| l.starts_with(&format!("{i} "))).unwrap().to_string();
    assert!(row(3).contains("1 (shared)") && row(5).contains("2 (shared)"), "{text}");
    assert!(row(0).contains("own") && row(5).contains("full"), "{text}");
    assert!(text.contains("weights streamed per decode step"));
    // The fixture's max_position_embeddings.
    assert!(text.contains("sliding window 8  context 4096"), "{text}");
    let bad = megagemma(&["info", "--model", "/nonexistent/dir"]);
    assert!(!bad.status.success() && stderr(&bad).starts_with("error: "));
}

/// `--ctx` past the model's `max_position_embeddings` (4,096 in the fixtures) runs, with one note
/// saying so; within it there is no note.
#[test]
fn a_context_past_the_trained_maximum_is_noted() {
    let d = fixtures_dir().join("ple_shared_dw");
    let run = |ctx: &str| {
        let out = megagemma(&[
            "run",
            "--model",
            d.to_str().unwrap(),
            "--prompt-ids",
            "2,100,200",
            "--max-new-tokens",
            "2",
            "--output",
            "ids",
            "--backend",
            "cpu",
            "--ctx",
            ctx,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        stderr(&out)
    };
    let past = run("5000");
    assert!(past.contains("note: --ctx 5000 is past the model's trained maximum of 4096 positions"), "{past}");
    assert!(!run("4096").contains("trained maximum"));
}
