//! Gemma 4's MTP assistant on the device (spec §6): its weights ([`CudaAssistant`], uploaded once
//! beside the target) and one draft round ([`CudaSeq::draft`]). A round is the CPU reference's
//! (`megagemma_model::assistant::draft`) run as the target's stage kernels — matvecs, norms,
//! `qkv_norm_rope`, the attention kernel over the target's committed K/V — plus the centroid head
//! of `kernels/draft.cu`. It runs on the device from the bonus token to the k-th draft, each draft
//! feeding the next step's embedding there; only the k ids come back. `gpu_check drafts` compares
//! rounds with the CPU backend's, and the speculative runs of `gpu_check drafts` and the GPU
//! session print greedy's ids.

use crate::device::{Arg, DevBuf, DevMat};
use crate::model::CudaModel;
use crate::seq::{
    f32s, gather_blocks, AttColumnDesc, AttIo, AttentionNorms, CudaSeq, Gate, KvView, ARGMAX_SPLIT, ATT_MAX_SPLITS,
    GATHER_THREADS,
};
use crate::synthetic::{random_layer, SYNTHETIC_GROUP};
use crate::weights::{place_in_arena, place_layer, DevLayer, Placer};
use megagemma_model::assistant::config::{AssistantConfig, HeadKind};
use megagemma_model::assistant::{scatter_centroid_logits, AssistantModel, AssistantPlan, DraftQuery};
use megagemma_model::config::AttnKind;
use megagemma_model::plan::LayerPlan;
use megagemma_model::{bail, Error, Result};
use std::sync::Arc;

/// Most drafts one round makes.
pub const MAX_DRAFT: usize = 16;
/// Most centroids the centroid head may have (`MAX_CENTROIDS` in kernels/draft.cu).
const MAX_CENTROIDS: usize = 4096;

/// The centroid head's centroids and token ordering (the head's rows are `DevAssistant::head`,
/// row-major: only the chosen members' rows are read).
struct DevCentroids {
    centroids: DevMat,
    ordering: u64,
    top_k: usize,
    per: usize,
}

struct DevAssistant {
    pre_projection: DevMat,
    post_projection: DevMat,
    /// Query-only layers: no K/V projections, PLE or MoE.
    layers: Vec<DevLayer>,
    final_norm: u64,
    head: DevMat,
    centroids: Option<DevCentroids>,
}

/// The drafter's activations: one round at a time (the backend drafts for one sequence a call).
struct DraftScratch {
    /// concat(target's scaled embedding, backbone hidden) `[2·backbone]`.
    z: DevBuf,
    x: DevBuf,
    a: DevBuf,
    q: DevBuf,
    att: DevBuf,
    o: DevBuf,
    g: DevBuf,
    u: DevBuf,
    f: DevBuf,
    /// The final-normed output of a step, and its post-projection (the next step's hidden).
    hn: DevBuf,
    next: DevBuf,
    /// Head logits: the vocabulary (dense head) or the centroids'.
    logits: DevBuf,
    /// The centroid head's candidate token ids and their logits.
    cand: DevBuf,
    scores: DevBuf,
    partial: DevBuf,
    /// A round's inputs, uploaded in one copy ([`RoundInputs`]): each step's input token (the
    /// first given, the others written by the step before), the query position, and per layer
    /// the attention's one column (the donor layer's cache).
    round: DevBuf,
    att_o: DevBuf,
    att_ml: DevBuf,
    att_counters: DevBuf,
}

/// Where a round's inputs sit in `DraftScratch::round`: `[token, draft 1, …]` as u32
/// (MAX_DRAFT + 1), the query position as i32, then 8-aligned one `AttColumnDesc` per layer.
struct RoundInputs;

// `encode` writes a column as its four pointers and two ints, with no padding.
const _: () = assert!(std::mem::size_of::<AttColumnDesc>() == 40);

impl RoundInputs {
    const IDS: usize = 0;
    const POS: usize = 4 * (MAX_DRAFT + 1);
    const COLS: usize = (Self::POS + 4).next_multiple_of(8);

    fn bytes(layers: usize) -> usize {
        Self::COLS + layers * std::mem::size_of::<AttColumnDesc>()
    }

