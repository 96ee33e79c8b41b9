//! Every committed fixture, through the CLI: greedy ids equal transformers' float64 greedy ids,
//! and the final logits of every step are within 1e-4 relative L2 of transformers'.

mod common;
use common::*;
use serde_json::Value;

const LOGITS_TOLERANCE: f64 = 1e-4;

#[test]
fn cli_greedy_ids_and_logits_match_transformers() {
    let tmp = std::env::temp_dir().join(format!("megagemma-logits-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut checked = 0;
    for dir in fixtures() {
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        for case in expected["cases"].as_array().unwrap() {
            let name = format!("{}/{}", dir.file_name().unwrap().to_string_lossy(), case["name"].as_str().unwrap());
            let dump = tmp.join(format!("{}.json", name.replace('/', "_")));
            let out = greedy_ids_and_logits(&dir, &case["prompt_ids"], case["max_new_tokens"].as_u64().unwrap(), &dump);
            assert!(out.status.success(), "{name}: megagemma failed: {}", stderr(&out));
            let want: Vec<String> = case["greedy_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
            let stdout = stdout(&out);
            assert_eq!(stdout.lines().count(), 1, "{name}: --output ids must print exactly one line");
            assert_eq!(stdout.trim(), want.join(","), "{name}: greedy ids differ from transformers");

            let got: Vec<Vec<f32>> = serde_json::from_str(&std::fs::read_to_string(&dump).unwrap()).unwrap();
            let want_logits = case["logits"].as_array().unwrap();
            assert_eq!(got.len(), want_logits.len(), "{name}: one logits row per generated step");
            for (step, (g, w)) in got.iter().zip(want_logits).enumerate() {
                let w: Vec<f64> = w.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
                let d = rel_l2(g, &w);
                assert!(d < LOGITS_TOLERANCE, "{name}: step {step}: logits differ by {d:.3e} relative L2");
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} cases checked");
    let _ = std::fs::remove_dir_all(&tmp);
}
