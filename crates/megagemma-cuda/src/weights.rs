//! Weights on the device: one arena, placed in two passes (measure, then write) so a model is
//! uploaded without holding a second host copy. Dense bf16/f16/f32 stay as stored; 4-bit affine
//! matrices (MLX, the crate's `q4`, GGUF `Q4_0`) become packed words plus (scale, bias) f32 pairs;
//! other GGUF types are widened to f32 (exact) for now.

use crate::device::{Arg, DevBuf, DevMat, Gpu, FMT_BF16, FMT_F16, FMT_F32, FMT_Q4};
use megagemma_model::gguf::GgmlType;
use megagemma_model::matrix::{RowDot, WeightLayout};
use megagemma_model::plan::ModelPlan;
use megagemma_model::quant::QuantMatrix;
use megagemma_model::weights::ModelWeights;
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
    /// Per expert: gate, up, down.
    pub experts: Vec<[DevMat; 3]>,
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

/// Places tensors in the arena: the first pass only measures, the second writes.
pub struct Placer<'g> {
    gpu: &'g Gpu,
    base: Option<u64>,
    off: usize,
    seed: u64,
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

    pub fn vec_const(&mut self, len: usize, value: f32) -> Result<u64> {
        let p = self.reserve(len * 4);
        if self.writing() {
            self.gpu.launch("fill_const", 264, 256, 0, &[Arg::Ptr(p), Arg::U64(len as u64), Arg::F32(value)])?;
        }
        Ok(p)
    }

    fn affine4(&mut self, rows: usize, cols: usize, gs: usize, packed: &[u32], s: &[f32], b: &[f32]) -> Result<DevMat> {
        let w = self.put(packed)?;
        let sb = if self.writing() {
            let pairs: Vec<[f32; 2]> = s.iter().zip(b).map(|(&s, &b)| [s, b]).collect();
            self.put(&pairs)?
        } else {
            self.reserve(s.len() * 8)
        };
        Ok(DevMat { w, sb, rows: rows as i32, cols: cols as i32, fmt: FMT_Q4, gs: gs as i32 })
    }

    /// Uploads a loaded matrix in its kernel format.
    pub fn mat(&mut self, m: &dyn RowDot) -> Result<DevMat> {
        let (rows, cols) = (m.rows(), m.cols());
        let dense = |w, fmt| DevMat { w, sb: 0, rows: rows as i32, cols: cols as i32, fmt, gs: 0 };
        Ok(match m.layout() {
            WeightLayout::F32(v) => dense(self.put(v)?, FMT_F32),
            WeightLayout::Bf16(v) => dense(self.put(v)?, FMT_BF16),
            WeightLayout::F16(v) => dense(self.put(v)?, FMT_F16),
            WeightLayout::Affine4 { group_size, packed, scales, biases } => {
                self.affine4(rows, cols, group_size, packed, scales, biases)?
            }
            WeightLayout::Gguf { kind: GgmlType::Q4_0, bytes } => {
                // Q4_0 is the affine form with scale d, bias −8d: exact.
                let q = QuantMatrix::from_ggml_q4_0(bytes, rows, cols)?;
                self.affine4(rows, cols, 32, q.packed(), q.scales(), q.biases())?
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

    /// A random 4-bit affine matrix (group size `gs`) generated on the device.
    pub fn q4_random(&mut self, rows: usize, cols: usize, gs: usize) -> Result<DevMat> {
        if !cols.is_multiple_of(gs) || !cols.is_multiple_of(8) {
            bail!("synthetic matrix [{rows}, {cols}]: group size {gs} does not divide the columns");
        }
        let words = rows * cols / 8;
        let groups = rows * cols / gs;
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
        Ok(DevMat { w, sb, rows: rows as i32, cols: cols as i32, fmt: FMT_Q4, gs: gs as i32 })
    }
}

/// Runs `place` twice — measuring, then writing into one arena of the measured size.
pub fn place_all(gpu: &Gpu, place: impl Fn(&mut Placer) -> Result<DevWeights>) -> Result<Uploaded> {
    let mut measure = Placer { gpu, base: None, off: 0, seed: 0 };
    place(&mut measure)?;
    let arena = gpu.alloc(measure.off.max(1))?;
    let mut write = Placer { gpu, base: Some(arena.ptr), off: 0, seed: 0 };
    let w = place(&mut write)?;
    gpu.sync()?;
    Ok(Uploaded { w, arena })
}

/// Every weight of a loaded model, in plan order.
pub fn place_model(p: &mut Placer, plan: &ModelPlan, mw: &ModelWeights) -> Result<DevWeights> {
    let embed = p.mat(mw.embed.as_ref())?;
    let ple = match &mw.ple {
        Some(x) => {
            Some(DevPleInput { table: p.mat(x.embed.as_ref())?, proj: p.mat(x.proj.as_ref())?, norm: p.vec(&x.norm)? })
        }
        None => None,
    };
    let mut layers = Vec::with_capacity(mw.layers.len());
    for (lp, lw) in plan.layers.iter().zip(&mw.layers) {
        let a = &lw.attn;
        let opt = |p: &mut Placer, m: &Option<Box<dyn RowDot>>| m.as_ref().map(|m| p.mat(m.as_ref())).transpose();
        let moe = match &lw.moe {
            Some(m) => Some(DevMoe {
                router: p.mat(m.router_proj.as_ref())?,
                router_scale: p.vec(&m.router_scale)?,
                per_expert_scale: p.vec(&m.per_expert_scale)?,
                experts: m
                    .experts
                    .iter()
                    .map(|e| Ok([p.mat(e.gate.as_ref())?, p.mat(e.up.as_ref())?, p.mat(e.down.as_ref())?]))
                    .collect::<Result<_>>()?,
                pre_norm_2: p.vec(&m.pre_norm_2)?,
                post_norm_1: p.vec(&m.post_norm_1)?,
                post_norm_2: p.vec(&m.post_norm_2)?,
            }),
            None => None,
        };
        layers.push(DevLayer {
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
        });
    }
    let lm_head = match &mw.lm_head {
        Some(h) => p.mat(h.as_ref())?,
        None => embed,
    };
    Ok(DevWeights { embed, ple, layers, final_norm: p.vec(&mw.final_norm)?, lm_head })
}
