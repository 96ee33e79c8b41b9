//! The generation loop, written against the [`Backend`] interface only: prefill the prompt on a
//! fresh sequence, then produce tokens one decode step at a time ([`decode`]) or several per
//! verify pass ([`speculate`]) until a stop condition ([`stop`]) ends it.

pub mod decode;
pub mod speculate;
pub mod stop;

use crate::sampling::SamplingParams;
use anyhow::{bail, Result};
use megagemma_model::backend::{Backend, SeqId};
pub use speculate::{DraftMode, DraftParams, SpecStats};
pub use stop::FinishReason;

#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after emitting any of these (the stop token is included in the output).
    pub stop_ids: Vec<u32>,
    /// Generate exactly `max_new_tokens`, ignoring stop ids.
    pub ignore_eos: bool,
    /// Keep the logits of every step (for `--dump-logits`).
    pub keep_logits: bool,
    /// Speculative decoding: who drafts, how many tokens per round.
    pub draft: DraftParams,
}

impl GenerateParams {
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerateParams {
            max_new_tokens,
            sampling: SamplingParams::greedy(),
            stop_ids: Vec::new(),
            ignore_eos: true,
            keep_logits: false,
            draft: DraftParams::default(),
        }
    }
}

#[derive(Debug)]
pub struct Generation {
    /// Generated ids (the prompt is not included).
    pub ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub finish_reason: FinishReason,
    /// Logits that produced each generated id (only with `keep_logits`).
    pub logits: Vec<Vec<f32>>,
    pub prefill_seconds: f64,
    /// Time spent after the first generated token.
    pub decode_seconds: f64,
    /// Speculative decoding counters (rounds, acceptance), when drafting was on.
    pub spec: Option<SpecStats>,
}

impl Generation {
    fn new(prompt_tokens: usize) -> Self {
        Generation {
            ids: Vec::new(),
            prompt_tokens,
            finish_reason: FinishReason::Length,
            logits: Vec::new(),
            prefill_seconds: 0.0,
            decode_seconds: 0.0,
            spec: None,
        }
    }

    /// Decode speed: tokens produced after the first, per second of decode time.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let steps = self.ids.len().saturating_sub(1);
        if steps == 0 || self.decode_seconds <= 0.0 {
            return 0.0;
        }
        steps as f64 / self.decode_seconds
    }
}

/// Generate from `prompt` on a fresh sequence of `backend` (freed afterwards, also on error).
/// `on_token` sees each id as soon as it is final and may return `false` to stop early.
pub fn generate(
    backend: &mut dyn Backend,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    if prompt.is_empty() {
        bail!("empty prompt: at least one token is needed");
    }
    params.sampling.validate()?;
    let seq = backend.new_sequence()?;
    let result = generate_on(backend, seq, prompt, params, &mut on_token);
    backend.free(seq)?;
    result
}

fn generate_on(
    backend: &mut dyn Backend,
    seq: SeqId,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation> {
    let mut out = Generation::new(prompt.len());
    if params.max_new_tokens == 0 {
        return Ok(out);
    }
    match params.draft.mode {
        DraftMode::None => decode::run(backend, seq, prompt, params, on_token, &mut out)?,
        _ => speculate::run(backend, seq, prompt, params, on_token, &mut out)?,
    }
    Ok(out)
}
