//! One draft round of the MTP assistant (spec §6.3–6.5), in f32 like the CPU reference.
//!
//! A round starts after the target emitted token `t` at position `p` (the target has committed
//! positions `0 .. p`, `t` itself is not in its cache yet). Step 1 reads
//! concat(target's scaled embedding of `t`, target's final-normed hidden state that produced `t`);
//! step j > 1 reads the previous draft and `post_projection` of the previous step's normed output.
//! Every step runs the query at the constant position `p` against the target's K/V as committed:
//! full-attention layers see keys `0 .. p−1`, sliding layers the W+1 newest, `p−W−1 .. p−1`
//! (what transformers' bidirectional sliding mask admits, spec §6.5). [`DraftQuery`] selects
//! vLLM's convention instead (query at `p − 1`, the W newest sliding keys).

use super::weights::CentroidHead;
use super::{AssistantModel, AssistantPlan, DraftQuery};
use crate::cpu::kv::KvCache;
use crate::cpu::ops::{argmax, gelu_mul, rms_norm, rms_norm_chunks, rope, softmax};
use crate::matrix::{matmul, RowDot};
use crate::model::Model;
use crate::plan::LayerPlan;
use crate::weights::{LayerWeights, MlpWeights};
use crate::{bail, Result};
use rayon::prelude::*;

/// The target's committed K/V rows, by target layer (one that owns a cache) and position.
pub trait TargetKv: Sync {
    /// Committed positions `0 .. committed()`.
    fn committed(&self) -> usize;
    /// Whether `layer` still holds every committed position from `first` on (a sliding ring
    /// may have overwritten older ones).
    fn holds(&self, layer: usize, first: usize) -> bool;
    fn key(&self, layer: usize, pos: usize) -> &[f32];
    fn value(&self, layer: usize, pos: usize) -> &[f32];
}

impl TargetKv for KvCache {
    fn committed(&self) -> usize {
        self.len()
    }
    fn holds(&self, layer: usize, first: usize) -> bool {
        // Rows fill a ring from slot 0, so it holds the last `resident_rows` positions.
        self.layer(layer).resident_rows() >= self.len().saturating_sub(first)
    }
    fn key(&self, layer: usize, pos: usize) -> &[f32] {
        self.layer(layer).key(pos)
    }
    fn value(&self, layer: usize, pos: usize) -> &[f32] {
        self.layer(layer).value(pos)
    }
}

/// `k` greedy drafts after token `token` at position `p`; `hidden` is the target's final-normed
/// hidden state at `p − 1` (the one whose logits chose `token`). The centroid head scores only
/// its selected tokens: no vocabulary-sized vector is built.
pub fn draft(
    asst: &AssistantModel,
    target: &Model,
    kv: &impl TargetKv,
    p: usize,
    token: u32,
    hidden: &[f32],
    k: usize,
) -> Result<Vec<u32>> {
    // On a pool thread, as the target's passes (cpu::forward::forward_batch): its products
    // then fork from a worker instead of each waiting on a hand-off from outside the pool.
    rayon::scope(|_| run(asst, target, kv, p, token, hidden, k, |hn| greedy_token(asst, hn)))
}

/// [`draft`] where `pick` chooses each draft from the drafter's vocabulary-sized logits (for
/// speculative sampling: apply the sampling transforms, sample, keep the probabilities). The
/// logits are transformers' (no softcap); with the centroid head, unselected tokens get the
/// smallest selected logit minus 1, as transformers fills them.
#[allow(clippy::too_many_arguments)]
pub fn draft_with(
    asst: &AssistantModel,
    target: &Model,
    kv: &impl TargetKv,
    p: usize,
    token: u32,
    hidden: &[f32],
    k: usize,
    mut pick: impl FnMut(&[f32]) -> u32,
) -> Result<Vec<u32>> {
    let mut logits = vec![0f32; asst.plan.vocab_size];
    run(asst, target, kv, p, token, hidden, k, |hn| {
        full_logits(asst, hn, &mut logits);
        pick(&logits)
    })
}

#[allow(clippy::too_many_arguments)]
fn run(
    asst: &AssistantModel,
    target: &Model,
    kv: &impl TargetKv,
    p: usize,
    token: u32,
    hidden: &[f32],
    k: usize,
    mut choose: impl FnMut(&[f32]) -> u32,
) -> Result<Vec<u32>> {
    check_inputs(&asst.plan, target, kv, p, token, hidden)?;
    let w = &asst.weights;
    let (mut tok, mut g) = (token, hidden.to_vec());
    let mut drafts = Vec::with_capacity(k);
    for j in 0..k {
        let hn = step(asst, target, kv, p, tok, &g);
        tok = choose(&hn);
        if tok as usize >= asst.plan.vocab_size {
            bail!("draft step {j} chose token id {tok}, outside the vocabulary of {}", asst.plan.vocab_size);
        }
        drafts.push(tok);
        if j + 1 < k {
            g = linear(w.post_projection.as_ref(), &hn);
        }
    }
    Ok(drafts)
}

