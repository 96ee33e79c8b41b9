//! The CPU reference backend: f32 arithmetic, weights in their stored format.

pub mod forward;
pub mod kv;
pub mod ops;

use crate::assistant::{self, AssistantModel};
use crate::backend::{check_pass, pos_out, Backend, BackendStats, Draft, PosOut, SeqId, Want};
use crate::error::Error;
use crate::model::Model;
use crate::plan::ModelPlan;
use crate::Result;
use forward::{forward_batch, ChunkOut, Segment};
use kv::KvCache;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Longest prompt chunk one prefill pass takes (bounds activation memory for long prompts).
const PREFILL_CHUNK: usize = 512;

/// Default context when none is asked for: long enough for real chats, small enough that a
/// forgotten sequence cannot eat the machine (or the model's maximum, when that is shorter).
pub const DEFAULT_MAX_CONTEXT: usize = 32_768;

/// One sequence: its KV cache and the final-normed hidden states the drafter reads.
#[derive(Clone)]
struct CpuSeq {
    kv: KvCache,
    /// Hidden state of the newest committed position (`[hidden]`, empty before the first pass).
    hidden: Vec<f32>,
    /// Hidden states of the staged positions of the last verify (`[staged, hidden]`).
    staged_hidden: Vec<f32>,
}

pub struct CpuBackend {
    model: Arc<Model>,
    /// The MTP assistant, when loaded: it drafts from a sequence's KV cache and hidden state.
    assistant: Option<Arc<AssistantModel>>,
    seqs: BTreeMap<SeqId, CpuSeq>,
    next_id: u32,
    max_context: usize,
    /// Reused across passes: the vocab-sized logits are never reallocated per step.
    scratch: ChunkOut,
    stats: BackendStats,
}

impl CpuBackend {
    pub fn new(model: Arc<Model>) -> CpuBackend {
        // Kernel layouts built once here (GGUF byte tiles: 0.17 s for Gemma 3 270M on two cores),
        // not in the first request's prefill; one matrix at a time, each built in parallel.
        for m in model.weights.matrices() {
            m.prepare_cpu_layout();
        }
        let max_context = DEFAULT_MAX_CONTEXT.min(model.plan.max_positions);
        CpuBackend {
            model,
            assistant: None,
            seqs: BTreeMap::new(),
            next_id: 0,
            max_context,
            scratch: ChunkOut::default(),
            stats: BackendStats::default(),
        }
    }

    /// Cap every sequence at `n` positions (committed + staged).
    pub fn with_max_context(mut self, n: usize) -> CpuBackend {
        self.max_context = n.max(1);
        self
    }

