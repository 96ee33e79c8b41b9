//! The generation loop: prefill the prompt, then decode one token at a time until a stop id
//! or the token budget. Sampling, stop conditions and timing live here; the forward pass is the
//! backend's.

use crate::sampling::{Sampler, SamplingParams};
use anyhow::{bail, Result};
use megagemma_model::backend::{Backend, StepOut};
use std::time::Instant;

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was generated.
    Stop,
    /// `max_new_tokens` reached.
    Length,
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
    /// Time spent in decode steps (tokens after the first).
    pub decode_seconds: f64,
}

impl Generation {
    /// Decode speed: tokens produced by decode steps per second of decode time.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let steps = self.ids.len().saturating_sub(1);
        if steps == 0 || self.decode_seconds <= 0.0 {
            return 0.0;
        }
        steps as f64 / self.decode_seconds
    }
}

/// Generate from `prompt` on a fresh sequence. `on_token` sees each id as soon as it exists
/// and may return `false` to stop early.
pub fn generate(
    backend: &mut dyn Backend,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    if prompt.is_empty() {
        bail!("empty prompt: at least one token is needed");
    }
    let mut sampler = Sampler::new(params.sampling.clone())?;
    backend.reset();
    let mut out = Generation {
        ids: Vec::new(),
        prompt_tokens: prompt.len(),
        finish_reason: FinishReason::Length,
        logits: Vec::new(),
        prefill_seconds: 0.0,
        decode_seconds: 0.0,
    };
    if params.max_new_tokens == 0 {
        return Ok(out);
    }
    let t0 = Instant::now();
    let mut step: StepOut = backend.prefill(prompt)?;
    out.prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        let tok = if params.sampling.is_greedy() { step.argmax } else { sampler.sample(&step.logits)? };
        if params.keep_logits {
            out.logits.push(std::mem::take(&mut step.logits));
        }
        out.ids.push(tok);
        let keep_going = on_token(tok);
        if !params.ignore_eos && params.stop_ids.contains(&tok) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        if !keep_going || out.ids.len() >= params.max_new_tokens {
            break;
        }
        step = backend.decode(tok)?;
    }
    out.decode_seconds = t1.elapsed().as_secs_f64();
    Ok(out)
}
