//! Next-token selection from logits, and the generation defaults shipped with a checkpoint.
//!
//! Pipeline (HF order): temperature → top-k → top-p → min-p → seeded draw. Temperature 0 is
//! greedy argmax with the lowest id winning ties, matching HF/PyTorch `argmax`.

use std::path::Path;

use anyhow::{anyhow, Result};
use megagemma_model::draw::{self, DrawParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::json_file::read_json_if_present;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability mass reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the top token's; 0 disables.
    pub min_p: f32,
    /// Same seed and same logits give the same tokens; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// Greedy: deterministic unless the caller asks for sampling.
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: None }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// How many of the highest logits top-k sampling needs in place of the whole row
    /// ([`Sampler::sample_candidates`]): the top-k when it keeps at least two tokens (with one,
    /// or without a top-k, the choice needs the argmax or the whole distribution).
    pub fn candidates_needed(&self) -> Option<usize> {
        (!self.is_greedy() && self.top_k >= 2).then_some(self.top_k)
    }

    /// Whether a sampled step draws (and takes one uniform from the seeded stream): not greedy
    /// and not top-k 1, whatever the logits.
    pub fn draws(&self) -> bool {
        !self.is_greedy() && self.top_k != 1
    }

    /// The draw's parameters as the backends take them (`megagemma_model::draw`).
    pub fn draw_params(&self) -> DrawParams {
        DrawParams { temperature: self.temperature, top_k: self.top_k, top_p: self.top_p, min_p: self.min_p }
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplingError::InvalidMinP(self.min_p));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("invalid temperature {0}: must be a finite number >= 0 (0 = greedy)")]
    InvalidTemperature(f32),
    #[error("invalid top_p {0}: must be in (0, 1] (1 = disabled)")]
    InvalidTopP(f32),
    #[error("invalid min_p {0}: must be in [0, 1] (0 = disabled)")]
    InvalidMinP(f32),
    #[error("cannot sample from empty logits")]
    EmptyLogits,
    #[error("cannot sample: every logit is NaN or -inf")]
    NoFiniteLogits,
    #[error("sampling from the highest logits alone needs top-k sampling with top_k >= 2")]
    CandidatesNeedTopK,
}

