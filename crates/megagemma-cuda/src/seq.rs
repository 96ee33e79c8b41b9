//! [`CudaSeq`]: one sequence's KV cache and scratch, and the forward pass over a chunk of tokens.
//!
//! Stage order and arithmetic follow the CPU reference (`megagemma_model::cpu::forward`) step by
//! step. A pass over T tokens at positions `len .. len+T` writes its K/V rows into per-layer
//! staging buffers, never into the cache: [`CudaSeq::commit`] copies the accepted rows in
//! afterwards, so a candidate never overwrites a ring slot a query may still need.
//!
//! This file holds the sequence itself (state, scratch, lifecycle, steps, batched steps, the
//! megakernel's tables); `stages` records a pass's launches, `pipeline` runs pipelined decoding.

use crate::candidates::{candidates_on_device, launch_draw, survivors, DrawBuffers, MAX_CANDIDATES};
use crate::device::{
    cuda_err, mma_kernel, mma_one_kernel, mma_prep_kernels, mma_ring_bytes, Arg, DevBuf, DevMat, Gpu, HostLog, FMT_Q4,
    FMT_Q4T,
};
use crate::long_pass::FEW_TOKENS;
use crate::megakernel::{Megakernel, MkTrace};
use crate::mma_split::{
    mma_chunk_bytes, mma_split, split_override, split_runs, MmaSplit, MMA_COUNTERS, MMA_PARTIAL_FLOATS, MMA_SLICE_BYTES,
};
use crate::model::CudaModel;
use crate::weights::{DevLayer, DevMoe};
use cudarc::driver::CudaGraph;
pub use megagemma_model::backend::Decode;
use megagemma_model::backend::{check_draw, no_finite_logit};
use megagemma_model::draw::DrawParams;
use megagemma_model::plan::{LayerPlan, ModelPlan};
use megagemma_model::{bail, Result};
use std::sync::Arc;

mod pipeline;
mod stages;

use pipeline::SampleBuf;

/// Most positions one forward may return (speculative verify), and most tokens per forward
/// without cuBLAS.
pub const MAX_VERIFY: usize = 64;
/// Most tokens one forward may run (and stage): long passes (prefill chunks) run on cuBLAS
/// (`long_pass.rs`); the per-token scratch grows to the longest pass a sequence has run.
pub const MAX_CHUNK: usize = 4096;
/// Tokens per prefill chunk (`MEGAGEMMA_CUDA_PREFILL_CHUNK`, at most `MAX_CHUNK`).
const PREFILL_CHUNK: usize = 1024;
/// Columns one matvec launch handles.
const MATVEC_COLS: usize = 8;
const MATVEC_ROWS_PER_BLOCK: usize = 8;
const ATTENTION_WARPS: usize = 8;
/// Fewest tokens of a pass whose residual steps prepare the next matvecs' inputs (`prep_inputs`).
/// Twenty-fourth session (H200, E4B graph, `gpu_check verifycost`, two rounds, prepared / built):
/// verify of 2 tokens 3.05–3.07 / 2.94–2.97 ms (the step's own build then costs more than the
/// matvecs save), of 3 3.44–3.46 / 3.45–3.49, of 4 3.54–3.55 / 3.69–3.74; four sequences in one
/// pass 3.44–3.46 / 3.59–3.60 ms. Twenty-fifth session, this threshold against 2 (same call, two
/// rounds): two sequences in one pass 2.844–2.855 against 2.948–2.949 ms, 3-column verify (`bench
/// --draft oracle --k 2`) 3.572–3.585 against 3.570–3.593 ms. Twenty-eighth session, with the copy's
/// loads in flight together (`copy_inputs`), 2 against 3: 2-column verify E4B 3.088 → 2.930 ms, E2B
/// 2.063–2.085 → 2.050–2.059; two sequences E4B 708.9 → 744.5 tok/s, E2B 1,091 → 1,093.
const PREP_MIN_TOKENS: usize = 2;
/// Blocks per token of the prepared-input residual step (at most; whole chunks each).
const PREP_SLICES: usize = 8;
/// Blocks per row of the softcap + argmax pass.
pub(crate) const ARGMAX_SPLIT: usize = 64;

/// Threads per block of a row gather (`embed_gather`, `ple_combine`: one element per thread).
pub(crate) const GATHER_THREADS: u32 = 256;

/// Blocks of `GATHER_THREADS` for a row gather of `t` tokens × `cols` elements (`row_element` in
/// kernels/ops.cu).
pub(crate) fn gather_blocks(t: usize, cols: usize) -> u32 {
    (t * cols.div_ceil(GATHER_THREADS as usize)) as u32
}

/// A residual step not run yet (`add_norm`: `x = (x + norm(o)·w1)·scale`, then the next input
/// `norm(x)·w2`, or `x` itself when `w2` is 0). The next tensor-core matvec folds it into its input
/// (`Residual` in `kernels/matvec_mma.cu`: each block recomputes it; the new `x` goes to the other
/// residual buffer); any other consumer runs it first on its own.
#[derive(Clone, Copy)]
struct PendingNorm {
    o: u64,
    w1: u64,
    scale: f32,
    w2: u64,
}

/// The second input of a gated projection: `[t, ≥ cols]` floats with row stride `stride`.
#[derive(Clone, Copy)]
pub(crate) struct Gate {
    pub(crate) ptr: u64,
    pub(crate) stride: usize,
}

/// What the pipelined loop (`CudaSeq::pipelined`) launches: greedy steps (graphs, or the
/// megakernel's two tables) or sampled steps (`sample_graphs`).
#[derive(Clone, Copy)]
enum StepGraphs {
    Greedy(Option<[usize; 2]>),
    Sampled,
}

/// `MEGAGEMMA_CUDA_DECODE=megakernel|graph` (default graph): how new sequences launch their decode
/// steps when the caller does not say.
pub fn decode_from_env() -> Decode {
    std::env::var("MEGAGEMMA_CUDA_DECODE").ok().and_then(|v| v.parse().ok()).unwrap_or(Decode::Graph)
}

/// What a forward returns per position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Want {
    /// Every position of the chunk (verify) or only the last (prefill, decode).
    pub all_positions: bool,
    /// Copy the logits to the host as well as the argmax.
    pub logits: bool,
}

#[derive(Clone, Debug)]
pub struct PosOut {
    pub argmax: u32,
    /// Final logits (after softcap), when asked for.
    pub logits: Option<Vec<f32>>,
}

/// K/V of one cache-owning layer: committed rows and staged rows.
pub(crate) struct LayerCache {
    pub(crate) k: DevBuf,
    pub(crate) v: DevBuf,
    pub(crate) staged_k: DevBuf,
    pub(crate) staged_v: DevBuf,
    pub(crate) width: usize,
    /// Ring slots (window + 1) for sliding layers; 0 for a full cache.
    pub(crate) ring: usize,
}

impl LayerCache {
    fn view(&self) -> KvView {
        KvView {
            k: self.k.ptr,
            v: self.v.ptr,
            staged_k: self.staged_k.ptr,
            staged_v: self.staged_v.ptr,
            ring: self.ring,
        }
    }
}

/// A cache-owning layer's device pointers, as a pass's attention reads and stages them.
#[derive(Clone, Copy, Default)]
pub(crate) struct KvView {
    k: u64,
    v: u64,
    staged_k: u64,
    staged_v: u64,
    ring: usize,
}

/// One column of a batched step's attention table (`struct AttColumn` in kernels/attention.cu):
/// the sequence of the pass's token t — its cache of the layer, ring slots and position.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct AttColumnDesc {
    pub(crate) kc: u64,
    pub(crate) vc: u64,
    pub(crate) ks: u64,
    pub(crate) vs: u64,
    pub(crate) pos: i32,
    pub(crate) ring: i32,
}

