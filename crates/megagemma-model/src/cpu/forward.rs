//! The reference forward pass over a chunk of tokens (prefill, decode and verify are all
//! chunks: T tokens at consecutive positions after the cache's committed length).
//!
//! Step numbers in comments follow the op-by-op layer description in the project's Gemma 4
//! specification (§2 model, §3 layer). Activations are f32 `[T, width]`, row-major.

use super::kv::KvCache;
use super::ops::{gelu_mul, rms_norm, rms_norm_chunks, rope_heads, softcap, softmax, ArgmaxParts};
use crate::matrix::{matmul, matmul_then, RowDot};
use crate::plan::{LayerPlan, ModelPlan};
use crate::weights::{LayerWeights, MlpWeights, ModelWeights, MoeWeights};
use rayon::prelude::*;

/// What a chunk pass returns.
#[derive(Default)]
pub struct ChunkOut {
    /// `[n, vocab]` final logits (after softcap) of the last `n` positions of the chunk.
    pub logits: Vec<f32>,
    /// `[n, hidden]` final-normed hidden states of the same positions.
    pub hidden: Vec<f32>,
    /// `[n]` each position's `ops::argmax` of its logits, found as the head wrote them.
    pub argmax: Vec<u32>,
}

fn linear(w: &dyn RowDot, x: &[f32], t: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * w.rows()];
    matmul(w, x, &mut y);
    debug_assert_eq!(x.len(), t * w.cols());
    y
}

fn norm_rows(x: &[f32], width: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_chunks(&mut y, width, Some(w), eps);
    y
}

/// One sequence's part of a batched pass: `tokens` at positions `kv.len() ..`, their K/V rows
/// staged in `kv`; outputs are kept for the segment's last `keep` positions.
pub struct Segment<'a> {
    pub kv: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub keep: usize,
}

/// Run `tokens` at positions `kv.len() ..`, staging their K/V rows in `kv`, and return logits,
/// argmaxes and hidden states for the last `keep` positions.
pub fn forward_chunk(plan: &ModelPlan, w: &ModelWeights, kv: &mut KvCache, tokens: &[u32], keep: usize) -> ChunkOut {
    let mut out = ChunkOut::default();
    forward_batch(plan, w, &mut [Segment { kv, tokens, keep }], &mut out);
    out
}

