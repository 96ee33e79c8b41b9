use megagemma_engine::sampling::{argmax, read_generation_config, Sampler, SamplingError, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p, seed: Some(seed) }
}

/// Logits whose softmax at temperature 1 is exactly `probs`.
fn logits_for(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn histogram(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
    let mut counts = vec![0; logits.len()];
    for _ in 0..draws {
        counts[sampler.sample(logits).unwrap() as usize] += 1;
    }
    counts
}

fn random_logits(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-10.0f32..10.0)).collect()
}

const PROBS: [f64; 4] = [0.5, 0.3, 0.15, 0.05];
const DRAWS: usize = 20_000;

#[test]
fn greedy_is_argmax_and_first_index_wins_ties() {
    let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(sampler.sample(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
    assert_eq!(sampler.sample(&[5.0, 5.0, 5.0]).unwrap(), 0);
    assert_eq!(sampler.sample(&[-1.0, f32::NAN, -0.5]).unwrap(), 2, "NaN must be ignored");
    assert_eq!(sampler.sample(&[f32::NEG_INFINITY, -1e30, f32::NEG_INFINITY]).unwrap(), 1);
    assert_eq!(argmax(&[0.0, 7.0, 7.0]), Some(1));
    assert_eq!(argmax(&[]), None);
}

#[test]
fn top_k_one_equals_greedy() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut sampler = Sampler::new(params(1.5, 1, 1.0, 0.0, 1)).unwrap();
    for _ in 0..200 {
        let mut logits = random_logits(&mut rng, 512);
        // Plant a tie for the maximum to check tie-breaking too.
        let max = logits.iter().cloned().fold(f32::MIN, f32::max);
        let a = rng.random_range(0..512);
        let b = rng.random_range(0..512);
        logits[a] = max + 1.0;
        logits[b] = max + 1.0;
        assert_eq!(sampler.sample(&logits).unwrap(), a.min(b) as u32);
    }
}

#[test]
fn same_seed_same_tokens_different_seed_differs() {
    let mut rng = StdRng::seed_from_u64(99);
    let rows: Vec<Vec<f32>> = (0..300).map(|_| random_logits(&mut rng, 2048)).collect();
    let run = |seed: u64| {
        let mut sampler = Sampler::new(params(1.0, 64, 0.95, 0.01, seed)).unwrap();
        rows.iter().map(|row| sampler.sample(row).unwrap()).collect::<Vec<u32>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn plain_temperature_sampling_follows_softmax() {
    let logits = logits_for(&PROBS);
    let mut sampler = Sampler::new(params(1.0, 0, 1.0, 0.0, 3)).unwrap();
    let counts = histogram(&mut sampler, &logits, DRAWS);
    for (count, p) in counts.iter().zip(PROBS) {
        let freq = *count as f64 / DRAWS as f64;
        assert!((freq - p).abs() < 0.015, "frequency {freq} vs probability {p}: {counts:?}");
    }
}

#[test]
fn low_temperature_sharpens() {
    let logits = logits_for(&PROBS);
    let mut sampler = Sampler::new(params(0.1, 0, 1.0, 0.0, 4)).unwrap();
    let counts = histogram(&mut sampler, &logits, 2_000);
    // (0.3/0.5)^10 ≈ 0.006 relative weight for the runner-up.
    assert!(counts[0] > 1_950, "{counts:?}");
}

#[test]
fn top_k_keeps_only_k_best() {
    let logits = logits_for(&PROBS);
    let mut sampler = Sampler::new(params(1.0, 2, 1.0, 0.0, 5)).unwrap();
    let counts = histogram(&mut sampler, &logits, DRAWS);
    assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
    let freq0 = counts[0] as f64 / DRAWS as f64;
    assert!((freq0 - 0.5 / 0.8).abs() < 0.015, "{counts:?}");
}

#[test]
fn top_p_excludes_the_tail() {
    let logits = logits_for(&PROBS);
    // Without filtering the tail tokens do come up (so the assertion below can fail).
    let mut unfiltered = Sampler::new(params(1.0, 0, 1.0, 0.0, 6)).unwrap();
    let baseline = histogram(&mut unfiltered, &logits, DRAWS);
    assert!(baseline[3] > 500, "{baseline:?}");

    // 0.5 + 0.3 ≥ 0.75: only tokens 0 and 1 remain, renormalised to 0.625 / 0.375.
    let mut sampler = Sampler::new(params(1.0, 0, 0.75, 0.0, 6)).unwrap();
    let counts = histogram(&mut sampler, &logits, DRAWS);
    assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
    let freq0 = counts[0] as f64 / DRAWS as f64;
    assert!((freq0 - 0.625).abs() < 0.015, "{counts:?}");

    // top_p below the top token's mass keeps just that token.
    let mut narrow = Sampler::new(params(1.0, 0, 0.1, 0.0, 6)).unwrap();
    assert_eq!(histogram(&mut narrow, &logits, 1_000)[0], 1_000);
}

#[test]
fn min_p_excludes_tokens_below_fraction_of_top() {
    let logits = logits_for(&PROBS);
    // Threshold 0.2 × 0.5 = 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    let mut sampler = Sampler::new(params(1.0, 0, 1.0, 0.2, 8)).unwrap();
    let counts = histogram(&mut sampler, &logits, DRAWS);
    assert_eq!(counts[3], 0, "{counts:?}");
    assert!(counts[2] > 2_000, "{counts:?}");
    let freq2 = counts[2] as f64 / DRAWS as f64;
    assert!((freq2 - 0.15 / 0.95).abs() < 0.015, "{counts:?}");
}

#[test]
fn filters_apply_to_large_vocabularies() {
    // One dominant token among a 262k vocabulary of near-equal logits: top-p 0.5 must pick it.
    let mut logits = vec![0.0f32; 262_144];
    logits[123_456] = 20.0;
    let mut sampler = Sampler::new(params(1.0, 0, 0.5, 0.0, 9)).unwrap();
    for _ in 0..20 {
        assert_eq!(sampler.sample(&logits).unwrap(), 123_456);
    }
}

/// Top-k sampling from the row's highest logits alone (what a backend hands back for
/// `Want::Candidates`) draws the tokens sampling from the whole row draws, seed for seed: ties
/// (lower token first), ±0, NaN, ±∞ and rows with fewer finite logits than k included.
#[test]
fn top_k_from_candidates_equals_top_k_from_the_row() {
    use megagemma_model::backend::top_candidates;
    let mut rng = StdRng::seed_from_u64(7);
    let mut rows: Vec<Vec<f32>> = (0..24).map(|_| random_logits(&mut rng, 3000)).collect();
    // Coarse values: many exact ties across the top.
    rows.push((0..3000).map(|i| ((i * 7919) % 13) as f32 * 0.5).collect());
    let mut odd = random_logits(&mut rng, 500);
    odd[3] = f32::NAN;
    odd[10] = f32::NEG_INFINITY;
    odd[11] = 0.0;
    odd[12] = -0.0;
    odd[40] = 9.999;
    odd[41] = 9.999;
    rows.push(odd);
    let mut sparse = vec![f32::NEG_INFINITY; 100];
    sparse[5] = 1.0;
    sparse[50] = 1.0;
    sparse[60] = f32::NAN;
    sparse[70] = -2.0;
    rows.push(sparse);
    let mut inf = random_logits(&mut rng, 200);
    inf[30] = f32::INFINITY;
    inf[31] = f32::INFINITY;
    rows.push(inf);
    let settings =
        [(1.0, 2, 1.0, 0.0), (0.7, 40, 0.95, 0.0), (1.3, 64, 0.9, 0.05), (1.0, 64, 1.0, 0.1), (0.5, 8, 0.5, 0.0)];
    for (r, row) in rows.iter().enumerate() {
        for (s, &(t, k, p, m)) in settings.iter().enumerate() {
            let seed = (r * 31 + s) as u64;
            let mut whole = Sampler::new(params(t, k, p, m, seed)).unwrap();
            let mut cands = Sampler::new(params(t, k, p, m, seed)).unwrap();
            assert_eq!(cands.candidates_needed(), Some(k));
            // A backend may return more than k: its first k are the same.
            let list = top_candidates(row, k + 3);
            for draw in 0..50 {
                let a = whole.sample(row).unwrap();
                let b = cands.sample_candidates(&list).unwrap();
                assert_eq!(a, b, "row {r}, setting {s}, draw {draw}");
            }
        }
    }
    // Nothing finite: the same error either way.
    let dead = [f32::NAN, f32::NEG_INFINITY];
    let mut whole = Sampler::new(params(1.0, 4, 1.0, 0.0, 1)).unwrap();
    let mut cands = Sampler::new(params(1.0, 4, 1.0, 0.0, 1)).unwrap();
    assert!(top_candidates(&dead, 4).is_empty());
    assert_eq!(whole.sample(&dead), Err(SamplingError::NoFiniteLogits));
    assert_eq!(cands.sample_candidates(&top_candidates(&dead, 4)), Err(SamplingError::NoFiniteLogits));
    // Greedy, top-k 1 and no top-k need more than candidates.
    for p in [SamplingParams::greedy(), params(1.0, 1, 1.0, 0.0, 1), params(1.0, 0, 0.9, 0.0, 1)] {
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.candidates_needed(), None);
        assert_eq!(s.sample_candidates(&[(3, 1.0), (1, 0.5)]), Err(SamplingError::CandidatesNeedTopK));
    }
}

#[test]
fn invalid_params_are_rejected() {
    let bad = [
        (params(-0.1, 0, 1.0, 0.0, 0), SamplingError::InvalidTemperature(-0.1)),
        (params(1.0, 0, 0.0, 0.0, 0), SamplingError::InvalidTopP(0.0)),
        (params(1.0, 0, 1.01, 0.0, 0), SamplingError::InvalidTopP(1.01)),
        (params(1.0, 0, 1.0, -0.5, 0), SamplingError::InvalidMinP(-0.5)),
        (params(1.0, 0, 1.0, 1.5, 0), SamplingError::InvalidMinP(1.5)),
    ];
    for (p, expected) in bad {
        let err = Sampler::new(p.clone()).err().unwrap_or_else(|| panic!("accepted {p:?}"));
        assert_eq!(err, expected);
    }
    assert!(Sampler::new(params(f32::NAN, 0, 1.0, 0.0, 0)).is_err());
    assert!(Sampler::new(params(f32::INFINITY, 0, 1.0, 0.0, 0)).is_err());
    assert!(SamplingError::InvalidTopP(2.0).to_string().contains("top_p"));
    // Boundaries are valid.
    assert!(Sampler::new(params(0.0, 0, 1.0, 1.0, 0)).is_ok());

    let mut sampler = Sampler::new(params(1.0, 0, 1.0, 0.0, 0)).unwrap();
    assert_eq!(sampler.sample(&[]), Err(SamplingError::EmptyLogits));
    assert_eq!(sampler.sample(&[f32::NAN, f32::NEG_INFINITY]), Err(SamplingError::NoFiniteLogits));
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("megagemma-sampling-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn generation_config_with_eos_list_and_sampling_defaults() {
    let dir = temp_dir("gen");
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"bos_token_id": 2, "pad_token_id": 0, "eos_token_id": [1, 106, 50], "do_sample": true,
            "temperature": 1.0, "top_k": 64, "top_p": 0.95}"#,
    )
    .unwrap();
    let defaults = read_generation_config(&dir).unwrap();
    assert_eq!(defaults.eos_token_ids, vec![1, 106, 50]);
    assert_eq!((defaults.bos_token_id, defaults.pad_token_id), (Some(2), Some(0)));
    assert_eq!((defaults.temperature, defaults.top_k, defaults.top_p), (Some(1.0), Some(64), Some(0.95)));
    let p = defaults.sampling_params(Some(5));
    assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p, p.seed), (1.0, 64, 0.95, 0.0, Some(5)));
}

