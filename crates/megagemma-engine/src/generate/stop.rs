//! When generation ends: a stop id, the token budget, or the caller.

use super::GenerateParams;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was generated.
    Stop,
    /// `max_new_tokens` reached (or the caller stopped listening).
    Length,
}

/// Checks each emitted token, in order, against the stop ids and the budget.
pub struct StopRule<'a> {
    params: &'a GenerateParams,
    emitted: usize,
}

impl<'a> StopRule<'a> {
    pub fn new(params: &'a GenerateParams) -> Self {
        StopRule { params, emitted: 0 }
    }

    /// Record one emitted token; `Some(reason)` when it is the last one.
    pub fn emit(&mut self, tok: u32, listener_wants_more: bool) -> Option<FinishReason> {
        self.emitted += 1;
        if !self.params.ignore_eos && self.params.stop_ids.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        if !listener_wants_more || self.emitted >= self.params.max_new_tokens {
            return Some(FinishReason::Length);
        }
        None
    }

    /// Tokens that may still be emitted.
    pub fn remaining(&self) -> usize {
        self.params.max_new_tokens.saturating_sub(self.emitted)
    }
}
