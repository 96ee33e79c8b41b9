//! The interface every compute backend (CPU reference, CUDA) offers the engine.
//!
//! One sequence per backend instance for now. `verify` exists for speculative decoding: it
//! runs several tokens in one pass and *stages* their KV rows; `commit` keeps the accepted
//! prefix. `truncate_to` rolls committed state back where the cache allows it.

use crate::Result;

/// Output of one position.
#[derive(Clone, Debug)]
pub struct StepOut {
    /// Final logits (after softcap), `vocab_size` floats.
    pub logits: Vec<f32>,
    /// Index of the largest logit (first wins ties).
    pub argmax: u32,
}

pub trait Backend: Send {
    fn name(&self) -> &str;
    fn vocab_size(&self) -> usize;
    /// Committed positions (tokens whose KV rows are in the cache).
    fn position(&self) -> usize;
    /// Run a prompt (appended after the committed positions); commit it; logits of its last token.
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOut>;
    /// One token (M = 1), committed.
    fn decode(&mut self, token: u32) -> Result<StepOut>;
    /// Several tokens in one pass; logits for every position; KV rows staged, not committed.
    fn verify(&mut self, tokens: &[u32]) -> Result<Vec<StepOut>>;
    /// Keep the first `accepted` staged rows of the last `verify`, drop the rest.
    fn commit(&mut self, accepted: usize) -> Result<()>;
    /// Roll back to `len` committed positions (drops staged rows too).
    fn truncate_to(&mut self, len: usize) -> Result<()>;
    /// Forget the whole sequence.
    fn reset(&mut self);
    /// Bytes of weights one decode step reads.
    fn decode_weight_bytes(&self) -> usize;
}