fn check_inputs(
    plan: &AssistantPlan,
    target: &Model,
    kv: &impl TargetKv,
    p: usize,
    token: u32,
    hidden: &[f32],
) -> Result<()> {
    if target.plan.hidden != plan.backbone_hidden || target.plan.vocab_size != plan.vocab_size {
        bail!("the assistant was loaded for a different target (hidden size or vocabulary differ)");
    }
    if hidden.len() != plan.backbone_hidden {
        bail!("draft: the target hidden state has {} values, expected {}", hidden.len(), plan.backbone_hidden);
    }
    if token as usize >= plan.vocab_size {
        bail!("draft: token id {token} is out of range (vocab_size is {})", plan.vocab_size);
    }
    if p == 0 {
        bail!("draft at position 0: the target has no committed key to attend (prefill first)");
    }
    if kv.committed() != p {
        bail!(
            "draft at position {p}: the target's cache has {} committed positions; drafting reads exactly the {p} \
             before the token",
            kv.committed()
        );
    }
    for lp in &plan.layers {
        let first = first_key(plan, lp, p);
        if !kv.holds(lp.kv_source, first) {
            bail!(
                "draft at position {p}: target layer {} no longer holds position {first}; the drafter reads the {} \
                 newest committed keys of a sliding layer",
                lp.kv_source,
                match plan.query {
                    DraftQuery::AtToken => "W+1",
                    DraftQuery::AtLastCommitted => "W",
                }
            );
        }
        if kv.key(lp.kv_source, p - 1).len() != lp.kv_width() {
            bail!("the assistant was loaded for a different target (KV width of layer {} differs)", lp.kv_source);
        }
    }
    Ok(())
}

/// The position of the draft query in a round whose token sits at `p`.
fn query_position(plan: &AssistantPlan, p: usize) -> usize {
    match plan.query {
        DraftQuery::AtToken => p,
        DraftQuery::AtLastCommitted => p - 1,
    }
}

/// The oldest key a draft query attends (the newest is always `p − 1`): 0 on full layers; on
/// sliding layers the W+1 newest for a query at `p`, the W newest for one at `p − 1`.
fn first_key(plan: &AssistantPlan, lp: &LayerPlan, p: usize) -> usize {
    let newest = |w: usize| match plan.query {
        DraftQuery::AtToken => w + 1,
        DraftQuery::AtLastCommitted => w,
    };
    lp.window.map_or(0, |w| p.saturating_sub(newest(w)))
}

fn linear(w: &dyn RowDot, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; w.rows()];
    matmul(w, x, &mut y);
    y
}

/// One assistant forward: returns the final-normed output `hN` (spec §6.3).
fn step(asst: &AssistantModel, target: &Model, kv: &impl TargetKv, p: usize, token: u32, g: &[f32]) -> Vec<f32> {
    let (plan, w) = (&asst.plan, &asst.weights);
    let hb = plan.backbone_hidden;
    // concat(target's scaled embedding, backbone hidden): embedding first.
    let mut z = vec![0f32; 2 * hb];
    target.weights.embed.row_to_f32(token as usize, &mut z[..hb]);
    z[..hb].iter_mut().for_each(|v| *v *= target.plan.embed_scale);
    z[hb..].copy_from_slice(g);
    let mut x = linear(w.pre_projection.as_ref(), &z);
    for (lp, lw) in plan.layers.iter().zip(&w.layers) {
        layer(plan, lp, lw, kv, p, &mut x);
    }
    rms_norm(&mut x, Some(&w.final_norm), plan.eps);
    x
}

/// A Gemma 4 decoder layer without PLE or MoE whose query attends the target's cache.
fn layer(plan: &AssistantPlan, lp: &LayerPlan, lw: &LayerWeights, kv: &impl TargetKv, p: usize, x: &mut [f32]) {
    let (hd, eps) = (lp.head_dim, plan.eps);
    let mut a = x.to_vec();
    rms_norm(&mut a, Some(&lw.input_norm), eps);
    let mut q = linear(lw.attn.q.as_ref(), &a);
    rms_norm_chunks(&mut q, hd, Some(&lw.attn.q_norm), eps);
    let q_pos = query_position(plan, p);
    q.chunks_exact_mut(hd).for_each(|head| rope(head, q_pos, &lp.inv_freq));

    let o = attention(plan, lp, kv, &q, p);
    let mut o = linear(lw.attn.o.as_ref(), &o);
    rms_norm(&mut o, Some(&lw.post_attn_norm), eps);
    x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

    let mut f_in = x.to_vec();
    rms_norm(&mut f_in, Some(&lw.pre_ffn_norm), eps);
    let mut f = mlp(&lw.mlp, &f_in);
    rms_norm(&mut f, Some(&lw.post_ffn_norm), eps);
    x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);

    if lw.layer_scalar != 1.0 {
        x.iter_mut().for_each(|v| *v *= lw.layer_scalar);
    }
}