    /// The bytes of a round from `token` at query position `pos` over `cols`.
    fn encode(token: u32, pos: usize, cols: &[AttColumnDesc]) -> Vec<u8> {
        let mut b = vec![0u8; Self::bytes(cols.len())];
        b[Self::IDS..Self::IDS + 4].copy_from_slice(&token.to_le_bytes());
        b[Self::POS..Self::POS + 4].copy_from_slice(&(pos as i32).to_le_bytes());
        for (i, c) in cols.iter().enumerate() {
            let at = Self::COLS + i * std::mem::size_of::<AttColumnDesc>();
            let fields = [c.kc, c.vc, c.ks, c.vs];
            for (j, f) in fields.iter().enumerate() {
                b[at + 8 * j..at + 8 * j + 8].copy_from_slice(&f.to_le_bytes());
            }
            b[at + 32..at + 36].copy_from_slice(&c.pos.to_le_bytes());
            b[at + 36..at + 40].copy_from_slice(&c.ring.to_le_bytes());
        }
        b
    }
}

/// An MTP assistant on the device of the target it was loaded for.
pub struct CudaAssistant {
    model: Arc<CudaModel>,
    plan: AssistantPlan,
    w: DevAssistant,
    _arena: DevBuf,
    s: DraftScratch,
}

impl CudaAssistant {
    /// Uploads `a` (loaded for `model`'s checkpoint) beside it. Fails with one line when the
    /// assistant does not fit the target or the kernels.
    pub fn load(model: &Arc<CudaModel>, a: &AssistantModel) -> Result<CudaAssistant> {
        let (plan, target) = (&a.plan, &model.plan);
        if plan.backbone_hidden != target.hidden || plan.vocab_size != target.vocab_size {
            bail!("the assistant was loaded for a different target (hidden size or vocabulary differ)");
        }
        for lp in &plan.layers {
            let donor = &target.layers[lp.kv_source];
            if donor.is_kv_shared() || donor.kv_width() != lp.kv_width() {
                bail!("the assistant was loaded for a different target (KV of layer {} differs)", lp.kv_source);
            }
        }
        if let Some(c) = &a.weights.centroids {
            if c.centroids.rows() > MAX_CENTROIDS {
                bail!(
                    "the assistant has {} centroids: the CUDA drafter takes at most {MAX_CENTROIDS}",
                    c.centroids.rows()
                );
            }
        }
        let (w, arena) = place_in_arena(&model.gpu, |p| place_assistant(p, a))?;
        CudaAssistant::new(model, plan.clone(), w, arena)
    }

