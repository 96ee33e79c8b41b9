//! [`CudaSeq`]: one sequence's KV cache and scratch, and the forward pass over a chunk of tokens.
//!
//! Stage order and arithmetic follow the CPU reference (`megagemma_model::cpu::forward`) step by
//! step. A pass over T tokens at positions `len .. len+T` writes its K/V rows into per-layer
//! staging buffers, never into the cache: [`CudaSeq::commit`] copies the accepted rows in
//! afterwards, so a candidate never overwrites a ring slot a query may still need.

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

/// The device side of pipelined sampled decoding: the candidate blocks' survivors, the no-finite-
/// logit flag, and one uniform per position of the sequence (the draw of the step at position p
/// reads `uniforms[p]`, uploaded before the loop).
struct SampleBuf {
    keys: DevBuf,
    flag: DevBuf,
    uniforms: DevBuf,
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

    /// Greedy decoding from `token` (fed at position `len()`): `max` decode steps at most, each
    /// committed, `on_token` given every step's argmax in order and returning whether to go on.
    /// Returns the steps committed. The same steps and ids as `step` in a loop, pipelined (graph
    /// and megakernel alike): each step leaves its argmax and the next position on the device
    /// (`kv_commit_step`), so the next step is queued before the host has read this one's token
    /// and the GPU does not wait for the host between tokens (25–43 µs a token on the H200,
    /// `gpu_check verifycost`). The megakernel's error flags are read once, at the end. When the host stops early, the step queued ahead is taken back:
    /// its position is not counted and its ring rows are restored (`kv_restore`).
    pub fn decode_greedy(&mut self, token: u32, max: usize, on_token: &mut dyn FnMut(u32) -> bool) -> Result<usize> {
        if self.len + max > self.max_len {
            bail!("position {} is past this sequence's maximum length {}", self.len + max - 1, self.max_len);
        }
        // Traced megakernel steps and sequences keeping hidden states (the drafter's: a step taken
        // back would leave its hidden state) step one token at a time.
        let traced = self.decode == Decode::Megakernel && self.trace_megakernel;
        if !self.pipeline || !self.use_graphs || traced || self.kv_layers == 0 || self.keep_hidden {
            let mut tok = token;
            for i in 0..max {
                tok = self.step(tok, false)?.argmax;
                if !on_token(tok) {
                    return Ok(i + 1);
                }
            }
            return Ok(max);
        }
        if max == 0 {
            return Ok(0);
        }
        self.start_steps(token)?;
        let tables = self.prepare_step_launches()?;
        self.pipelined(token, max, StepGraphs::Greedy(tables), on_token)
    }

    /// Before a pipelined loop from `token`: the token checked, nothing staged, scratch for
    /// single-token passes.
    fn start_steps(&mut self, token: u32) -> Result<()> {
        self.check_tokens(&[token])?;
        self.staged = 0;
        self.reserve(1)
    }

    /// Whether `decode_sampled` runs here with `params`: the device draw on (`device_draw`), the
    /// pipelined graph path, a top-k the device selection serves, and no hidden state to keep
    /// (a step queued ahead and taken back would leave it). Elsewhere sampled decoding steps one
    /// token at a time through the backend (`megagemma_model::backend::decode_sampled_steps`).
    pub fn draws_on_device(&self, params: &DrawParams) -> bool {
        self.device_draw
            && self.pipeline
            && self.use_graphs
            && self.decode == Decode::Graph
            && self.kv_layers > 0
            && !self.keep_hidden
            && candidates_on_device(self.model.plan.vocab_size, params.top_k)
    }

    /// Sampled decoding from `token` (fed at position `len()`) where `draws_on_device`: one
    /// committed step per uniform, step i's token drawn with `uniforms[i]` from its `params.top_k`
    /// highest logits, `on_token` given each token in order and returning whether to go on.
    /// Returns the steps committed. It is `decode_greedy`'s pipelined loop with the draw on the
    /// device (`sample_draw`: `megagemma_model::draw::draw_candidates`' arithmetic, operation for
    /// operation) before each step's commit, so the next step is queued before the host has the
    /// token: the tokens of `decode_sampled_steps`.
    pub fn decode_sampled(
        &mut self,
        token: u32,
        params: &DrawParams,
        uniforms: &[f64],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        check_draw(params)?;
        if !self.draws_on_device(params) {
            bail!("this sequence does not draw sampled tokens on the device (CudaSeq::draws_on_device)");
        }
        let max = uniforms.len();
        if self.len + max > self.max_len {
            bail!("position {} is past this sequence's maximum length {}", self.len + max - 1, self.max_len);
        }
        if max == 0 {
            return Ok(0);
        }
        self.start_steps(token)?;
        let len = self.len as u64;
        let buf = self.sample_buffers()?;
        let (uniforms_at, flag) = (buf.uniforms.ptr + len * 8, buf.flag.ptr);
        self.model.gpu.upload(uniforms_at, uniforms)?;
        self.model.gpu.upload(flag, &[0u32])?;
        if self.sample_graphs.as_ref().is_none_or(|(p, _)| p != params) {
            self.sample_graphs = None;
            self.commit_in_step = true;
            self.sample_stage = Some(*params);
            let captured = (|| -> Result<[CudaGraph; 2]> {
                let a = self.capture(|| self.run_step())?;
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                let b = self.capture(|| self.run_step());
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                Ok([a, b?])
            })();
            self.sample_stage = None;
            self.commit_in_step = false;
            self.sample_graphs = Some((*params, captured?));
        }
        let ran = self.pipelined(token, max, StepGraphs::Sampled, on_token)?;
        let mut set = [0u32];
        self.model.gpu.download(&mut set, flag)?;
        if set[0] != 0 {
            return Err(no_finite_logit());
        }
        Ok(ran)
    }

    /// The device's draw of a sampled step, after its pass (`sample_draw`: the candidate blocks'
    /// survivors of row 0 merged, then drawn with the uniform of the step's position).
    fn draw_on_device(&self, params: &DrawParams) -> Result<()> {
        let buf = self.sample_buf.as_ref().ok_or_else(|| megagemma_model::Error::msg("sampling buffers missing"))?;
        let vocab = self.model.plan.vocab_size;
        debug_assert!(candidates_on_device(vocab, params.top_k), "draws_on_device checked the top-k");
        let at = DrawBuffers {
            keys: buf.keys.ptr,
            uniforms: buf.uniforms.ptr,
            meta: self.s.meta.ptr,
            ids: self.s.ids.ptr,
            flag: buf.flag.ptr,
        };
        launch_draw(self.gpu(), self.s.logits.ptr, vocab, params, &at)
    }