/// Each query head over its KV head's keys `first_key(p) .. p` of the donor layer, in
/// chronological order, with the arithmetic of the target's attention.
fn attention(plan: &AssistantPlan, lp: &LayerPlan, kv: &impl TargetKv, q: &[f32], p: usize) -> Vec<f32> {
    let hd = lp.head_dim;
    let group = lp.num_heads / lp.num_kv_heads;
    let keys = first_key(plan, lp, p)..p;
    let mut out = vec![0f32; lp.q_width()];
    out.par_chunks_mut(hd).enumerate().for_each(|(head, o)| {
        let kvh = head / group;
        let qv = &q[head * hd..(head + 1) * hd];
        let cols = kvh * hd..(kvh + 1) * hd;
        let mut scores: Vec<f32> = keys
            .clone()
            .map(|j| crate::simd::dot_f32(qv, &kv.key(lp.kv_source, j)[cols.clone()]) * plan.attn_scale)
            .collect();
        softmax(&mut scores);
        o.fill(0.0);
        for (j, s) in keys.clone().zip(&scores) {
            for (ov, vv) in o.iter_mut().zip(&kv.value(lp.kv_source, j)[cols.clone()]) {
                *ov += s * vv;
            }
        }
    });
    out
}

/// Gated GELU MLP: `down(gelu(gate(x)) · up(x))`.
fn mlp(m: &MlpWeights, x: &[f32]) -> Vec<f32> {
    let mut g = linear(m.gate.as_ref(), x);
    let u = linear(m.up.as_ref(), x);
    gelu_mul(&mut g, &u);
    linear(m.down.as_ref(), &g)
}

/// The head's argmax; ties go to the lowest token id, as an argmax over full logits gives.
fn greedy_token(asst: &AssistantModel, hn: &[f32]) -> u32 {
    match &asst.weights.centroids {
        None => argmax(&linear(asst.weights.head.as_ref(), hn)),
        Some(c) => {
            let (ids, scores) = centroid_scores(asst, c, hn);
            let mut best = 0;
            for i in 1..ids.len() {
                if scores[i] > scores[best] || (scores[i] == scores[best] && ids[i] < ids[best]) {
                    best = i;
                }
            }
            ids[best]
        }
    }
}

/// Vocabulary-sized logits of the head, as transformers builds them.
fn full_logits(asst: &AssistantModel, hn: &[f32], out: &mut [f32]) {
    match &asst.weights.centroids {
        None => matmul(asst.weights.head.as_ref(), hn, out),
        Some(c) => {
            let (ids, scores) = centroid_scores(asst, c, hn);
            scatter_centroid_logits(&ids, &scores, out);
        }
    }
}

/// The centroid head's vocabulary-sized logits from its candidates' (`ids`, `scores`): every other
/// token gets the smallest candidate logit minus 1, as transformers fills them. Shared with the
/// device drafter, whose candidates come back from the GPU.
pub fn scatter_centroid_logits(ids: &[u32], scores: &[f32], out: &mut [f32]) {
    let fill = scores.iter().copied().fold(f32::INFINITY, f32::min) - 1.0;
    out.fill(fill);
    for (&id, &s) in ids.iter().zip(scores) {
        out[id as usize] = s;
    }
}

/// The centroid head (spec §6.4): the `top_k` best centroids, then the head's logits of just
/// their member tokens. Returns (token ids, logits), centroid by centroid.
fn centroid_scores(asst: &AssistantModel, c: &CentroidHead, hn: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let centroid_logits = linear(c.centroids.as_ref(), hn);
    let mut order: Vec<usize> = (0..centroid_logits.len()).collect();
    // Stable: among equal scores the lower centroid index first.
    order.sort_by(|&a, &b| centroid_logits[b].total_cmp(&centroid_logits[a]));
    let ids: Vec<u32> = order[..c.top_k].iter().flat_map(|&i| c.members(i).iter().copied()).collect();
    let mut scores = vec![0f32; ids.len()];
    let head = asst.weights.head.as_ref();
    // The input prepared once for every member row (integer kernels), not once a row.
    let prepared = head.prepare_inputs(hn);
    scores.par_iter_mut().zip(ids.par_iter()).for_each(|(s, &id)| {
        let out = std::slice::from_mut(s);
        match &prepared {
            Some(p) => head.dot_rows_prepared(id as usize, p, &mut [out]),
            None => head.dot_rows(id as usize, hn, out),
        }
    });
    (ids, scores)
}