    /// An assistant of the published E2B / E4B assistants' shapes (spec §6.1: four query-only
    /// layers of width 256 reading the target's last sliding and full cache layers, MLP 2048, the
    /// centroid head with 2048 centroids and the top 32) with random 4-bit weights, for a synthetic
    /// Gemma 4 target: what `bench --synthetic e4b --draft mtp` drafts with. Its drafts are never
    /// accepted; it measures what a round costs.
    pub fn synthetic(model: &Arc<CudaModel>) -> Result<CudaAssistant> {
        let t = &model.plan;
        let donor = |kind| t.cache_layers().filter(|l| l.kind == kind).last();
        let (Some(sliding), Some(full)) = (donor(AttnKind::Sliding), donor(AttnKind::Full)) else {
            bail!("a synthetic assistant needs a target with sliding and full-attention cache layers");
        };
        if sliding.num_kv_heads != full.num_kv_heads || sliding.window.is_none() {
            bail!("a synthetic assistant needs the same KV heads on the target's sliding and full layers (E2B, E4B)");
        }
        let centroids = 2048.min(t.vocab_size);
        let config = serde_json::json!({
            "architectures": ["Gemma4AssistantForCausalLM"], "backbone_hidden_size": t.hidden,
            "use_ordered_embeddings": true, "num_centroids": centroids, "centroid_intermediate_top_k": 32.min(centroids),
            "tie_word_embeddings": true,
            "text_config": {"model_type": "gemma4_text", "vocab_size": t.vocab_size, "hidden_size": 256,
                            "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 4,
                            "num_key_value_heads": full.num_kv_heads, "head_dim": sliding.head_dim,
                            "global_head_dim": full.head_dim, "num_kv_shared_layers": 4,
                            "sliding_window": sliding.window, "hidden_size_per_layer_input": 0,
                            "vocab_size_per_layer_input": 0, "final_logit_softcapping": null,
                            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                            "full_attention"]}});
        let config = AssistantConfig::from_json(&config)?;
        let plan = AssistantPlan::new(&config, t)?;
        let HeadKind::Centroids { num_centroids, top_k } = config.head else {
            bail!("the synthetic assistant has a centroid head")
        };
        let (w, arena) = place_in_arena(&model.gpu, |p| place_random_assistant(p, &plan, num_centroids, top_k))?;
        CudaAssistant::new(model, plan, w, arena)
    }

    /// The assistant `w` (uploaded into `arena`) with its drafting scratch.
    fn new(model: &Arc<CudaModel>, plan: AssistantPlan, w: DevAssistant, arena: DevBuf) -> Result<CudaAssistant> {
        let gpu = &model.gpu;
        let (h, hb) = (plan.hidden, plan.backbone_hidden);
        let max_q = plan.layers.iter().map(LayerPlan::q_width).max().unwrap_or(0);
        let max_hd = plan.layers.iter().map(|l| l.head_dim).max().unwrap_or(0);
        let heads = plan.layers.iter().map(|l| l.num_heads).max().unwrap_or(0);
        let inter = plan.layers.iter().map(|l| l.mlp_width).max().unwrap_or(0);
        let (logits, cand) = match &w.centroids {
            Some(c) => (c.centroids.rows as usize, c.top_k * c.per),
            None => (plan.vocab_size, 1),
        };
        let buf = |floats: usize| gpu.alloc_zeros(f32s(floats.max(1)));
        let s = DraftScratch {
            z: buf(2 * hb)?,
            x: buf(h)?,
            a: buf(h)?,
            q: buf(max_q)?,
            att: buf(max_q)?,
            o: buf(h)?,
            g: buf(inter)?,
            u: buf(inter)?,
            f: buf(h)?,
            hn: buf(h)?,
            next: buf(hb)?,
            logits: buf(logits)?,
            cand: buf(cand)?,
            scores: buf(cand)?,
            partial: buf(2 * ARGMAX_SPLIT)?,
            round: gpu.alloc_zeros(RoundInputs::bytes(plan.layers.len()))?,
            att_o: buf(heads * ATT_MAX_SPLITS * max_hd)?,
            att_ml: buf(2 * heads * ATT_MAX_SPLITS)?,
            att_counters: buf(heads)?,
        };
        Ok(CudaAssistant { model: model.clone(), plan, w, _arena: arena, s })
    }
}

/// Every assistant tensor: the matvecs' matrices in their layout; the centroid head's rows
/// row-major (only the chosen members' rows are read), a dense head in the matvec layout.
fn place_assistant(p: &mut Placer, a: &AssistantModel) -> Result<DevAssistant> {
    let w = &a.weights;
    let layers = a.plan.layers.iter().zip(&w.layers).map(|(lp, lw)| place_layer(p, lp, lw)).collect::<Result<_>>()?;
    let centroids = match &w.centroids {
        Some(c) => Some(DevCentroids {
            centroids: p.mat(c.centroids.as_ref())?,
            ordering: p.ids(&c.ordering)?,
            top_k: c.top_k,
            per: c.tokens_per_centroid(),
        }),
        None => None,
    };
    let head = if centroids.is_some() { p.mat_rows(w.head.as_ref())? } else { p.mat(w.head.as_ref())? };
    Ok(DevAssistant {
        pre_projection: p.mat(w.pre_projection.as_ref())?,
        post_projection: p.mat(w.post_projection.as_ref())?,
        layers,
        final_norm: p.vec(&w.final_norm)?,
        head,
        centroids,
    })
}

