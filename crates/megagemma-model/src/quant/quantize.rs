//! Quantizing f32 matrices into [`QuantMatrix`]: MLX's affine scheme and the symmetric `Q4_0` one.
//!
//! # MLX affine quantization (what `mlx.core.quantize` / `mlx_lm.convert` do)
//!
//! Checked against ml-explore/mlx `mlx/backend/metal/kernels/quantized.h` (`affine_quantize`, the
//! GPU kernel that `mlx_lm.convert` runs on Apple silicon); the CUDA kernel
//! (`mlx/backend/cuda/quantized/affine_quantize.cu`) is the same. Per group, in f32, with
//! `n_bins = 2^bits − 1 = 15` and `eps = 1e-7`:
//!
//! 1. `w_min` = minimum of the group; `w_max` = maximum of the group **and 0** (the kernel starts
//!    its max reduction at 0, not at −∞, so an all-negative group gets `w_max = 0`; the min starts at
//!    the dtype's largest value, so an all-positive group keeps its true minimum).
//! 2. `scale = max((w_max − w_min) / n_bins, eps)`.
//! 3. The "edge" is the end with the larger magnitude: if `|w_min| > |w_max|` the edge is `w_min`
//!    and the scale stays positive; otherwise the edge is `w_max` and the scale is negated
//!    (so MLX scales are often negative, and `q = 0` always decodes to the edge).
//! 4. `q0 = round(edge / scale)` (round half away from zero). If `q0 ≠ 0` the scale is refined to
//!    `edge / q0` and `bias = edge` — this makes 0.0 exactly representable (it is code `−q0`);
//!    if `q0 = 0` (only for groups within ~1e-7 of zero) the scale is kept and `bias = 0`.
//! 5. `q = min(round((w − bias) / scale), n_bins)` with the f32 (unrounded) scale and bias, then
//!    packed 8 per u32, least-significant nibble first. (Values below 0 cannot occur except in the
//!    `q0 = 0` corner, where the kernel's float→uint8 cast is undefined; we clamp to 0.)
//! 6. Scales and biases are stored in the weight's dtype — bf16 for Gemma checkpoints — by a
//!    round-to-nearest-even cast; here they are rounded to bf16 and kept as f32, so writing them out
//!    as bf16 and reloading gives the same bits.
//!
//! MLX's CPU backend (`mlx/backend/cpu/quantized.cpp`) differs in two corner cases: its max starts at
//! −∞ (an all-negative group keeps its true maximum) and it rounds half to even. Published MLX
//! checkpoints are made on the GPU path, which is the one reproduced here.

use rayon::prelude::*;

use super::{pack8, round_bf16, QuantMatrix, GROUP_SIZES};

/// Rows per parallel quantization task.
const ROWS_PER_TASK: usize = 16;

/// Quantizes a row-major `[rows, cols]` f32 matrix with MLX's 4-bit affine scheme (module docs);
/// scales and biases come out as bf16 values. Deterministic; parallel over rows.
///
/// Panics (caller bug, not data error) if `group_size` is not 32/64/128, does not divide `cols`,
/// `w.len() != rows·cols`, or a weight is not finite.
pub fn quantize_affine(w: &[f32], rows: usize, cols: usize, group_size: usize) -> QuantMatrix {
    check_args("quantize_affine", w, rows, cols, group_size);
    quantize_with(w, rows, cols, group_size, affine_group)
}

/// Quantizes a row-major `[rows, cols]` f32 matrix with the symmetric group-32 scheme of Google's
/// QAT checkpoints (= ggml `Q4_0`): per group, `m` = the value of largest magnitude (first one on
/// ties, sign kept), `d = bf16(m / −8)`, `q = clamp(round(x / d) + 8, 0, 15)` (round half away from
/// zero; `q = 8` everywhere when `d = 0`), stored as `scale = d`, `bias = −8·d` (exact, `d` being a
/// bf16 value), so `w = d·(q − 8)`. Unlike ggml, `d` is rounded before computing `q`, so each code
/// is the nearest point of the grid actually stored. Deterministic; parallel over rows.
///
/// Panics (caller bug) if `cols` is not a multiple of 32, `w.len() != rows·cols`, or a weight is not
/// finite.
pub fn quantize_q4_0(w: &[f32], rows: usize, cols: usize) -> QuantMatrix {
    check_args("quantize_q4_0", w, rows, cols, 32);
    quantize_with(w, rows, cols, 32, q4_0_group)
}