impl AttColumnDesc {
    /// Column `pos` of a sequence whose layer cache is `c`.
    fn new(c: KvView, pos: usize) -> AttColumnDesc {
        AttColumnDesc { kc: c.k, vc: c.v, ks: c.staged_k, vs: c.staged_v, pos: pos as i32, ring: c.ring as i32 }
    }
}

/// Most sequences one batched step runs: a batch is one short pass (its attention norms every
/// column's K/V; its columns split their keys as a lone token does).
pub const MAX_BATCH: usize = 8;
const _: () = assert!(MAX_BATCH <= AttentionSplit::FEW_TOKENS);

/// One cache-owning layer as `kv_commit` reads it (`struct KvLayer` in `kernels/ops.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
struct KvLayerDesc {
    k: u64,
    v: u64,
    staged_k: u64,
    staged_v: u64,
    width: i32,
    ring: i32,
}

/// Activation scratch, f32 `[tokens, width]` each (tokens: the sequence's longest pass so far;
/// logits and argmax partials for `MAX_VERIFY` positions).
pub(crate) struct Scratch {
    /// The residual stream: `x`, or `x2` after an odd number of folded residual steps in a pass
    /// (`CudaSeq::xcur`).
    x: DevBuf,
    x2: DevBuf,
    a: DevBuf,
    pub(crate) q: DevBuf,
    /// A short pass's raw K and V projections (`[tokens, kv width]`), normed by the attention
    /// kernel, which writes the cache's staged rows (`fuse_norms`).
    kr: DevBuf,
    vr: DevBuf,
    /// A batched step's tables, uploaded with its tokens: per layer and column the column's
    /// cache and position (`AttColumnDesc`), and per column its `KvLayerDesc` table and position
    /// for the commit. A captured batched pass reads them, so one graph serves every set of
    /// sequences.
    att_cols: DevBuf,
    commit_tables: DevBuf,
    commit_pos: DevBuf,
    pub(crate) att: DevBuf,
    o: DevBuf,
    f: DevBuf,
    g: DevBuf,
    u: DevBuf,
    pli: DevBuf,
    pg: DevBuf,
    pub(crate) logits: DevBuf,
    ids: DevBuf,
    /// With `keep_hidden`: the final-normed hidden states of the positions whose logits the last
    /// pass computed (`[rows, hidden]`), for the MTP drafter.
    pub(crate) hid: DevBuf,
    /// Per-block (value, index) candidates of the argmax.
    partial: DevBuf,
    /// Per-part sums of split matvecs (`MMA_PARTIAL_FLOATS`) and their per-tile-group arrival
    /// counters (`MMA_COUNTERS`, zero between launches).
    mma_partial: DevBuf,
    /// Inputs of passes of 2–8 tokens prepared once by their residual step for the plain
    /// tensor-core matvecs after it (`prep_inputs` in kernels/matvec_mma.cu): hidden-wide rows.
    mma_prep: DevBuf,
    mma_counters: DevBuf,
    /// With `Gpu::fixed_sums`: two buffers of 64-bit sums (`[MATVEC_COLS, hidden]` each) that the
    /// split launches of a pass write in turn (`matvec_sum`), the first zero when a pass starts.
    sums: DevBuf,
    /// Attention split along the keys: per-split partial outputs, (max, sum) pairs and per-query
    /// arrival counters (zero between launches).
    att_o: DevBuf,
    att_ml: DevBuf,
    att_counters: DevBuf,
    /// `[p0, token 0, token 1, …]` as u32: the chunk's first position and its tokens, uploaded
    /// in one copy and read by the kernels on the device.
    meta: DevBuf,
    /// The next decode step's `[position, token]`, written by a committed decode step
    /// (`kv_commit_step`); the pipelined loop's second graph reads it as its `meta` and writes
    /// `meta` (`CudaSeq::decode_greedy`).
    meta_next: DevBuf,
    // MoE
    zr: DevBuf,
    rl: DevBuf,
    idx: DevBuf,
    wts: DevBuf,
    ys: DevBuf,
    e: DevBuf,
}

/// `fused` flags of the attention kernel (`ATT_FUSED_*` in kernels/attention.cu).
const ATT_FUSED_Q: i32 = 1;
const ATT_FUSED_KV: i32 = 2;
const ATT_FUSED_VNORM: i32 = 4;

/// The norms a short pass's attention applies itself (`fused` = 0: the pass ran `qkv_norm_rope`).
pub(crate) struct AttentionNorms {
    fused: i32,
    q_norm: u64,
    inv_freq: u64,
    /// With `ATT_FUSED_KV`: the k_norm weight and the raw K and V rows of this pass.
    k_norm: u64,
    kr: u64,
    vr: u64,
}

impl AttentionNorms {
    /// None: the queries (and keys) were normed and rotated before the attention.
    pub(crate) fn none() -> AttentionNorms {
        AttentionNorms { fused: 0, q_norm: 0, inv_freq: 0, k_norm: 0, kr: 0, vr: 0 }
    }
}

/// Where an attention launch reads its queries (and, without a column table, its positions) and
/// writes its output and split scratch, its window (0: full) and the most keys a query sees (which
/// sizes the grid): a pass's own, or the MTP drafter's (`CudaSeq::draft`).
pub(crate) struct AttIo {
    pub(crate) q: u64,
    pub(crate) out: u64,
    pub(crate) pos: u64,
    pub(crate) part_o: u64,
    pub(crate) part_ml: u64,
    pub(crate) counters: u64,
    pub(crate) window: usize,
    pub(crate) max_keys: usize,
    pub(crate) scale: f32,
}

/// The most keys a query of layer `lp` can see in a sequence of `max_len` positions.
fn attention_keys(lp: &LayerPlan, max_len: usize) -> usize {
    lp.window.map_or(max_len, |w| w.min(max_len))
}

/// Most key splits of a query in a short pass (`ATT_MAX_SPLITS` in kernels/attention.cu): sizes
/// every attention's split scratch, the MTP drafter's too.
pub(crate) const ATT_MAX_SPLITS: usize = 64;

/// How the attention kernel splits a query's keys over blocks (`kernels/attention.cu`: splits of at
/// least `split_keys` keys, at most `ATT_MAX_SPLITS` of them in passes of up to `ATT_FEW_TOKENS`
/// tokens, `ATT_LONG_SPLITS` in longer ones). `split_keys` is an argument of the kernel: the host
/// chooses it (`Gpu::att_split_keys`) and sizes the grid and shared memory from the same value.
struct AttentionSplit {
    /// Blocks per query in the grid (enough for the longest query).
    grid_splits: usize,
    /// Most keys one block takes.
    keys_per_block: usize,
}

impl AttentionSplit {
    const FEW_TOKENS: usize = 8;
    const MAX_SPLITS: usize = ATT_MAX_SPLITS;
    const LONG_SPLITS: usize = 4;

    /// Most splits a query of a `t`-token pass gets (`att_splits`' cap).
    fn cap(t: usize) -> usize {
        if t <= Self::FEW_TOKENS {
            Self::MAX_SPLITS
        } else {
            Self::LONG_SPLITS
        }
    }

    fn new(max_keys: usize, t: usize, split_keys: usize) -> AttentionSplit {
        let cap = Self::cap(t);
        let grid_splits = max_keys.div_ceil(split_keys).clamp(1, cap);
        AttentionSplit { grid_splits, keys_per_block: split_keys.max(max_keys.div_ceil(cap)) }
    }

    /// Partial outputs (`[queries·grid_splits, hd]` floats) the largest pass of a layer needs.
    fn scratch_floats(lp: &LayerPlan, max_len: usize, split_keys: usize) -> usize {
        let keys = attention_keys(lp, max_len);
        [Self::FEW_TOKENS, MAX_VERIFY]
            .into_iter()
            .map(|t| t * lp.num_heads * Self::new(keys, t, split_keys).grid_splits * lp.head_dim)
            .max()
            .unwrap_or(0)
    }
}