/// One weight pass over several segments (sequences), each with its own cache and positions:
/// every product is a matmul with one column per token of every segment, and attention reads
/// each token's own cache. `out` is reused across calls (no per-step allocation of the
/// vocab-sized logits once it has grown). A column's arithmetic never depends on the others.
pub fn forward_batch(plan: &ModelPlan, w: &ModelWeights, segs: &mut [Segment<'_>], out: &mut ChunkOut) {
    // The pass runs on a pool thread, so its ~200 parallel products and loops are forked from a
    // worker (a hot hand-off) instead of each being injected from outside the pool and waited
    // for with a sleep and a wake-up.
    rayon::scope(|_| forward_batch_in_pool(plan, w, segs, out));
}

fn forward_batch_in_pool(plan: &ModelPlan, w: &ModelWeights, segs: &mut [Segment<'_>], out: &mut ChunkOut) {
    let h = plan.hidden;
    let tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    let t = tokens.len();
    let mut rows = Vec::with_capacity(segs.len());
    let mut r0 = 0;
    for s in segs.iter_mut() {
        let p0 = s.kv.len();
        s.kv.begin_stage(s.tokens.len());
        rows.push(Rows { start: r0, len: s.tokens.len(), p0 });
        r0 += s.tokens.len();
    }

    // §2.1 token embedding, scaled by sqrt(H).
    let mut x = vec![0f32; t * h];
    for (i, &tok) in tokens.iter().enumerate() {
        let row = &mut x[i * h..(i + 1) * h];
        w.embed.row_to_f32(tok as usize, row);
        row.iter_mut().for_each(|v| *v *= plan.embed_scale);
    }

    // §2.2 per-layer inputs: [T, L, P].
    let pli = w.ple.as_ref().map(|ple| per_layer_inputs(plan, ple, &x, &tokens));

    for (lp, lw) in plan.layers.iter().zip(&w.layers) {
        layer(plan, lp, lw, segs, &rows, &mut x, pli.as_deref());
    }

    // §2.4 final norm and LM head on the kept positions of every segment.
    out.hidden.clear();
    for (s, r) in segs.iter().zip(&rows) {
        let keep = s.keep.min(r.len);
        out.hidden.extend_from_slice(&x[(r.start + r.len - keep) * h..(r.start + r.len) * h]);
    }
    rms_norm_chunks(&mut out.hidden, h, Some(&w.final_norm), plan.eps);
    let head = w.lm_head.as_deref().unwrap_or(w.embed.as_ref());
    let kept = out.hidden.len() / h;
    out.logits.resize(kept * head.rows(), 0.0);
    // Each task of the head softcaps the logits it wrote and finds their best while they are in
    // cache (a verify's 4 MiB of logits are not read back for its argmaxes).
    let parts = std::sync::Mutex::new(vec![ArgmaxParts::default(); kept]);
    matmul_then(head, &out.hidden, &mut out.logits, &|start, rows| {
        for (i, row) in rows.iter_mut().enumerate() {
            if let Some(cap) = plan.final_softcap {
                row.iter_mut().for_each(|v| *v = softcap(*v, cap));
            }
            let mut p = ArgmaxParts::default();
            p.add(row, start);
            // The lock is held only for the join: the rows were scanned above.
            let mut all = parts.lock().unwrap_or_else(|e| e.into_inner());
            all[i] = all[i].join(p);
        }
    });
    out.argmax.clear();
    out.argmax.extend(parts.into_inner().unwrap_or_else(|e| e.into_inner()).iter().map(ArgmaxParts::argmax));
}

/// Where a segment's tokens sit in the batch: rows `start .. start + len`, positions `p0 ..`.
struct Rows {
    start: usize,
    len: usize,
    p0: usize,
}

fn per_layer_inputs(plan: &ModelPlan, ple: &crate::weights::PleInputWeights, x: &[f32], tokens: &[u32]) -> Vec<f32> {
    let (t, h, p) = (tokens.len(), plan.hidden, plan.ple_dim);
    let lp = plan.layers.len() * p;
    // Context component: project the scaled embedding, scale by H^-1/2, RMS-normalise per layer.
    let mut c = linear(ple.proj.as_ref(), x, t);
    let proj_scale = (h as f64).powf(-0.5) as f32;
    c.iter_mut().for_each(|v| *v *= proj_scale);
    rms_norm_chunks(&mut c, p, Some(&ple.norm), plan.eps);
    // Token-identity component: the PLE table row scaled by sqrt(P); combine and scale by 2^-1/2.
    let embed_scale = (p as f64).sqrt() as f32;
    let input_scale = std::f64::consts::FRAC_1_SQRT_2 as f32;
    let mut y = vec![0f32; lp];
    for (i, &tok) in tokens.iter().enumerate() {
        ple.embed.row_to_f32(tok as usize, &mut y);
        for (cv, yv) in c[i * lp..(i + 1) * lp].iter_mut().zip(&y) {
            *cv = (*cv + yv * embed_scale) * input_scale;
        }
    }
    c
}

#[allow(clippy::too_many_arguments)]
fn layer(
    plan: &ModelPlan,
    lp: &LayerPlan,
    lw: &LayerWeights,
    segs: &mut [Segment<'_>],
    rows: &[Rows],
    x: &mut [f32],
    pli: Option<&[f32]>,
) {
    let h = plan.hidden;
    let t = x.len() / h;
    let (hd, eps) = (lp.head_dim, plan.eps);

    // 2–5: pre-attention norm, Q projection, per-head q_norm, RoPE at each token's position.
    let a = norm_rows(x, h, &lw.input_norm, eps);
    let mut q = linear(lw.attn.q.as_ref(), &a, t);
    rms_norm_chunks(&mut q, hd, Some(&lw.attn.q_norm), eps);
    rope_rows(&mut q, lp.q_width(), hd, rows, &lp.inv_freq);

    // 6–11: this layer's own K/V (skipped on KV-shared layers), staged in each sequence's cache.
    if let (Some(wk), Some(k_norm)) = (&lw.attn.k, &lw.attn.k_norm) {
        let mut k = linear(wk.as_ref(), &a, t);
        // k_eq_v: values are the raw key projection (taken before k_norm and RoPE).
        let mut v = match &lw.attn.v {
            Some(wv) => linear(wv.as_ref(), &a, t),
            None => k.clone(),
        };
        rms_norm_chunks(&mut k, hd, Some(k_norm), eps);
        rope_rows(&mut k, lp.kv_width(), hd, rows, &lp.inv_freq);
        if plan.v_norm {
            rms_norm_chunks(&mut v, hd, None, eps);
        }
        let kw = lp.kv_width();
        for (s, r) in segs.iter_mut().zip(rows) {
            let span = r.start * kw..(r.start + r.len) * kw;
            s.kv.stage_rows(lp.index, &k[span.clone()], &v[span]);
        }
    }

    // 12–15: attention over the source layer's cache, output projection, post-attention norm.
    let qw = lp.q_width();
    let mut o = vec![0f32; t * qw];
    for (s, r) in segs.iter().zip(rows) {
        let span = r.start * qw..(r.start + r.len) * qw;
        attention(plan, lp, s.kv, &q[span.clone()], &mut o[span], r.len, r.p0);
    }
    let mut o = linear(lw.attn.o.as_ref(), &o, t);
    rms_norm_chunks(&mut o, h, Some(&lw.post_attn_norm), eps);
    x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

    // 16–19: feed-forward (dense MLP, plus the MoE branch when present).
    let f_in = norm_rows(x, h, &lw.pre_ffn_norm, eps);
    let mut f = mlp(&lw.mlp, &f_in, t);
    if let Some(moe) = &lw.moe {
        rms_norm_chunks(&mut f, h, Some(&moe.post_norm_1), eps);
        let e = moe_block(plan, moe, x, t);
        f.iter_mut().zip(&e).for_each(|(f, e)| *f += e);
    }
    rms_norm_chunks(&mut f, h, Some(&lw.post_ffn_norm), eps);
    x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);

    // 20–24: per-layer embedding injection.
    if let (Some(ple), Some(pli)) = (&lw.ple, pli) {
        let p = plan.ple_dim;
        let lpw = plan.layers.len() * p;
        let mut g = linear(ple.gate.as_ref(), x, t);
        for ti in 0..t {
            let inp = &pli[ti * lpw + lp.index * p..ti * lpw + (lp.index + 1) * p];
            gelu_mul(&mut g[ti * p..(ti + 1) * p], inp);
        }
        let mut g = linear(ple.proj.as_ref(), &g, t);
        rms_norm_chunks(&mut g, h, Some(&ple.post_norm), eps);
        x.iter_mut().zip(&g).for_each(|(x, g)| *x += g);
    }

    // 25: learned per-layer scalar on the whole residual stream.
    if lw.layer_scalar != 1.0 {
        x.iter_mut().for_each(|v| *v *= lw.layer_scalar);
    }
}

/// Scaled dot-product attention for every (token, head), keys in chronological order: the
/// committed cache (inside the window) followed by this chunk's staged rows up to the query.
/// The query heads that share a K/V head are computed together, each K/V row loaded once for all
/// of them (the same arithmetic per head, so the same bits), when there are enough (token, K/V
/// head) pairs to keep every thread busy; otherwise (a decode step) the work splits by query head.
fn attention(plan: &ModelPlan, lp: &LayerPlan, kv: &KvCache, q: &[f32], out: &mut [f32], t: usize, p0: usize) {
    let hd = lp.head_dim;
    let group = lp.num_heads / lp.num_kv_heads;
    let src = kv.layer(lp.kv_source);
    debug_assert_eq!(out.len(), t * lp.q_width());
    let heads_per_task = if t * lp.num_kv_heads >= 2 * rayon::current_num_threads() { group } else { 1 };
    out.par_chunks_mut(heads_per_task * hd).enumerate().for_each(|(idx, o)| {
        let first = idx * heads_per_task;
        let (ti, head) = (first / lp.num_heads, first % lp.num_heads);
        let pos = p0 + ti;
        let kvh = head / group;
        let lo = lp.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let key = |j: usize| -> &[f32] {
            let row = if j < p0 { src.key(j) } else { src.staged_key(j - p0) };
            &row[kvh * hd..(kvh + 1) * hd]
        };
        let value = |j: usize| -> &[f32] {
            let row = if j < p0 { src.value(j) } else { src.staged_value(j - p0) };
            &row[kvh * hd..(kvh + 1) * hd]
        };
        let qs: Vec<&[f32]> = (head..head + heads_per_task)
            .map(|h| &q[ti * lp.q_width() + h * hd..ti * lp.q_width() + (h + 1) * hd])
            .collect();
        let keys: Vec<&[f32]> = (lo..=pos).map(key).collect();
        let mut scores = vec![0f32; heads_per_task * keys.len()];
        let mut per_head: Vec<&mut [f32]> = scores.chunks_mut(keys.len()).collect();
        crate::simd::dot_f32_rows_shared(&qs, &keys, &mut per_head);
        for s in per_head.iter_mut() {
            s.iter_mut().for_each(|s| *s *= plan.attn_scale);
            softmax(s);
        }
        let ps: Vec<&[f32]> = scores.chunks(keys.len()).collect();
        let values: Vec<&[f32]> = (lo..=pos).map(value).collect();
        let mut outs: Vec<&mut [f32]> = o.chunks_mut(hd).collect();
        crate::simd::weighted_sum_shared(&ps, &values, &mut outs);
    });
}

/// RoPE on every head of every row, each row at its own position (its segment's `p0` + offset).
fn rope_rows(x: &mut [f32], width: usize, hd: usize, rows: &[Rows], inv_freq: &[f32]) {
    for r in rows {
        for (ti, row) in x[r.start * width..(r.start + r.len) * width].chunks_exact_mut(width).enumerate() {
            rope_heads(row, hd, r.p0 + ti, inv_freq);
        }
    }
}

/// Elements per parallel task of the GELU gate (vectorised: a decode step of Gemma 3 270M, 2048
/// elements, is not worth splitting).
const GELU_CHUNK: usize = 16 * 1024;

/// Gated GELU MLP: `down(gelu(gate(x)) · up(x))`.
fn mlp(m: &MlpWeights, x: &[f32], t: usize) -> Vec<f32> {
    let mut g = linear(m.gate.as_ref(), x, t);
    let u = linear(m.up.as_ref(), x, t);
    // Elementwise, so split over threads (per element the same arithmetic as a serial loop).
    g.par_chunks_mut(GELU_CHUNK).zip(u.par_chunks(GELU_CHUNK)).for_each(|(g, u)| {
        gelu_mul(g, u);
    });
    linear(m.down.as_ref(), &g, t)
}

/// The MoE branch, token by token: route the residual stream, run the top-k experts on the
/// pre-normed input, and return their weighted sum after `post_feedforward_layernorm_2`.
fn moe_block(plan: &ModelPlan, m: &MoeWeights, resid: &[f32], t: usize) -> Vec<f32> {
    let h = plan.hidden;
    let e_count = m.experts.len();
    let top_k = plan.moe_top_k.min(e_count);
    let root = (h as f64).powf(-0.5) as f32;
    let mut out = vec![0f32; t * h];
    for ti in 0..t {
        let r = &resid[ti * h..(ti + 1) * h];
        // Router: weightless RMSNorm, learned per-channel scale, H^-1/2, projection, softmax.
        let mut z = r.to_vec();
        rms_norm(&mut z, None, plan.eps);
        z.iter_mut().zip(&m.router_scale).for_each(|(z, s)| *z = *z * s * root);
        let mut probs = linear(m.router_proj.as_ref(), &z, 1);
        softmax(&mut probs);
        // Top-k by probability (stable: lower expert index first among equals).
        let mut order: Vec<usize> = (0..e_count).collect();
        order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap_or(std::cmp::Ordering::Equal));
        let chosen = &order[..top_k];
        let total: f32 = chosen.iter().map(|&e| probs[e]).sum();
        let e_in = norm_rows(r, h, &m.pre_norm_2, plan.eps);
        let acc = &mut out[ti * h..(ti + 1) * h];
        for &e in chosen {
            let weight = probs[e] / total * m.per_expert_scale[e];
            let y = mlp(&m.experts[e], &e_in, 1);
            acc.iter_mut().zip(&y).for_each(|(a, y)| *a += weight * y);
        }
    }
    rms_norm_chunks(&mut out, h, Some(&m.post_norm_2), plan.eps);
    out
}