/// Random 4-bit weights of `plan`'s shapes (groups of 64, as the synthetic targets'), unit norms,
/// and a token ordering that spreads the vocabulary over `centroids` centroids.
fn place_random_assistant(
    p: &mut Placer,
    plan: &AssistantPlan,
    centroids: usize,
    top_k: usize,
) -> Result<DevAssistant> {
    let (h, hb, v, g) = (plan.hidden, plan.backbone_hidden, plan.vocab_size, SYNTHETIC_GROUP);
    let layers = plan.layers.iter().map(|lp| random_layer(p, h, 0, lp, false)).collect::<Result<_>>()?;
    // An odd stride is a permutation of a power-of-two vocabulary; any other vocabulary in order.
    let stride = if v.is_power_of_two() { 7919 } else { 1 };
    let ordering: Vec<u32> = (0..v).map(|i| ((i * stride) % v) as u32).collect();
    Ok(DevAssistant {
        pre_projection: p.q4_random(h, 2 * hb, g, true)?,
        post_projection: p.q4_random(hb, h, g, true)?,
        layers,
        final_norm: p.vec_const(h, 1.0)?,
        head: p.q4_random(v, h, g, false)?,
        centroids: Some(DevCentroids {
            centroids: p.q4_random(centroids, h, g, true)?,
            ordering: p.ids(&ordering)?,
            top_k,
            per: v / centroids,
        }),
    })
}

/// The oldest key a draft query attends, as a window ending at the last committed position: the
/// W+1 newest keys of a sliding layer for a query at the token's position, the W newest for one at
/// the last committed position (`first_key` in the CPU reference); 0 = every committed key.
fn draft_window(plan: &AssistantPlan, lp: &LayerPlan) -> usize {
    lp.window.map_or(0, |w| match plan.query {
        DraftQuery::AtToken => w + 1,
        DraftQuery::AtLastCommitted => w,
    })
}

