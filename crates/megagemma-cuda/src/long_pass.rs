//! Long passes: prefill chunks of at least [`LONG_PASS_TOKENS`] tokens, on cuBLAS.
//!
//! Matrix products run on the tensor cores: each matrix is widened, a block of rows at a time,
//! into fp16 (high, low) parts in a scratch buffer (`widen_rows` / `widen_tiles` in
//! `kernels/prefill.cu`), its inputs are split the same way, and `Σ w·x` is taken as
//! `w_hi·x_hi + w_lo·x_hi + w_hi·x_lo` in two GEMMs with f32 accumulation, so each product keeps
//! ~2^-22 of its value, as the tensor-core matvec does. Attention runs per block of queries as
//! strided-batched products split the same way (scores, then probabilities × values; one batch
//! entry per KV head) around a masked softmax, over the keys gathered in position order.
//!
//! Shorter passes (decode, speculative verify, short prompts) never come here: those of at most
//! [`FEW_TOKENS`] tokens keep their columns bit-identical to single steps.

use crate::device::{cuda_err, Arg, DevBuf, DevMat, Gpu, FMT_Q4T};
use crate::seq::{f32s, CudaSeq};
use cudarc::cublas::{result as blas, sys as bsys};
use megagemma_model::plan::LayerPlan;
use megagemma_model::{bail, Result};
use std::ffi::c_void;
use std::sync::Mutex;

/// Passes of up to this many tokens (decode, verify) run exactly as single steps do.
pub const FEW_TOKENS: usize = 8;
/// Passes of at least this many tokens take cuBLAS; shorter ones the matvecs. The crossover
/// measured on the H200 (synthetic E4B q4 prefill, `gpu_check prefill`): 16 tokens 17.5 ms on the
/// matvecs against 20.2 on cuBLAS, 64 tokens 60 ms against 20.5 (the widening of every matrix is a
/// fixed ~19 ms per pass).
pub const LONG_PASS_TOKENS: usize = 20;
/// Widened weights (fp16 high and low parts) one block of rows may take.
const WIDE_BYTES: usize = 256 << 20;
/// 64-column chunks per block of `widen_tiles` (`WIDEN_CHUNKS` in `kernels/prefill.cu`).
const WIDEN_CHUNKS: usize = 8;
/// Attention scores one block of queries may take.
const SCORE_BYTES: usize = 128 << 20;

/// Scratch of long passes, shared by a model's sequences (they run one at a time on its stream)
/// and grown on demand.
#[derive(Default)]
pub(crate) struct Workspace {
    bufs: Mutex<[Option<DevBuf>; 8]>,
}

/// What a workspace buffer holds: widened weights, split inputs; attention's queries, outputs,
/// gathered keys and values, scores and probabilities.
#[derive(Clone, Copy)]
enum Slot {
    Wide,
    Inputs,
    Queries,
    Outputs,
    Keys,
    Values,
    Scores,
    Probs,
}

impl Workspace {
    /// A buffer of at least `bytes` in `slot`. Growing waits for the stream first, so no queued
    /// kernel still uses the old one; a pointer stays valid until the next call for its slot.
    fn get(&self, gpu: &Gpu, slot: Slot, bytes: usize) -> Result<u64> {
        let mut bufs = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let b = &mut bufs[slot as usize];
        if b.as_ref().is_none_or(|b| b.bytes < bytes) {
            gpu.sync()?;
            *b = None;
            *b = Some(gpu.alloc(bytes)?);
        }
        Ok(b.as_ref().expect("allocated above").ptr)
    }
}