impl Scratch {
    /// Scratch for passes of up to `t` tokens in a sequence of at most `max_len` positions.
    fn new(model: &CudaModel, t: usize, max_len: usize) -> Result<Scratch> {
        let (gpu, plan) = (&model.gpu, &model.plan);
        let h = plan.hidden;
        let max_q = plan.layers.iter().map(LayerPlan::q_width).max().unwrap_or(0);
        let max_kv = plan.layers.iter().map(LayerPlan::kv_width).max().unwrap_or(0);
        let moe = model.weights().layers.iter().find_map(|l| l.moe.as_ref());
        let (experts, moe_inter) = moe.map_or((0, 0), |m| (m.experts.len(), m.experts[0][0].rows as usize));
        let max_i = plan.layers.iter().map(|l| l.mlp_width).max().unwrap_or(0).max(moe_inter);
        let lp = plan.layers.len() * plan.ple_dim;
        let top_k = plan.moe_top_k.max(1);
        let att_floats = plan
            .layers
            .iter()
            .map(|l| AttentionSplit::scratch_floats(l, max_len, gpu.att_split_keys))
            .max()
            .unwrap_or(0);
        let min_hd = plan.layers.iter().map(|l| l.head_dim).min().unwrap_or(1).max(1);
        let max_heads = plan.layers.iter().map(|l| l.num_heads).max().unwrap_or(1);
        let out = t.min(MAX_VERIFY);
        Ok(Scratch {
            x: gpu.alloc_zeros(f32s(t * h))?,
            x2: gpu.alloc_zeros(f32s(t * h))?,
            a: gpu.alloc_zeros(f32s(t * h))?,
            q: gpu.alloc_zeros(f32s(t * max_q))?,
            kr: gpu.alloc_zeros(f32s(t * max_kv))?,
            vr: gpu.alloc_zeros(f32s(t * max_kv))?,
            att_cols: gpu.alloc_zeros(plan.layers.len() * MAX_BATCH * std::mem::size_of::<AttColumnDesc>())?,
            commit_tables: gpu.alloc_zeros(MAX_BATCH * 8)?,
            commit_pos: gpu.alloc_zeros(MAX_BATCH * 4)?,
            att: gpu.alloc_zeros(f32s(t * max_q))?,
            o: gpu.alloc_zeros(f32s(t * h))?,
            f: gpu.alloc_zeros(f32s(t * h))?,
            g: gpu.alloc_zeros(f32s(t * max_i.max(top_k * moe_inter)))?,
            u: gpu.alloc_zeros(f32s(t * max_i.max(top_k * moe_inter)))?,
            pli: gpu.alloc_zeros(f32s(t * lp))?,
            pg: gpu.alloc_zeros(f32s(t * plan.ple_dim))?,
            logits: gpu.alloc_zeros(f32s(out * plan.vocab_size))?,
            ids: gpu.alloc_zeros(out * 4)?,
            hid: gpu.alloc_zeros(f32s(out * h))?,
            partial: gpu.alloc_zeros(out * ARGMAX_SPLIT * 8)?,
            mma_partial: gpu.alloc_zeros(f32s(MMA_PARTIAL_FLOATS))?,
            mma_prep: gpu.alloc_zeros(model.plan.hidden.div_ceil(64) * mma_chunk_bytes(2, 2))?,
            att_o: gpu.alloc_zeros(f32s(att_floats))?,
            att_ml: gpu.alloc_zeros(f32s(2 * att_floats / min_hd))?,
            att_counters: gpu.alloc_zeros(4 * out * max_heads)?,
            mma_counters: gpu.alloc_zeros(MMA_COUNTERS * 4)?,
            sums: gpu.alloc_zeros(if gpu.fixed_sums { 2 * MATVEC_COLS * h * 8 } else { 8 })?,
            meta: gpu.alloc_zeros((t + 1) * 4)?,
            meta_next: gpu.alloc_zeros((t + 1) * 4)?,
            zr: gpu.alloc_zeros(f32s(t * h))?,
            rl: gpu.alloc_zeros(f32s(t * experts.max(1)))?,
            idx: gpu.alloc_zeros(t * top_k * 4)?,
            wts: gpu.alloc_zeros(f32s(t * top_k))?,
            ys: gpu.alloc_zeros(f32s(t * top_k * h))?,
            e: gpu.alloc_zeros(f32s(t * h))?,
        })
    }
}

pub struct CudaSeq {
    pub(crate) model: Arc<CudaModel>,
    max_len: usize,
    len: usize,
    staged: usize,
    /// Tokens the scratch and staging rows hold.
    capacity: usize,
    /// Tokens per prefill chunk with cuBLAS (`MEGAGEMMA_CUDA_PREFILL_CHUNK`, default 1024).
    prefill_chunk: usize,
    caches: Vec<Option<LayerCache>>,
    /// The cache-owning layers' [`KvLayerDesc`]s on the device, and how many: one commit launch
    /// copies every layer's accepted rows.
    kv_table: DevBuf,
    kv_layers: usize,
    pub(crate) s: Scratch,
    /// Single-token passes replay a captured CUDA graph (all their kernels in one launch).
    use_graphs: bool,
    /// The single-token pass as a graph, without and with the commit of its K/V row (`[plain,
    /// committing]`: `step` commits in the same launch).
    decode_graph: [Option<CudaGraph>; 2],
    /// The committed decode step with its two meta buffers swapped: the pipelined loop alternates
    /// it with `decode_graph[1]` (`decode_greedy`).
    ahead_graph: Option<CudaGraph>,
    /// Where committed decode steps leave their argmax for the host, tagged with their position
    /// (slot position mod `STEP_LOG`; `decode_greedy` polls it).
    step_log: HostLog,
    /// Whether `decode_greedy` queues steps ahead of the host (`MEGAGEMMA_CUDA_PIPELINE=0`: one
    /// step at a time, as `step` in a loop; the same ids either way).
    pipeline: bool,
    decode: Decode,
    /// Megakernel tables recorded so far, one per kind of pass (tokens, outputs, commit).
    megakernels: Vec<(MkPass, Megakernel)>,
    /// Which of `megakernels` ran last (its trace, shape and error flag are the ones reported).
    mk_last: usize,
    /// While `step` runs its pass: the single-token launch commits the row too.
    commit_in_step: bool,
    /// Record per-block stage timestamps in the megakernel.
    trace_megakernel: bool,
    /// `MEGAGEMMA_CUDA_MK_TRACE=FILE`: every megakernel step traced, each overwriting FILE.
    trace_file: Option<std::path::PathBuf>,
    /// While a pass is being launched: whether the residual stream is in `s.x2` (`xcur`).
    x_in_x2: std::cell::Cell<bool>,
    /// While a pass is being launched: its split launches that add 64-bit sums so far, and
    /// whether its first such launch combines in part order instead (`matvec_sum`).
    sums_next: std::cell::Cell<usize>,
    sums_skip_first: std::cell::Cell<bool>,
    /// While a batched step's pass is launched or captured: its attention takes each column's
    /// cache and position from `Scratch::att_cols`.
    batched: std::cell::Cell<bool>,
    /// The batched pass of n sequences (and its commits), captured on first use: index n.
    batch_graphs: Vec<Option<CudaGraph>>,
    /// Fold residual steps into the next tensor-core matvec (`MEGAGEMMA_CUDA_FOLD_NORMS=0`: never;
    /// the arithmetic, and so every result, is the same either way).
    fold_norms: bool,
    /// In passes of 3–8 tokens, residual steps also prepare the inputs of the plain tensor-core
    /// matvecs after them, which copy instead of building them (`MEGAGEMMA_CUDA_PREP_INPUTS=0`:
    /// never; same results).
    prep_inputs: bool,
    /// The fewest tokens of a pass that prepares inputs (`MEGAGEMMA_CUDA_PREP_MIN`, 2–8; default
    /// `PREP_MIN_TOKENS`; same results).
    prep_min: usize,
    /// Blocks per token of that step, at most (`MEGAGEMMA_CUDA_PREP_SLICES`, 1–16; default
    /// `PREP_SLICES`; same results).
    prep_slices: usize,
    /// Every pass also writes the final-normed hidden states of its output positions (`Scratch::
    /// hid`: one more launch) and commits keep the newest one in `hidden`: what the MTP drafter
    /// reads (`CudaSeq::draft`). Off unless the backend has an assistant.
    keep_hidden: bool,
    /// The final-normed hidden state of position `len − 1` (`[hidden]`), valid when `has_hidden`.
    pub(crate) hidden: DevBuf,
    pub(crate) has_hidden: bool,
    /// The pass position of `Scratch::hid`'s row 0 in the last forward (its first output).
    hid_first: usize,
    /// Greedy draft rounds captured as CUDA graphs, by (assistant, drafts per round): a round's
    /// inputs (token, position, the cache columns) are uploaded before its launch.
    pub(crate) draft_graphs: Vec<((u64, usize), CudaGraph)>,
    /// Pipelined sampled decoding (`decode_sampled`): the committed step with the device's draw
    /// (`sample_draw`) before its commit, and the same with its meta buffers swapped, captured
    /// for one set of draw parameters.
    sample_graphs: Option<(DrawParams, [CudaGraph; 2])>,
    /// While those graphs are captured: the draw the step runs after its pass.
    sample_stage: Option<DrawParams>,
    /// `decode_sampled`'s device buffers (`SampleBuf`), allocated on first use.
    sample_buf: Option<SampleBuf>,
    /// Whether `decode_sampled` draws on the device in the pipelined loop (the default;
    /// `MEGAGEMMA_CUDA_DEVICE_DRAW=0`: one step at a time, drawn on the host).
    device_draw: bool,
}

