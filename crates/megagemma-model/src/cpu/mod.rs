//! The CPU reference backend: f32 arithmetic, weights in their stored format.

pub mod forward;
pub mod kv;
pub mod ops;

use crate::backend::{Backend, StepOut};
use crate::model::Model;
use crate::{bail, Result};
use forward::forward_chunk;
use kv::KvCache;
use std::sync::Arc;

pub struct CpuBackend {
    model: Arc<Model>,
    kv: KvCache,
}

impl CpuBackend {
    pub fn new(model: Arc<Model>) -> CpuBackend {
        let kv = KvCache::new(&model.plan);
        CpuBackend { model, kv }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            bail!("empty input: at least one token is needed");
        }
        let v = self.model.plan.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            bail!("token id {bad} is out of range (vocab_size is {v})");
        }
        if self.kv.staged() > 0 {
            bail!("{} verified rows are still staged: commit or truncate first", self.kv.staged());
        }
        Ok(())
    }

    fn run(&mut self, tokens: &[u32], keep: usize) -> Vec<StepOut> {
        let out = forward_chunk(&self.model.plan, &self.model.weights, &mut self.kv, tokens, keep);
        let v = self.model.plan.vocab_size;
        out.logits.chunks_exact(v).map(|l| StepOut { argmax: ops::argmax(l), logits: l.to_vec() }).collect()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    fn vocab_size(&self) -> usize {
        self.model.plan.vocab_size
    }
    fn position(&self) -> usize {
        self.kv.len()
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOut> {
        self.check_tokens(tokens)?;
        let out = self.run(tokens, 1).pop().unwrap();
        self.kv.commit(tokens.len())?;
        Ok(out)
    }
    fn decode(&mut self, token: u32) -> Result<StepOut> {
        self.prefill(&[token])
    }
    fn verify(&mut self, tokens: &[u32]) -> Result<Vec<StepOut>> {
        self.check_tokens(tokens)?;
        Ok(self.run(tokens, tokens.len()))
    }
    fn commit(&mut self, accepted: usize) -> Result<()> {
        self.kv.commit(accepted)
    }
    fn truncate_to(&mut self, len: usize) -> Result<()> {
        self.kv.truncate_to(len)
    }
    fn reset(&mut self) {
        self.kv.clear();
    }
    fn decode_weight_bytes(&self) -> usize {
        self.model.weights.decode_bytes(self.model.plan.moe_top_k)
    }
}
