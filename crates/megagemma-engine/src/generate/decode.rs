//! Plain decoding: prefill, then one token per decode step (M = 1).

use super::stop::{FinishReason, StopRule};
use super::{GenerateParams, Generation};
use crate::sampling::Sampler;
use anyhow::Result;
use megagemma_model::backend::{Backend, PosOut, SeqId, Want};
use std::time::Instant;

/// What to ask the backend for: greedy needs only the argmax (no vocab-sized copy).
pub fn want(params: &GenerateParams) -> Want {
    if params.keep_logits || !params.sampling.is_greedy() {
        Want::Logits
    } else {
        Want::Argmax
    }
}

/// The next token from one position's output.
pub fn choose(sampler: &mut Sampler, out: &PosOut) -> Result<u32> {
    if sampler.params().is_greedy() {
        Ok(out.argmax)
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
    let want = want(params);
    let mut stop = StopRule::new(params);
    let t0 = Instant::now();
    let mut step = backend.prefill(seq, prompt, want)?;
    out.prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        let tok = choose(&mut sampler, &step)?;
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
        step = backend.decode(seq, tok, want)?;
    }
    out.decode_seconds = t1.elapsed().as_secs_f64();
    Ok(())
}
