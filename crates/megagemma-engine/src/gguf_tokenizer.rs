//! A [`Tokenizer`] built from GGUF metadata, for GGUF files that come without a `tokenizer.json`.
//!
//! Supports `tokenizer.ggml.model = "llama"`, i.e. SentencePiece BPE with byte fallback (Gemma,
//! Llama 2, ...), and `"gemma4"`, Gemma 4's BPE (the same SentencePiece-style BPE on raw UTF-8
//! with spaces as `"▁"` and byte fallback, but with its merges stored in
//! `tokenizer.ggml.merges` and every score a placeholder). The result is an ordinary
//! `tokenizers::Tokenizer` wrapped in [`Tokenizer`], set up the way HF's
//! `convert_slow_tokenizer` sets up the official Gemma `tokenizer.json`:
//!
//! * **model**: `BPE` over the GGUF vocabulary (ids kept), `byte_fallback` (`<0xNN>` pieces),
//!   `fuse_unk`, with merges derived from the scores exactly as HF's `SentencePieceExtractor`
//!   does (see [`sentencepiece_merges`]). On Gemma 3 this reproduces the official 514 906 merges
//!   in the official order. `gemma4` files carry the merges themselves (`"left right"`, in rank
//!   order) and their pieces are used exactly as stored.
//! * **normalizer**: `" "` → `"▁"` (plus a leading `"▁"` when `add_space_prefix` is set);
//!   **pre-tokenizer**: `Split(" ", MergedWithPrevious)` as in the official file (a no-op after
//!   the normalizer).
//! * **added tokens**: every control (type 3), user-defined (type 4) and unknown (type 2) piece,
//!   unnormalized, so `<start_of_turn>`, `\n`, `\t\t`, `<h1>` ... are matched whole before BPE.
//!   Control/unknown pieces and the bos/eos/unk/pad ids are flagged special.
//! * **post-processor**: `<bos>` (and/or `<eos>`) per `add_bos_token` / `add_eos_token`.
//! * **decoder**: `Replace("▁", " ")`, `ByteFallback`, `Fuse` (+ `Strip` of the prefix space).
//!
//! Two GGUF quirks are undone: llama.cpp's converter writes user-defined pieces made of spaces
//! with real spaces (`"  "` instead of `"▁▁"`), and scores them -1000 where the SentencePiece
//! model (and hence the merge order of the official file) has 0.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use megagemma_model::gguf::{GgufArray, GgufFile};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, SplitDelimiterBehavior};

use crate::tokenizer::Tokenizer;

/// SentencePiece's whitespace marker.
const SPACE_MARK: &str = "\u{2581}";

/// llama.cpp token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// True when the file carries a tokenizer vocabulary (`tokenizer.ggml.tokens`).
pub fn gguf_has_tokenizer(file: &GgufFile) -> bool {
    file.get_str_array("tokenizer.ggml.tokens").is_some()
}

/// Opens `path` and builds its tokenizer (see [`tokenizer_from_gguf`]).
pub fn tokenizer_from_gguf_path(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let path = path.as_ref();
    let file = GgufFile::open(path).map_err(|e| anyhow!("{e}"))?;
    tokenizer_from_gguf(&file).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// Builds the tokenizer described by the file's `tokenizer.ggml.*` metadata.
pub fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    Ok(Tokenizer::from_inner(hf_tokenizer_from_gguf(file)?))
}