// SAFETY: the graph handle is only used through `&mut self`, on the model's stream; the driver
// API may be called from any thread once the context is bound (every call binds it).
unsafe impl Send for CudaSeq {}

/// Most tokens a megakernel pass takes: its tensor-core matvec runs one launch's columns (two
/// groups of four, `ring_slice`); longer passes (verify of more drafts, prefill) launch their
/// stages.
pub const MK_MAX_TOKENS: usize = MATVEC_COLS;

/// What a recorded megakernel table computes: a pass of `tokens` tokens with outputs from
/// position `first` on, committing its K/V row (`step`) or staging it; `ahead`: recorded with the
/// two meta buffers swapped (the pipelined loop's second table, `decode_greedy`); `batched`: a
/// batched step of `tokens` sequences and their commits (`step_batch`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct MkPass {
    tokens: usize,
    first: usize,
    commit: bool,
    ahead: bool,
    batched: bool,
}

/// Slots of a sequence's step log (a power of two; the pipelined loop has two steps in flight).
const STEP_LOG: usize = 4;

/// Two argument lists as one array (`C = A + B`), without allocating.
fn join<const A: usize, const B: usize, const C: usize>(a: [Arg; A], b: [Arg; B]) -> [Arg; C] {
    assert_eq!(A + B, C, "join: {A} + {B} arguments into {C}");
    std::array::from_fn(|i| if i < A { a[i] } else { b[i - A] })
}

/// Bytes of `n` f32s.
pub(crate) fn f32s(n: usize) -> usize {
    n * 4
}

/// K (and V) rows a cache-owning layer keeps for a sequence of at most `max_len` positions, and its
/// ring length (0: rows by position): a sliding layer's ring of W + 1 slots, or `max_len` rows when
/// that is fewer; a full layer `max_len` rows.
fn cache_slots(lp: &LayerPlan, max_len: usize) -> (usize, usize) {
    match lp.window.map(|w| w + 1) {
        Some(ring) if ring <= max_len => (ring, ring),
        _ => (max_len, 0),
    }
}

/// Bytes of K/V cache one sequence of at most `max_len` positions allocates.
pub fn kv_cache_bytes(plan: &ModelPlan, max_len: usize) -> usize {
    plan.layers
        .iter()
        .filter(|lp| !lp.is_kv_shared())
        .map(|lp| 2 * f32s(cache_slots(lp, max_len).0 * lp.kv_width()))
        .sum()
}