fn check_args(what: &str, w: &[f32], rows: usize, cols: usize, group_size: usize) {
    assert!(GROUP_SIZES.contains(&group_size), "{what}: group_size {group_size} is not 32, 64 or 128");
    assert!(cols.is_multiple_of(group_size), "{what}: group_size {group_size} does not divide cols {cols}");
    assert_eq!(w.len(), rows * cols, "{what}: input has {} values, expected [{rows}, {cols}]", w.len());
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        panic!("{what}: weight [{}, {}] = {} is not finite", i / cols, i % cols, w[i]);
    }
}

/// Quantizes one group: writes `group_size` codes to `q`, returns `(scale, bias)` as stored.
type GroupFn = fn(&[f32], &mut [u8]) -> (f32, f32);

fn quantize_with(w: &[f32], rows: usize, cols: usize, group_size: usize, f: GroupFn) -> QuantMatrix {
    let ng = cols / group_size;
    let mut packed = vec![0u32; rows * cols / 8];
    let mut scales = vec![0f32; rows * ng];
    let mut biases = vec![0f32; rows * ng];
    let task_rows = ROWS_PER_TASK;
    packed
        .par_chunks_mut(task_rows * cols / 8)
        .zip(scales.par_chunks_mut(task_rows * ng))
        .zip(biases.par_chunks_mut(task_rows * ng))
        .zip(w.par_chunks(task_rows * cols))
        .for_each(|(((pk, sc), bi), wr)| {
            let mut q = vec![0u8; group_size];
            for (gi, wg) in wr.chunks_exact(group_size).enumerate() {
                let (s, b) = f(wg, &mut q);
                sc[gi] = s;
                bi[gi] = b;
                for (word, q8) in pk[gi * group_size / 8..(gi + 1) * group_size / 8].iter_mut().zip(q.chunks_exact(8)) {
                    *word = pack8(q8);
                }
            }
        });
    QuantMatrix::from_parts_unchecked(rows, cols, group_size, packed, scales, biases)
}

/// MLX affine, 4 bits (see the module docs for the steps).
fn affine_group(w: &[f32], q: &mut [u8]) -> (f32, f32) {
    const N_BINS: f32 = 15.0;
    const EPS: f32 = 1e-7;
    let mut w_min = f32::MAX;
    let mut w_max = 0.0f32;
    for &v in w {
        w_min = w_min.min(v);
        w_max = w_max.max(v);
    }
    let mut scale = ((w_max - w_min) / N_BINS).max(EPS);
    let side = w_min.abs() > w_max.abs();
    if !side {
        scale = -scale;
    }
    let edge = if side { w_min } else { w_max };
    let q0 = (edge / scale).round();
    let (scale, bias) = if q0 == 0.0 { (scale, 0.0) } else { (edge / q0, edge) };
    for (qi, &v) in q.iter_mut().zip(w) {
        *qi = ((v - bias) / scale).round().clamp(0.0, N_BINS) as u8;
    }
    (round_bf16(scale), round_bf16(bias))
}

/// Symmetric `Q4_0` (see [`quantize_q4_0`]).
fn q4_0_group(w: &[f32], q: &mut [u8]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in w {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = round_bf16(max / -8.0);
    for (qi, &v) in q.iter_mut().zip(w) {
        *qi = if d == 0.0 { 8 } else { ((v / d).round() + 8.0).clamp(0.0, 15.0) as u8 };
    }
    (d, -8.0 * d)
}