    /// `decode_sampled`'s device buffers, allocated on first use for the sequence's whole length.
    fn sample_buffers(&mut self) -> Result<&SampleBuf> {
        if self.sample_buf.is_none() {
            let gpu = &self.model.gpu;
            self.sample_buf = Some(SampleBuf {
                keys: gpu.alloc(survivors(self.model.plan.vocab_size, MAX_CANDIDATES) * 8)?,
                flag: gpu.alloc_zeros(4)?,
                uniforms: gpu.alloc_zeros(self.max_len.max(1) * 8)?,
            });
        }
        Ok(self.sample_buf.as_ref().expect("allocated above"))
    }

    /// The pipelined loop of `decode_greedy` and `decode_sampled` from `token` at position
    /// `len()`, up to `max` committed steps, launched as `graphs` says.
    fn pipelined(
        &mut self,
        token: u32,
        max: usize,
        graphs: StepGraphs,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        let tables = match graphs {
            StepGraphs::Greedy(t) => t,
            StepGraphs::Sampled => None,
        };
        self.model.gpu.upload(self.s.meta.ptr, &[self.len as u32, token])?;
        // Step i runs graph (or megakernel table) i % 2 (the second reads the meta the first
        // wrote, and the other way round); one step is queued ahead of the one waited for.
        let (mut queued, mut done) = (0, 0);
        let first = self.len;
        let ran = (|| -> Result<usize> {
            loop {
                while queued < max && queued <= done + 1 {
                    self.step_log.clear(first + queued);
                    self.launch_step(queued % 2, graphs)?;
                    queued += 1;
                }
                let id = self.wait_step_token(self.len)?;
                self.len += 1;
                done += 1;
                if !on_token(id) || done == max {
                    return Ok(done);
                }
            }
        })();
        if queued > done {
            // The step queued ahead committed its row at position len: put back the ring rows
            // it replaced (a full cache's row past len is unused).
            let args = [Arg::Ptr(self.kv_table.ptr), Arg::I32(self.len as i32)];
            self.gpu().launch("kv_restore", 2 * self.kv_layers as u32, 128, 0, &args)?;
        }
        self.model.gpu.sync()?;
        if let Some(tables) = tables {
            // A wait that timed out is the error to report (it also explains a missing token).
            for i in tables {
                self.megakernels[i].1.check(&self.model.gpu)?;
            }
            self.mk_last = tables[0];
        }
        ran
    }

    /// The two launches of the pipelined loop: the committed decode step (`decode_graph[1]`, or
    /// its megakernel table) and the same with its meta buffers swapped (`ahead_graph`, or the
    /// `ahead` table); the tables' indices on the megakernel path.
    fn prepare_step_launches(&mut self) -> Result<Option<[usize; 2]>> {
        self.commit_in_step = true;
        let prepared = (|| {
            if self.decode == Decode::Megakernel {
                let pass = |ahead| MkPass { tokens: 1, first: 0, commit: true, ahead, batched: false };
                return Ok(Some([self.megakernel_table(pass(false))?, self.megakernel_table(pass(true))?]));
            }
            if self.decode_graph[1].is_none() {
                self.decode_graph[1] = Some(self.capture(|| self.run_step())?);
            }
            if self.ahead_graph.is_none() {
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                let g = self.capture(|| self.run_step());
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                self.ahead_graph = Some(g?);
            }
            Ok(None)
        })();
        self.commit_in_step = false;
        prepared
    }

    /// Queues pipelined step `which` of `graphs`: greedy, `decode_graph[1]` (0) or `ahead_graph`
    /// (1), on the megakernel path the launch of table `tables[which]`; sampled, `sample_graphs`'
    /// graph `which`.
    fn launch_step(&mut self, which: usize, graphs: StepGraphs) -> Result<()> {
        let g = match graphs {
            StepGraphs::Greedy(Some(t)) => return self.megakernels[t[which]].1.launch(&self.model.gpu, 0),
            StepGraphs::Greedy(None) => if which == 0 { &self.decode_graph[1] } else { &self.ahead_graph }.as_ref(),
            StepGraphs::Sampled => self.sample_graphs.as_ref().map(|(_, g)| &g[which]),
        };
        let g = g.ok_or_else(|| megagemma_model::Error::msg("pipelined step graph not captured"))?;
        self.model.gpu.count_launch();
        g.launch().map_err(|e| cuda_err("graph launch", e))
    }