impl CudaSeq {
    /// A sequence of at most `max_len` positions.
    pub fn new(model: &Arc<CudaModel>, max_len: usize) -> Result<CudaSeq> {
        let gpu = &model.gpu;
        let plan = &model.plan;
        let t = FEW_TOKENS;
        let mut caches = Vec::with_capacity(plan.layers.len());
        for lp in &plan.layers {
            caches.push(if lp.is_kv_shared() {
                None
            } else {
                let width = lp.kv_width();
                let (slots, ring) = cache_slots(lp, max_len);
                Some(LayerCache {
                    k: gpu.alloc_zeros(f32s(slots * width))?,
                    v: gpu.alloc_zeros(f32s(slots * width))?,
                    staged_k: gpu.alloc_zeros(f32s(t * width))?,
                    staged_v: gpu.alloc_zeros(f32s(t * width))?,
                    width,
                    ring,
                })
            });
        }
        let s = Scratch::new(model, t, max_len)?;
        let kv_layers = caches.iter().flatten().count();
        let kv_table = gpu.alloc_zeros((kv_layers * std::mem::size_of::<KvLayerDesc>()).max(1))?;
        let use_graphs = std::env::var("MEGAGEMMA_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let chunk = std::env::var("MEGAGEMMA_CUDA_PREFILL_CHUNK").ok().and_then(|v| v.parse().ok());
        let trace_file = std::env::var_os("MEGAGEMMA_CUDA_MK_TRACE").map(std::path::PathBuf::from);
        let mut seq = CudaSeq {
            model: model.clone(),
            max_len,
            len: 0,
            staged: 0,
            capacity: t,
            prefill_chunk: chunk.unwrap_or(PREFILL_CHUNK).clamp(1, MAX_CHUNK),
            kv_layers,
            kv_table,
            caches,
            s,
            use_graphs,
            decode_graph: [None, None],
            ahead_graph: None,
            step_log: HostLog::new(gpu, STEP_LOG)?,
            pipeline: std::env::var("MEGAGEMMA_CUDA_PIPELINE").map_or(true, |v| v != "0"),
            decode: decode_from_env(),
            megakernels: Vec::new(),
            mk_last: 0,
            commit_in_step: false,
            trace_megakernel: trace_file.is_some(),
            trace_file,
            x_in_x2: Default::default(),
            sums_next: Default::default(),
            sums_skip_first: Default::default(),
            batched: Default::default(),
            batch_graphs: (0..=MAX_BATCH).map(|_| None).collect(),
            fold_norms: std::env::var("MEGAGEMMA_CUDA_FOLD_NORMS").map_or(true, |v| v != "0"),
            prep_inputs: std::env::var("MEGAGEMMA_CUDA_PREP_INPUTS").map_or(true, |v| v != "0"),
            prep_min: crate::device::env_count("MEGAGEMMA_CUDA_PREP_MIN", 2..=MATVEC_COLS, PREP_MIN_TOKENS),
            prep_slices: crate::device::env_count("MEGAGEMMA_CUDA_PREP_SLICES", 1..=16, PREP_SLICES),
            keep_hidden: false,
            hidden: gpu.alloc_zeros(f32s(plan.hidden))?,
            has_hidden: false,
            hid_first: 0,
            draft_graphs: Vec::new(),
            sample_graphs: None,
            sample_stage: None,
            sample_buf: None,
            device_draw: std::env::var("MEGAGEMMA_CUDA_DEVICE_DRAW").map_or(true, |v| v != "0"),
        };
        seq.upload_kv_table()?;
        Ok(seq)
    }

    /// The cache-owning layers' descriptors, as `kv_commit` reads them.
    fn upload_kv_table(&mut self) -> Result<()> {
        let descs: Vec<KvLayerDesc> = self
            .caches
            .iter()
            .flatten()
            .map(|c| KvLayerDesc {
                k: c.k.ptr,
                v: c.v.ptr,
                staged_k: c.staged_k.ptr,
                staged_v: c.staged_v.ptr,
                width: c.width as i32,
                ring: c.ring as i32,
            })
            .collect();
        self.model.gpu.upload(self.kv_table.ptr, &descs)?;
        self.model.gpu.sync()
    }

    /// Makes the scratch and staging rows hold passes of `t` tokens (in steps of 64). The decode
    /// graph, which holds the old addresses, is captured again on next use.
    fn reserve(&mut self, t: usize) -> Result<()> {
        if t <= self.capacity {
            return Ok(());
        }
        let t = t.next_multiple_of(64).min(MAX_CHUNK);
        self.model.gpu.sync()?;
        self.forget_recordings();
        self.draft_graphs.clear();
        let gpu = &self.model.gpu;
        self.s = Scratch::new(&self.model, t, self.max_len)?;
        for c in self.caches.iter_mut().flatten() {
            c.staged_k = gpu.alloc_zeros(f32s(t * c.width))?;
            c.staged_v = gpu.alloc_zeros(f32s(t * c.width))?;
        }
        self.capacity = t;
        self.upload_kv_table()
    }

    /// A new sequence holding a copy of this one's committed positions (staged rows are not
    /// copied) and its settings: each cache layer's K/V rows copied on the device — the whole ring
    /// of a sliding layer, the first `len` rows of a full one.
    pub fn fork(&self) -> Result<CudaSeq> {
        self.fork_into(CudaSeq::new(&self.model, self.max_len)?)
    }

    /// [`fork`](Self::fork) into `copy`, an unused sequence of the same model and length (a new
    /// one, or one given back and kept for reuse: its positions are forgotten first).
    pub fn fork_into(&self, mut copy: CudaSeq) -> Result<CudaSeq> {
        if !Arc::ptr_eq(&copy.model, &self.model) || copy.max_len != self.max_len {
            bail!("a fork needs a sequence of the same model and length");
        }
        copy.clear();
        let gpu = &self.model.gpu;
        for (dst, src) in copy.caches.iter().zip(&self.caches) {
            if let (Some(d), Some(s)) = (dst, src) {
                let rows = if s.ring > 0 { s.ring } else { self.len };
                gpu.copy(d.k.ptr, s.k.ptr, f32s(rows * s.width))?;
                gpu.copy(d.v.ptr, s.v.ptr, f32s(rows * s.width))?;
            }
        }
        copy.len = self.len;
        copy.prefill_chunk = self.prefill_chunk;
        copy.use_graphs = self.use_graphs;
        copy.pipeline = self.pipeline;
        copy.device_draw = self.device_draw;
        copy.decode = self.decode;
        copy.trace_megakernel = self.trace_megakernel;
        copy.trace_file = self.trace_file.clone();
        copy.set_keep_hidden(self.keep_hidden);
        if self.has_hidden {
            gpu.copy(copy.hidden.ptr, self.hidden.ptr, f32s(self.model.plan.hidden))?;
            copy.has_hidden = true;
        }
        gpu.sync()?;
        Ok(copy)
    }

    /// Forgets every position, for reuse as a new sequence: the caches and captured graphs stay
    /// (a pass reads no cache row past the positions it holds, and every step's slot of the step
    /// log is cleared before the step is queued), so nothing is allocated or zeroed again.
    pub fn clear(&mut self) {
        self.len = 0;
        self.staged = 0;
        self.has_hidden = false;
    }

    /// The most positions this sequence holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether passes keep the final-normed hidden states the MTP drafter reads (see
    /// `keep_hidden`). Graphs and megakernel tables are recorded again with or without its launch.
    pub fn set_keep_hidden(&mut self, on: bool) {
        if on != self.keep_hidden {
            self.keep_hidden = on;
            self.forget_recordings();
        }
    }

    /// Drops the captured pass graphs and megakernel tables: captured again on next use.
    fn forget_recordings(&mut self) {
        self.decode_graph = [None, None];
        self.ahead_graph = None;
        self.sample_graphs = None;
        self.batch_graphs.iter_mut().for_each(|g| *g = None);
        self.megakernels.clear();
    }

    /// After a commit that makes position `i` of the last pass the newest: its hidden state
    /// becomes the sequence's (when the pass computed it).
    fn keep_hidden_of(&mut self, i: usize) -> Result<()> {
        if !self.keep_hidden {
            return Ok(());
        }
        self.has_hidden = i >= self.hid_first;
        if self.has_hidden {
            let h = self.model.plan.hidden;
            self.model.gpu.copy(self.hidden.ptr, self.s.hid.at(f32s((i - self.hid_first) * h)), f32s(h))?;
        }
        Ok(())
    }

    /// Whether passes replay captured CUDA graphs.
    pub fn uses_graphs(&self) -> bool {
        self.use_graphs
    }

    /// Whether `decode_greedy` queues each step before the host has read the previous token
    /// (default on; off with `MEGAGEMMA_CUDA_PIPELINE=0`).
    pub fn set_pipeline(&mut self, on: bool) {
        self.pipeline = on;
    }

    /// Whether `decode_sampled` draws each step's token on the device and pipelines the steps
    /// (default on; off with `MEGAGEMMA_CUDA_DEVICE_DRAW=0`).
    pub fn set_device_draw(&mut self, on: bool) {
        self.device_draw = on;
    }

    /// Whether single-token passes replay a captured CUDA graph (default on; off with
    /// `MEGAGEMMA_CUDA_GRAPHS=0`). Both ways run the same kernels on the same arguments.
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
    }

    /// The single-token pass: captured into a graph on first use, replayed after. Positions come
    /// from the device (`meta`), and attention's shared memory is sized for the longest window, so
    /// one graph serves every step.
    fn decode_graph(&mut self) -> Result<()> {
        let which = self.commit_in_step as usize;
        if self.decode_graph[which].is_none() {
            let g = self.capture(|| self.run_step())?;
            self.decode_graph[which] = Some(g);
        }
        let g = self.decode_graph[which].as_ref().expect("captured above");
        self.model.gpu.count_launch();
        g.launch().map_err(|e| cuda_err("graph launch", e))
    }

    /// Replays the last committed decode step's graph `n` times back to back, then waits once:
    /// the same token at the same position each time (its row rewritten with the same values).
    /// Timing only — `gpu_check verifycost` sets it beside `step`'s loop, which waits for each
    /// token, to measure what the host adds between steps.
    pub fn replay_last_step(&self, n: usize) -> Result<()> {
        let Some(g) = self.decode_graph[1].as_ref() else {
            bail!("no committed decode step has been captured yet");
        };
        for _ in 0..n {
            g.launch().map_err(|e| cuda_err("graph launch", e))?;
        }
        self.model.gpu.sync()
    }

