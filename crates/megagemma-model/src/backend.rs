//! The interface every compute backend (CPU reference, CUDA) offers the engine.
//!
//! A backend holds one model's weights and any number of independent *sequences*, each with
//! its own KV cache, created and freed by handle. Calls say what they want back
//! ([`Want`]): greedy decoding asks for the argmax only, so no vocab-sized vector crosses the
//! interface (on a GPU: no device-to-host copy of the logits). `verify` runs several tokens of
//! one sequence in one pass and *stages* their KV rows; `commit` keeps the accepted prefix. The
//! final-normed hidden state of each sequence's newest committed position stays inside the
//! backend, where the MTP drafter (`draft`) reads it together with the sequence's KV cache.

use crate::draw::{draw_candidates, DrawParams};
use crate::error::Error;
use crate::plan::ModelPlan;
use crate::Result;
use std::fmt;

/// A sequence handle. Handles are not reused while the backend lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How a backend with more than one way launches a single-token pass (a decode step): the
/// CUDA backend's stage kernels captured in a CUDA graph, or one persistent kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decode {
    /// The stage kernels captured in a CUDA graph, replayed per token.
    Graph,
    /// One persistent kernel running the recorded stages (the CUDA megakernel).
    Megakernel,
}

impl std::str::FromStr for Decode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Decode> {
        match s {
            "graph" => Ok(Decode::Graph),
            "megakernel" => Ok(Decode::Megakernel),
            other => Err(Error::invalid_input(format!("unknown decode mode `{other}` (expected graph or megakernel)"))),
        }
    }
}

impl fmt::Display for Decode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Decode::Graph => "graph",
            Decode::Megakernel => "megakernel",
        })
    }
}

/// What a call hands back for each position it was asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// The argmax only (greedy and speculative greedy).
    Argmax,
    /// The argmax and the full final logits (sampling, `--dump-logits`).
    Logits,
    /// The argmax and the `n` most likely tokens with their log-probabilities.
    TopLogprobs(usize),
    /// The argmax and the `k` highest logits with their tokens ([`top_candidates`]): what top-k
    /// sampling needs, without a vocab-sized copy (the CUDA backend selects them on the device).
    Candidates(usize),
}

/// Output of one position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PosOut {
    /// Index of the largest final logit (first wins ties).
    pub argmax: u32,
    /// Final logits (after softcap), `vocab_size` floats — only for [`Want::Logits`], else empty.
    pub logits: Vec<f32>,
    /// `(token, log-probability)`, most likely first — only for [`Want::TopLogprobs`], else empty.
    pub top_logprobs: Vec<(u32, f32)>,
    /// `(token, logit)`, highest first — only for [`Want::Candidates`], else empty.
    pub candidates: Vec<(u32, f32)>,
}

/// The drafter's proposal: `ids[i]` is its argmax at draft step `i`; `probs[i]` its full
/// distribution (softmax of its logits) when asked for (speculative sampling), else empty.
#[derive(Clone, Debug, Default)]
pub struct Draft {
    pub ids: Vec<u32>,
    pub probs: Vec<Vec<f32>>,
}

/// Counters a test or a benchmark can read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Vocab-sized logit vectors handed to the caller (greedy paths keep this at zero).
    pub logits_copies: u64,
    /// Weight passes run (one per prefill chunk, step, verify).
    pub passes: u64,
}

pub trait Backend: Send {
    fn name(&self) -> &str;
    /// The layer plan of the loaded model.
    fn plan(&self) -> &ModelPlan;
    fn vocab_size(&self) -> usize {
        self.plan().vocab_size
    }
    /// Longest sequence (committed + staged positions) this backend accepts.
    fn max_context(&self) -> usize;
    /// Bytes of weights one decode step streams.
    fn decode_weight_bytes(&self) -> usize;
    fn stats(&self) -> BackendStats;
    /// What computes: the CPU model or the GPU name.
    fn device_name(&self) -> String;
    /// The read bandwidth of the memory the weights stream from, in GB/s, when the backend
    /// measures it itself (a GPU); `None` lets the caller measure host memory.
    fn measure_read_bandwidth(&mut self) -> Result<Option<f64>> {
        Ok(None)
    }
    /// Kernel launches per decode step (GPU backends).
    fn launches_per_token(&self) -> Option<f64> {
        None
    }
    /// How new sequences launch their decode steps, where the backend has more than one way.
    fn decode_launch(&self) -> Option<Decode> {
        None
    }
    /// New sequences launch their decode steps as `decode` says (existing ones keep theirs): so
    /// that `bench` can time the megakernel against the graph path in one run.
    fn set_decode_launch(&mut self, decode: Decode) -> Result<()> {
        Err(Error::invalid_input(format!(
            "the {} backend has one way to launch a decode step, not `{decode}`",
            self.name()
        )))
    }
    /// Runs one pass of `seq` over `tokens` with a per-block timeline recorded (the CUDA
    /// megakernel) — a decode step for one token, a verify pass for several — writes it to
    /// `path` as JSON and returns a table of where the pass's time went; nothing is committed.
    fn trace_pass(&mut self, _seq: SeqId, _tokens: &[u32], _path: &std::path::Path) -> Result<String> {
        Err(Error::invalid_input("a megakernel trace needs the CUDA backend with --decode megakernel"))
    }