/// The underlying `tokenizers::Tokenizer` (what [`tokenizer_from_gguf`] wraps).
pub fn hf_tokenizer_from_gguf(file: &GgufFile) -> Result<tokenizers::Tokenizer> {
    let Some(tokens) = file.get_str_array("tokenizer.ggml.tokens") else {
        bail!(
            "GGUF file has no tokenizer metadata (tokenizer.ggml.tokens is missing); \
             provide a tokenizer.json for this model"
        );
    };
    if tokens.is_empty() {
        bail!("GGUF tokenizer metadata is empty (tokenizer.ggml.tokens has no entries)");
    }
    let gemma4 = match file.get_str("tokenizer.ggml.model") {
        Some("llama") => false,
        Some("gemma4") => true,
        Some(other) => bail!(
            "unsupported GGUF tokenizer model {other:?} (supported: \"llama\", SentencePiece BPE, and \
             \"gemma4\"); provide a tokenizer.json for this model"
        ),
        None => bail!("GGUF tokenizer metadata lacks tokenizer.ggml.model"),
    };
    let n = tokens.len();
    let types = token_types(file, n)?;

    let id_key = |key: &str| -> Result<Option<u32>> {
        match file.get_u32(key) {
            Some(id) if id as usize >= n => {
                bail!("GGUF {key} = {id} is outside the vocabulary ({n} tokens)")
            }
            id => Ok(id),
        }
    };
    let bos = id_key("tokenizer.ggml.bos_token_id")?;
    let eos = id_key("tokenizer.ggml.eos_token_id")?;
    let unk = id_key("tokenizer.ggml.unknown_token_id")?;
    let pad = id_key("tokenizer.ggml.padding_token_id")?;
    // llama.cpp's defaults for SentencePiece vocabularies when the flags are absent.
    let add_bos = file.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(true);
    let add_eos = file.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false);
    // (Gemma 4's converter always writes add_space_prefix = false.)
    let add_space_prefix = file.get_bool("tokenizer.ggml.add_space_prefix").unwrap_or(!gemma4);

    // Pieces as the SentencePiece model spells them: spaces are always "▁" there (the
    // normalizer turns every input space into "▁", so a piece with a real space is unreachable).
    // A gemma4 file stores the tokenizer.json pieces themselves: used as they are.
    let pieces: Vec<String> =
        if gemma4 { tokens.to_vec() } else { tokens.iter().map(|t| t.replace(' ', SPACE_MARK)).collect() };
    // The BPE model's own map type: handed over as is, not hashed a second time.
    let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(n);
    for (id, piece) in pieces.iter().enumerate() {
        // A duplicated piece keeps its first id (never the case in Gemma files).
        vocab.entry(piece.clone()).or_insert(id as u32);
    }
    let merges = if gemma4 {
        stored_merges(file, &vocab)?
    } else {
        let Some(scores) = file.get_f32_array("tokenizer.ggml.scores") else {
            bail!("GGUF tokenizer metadata lacks tokenizer.ggml.scores (f32 array), needed for BPE merges");
        };
        if scores.len() != n {
            bail!("GGUF tokenizer metadata is inconsistent: {} scores for {n} tokens", scores.len());
        }
        sentencepiece_merges(&pieces, scores, &types)
    };

    let unk_piece =
        unk.map(|id| pieces[id as usize].clone()).or_else(|| vocab.contains_key("<unk>").then(|| "<unk>".to_string()));
    let byte_fallback = types.contains(&token_type::BYTE) || vocab.contains_key("<0x00>");
    let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).fuse_unk(true).byte_fallback(byte_fallback);
    if let Some(unk_piece) = &unk_piece {
        bpe = bpe.unk_token(unk_piece.clone());
    }
    let bpe = bpe.build().map_err(|e| anyhow!("cannot build BPE model from GGUF vocabulary: {e}"))?;

    let mut tok = tokenizers::Tokenizer::new(bpe);

    let replace = Replace::new(" ", SPACE_MARK).map_err(|e| anyhow!("{e}"))?;
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE_MARK.into()).into(), replace.into()]).into()
    } else {
        replace.into()
    };
    tok.with_normalizer(Some(normalizer));
    let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false)
        .map_err(|e| anyhow!("{e}"))?;
    tok.with_pre_tokenizer(Some(split));

    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE_MARK, " ").map_err(|e| anyhow!("{e}"))?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(DecoderSequence::new(decoders)));

    // <bos> $A [<eos>]; a pair repeats the frame around $B (as the official Gemma file does).
    let mut frame_start = Vec::new();
    let mut frame_end = Vec::new();
    let mut special = Vec::new();
    if add_bos {
        let id = bos.ok_or_else(|| anyhow!("GGUF sets add_bos_token but has no bos_token_id"))?;
        frame_start.push(pieces[id as usize].clone());
        special.push((pieces[id as usize].clone(), id));
    }
    if add_eos {
        let id = eos.ok_or_else(|| anyhow!("GGUF sets add_eos_token but has no eos_token_id"))?;
        frame_end.push(pieces[id as usize].clone());
        special.push((pieces[id as usize].clone(), id));
    }
    if !special.is_empty() {
        let with_type = |pieces: &[String], type_id: u32| -> Vec<String> {
            pieces.iter().map(|p| format!("{p}:{type_id}")).collect()
        };
        let single: Vec<String> =
            frame_start.iter().cloned().chain(["$A:0".to_string()]).chain(frame_end.iter().cloned()).collect();
        let pair: Vec<String> = single
            .iter()
            .cloned()
            .chain(with_type(&frame_start, 1))
            .chain(["$B:1".to_string()])
            .chain(with_type(&frame_end, 1))
            .collect();
        let processor = TemplateProcessing::builder()
            .try_single(single)
            .map_err(|e| anyhow!("bad post-processor template: {e}"))?
            .try_pair(pair)
            .map_err(|e| anyhow!("bad post-processor template: {e}"))?
            .special_tokens(special)
            .build()
            .map_err(|e| anyhow!("bad post-processor template: {e}"))?;
        tok.with_post_processor(Some(processor));
    }

    // Control / user-defined / unknown pieces are matched whole in the raw text, before BPE.
    let special_ids: Vec<u32> = [bos, eos, unk, pad].into_iter().flatten().collect();
    let added: Vec<AddedToken> = pieces
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(id, (piece, &ty))| {
            !piece.is_empty()
                && (matches!(ty, token_type::CONTROL | token_type::USER_DEFINED | token_type::UNKNOWN)
                    || special_ids.contains(&(*id as u32)))
        })
        .map(|(id, (piece, &ty))| {
            let special = ty == token_type::CONTROL || ty == token_type::UNKNOWN || special_ids.contains(&(id as u32));
            AddedToken::from(piece.clone(), special).normalized(false)
        })
        .collect();
    tok.add_tokens(&added);
    Ok(tok)
}