    /// The launches `pass` makes, captured into a CUDA graph instead of run.
    pub(crate) fn capture(&self, pass: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let stream = self.model.gpu.stream.clone();
        let graph = crate::capture::capture(|| {
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| cuda_err("begin capture", e))?;
            self.model.gpu.set_capturing(true);
            let ran = pass();
            self.model.gpu.set_capturing(false);
            let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(|e| cuda_err("end capture", e));
            ran?;
            graph
        });
        match graph? {
            Some(g) => Ok(g),
            None => bail!("CUDA graph capture of a pass produced no graph"),
        }
    }

    /// How single-token passes are launched (both run the same arithmetic).
    pub fn set_decode(&mut self, decode: Decode) {
        self.decode = decode;
    }

    /// A pass of `t` ≤ [`MK_MAX_TOKENS`] tokens (outputs from position `first` on) in one
    /// persistent launch: its launches recorded on first use (as the graph captures them), then
    /// the megakernel runs the recorded stages. `skew` ≠ 0 makes every wait unsatisfiable (the
    /// timeout test).
    fn megakernel_pass(&mut self, t: usize, first: usize, skew: u32) -> Result<()> {
        self.launch_megakernel(
            MkPass { tokens: t, first, commit: self.commit_in_step, ahead: false, batched: false },
            skew,
        )
    }

    /// Launches `pass`'s table (recorded now if it is new); it becomes the last one run.
    fn launch_megakernel(&mut self, pass: MkPass, skew: u32) -> Result<()> {
        let i = self.megakernel_table(pass)?;
        self.mk_last = i;
        self.megakernels[i].1.launch(&self.model.gpu, skew)
    }

    /// The index in `megakernels` of `pass`'s table, recorded now if it is new.
    fn megakernel_table(&mut self, pass: MkPass) -> Result<usize> {
        if let Some(i) = self.megakernels.iter().position(|(p, _)| *p == pass) {
            return Ok(i);
        }
        if pass.ahead {
            std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
        }
        let gpu = &self.model.gpu;
        gpu.start_recording();
        let ran = if pass.batched { self.run_batch(pass.tokens) } else { self.run_pass(pass.tokens, pass.first) };
        let recorded = gpu.stop_recording();
        if pass.ahead {
            std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
        }
        ran?;
        let gpu = &self.model.gpu;
        self.megakernels.push((pass, Megakernel::new(gpu, &recorded, self.trace_megakernel)?));
        Ok(self.megakernels.len() - 1)
    }

    /// The single-token pass the decode graph captures.
    fn run_step(&self) -> Result<()> {
        self.run_pass(1, 0)
    }

    /// The launches of a pass, and with `commit_in_step` (single-token passes) the commit of its
    /// K/V row at the position the pass ran (read from `meta` on the device, so a captured graph
    /// or a megakernel table serves every step).
    fn run_pass(&self, t: usize, first: usize) -> Result<()> {
        self.run(t, first)?;
        if let Some(params) = &self.sample_stage {
            self.draw_on_device(params)?;
        }
        if self.commit_in_step && self.kv_layers > 0 {
            let args = [
                Arg::Ptr(self.kv_table.ptr),
                Arg::Ptr(self.s.meta.ptr),
                Arg::Ptr(self.s.meta_next.ptr),
                Arg::Ptr(self.s.ids.ptr),
                Arg::Ptr(self.step_log.dev),
                Arg::I32(STEP_LOG as i32 - 1),
            ];
            self.gpu().launch("kv_commit_step", 2 * self.kv_layers as u32, 128, 0, &args)?;
        }
        Ok(())
    }

    /// One decode step of `token` at position `len()`, committed: the same arithmetic as
    /// `forward(&[token])` and `commit(1)`, but on the graph and megakernel paths in one launch
    /// (the commit is the pass's last stage).
    pub fn step(&mut self, token: u32, logits: bool) -> Result<PosOut> {
        let fused = self.use_graphs;
        self.commit_in_step = fused;
        let out = self.forward(std::slice::from_ref(&token), Want { all_positions: false, logits });
        self.commit_in_step = false;
        let out = out?.pop().ok_or_else(|| megagemma_model::Error::msg("the CUDA forward returned no output"))?;
        if fused {
            // forward staged the row and the launch committed it.
            self.len += 1;
            self.staged = 0;
            self.keep_hidden_of(0)?;
        } else {
            self.commit(1)?;
        }
        Ok(out)
    }

    /// Every cache-owning layer's committed K and V rows that a later pass can still read (a
    /// ring's newest `ring` positions, a full cache's `len`), in position order: for checks
    /// that two ways of reaching the same position leave the same cache (`check::pipeline_matches`).
    pub fn committed_rows(&self) -> Result<Vec<f32>> {
        let mut out = vec![];
        for c in self.caches.iter().flatten() {
            let first = if c.ring > 0 { self.len.saturating_sub(c.ring) } else { 0 };
            for buf in [&c.k, &c.v] {
                let slots = if c.ring > 0 { c.ring } else { self.len.max(1) };
                let mut all = vec![0f32; slots * c.width];
                self.model.gpu.download(&mut all, buf.ptr)?;
                for p in first..self.len {
                    let slot = if c.ring > 0 { p % c.ring } else { p };
                    out.extend_from_slice(&all[slot * c.width..(slot + 1) * c.width]);
                }
            }
        }
        Ok(out)
    }

    /// `tokens` fit this sequence's remaining positions and the vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.plan.vocab_size;
        if self.len + tokens.len() > self.max_len {
            bail!("position {} is past this sequence's maximum length {}", self.len + tokens.len() - 1, self.max_len);
        }
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= vocab) {
            bail!("token id {bad} is out of range (vocab_size is {vocab})");
        }
        Ok(())
    }

    /// One decode step of several sequences in one weight pass, committed: column 0 is this
    /// sequence's `tokens[0]`, column i its `others[i − 1]`'s `tokens[i]`. Each column's attention
    /// reads and stages its own sequence's K/V at its own position, and every column's arithmetic
    /// is a lone `step`'s (matvec columns are independent of each other; the norms run inside
    /// the attention): the same ids and logits, bit for bit (`gpu_check batch`). One CUDA graph per
    /// sequence count (kernel by kernel without graphs; never the megakernel).
    pub fn step_batch(&mut self, others: &mut [&mut CudaSeq], tokens: &[u32], logits: bool) -> Result<Vec<PosOut>> {
        let n = tokens.len();
        let vocab = self.model.plan.vocab_size;
        if n != others.len() + 1 || n > MAX_BATCH {
            bail!(
                "a batched step takes one token per sequence, at most {MAX_BATCH} sequences ({n} tokens, {} sequences)",
                others.len() + 1
            );
        }
        for o in others.iter() {
            if !Arc::ptr_eq(&o.model, &self.model) || o.max_len != self.max_len {
                bail!("a batched step runs sequences of one model and one context length");
            }
        }
        for (s, tok) in std::iter::once(&*self).chain(others.iter().map(|o| &**o)).zip(tokens) {
            s.check_tokens(std::slice::from_ref(tok))?;
        }
        self.reserve(n)?;
        let model = self.model.clone();
        let (gpu, plan) = (&model.gpu, &model.plan);
        let meta: Vec<u32> = std::iter::once(self.len as u32).chain(tokens.iter().copied()).collect();
        gpu.upload(self.s.meta.ptr, &meta)?;
        let seqs: Vec<&CudaSeq> = std::iter::once(&*self).chain(others.iter().map(|o| &**o)).collect();
        let mut cols = vec![AttColumnDesc::default(); plan.layers.len() * MAX_BATCH];
        for (l, lp) in plan.layers.iter().enumerate() {
            for (c, s) in seqs.iter().enumerate() {
                if let Some(kv) = &s.caches[lp.kv_source] {
                    cols[l * MAX_BATCH + c] = AttColumnDesc::new(kv.view(), s.len);
                }
            }
        }
        gpu.upload(self.s.att_cols.ptr, &cols)?;
        gpu.upload(self.s.commit_tables.ptr, &seqs.iter().map(|s| s.kv_table.ptr).collect::<Vec<u64>>())?;
        gpu.upload(self.s.commit_pos.ptr, &seqs.iter().map(|s| s.len as i32).collect::<Vec<i32>>())?;
        // The pass and every column's commit: one graph or megakernel table per n (what differs
        // between steps is in the tables), or launched kernel by kernel without graphs.
        self.batched.set(true);
        let ran = if !self.use_graphs {
            self.run_batch(n)
        } else if self.decode == Decode::Megakernel && n <= MK_MAX_TOKENS {
            self.batch_megakernel(n)
        } else {
            self.batch_graph(n)
        };
        self.batched.set(false);
        ran?;
        let mut ids = vec![0u32; n];
        gpu.download(&mut ids, self.s.ids.ptr)?;
        let mut all = vec![];
        if logits {
            all = vec![0f32; n * vocab];
            gpu.download(&mut all, self.s.logits.ptr)?;
        }
        let h = plan.hidden;
        let hid = self.s.hid.ptr;
        for (i, s) in std::iter::once(&mut *self).chain(others.iter_mut().map(|o| &mut **o)).enumerate() {
            s.len += 1;
            s.staged = 0;
            if s.keep_hidden {
                // Column i's hidden state, from the pass's scratch (the first sequence's).
                gpu.copy(s.hidden.ptr, hid + f32s(i * h) as u64, f32s(h))?;
                s.has_hidden = true;
            }
        }
        Ok(ids
            .into_iter()
            .enumerate()
            .map(|(i, argmax)| PosOut { argmax, logits: logits.then(|| all[i * vocab..(i + 1) * vocab].to_vec()) })
            .collect())
    }

    /// A batched pass of `n` columns and the commit of each column's K/V row to its sequence.
    fn run_batch(&self, n: usize) -> Result<()> {
        self.run(n, 0)?;
        if self.kv_layers > 0 {
            let rows = 2 * self.kv_layers;
            let args = [Arg::Ptr(self.s.commit_tables.ptr), Arg::Ptr(self.s.commit_pos.ptr), Arg::I32(rows as i32)];
            self.gpu().launch("kv_commit_columns", (rows * n) as u32, 128, 0, &args)?;
        }
        Ok(())
    }

    /// [`CudaSeq::run_batch`] as a CUDA graph, captured on first use for each `n`.
    fn batch_graph(&mut self, n: usize) -> Result<()> {
        if self.batch_graphs[n].is_none() {
            let g = self.capture(|| self.run_batch(n))?;
            self.batch_graphs[n] = Some(g);
        }
        let g = self.batch_graphs[n].as_ref().expect("captured above");
        self.model.gpu.count_launch();
        g.launch().map_err(|e| cuda_err("graph launch", e))
    }

    /// [`CudaSeq::run_batch`] as one megakernel launch, its stage table recorded on first use for
    /// each `n`; an error if a wait timed out.
    fn batch_megakernel(&mut self, n: usize) -> Result<()> {
        self.launch_megakernel(MkPass { tokens: n, first: 0, commit: true, ahead: false, batched: true }, 0)?;
        self.check_megakernel(self.mk_last)
    }

    /// After megakernel `i` has run: an error if a wait timed out. A step abandoned part way may
    /// leave a 64-bit sum buffer written (`FIXED_SUMS`: `matvec_sum` in src/seq/stages.rs), so both
    /// are cleared then, as the next pass expects.
    pub(crate) fn check_megakernel(&mut self, i: usize) -> Result<()> {
        let gpu = &self.model.gpu;
        let r = self.megakernels[i].1.check(gpu);
        if r.is_err() && gpu.fixed_sums {
            gpu.upload(self.s.sums.ptr, &vec![0u8; self.s.sums.bytes])?;
        }
        r
    }

    /// Megakernel steps record when each block started, finished waiting and ended each stage
    /// (from the next recording of the step on); always with `MEGAGEMMA_CUDA_MK_TRACE`.
    pub fn set_megakernel_trace(&mut self, on: bool) {
        self.trace_megakernel = on || self.trace_file.is_some();
        self.megakernels.clear();
    }

    /// The last megakernel step's trace, when tracing.
    pub fn megakernel_trace(&self) -> Result<Option<MkTrace>> {
        match self.megakernels.get(self.mk_last) {
            Some((_, m)) => m.trace(&self.model.gpu),
            None => Ok(None),
        }
    }

    /// Whether the last megakernel launch was a batched step's table (`step_batch` under
    /// `Decode::Megakernel`, rather than its stages through a graph).
    pub(crate) fn last_megakernel_was_batched(&self) -> bool {
        self.megakernels.get(self.mk_last).is_some_and(|(p, _)| p.batched)
    }

    /// `(stages, blocks)` of the megakernel once a decode step has run with it.
    pub fn megakernel_shape(&self) -> Option<(usize, u32)> {
        self.megakernels.get(self.mk_last).map(|(_, m)| (m.stages(), m.grid()))
    }

    /// A decode step of `token` through the megakernel with a schedule no wait can satisfy: it
    /// must come back as an error (the timeout and error flag), not hang. Nothing is staged.
    pub fn megakernel_step_with_broken_schedule(&mut self, token: u32) -> Result<()> {
        self.staged = 0;
        self.model.gpu.upload(self.s.meta.ptr, &[self.len as u32, token])?;
        self.megakernel_pass(1, 0, 1 << 20)?;
        self.model.gpu.sync()?;
        self.check_megakernel(self.mk_last)
    }

    /// Rows staged by the last forward and not yet committed.
    pub fn staged(&self) -> usize {
        self.staged
    }

    pub fn model(&self) -> &Arc<CudaModel> {
        &self.model
    }

    /// Runs `tokens` at positions `len() ..`, stages their K/V rows and returns the argmax (and
    /// logits when asked) of the last position, or of every position with `want.all_positions`.
    /// Earlier staged rows are discarded.
    pub fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Vec<PosOut>> {
        let t = tokens.len();
        let vocab = self.model.plan.vocab_size;
        if t == 0 {
            bail!("empty input: at least one token is needed");
        }
        let most = if self.long_pass(t) { MAX_CHUNK } else { MAX_VERIFY };
        if t > most {
            bail!("{t} tokens in one forward: at most {most} (prefill longer prompts in chunks, committing each)");
        }
        if want.all_positions && t > MAX_VERIFY {
            bail!("{t} positions' outputs from one forward: at most {MAX_VERIFY}");
        }
        self.check_tokens(tokens)?;
        self.staged = 0;
        self.reserve(t)?;
        let meta: Vec<u32> = std::iter::once(self.len as u32).chain(tokens.iter().copied()).collect();
        self.model.gpu.upload(self.s.meta.ptr, &meta)?;
        let first = if want.all_positions { 0 } else { t - 1 };
        self.hid_first = first;
        let megakernel = t <= MK_MAX_TOKENS && self.use_graphs && self.decode == Decode::Megakernel;
        if megakernel {
            self.megakernel_pass(t, first, 0)?;
        } else if t == 1 && self.use_graphs {
            self.decode_graph()?;
        } else {
            self.run(t, first)?;
        }
        self.staged = t;
        let n = t - first;
        let v = vocab;
        let mut ids = vec![0u32; n];
        self.model.gpu.download(&mut ids, self.s.ids.ptr)?;
        if megakernel {
            self.check_megakernel(self.mk_last)?;
        }
        let gpu = &self.model.gpu;
        if megakernel {
            // MEGAGEMMA_CUDA_MK_TRACE=FILE: each traced step overwrites FILE (tools/mk_trace.py).
            if let Some(path) = &self.trace_file {
                if let Some(t) = self.megakernels[self.mk_last].1.trace(gpu)? {
                    std::fs::write(path, t.to_json())
                        .map_err(|e| megagemma_model::Error::msg(format!("{}: {e}", path.display())))?;
                }
            }
        }
        let mut logits = vec![];
        if want.logits {
            logits = vec![0f32; n * v];
            gpu.download(&mut logits, self.s.logits.ptr)?;
        }
        Ok(ids
            .into_iter()
            .enumerate()
            .map(|(i, argmax)| PosOut { argmax, logits: want.logits.then(|| logits[i * v..(i + 1) * v].to_vec()) })
            .collect())
    }

    /// Tokens per prefill chunk: `MEGAGEMMA_CUDA_PREFILL_CHUNK` (default 1024) or as set, with
    /// cuBLAS; at most [`MAX_VERIFY`] without.
    pub fn prefill_chunk(&self) -> usize {
        if self.long_pass(MAX_VERIFY) {
            self.prefill_chunk
        } else {
            self.prefill_chunk.min(MAX_VERIFY)
        }
    }

    /// Sets the prefill chunk (clamped to 1 ..= [`MAX_CHUNK`]).
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.clamp(1, MAX_CHUNK);
    }

    /// Forward over `tokens` in chunks of at most [`CudaSeq::prefill_chunk`] tokens, committing
    /// each; returns the last position's output.
    pub fn prefill(&mut self, tokens: &[u32], logits: bool) -> Result<PosOut> {
        let mut last = None;
        for chunk in tokens.chunks(self.prefill_chunk()) {
            last = self.forward(chunk, Want { all_positions: false, logits })?.pop();
            self.commit(chunk.len())?;
        }
        last.ok_or_else(|| megagemma_model::Error::msg("empty input: at least one token is needed"))
    }

    /// Makes the first `accepted` staged rows part of the cache and drops the rest.
    pub fn commit(&mut self, accepted: usize) -> Result<()> {
        if accepted > self.staged {
            bail!("cannot commit {accepted} rows: only {} are staged", self.staged);
        }
        if accepted > 0 && self.kv_layers > 0 {
            let args = [Arg::Ptr(self.kv_table.ptr), Arg::I32(accepted as i32), Arg::I32(self.len as i32)];
            self.model.gpu.launch_2d("kv_commit", (2 * self.kv_layers as u32, accepted as u32), 128, 0, &args)?;
        }
        self.len += accepted;
        self.staged = 0;
        if accepted > 0 {
            self.keep_hidden_of(accepted - 1)?;
        }
        Ok(())
    }

    /// Forgets positions `len ..` (and anything staged). Sliding rings can only roll back as far
    /// as they still hold the window of the new last position.
    pub fn truncate_to(&mut self, len: usize) -> Result<()> {
        self.staged = 0;
        if len > self.len {
            bail!("cannot truncate to {len}: only {} positions are cached", self.len);
        }
        for (lp, c) in self.model.plan.layers.iter().zip(&self.caches) {
            if let (Some(c), Some(w)) = (c, lp.window) {
                if c.ring > 0 && len > 0 && (len + 1).saturating_sub(w) < self.len.saturating_sub(c.ring) {
                    bail!(
                        "cannot roll back from {} to {len}: the sliding-window cache no longer holds position {}",
                        self.len,
                        (len + 1).saturating_sub(w)
                    );
                }
            }
        }
        if len != self.len {
            // The hidden state of position len − 1 is gone; a drafter needs a fresh pass first.
            self.has_hidden = false;
        }
        self.len = len;
        Ok(())
    }
}