    /// Load `assistant` beside the target for [`Backend::draft`].
    pub fn with_assistant(mut self, assistant: Arc<AssistantModel>) -> CpuBackend {
        self.assistant = Some(assistant);
        self
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Sequences currently held.
    pub fn live_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The KV cache of a sequence (for inspection by tests and the drafter).
    pub fn kv(&self, seq: SeqId) -> Result<&KvCache> {
        Ok(&self.seq(seq)?.kv)
    }

    /// Final-normed hidden state of `seq`'s newest committed position.
    pub fn hidden(&self, seq: SeqId) -> Result<&[f32]> {
        Ok(&self.seq(seq)?.hidden)
    }

    fn seq(&self, seq: SeqId) -> Result<&CpuSeq> {
        self.seqs.get(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut CpuSeq> {
        self.seqs.get_mut(&seq).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
    }

    fn check_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let s = self.seq(seq)?;
        check_pass(seq, tokens, self.model.plan.vocab_size, s.kv.len(), s.kv.staged(), self.max_context)
    }

    /// One weight pass over `(seq, tokens, keep)` segments; results land in `self.scratch`.
    fn pass(&mut self, work: &[(SeqId, &[u32], usize)]) -> Result<()> {
        // Take the sequences out of the map so each segment can borrow its cache mutably.
        let mut taken: Vec<(SeqId, CpuSeq)> = Vec::with_capacity(work.len());
        for &(id, _, _) in work {
            match self.seqs.remove(&id) {
                Some(s) => taken.push((id, s)),
                None => {
                    self.seqs.extend(taken);
                    return Err(Error::invalid_input(format!("unknown or repeated sequence {id} in one pass")));
                }
            }
        }
        let mut segs: Vec<Segment<'_>> = taken
            .iter_mut()
            .zip(work)
            .map(|((_, s), &(_, tokens, keep))| Segment { kv: &mut s.kv, tokens, keep })
            .collect();
        forward_batch(&self.model.plan, &self.model.weights, &mut segs, &mut self.scratch);
        drop(segs);
        self.seqs.extend(taken);
        self.stats.passes += 1;
        Ok(())
    }

    fn outputs(&mut self, rows: usize, want: Want) -> Vec<PosOut> {
        let v = self.model.plan.vocab_size;
        if want == Want::Logits {
            self.stats.logits_copies += rows as u64;
        }
        // The head found each row's argmax as it wrote it; one position per task for the rest
        // (a logits copy or a top-n over the vocabulary).
        use rayon::prelude::*;
        let (logits, argmax) = (&self.scratch.logits[..rows * v], &self.scratch.argmax[..rows]);
        logits.par_chunks_exact(v).zip(argmax).map(|(l, &a)| pos_out(a, l, want)).collect()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    fn plan(&self) -> &ModelPlan {
        &self.model.plan
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn decode_weight_bytes(&self) -> usize {
        self.model.weights.decode_bytes(self.model.plan.moe_top_k)
    }
    fn stats(&self) -> BackendStats {
        self.stats
    }
    fn device_name(&self) -> String {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        format!("{cpu}, {} threads", rayon::current_num_threads())
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let kv = KvCache::new(&self.model.plan);
        self.seqs.insert(id, CpuSeq { kv, hidden: Vec::new(), staged_hidden: Vec::new() });
        Ok(id)
    }
    fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let mut copy = self.seq(seq)?.clone();
        copy.kv.truncate_to(copy.kv.len())?; // drop staged rows
        copy.staged_hidden.clear();
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, copy);
        Ok(id)
    }
    fn free(&mut self, seq: SeqId) -> Result<()> {
        self.seqs.remove(&seq).map(|_| ()).ok_or_else(|| Error::invalid_input(format!("unknown sequence {seq}")))
    }
    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.kv.len())
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], want: Want) -> Result<PosOut> {
        self.check_tokens(seq, tokens)?;
        let h = self.model.plan.hidden;
        let chunks: Vec<&[u32]> = tokens.chunks(PREFILL_CHUNK).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            self.pass(&[(seq, chunk, usize::from(last))])?;
            let s = self.seqs.get_mut(&seq).expect("sequence checked above");
            s.kv.commit(chunk.len())?;
            if last {
                s.hidden.clear();
                s.hidden.extend_from_slice(&self.scratch.hidden[..h]);
            }
        }
        Ok(self.outputs(1, want).remove(0))
    }

    fn step(&mut self, batch: &[(SeqId, u32)], want: Want) -> Result<Vec<PosOut>> {
        for (seq, tok) in batch {
            self.check_tokens(*seq, std::slice::from_ref(tok))?;
        }
        let work: Vec<(SeqId, &[u32], usize)> = batch.iter().map(|(s, t)| (*s, std::slice::from_ref(t), 1)).collect();
        self.pass(&work)?;
        let h = self.model.plan.hidden;
        for (i, (seq, _)) in batch.iter().enumerate() {
            let hidden = &self.scratch.hidden[i * h..(i + 1) * h];
            let s = self.seqs.get_mut(seq).expect("sequence checked above");
            s.kv.commit(1)?;
            s.hidden.clear();
            s.hidden.extend_from_slice(hidden);
        }
        Ok(self.outputs(batch.len(), want))
    }

    fn verify(&mut self, seq: SeqId, tokens: &[u32], want: Want) -> Result<Vec<PosOut>> {
        self.check_tokens(seq, tokens)?;
        self.pass(&[(seq, tokens, tokens.len())])?;
        let hidden = std::mem::take(&mut self.scratch.hidden);
        let s = self.seq_mut(seq)?;
        s.staged_hidden.clear();
        s.staged_hidden.extend_from_slice(&hidden);
        self.scratch.hidden = hidden;
        Ok(self.outputs(tokens.len(), want))
    }

    fn commit(&mut self, seq: SeqId, accepted: usize) -> Result<()> {
        let h = self.model.plan.hidden;
        let s = self.seq_mut(seq)?;
        s.kv.commit(accepted)?;
        if accepted > 0 {
            s.hidden.clear();
            s.hidden.extend_from_slice(&s.staged_hidden[(accepted - 1) * h..accepted * h]);
        }
        s.staged_hidden.clear();
        Ok(())
    }

    fn has_drafter(&self) -> bool {
        self.assistant.is_some()
    }

    fn draft(&mut self, seq: SeqId, token: u32, k: usize, with_probs: bool) -> Result<Draft> {
        let Some(asst) = &self.assistant else {
            return Err(Error::invalid_input("no MTP assistant is loaded (give --assistant DIR)"));
        };
        let s = self.seq(seq)?;
        if s.hidden.is_empty() {
            return Err(Error::invalid_input(format!(
                "sequence {seq} has no hidden state to draft from: run a pass after creating or truncating it"
            )));
        }
        if token as usize >= self.model.plan.vocab_size {
            return Err(Error::invalid_input(format!("token id {token} is out of range")));
        }
        let p = s.kv.len();
        if !with_probs {
            let ids = assistant::draft(asst, &self.model, &s.kv, p, token, &s.hidden, k)?;
            return Ok(Draft { ids, probs: Vec::new() });
        }
        let mut probs = Vec::with_capacity(k);
        let ids = assistant::draft_with(asst, &self.model, &s.kv, p, token, &s.hidden, k, |logits| {
            let mut q = logits.to_vec();
            ops::softmax(&mut q);
            probs.push(q);
            ops::argmax(logits)
        })?;
        Ok(Draft { ids, probs })
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let s = self.seq_mut(seq)?;
        let before = s.kv.len();
        s.kv.truncate_to(len)?;
        s.staged_hidden.clear();
        if len != before {
            // The hidden state of position len − 1 is gone; a drafter needs a fresh pass first.
            s.hidden.clear();
        }
        Ok(())
    }
}