    /// The argmax of the queued decode step at position `pos`, once its tagged slot of the step
    /// log arrives (polled: no event between the steps' graphs). A step that failed, or a stream
    /// that went idle without the slot, is an error.
    fn wait_step_token(&self, pos: usize) -> Result<u32> {
        let tag = pos as u64 + 1;
        let mut spins = 0u32;
        loop {
            let v = self.step_log.read(pos);
            if v >> 32 == tag {
                return Ok(v as u32);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && self.model.gpu.stream_done()? {
                let v = self.step_log.read(pos);
                if v >> 32 == tag {
                    return Ok(v as u32);
                }
                bail!("the decode step at position {pos} finished without handing its token over");
            }
            std::hint::spin_loop();
        }
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
        self.megakernels[self.mk_last].1.check(&self.model.gpu)
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
        self.megakernels[self.mk_last].1.check(&self.model.gpu)
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
        let gpu = &self.model.gpu;
        let mut ids = vec![0u32; n];
        gpu.download(&mut ids, self.s.ids.ptr)?;
        if megakernel {
            self.megakernels[self.mk_last].1.check(gpu)?;
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

    // ---- the forward, stage by stage ------------------------------------------------------

    pub(crate) fn gpu(&self) -> &Gpu {
        &self.model.gpu
    }

    pub(crate) fn cache(&self, layer: usize) -> Option<&LayerCache> {
        self.caches.get(layer).and_then(Option::as_ref)
    }

    pub(crate) fn scratch(&self) -> &Scratch {
        &self.s
    }

    /// `y[t] = W·x[t]` for `t` columns, in launches of up to eight columns (each column's
    /// arithmetic is independent of the others, so the split does not change any bit).
    pub(crate) fn matvec(&self, w: &DevMat, x: u64, y: u64, t: usize) -> Result<()> {
        self.matvec_impl(w, x, None, y, t)
    }

    /// `y[t] = W·(gelu(x[t]) · gate[t])`: fused into the 4-bit kernel, else a separate pass over `x`.
    pub(crate) fn matvec_gated(&self, w: &DevMat, x: u64, gate: Gate, y: u64, t: usize) -> Result<()> {
        self.matvec_impl(w, x, Some(gate), y, t)
    }

    /// Whether `w` takes the 4-bit many-rows-per-warp kernel (16-aligned rows).
    fn q4_fast(w: &DevMat) -> bool {
        w.fmt == FMT_Q4 && (w.cols as usize).is_multiple_of(16)
    }

    /// Warps sharing a row group: each warp takes its 512-column chunks in order and should
    /// get at least two, unless that leaves SMs idle (few rows): then up to one chunk per warp.
    /// Depends only on the shape (and the GPU), never on the number of columns of x.
    fn warps_per_rows(&self, rows: usize, cols: usize) -> usize {
        let chunks = cols.div_ceil(512);
        let mut wpr = [8, 4, 2, 1].into_iter().find(|&w| 2 * w <= chunks).unwrap_or(1);
        while wpr < 8 && 2 * wpr <= chunks && rows.div_ceil(8 * (8 / wpr)) < self.gpu().sms as usize {
            wpr *= 2;
        }
        wpr
    }

    /// Blocks launched for `nblocks` virtual blocks of the 4-bit kernels: at most
    /// `blocks_per_sm` per SM, each looping over its share.
    fn q4_grid(&self, nblocks: usize) -> u32 {
        nblocks.min(self.gpu().q4_stream.blocks_per_sm * self.gpu().sms as usize) as u32
    }

    /// How the tensor-core kernel splits a launch (`mma_split`), or `MEGAGEMMA_CUDA_MMA_SPLITS`'s
    /// split for the shape when it names one the kernel can run.
    fn mma_split(&self, tiles: &[usize], cols: usize, gated: bool) -> MmaSplit {
        let q = &self.gpu().q4_stream;
        let round = q.mma_waves * q.mma_blocks_per_sm * self.gpu().sms as usize;
        if let Some(split) = split_override(tiles[0] * 16, cols) {
            if split_runs(tiles, cols, split) {
                return split;
            }
        }
        mma_split(tiles, cols, gated, round, q.mma_part_chunks, q.mma_fill)
    }

    /// Tensor-core 4-bit matvecs (`kernels/matvec_mma.cu`) of up to three tiled matrices of the
    /// same width and group class on the same input, or one gated matrix: launches of ≤ 8 columns.
    /// With `res` (plain launches only), the pending residual step of rows `row0 ..` is folded into
    /// the input (`x` unused): each launch's block 0 writes the new residual to the other buffer.
    fn matvec_mma(
        &self,
        mats: &[(&DevMat, u64)],
        x: u64,
        gate: Option<Gate>,
        t: usize,
        res: Option<(PendingNorm, usize)>,
        prep: bool,
    ) -> Result<()> {
        let (w0, y0) = mats[0];
        let cols = w0.cols as usize;
        let tiles: Vec<usize> = mats.iter().map(|(w, _)| (w.rows as usize).div_ceil(16)).collect();
        let split = self.mma_split(&tiles, cols, gate.is_some());
        let nb: Vec<usize> = tiles.iter().map(|&t| split.matrix_blocks(t)).collect();
        let nblocks: usize = nb.iter().sum();
        let grid = nblocks.min(self.gpu().q4_stream.mma_blocks_per_sm * self.gpu().sms as usize) as u32;
        // L2 requests for the next virtual block (`MEGAGEMMA_CUDA_MMA_AHEAD`, default none) only
        // in passes of several tokens, and only while a launch runs at most two rounds of virtual
        // blocks. Single-token passes load their first weights into registers before the wait,
        // and without the requests they are faster (fourteenth session: megakernel E4B -4%, E2B
        // -2.6%, graph E2B -0.7%, E4B +-0); since the twenty-fourth session passes of several
        // tokens go without them too (verify 2-4% faster, `Q4Stream::mma_ahead`). The LM head's
        // 2,048 virtual blocks (E4B) asked a round ahead are ~54 MB, more than L2 holds, and
        // evicted lines were read twice (Nsight Compute: 561 MB read for its 419, 155 µs; with
        // none 419 MB, 119 µs).
        let ahead = if t == 1 || nblocks > 2 * grid as usize { 0 } else { self.gpu().q4_stream.mma_ahead as i32 };
        let chunks = cols.div_ceil(64);
        let upc = if w0.gs == 32 { 2 } else { 1 };
        let (partial, counters) = (Arg::Ptr(self.s.mma_partial.ptr), Arg::Ptr(self.s.mma_counters.ptr));
        for c0 in (0..t).step_by(MATVEC_COLS) {
            let m = MATVEC_COLS.min(t - c0);
            let h = m.div_ceil(4);
            // Input fragments and per-unit sums per 64-column chunk.
            let slice = chunks.min(MMA_SLICE_BYTES / mma_chunk_bytes(h, upc));
            // The ring form is for launched passes only: a megakernel's stage table records the
            // register form's names (it inlines the ring itself).
            let ring = self.gpu().q4_stream.mma_ring && h == 1 && !self.gpu().is_recording() && !prep;
            let ring_bytes = if ring { mma_ring_bytes(upc as u32) } else { 0 };
            let smem = (slice * mma_chunk_bytes(h, upc)) as u32 + ring_bytes;
            // Single-token launches run the entries built for one token (not recorded into a
            // megakernel's stage table, which dispatches the four-token names).
            let one = self.gpu().q4_stream.mma_one && m == 1 && !ring && !prep && !self.gpu().is_recording();
            let name = match (prep, one) {
                (true, _) => mma_prep_kernels(h, upc == 2).1,
                (false, true) => mma_one_kernel(upc == 2, gate.is_some()),
                (false, false) => mma_kernel(h, upc == 2, gate.is_some(), ring),
            };
            let yp = |y: u64, w: &DevMat| if y == 0 { 0 } else { y + f32s(c0 * w.rows as usize) as u64 };
            let xp = x + f32s(c0 * cols) as u64;
            // Both entry points take (columns, warps per tile, column parts, virtual blocks, blocks
            // ahead, partial sums, counters) after their matrices and pointers; the gated one then
            // takes the gate.
            let split = [
                Arg::I32(m as i32),
                Arg::I32(split.arg()),
                Arg::I32(split.parts as i32),
                Arg::I32(nblocks as i32),
                Arg::I32(ahead),
                partial,
                counters,
            ];
            match gate {
                Some(g) => {
                    let gate = [Arg::Ptr(g.ptr + f32s(c0 * g.stride) as u64), Arg::I32(g.stride as i32)];
                    let head: [Arg; 10] = join([Arg::Mat(*w0), Arg::Ptr(xp), Arg::Ptr(yp(y0, w0))], split);
                    let args: [Arg; 12] = join(head, gate);
                    self.gpu().launch(name, grid, 256, smem, &args)?;
                }
                None => {
                    let (w1, y1) = mats.get(1).copied().unwrap_or((w0, 0));
                    let (w2, y2) = mats.get(2).copied().unwrap_or((w0, 0));
                    let head = [
                        Arg::Mat(*w0),
                        Arg::Mat(*w1),
                        Arg::Mat(*w2),
                        Arg::Ptr(xp),
                        Arg::Ptr(yp(y0, w0)),
                        Arg::Ptr(yp(y1, w1)),
                        Arg::Ptr(yp(y2, w2)),
                        Arg::I32(nb[0] as i32),
                        Arg::I32(nb.get(1).copied().unwrap_or(0) as i32),
                    ];
                    let args: [Arg; 16] = join(head, split);
                    if prep {
                        // `x` is the prepared inputs of the whole pass (one launch: t ≤ 8).
                        self.gpu().launch(name, grid, 256, smem, &args)?;
                    } else {
                        let args: [Arg; 23] = join(args, self.residual_args(res, c0, cols));
                        self.gpu().launch(name, grid, 256, smem, &args)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `x[t][i] = gelu(x[t][i]) · gate[t][i]` over `t` rows of `cols` (the GeGLU), in place: before
    /// a matvec whose kernel cannot apply the gate itself, and for the MoE experts.
    fn gelu_gate_in_place(&self, x: u64, g: Gate, cols: usize, t: usize) -> Result<()> {
        let args = [Arg::Ptr(x), Arg::Ptr(g.ptr), Arg::I32(cols as i32), Arg::I32(g.stride as i32), Arg::I32(t as i32)];
        self.elementwise("gelu_gate", t * cols, &args)
    }

    /// Whether these matrices (same input) take one tensor-core matvec launch per eight columns.
    fn one_mma_launch(&self, mats: &[(&DevMat, u64)]) -> bool {
        let (cols, g32) = (mats[0].0.cols, mats[0].0.gs == 32);
        let one_part = (cols as usize).div_ceil(64) <= self.gpu().q4_stream.mma_part_chunks;
        mats.len() <= 3
            && (mats.len() == 1 || one_part)
            && mats.iter().all(|(w, _)| w.fmt == FMT_Q4T && w.cols == cols && (w.gs == 32) == g32)
    }

    /// The residual stream's buffer at this point of the pass being launched.
    fn xcur(&self) -> u64 {
        if self.x_in_x2.get() {
            self.s.x2.ptr
        } else {
            self.s.x.ptr
        }
    }

    /// The residual buffer a step that does not write in place writes (the one `xcur` is not).
    fn xother(&self) -> u64 {
        if self.x_in_x2.get() {
            self.s.x.ptr
        } else {
            self.s.x2.ptr
        }
    }

    /// The plain tensor-core entry points' trailing `Residual` arguments for the launch of columns
    /// `c0 ..` (all zero without one).
    fn residual_args(&self, res: Option<(PendingNorm, usize)>, c0: usize, cols: usize) -> [Arg; 7] {
        let eps = self.model.plan.eps;
        let Some((p, row0)) = res else {
            return [Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::F32(1.0), Arg::F32(eps)];
        };
        // The folded step reads the current residual buffer and writes the other.
        let (xin, xout) = (self.xcur(), self.xother());
        let at = f32s((row0 + c0) * cols) as u64;
        [
            Arg::Ptr(xin + at),
            Arg::Ptr(p.o + at),
            Arg::Ptr(p.w1),
            Arg::Ptr(p.w2),
            Arg::Ptr(xout + at),
            Arg::F32(p.scale),
            Arg::F32(eps),
        ]
    }

    /// `y_i = W_i·x` (as `matvec_many`) after the pending residual step, if any: folded into the
    /// matvec in single-token passes when it is one tensor-core launch on hidden-wide rows (`x` is then the step's output
    /// by construction: its norm, or the new residual), else run first with `add_norm`. `row0`: the
    /// first row of the step the matvec reads (the LM head reads the wanted positions only).
    fn matvec_after(
        &self,
        mats: &[(&DevMat, u64)],
        x: u64,
        pending: Option<PendingNorm>,
        row0: usize,
        t: usize,
    ) -> Result<()> {
        let Some(p) = pending else { return self.matvec_many(mats, x, t) };
        let h = self.model.plan.hidden;
        // Single-token passes only: the folded step computes each token's row statistics in turn,
        // so a verify or short prefill pass of t tokens would pay t times its latency in every
        // block (measured: a 4-column verify 1.27x -> 1.49x a decode step). All tokens' statistics
        // in one pass over their rows was no better (twenty-third session: 3-column verify +16%,
        // and the code it adds made E4B decode 7.7% slower): every block then rebuilds each
        // token's inputs from x, o and both norm weights, where `add_norm` writes them once.
        if self.fold_norms && t == 1 && self.one_mma_launch(mats) && mats[0].0.cols as usize == h {
            self.matvec_mma(mats, 0, None, t, Some((p, row0)), false)?;
            self.x_in_x2.set(!self.x_in_x2.get());
            return Ok(());
        }
        // Three to eight tokens (one launch of each): the step prepares the inputs once, one block
        // per token, and the matvec copies them instead of building them in each of its blocks.
        let prep = self.prep_inputs
            && row0 == 0
            && (self.prep_min..=MATVEC_COLS).contains(&t)
            && !self.long_pass(t)
            && !self.gpu().is_recording()
            && self.one_mma_launch(mats)
            && mats[0].0.cols as usize == h;
        if prep {
            let (step, _) = mma_prep_kernels(t.div_ceil(4), mats[0].0.gs == 32);
            // Each token's row in slices of whole chunks, a block each: every block takes the
            // row's statistics, and writes and prepares its slice only (one block per token built
            // the whole row after its reductions, on the critical path of every residual step).
            self.add_norm(p, t, self.norm_slices(), Some((step, self.s.mma_prep.ptr)))?;
            return self.matvec_mma(mats, self.s.mma_prep.ptr, None, t, None, true);
        }
        // Otherwise the step runs first and the matvecs build their inputs from its output. Before
        // one hidden-wide tensor-core launch (the megakernel's passes of several tokens, whose
        // tables take no prepared-input entries) it runs in slices too, so no block writes a whole
        // row after its reductions.
        let sliced = row0 == 0 && !self.long_pass(t) && self.one_mma_launch(mats) && mats[0].0.cols as usize == h;
        self.add_norm(p, row0 + t, if sliced { self.norm_slices() } else { 1 }, None)?;
        // Without w2 the matvec's input is the new residual, which a sliced step wrote elsewhere.
        let x = if p.w2 == 0 { self.xcur() } else { x };
        self.matvec_many(mats, x, t)
    }

    /// Blocks per token of a sliced residual step: whole 64-column chunks each, about
    /// `MEGAGEMMA_CUDA_PREP_SLICES` of them (default 8; 1: the step in place, one block a token).
    fn norm_slices(&self) -> usize {
        let chunks = self.model.plan.hidden.div_ceil(64);
        chunks.div_ceil(chunks.div_ceil(self.prep_slices))
    }

    /// `y_i[t] = W_i·x[t]` for up to three matrices of the same width (Q/K/V, gate/up): one launch
    /// per eight columns when all are 4-bit in the same layout, else one matvec each.
    pub(crate) fn matvec_many(&self, mats: &[(&DevMat, u64)], x: u64, t: usize) -> Result<()> {
        if self.long_pass(t) && self.gemm(mats, x, None, t)? {
            return Ok(());
        }
        let cols = mats[0].0.cols;
        if self.one_mma_launch(mats) {
            return self.matvec_mma(mats, x, None, t, None, false);
        }
        if mats.len() > 1 && mats.iter().any(|(w, _)| w.fmt == FMT_Q4T) {
            return mats.iter().try_for_each(|(w, y)| self.matvec_impl(w, x, None, *y, t));
        }
        if mats.len() > 3 || !mats.iter().all(|(w, _)| Self::q4_fast(w) && w.cols == cols) {
            return mats.iter().try_for_each(|(w, y)| self.matvec_impl(w, x, None, *y, t));
        }
        let cols = cols as usize;
        let wpr = self.warps_per_rows(mats.iter().map(|(w, _)| w.rows as usize).sum(), cols);
        let blocks = |w: &DevMat| (w.rows as usize).div_ceil(8 * (8 / wpr));
        let (w0, y0) = mats[0];
        let (w1, y1) = mats.get(1).copied().unwrap_or((w0, 0));
        let (w2, y2) = mats.get(2).copied().unwrap_or((w0, 0));
        let nb0 = blocks(w0);
        let nb1 = if mats.len() > 1 { blocks(w1) } else { 0 };
        let nb2 = if mats.len() > 2 { blocks(w2) } else { 0 };
        let nblocks = nb0 + nb1 + nb2;
        for c0 in (0..t).step_by(MATVEC_COLS) {
            let m = MATVEC_COLS.min(t - c0);
            let yp = |y: u64, w: &DevMat| if y == 0 { 0 } else { y + f32s(c0 * w.rows as usize) as u64 };
            let args = [
                Arg::Mat(*w0),
                Arg::Mat(*w1),
                Arg::Mat(*w2),
                Arg::Ptr(x + f32s(c0 * cols) as u64),
                Arg::Ptr(yp(y0, w0)),
                Arg::Ptr(yp(y1, w1)),
                Arg::Ptr(yp(y2, w2)),
                Arg::I32(nb0 as i32),
                Arg::I32(nb1 as i32),
                Arg::I32(m as i32),
                Arg::I32(wpr as i32),
                Arg::I32(nblocks as i32),
                Arg::I32(self.gpu().q4_stream.ahead as i32),
            ];
            self.gpu().launch("matvec_q4", self.q4_grid(nblocks), 256, 0, &args)?;
        }
        Ok(())
    }

    fn matvec_impl(&self, w: &DevMat, x: u64, gate: Option<Gate>, y: u64, t: usize) -> Result<()> {
        if self.long_pass(t) && self.gemm(&[(w, y)], x, gate.map(|g| (g.ptr, g.stride)), t)? {
            return Ok(());
        }
        let (rows, cols) = (w.rows as usize, w.cols as usize);
        if w.fmt == FMT_Q4T {
            return match gate {
                None => self.matvec_mma(&[(w, y)], x, None, t, None, false),
                Some(g) if g.stride.is_multiple_of(4) => self.matvec_mma(&[(w, y)], x, gate, t, None, false),
                Some(g) => {
                    self.gelu_gate_in_place(x, g, cols, t)?;
                    self.matvec_mma(&[(w, y)], x, None, t, None, false)
                }
            };
        }
        let q4_fast = Self::q4_fast(w) && gate.is_none_or(|g| g.stride.is_multiple_of(4));
        match (gate, q4_fast) {
            (None, true) => return self.matvec_many(&[(w, y)], x, t),
            (Some(g), false) => self.gelu_gate_in_place(x, g, cols, t)?,
            _ => {}
        }
        let wpr = self.warps_per_rows(rows, cols);
        let nblocks = rows.div_ceil(8 * (8 / wpr));
        for c0 in (0..t).step_by(MATVEC_COLS) {
            let m = MATVEC_COLS.min(t - c0);
            let (xp, yp) = (x + f32s(c0 * cols) as u64, y + f32s(c0 * rows) as u64);
            match gate {
                Some(g) if q4_fast => {
                    let args = [
                        Arg::Mat(*w),
                        Arg::Ptr(xp),
                        Arg::Ptr(yp),
                        Arg::I32(m as i32),
                        Arg::I32(wpr as i32),
                        Arg::Ptr(g.ptr + f32s(c0 * g.stride) as u64),
                        Arg::I32(g.stride as i32),
                        Arg::I32(nblocks as i32),
                        Arg::I32(self.gpu().q4_stream.ahead as i32),
                    ];
                    self.gpu().launch("matvec_q4_gated", self.q4_grid(nblocks), 256, 0, &args)?;
                }
                _ => {
                    let grid = rows.div_ceil(MATVEC_ROWS_PER_BLOCK) as u32;
                    let args = [Arg::Mat(*w), Arg::Ptr(xp), Arg::Ptr(yp), Arg::I32(m as i32)];
                    self.gpu().launch("matvec", grid, (MATVEC_ROWS_PER_BLOCK * 32) as u32, 0, &args)?;
                }
            }
        }
        Ok(())
    }

    /// RMSNorm of `chunks` chunks of `dim`: `y = x̂·w` (add: `y += x̂·w`); `w = 0` for no weight.
    fn norm(&self, y: u64, x: u64, w: u64, dim: usize, chunks: usize, add: bool) -> Result<()> {
        let block = 256;
        let eps = self.model.plan.eps;
        let args = [Arg::Ptr(y), Arg::Ptr(x), Arg::Ptr(w), Arg::I32(dim as i32), Arg::F32(eps), Arg::I32(add as i32)];
        self.gpu().launch("rms_norm", chunks as u32, block, 0, &args)
    }

    pub(crate) fn elementwise(&self, name: &str, n: usize, args: &[Arg]) -> Result<()> {
        self.gpu().launch(name, n.div_ceil(256) as u32, 256, 0, args)
    }

    /// The whole pass over `t` staged tokens; logits and argmax of positions `first .. t` land in
    /// rows `0 .. t − first` of `s.logits` / `s.ids`.
    fn run(&self, t: usize, first: usize) -> Result<()> {
        let m = &*self.model;
        let (plan, w, s) = (&m.plan, m.weights(), &self.s);
        let h = plan.hidden;
        self.x_in_x2.set(false);

        // §2.1 embedding · sqrt(H).
        let args = [Arg::Mat(w.embed), Arg::Ptr(s.meta.at(4)), Arg::Ptr(s.x.ptr), Arg::F32(plan.embed_scale)];
        self.gpu().launch("embed_gather", gather_blocks(t, h), GATHER_THREADS, 0, &args)?;

        // §2.2 per-layer inputs [T, L·P].
        if let Some(ple) = &w.ple {
            let (p, lpw) = (plan.ple_dim, plan.layers.len() * plan.ple_dim);
            self.matvec(&ple.proj, s.x.ptr, s.pli.ptr, t)?;
            let proj_scale = (h as f64).powf(-0.5) as f32;
            self.elementwise(
                "scale",
                t * lpw,
                &[Arg::Ptr(s.pli.ptr), Arg::F32(proj_scale), Arg::U64((t * lpw) as u64)],
            )?;
            self.norm(s.pli.ptr, s.pli.ptr, ple.norm, p, t * plan.layers.len(), false)?;
            let embed_scale = (p as f64).sqrt() as f32;
            let input_scale = std::f64::consts::FRAC_1_SQRT_2 as f32;
            let args = [
                Arg::Ptr(s.pli.ptr),
                Arg::Mat(ple.table),
                Arg::Ptr(s.meta.at(4)),
                Arg::F32(embed_scale),
                Arg::F32(input_scale),
            ];
            self.gpu().launch("ple_combine", gather_blocks(t, lpw), GATHER_THREADS, 0, &args)?;
        }

        // Each layer starts with `a` = its input norm of `x` (or that step pending) and ends with
        // the residual step whose norm is the next layer's (or the final) input, pending.
        self.norm(s.a.ptr, s.x.ptr, w.layers[0].input_norm, h, t, false)?;
        let mut pending = None;
        for (i, (lp, lw)) in plan.layers.iter().zip(&w.layers).enumerate() {
            let next_norm = w.layers.get(i + 1).map_or(w.final_norm, |l| l.input_norm);
            pending = Some(self.layer(lp, lw, next_norm, t, pending)?);
        }

        // §2.4 LM head on the final-normed wanted positions, softcap, argmax.
        let n = t - first;
        self.matvec_after(&[(&w.lm_head, s.logits.ptr)], s.a.at(f32s(first * h)), pending, first, n)?;
        let cap = plan.final_softcap.unwrap_or(0.0);
        let v = plan.vocab_size as i32;
        let args = [
            Arg::Ptr(s.logits.ptr),
            Arg::I32(v),
            Arg::F32(cap),
            Arg::Ptr(s.partial.ptr),
            Arg::I32(ARGMAX_SPLIT as i32),
        ];
        self.gpu().launch("softcap_argmax_partial", (n * ARGMAX_SPLIT) as u32, 256, 0, &args)?;
        let args = [Arg::Ptr(s.partial.ptr), Arg::I32(ARGMAX_SPLIT as i32), Arg::Ptr(s.ids.ptr)];
        self.gpu().launch("argmax_final", n as u32, 32, 0, &args)?;
        if self.keep_hidden {
            // The final residual of the wanted positions (the step the LM head folded or ran
            // wrote it to `xcur`), normed again for the drafter.
            self.norm(s.hid.ptr, self.xcur() + f32s(first * h) as u64, w.final_norm, h, n, false)?;
        }
        Ok(())
    }

    /// One decoder layer over `t` tokens; on entry `s.a` holds `x`'s input norm, or `pending` the
    /// residual step that gives it; returns the layer's last residual step (whose norm with
    /// `next_norm` is the next input), not run yet.
    fn layer(
        &self,
        lp: &LayerPlan,
        lw: &DevLayer,
        next_norm: u64,
        t: usize,
        pending: Option<PendingNorm>,
    ) -> Result<PendingNorm> {
        let m = &*self.model;
        let (plan, s) = (&m.plan, &self.s);
        let (h, hd, eps) = (plan.hidden, lp.head_dim, plan.eps);
        let pos = self.s.meta.ptr;

        // 3–15: Q, and on layers that own a cache K and V; q_norm + RoPE, k_norm + RoPE, v_norm;
        // attention over the source layer's cache. With `fuse_norms` (the megakernel's stage
        // table, by default) a pass of up to eight tokens keeps the projections raw (K/V in
        // `kr`/`vr`) and the attention kernel norms them (`AttentionNorms`; each block norms the
        // pass's keys in its range, so not for longer passes); otherwise K/V go straight into the
        // staging rows and `qkv_norm_rope` norms them in place first.
        let long = self.long_pass(t);
        let gpu = self.gpu();
        // A batched step's columns have their own positions: only the attention knows them.
        let batched = self.batched.get();
        let fused = !long
            && t <= AttentionSplit::FEW_TOKENS
            && (batched || gpu.fuse_norms.unwrap_or_else(|| gpu.is_recording()));
        let mut norms = AttentionNorms {
            fused: if fused { ATT_FUSED_Q } else { 0 },
            q_norm: lw.q_norm,
            inv_freq: lw.inv_freq,
            k_norm: 0,
            kr: 0,
            vr: 0,
        };
        // qkv_norm_rope's K and V arguments: rows, k_norm weight, heads, rows, heads (none: 0).
        let mut kv_norms = (0, 0, 0, 0, 0);
        match (&lw.k, lw.k_norm, &self.caches[lp.index]) {
            (Some(wk), Some(k_norm), Some(c)) => {
                let (k, v) = if fused { (s.kr.ptr, s.vr.ptr) } else { (c.staged_k.ptr, c.staged_v.ptr) };
                match &lw.v {
                    Some(wv) => self.matvec_after(&[(&lw.q, s.q.ptr), (wk, k), (wv, v)], s.a.ptr, pending, 0, t)?,
                    None => self.matvec_after(&[(&lw.q, s.q.ptr), (wk, k)], s.a.ptr, pending, 0, t)?,
                }
                let nv = if plan.v_norm { lp.num_kv_heads } else { 0 };
                // k_eq_v (no V projection): values are the raw key projection (before k_norm and RoPE).
                if fused {
                    norms.fused |= ATT_FUSED_KV | if nv > 0 { ATT_FUSED_VNORM } else { 0 };
                    (norms.k_norm, norms.kr, norms.vr) = (k_norm, k, if lw.v.is_some() { v } else { k });
                } else {
                    if lw.v.is_none() {
                        let n = t * c.width;
                        self.elementwise("copy", n, &[Arg::Ptr(v), Arg::Ptr(k), Arg::U64(n as u64)])?
                    }
                    kv_norms = (k, k_norm, lp.num_kv_heads, v, nv);
                }
            }
            _ => self.matvec_after(&[(&lw.q, s.q.ptr)], s.a.ptr, pending, 0, t)?,
        }
        if !fused {
            let (k, k_norm, nk, v, nv) = kv_norms;
            let args = [
                Arg::Ptr(s.q.ptr),
                Arg::Ptr(lw.q_norm),
                Arg::I32(lp.num_heads as i32),
                Arg::Ptr(k),
                Arg::Ptr(k_norm),
                Arg::I32(nk as i32),
                Arg::Ptr(v),
                Arg::I32(nv as i32),
                Arg::Ptr(lw.inv_freq),
                Arg::I32(hd as i32),
                Arg::Ptr(pos),
                Arg::I32(t as i32),
                Arg::F32(eps),
            ];
            self.gpu().launch("qkv_norm_rope", (t * (lp.num_heads + nk + nv)) as u32, 256, 0, &args)?;
        }
        if long {
            self.attention_long(lp, t)?;
        } else {
            self.attention(lp, t, &norms)?;
        }

        // O projection; the post-attention norm and residual, then the pre-feed-forward norm
        // (folded into the feed-forward's first matvec).
        self.matvec(&lw.o, s.att.ptr, s.o.ptr, t)?;
        let post_attn = PendingNorm { o: s.o.ptr, w1: lw.post_attn_norm, scale: 1.0, w2: lw.pre_ffn_norm };

        // 16–19: feed-forward (dense MLP, plus the MoE branch).
        self.mlp(&lw.gate, &lw.up, &lw.down, post_attn, s.f.ptr, t)?;
        if let Some(moe) = &lw.moe {
            self.norm(s.f.ptr, s.f.ptr, moe.post_norm_1, h, t, false)?;
            self.moe(moe, t)?;
            self.elementwise("add", t * h, &[Arg::Ptr(s.f.ptr), Arg::Ptr(s.e.ptr), Arg::U64((t * h) as u64)])?;
        }

        // 20–25: per-layer embedding injection, the per-layer scalar, the next norm.
        let post_ffn = PendingNorm { o: s.f.ptr, w1: lw.post_ffn_norm, scale: 1.0, w2: 0 };
        Ok(match &lw.ple {
            Some(ple) => {
                let p = plan.ple_dim;
                let lpw = plan.layers.len() * p;
                // The PLE gate reads the residual after the feed-forward step itself (no norm).
                self.matvec_after(&[(&ple.gate, s.pg.ptr)], self.xcur(), Some(post_ffn), 0, t)?;
                let gate = Gate { ptr: s.pli.at(f32s(lp.index * p)), stride: lpw };
                self.matvec_gated(&ple.proj, s.pg.ptr, gate, s.o.ptr, t)?;
                PendingNorm { o: s.o.ptr, w1: ple.post_norm, scale: lw.layer_scalar, w2: next_norm }
            }
            None => PendingNorm { scale: lw.layer_scalar, w2: next_norm, ..post_ffn },
        })
    }

    /// The residual step `p` of `t` rows — `x = (x + norm(o)·w1) · scale`, then `a = norm(x)·w2`
    /// when `w2` is non-zero — each row in `slices` blocks (`norm_slices`): in place with one, else
    /// x' into the other residual buffer, which becomes the current one. `prep`: run as the
    /// prepared-input entry given, which also writes the output's digit planes to the buffer given
    /// (`add_norm_prep_*`).
    fn add_norm(&self, p: PendingNorm, t: usize, slices: usize, prep: Option<(&str, u64)>) -> Result<()> {
        let (h, eps) = (self.model.plan.hidden, self.model.plan.eps);
        let x_out = if slices > 1 { self.xother() } else { self.xcur() };
        let mut args = vec![
            Arg::Ptr(self.xcur()),
            Arg::Ptr(p.o),
            Arg::Ptr(p.w1),
            Arg::F32(p.scale),
            Arg::Ptr(self.s.a.ptr),
            Arg::Ptr(p.w2),
            Arg::I32(h as i32),
            Arg::F32(eps),
        ];
        args.extend(prep.map(|(_, buf)| Arg::Ptr(buf)));
        args.extend([Arg::Ptr(x_out), Arg::I32(slices as i32)]);
        let kernel = prep.map_or("add_norm", |(step, _)| step);
        // 256 threads per row (every decode-step kernel has blocks of 256, as the megakernel runs them).
        self.gpu().launch(kernel, (t * slices) as u32, 256, 0, &args)?;
        if slices > 1 {
            self.x_in_x2.set(!self.x_in_x2.get());
        }
        Ok(())
    }

    /// Attention of the pass's `t` tokens over this sequence's cache, or in a batched step of
    /// each column over its own sequence's cache (the table `step_batch` uploaded).
    fn attention(&self, lp: &LayerPlan, t: usize, norms: &AttentionNorms) -> Result<()> {
        if self.batched.get() {
            let cols = self.s.att_cols.ptr + (lp.index * MAX_BATCH * std::mem::size_of::<AttColumnDesc>()) as u64;
            return self.attention_launch(lp, KvView::default(), t, norms, cols);
        }
        let Some(c) = &self.caches[lp.kv_source] else { bail!("layer {} has no KV cache", lp.kv_source) };
        self.attention_launch(lp, c.view(), t, norms, 0)
    }

    /// Attention of the pass's `t` tokens over the cache `c`, or (`cols` non-zero) over each
    /// column's cache from that table.
    fn attention_launch(&self, lp: &LayerPlan, c: KvView, t: usize, norms: &AttentionNorms, cols: u64) -> Result<()> {
        let s = &self.s;
        let io = AttIo {
            q: s.q.ptr,
            out: s.att.ptr,
            pos: s.meta.ptr,
            part_o: s.att_o.ptr,
            part_ml: s.att_ml.ptr,
            counters: s.att_counters.ptr,
            window: lp.window.unwrap_or(0),
            // Sized for the most keys any pass of this sequence can see, so a captured graph fits every step.
            max_keys: attention_keys(lp, self.max_len),
            scale: self.model.plan.attn_scale,
        };
        self.launch_attention(lp, c, t, norms, cols, &io)
    }

    /// The attention kernel over `io`'s buffers (the heads and head dim of `lp`).
    pub(crate) fn launch_attention(
        &self,
        lp: &LayerPlan,
        c: KvView,
        t: usize,
        norms: &AttentionNorms,
        cols: u64,
        io: &AttIo,
    ) -> Result<()> {
        if lp.head_dim > 512 || !lp.head_dim.is_multiple_of(4) {
            bail!("head dim {} is not one the attention kernel takes (a multiple of 4, at most 512)", lp.head_dim);
        }
        let split_keys = self.gpu().att_split_keys;
        let split = AttentionSplit::new(io.max_keys, t, split_keys);
        // The query, per-warp sums, with fused K/V norms the range's normed K/V rows, and scores.
        let staged_rows = if norms.fused & ATT_FUSED_KV != 0 { t.min(split.keys_per_block) } else { 0 };
        let smem = f32s(lp.head_dim * (1 + ATTENTION_WARPS + 2 * staged_rows) + split.keys_per_block);
        if smem > 200 * 1024 {
            bail!("attention needs {smem} bytes of shared memory per block (at most 200 KB)");
        }
        let args = [
            Arg::Ptr(io.q),
            Arg::Ptr(c.k),
            Arg::Ptr(c.v),
            Arg::Ptr(c.staged_k),
            Arg::Ptr(c.staged_v),
            Arg::Ptr(io.out),
            Arg::I32(lp.num_heads as i32),
            Arg::I32(lp.num_kv_heads as i32),
            Arg::I32(lp.head_dim as i32),
            Arg::Ptr(io.pos),
            Arg::I32(io.window as i32),
            Arg::I32(c.ring as i32),
            Arg::F32(io.scale),
            Arg::I32(t as i32),
            Arg::I32(split.grid_splits as i32),
            Arg::Ptr(io.part_o),
            Arg::Ptr(io.part_ml),
            Arg::Ptr(io.counters),
            Arg::I32(split_keys as i32),
            Arg::I32(norms.fused),
            Arg::Ptr(norms.q_norm),
            Arg::Ptr(norms.k_norm),
            Arg::Ptr(norms.inv_freq),
            Arg::F32(self.model.plan.eps),
            Arg::Ptr(norms.kr),
            Arg::Ptr(norms.vr),
            Arg::Ptr(cols),
        ];
        let grid = (t * lp.num_heads * split.grid_splits) as u32;
        // A decode step (one token, no column table) runs the entry built for its head dim; a
        // megakernel's stage table dispatches the general one.
        let one = self.gpu().att_one && t == 1 && cols == 0 && !self.gpu().is_recording();
        let name = match (one, lp.head_dim) {
            (true, 256) => "attention_1_256",
            (true, 512) => "attention_1_512",
            _ => "attention",
        };
        self.gpu().launch(name, grid, (ATTENTION_WARPS * 32) as u32, smem as u32, &args)
    }

    /// `out = down(gelu(gate·a) · up·a)` for `t` columns, `a` the input the pending residual
    /// step gives.
    fn mlp(&self, gate: &DevMat, up: &DevMat, down: &DevMat, pending: PendingNorm, out: u64, t: usize) -> Result<()> {
        let s = &self.s;
        self.matvec_after(&[(gate, s.g.ptr), (up, s.u.ptr)], s.a.ptr, Some(pending), 0, t)?;
        self.matvec_gated(down, s.g.ptr, Gate { ptr: s.u.ptr, stride: gate.rows as usize }, out, t)
    }

    /// MoE branch into `s.e`: route, run every expert on the pre-normed input, combine the top-k
    /// in routing order, `post_feedforward_layernorm_2`.
    fn moe(&self, moe: &DevMoe, t: usize) -> Result<()> {
        let (plan, s) = (&self.model.plan, &self.s);
        let h = plan.hidden;
        let e_count = moe.experts.len();
        let k = plan.moe_top_k.min(e_count);
        if e_count > 256 {
            bail!("{e_count} experts: the router kernel handles at most 256");
        }
        self.norm(s.zr.ptr, self.xcur(), 0, h, t, false)?;
        let root = (h as f64).powf(-0.5) as f32;
        let args =
            [Arg::Ptr(s.zr.ptr), Arg::Ptr(moe.router_scale), Arg::F32(root), Arg::I32(h as i32), Arg::I32(t as i32)];
        self.elementwise("router_scale", t * h, &args)?;
        self.matvec(&moe.router, s.zr.ptr, s.rl.ptr, t)?;
        let args = [
            Arg::Ptr(s.rl.ptr),
            Arg::Ptr(moe.per_expert_scale),
            Arg::Ptr(s.idx.ptr),
            Arg::Ptr(s.wts.ptr),
            Arg::I32(e_count as i32),
            Arg::I32(k as i32),
            Arg::I32(t as i32),
        ];
        // Blocks of 256 threads, as every stage the megakernel runs (one thread per token).
        self.gpu().launch("moe_route", t.div_ceil(256) as u32, 256, 0, &args)?;
        self.norm(s.a.ptr, self.xcur(), moe.pre_norm_2, h, t, false)?;
        // Only each token's k routed experts run: (token, slot) pairs p = t·k + s.
        let pairs = t * k;
        let inter = moe.experts[0][0].rows as usize;
        let experts = |which: i32, x: u64, x_per_pair: bool, y: u64, rows: usize| {
            let row_blocks = rows.div_ceil(MATVEC_ROWS_PER_BLOCK);
            let args = [
                Arg::Ptr(moe.table),
                Arg::I32(which),
                Arg::Ptr(s.idx.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(x),
                Arg::I32(x_per_pair as i32),
                Arg::Ptr(y),
                Arg::I32(row_blocks as i32),
            ];
            let grid = (row_blocks * pairs) as u32;
            self.gpu().launch("matvec_experts", grid, (MATVEC_ROWS_PER_BLOCK * 32) as u32, 0, &args)
        };
        experts(0, s.a.ptr, false, s.g.ptr, inter)?;
        experts(1, s.a.ptr, false, s.u.ptr, inter)?;
        self.gelu_gate_in_place(s.g.ptr, Gate { ptr: s.u.ptr, stride: inter }, inter, pairs)?;
        experts(2, s.g.ptr, true, s.ys.ptr, h)?;
        let args = [
            Arg::Ptr(s.e.ptr),
            Arg::Ptr(s.ys.ptr),
            Arg::Ptr(s.wts.ptr),
            Arg::I32(k as i32),
            Arg::I32(h as i32),
            Arg::I32(t as i32),
        ];
        self.elementwise("moe_combine", t * h, &args)?;
        self.norm(s.e.ptr, s.e.ptr, moe.post_norm_2, h, t, false)
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
