//! Weights on the device: one arena, placed in two passes (measure, then write) so a model is
//! uploaded without holding a second host copy. Dense bf16/f16/f32 stay as stored; 4-bit affine
//! matrices (MLX, the crate's `q4`, GGUF `Q4_0`) become (scale, bias) f32 pairs plus codes, in the
//! tensor-core tiled layout (`tiled.rs`) for matrices the matvecs read and row-major for the ones
//! only gathered from (embedding, PLE table); other GGUF types are widened to f32 (exact) for now.

use crate::device::{Arg, DevBuf, DevMat, Gpu, FMT_BF16, FMT_F16, FMT_F32, FMT_Q4, FMT_Q4T};
use crate::tiled::{tile_q4, tileable, tiled_sizes};
use megagemma_model::gguf::GgmlType;
use megagemma_model::matrix::{RowDot, WeightLayout};
use megagemma_model::plan::{LayerPlan, ModelPlan};
use megagemma_model::quant::QuantMatrix;
use megagemma_model::weights::{LayerWeights, ModelWeights};
use megagemma_model::{bail, Result};

pub struct DevPleLayer {
    pub gate: DevMat,
    pub proj: DevMat,
    pub post_norm: u64,
}

pub struct DevMoe {
    pub router: DevMat,
    pub router_scale: u64,
    pub per_expert_scale: u64,
    /// Per expert: gate, up, down (row-major: the routed-expert kernel reads them by row).
    pub experts: Vec<[DevMat; 3]>,
    /// The same descriptors on the device, `[experts·3]`, indexed by the router's choices.
    pub table: u64,
    pub pre_norm_2: u64,
    pub post_norm_1: u64,
    pub post_norm_2: u64,
}

pub struct DevLayer {
    pub input_norm: u64,
    pub q: DevMat,
    pub q_norm: u64,
    pub k: Option<DevMat>,
    pub v: Option<DevMat>,
    pub k_norm: Option<u64>,
    pub o: DevMat,
    pub post_attn_norm: u64,
    pub pre_ffn_norm: u64,
    pub gate: DevMat,
    pub up: DevMat,
    pub down: DevMat,
    pub post_ffn_norm: u64,
    pub ple: Option<DevPleLayer>,
    pub moe: Option<DevMoe>,
    pub layer_scalar: f32,
    /// The layer plan's RoPE inverse frequencies.
    pub inv_freq: u64,
}

pub struct DevPleInput {
    pub table: DevMat,
    pub proj: DevMat,
    pub norm: u64,
}

pub struct DevWeights {
    pub embed: DevMat,
    pub ple: Option<DevPleInput>,
    pub layers: Vec<DevLayer>,
    pub final_norm: u64,
    pub lm_head: DevMat,
}

/// Weights and the arena that holds them.
pub struct Uploaded {
    pub w: DevWeights,
    pub arena: DevBuf,
}

const ALIGN: usize = 256;

/// A row-major 4-bit affine matrix's data: groups of `gs` columns, `rows·cols/8` code words (nibble
/// k of word j is weight 8j + k), one scale and bias per (row, group).
struct Affine4Data<'a> {
    gs: usize,
    packed: &'a [u32],
    scales: &'a [f32],
    biases: &'a [f32],
}

/// Places tensors in the arena: the first pass only measures, the second writes.
pub struct Placer<'g> {
    gpu: &'g Gpu,
    base: Option<u64>,
    off: usize,
    seed: u64,
    /// 4-bit matvec matrices of at least this many weights take the tiled layout (and the
    /// tensor-core kernel); `None`: none do.
    mma_min: Option<usize>,
}

/// Weights from which a 4-bit matrix takes the tensor-core kernel: every tileable one. On the H200
/// (synthetic E4B/E2B q4, same run) that makes decode 1.6–1.9% faster than the CUDA-core kernel on
/// the matrices below 8M weights, and a 4-column verify 1.28× / 1.31× a decode step instead of
/// 1.47× / 1.58× (the CUDA-core kernel's work grows with the columns; `docs/perf-notes.md`). The
/// choice depends on the shape only, so every token of a multi-token pass runs the same kernel as
/// a single-token pass.
const MMA_MIN_WEIGHTS: usize = 0;

