//! Gemma 4's MTP assistant (`Gemma4AssistantForCausalLM`, spec §6): a small drafter whose
//! query-only layers attend the target's KV cache, loaded for one target and driven by
//! [`draft::draft`].
//!
//! - [`config`]: `config.json`, and the checks that an assistant fits its target;
//! - [`weights`]: checkpoint tensors (bf16/f32, or 4-bit with `--quant`);
//! - [`draft`]: one draft round of k steps, dense or centroid head.

pub mod config;
pub mod draft;
pub mod weights;

use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::plan::{LayerPlan, ModelPlan};
use crate::quant::load::QuantMode;
use crate::{bail, Error, Result};
use config::{load_assistant_config, AssistantConfig};
use std::path::Path;
use weights::{load_assistant_weights, AssistantWeights};

pub use draft::{draft, draft_with, scatter_centroid_logits, TargetKv};

/// An assistant loaded for one target: which target layers it reads, its weights.
pub struct AssistantModel {
    pub config: AssistantConfig,
    pub plan: AssistantPlan,
    pub weights: AssistantWeights,
}

/// The assistant's layers as numbers. `layers[i].kv_source` is the **target** layer whose cache
/// assistant layer `i` attends (the last target layer of its attention type that owns a cache).
#[derive(Clone, Debug)]
pub struct AssistantPlan {
    pub hidden: usize,
    pub backbone_hidden: usize,
    pub vocab_size: usize,
    pub layers: Vec<LayerPlan>,
    pub eps: f32,
    pub attn_scale: f32,
    pub query: DraftQuery,
}

/// Where the drafter's query sits in a round that starts with the target's token at position
/// `p`, and which committed keys it sees (spec §6.5). Implementations differ by one position;
/// the choice changes acceptance, never the output of greedy speculative decoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftQuery {
    /// transformers' convention (the default): the query at `p`; full-attention layers see keys
    /// `0 .. p−1`, sliding layers the W+1 newest, `p−W−1 .. p−1`.
    #[default]
    AtToken,
    /// vLLM's and SGLang's: the query at `p − 1`, the last committed position; full-attention
    /// layers see `0 .. p−1`, sliding layers the target's own window there, `p−W .. p−1`.
    AtLastCommitted,
}

impl AssistantModel {
    /// Load the assistant checkpoint in `dir` for `target`, quantizing on load with `quant` like
    /// the target. Fails with one line when the assistant does not fit the target.
    pub fn load(dir: &Path, target: &Model, quant: QuantMode) -> Result<AssistantModel> {
        let context = |e: Error| Error::msg(format!("{}: {e}", dir.display()));
        if !dir.is_dir() {
            bail!("assistant directory {} does not exist", dir.display());
        }
        let config = load_assistant_config(dir)?;
        let plan = AssistantPlan::new(&config, &target.plan).map_err(context)?;
        let ck = Checkpoint::open(dir)?;
        let weights = load_assistant_weights(&ck, &config, &plan.layers, quant)?;
        Ok(AssistantModel { config, plan, weights })
    }
}

impl AssistantPlan {
    pub fn new(config: &AssistantConfig, target: &ModelPlan) -> Result<AssistantPlan> {
        let donors = config.donors(target)?;
        // The assistant's own layer plan (head dims, RoPE, MLP width), then the cache each reads.
        let own = ModelPlan::new(&config.text)?;
        let layers = own.layers.into_iter().zip(donors).map(|(l, donor)| LayerPlan { kv_source: donor, ..l }).collect();
        Ok(AssistantPlan {
            hidden: own.hidden,
            backbone_hidden: config.backbone_hidden_size,
            vocab_size: own.vocab_size,
            layers,
            eps: own.eps,
            attn_scale: own.attn_scale,
            query: DraftQuery::default(),
        })
    }
}
