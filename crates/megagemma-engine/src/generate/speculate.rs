//! Lossless speculative decoding: a drafter proposes k tokens after the last emitted token t,
//! the target scores [t, d1..dk] in one verify pass, the longest prefix of drafts equal to
//! the target's own argmax is accepted, and the target's next token follows it. Only the rows
//! of fed tokens are committed, so the output is exactly plain greedy decoding's.
//!
//! Drafters: the MTP assistant inside the backend (`mtp`), n-gram lookup in prompt + output
//! (`lookup`, no weights), and a synthetic `oracle` that knows the greedy continuation and keeps
//! each drafted token right with a given probability (to measure speedup against acceptance).

use super::decode::{choose, want_for};
use super::stop::StopRule;
use super::{decode, GenerateParams, Generation};
use crate::sampling::Sampler;
use anyhow::{bail, Result};
use megagemma_model::backend::PosOut;
use megagemma_model::backend::{Backend, SeqId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

#[derive(Clone, Debug, PartialEq, Default)]
pub enum DraftMode {
    #[default]
    None,
    /// The MTP assistant loaded beside the target (`--assistant DIR`).
    Mtp,
    /// Continue the longest recent n-gram match (n from `max_ngram` down to 1).
    Lookup { max_ngram: usize },
    /// Synthetic: the true greedy continuation, each token kept right with probability
    /// `acceptance` (seeded).
    Oracle { acceptance: f64, seed: u64 },
}

#[derive(Clone, Debug)]
pub struct DraftParams {
    pub mode: DraftMode,
    /// Tokens drafted per round.
    pub k: usize,
    /// Print one stderr line per round: `draft pos=<p> ids=<a,b,..> accepted=<n>`.
    pub trace: bool,
}

impl Default for DraftParams {
    fn default() -> Self {
        DraftParams { mode: DraftMode::None, k: 4, trace: false }
    }
}

/// Counters of one speculative generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// `accepted_at[i]`: rounds whose draft token `i` was accepted (out of `drafted_at[i]`).
    pub accepted_at: Vec<usize>,
    pub drafted_at: Vec<usize>,
}

impl SpecStats {
    pub fn mean_accepted(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.accepted as f64 / self.rounds as f64
        }
    }

    /// One line for `--stats`.
    pub fn summary(&self, tokens_per_second: f64) -> String {
        let per_pos: Vec<String> = self
            .accepted_at
            .iter()
            .zip(&self.drafted_at)
            .map(|(a, d)| format!("{:.2}", *a as f64 / (*d).max(1) as f64))
            .collect();
        format!(
            "spec: rounds {} | drafted {} | accepted {} | mean accepted/round {:.2} | acceptance by position [{}] | {:.1} tok/s",
            self.rounds,
            self.drafted,
            self.accepted,
            self.mean_accepted(),
            per_pos.join(", "),
            tokens_per_second
        )
    }

    fn record(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        for i in 0..drafted {
            self.drafted_at[i] += 1;
            if i < accepted {
                self.accepted_at[i] += 1;
            }
        }
    }
}

/// Proposes up to `k` tokens to follow `history` (prompt + emitted; its last token is the one
/// the target predicted last and that is not yet fed).
pub trait Drafter: Send {
    fn propose(&mut self, backend: &mut dyn Backend, seq: SeqId, history: &[u32], k: usize) -> Result<Vec<u32>>;
}

/// The backend's MTP assistant (`Backend::draft`), reading `seq`'s cache and hidden state.
pub struct MtpDrafter;

impl Drafter for MtpDrafter {
    fn propose(&mut self, backend: &mut dyn Backend, seq: SeqId, history: &[u32], k: usize) -> Result<Vec<u32>> {
        let t = *history.last().expect("history holds at least the prompt");
        Ok(backend.draft(seq, t, k, false)?.ids)
    }
}

/// Prompt lookup: find the most recent earlier occurrence of the longest suffix n-gram of the
/// history and propose what followed it.
pub struct LookupDrafter {
    pub max_ngram: usize,
}