fn op(transpose: bool) -> bsys::cublasOperation_t {
    if transpose {
        bsys::cublasOperation_t::CUBLAS_OP_T
    } else {
        bsys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// One column-major cuBLAS product `C = op(A)·op(B) + beta·C` (`m × n`, inner size `k`), `batch`
/// times; fp16 operands (`half`) or f32, f32 results, f32 sums. A row-major `[r, c]` array is a
/// column-major `[c, r]` one, so the callers' row-major products appear here transposed.
struct Gemm {
    /// Transpose A / B.
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    /// (device pointer, leading dimension, stride between batch entries), in elements.
    a: (u64, usize, usize),
    b: (u64, usize, usize),
    c: (u64, usize, usize),
    beta: f32,
    batch: usize,
    half: bool,
}

impl Gemm {
    fn run(&self, gpu: &Gpu) -> Result<()> {
        let Some(h) = gpu.blas.as_ref() else { bail!("cuBLAS is not loaded") };
        let int = |v: usize| i32::try_from(v).map_err(|_| cuda_err("cuBLAS size", v));
        let ty = if self.half { bsys::cudaDataType_t::CUDA_R_16F } else { bsys::cudaDataType_t::CUDA_R_32F };
        let (alpha, beta) = (1f32, self.beta);
        let (a, b, c) = (self.a, self.b, self.c);
        let key = || {
            let kind = if self.half { "f16 split" } else { "f32" };
            format!("cuBLAS {kind} {}x{}x{} batch {}", self.m, self.n, self.k, self.batch)
        };
        // cuBLAS may allocate on its first use of a shape: not during another thread's capture.
        crate::capture::device_wide(|| {
            gpu.timed(key, || {
                // SAFETY: every pointer is a live device allocation sized by the caller for these shapes;
                // alpha and beta are host values read during the call; the handle is on the model's stream.
                unsafe {
                    blas::gemm_strided_batched_ex(
                        *h.handle(),
                        op(self.ta),
                        op(self.tb),
                        int(self.m)?,
                        int(self.n)?,
                        int(self.k)?,
                        &alpha as *const f32 as *const c_void,
                        a.0 as *const c_void,
                        ty,
                        int(a.1)?,
                        a.2 as i64,
                        b.0 as *const c_void,
                        ty,
                        int(b.1)?,
                        b.2 as i64,
                        &beta as *const f32 as *const c_void,
                        c.0 as *mut c_void,
                        bsys::cudaDataType_t::CUDA_R_32F,
                        int(c.1)?,
                        c.2 as i64,
                        int(self.batch)?,
                        bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| cuda_err("cuBLAS GEMM", e))
            })
        })
    }
}

impl CudaSeq {
    /// Whether a pass of `t` tokens runs here (else on the matvecs and the decode attention kernel).
    pub(crate) fn long_pass(&self, t: usize) -> bool {
        t >= LONG_PASS_TOKENS && self.gpu().blas.is_some()
    }

    /// `y_i[t] = W_i·x[t]` for matrices of the same width on one input (`gelu(x)·gate` when
    /// gated), `t` ≥ [`LONG_PASS_TOKENS`]. Returns false, having done nothing, for shapes it does not take.
    pub(crate) fn gemm(&self, mats: &[(&DevMat, u64)], x: u64, gate: Option<(u64, usize)>, t: usize) -> Result<bool> {
        let cols = mats[0].0.cols as usize;
        if !cols.is_multiple_of(8) || mats.iter().any(|(w, _)| w.cols as usize != cols) {
            return Ok(false);
        }
        let gpu = self.gpu();
        let work = &self.model.work;
        let inputs = work.get(gpu, Slot::Inputs, 2 * t * 3 * cols)?;
        let (g, gstride) = gate.unwrap_or((0, 0));
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(g),
            Arg::I32(gstride as i32),
            Arg::I32(cols as i32),
            Arg::I32(t as i32),
            Arg::Ptr(inputs),
        ];
        gpu.launch("split_inputs", (t * cols).div_ceil(256) as u32, 256, 0, &args)?;
        for &(w, y) in mats {
            let rows = w.rows as usize;
            // Blocks of whole 16-row tiles, as many as the widened scratch holds.
            let block = (WIDE_BYTES / (4 * cols)).max(16) / 16 * 16;
            for r0 in (0..rows).step_by(block) {
                let n = block.min(rows - r0);
                let wide = work.get(gpu, Slot::Wide, 4 * n * cols)?;
                if w.fmt == FMT_Q4T {
                    let tiles = n.div_ceil(16);
                    let args = [Arg::Mat(*w), Arg::I32((r0 / 16) as i32), Arg::I32(tiles as i32), Arg::Ptr(wide)];
                    let grid = tiles * cols.div_ceil(64).div_ceil(WIDEN_CHUNKS);
                    gpu.launch("widen_tiles", grid as u32, (WIDEN_CHUNKS * 32) as u32, 0, &args)?;
                } else {
                    let args = [Arg::Mat(*w), Arg::I32(r0 as i32), Arg::I32(n as i32), Arg::Ptr(wide)];
                    gpu.launch("widen_rows", (n * cols / 8).div_ceil(256) as u32, 256, 0, &args)?;
                }
                // Row-major Y [t, rows] is column-major [rows, t]: Y = wide^T-op · inputs.
                let y0 = y + f32s(r0) as u64;
                let one = |k: usize, b: u64, beta: f32| Gemm {
                    ta: true,
                    tb: false,
                    m: n,
                    n: t,
                    k,
                    a: (wide, 2 * cols, 0),
                    b: (b, 3 * cols, 0),
                    c: (y0, rows, 0),
                    beta,
                    batch: 1,
                    half: true,
                };
                one(2 * cols, inputs, 0.0).run(gpu)?; // (w_hi | w_lo)·(x_hi | x_hi)
                one(cols, inputs + (4 * cols) as u64, 1.0).run(gpu)?; // + w_hi·x_lo
            }
        }
        Ok(true)
    }

    /// Attention of a long pass over `t` tokens at positions `p0 ..`: queries in `s.q`, output in
    /// `s.att`, keys and values from the source layer's cache and this pass's staged rows. Every
    /// product takes fp16 (high, low) parts of its operands, like the weight products.
    pub(crate) fn attention_long(&self, lp: &LayerPlan, t: usize) -> Result<()> {
        let Some(c) = self.cache(lp.kv_source) else { bail!("layer {} has no KV cache", lp.kv_source) };
        let (gpu, work, s) = (self.gpu(), &self.model.work, self.scratch());
        let (heads, kvh, hd) = (lp.num_heads, lp.num_kv_heads, lp.head_dim);
        let (hpk, kvw, p0) = (heads / kvh, c.width, self.len());
        let window = lp.window.unwrap_or(0);
        // Keys any query of the pass sees, in position order: keys [n][kvh][3·hd], values [2][n][kvw].
        let first = if window > 0 { (p0 + 1).saturating_sub(window) } else { 0 };
        let n = p0 + t - first;
        let (kg, vg) = (work.get(gpu, Slot::Keys, 2 * 3 * n * kvw)?, work.get(gpu, Slot::Values, 2 * 2 * n * kvw)?);
        let args = [
            Arg::Ptr(c.k.ptr),
            Arg::Ptr(c.v.ptr),
            Arg::Ptr(c.staged_k.ptr),
            Arg::Ptr(c.staged_v.ptr),
            Arg::Ptr(kg),
            Arg::Ptr(vg),
            Arg::I32(first as i32),
            Arg::I32(n as i32),
            Arg::I32(p0 as i32),
            Arg::I32(c.ring as i32),
            Arg::I32(kvh as i32),
            Arg::I32(hd as i32),
        ];
        gpu.launch("kv_gather", (n * kvw).div_ceil(256) as u32, 256, 0, &args)?;
        // Queries [kvh][t][hpk][3·hd]: each KV head's queries one matrix.
        let qg = work.get(gpu, Slot::Queries, 2 * 3 * t * heads * hd)?;
        let og = work.get(gpu, Slot::Outputs, f32s(t * heads * hd))?;
        let args = [Arg::Ptr(s.q.ptr), Arg::Ptr(qg), Arg::I32(t as i32), Arg::I32(heads as i32), Arg::I32(kvh as i32)];
        let args = [&args[..], &[Arg::I32(hd as i32)]].concat();
        gpu.launch("split_queries", (t * heads * hd).div_ceil(256) as u32, 256, 0, &args)?;
        let tq = t.min((SCORE_BYTES / f32s(kvh * hpk * n)).max(16));
        for t0 in (0..t).step_by(tq) {
            let tb = tq.min(t - t0);
            let r = tb * hpk; // score rows per KV head: (token, head in group)
            let kb0 = if window > 0 { first.max((p0 + t0 + 1).saturating_sub(window)) } else { 0 };
            let nb = p0 + t0 + tb - kb0;
            let ld = nb.next_multiple_of(8); // rows of scores and probabilities, aligned for the tensor cores
            let scores = work.get(gpu, Slot::Scores, f32s(kvh * r * ld))?;
            let probs = work.get(gpu, Slot::Probs, 2 * 2 * kvh * r * ld)?;
            // Scores [r, nb] row-major = column-major [nb, r] = K (row-major [nb, 3·hd]: op T) · Q.
            Gemm {
                ta: true,
                tb: false,
                m: nb,
                n: r,
                k: 3 * hd,
                a: (kg + (2 * 3 * (kb0 - first) * kvw) as u64, 3 * kvw, 3 * hd),
                b: (qg + (2 * 3 * t0 * hpk * hd) as u64, 3 * hd, 3 * t * hpk * hd),
                c: (scores, ld, r * ld),
                beta: 0.0,
                batch: kvh,
                half: true,
            }
            .run(gpu)?;
            let args = [
                Arg::Ptr(scores),
                Arg::Ptr(probs),
                Arg::I32(nb as i32),
                Arg::I32(ld as i32),
                Arg::I32(hpk as i32),
                Arg::I32(tb as i32),
                Arg::I32(t0 as i32),
                Arg::I32(p0 as i32),
                Arg::I32(kb0 as i32),
                Arg::I32(window as i32),
                Arg::F32(self.model.plan.attn_scale),
            ];
            gpu.launch("masked_softmax", (kvh * r) as u32, 256, 0, &args)?;
            // Out [r, hd] row-major = column-major [hd, r] = V (column-major [hd, nb]) · P, as
            // p_hi·v_hi + p_lo·v_hi + p_hi·v_lo.
            let v_hi = vg + (2 * (kb0 - first) * kvw) as u64;
            let v_lo = v_hi + (2 * n * kvw) as u64;
            for (i, (v, p)) in [(v_hi, 0), (v_hi, ld), (v_lo, 0)].into_iter().enumerate() {
                Gemm {
                    ta: false,
                    tb: false,
                    m: hd,
                    n: r,
                    k: nb,
                    a: (v, kvw, hd),
                    b: (probs + (2 * p) as u64, 2 * ld, 2 * r * ld),
                    c: (og + f32s(t0 * hpk * hd) as u64, hd, t * hpk * hd),
                    beta: if i == 0 { 0.0 } else { 1.0 },
                    batch: kvh,
                    half: true,
                }
                .run(gpu)?;
            }
        }
        let args = [Arg::Ptr(og), Arg::Ptr(s.att.ptr), Arg::I32(kvh as i32), Arg::I32(t as i32)];
        let args = [&args[..], &[Arg::I32((hpk * hd) as i32)]].concat();
        gpu.launch("swap_rows", (t * heads * hd).div_ceil(256) as u32, 256, 0, &args)
    }
}
