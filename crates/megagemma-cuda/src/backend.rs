//! [`CudaBackend`]: the engine's [`Backend`] interface over [`CudaModel`] and its sequences.
//!
//! Inputs are validated here, before anything reaches the device, so a bad request is an
//! `InvalidInput` or `Capacity` error and never leaves a sequence half-updated. Greedy calls read
//! back only the argmax (4 bytes per position); logits cross to the host only when asked for.

use crate::candidates::candidates_on_device;
use crate::draft::CudaAssistant;
use crate::model::CudaModel;
use crate::seq::{
    decode_from_env, kv_cache_bytes, CudaSeq, Decode, Want as SeqWant, MAX_BATCH, MAX_VERIFY, MK_MAX_TOKENS,
};
use megagemma_model::assistant::AssistantModel;
use megagemma_model::backend::{
    check_pass, decode_sampled_steps, top_candidates, top_logprobs, Backend, BackendStats, Draft, PosOut, SeqId, Want,
};
use megagemma_model::cpu::ops::softmax;
use megagemma_model::draw::DrawParams;
use megagemma_model::error::Error;
use megagemma_model::plan::ModelPlan;
use megagemma_model::Result;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Device memory kept out of the caches when sizing the default context: for cuBLAS, the long
/// passes' workspace and graphs (at least this, or a tenth of what is free).
const CONTEXT_RESERVE: usize = 2 << 30;
/// What a sequence allocates beside its K/V caches (scratch and staging rows of a prefill chunk).
const SEQ_OVERHEAD: usize = 512 << 20;
/// The default context is a multiple of this when free memory caps it.
const CONTEXT_STEP: usize = 1024;
/// Freed sequences kept for reuse, at most.
const SPARE_SEQUENCES: usize = 16;

/// The context a sequence gets when none is asked for (`--ctx`): the model's maximum, unless
/// `sequences` sequences' caches (allocated whole when a sequence starts) would not fit in `free`
/// bytes of device memory; then the most that fits, in steps of 1,024 (at least one step, or the
/// model's maximum when smaller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DefaultContext {
    pub tokens: usize,
    pub model_max: usize,
    pub free: usize,
    pub sequences: usize,
}

impl DefaultContext {
    pub fn new(plan: &ModelPlan, free: usize, sequences: usize) -> DefaultContext {
        let (model_max, sequences) = (plan.max_positions.max(1), sequences.max(1));
        let usable = free.saturating_sub(CONTEXT_RESERVE.max(free / 10)) / sequences;
        let fits = |n: usize| kv_cache_bytes(plan, n).saturating_add(SEQ_OVERHEAD) <= usable;
        let tokens = if fits(model_max) {
            model_max
        } else {
            // Cache bytes grow with the length: the largest fitting multiple of the step.
            let (mut lo, mut hi) = (0, model_max / CONTEXT_STEP);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if fits(mid * CONTEXT_STEP) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            (lo * CONTEXT_STEP).max(CONTEXT_STEP.min(model_max))
        };
        DefaultContext { tokens, model_max, free, sequences }
    }

    /// For a model on the device now.
    pub fn measure(model: &CudaModel, sequences: usize) -> Result<DefaultContext> {
        let (free, _) = model.gpu.memory()?;
        Ok(DefaultContext::new(model.plan(), free, sequences))
    }

    /// Whether free memory made it shorter than the model's maximum.
    pub fn capped(&self) -> bool {
        self.tokens < self.model_max
    }

    /// One line for the user when the context was capped.
    pub fn note(&self) -> Option<String> {
        self.capped().then(|| {
            let many = if self.sequences == 1 {
                "one sequence's".to_string()
            } else {
                format!("{} sequences'", self.sequences)
            };
            format!(
                "context {} tokens, not the model's {}: {many} caches must fit in the {:.1} GiB of GPU memory free \
                 (--ctx sets it)",
                thousands(self.tokens),
                thousands(self.model_max),
                self.free as f64 / (1u64 << 30) as f64
            )
        })
    }
}

