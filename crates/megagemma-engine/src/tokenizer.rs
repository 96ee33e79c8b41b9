//! Thin wrapper over a HuggingFace `tokenizer.json` plus a streaming detokenizer.
//!
//! Gemma's tokenizer is SentencePiece-style BPE with byte fallback: a character missing from
//! the vocabulary becomes several `<0xNN>` byte tokens, so a single generated id may be only
//! part of a UTF-8 character. [`StreamDecoder`] holds such ids back until they complete.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};

/// Cheap to clone (the vocabulary is shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    special_ids: Arc<HashSet<u32>>,
    vocab_size: usize,
    /// One past the largest known id (added tokens may lie beyond the model vocabulary).
    id_limit: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size).finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.is_file() {
            bail!("tokenizer file not found: {}", path.display());
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("failed to load tokenizer {}: {e}", path.display()))?;
        Ok(Self::from_inner(inner))
    }

    /// Loads `tokenizer.json` from a model directory.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!("tokenizer.json not found in {}", dir.display());
        }
        Self::from_file(path)
    }

    /// Parses the JSON text of a `tokenizer.json`.
    pub fn from_json_bytes(json: &[u8]) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_bytes(json).map_err(|e| anyhow!("failed to parse tokenizer JSON: {e}"))?;
        Ok(Self::from_inner(inner))
    }

    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let added = inner.get_added_tokens_decoder();
        let special_ids = added.iter().filter(|(_, tok)| tok.special).map(|(&id, _)| id).collect();
        let vocab_size = inner.get_vocab_size(false);
        let max_added = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0);
        Self {
            inner: Arc::new(inner),
            special_ids: Arc::new(special_ids),
            vocab_size,
            id_limit: vocab_size.max(max_added),
        }
    }

    /// Encodes `text`. With `add_special_tokens` the tokenizer's post-processor runs (for Gemma
    /// it prepends `<bos>`); pass `false` for text that already contains the BOS token text,
    /// e.g. a rendered chat template, or the prompt gets two BOS tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        // encode_fast skips offset tracking, which we never use.
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenizer failed to encode text: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        // The underlying decoder silently drops unknown ids; a bad id is a caller bug worth seeing.
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.id_limit) {
            bail!("token id {bad} is out of range (largest id is {})", self.id_limit.saturating_sub(1));
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| anyhow!("tokenizer failed to decode ids: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Size of the model vocabulary, i.e. the LM-head rows (262 144 for Gemma 3/4). Added
    /// tokens may extend past it (the Gemma 3 file adds `<image_soft_token>` = 262 144).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// True for added tokens flagged `special` (skipped by `decode(.., true)`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// A fresh streaming detokenizer for one generated sequence.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special_tokens)
    }

    /// Escape hatch to the full `tokenizers` API.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Incremental detokenizer: feed ids one at a time, get text pieces whose concatenation equals
/// `decode(all_ids)`.
///
/// Each step decodes a short window of recent ids and emits only the text past what the window
/// already produced; the window restarts after every emitted piece, so a step costs O(window).
/// The piece is held back while the decoded text ends in U+FFFD, i.e. while a byte-fallback
/// sequence is still incomplete.
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the decode window (keeps the previous piece as context for the decoder).
    prefix_offset: usize,
    /// Ids before this index have been emitted as text.
    read_offset: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        Self { tokenizer, skip_special_tokens, ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }

    /// Adds one id; returns the new text, or `None` while it does not yet form complete UTF-8.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = self.decode_range(self.prefix_offset, self.read_offset)?;
        let full = self.decode_range(self.prefix_offset, self.ids.len())?;
        if full.ends_with('\u{FFFD}') || full.len() <= prefix.len() {
            return Ok(None);
        }
        let Some(piece) = full.strip_prefix(prefix.as_str()) else {
            // The decoder rewrote earlier text (not the case for Gemma); resynchronise.
            return Ok(None);
        };
        let piece = piece.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(Some(piece))
    }

    /// Text of ids still held back (an unfinished byte sequence decodes to U+FFFD here).
    /// Call once when generation ends.
    pub fn flush(&mut self) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let prefix = self.decode_range(self.prefix_offset, self.read_offset)?;
        let full = self.decode_range(self.prefix_offset, self.ids.len())?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let piece = full.strip_prefix(prefix.as_str()).unwrap_or(&full).to_string();
        Ok((!piece.is_empty()).then_some(piece))
    }

    /// All ids fed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn decode_range(&self, start: usize, end: usize) -> Result<String> {
        if start == end {
            return Ok(String::new());
        }
        self.tokenizer.decode(&self.ids[start..end], self.skip_special_tokens)
    }
}