impl LookupDrafter {
    pub fn lookup(&self, history: &[u32], k: usize) -> Vec<u32> {
        let len = history.len();
        for n in (1..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            // Latest match first: recent context predicts best.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == suffix {
                    let from = start + n;
                    let to = (from + k).min(len);
                    if from < to {
                        return history[from..to].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

impl Drafter for LookupDrafter {
    fn propose(&mut self, _: &mut dyn Backend, _: SeqId, history: &[u32], k: usize) -> Result<Vec<u32>> {
        Ok(self.lookup(history, k))
    }
}

/// Knows the greedy continuation `truth` (ids after the prompt); corrupts each proposed token
/// with probability `1 − acceptance`.
struct OracleDrafter {
    truth: Vec<u32>,
    prompt_len: usize,
    acceptance: f64,
    vocab: u32,
    rng: StdRng,
}

impl Drafter for OracleDrafter {
    fn propose(&mut self, _: &mut dyn Backend, _: SeqId, history: &[u32], k: usize) -> Result<Vec<u32>> {
        let emitted = history.len() - self.prompt_len;
        let next = self.truth.iter().skip(emitted).take(k);
        Ok(next.map(|&t| if self.rng.random::<f64>() < self.acceptance { t } else { (t + 1) % self.vocab }).collect())
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
    if params.draft.k == 0 {
        bail!("--k must be at least 1 when drafting");
    }
    let mut drafter: Box<dyn Drafter> = match &params.draft.mode {
        DraftMode::None => unreachable!("plain decoding does not draft"),
        DraftMode::Mtp => {
            if !backend.has_drafter() {
                bail!("--draft mtp needs an assistant model: give --assistant DIR");
            }
            Box::new(MtpDrafter)
        }
        DraftMode::Lookup { max_ngram } => {
            if *max_ngram == 0 {
                bail!("--lookup-ngram must be at least 1");
            }
            Box::new(LookupDrafter { max_ngram: *max_ngram })
        }
        DraftMode::Oracle { acceptance, seed } => {
            if !(0.0..=1.0).contains(acceptance) {
                bail!("--acceptance must be between 0 and 1, got {acceptance}");
            }
            let truth = greedy_truth(backend, prompt, params)?;
            Box::new(OracleDrafter {
                truth,
                prompt_len: prompt.len(),
                acceptance: *acceptance,
                vocab: backend.vocab_size() as u32,
                rng: StdRng::seed_from_u64(*seed),
            })
        }
    };

    // Top-k sampling verifies with the k highest logits of each column (no vocab-sized copy per
    // position); its accept rule needs no more (`accept_sampled`).
    let want = want_for(&params.sampling, params.keep_logits);
    let mut sampler = Sampler::new(params.sampling.clone())?;
    let mut stop = StopRule::new(params);
    let mut stats = SpecStats::default();
    let mut history = prompt.to_vec();

    let t0 = Instant::now();
    let first = backend.prefill(seq, prompt, want)?;
    out.prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();

    // Emit one token; true when generation ends with it.
    let mut emit = |tok: u32, logits: Vec<f32>, out: &mut Generation, history: &mut Vec<u32>| -> bool {
        if params.keep_logits {
            out.logits.push(logits);
        }
        out.ids.push(tok);
        history.push(tok);
        match stop.emit(tok, on_token(tok)) {
            Some(reason) => {
                out.finish_reason = reason;
                true
            }
            None => false,
        }
    };

    let tok = choose(&mut sampler, &first, want)?;
    let mut done = emit(tok, first.logits, out, &mut history);
    while !done {
        let t = *history.last().expect("a token was emitted");
        // A round emits the accepted drafts plus the target's own next token.
        let k = params.draft.k.min(params.max_new_tokens - out.ids.len() - 1);
        let mut drafts = if k > 0 { drafter.propose(backend, seq, &history, k)? } else { Vec::new() };
        drafts.truncate(k);
        if drafts.is_empty() {
            let o = backend.decode(seq, t, want)?;
            let tok = choose(&mut sampler, &o, want)?;
            done = emit(tok, o.logits, out, &mut history);
            continue;
        }
        let pos = backend.seq_len(seq)?;
        let mut block = Vec::with_capacity(drafts.len() + 1);
        block.push(t);
        block.extend_from_slice(&drafts);
        let mut outs = backend.verify(seq, &block, want)?;
        let (accepted, next) = if sampler.params().is_greedy() {
            let n = drafts.iter().zip(&outs).take_while(|(d, o)| **d == o.argmax).count();
            (n, outs[n].argmax)
        } else {
            accept_sampled(&mut sampler, &drafts, &outs)?
        };
        stats.record(drafts.len(), accepted);
        if params.draft.trace {
            let ids: Vec<String> = drafts.iter().map(|d| d.to_string()).collect();
            eprintln!("draft pos={pos} ids={} accepted={accepted}", ids.join(","));
        }
        // Emit d1..d_accepted, then the target's token after them; commit the rows of every
        // token that was fed and is followed by an emitted token (t and the accepted drafts,
        // fewer when a stop id ends the round early).
        let mut fed = 1;
        for i in 0..=accepted {
            let tok = if i < accepted { drafts[i] } else { next };
            let logits = std::mem::take(&mut outs[i].logits);
            done = emit(tok, logits, out, &mut history);
            if done {
                break;
            }
            if i < accepted {
                fed += 1;
            }
        }
        backend.commit(seq, fed)?;
    }
    out.decode_seconds = t1.elapsed().as_secs_f64();
    out.spec = Some(stats);
    Ok(())
}

/// Speculative sampling (the standard accept/reject rule) for drafters that propose one token
/// per position deterministically, i.e. whose distribution q is one-hot at the draft `d`:
/// accept `d` with probability min(1, p(d)/q(d)) = p(d); on rejection draw from the residual
/// max(0, p − q), which is p without `d`, renormalised. `p` is the target's distribution after
/// the sampling transforms (temperature, top-k, top-p, min-p), so every emitted token is
/// distributed exactly as plain sampling's. Returns (accepted drafts, the token after them).
/// Each column's p comes from its whole logits row or, when the verify asked for candidates, from
/// its k highest logits: top-k gives every other token probability 0, so p is the same either way.
fn accept_sampled(sampler: &mut Sampler, drafts: &[u32], outs: &[PosOut]) -> Result<(usize, u32)> {
    let distribution = |sampler: &mut Sampler, o: &PosOut| {
        if o.logits.is_empty() {
            sampler.distribution_candidates(&o.candidates)
        } else {
            sampler.distribution(&o.logits)
        }
    };
    for (i, &d) in drafts.iter().enumerate() {
        let p = distribution(sampler, &outs[i])?;
        let p_d = p.iter().find(|x| x.0 == d).map_or(0.0, |x| x.1);
        if sampler.uniform() < p_d {
            continue;
        }
        let residual: Vec<(u32, f64)> = p.into_iter().filter(|x| x.0 != d).collect();
        if residual.iter().all(|x| x.1 <= 0.0) {
            // p was one-hot at d: rejection has probability 0; only rounding gets here.
            continue;
        }
        return Ok((i, sampler.draw_from(&residual)));
    }
    let last = distribution(sampler, &outs[drafts.len()])?;
    Ok((drafts.len(), sampler.draw_from(&last)))
}

/// The plain greedy continuation of `prompt` (what the oracle drafter knows), on its own sequence.
fn greedy_truth(backend: &mut dyn Backend, prompt: &[u32], params: &GenerateParams) -> Result<Vec<u32>> {
    // Greedy even when the generation samples: drafts must not depend on the sampler's stream.
    let plain = GenerateParams {
        draft: Default::default(),
        keep_logits: false,
        sampling: crate::sampling::SamplingParams::greedy(),
        ..params.clone()
    };
    let seq = backend.new_sequence()?;
    let mut g = Generation::new(prompt.len());
    let r = decode::run(backend, seq, prompt, &plain, &mut |_| true, &mut g);
    backend.free(seq)?;
    r?;
    Ok(g.ids)
}