#[cfg(test)]
mod attention_split_tests {
    use super::AttentionSplit;
    use crate::device::ATT_SPLIT_KEYS;

    /// The value of `#define NAME v` in attention.cu.
    fn kernel_define(name: &str) -> usize {
        crate::compile::kernel_define("attention.cu", name).parse().expect(name)
    }

    /// The host sizes the grid and the shared memory from the split the kernel computes for
    /// itself (from the same `split_keys`, an argument): the two must agree (a kernel splitting into more keys per block than the host's
    /// `keys_per_block` overruns its shared memory; into more splits than `grid_splits`, skips keys).
    #[test]
    fn host_split_matches_the_kernel() {
        assert_eq!(AttentionSplit::FEW_TOKENS, kernel_define("ATT_FEW_TOKENS"));
        assert_eq!(AttentionSplit::MAX_SPLITS, kernel_define("ATT_MAX_SPLITS"));
        assert_eq!(AttentionSplit::LONG_SPLITS, kernel_define("ATT_LONG_SPLITS"));
        // The kernel's split of n keys (att_splits) fits the host's grid and shared memory.
        for (t, split_keys) in [1, 4, 8, 9, 64].into_iter().flat_map(|t| [1, 16, ATT_SPLIT_KEYS, 64].map(|k| (t, k))) {
            for max_keys in [1, 31, 32, 33, 200, 512, 4096, 131072] {
                let host = AttentionSplit::new(max_keys, t, split_keys);
                for n in 1..=max_keys.min(5000) {
                    let cap = AttentionSplit::cap(t);
                    let nsplit = n.div_ceil(split_keys).min(cap);
                    assert!(nsplit <= host.grid_splits, "t {t} max_keys {max_keys} n {n}");
                    assert!(n.div_ceil(nsplit) <= host.keys_per_block, "t {t} max_keys {max_keys} n {n}");
                }
            }
        }
    }