/// `MEGAGEMMA_CUDA_Q4_MMA=0` turns the tensor-core kernel off (the CUDA-core kernel everywhere, as
/// the GPU session also checks); `MEGAGEMMA_CUDA_Q4_MMA_MIN=N` sets the threshold in weights.
pub fn q4_mma_min() -> Option<usize> {
    if std::env::var("MEGAGEMMA_CUDA_Q4_MMA").is_ok_and(|v| v == "0") {
        return None;
    }
    Some(std::env::var("MEGAGEMMA_CUDA_Q4_MMA_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(MMA_MIN_WEIGHTS))
}

impl Placer<'_> {
    fn reserve(&mut self, bytes: usize) -> u64 {
        let o = self.off.next_multiple_of(ALIGN);
        self.off = o + bytes;
        self.base.unwrap_or(0) + o as u64
    }
    fn writing(&self) -> bool {
        self.base.is_some()
    }
    fn put<T>(&mut self, data: &[T]) -> Result<u64> {
        let p = self.reserve(std::mem::size_of_val(data));
        if self.writing() {
            self.gpu.upload(p, data)?;
        }
        Ok(p)
    }

    pub fn vec(&mut self, v: &[f32]) -> Result<u64> {
        self.put(v)
    }

    /// A table of u32 (token ids).
    pub fn ids(&mut self, v: &[u32]) -> Result<u64> {
        self.put(v)
    }

    /// The experts' matrix descriptors as a device table (see [`DevMoe::table`]).
    pub fn expert_table(&mut self, experts: &[[DevMat; 3]]) -> Result<u64> {
        let flat: Vec<DevMat> = experts.iter().flatten().copied().collect();
        self.put(&flat)
    }

    pub fn vec_const(&mut self, len: usize, value: f32) -> Result<u64> {
        let p = self.reserve(len * 4);
        if self.writing() {
            self.gpu.launch("fill_const", 264, 256, 0, &[Arg::Ptr(p), Arg::U64(len as u64), Arg::F32(value)])?;
        }
        Ok(p)
    }

    fn affine4(&mut self, rows: usize, cols: usize, q: Affine4Data, matvec: bool) -> Result<DevMat> {
        let Affine4Data { gs, packed, scales: s, biases: b } = q;
        if matvec && self.tiles_shape(rows, cols, gs) {
            let (nw, ns) = tiled_sizes(rows, cols, gs);
            let (w, sb) = if self.writing() {
                let (codes, sb) = tile_q4(rows, cols, gs, packed, s, b);
                (self.put(&codes)?, self.put(&sb)?)
            } else {
                (self.reserve(nw * 4), self.reserve(ns * 4))
            };
            return Ok(DevMat { w, sb, rows: rows as i32, cols: cols as i32, fmt: FMT_Q4T, gs: gs as i32 });
        }
        let w = self.put(packed)?;
        let sb = if self.writing() {
            let pairs: Vec<[f32; 2]> = s.iter().zip(b).map(|(&s, &b)| [s, b]).collect();
            self.put(&pairs)?
        } else {
            self.reserve(s.len() * 8)
        };
        Ok(DevMat { w, sb, rows: rows as i32, cols: cols as i32, fmt: FMT_Q4, gs: gs as i32 })
    }

    /// Uploads a matrix the matvecs read (4-bit: tiled when [`Placer::tiles_shape`] says so).
    pub fn mat(&mut self, m: &dyn RowDot) -> Result<DevMat> {
        self.mat_as(m, true)
    }

    /// Whether a 4-bit `[rows, cols]` matvec matrix with groups of `gs` takes the tiled layout.
    fn tiles_shape(&self, rows: usize, cols: usize, gs: usize) -> bool {
        self.mma_min.is_some_and(|min| rows * cols >= min) && tileable(cols, gs)
    }

    /// Uploads a matrix only gathered from by row (embedding, PLE table): row-major.
    pub fn mat_rows(&mut self, m: &dyn RowDot) -> Result<DevMat> {
        self.mat_as(m, false)
    }

    /// Whether [`Placer::mat`] stores `m` differently from [`Placer::mat_rows`].
    pub fn tiles(&self, m: &dyn RowDot) -> bool {
        match m.layout() {
            WeightLayout::Affine4 { group_size, .. } => self.tiles_shape(m.rows(), m.cols(), group_size),
            WeightLayout::Gguf { kind: GgmlType::Q4_0, .. } => self.tiles_shape(m.rows(), m.cols(), 32),
            _ => false,
        }
    }

    fn mat_as(&mut self, m: &dyn RowDot, matvec: bool) -> Result<DevMat> {
        let (rows, cols) = (m.rows(), m.cols());
        let dense = |w, fmt| DevMat { w, sb: 0, rows: rows as i32, cols: cols as i32, fmt, gs: 0 };
        Ok(match m.layout() {
            WeightLayout::F32(v) => dense(self.put(v)?, FMT_F32),
            WeightLayout::Bf16(v) => dense(self.put(v)?, FMT_BF16),
            WeightLayout::F16(v) => dense(self.put(v)?, FMT_F16),
            WeightLayout::Affine4 { group_size, packed, scales, biases } => {
                self.affine4(rows, cols, Affine4Data { gs: group_size, packed, scales, biases }, matvec)?
            }
            WeightLayout::Gguf { kind: GgmlType::Q4_0, bytes } => {
                // Q4_0 is the affine form with scale d, bias −8d: exact.
                let q = QuantMatrix::from_ggml_q4_0(bytes, rows, cols)?;
                let data = Affine4Data { gs: 32, packed: q.packed(), scales: q.scales(), biases: q.biases() };
                self.affine4(rows, cols, data, matvec)?
            }
            WeightLayout::Gguf { .. } => {
                // Other GGUF types: widened to f32, exactly as the CPU dequantizes them.
                let p = self.reserve(rows * cols * 4);
                if self.writing() {
                    let block = 1024;
                    let mut buf = vec![0f32; block.min(rows) * cols];
                    for r0 in (0..rows).step_by(block) {
                        let n = block.min(rows - r0);
                        for (i, row) in buf[..n * cols].chunks_exact_mut(cols).enumerate() {
                            m.row_to_f32(r0 + i, row);
                        }
                        self.gpu.upload(p + (r0 * cols * 4) as u64, &buf[..n * cols])?;
                    }
                }
                dense(p, FMT_F32)
            }
        })
    }

    /// A random 4-bit affine matrix (group size `gs`) generated on the device, in the layout
    /// [`Placer::mat`] (`matvec`) or [`Placer::mat_rows`] (`!matvec`) would give it.
    pub fn q4_random(&mut self, rows: usize, cols: usize, gs: usize, matvec: bool) -> Result<DevMat> {
        if !cols.is_multiple_of(gs) || !cols.is_multiple_of(8) {
            bail!("synthetic matrix [{rows}, {cols}]: group size {gs} does not divide the columns");
        }
        let tiled = matvec && self.tiles_shape(rows, cols, gs);
        let (words, groups) = if tiled {
            let (nw, ns) = tiled_sizes(rows, cols, gs);
            (nw, ns / 2)
        } else {
            (rows * cols / 8, rows * cols / gs)
        };
        let w = self.reserve(words * 4);
        let sb = self.reserve(groups * 8);
        self.seed += 1;
        if self.writing() {
            let s0 = 1.0 / (7.0 * (cols as f32).sqrt());
            let seed = self.seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
            self.gpu.launch("fill_random_u32", 1056, 256, 0, &[Arg::Ptr(w), Arg::U64(words as u64), Arg::U64(seed)])?;
            self.gpu.launch(
                "fill_q4_scales",
                1056,
                256,
                0,
                &[Arg::Ptr(sb), Arg::U64(groups as u64), Arg::U64(seed ^ 0x5555), Arg::F32(s0)],
            )?;
        }
        let fmt = if tiled { FMT_Q4T } else { FMT_Q4 };
        Ok(DevMat { w, sb, rows: rows as i32, cols: cols as i32, fmt, gs: gs as i32 })
    }
}

/// Runs `place` twice — measuring, then writing into one arena of the measured size.
pub fn place_all(gpu: &Gpu, place: impl Fn(&mut Placer) -> Result<DevWeights>) -> Result<Uploaded> {
    let (w, arena) = place_in_arena(gpu, place)?;
    Ok(Uploaded { w, arena })
}

/// [`place_all`] for any set of tensors (the MTP assistant's): what `place` returns, and the arena.
pub fn place_in_arena<T>(gpu: &Gpu, place: impl Fn(&mut Placer) -> Result<T>) -> Result<(T, DevBuf)> {
    let mma_min = q4_mma_min();
    let mut measure = Placer { gpu, base: None, off: 0, seed: 0, mma_min };
    place(&mut measure)?;
    let arena = gpu.alloc(measure.off.max(1))?;
    let mut write = Placer { gpu, base: Some(arena.ptr), off: 0, seed: 0, mma_min };
    let w = place(&mut write)?;
    gpu.sync()?;
    Ok((w, arena))
}

/// Every weight of a loaded model, in plan order.
pub fn place_model(p: &mut Placer, plan: &ModelPlan, mw: &ModelWeights) -> Result<DevWeights> {
    let embed = p.mat_rows(mw.embed.as_ref())?;
    let ple = match &mw.ple {
        Some(x) => Some(DevPleInput {
            table: p.mat_rows(x.embed.as_ref())?,
            proj: p.mat(x.proj.as_ref())?,
            norm: p.vec(&x.norm)?,
        }),
        None => None,
    };
    let mut layers = Vec::with_capacity(mw.layers.len());
    for (lp, lw) in plan.layers.iter().zip(&mw.layers) {
        layers.push(place_layer(p, lp, lw)?);
    }
    // A tied head is the embedding again, in the matvec layout when that differs.
    let lm_head = match &mw.lm_head {
        Some(h) => p.mat(h.as_ref())?,
        None if p.tiles(mw.embed.as_ref()) => p.mat(mw.embed.as_ref())?,
        None => embed,
    };
    Ok(DevWeights { embed, ple, layers, final_norm: p.vec(&mw.final_norm)?, lm_head })
}

/// One decoder layer's tensors (the MTP assistant's query-only layers too: no K/V, PLE or MoE).
pub fn place_layer(p: &mut Placer, lp: &LayerPlan, lw: &LayerWeights) -> Result<DevLayer> {
    let a = &lw.attn;
    let opt = |p: &mut Placer, m: &Option<Box<dyn RowDot>>| m.as_ref().map(|m| p.mat(m.as_ref())).transpose();
    let moe = match &lw.moe {
        Some(m) => {
            let experts: Vec<[DevMat; 3]> = m
                .experts
                .iter()
                .map(|e| Ok([p.mat_rows(e.gate.as_ref())?, p.mat_rows(e.up.as_ref())?, p.mat_rows(e.down.as_ref())?]))
                .collect::<Result<_>>()?;
            Some(DevMoe {
                router: p.mat(m.router_proj.as_ref())?,
                router_scale: p.vec(&m.router_scale)?,
                per_expert_scale: p.vec(&m.per_expert_scale)?,
                table: p.expert_table(&experts)?,
                experts,
                pre_norm_2: p.vec(&m.pre_norm_2)?,
                post_norm_1: p.vec(&m.post_norm_1)?,
                post_norm_2: p.vec(&m.post_norm_2)?,
            })
        }
        None => None,
    };
    Ok(DevLayer {
        input_norm: p.vec(&lw.input_norm)?,
        q: p.mat(a.q.as_ref())?,
        q_norm: p.vec(&a.q_norm)?,
        k: opt(p, &a.k)?,
        v: opt(p, &a.v)?,
        k_norm: a.k_norm.as_ref().map(|v| p.vec(v)).transpose()?,
        o: p.mat(a.o.as_ref())?,
        post_attn_norm: p.vec(&lw.post_attn_norm)?,
        pre_ffn_norm: p.vec(&lw.pre_ffn_norm)?,
        gate: p.mat(lw.mlp.gate.as_ref())?,
        up: p.mat(lw.mlp.up.as_ref())?,
        down: p.mat(lw.mlp.down.as_ref())?,
        post_ffn_norm: p.vec(&lw.post_ffn_norm)?,
        ple: match &lw.ple {
            Some(x) => Some(DevPleLayer {
                gate: p.mat(x.gate.as_ref())?,
                proj: p.mat(x.proj.as_ref())?,
                post_norm: p.vec(&x.post_norm)?,
            }),
            None => None,
        },
        moe,
        layer_scalar: lw.layer_scalar,
        inv_freq: p.vec(&lp.inv_freq)?,
    })
}
