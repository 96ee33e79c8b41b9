//! Assistant checkpoint tensors → [`AssistantWeights`] (spec §6.2).
//!
//! The decoder (`model.*`) loads through the target's own per-layer loader as query-only layers;
//! the projections and the centroid head are top-level tensors. `--quant` applies as it does to a
//! target: the layers' projections and the embedding (the LM head) are quantized, the
//! pre/post projections and the centroids stay in their stored dtype.

use super::config::{AssistantConfig, HeadKind};
use crate::checkpoint::{Checkpoint, DType};
use crate::plan::LayerPlan;
use crate::quant::load::{text_prefix, with_tensor_source, QuantMode};
use crate::weights::{load_layer, LayerWeights, Matrix};
use crate::{bail, Result};

pub struct AssistantWeights {
    /// `[2·backbone, hidden]`: concat(target embedding, target hidden) → assistant width.
    pub pre_projection: Matrix,
    /// `[backbone, hidden]`: the normed output → next step's stand-in for the target hidden.
    pub post_projection: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]` LM head: `lm_head.weight` when untied, else `model.embed_tokens.weight`.
    pub head: Matrix,
    pub centroids: Option<CentroidHead>,
}

/// `masked_embedding`: centroid scores and, centroid by centroid, the token ids each one owns.
pub struct CentroidHead {
    /// `[num_centroids, hidden]`.
    pub centroids: Matrix,
    /// `token_ordering`, `[num_centroids · tokens_per_centroid]` vocabulary ids.
    pub ordering: Vec<u32>,
    pub top_k: usize,
}

impl CentroidHead {
    pub fn tokens_per_centroid(&self) -> usize {
        self.ordering.len() / self.centroids.rows()
    }
    /// The tokens centroid `c` owns.
    pub fn members(&self, c: usize) -> &[u32] {
        let n = self.tokens_per_centroid();
        &self.ordering[c * n..(c + 1) * n]
    }
}

pub fn load_assistant_weights(
    ck: &Checkpoint,
    cfg: &AssistantConfig,
    layers: &[LayerPlan],
    quant: QuantMode,
) -> Result<AssistantWeights> {
    let c = &cfg.text;
    let (h, hb) = (c.hidden_size, cfg.backbone_hidden_size);
    let (layer_weights, final_norm, head) = with_tensor_source(ck, c, &text_prefix(ck, c), quant, |src| {
        let layers = layers.iter().map(|lp| load_layer(src, c, lp, false)).collect::<Result<Vec<_>>>()?;
        let head = if c.tie_word_embeddings { "embed_tokens.weight" } else { "lm_head.weight" };
        Ok((layers, src.vector("norm.weight", h)?, src.matrix(head, c.vocab_size, h)?))
    })?;
    with_tensor_source(ck, c, "", quant, |top| {
        let centroids = match cfg.head {
            HeadKind::Dense => None,
            HeadKind::Centroids { num_centroids, top_k } => Some(CentroidHead {
                centroids: top.matrix("masked_embedding.centroids.weight", num_centroids, h)?,
                ordering: token_ordering(ck, c.vocab_size)?,
                top_k,
            }),
        };
        Ok(AssistantWeights {
            pre_projection: top.matrix("pre_projection.weight", h, 2 * hb)?,
            post_projection: top.matrix("post_projection.weight", hb, h)?,
            layers: layer_weights,
            final_norm,
            head,
            centroids,
        })
    })
}

/// `masked_embedding.token_ordering`: `vocab` integer ids, each below `vocab`.
fn token_ordering(ck: &Checkpoint, vocab: usize) -> Result<Vec<u32>> {
    let name = "masked_embedding.token_ordering";
    let t = ck.require(name, &[vocab])?;
    let ids: Vec<i64> = match t.dtype {
        DType::I64 => t.data.bytes().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect(),
        DType::I32 => {
            t.data.bytes().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64).collect()
        }
        other => bail!("tensor `{name}` has dtype {}, expected I64 token ids", other.name()),
    };
    ids.iter()
        .map(|&id| match u32::try_from(id) {
            Ok(v) if (v as usize) < vocab => Ok(v),
            _ => bail!("tensor `{name}` holds token id {id}, outside the vocabulary of {vocab}"),
        })
        .collect()
}