/// 131072 as "131,072".
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub struct CudaBackend {
    model: Arc<CudaModel>,
    seqs: BTreeMap<SeqId, CudaSeq>,
    next_id: u32,
    max_context: usize,
    stats: BackendStats,
    /// Launches and tokens of single-token steps, for launches per token.
    step_launches: u64,
    step_tokens: u64,
    /// How new sequences launch their decode steps.
    decode: Decode,
    /// A step of several sequences runs them in one weight pass (`MEGAGEMMA_CUDA_BATCH=0`: one
    /// pass each).
    batch_steps: bool,
    /// The MTP assistant, when loaded: it drafts from a sequence's KV cache and kept hidden state.
    assistant: Option<CudaAssistant>,
    /// New sequences draw sampled steps on the device (`CudaSeq::set_device_draw`); `None`: as
    /// `MEGAGEMMA_CUDA_DEVICE_DRAW` says.
    device_draw: Option<bool>,
    /// Freed sequences, reused by `new_sequence` and `fork` before anything is allocated: a
    /// sequence's caches at a long context are gigabytes that would otherwise be allocated, zeroed
    /// and freed (a synchronising `cuMemFree`) per request, and its captured graphs would be
    /// captured again. The pool never holds more than the most sequences live at once, so the
    /// device memory held is what that peak needed (`MEGAGEMMA_CUDA_SEQ_POOL=0`: none kept).
    spare: Vec<CudaSeq>,
    keep_spares: bool,
}

impl CudaBackend {
    /// A backend whose sequences hold at most `max_context` positions (for the default, see
    /// [`DefaultContext`]).
    pub fn new(model: Arc<CudaModel>, max_context: usize) -> CudaBackend {
        CudaBackend {
            model,
            seqs: BTreeMap::new(),
            next_id: 0,
            max_context: max_context.max(1),
            stats: BackendStats::default(),
            step_launches: 0,
            step_tokens: 0,
            decode: decode_from_env(),
            batch_steps: std::env::var("MEGAGEMMA_CUDA_BATCH").map_or(true, |v| v != "0"),
            assistant: None,
            device_draw: None,
            spare: Vec::new(),
            keep_spares: std::env::var("MEGAGEMMA_CUDA_SEQ_POOL").map_or(true, |v| v != "0"),
        }
    }

    /// Whether freed sequences are kept for reuse (the default; see `spare`).
    pub fn with_sequence_pool(mut self, on: bool) -> CudaBackend {
        self.keep_spares = on;
        if !on {
            self.spare.clear();
        }
        self
    }

    /// Freed sequences held for reuse now.
    pub fn spare_sequences(&self) -> usize {
        self.spare.len()
    }

    /// A sequence with no positions: a spare one when there is one, else a new allocation.
    fn blank_sequence(&mut self) -> Result<CudaSeq> {
        match self.spare.pop() {
            Some(mut s) => {
                s.clear();
                Ok(s)
            }
            None => CudaSeq::new(&self.model, self.max_context),
        }
    }

    /// Sampled decoding draws on the device, pipelined (`CudaSeq::set_device_draw`), or not.
    pub fn with_device_draw(mut self, on: bool) -> CudaBackend {
        self.device_draw = Some(on);
        self
    }

    /// Uploads `assistant` (loaded for this backend's model) beside the target for
    /// [`Backend::draft`]; sequences from now on keep the hidden state it reads.
    pub fn with_assistant(self, assistant: &AssistantModel) -> Result<CudaBackend> {
        let a = CudaAssistant::load(&self.model, assistant)?;
        Ok(self.drafting_with(a))
    }

    /// A random assistant of the real E2B / E4B assistants' shapes ([`CudaAssistant::synthetic`]).
    pub fn with_synthetic_assistant(self) -> Result<CudaBackend> {
        let a = CudaAssistant::synthetic(&self.model)?;
        Ok(self.drafting_with(a))
    }

    fn drafting_with(mut self, a: CudaAssistant) -> CudaBackend {
        self.assistant = Some(a);
        for s in self.seqs.values_mut() {
            s.set_keep_hidden(true);
        }
        self
    }

    /// Decode steps as a CUDA graph (the default) or as one persistent kernel.
    pub fn with_decode(mut self, decode: Decode) -> CudaBackend {
        self.decode = decode;
        self
    }

    pub fn model(&self) -> &Arc<CudaModel> {
        &self.model
    }

