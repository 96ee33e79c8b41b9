//! Finished sequences kept for reuse: a new prompt that starts with the tokens of one (the
//! same system prompt, the next turn of a chat) forks it, rolls it back to the shared prefix
//! and prefills only the rest.

use megagemma_model::backend::{Backend, SeqId};

pub struct PrefixCache {
    capacity: usize,
    /// (sequence, the tokens its committed positions hold, last use).
    entries: Vec<(SeqId, Vec<u32>, u64)>,
    clock: u64,
}

impl PrefixCache {
    pub fn new(capacity: usize) -> Self {
        PrefixCache { capacity, entries: Vec::new(), clock: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Keeps `seq` (holding `tokens`) for reuse, or frees it when the cache is off or already
    /// holds those tokens; the least recently used entry goes when the cache is full.
    pub fn insert(&mut self, backend: &mut dyn Backend, seq: SeqId, tokens: Vec<u32>) {
        if self.capacity == 0 || self.entries.iter().any(|(_, t, _)| *t == tokens) {
            let _ = backend.free(seq);
            return;
        }
        if self.entries.len() >= self.capacity {
            self.evict_oldest(backend);
        }
        self.clock += 1;
        self.entries.push((seq, tokens, self.clock));
    }

    /// A new sequence holding the longest cached prefix of `prompt` (at least one prompt token
    /// is left to prefill), and that prefix's length; `None` when nothing usable is cached.
    pub fn lookup(&mut self, backend: &mut dyn Backend, prompt: &[u32]) -> Option<(SeqId, usize)> {
        let limit = prompt.len().saturating_sub(1);
        let (i, shared) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (_, t, _))| (i, common_prefix(t, &prompt[..limit])))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        if shared == 0 {
            return None;
        }
        let seq = backend.fork(self.entries[i].0).ok()?;
        // A sliding-window cache may no longer hold what the rollback needs: then start afresh.
        if backend.truncate(seq, shared).is_err() {
            let _ = backend.free(seq);
            return None;
        }
        self.clock += 1;
        self.entries[i].2 = self.clock;
        Some((seq, shared))
    }

    /// Frees every cached sequence (to make room for running ones).
    pub fn clear(&mut self, backend: &mut dyn Backend) {
        for (seq, _, _) in self.entries.drain(..) {
            let _ = backend.free(seq);
        }
    }

    fn evict_oldest(&mut self, backend: &mut dyn Backend) {
        if let Some(i) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].2) {
            let (seq, _, _) = self.entries.remove(i);
            let _ = backend.free(seq);
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