/// `tokenizer.ggml.merges` (`"left right"`, highest rank first), split as llama.cpp splits them:
/// at the first space after the first byte (so a left part may itself be a space). Both parts
/// must be vocabulary pieces.
fn stored_merges(file: &GgufFile, vocab: &tokenizers::models::bpe::Vocab) -> Result<Vec<(String, String)>> {
    let Some(merges) = file.get_str_array("tokenizer.ggml.merges") else {
        bail!("GGUF gemma4 tokenizer metadata lacks tokenizer.ggml.merges");
    };
    merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let first = m.chars().next().map_or(0, char::len_utf8);
            let Some(at) = m[first..].find(' ').map(|p| p + first) else {
                bail!("GGUF tokenizer.ggml.merges[{i}] = {m:?} is not \"left right\"");
            };
            let (l, r) = (&m[..at], &m[at + 1..]);
            if !vocab.contains_key(l) || !vocab.contains_key(r) {
                bail!("GGUF tokenizer.ggml.merges[{i}] = {m:?} names a piece outside the vocabulary");
            }
            Ok((l.to_string(), r.to_string()))
        })
        .collect()
}

/// `tokenizer.ggml.token_type` (i32, or u32 from some writers); all NORMAL when absent.
fn token_types(file: &GgufFile, n: usize) -> Result<Vec<i32>> {
    let types: Vec<i32> = match file.get_array("tokenizer.ggml.token_type") {
        None => return Ok(vec![token_type::NORMAL; n]),
        Some(GgufArray::I32(v)) => v.clone(),
        Some(GgufArray::U32(v)) => v.iter().map(|&t| t as i32).collect(),
        Some(GgufArray::I8(v)) => v.iter().map(|&t| t as i32).collect(),
        Some(GgufArray::U8(v)) => v.iter().map(|&t| t as i32).collect(),
        Some(other) => bail!(
            "GGUF tokenizer.ggml.token_type has unexpected element type ({} entries of a non-integer type)",
            other.len()
        ),
    };
    if types.len() != n {
        bail!("GGUF tokenizer metadata is inconsistent: {} token types for {n} tokens", types.len());
    }
    Ok(types)
}

/// BPE merges of a SentencePiece vocabulary, in the order of HF's `SentencePieceExtractor`
/// (`transformers`/`tokenizers` `generate_merges`): for every piece, every split into two
/// in-vocabulary pieces is a merge (within a piece ordered by the parts' ids); all merges are
/// then stably sorted by the merged piece's score, descending, then by the left part's length,
/// then the right part's length (in characters), both descending.
///
/// Scores are SentencePiece's: the file score for normal pieces, 0 for the others (the
/// SentencePiece model stores 0 for control/user-defined/byte pieces; llama.cpp writes -1000).
pub fn sentencepiece_merges(pieces: &[String], scores: &[f32], types: &[i32]) -> Vec<(String, String)> {
    // ~3.7 M lookups for Gemma's 262,144 pieces: a fast hasher (the keys are the file's own).
    let mut index: HashMap<&str, u32, ahash::RandomState> =
        HashMap::with_capacity_and_hasher(pieces.len(), ahash::RandomState::new());
    for (id, piece) in pieces.iter().enumerate() {
        // Python's dict comprehension keeps the last id of a duplicated piece.
        index.insert(piece.as_str(), id as u32);
    }
    struct Merge {
        left: u32,
        right: u32,
        score: f32,
        left_chars: u32,
        right_chars: u32,
    }
    let mut merges: Vec<Merge> = Vec::new();
    let mut local: Vec<Merge> = Vec::new();
    for (id, piece) in pieces.iter().enumerate() {
        let score = if types[id] == token_type::NORMAL { scores[id] } else { 0.0 };
        let total_chars = piece.chars().count() as u32;
        local.clear();
        for (nth, (at, _)) in piece.char_indices().enumerate().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&left), Some(&right)) = (index.get(l), index.get(r)) {
                local.push(Merge { left, right, score, left_chars: nth as u32, right_chars: total_chars - nth as u32 });
            }
        }
        local.sort_by_key(|m| (m.left, m.right));
        merges.append(&mut local);
    }
    // Stable sort, like Python's `sorted(..., reverse=True)` (which keeps ties in order).
    // `partial_cmp` treats -0.0 and 0.0 as equal, as Python does.
    merges.sort_by(|a, b| {
        b.score
            .partial_cmp(&a.score)
            .unwrap_or(Ordering::Equal)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    merges.into_iter().map(|m| (pieces[m.left as usize].clone(), pieces[m.right as usize].clone())).collect()
}