/// Index of the largest logit, lowest index on ties; NaN is ignored. `None` if nothing is left.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        // Strict `>` keeps the first index among equal maxima.
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Scratch buffers reused across calls: (token id, logit) and its unnormalised probability.
    candidates: Vec<(u32, f32)>,
    weights: Vec<f64>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Self { params, rng, candidates: Vec::new(), weights: Vec::new() })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token id from one row of logits. A step that draws takes one uniform from
    /// the seeded stream ([`SamplingParams::draws`]), also when an infinite logit decides it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        match self.filter(logits)? {
            Some(only) => {
                if self.params.draws() {
                    self.uniform();
                }
                Ok(only)
            }
            None => Ok(self.draw()),
        }
    }

    /// [`SamplingParams::candidates_needed`] of this sampler's parameters.
    pub fn candidates_needed(&self) -> Option<usize> {
        self.params.candidates_needed()
    }

    /// `sample` from the row's highest logits alone: `candidates` is
    /// `megagemma_model::backend::top_candidates(logits, k)` for some k ≥ `candidates_needed()`.
    /// Top-k keeps only those, in that order, so the token drawn — and the seeded stream after it —
    /// is the one `sample` would draw from the whole row.
    pub fn sample_candidates(&mut self, candidates: &[(u32, f32)]) -> Result<u32, SamplingError> {
        self.candidates_needed().ok_or(SamplingError::CandidatesNeedTopK)?;
        debug_assert!(candidates.windows(2).all(|w| by_logit_desc(&w[0], &w[1]).is_le()));
        // The first candidate is the row's argmax (no NaN or −∞ is listed; ±0 ties differ only
        // in the sign of a zero, which changes no weight). None at all: every logit was NaN or −∞.
        if candidates.is_empty() {
            return Err(SamplingError::NoFiniteLogits);
        }
        let u = self.uniform();
        draw::draw_candidates(candidates, &self.params.draw_params(), u).ok_or(SamplingError::NoFiniteLogits)
    }

    /// The distribution `sample` draws from, after temperature, top-k, top-p and min-p:
    /// `(token, probability)` pairs summing to 1 (one pair when the choice is deterministic).
    /// Speculative sampling compares the target's and the drafter's distributions through this.
    pub fn distribution(&mut self, logits: &[f32]) -> Result<Vec<(u32, f64)>, SamplingError> {
        if let Some(only) = self.filter(logits)? {
            return Ok(vec![(only, 1.0)]);
        }
        let total: f64 = self.weights.iter().sum();
        Ok(self.candidates.iter().zip(&self.weights).map(|(c, w)| (c.0, w / total)).collect())
    }

    /// `distribution` from the row's highest logits alone (`candidates` as `sample_candidates`
    /// takes them): the same pairs, in the same order, with the same weights.
    pub fn distribution_candidates(&mut self, candidates: &[(u32, f32)]) -> Result<Vec<(u32, f64)>, SamplingError> {
        let k = self.candidates_needed().ok_or(SamplingError::CandidatesNeedTopK)?;
        let &(best, best_logit) = candidates.first().ok_or(SamplingError::NoFiniteLogits)?;
        if best_logit == f32::INFINITY {
            return Ok(vec![(best, 1.0)]);
        }
        self.candidates.clear();
        self.candidates.extend_from_slice(&candidates[..k.min(candidates.len())]);
        self.filter_candidates(best_logit);
        let total: f64 = self.weights.iter().sum();
        Ok(self.candidates.iter().zip(&self.weights).map(|(c, w)| (c.0, w / total)).collect())
    }

    /// The sampling transforms: `Some(token)` when the choice is deterministic (greedy, top-k 1,
    /// an infinite logit), else the surviving candidates and their weights in the scratch buffers.
    fn filter(&mut self, logits: &[f32]) -> Result<Option<u32>, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        let best = argmax(logits).ok_or(SamplingError::NoFiniteLogits)?;
        let best_logit = logits[best as usize];
        if best_logit == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogits);
        }
        // top_k == 1 is greedy too; +inf would make every other weight NaN/0, so it wins outright.
        if self.params.is_greedy() || self.params.top_k == 1 || best_logit == f32::INFINITY {
            return Ok(Some(best));
        }
        self.collect_candidates(logits);
        self.apply_top_k();
        self.filter_candidates(best_logit);
        Ok(None)
    }

    /// The transforms after top-k, on the scratch candidates: their weights at the temperature
    /// (`best_logit` the row's largest), top-p, min-p.
    fn filter_candidates(&mut self, best_logit: f32) {
        if self.params.top_p < 1.0 {
            self.candidates.sort_unstable_by(by_logit_desc);
        }
        self.compute_weights(best_logit);
        self.apply_top_p();
        self.apply_min_p();
    }

    /// A uniform draw in [0, 1) from the sampler's seeded stream.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// The next `n` uniforms of the stream, without taking them: a backend's `decode_sampled`
    /// draws step i with the i-th; [`Sampler::skip`] then takes as many as it used, so the stream
    /// goes on where one `sample` per step would have left it.
    pub fn uniforms_ahead(&self, n: usize) -> Vec<f64> {
        let mut rng = self.rng.clone();
        (0..n).map(|_| rng.random::<f64>()).collect()
    }

    /// Takes `n` uniforms from the stream (those `uniforms_ahead` lent out and a backend used).
    pub fn skip(&mut self, n: usize) {
        for _ in 0..n {
            self.uniform();
        }
    }

    /// Draw a token from `(token, weight)` pairs (weights need not sum to 1; at least one > 0).
    pub fn draw_from(&mut self, dist: &[(u32, f64)]) -> u32 {
        let total: f64 = dist.iter().map(|d| d.1).sum();
        let mut remaining = self.rng.random::<f64>() * total;
        for &(tok, w) in dist {
            if remaining < w {
                return tok;
            }
            remaining -= w;
        }
        dist.iter().rev().find(|d| d.1 > 0.0).map_or(dist[0].0, |d| d.0)
    }

    fn collect_candidates(&mut self, logits: &[f32]) {
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, l)),
        );
    }

    fn apply_top_k(&mut self) {
        let k = self.params.top_k;
        if k > 0 && k < self.candidates.len() {
            // O(n) partition instead of sorting the full 262k vocabulary.
            self.candidates.select_nth_unstable_by(k - 1, by_logit_desc);
            self.candidates.truncate(k);
            // Partition order is unspecified; sort so the draw order is reproducible.
            self.candidates.sort_unstable_by(by_logit_desc);
        }
    }

    /// Softmax numerators at the sampling temperature, in f64 so tiny tail masses still add up
    /// (`draw::weights`: the same bits on the host and the device).
    fn compute_weights(&mut self, max_logit: f32) {
        self.weights = draw::weights(&self.candidates, max_logit, self.params.temperature);
    }

    /// Expects candidates sorted by descending logit (done in `sample` when top_p < 1).
    fn apply_top_p(&mut self) {
        let keep = draw::top_p_keep(&self.weights, self.params.top_p);
        self.candidates.truncate(keep);
        self.weights.truncate(keep);
    }

    fn apply_min_p(&mut self) {
        let mut kept = 0;
        for i in 0..self.weights.len() {
            if draw::min_p_keeps(self.weights[i], self.params.min_p) {
                self.weights[kept] = self.weights[i];
                self.candidates[kept] = self.candidates[i];
                kept += 1;
            }
        }
        self.weights.truncate(kept);
        self.candidates.truncate(kept);
    }

    fn draw(&mut self) -> u32 {
        let u = self.uniform();
        self.candidates[draw::draw_index(&self.weights, u)].0
    }
}

fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Token ids and sampling defaults from a checkpoint's `generation_config.json` / `config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Generation stops at any of these (Gemma 4 IT: `[1, 106]`, sometimes also 50).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
}

impl GenerationDefaults {
    /// The checkpoint's recommended sampling, greedy when it says `do_sample: false` or gives
    /// no temperature/top-k/top-p at all.
    pub fn sampling_params(&self, seed: Option<u64>) -> SamplingParams {
        let any_sampling = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        if self.do_sample == Some(false) || (self.do_sample.is_none() && !any_sampling) {
            return SamplingParams { seed, ..SamplingParams::greedy() };
        }
        SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            seed,
        }
    }
}

/// Reads `generation_config.json` from `dir`; token ids missing there come from `config.json`
/// (top level, then `text_config`). Errors if neither file exists or one is malformed.
pub fn read_generation_config(dir: impl AsRef<Path>) -> Result<GenerationDefaults> {
    let dir = dir.as_ref();
    let generation = read_json_if_present(&dir.join("generation_config.json"))?;
    let config = read_json_if_present(&dir.join("config.json"))?;
    if generation.is_none() && config.is_none() {
        anyhow::bail!("neither generation_config.json nor config.json found in {}", dir.display());
    }
    // Most specific first: generation config, then the model config, then its text sub-config.
    let sources: Vec<&Value> =
        [generation.as_ref(), config.as_ref(), config.as_ref().and_then(|c| c.get("text_config"))]
            .into_iter()
            .flatten()
            .collect();
    let first = |key: &str| sources.iter().find_map(|s| s.get(key).filter(|v| !v.is_null()));
    let gen_field = |key: &str| generation.as_ref().and_then(|g| g.get(key)).filter(|v| !v.is_null());

    let eos_token_ids = match first("eos_token_id") {
        Some(v) => parse_id_list(v).map_err(|e| anyhow!("invalid eos_token_id in {}: {e}", dir.display()))?,
        None => Vec::new(),
    };
    Ok(GenerationDefaults {
        eos_token_ids,
        bos_token_id: optional_id(first("bos_token_id"), "bos_token_id", dir)?,
        pad_token_id: optional_id(first("pad_token_id"), "pad_token_id", dir)?,
        do_sample: gen_field("do_sample").and_then(Value::as_bool),
        temperature: gen_field("temperature").and_then(Value::as_f64).map(|x| x as f32),
        top_k: gen_field("top_k").and_then(Value::as_u64).map(|x| x as usize),
        top_p: gen_field("top_p").and_then(Value::as_f64).map(|x| x as f32),
        min_p: gen_field("min_p").and_then(Value::as_f64).map(|x| x as f32),
    })
}

fn optional_id(v: Option<&Value>, key: &str, dir: &Path) -> Result<Option<u32>> {
    v.map(parse_id).transpose().map_err(|e| anyhow!("invalid {key} in {}: {e}", dir.display()))
}

fn parse_id(v: &Value) -> Result<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| anyhow!("expected a token id, got {v}"))
}

/// `eos_token_id` is either one id or a list of ids.
fn parse_id_list(v: &Value) -> Result<Vec<u32>> {
    let ids: Vec<u32> = match v {
        Value::Array(items) => items.iter().map(parse_id).collect::<Result<_>>()?,
        single => vec![parse_id(single)?],
    };
    let mut unique = Vec::with_capacity(ids.len());
    for id in ids {
        if !unique.contains(&id) {
            unique.push(id);
        }
    }
    Ok(unique)
}