impl CudaSeq {
    /// `k` greedy drafts of `asst` after `token`, the target's prediction from this sequence's
    /// newest committed position (spec §6.5): step 1 reads the token's scaled embedding and the
    /// sequence's kept hidden state, step j > 1 the previous draft and the post-projection of the
    /// previous output; every step queries the target's committed K/V at one fixed position. With
    /// `logits`, each step's vocabulary-sized logits too (the centroid head's unselected tokens get
    /// the smallest selected logit minus 1, as the reference fills them).
    pub fn draft(
        &mut self,
        asst: &CudaAssistant,
        token: u32,
        k: usize,
        logits: bool,
    ) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
        let (plan, ap) = (&self.model.plan, &asst.plan);
        if !Arc::ptr_eq(&asst.model, &self.model) {
            bail!("the assistant was loaded for another model");
        }
        if !(1..=MAX_DRAFT).contains(&k) {
            bail!("{k} drafts in one round: the CUDA drafter makes 1 to {MAX_DRAFT}");
        }
        if !self.has_hidden {
            return Err(Error::invalid_input(
                "this sequence has no hidden state to draft from: run a pass after creating or truncating it",
            ));
        }
        if token as usize >= plan.vocab_size {
            return Err(Error::invalid_input(format!(
                "draft: token id {token} is out of range (vocab_size is {})",
                plan.vocab_size
            )));
        }
        let p = self.len();
        if p == 0 {
            bail!("draft at position 0: the target has no committed key to attend (prefill first)");
        }
        // Each layer's one attention column: the donor's committed keys up to p − 1, the newest
        // (p − 1) read as the column's own row, the rest from the cache as committed rows.
        let mut cols = Vec::with_capacity(ap.layers.len());
        for lp in &ap.layers {
            let Some(c) = self.cache(lp.kv_source) else { bail!("target layer {} has no KV cache", lp.kv_source) };
            let window = draft_window(ap, lp);
            if window > 0 && c.ring > 0 && window.min(p) > c.ring {
                bail!(
                    "draft at position {p}: target layer {} keeps {} keys, the drafter reads {window}",
                    lp.kv_source,
                    c.ring
                );
            }
            let slot = if c.ring > 0 { (p - 1) % c.ring } else { p - 1 };
            let row = f32s(slot * c.width) as u64;
            cols.push(AttColumnDesc {
                kc: c.k.ptr,
                vc: c.v.ptr,
                ks: c.k.ptr + row,
                vs: c.v.ptr + row,
                pos: (p - 1) as i32,
                ring: c.ring as i32,
            });
        }
        let q_pos = match ap.query {
            DraftQuery::AtToken => p,
            DraftQuery::AtLastCommitted => p - 1,
        };
        let gpu = &self.model.gpu;
        let s = &asst.s;
        gpu.upload(s.round.ptr, &RoundInputs::encode(token, q_pos, &cols))?;
        let mut all_logits = Vec::new();
        if logits {
            // Each step's logits come back before the next step: launched kernel by kernel.
            for j in 0..k {
                self.draft_step(asst, j)?;
                all_logits.push(self.draft_logits(asst)?);
                if j + 1 < k {
                    self.matvec(&asst.w.post_projection, s.hn.ptr, s.next.ptr, 1)?;
                }
            }
        } else if self.uses_graphs() {
            // A greedy round is one CUDA graph per (assistant, k), replayed on this round's inputs.
            let key = (s.round.ptr, k);
            let i = match self.draft_graphs.iter().position(|(kk, _)| *kk == key) {
                Some(i) => i,
                None => {
                    let g = self.capture(|| self.draft_round(asst, k))?;
                    self.draft_graphs.push((key, g));
                    self.draft_graphs.len() - 1
                }
            };
            self.draft_graphs[i].1.launch().map_err(|e| crate::device::cuda_err("graph launch", e))?;
        } else {
            self.draft_round(asst, k)?;
        }
        let mut ids = vec![0u32; k + 1];
        gpu.download(&mut ids, s.round.at(RoundInputs::IDS))?;
        ids.remove(0);
        if let Some((j, bad)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= ap.vocab_size) {
            bail!("draft step {j} chose token id {bad}, outside the vocabulary of {}", ap.vocab_size);
        }
        Ok((ids, all_logits))
    }

    /// A greedy round's launches: k steps, each but the last followed by its post-projection.
    fn draft_round(&self, asst: &CudaAssistant, k: usize) -> Result<()> {
        for j in 0..k {
            self.draft_step(asst, j)?;
            if j + 1 < k {
                self.matvec(&asst.w.post_projection, asst.s.hn.ptr, asst.s.next.ptr, 1)?;
            }
        }
        Ok(())
    }

    /// Draft step `j`: from input token `ids[j]` (and the kept hidden state, or the previous
    /// step's post-projection) to `hn` and the chosen token `ids[j + 1]`.
    fn draft_step(&self, asst: &CudaAssistant, j: usize) -> Result<()> {
        let (plan, ap, w, s) = (&self.model.plan, &asst.plan, &asst.w, &asst.s);
        let (h, hb) = (ap.hidden, ap.backbone_hidden);
        let gpu = self.gpu();
        let ids = |i: usize| s.round.at(RoundInputs::IDS + 4 * i);
        let args =
            [Arg::Mat(self.model.weights().embed), Arg::Ptr(ids(j)), Arg::Ptr(s.z.ptr), Arg::F32(plan.embed_scale)];
        gpu.launch("embed_gather", gather_blocks(1, plan.hidden), GATHER_THREADS, 0, &args)?;
        let g = if j == 0 { self.hidden.ptr } else { s.next.ptr };
        let z_hidden = s.z.ptr + f32s(hb) as u64;
        self.elementwise("copy", hb, &[Arg::Ptr(z_hidden), Arg::Ptr(g), Arg::U64(hb as u64)])?;
        self.matvec(&w.pre_projection, s.z.ptr, s.x.ptr, 1)?;
        // Each layer ends with its residual step and the next input norm in one `add_norm`: the
        // next layer's, and after the last the final norm, into `hn`.
        let first_norm = w.layers.first().map_or(w.final_norm, |l| l.input_norm);
        self.draft_norm(ap, if w.layers.is_empty() { s.hn.ptr } else { s.a.ptr }, s.x.ptr, first_norm, h)?;
        for (l, (lp, lw)) in ap.layers.iter().zip(&w.layers).enumerate() {
            let (next_norm, out) = match w.layers.get(l + 1) {
                Some(next) => (next.input_norm, s.a.ptr),
                None => (w.final_norm, s.hn.ptr),
            };
            self.draft_layer(asst, l, lp, lw, next_norm, out)?;
        }
        self.draft_head(asst, ids(j + 1))
    }

    /// One query-only layer (the reference's `layer`) on `s.x`, whose input norm is in `s.a`;
    /// ends with `out` = the norm of the new `s.x` by `next_norm`.
    fn draft_layer(
        &self,
        asst: &CudaAssistant,
        l: usize,
        lp: &LayerPlan,
        lw: &DevLayer,
        next_norm: u64,
        out: u64,
    ) -> Result<()> {
        let (ap, s) = (&asst.plan, &asst.s);
        self.matvec(&lw.q, s.a.ptr, s.q.ptr, 1)?;
        let args = [
            Arg::Ptr(s.q.ptr),
            Arg::Ptr(lw.q_norm),
            Arg::I32(lp.num_heads as i32),
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::I32(0),
            Arg::Ptr(0),
            Arg::I32(0),
            Arg::Ptr(lw.inv_freq),
            Arg::I32(lp.head_dim as i32),
            Arg::Ptr(s.round.at(RoundInputs::POS)),
            Arg::I32(1),
            Arg::F32(ap.eps),
        ];
        self.gpu().launch("qkv_norm_rope", lp.num_heads as u32, 256, 0, &args)?;
        let window = draft_window(ap, lp);
        let io = AttIo {
            q: s.q.ptr,
            out: s.att.ptr,
            pos: s.round.at(RoundInputs::POS),
            part_o: s.att_o.ptr,
            part_ml: s.att_ml.ptr,
            counters: s.att_counters.ptr,
            window,
            max_keys: if window > 0 { window.min(self.max_len()) } else { self.max_len() },
            scale: ap.attn_scale,
        };
        let col = s.round.at(RoundInputs::COLS + l * std::mem::size_of::<AttColumnDesc>());
        self.launch_attention(lp, KvView::default(), 1, &AttentionNorms::none(), col, &io)?;
        self.matvec(&lw.o, s.att.ptr, s.o.ptr, 1)?;
        self.draft_add_norm(asst, s.o.ptr, lw.post_attn_norm, 1.0, s.a.ptr, lw.pre_ffn_norm)?;
        self.matvec_many(&[(&lw.gate, s.g.ptr), (&lw.up, s.u.ptr)], s.a.ptr, 1)?;
        self.matvec_gated(&lw.down, s.g.ptr, Gate { ptr: s.u.ptr, stride: lw.gate.rows as usize }, s.f.ptr, 1)?;
        self.draft_add_norm(asst, s.f.ptr, lw.post_ffn_norm, lw.layer_scalar, out, next_norm)
    }

    /// RMSNorm of `x` into `y` with the assistant's epsilon: `y = x̂·w`.
    fn draft_norm(&self, ap: &AssistantPlan, y: u64, x: u64, w: u64, dim: usize) -> Result<()> {
        let args = [Arg::Ptr(y), Arg::Ptr(x), Arg::Ptr(w), Arg::I32(dim as i32), Arg::F32(ap.eps), Arg::I32(0)];
        self.gpu().launch("rms_norm", 1, 256, 0, &args)
    }

    /// The residual step on the drafter's stream `s.x` (`add_norm` in kernels/ops.cu): `x = (x +
    /// norm(o)·w1)·scale`, then `a = norm(x)·w2` — the post-norm, the residual add, the layer
    /// scalar and the next norm in one launch.
    fn draft_add_norm(&self, asst: &CudaAssistant, o: u64, w1: u64, scale: f32, a: u64, w2: u64) -> Result<()> {
        let ap = &asst.plan;
        let args = [
            Arg::Ptr(asst.s.x.ptr),
            Arg::Ptr(o),
            Arg::Ptr(w1),
            Arg::F32(scale),
            Arg::Ptr(a),
            Arg::Ptr(w2),
            Arg::I32(ap.hidden as i32),
            Arg::F32(ap.eps),
            Arg::Ptr(asst.s.x.ptr), // in place: one block
            Arg::I32(1),
        ];
        self.gpu().launch("add_norm", 1, 256, 0, &args)
    }

    /// The head's greedy token from `hn` into `out`: the argmax of the dense head's logits (no
    /// softcap), or of the chosen centroids' members (ties: the lower token id, as in the reference).
    fn draft_head(&self, asst: &CudaAssistant, out: u64) -> Result<()> {
        let (w, s) = (&asst.w, &asst.s);
        let gpu = self.gpu();
        match &w.centroids {
            None => {
                self.matvec(&w.head, s.hn.ptr, s.logits.ptr, 1)?;
                let v = w.head.rows;
                let split = ARGMAX_SPLIT as i32;
                let args =
                    [Arg::Ptr(s.logits.ptr), Arg::I32(v), Arg::F32(0.0), Arg::Ptr(s.partial.ptr), Arg::I32(split)];
                gpu.launch("softcap_argmax_partial", ARGMAX_SPLIT as u32, 256, 0, &args)?;
                gpu.launch("argmax_final", 1, 32, 0, &[Arg::Ptr(s.partial.ptr), Arg::I32(split), Arg::Ptr(out)])
            }
            Some(c) => {
                self.matvec(&c.centroids, s.hn.ptr, s.logits.ptr, 1)?;
                let n = c.top_k * c.per;
                let args = [
                    Arg::Ptr(s.logits.ptr),
                    Arg::I32(c.centroids.rows),
                    Arg::I32(c.top_k as i32),
                    Arg::Ptr(c.ordering),
                    Arg::I32(c.per as i32),
                    Arg::Ptr(s.cand.ptr),
                ];
                gpu.launch("centroid_candidates", 1, 1024, 0, &args)?;
                let args = [
                    Arg::Mat(w.head),
                    Arg::Ptr(s.cand.ptr),
                    Arg::I32(n as i32),
                    Arg::Ptr(s.hn.ptr),
                    Arg::Ptr(s.scores.ptr),
                ];
                gpu.launch("rows_dot", n.div_ceil(8) as u32, 256, 0, &args)?;
                gpu.launch(
                    "argmax_ids",
                    1,
                    256,
                    0,
                    &[Arg::Ptr(s.scores.ptr), Arg::Ptr(s.cand.ptr), Arg::I32(n as i32), Arg::Ptr(out)],
                )
            }
        }
    }

    /// The last step's vocabulary-sized logits, on the host.
    fn draft_logits(&self, asst: &CudaAssistant) -> Result<Vec<f32>> {
        let (w, s) = (&asst.w, &asst.s);
        let gpu = self.gpu();
        let v = asst.plan.vocab_size;
        match &w.centroids {
            None => {
                let mut l = vec![0f32; v];
                gpu.download(&mut l, s.logits.ptr)?;
                Ok(l)
            }
            Some(c) => {
                let n = c.top_k * c.per;
                let (mut ids, mut scores) = (vec![0u32; n], vec![0f32; n]);
                gpu.download(&mut ids, s.cand.ptr)?;
                gpu.download(&mut scores, s.scores.ptr)?;
                let mut l = vec![0f32; v];
                scatter_centroid_logits(&ids, &scores, &mut l);
                Ok(l)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's cap on centroids is the size of the kernel's sort buffer.
    #[test]
    fn centroid_limit_matches_the_kernel() {
        let define = crate::compile::kernel_define("draft.cu", "MAX_CENTROIDS");
        assert_eq!(define.parse::<usize>().expect("MAX_CENTROIDS"), MAX_CENTROIDS);
    }

    /// The round's bytes hold the token, the position and each column exactly where the kernels
    /// read them: the column as `struct AttColumn` (kernels/attention.cu) lays it out in memory.
    #[test]
    fn round_inputs_match_the_column_layout() {
        let cols: Vec<AttColumnDesc> = (0..3u64)
            .map(|i| AttColumnDesc {
                kc: 0x1000 + i,
                vc: 0x2000 + i,
                ks: 0x3000 + i,
                vs: 0x4000 + i,
                pos: 7 + i as i32,
                ring: -(i as i32),
            })
            .collect();
        let b = RoundInputs::encode(0xdead_beef, 4242, &cols);
        assert_eq!(b.len(), RoundInputs::bytes(3));
        assert_eq!(&b[RoundInputs::IDS..RoundInputs::IDS + 4], &0xdead_beef_u32.to_le_bytes());
        assert_eq!(&b[RoundInputs::POS..RoundInputs::POS + 4], &4242_i32.to_le_bytes());
        assert_eq!(RoundInputs::COLS % 8, 0);
        let size = std::mem::size_of::<AttColumnDesc>();
        for (i, c) in cols.iter().enumerate() {
            // SAFETY: AttColumnDesc is repr(C) plain data without padding (asserted above).
            let raw = unsafe { std::slice::from_raw_parts((c as *const AttColumnDesc).cast::<u8>(), size) };
            assert_eq!(&b[RoundInputs::COLS + i * size..RoundInputs::COLS + (i + 1) * size], raw);
        }
    }
}