    /// The host's fused-norm flags, batch size and column table are the kernel's.
    #[test]
    fn host_attention_arguments_match_the_kernel() {
        assert_eq!(super::ATT_FUSED_Q as usize, kernel_define("ATT_FUSED_Q"));
        assert_eq!(super::ATT_FUSED_KV as usize, kernel_define("ATT_FUSED_KV"));
        assert_eq!(super::ATT_FUSED_VNORM as usize, kernel_define("ATT_FUSED_VNORM"));
        // struct AttColumn: four pointers, then the position and the ring, as AttColumnDesc.
        assert_eq!(std::mem::size_of::<super::AttColumnDesc>(), 40);
        let src = include_str!("../kernels/attention.cu");
        let body = &src[src.find("struct AttColumn {").expect("struct AttColumn")..];
        let fields: Vec<&str> = body.lines().skip(1).take_while(|l| !l.starts_with('}')).map(str::trim).collect();
        let want = ["const float* kc;", "const float* vc;", "float* ks;", "float* vs;", "int pos;", "int ring;"];
        assert_eq!(fields, want);
    }
}

#[cfg(test)]
mod small_div_tests {
    /// `SmallDiv` in kernels/matvec_mma.cu, operation by operation: the reciprocal rounded to
    /// nearest (`__frcp_rn`), the product rounded toward zero (`__fmul_rz`; exact in f64 first, as
    /// 24 × 24 bits fit), truncation, then one correction step either way.
    fn small_div(a: u32, d: u32) -> u32 {
        let inv = 1.0f32 / d as f32;
        let exact = a as f64 * inv as f64;
        let mut p = exact as f32;
        if p as f64 > exact {
            p = f32::from_bits(p.to_bits() - 1); // toward zero (p > 0 here)
        }
        let mut q = p as u32;
        q -= u32::from(q * d > a);
        q += u32::from((q + 1) * d <= a);
        q
    }

    /// One correction step is enough: exact for every divisor the input build uses (a token's
    /// float4s, 16 to 704 at 44 chunks) over every index it divides, and across the claimed range
    /// a < 2^20 on a sample.
    #[test]
    fn one_correction_is_exact() {
        for d in 1..=1024u32 {
            for a in 0..(1u32 << 14) {
                assert_eq!(small_div(a, d), a / d, "{a} / {d}");
            }
            for a in (0..(1u32 << 20)).step_by(1009) {
                assert_eq!(small_div(a, d), a / d, "{a} / {d}");
            }
        }
    }
}