#[test]
fn generation_config_falls_back_to_config_json_text_config() {
    let dir = temp_dir("fallback");
    std::fs::write(dir.join("generation_config.json"), r#"{"do_sample": false}"#).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "gemma4", "text_config": {"eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}}"#,
    )
    .unwrap();
    let defaults = read_generation_config(&dir).unwrap();
    assert_eq!(defaults.eos_token_ids, vec![1]);
    assert_eq!(defaults.bos_token_id, Some(2));
    assert!(defaults.sampling_params(None).is_greedy());

    // Top-level config.json value wins over text_config.
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": [1, 106], "text_config": {"eos_token_id": 7}}"#)
        .unwrap();
    assert_eq!(read_generation_config(&dir).unwrap().eos_token_ids, vec![1, 106]);
}

#[test]
fn generation_config_errors_are_clear() {
    let dir = temp_dir("errors");
    let err = read_generation_config(&dir).unwrap_err().to_string();
    assert!(err.contains("neither generation_config.json nor config.json"), "{err}");

    std::fs::write(dir.join("generation_config.json"), "{not json").unwrap();
    let err = read_generation_config(&dir).unwrap_err().to_string();
    assert!(err.contains("invalid JSON") && err.contains("generation_config.json"), "{err}");

    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
    let err = read_generation_config(&dir).unwrap_err().to_string();
    assert!(err.contains("eos_token_id"), "{err}");
}