    /// Keeps `s` under a new id.
    fn add(&mut self, s: CudaSeq) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, s);
        id
    }

    /// The sequence behind `seq` (the GPU checks look at how its passes ran).
    pub(crate) fn seq(&self, seq: SeqId) -> Result<&CudaSeq> {
        self.seqs.get(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut CudaSeq> {
        self.seqs.get_mut(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
    }

    fn check(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let s = self.seqs.get(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))?;
        check_pass(seq, tokens, self.model.plan().vocab_size, s.len(), s.staged(), self.max_context)
    }

    /// One weight pass for the (distinct, checked) sequences of `chunk` (`CudaSeq::step_batch`),
    /// or a lone sequence's step (its pass and K/V commit: one launch on the graph and megakernel
    /// paths).
    fn step_batched(&mut self, chunk: &[(SeqId, u32)], want: Want) -> Result<Vec<PosOut>> {
        let before = self.model.launches();
        let logits = self.needs_logits(want);
        let outs = if let [(seq, tok)] = *chunk {
            vec![self.seq_mut(seq)?.step(tok, logits)?]
        } else {
            // The sequences leave the map for the pass and all come back, whatever it returns.
            let mut taken: Vec<(SeqId, CudaSeq)> =
                chunk.iter().filter_map(|(id, _)| self.seqs.remove(id).map(|s| (*id, s))).collect();
            let tokens: Vec<u32> = chunk.iter().map(|&(_, t)| t).collect();
            let ran = match taken.split_first_mut() {
                Some((first, rest)) if rest.len() + 1 == chunk.len() => {
                    let mut others: Vec<&mut CudaSeq> = rest.iter_mut().map(|(_, s)| s).collect();
                    first.1.step_batch(&mut others, &tokens, logits)
                }
                _ => Err(Error::invalid_input("unknown sequence in a batched step".to_string())),
            };
            self.seqs.extend(taken);
            ran?
        };
        self.step_launches += self.model.launches() - before;
        self.step_tokens += chunk.len() as u64;
        self.stats.passes += 1;
        // The pass's rows are in its first sequence's scratch.
        self.host_outputs(chunk[0].0, outs, want)
    }

    /// Whether a pass must copy whole logits rows: for every want but the argmax and the
    /// candidates the device selects.
    fn needs_logits(&self, want: Want) -> bool {
        match want {
            Want::Argmax => false,
            Want::Candidates(k) => !candidates_on_device(self.model.plan().vocab_size, k),
            _ => true,
        }
    }

    /// Up to `max` committed steps of `seq` from `token` in one call of the sequence's own loop
    /// (`run` with the steps that fit), counted as steps: the steps that fit the context, then the
    /// capacity error `decode` in a loop would give.
    fn decode_run(
        &mut self,
        seq: SeqId,
        token: u32,
        max: usize,
        run: impl FnOnce(&mut CudaSeq, usize) -> Result<usize>,
    ) -> Result<usize> {
        self.check(seq, std::slice::from_ref(&token))?;
        let room = self.max_context.saturating_sub(self.seqs.get(&seq).map_or(0, |s| s.len()));
        let before = self.model.launches();
        let steps = run(self.seq_mut(seq)?, max.min(room));
        self.step_launches += self.model.launches() - before;
        let steps = steps?;
        self.step_tokens += steps as u64;
        self.stats.passes += steps as u64;
        if steps == room && max > room {
            // The context is full: the next step's check is the capacity error.
            self.check(seq, std::slice::from_ref(&token))?;
        }
        Ok(steps)
    }

    /// The outputs of the pass `seq` (its first sequence) just ran, as `want` asks: candidates are
    /// selected on the device from the rows still in its scratch.
    fn host_outputs(&mut self, seq: SeqId, outs: Vec<crate::seq::PosOut>, want: Want) -> Result<Vec<PosOut>> {
        let mut cands = match want {
            Want::Candidates(k) if !self.needs_logits(want) => {
                let s = self.seqs.get(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))?;
                s.candidates(outs.len(), k)?.unwrap_or_default()
            }
            _ => vec![],
        }
        .into_iter();
        Ok(outs.into_iter().map(|o| self.host_output(o, want, cands.next().unwrap_or_default())).collect())
    }

    fn host_output(&mut self, o: crate::seq::PosOut, want: Want, candidates: Vec<(u32, f32)>) -> PosOut {
        match (want, o.logits) {
            (Want::Logits, Some(l)) => {
                self.stats.logits_copies += 1;
                PosOut { argmax: o.argmax, logits: l, ..Default::default() }
            }
            (Want::TopLogprobs(n), Some(l)) => {
                PosOut { argmax: o.argmax, top_logprobs: top_logprobs(&l, n), ..Default::default() }
            }
            // A k the device selection does not serve: from the copied row.
            (Want::Candidates(k), Some(l)) => {
                self.stats.logits_copies += 1;
                PosOut { argmax: o.argmax, candidates: top_candidates(&l, k), ..Default::default() }
            }
            (Want::Candidates(_), None) => PosOut { argmax: o.argmax, candidates, ..Default::default() },
            _ => PosOut { argmax: o.argmax, ..Default::default() },
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }
    fn plan(&self) -> &ModelPlan {
        self.model.plan()
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn decode_weight_bytes(&self) -> usize {
        self.model.decode_weight_bytes()
    }
    fn stats(&self) -> BackendStats {
        self.stats
    }
    fn device_name(&self) -> String {
        self.model.device_name().to_string()
    }
    fn measure_read_bandwidth(&mut self) -> Result<Option<f64>> {
        Ok(Some(self.model.read_bandwidth(8 << 30)?))
    }
    fn trace_pass(&mut self, seq: SeqId, tokens: &[u32], path: &std::path::Path) -> Result<String> {
        if self.decode != Decode::Megakernel {
            return Err(Error::invalid_input("a megakernel trace needs --decode megakernel"));
        }
        if tokens.is_empty() || tokens.len() > MK_MAX_TOKENS {
            return Err(Error::invalid_input(format!("a traced pass takes 1 to {MK_MAX_TOKENS} tokens")));
        }
        let step = tokens.len() == 1;
        // A step is run twice (each commits its row, taken back after): room for two positions.
        let twice = [tokens[0], tokens[0]];
        self.check(seq, if step { &twice } else { tokens })?;
        let s = self.seq_mut(seq)?;
        let len = s.len();
        s.set_megakernel_trace(true);
        // The first pass records the stage table again (now with a trace buffer); the second is
        // the traced one. One token: the committing steps `step` runs; several: verify passes
        // (staged rows). Neither is kept.
        if step {
            let next = s.step(tokens[0], false)?.argmax;
            s.step(next, false)?;
        } else {
            let want = SeqWant { all_positions: true, logits: false };
            s.forward(tokens, want)?;
            s.forward(tokens, want)?;
        }
        let trace = s.megakernel_trace()?;
        s.set_megakernel_trace(false);
        s.truncate_to(len)?;
        let t = trace.ok_or_else(|| Error::msg("the megakernel recorded no trace"))?;
        std::fs::write(path, t.to_json()).map_err(|e| Error::msg(format!("{}: {e}", path.display())))?;
        Ok(t.table())
    }
    fn launches_per_token(&self) -> Option<f64> {
        (self.step_tokens > 0).then(|| self.step_launches as f64 / self.step_tokens as f64)
    }

    fn decode_launch(&self) -> Option<Decode> {
        Some(self.decode)
    }

    fn set_decode_launch(&mut self, decode: Decode) -> Result<()> {
        self.decode = decode;
        Ok(())
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        let mut s = self.blank_sequence()?;
        s.set_decode(self.decode);
        s.set_keep_hidden(self.assistant.is_some());
        if let Some(on) = self.device_draw {
            s.set_device_draw(on);
        }
        Ok(self.add(s))
    }
    fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        self.seq(seq)?; // an unknown id must not use up a spare
        let blank = self.blank_sequence()?;
        let copy = self.seq(seq)?.fork_into(blank)?;
        Ok(self.add(copy))
    }
    fn free(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.remove(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))?;
        if self.keep_spares && self.spare.len() < SPARE_SEQUENCES {
            self.spare.push(s);
        }
        Ok(())
    }
    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        self.seqs.get(&seq).map(|s| s.len()).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], want: Want) -> Result<PosOut> {
        self.check(seq, tokens)?;
        let logits = self.needs_logits(want);
        let s = self.seq_mut(seq)?;
        let chunk = s.prefill_chunk();
        let o = s.prefill(tokens, logits)?;
        self.stats.passes += tokens.len().div_ceil(chunk) as u64;
        Ok(self.host_outputs(seq, vec![o], want)?.pop().unwrap_or_default())
    }

    fn step(&mut self, batch: &[(SeqId, u32)], want: Want) -> Result<Vec<PosOut>> {
        for (i, (seq, tok)) in batch.iter().enumerate() {
            self.check(*seq, std::slice::from_ref(tok))?;
            if batch[..i].iter().any(|(s, _)| s == seq) {
                return Err(Error::invalid_input(format!("sequence {seq} appears twice in one step")));
            }
        }
        // One weight pass per MAX_BATCH sequences (`MEGAGEMMA_CUDA_BATCH=0`: one pass per sequence,
        // each a graph or megakernel launch).
        let per_pass = if self.batch_steps { MAX_BATCH } else { 1 };
        let mut outs = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(per_pass) {
            outs.extend(self.step_batched(chunk, want)?);
        }
        Ok(outs)
    }

    fn decode_greedy(
        &mut self,
        seq: SeqId,
        token: u32,
        max: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        self.decode_run(seq, token, max, |s, n| s.decode_greedy(token, n, on_token))
    }

    fn decode_sampled(
        &mut self,
        seq: SeqId,
        token: u32,
        params: &DrawParams,
        uniforms: &[f64],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        // Both ways check `params` (`check_draw`) before they step.
        if !self.seq_mut(seq)?.draws_on_device(params) {
            return decode_sampled_steps(self, seq, token, params, uniforms, on_token);
        }
        self.decode_run(seq, token, uniforms.len(), |s, n| s.decode_sampled(token, params, &uniforms[..n], on_token))
    }

    fn verify(&mut self, seq: SeqId, tokens: &[u32], want: Want) -> Result<Vec<PosOut>> {
        self.check(seq, tokens)?;
        if tokens.len() > MAX_VERIFY {
            return Err(Error::capacity(format!("verify of {} tokens: at most {MAX_VERIFY} per pass", tokens.len())));
        }
        let logits = self.needs_logits(want);
        let outs = self.seq_mut(seq)?.forward(tokens, SeqWant { all_positions: true, logits })?;
        self.stats.passes += 1;
        self.host_outputs(seq, outs, want)
    }

    fn commit(&mut self, seq: SeqId, accepted: usize) -> Result<()> {
        self.seq_mut(seq)?.commit(accepted)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        self.seq_mut(seq)?.truncate_to(len)
    }

    fn has_drafter(&self) -> bool {
        self.assistant.is_some()
    }

    fn draft(&mut self, seq: SeqId, token: u32, k: usize, with_probs: bool) -> Result<Draft> {
        let Some(asst) = &self.assistant else {
            return Err(Error::invalid_input("no MTP assistant is loaded (give --assistant DIR)"));
        };
        let s = self.seqs.get_mut(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))?;
        let (ids, logits) = s.draft(asst, token, k, with_probs)?;
        let probs = logits
            .into_iter()
            .map(|mut l| {
                softmax(&mut l);
                l
            })
            .collect();
        Ok(Draft { ids, probs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::synthetic_config;

    const GIB: usize = 1 << 30;

    fn plan(name: &str) -> ModelPlan {
        ModelPlan::new(&synthetic_config(name).unwrap()).unwrap()
    }

    #[test]
    fn the_default_context_is_the_models_maximum_when_it_fits() {
        let p = plan("e4b");
        // E4B's four cache-owning full layers: 2 KV heads of 512, K and V in f32.
        let per_position = kv_cache_bytes(&p, 200_000) - kv_cache_bytes(&p, 199_999);
        assert_eq!(per_position, 4 * 2 * 2 * 512 * 4);
        let d = DefaultContext::new(&p, 70 * GIB, 1);
        assert_eq!((d.tokens, d.model_max), (131_072, 131_072));
        assert!(!d.capped() && d.note().is_none());
    }

    #[test]
    fn free_memory_caps_the_default_context() {
        let p = plan("e4b");
        for (free, sequences) in [(6 * GIB, 1), (70 * GIB, 20), (40 * GIB, 20), (80 * GIB, 256)] {
            let d = DefaultContext::new(&p, free, sequences);
            assert!(d.capped(), "{free} {sequences}");
            assert!(d.tokens.is_multiple_of(CONTEXT_STEP) && d.tokens >= CONTEXT_STEP);
            // The caches fit with the reserve kept, and one step more would not.
            let usable = (free - CONTEXT_RESERVE.max(free / 10)) / sequences;
            let needs = |n| kv_cache_bytes(&p, n) + SEQ_OVERHEAD;
            assert!(needs(d.tokens) <= usable || d.tokens == CONTEXT_STEP);
            assert!(needs(d.tokens + CONTEXT_STEP) > usable);
            let note = d.note().unwrap();
            assert!(
                note.contains(&thousands(d.tokens)) && note.contains("131,072") && note.contains("--ctx"),
                "{note}"
            );
        }
        // More sequences, shorter contexts.
        let few = DefaultContext::new(&p, 40 * GIB, 4).tokens;
        let many = DefaultContext::new(&p, 40 * GIB, 16).tokens;
        assert!(many < few, "{many} {few}");
        // Nothing free: one step, never zero.
        assert_eq!(DefaultContext::new(&p, 0, 1).tokens, CONTEXT_STEP);
    }

    #[test]
    fn a_smaller_model_maximum_is_kept() {
        let mut c = synthetic_config("tiny").unwrap();
        c.max_position_embeddings = 700;
        let d = DefaultContext::new(&ModelPlan::new(&c).unwrap(), 0, 1);
        assert_eq!(d.tokens, 700);
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(999), "999");
    }
}
