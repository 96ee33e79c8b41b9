//! [`CudaBackend`]: the engine's [`Backend`] interface over [`CudaModel`] and its sequences.
//!
//! Inputs are validated here, before anything reaches the device, so a bad request is an
//! `InvalidInput` or `Capacity` error and never leaves a sequence half-updated. Greedy calls read
//! back only the argmax (4 bytes per position); logits cross to the host only when asked for.

use crate::candidates::candidates_on_device;
use crate::draft::CudaAssistant;
use crate::model::CudaModel;
use crate::seq::{decode_from_env, CudaSeq, Decode, Want as SeqWant, MAX_BATCH, MAX_VERIFY, MK_MAX_TOKENS};
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

/// Default context when none is asked for (KV memory is allocated up front per sequence).
pub const DEFAULT_MAX_CONTEXT: usize = 8192;

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
}

impl CudaBackend {
    pub fn new(model: Arc<CudaModel>, max_context: Option<usize>) -> CudaBackend {
        CudaBackend {
            model,
            seqs: BTreeMap::new(),
            next_id: 0,
            max_context: max_context.unwrap_or(DEFAULT_MAX_CONTEXT).max(1),
            stats: BackendStats::default(),
            step_launches: 0,
            step_tokens: 0,
            decode: decode_from_env(),
            batch_steps: std::env::var("MEGAGEMMA_CUDA_BATCH").map_or(true, |v| v != "0"),
            assistant: None,
            device_draw: None,
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
        let mut s = CudaSeq::new(&self.model, self.max_context)?;
        s.set_decode(self.decode);
        s.set_keep_hidden(self.assistant.is_some());
        if let Some(on) = self.device_draw {
            s.set_device_draw(on);
        }
        Ok(self.add(s))
    }
    fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let copy = self.seq_mut(seq)?.fork()?;
        Ok(self.add(copy))
    }
    fn free(&mut self, seq: SeqId) -> Result<()> {
        self.seqs.remove(&seq).map(|_| ()).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
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
