//! Plain decoding: prefill, then one token per decode step (M = 1).

use super::stop::{FinishReason, StopRule};
use super::{GenerateParams, Generation};
use crate::sampling::{Sampler, SamplingParams};
use anyhow::Result;
use megagemma_model::backend::{Backend, PosOut, SeqId, Want};
use std::time::Instant;

/// What one token's choice needs from a position when every token is chosen alone (plain
/// decoding, the server): the argmax for greedy, the k highest logits for top-k sampling
/// (`Want::Candidates`: the CUDA backend selects them on the device instead of copying the row),
/// else the whole row — always the row when `full_logits` (kept logits, log-probabilities).
pub fn want_for(sampling: &SamplingParams, full_logits: bool) -> Want {
    if full_logits {
        return Want::Logits;
    }
    if sampling.is_greedy() {
        return Want::Argmax;
    }
    match sampling.candidates_needed() {
        Some(k) if k <= MAX_CANDIDATES => Want::Candidates(k),
        _ => Want::Logits,
    }
}

/// The most candidates a choice asks a backend for (the CUDA backend's device selection serves
/// up to `megagemma_cuda::MAX_CANDIDATES`); a larger top-k takes the whole row.
pub const MAX_CANDIDATES: usize = megagemma_cuda::MAX_CANDIDATES;

/// The sampler's next uniforms for up to `steps` sampled steps of `seq` in one
/// `Backend::decode_sampled` call (lent: `Sampler::skip` takes the ones used): one more than the
/// context holds at most, so running past it is the capacity error a step gives.
pub fn uniforms_for(backend: &dyn Backend, seq: SeqId, sampler: &Sampler, steps: usize) -> Result<Vec<f64>> {
    let room = backend.max_context().saturating_sub(backend.seq_len(seq)?) + 1;
    Ok(sampler.uniforms_ahead(steps.min(room)))
}

/// The next token from one position's output, asked for as `want`.
pub fn choose(sampler: &mut Sampler, out: &PosOut, want: Want) -> Result<u32> {
    if sampler.params().is_greedy() {
        Ok(out.argmax)
    } else if let Want::Candidates(_) = want {
        Ok(sampler.sample_candidates(&out.candidates)?)
    } else {
        Ok(sampler.sample(&out.logits)?)
    }
}

pub fn run(
    backend: &mut dyn Backend,
    seq: SeqId,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut dyn FnMut(u32) -> bool,
    out: &mut Generation,
) -> Result<()> {
    let mut sampler = Sampler::new(params.sampling.clone())?;
    let want = want_for(&params.sampling, params.keep_logits);
    let mut stop = StopRule::new(params);
    let t0 = Instant::now();
    let mut step = backend.prefill(seq, prompt, want)?;
    out.prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        let tok = choose(&mut sampler, &step, want)?;
        if params.keep_logits {
            out.logits.push(std::mem::take(&mut step.logits));
        }
        out.ids.push(tok);
        if let Some(reason) = stop.emit(tok, on_token(tok)) {
            out.finish_reason = reason;
            break;
        }
        if want == Want::Argmax && sampler.params().is_greedy() {
            // The rest in one call, so a backend can queue each step before the host has read
            // the previous one's token.
            let mut finish = None;
            backend.decode_greedy(seq, tok, stop.remaining(), &mut |t| {
                out.ids.push(t);
                finish = stop.emit(t, on_token(t));
                finish.is_none()
            })?;
            out.finish_reason = finish.unwrap_or(FinishReason::Length);
            break;
        }
        if let Want::Candidates(_) = want {
            // Top-k sampling: the rest in one call too, each step drawn with the next uniform of
            // the sampler's stream (the order `choose` takes them in), so a backend can draw on
            // its device and queue the next step before the host has the token.
            let uniforms = uniforms_for(backend, seq, &sampler, stop.remaining())?;
            let mut finish = None;
            let steps = backend.decode_sampled(seq, tok, &params.sampling.draw_params(), &uniforms, &mut |t| {
                out.ids.push(t);
                finish = stop.emit(t, on_token(t));
                finish.is_none()
            })?;
            sampler.skip(steps);
            out.finish_reason = finish.unwrap_or(FinishReason::Length);
            break;
        }
        step = backend.decode(seq, tok, want)?;
    }
    out.decode_seconds = t1.elapsed().as_secs_f64();
    Ok(())
}