    /// A new, empty sequence.
    fn new_sequence(&mut self) -> Result<SeqId>;
    /// A new sequence holding a copy of `seq`'s committed state (KV rows, hidden state).
    fn fork(&mut self, seq: SeqId) -> Result<SeqId>;
    /// Forget a sequence and release its memory.
    fn free(&mut self, seq: SeqId) -> Result<()>;
    /// Committed positions of `seq`.
    fn seq_len(&self, seq: SeqId) -> Result<usize>;

    /// Run a prompt (appended after `seq`'s committed positions) and commit it; output of its
    /// last token.
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], want: Want) -> Result<PosOut>;
    /// Advance several sequences by one token each, in one weight pass; committed. Outputs in
    /// the order of `batch`. Each column is computed exactly as a lone sequence would be.
    fn step(&mut self, batch: &[(SeqId, u32)], want: Want) -> Result<Vec<PosOut>>;
    /// Several tokens of one sequence in one pass; output for every position; KV rows staged,
    /// not committed. Column `i` equals what `step` would give after the first `i` tokens.
    fn verify(&mut self, seq: SeqId, tokens: &[u32], want: Want) -> Result<Vec<PosOut>>;
    /// Keep the first `accepted` staged rows of the last `verify` of `seq`, drop the rest.
    fn commit(&mut self, seq: SeqId, accepted: usize) -> Result<()>;
    /// Roll `seq` back to `len` committed positions (drops staged rows too).
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()>;

    /// One token of one sequence (M = 1), committed.
    fn decode(&mut self, seq: SeqId, token: u32, want: Want) -> Result<PosOut> {
        let mut out = self.step(&[(seq, token)], want)?;
        out.pop().ok_or_else(|| Error::msg("backend returned no output for a decode step"))
    }

    /// Greedy decoding of `seq` from `token` (its next input): up to `max` decode steps, each
    /// committed, `on_token` given each step's argmax in order and returning whether to go on.
    /// Returns the steps committed. The ids and the sequence's state are those of `decode` in a
    /// loop; a backend may queue a step before the host has read the previous one's token (the
    /// CUDA graph path does, and takes that step back when `on_token` stops).
    fn decode_greedy(
        &mut self,
        seq: SeqId,
        token: u32,
        max: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        let mut tok = token;
        for i in 0..max {
            tok = self.decode(seq, tok, Want::Argmax)?.argmax;
            if !on_token(tok) {
                return Ok(i + 1);
            }
        }
        Ok(max)
    }

    /// Sampled decoding of `seq` from `token`: one committed decode step per uniform of
    /// `uniforms`, step i's token drawn with `uniforms[i]` from the step's `params.top_k` highest
    /// logits (`draw::draw_candidates`); `on_token` gets each token in order and returns whether
    /// to go on. Returns the steps committed. The tokens and the sequence's state are those of
    /// `decode` with `Want::Candidates(top_k)` and `draw_candidates` in a loop; a backend may draw
    /// on its own device and queue the next step before the host has the token (the CUDA graph
    /// path does). `params.top_k` is 2 or more; a step with no finite logit is an error.
    fn decode_sampled(
        &mut self,
        seq: SeqId,
        token: u32,
        params: &DrawParams,
        uniforms: &[f64],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        decode_sampled_steps(self, seq, token, params, uniforms, on_token)
    }

    /// Whether an MTP assistant is loaded beside the target.
    fn has_drafter(&self) -> bool {
        false
    }
    /// Draft `k` tokens after `token`, the target's prediction from `seq`'s newest committed
    /// position (not yet fed): the assistant reads `seq`'s KV cache and hidden state.
    fn draft(&mut self, seq: SeqId, token: u32, k: usize, with_probs: bool) -> Result<Draft> {
        let _ = (seq, token, k, with_probs);
        Err(Error::invalid_input(format!("the {} backend has no drafter loaded (give --assistant DIR)", self.name())))
    }
}

/// `Backend::decode_sampled` one step at a time: `decode` with the step's candidates, then
/// `draw_candidates` on the host. The trait's default, and what a backend that can draw on its own
/// device runs where it cannot.
pub fn decode_sampled_steps<B: Backend + ?Sized>(
    b: &mut B,
    seq: SeqId,
    token: u32,
    params: &DrawParams,
    uniforms: &[f64],
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<usize> {
    check_draw(params)?;
    let mut tok = token;
    for (i, &u) in uniforms.iter().enumerate() {
        let out = b.decode(seq, tok, Want::Candidates(params.top_k))?;
        tok = draw_candidates(&out.candidates, params, u).ok_or_else(no_finite_logit)?;
        if !on_token(tok) {
            return Ok(i + 1);
        }
    }
    Ok(uniforms.len())
}

/// `decode_sampled`'s parameters: a temperature above 0 and a top-k of at least 2.
pub fn check_draw(params: &DrawParams) -> Result<()> {
    if !(params.temperature > 0.0 && params.temperature.is_finite()) || params.top_k < 2 {
        return Err(Error::invalid_input(format!(
            "sampled decoding needs a temperature above 0 and top-k of at least 2 (got {} and {})",
            params.temperature, params.top_k
        )));
    }
    Ok(())
}

/// The error of a sampled step whose row has no finite logit.
pub fn no_finite_logit() -> Error {
    Error::msg("cannot sample: every logit is NaN or -inf")
}

/// The checks every backend makes before a pass of `tokens` on sequence `seq`, which holds `len`
/// committed and `staged` uncommitted rows: tokens present and inside the vocabulary, nothing
/// staged, and the context not outgrown. Kinds: `InvalidInput`, or `Capacity` for the context.
pub fn check_pass(
    seq: SeqId,
    tokens: &[u32],
    vocab: usize,
    len: usize,
    staged: usize,
    max_context: usize,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::invalid_input("empty input: at least one token is needed"));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::invalid_input(format!("token id {bad} is out of range (vocab_size is {vocab})")));
    }
    if staged > 0 {
        return Err(Error::invalid_input(format!(
            "sequence {seq}: {staged} verified rows are still staged: commit or truncate first"
        )));
    }
    let need = len + tokens.len();
    if need > max_context {
        return Err(Error::capacity(format!(
            "sequence {seq} would hold {need} positions, more than the context of {max_context} (use a larger --ctx)"
        )));
    }
    Ok(())
}

/// The `n` most likely tokens of a logits row with their log-probabilities (log-softmax in
/// f64), most likely first; ties keep the lower id first.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_z = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if n < idx.len() && n > 0 {
        idx.select_nth_unstable_by(n - 1, by_logit);
    }
    idx.truncate(n);
    idx.sort_by(by_logit);
    idx.into_iter().map(|i| (i, (logits[i as usize] as f64 - log_z) as f32)).collect()
}

/// The `k` highest logits as `(token, logit)`, highest first, by `f32::total_cmp` and then the lower
/// token (the order top-k sampling sorts its candidates in); NaN and −∞ are never listed, so fewer
/// than `k` come back when fewer logits are finite or +∞. A backend that selects them elsewhere
/// must return exactly this list.
pub fn top_candidates(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY)
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k > 0 && k < c.len() {
        c.select_nth_unstable_by(k - 1, by_logit);
    }
    c.truncate(k);
    c.sort_unstable_by(by_logit);
    c
}

/// A [`PosOut`] for one logits row whose argmax is `argmax`, as `want` asks.
pub fn pos_out(argmax: u32, logits: &[f32], want: Want) -> PosOut {
    match want {
        Want::Argmax => PosOut { argmax, ..Default::default() },
        Want::Logits => PosOut { argmax, logits: logits.to_vec(), ..Default::default() },
        Want::TopLogprobs(n) => PosOut { argmax, top_logprobs: top_logprobs(logits, n), ..Default::default() },
        Want::Candidates(k) => PosOut { argmax, candidates: top_candidates(logits, k), ..Default::default() },
    }
}
