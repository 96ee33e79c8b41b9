//! Integer dot products for GGUF Q5_0 rows on CPUs with AVX-512 VNNI.
//!
//! A Q5_0 weight is `d·(u − 16)` with a 5-bit `u` and an f16 `d` per 32 values. The f32 kernels
//! spend one fused multiply-add per weight and vector, which keeps a multi-token pass (prefill,
//! verify) at the FMA units' limit. Here each activation vector is quantized once per matmul to
//! 22-bit integers per 16 values (`x ≈ s·x_q`, `s = amax / (2^21 − 1)`, so the error is at most
//! `s/2`, ≈2.4e-7 of the 16 values' largest), split into three bytes; `vpdpbusd` (64 byte
//! products per instruction) computes `Σ q·x_q` exactly in integers, and one f32 multiply-add
//! per 16 values applies `d·s`. (16-bit activations were measured first: logits of the real
//! Gemma 3 270M moved by up to 8e-5 relative L2 from transformers', too close to the 1e-4
//! contract; with 22 bits they stay within a few 1e-7, as the f32 kernels'.)
//!
//! Layout. A group of 8 blocks (256 values) fills 16 lanes, each lane half a block (16 values in
//! 4 steps of 4 bytes): lane `j` holds block `j / 2`, values `16·(j % 2) + 4·i .. + 4` in step
//! `i`, and one activation scale. The activations are stored in that order when quantized; the weights
//! are permuted into it per row (`vpermt2b`), once per row for every vector of the call.
//! Per lane and group: `acc += f32(Σ q·x_q) · (d·s)` (fused), then the 16 lanes are summed
//! pairwise (8, 4, 2, 1). Every step is per vector, so a column of a multi-vector call is
//! bit-identical to a one-vector call; [`tests`] check the kernel against a scalar transcription
//! of the same arithmetic, bit for bit, and the result against an f64 dot product.

#![allow(clippy::missing_safety_doc)]
// Indexed loops over fixed-size register arrays unroll into straight-line code (as dot512.rs).
#![allow(clippy::needless_range_loop)]

use rayon::prelude::*;
use std::sync::OnceLock;

/// Values per Q5_0 weight block.
const BLOCK: usize = 32;
/// Values per lane (and per activation scale): half a block.
const LANE_VALUES: usize = 16;
/// Q5_0 block bytes: f16 `d`, 32 high bits `qh`, 16 bytes of nibbles.
const Q5_0_BYTES: usize = 22;
/// Blocks per 16-lane group.
const GROUP_BLOCKS: usize = 8;
/// Bytes of one group's high (or low) activation bytes: 4 steps × 16 lanes × 4.
const GROUP_BYTES: usize = 4 * 64;
/// Vectors quantized per parallel task.
const QUANT_TASK: usize = 8;

/// Whether the integer Q5_0 path runs on this machine: AVX-512 with VNNI (and the byte/word
/// forms, VBMI and F16C), unless `MEGAGEMMA_INT_DOT=0` turns it off.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("MEGAGEMMA_INT_DOT").is_ok_and(|v| v == "0") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            crate::simd::level() == crate::simd::Level::Avx512
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// `T` activation vectors of `cols` values, quantized to 22-bit integers per 16 values and laid
/// out for the integer kernel (see the module documentation).
pub struct IntInputs {
    t: usize,
    groups: usize,
    /// `[t][group][step][lane][4]`: `(x_q >> 16) + 128` (as unsigned bytes).
    hi: Vec<u8>,
    /// Same layout: `(x_q >> 8) & 255`.
    mid: Vec<u8>,
    /// Same layout: `x_q & 255`.
    lo: Vec<u8>,
    /// `[t][group][lane]`: the lane's block scale `s` (0 on padding lanes).
    scale: Vec<f32>,
}

impl IntInputs {
    /// Quantize `xs` (`[T, cols]`, `cols` a multiple of 32).
    pub fn quantize(xs: &[f32], cols: usize) -> IntInputs {
        assert!(cols > 0 && cols.is_multiple_of(BLOCK), "integer dot: {cols} values per vector is not whole 32-value blocks");
        assert_eq!(xs.len() % cols, 0, "integer dot: input is not [T, {cols}]");
        let t = xs.len() / cols;
        let groups = cols.div_ceil(BLOCK * GROUP_BLOCKS);
        // Padding (past the last block) is x_q = 0: high byte 128, the others 0, scale 0.
        let mut hi = vec![128u8; t * groups * GROUP_BYTES];
        let mut mid = vec![0u8; t * groups * GROUP_BYTES];
        let mut lo = vec![0u8; t * groups * GROUP_BYTES];
        let mut scale = vec![0f32; t * groups * 16];
        let (vb, sb) = (groups * GROUP_BYTES, groups * 16);
        hi.par_chunks_mut(vb * QUANT_TASK)
            .zip(mid.par_chunks_mut(vb * QUANT_TASK))
            .zip(lo.par_chunks_mut(vb * QUANT_TASK))
            .zip(scale.par_chunks_mut(sb * QUANT_TASK))
            .zip(xs.par_chunks(cols * QUANT_TASK))
            .for_each(|((((hi, mid), lo), scale), xs)| {
                for (k, x) in xs.chunks_exact(cols).enumerate() {
                    let bytes = k * vb..(k + 1) * vb;
                    let parts = [&mut hi[bytes.clone()], &mut mid[bytes.clone()], &mut lo[bytes]];
                    quantize_one(x, parts, &mut scale[k * sb..(k + 1) * sb]);
                }
            });
        IntInputs { t, groups, hi, mid, lo, scale }
    }

    /// Number of vectors.
    pub fn len(&self) -> usize {
        self.t
    }

    pub fn is_empty(&self) -> bool {
        self.t == 0
    }
}

const ROUNDER: f32 = 12_582_912.0;
/// The largest quantized magnitude: 22-bit integers, so a lane's `Σ q·x_q` (16 values,
/// `|q| ≤ 16`) stays within `i32`.
const Q_MAX: f32 = 2_097_151.0;

fn quantize_one(x: &[f32], [hi, mid, lo]: [&mut [u8]; 3], scale: &mut [f32]) {
    // One scale per lane: 16 values, half a block.
    for (h, part) in x.chunks_exact(LANE_VALUES).enumerate() {
        let (g, lane) = (h / 16, h % 16);
        let amax = part.iter().fold(0f32, |m, v| m.max(v.abs()));
        // A non-finite value makes the lane's scale NaN, so it reaches the result as the f32
        // kernels' would (the integer part cannot carry it).
        let finite = part.iter().all(|v| v.is_finite());
        let s = if finite { amax / Q_MAX } else { f32::NAN };
        let inv = if finite && amax > 0.0 { Q_MAX / amax } else { 0.0 };
        for (v, &xv) in part.iter().enumerate() {
            // Round half to even by adding and subtracting 1.5·2^23 (exact for |v| < 2^22;
            // `round_ties_even` is a libm call on baseline x86-64).
            let q = ((xv * inv + ROUNDER) - ROUNDER).clamp(-Q_MAX, Q_MAX) as i32;
            let at = (g * 4 + v / 4) * 64 + lane * 4 + v % 4;
            hi[at] = ((q >> 16) + 128) as u8;
            mid[at] = ((q >> 8) & 0xff) as u8;
            lo[at] = (q & 0xff) as u8;
        }
        scale[g * 16 + lane] = s;
    }
}

/// `outs[t·n + i] = dot(row(start + i), x[t])` for `n = outs.len() / T` consecutive rows of a
/// Q5_0 matrix whose rows are `row_bytes` bytes from `data`. Requires [`enabled`].
pub fn dot_rows_q5_0(data: &[u8], row_bytes: usize, start: usize, x: &IntInputs, outs: &mut [f32]) {
    assert!(enabled(), "integer dot kernel used on a CPU without AVX-512 VNNI");
    assert!(x.t > 0 && outs.len().is_multiple_of(x.t), "integer dot: {} outputs for {} vectors", outs.len(), x.t);
    let n = outs.len() / x.t;
    assert!(row_bytes.is_multiple_of(Q5_0_BYTES) && (start + n) * row_bytes <= data.len(), "integer dot: rows out of range");
    assert_eq!((row_bytes / Q5_0_BYTES).div_ceil(GROUP_BLOCKS), x.groups, "integer dot: row and vector sizes differ");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `enabled()` checked the CPU features; the shapes were checked just above.
    unsafe {
        avx512::dot_rows(data, row_bytes, start, x, outs, n)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One row's group, decoded: the signed weights `u − 16` in the lane layout (4 steps), the
    /// lanes' `d`, and `−128·Σq` per lane (the high bytes carry a +128 offset).
    #[derive(Clone, Copy)]
    pub(super) struct DecGroup {
        q: [__m512i; 4],
        d: __m512,
        init: __m512i,
    }

    /// Byte `e` of entry `m` is 0x10 when bit `e` of `m` is set: four `qh` bits → the fifth bit
    /// of four weights.
    const HIGH_BIT_LUT: [i32; 16] = {
        let mut t = [0i32; 16];
        let mut m = 0;
        while m < 16 {
            let mut e = 0;
            while e < 4 {
                if (m >> e) & 1 == 1 {
                    t[m] |= 0x10 << (8 * e);
                }
                e += 1;
            }
            m += 1;
        }
        t
    };

    /// Byte-permute indices that gather, for every lane `j` (block `(j / 2) % 4` of a 4-block,
    /// 88-byte window), bytes `at, at + 1, at + 2, at + 3` of that block.
    const fn lane_bytes(at: usize) -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut p = 0;
        while p < 64 {
            t[p] = (Q5_0_BYTES * ((p / 8) % 4) + at + p % 4) as u8;
            p += 1;
        }
        t
    }
    /// Per step `i`: the nibble bytes `qs[4i .. 4i + 4]` (at offset 6 in a block).
    const QS_IDX: [[u8; 64]; 4] = [lane_bytes(6), lane_bytes(10), lane_bytes(14), lane_bytes(18)];
    /// `qh` (offset 2) and `d` (offset 0; the low 16 bits of each lane).
    const QH_IDX: [u8; 64] = lane_bytes(2);
    const D_IDX: [u8; 64] = lane_bytes(0);

    /// Decode group `g` of a row of `nb` blocks. The group's 8 blocks (176 bytes) are loaded as
    /// two 128-byte windows (blocks 0–3 and 4–7; bytes past the row masked off, so they read
    /// as zero and give `d = 0`) and each lane's bytes are picked with `vpermt2b`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c")]
    unsafe fn decode_group(row: *const u8, g: usize, nb: usize) -> DecGroup {
        let row_len = nb * Q5_0_BYTES;
        let load = |off: usize| {
            let avail = row_len.saturating_sub(off).min(64);
            let mask = if avail == 64 { u64::MAX } else { (1u64 << avail) - 1 };
            _mm512_maskz_loadu_epi8(mask, row.wrapping_add(off) as *const i8)
        };
        let g0 = g * GROUP_BLOCKS * Q5_0_BYTES;
        let (a0, a1) = (load(g0), load(g0 + 64));
        let (b0, b1) = (load(g0 + 88), load(g0 + 152));
        // Lanes 8–15 (bytes 32–63) come from the second window.
        const SECOND: u64 = 0xffff_ffff_0000_0000;
        let pick = |idx: &[u8; 64]| {
            let i = _mm512_loadu_si512(idx.as_ptr() as *const _);
            _mm512_mask_blend_epi8(SECOND, _mm512_permutex2var_epi8(a0, i, a1), _mm512_permutex2var_epi8(b0, i, b1))
        };
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let half = _mm512_and_si512(lane, _mm512_set1_epi32(1));
        let nib_shift = _mm512_slli_epi32::<2>(half); // 0 or 4
        let qh_shift = _mm512_slli_epi32::<4>(half); // 0 or 16
        let qh = pick(&QH_IDX);
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pick(&D_IDX)));
        let lut = _mm512_loadu_si512(HIGH_BIT_LUT.as_ptr() as *const _);
        let (low4, sixteen, c128) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(16), _mm512_set1_epi8(-128));
        let z = _mm512_setzero_si512();
        let mut q = [z; 4];
        let mut sum128 = z;
        for (i, qi) in q.iter_mut().enumerate() {
            let raw = pick(&QS_IDX[i]);
            let nib = _mm512_and_si512(_mm512_srlv_epi32(raw, nib_shift), low4);
            let bits = _mm512_srlv_epi32(qh, _mm512_add_epi32(qh_shift, _mm512_set1_epi32(4 * i as i32)));
            let hb = _mm512_permutexvar_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0xf)), lut);
            *qi = _mm512_sub_epi8(_mm512_or_si512(nib, hb), sixteen);
            sum128 = _mm512_dpbusd_epi32(sum128, c128, *qi);
        }
        DecGroup { q, d, init: _mm512_sub_epi32(z, sum128) }
    }

    /// The 16 lanes summed pairwise: `s[i] += s[i + n]` for n = 8, 4, 2, 1.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c")]
    unsafe fn hsum16(v: __m512) -> f32 {
        let s8 = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// `R` decoded rows × vectors `t0 .. t0 + N`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c")]
    unsafe fn tile<const R: usize, const N: usize>(rows: [&[DecGroup]; R], x: &IntInputs, t0: usize) -> [[f32; N]; R] {
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for g in 0..x.groups {
            for n in 0..N {
                let v = (t0 + n) * x.groups + g;
                let load4 = |bytes: &[u8]| -> [__m512i; 4] {
                    let p = bytes.as_ptr().add(v * GROUP_BYTES);
                    std::array::from_fn(|i| _mm512_loadu_si512(p.add(64 * i) as *const _))
                };
                let (hs, ms, ls) = (load4(&x.hi), load4(&x.mid), load4(&x.lo));
                let s = _mm512_loadu_ps(x.scale.as_ptr().add(v * 16));
                for r in 0..R {
                    let dg = &rows[r][g];
                    let (mut ah, mut am, mut al) = (dg.init, _mm512_setzero_si512(), _mm512_setzero_si512());
                    for i in 0..4 {
                        ah = _mm512_dpbusd_epi32(ah, hs[i], dg.q[i]);
                        am = _mm512_dpbusd_epi32(am, ms[i], dg.q[i]);
                        al = _mm512_dpbusd_epi32(al, ls[i], dg.q[i]);
                    }
                    let upper = _mm512_add_epi32(_mm512_slli_epi32::<8>(ah), am);
                    let sum = _mm512_add_epi32(_mm512_slli_epi32::<8>(upper), al);
                    let ds = _mm512_mul_ps(dg.d, s);
                    acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, acc[r][n]);
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for n in 0..N {
                out[r][n] = hsum16(acc[r][n]);
            }
        }
        out
    }

    /// Rows `start .. start + n`, each decoded once (two at a time), times every vector.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c")]
    pub(super) unsafe fn dot_rows(
        data: &[u8],
        row_bytes: usize,
        start: usize,
        x: &IntInputs,
        outs: &mut [f32],
        n: usize,
    ) {
        let (groups, nb, t) = (x.groups, row_bytes / Q5_0_BYTES, x.t);
        let z = _mm512_setzero_si512();
        let empty = DecGroup { q: [z; 4], d: _mm512_setzero_ps(), init: z };
        let mut dec = vec![empty; 2 * groups];
        let decode_row = |r: usize, into: &mut [DecGroup]| {
            let p = data.as_ptr().add((start + r) * row_bytes);
            for (g, slot) in into.iter_mut().enumerate() {
                *slot = decode_group(p, g, nb);
            }
        };
        let mut r = 0;
        while r + 2 <= n {
            let (a, b) = dec.split_at_mut(groups);
            decode_row(r, a);
            decode_row(r + 1, b);
            let rows = [&a[..], &b[..]];
            let mut ti = 0;
            while ti + 4 <= t {
                let ys = tile::<2, 4>(rows, x, ti);
                for (dr, yr) in ys.iter().enumerate() {
                    for (j, y) in yr.iter().enumerate() {
                        outs[(ti + j) * n + r + dr] = *y;
                    }
                }
                ti += 4;
            }
            for ti in ti..t {
                let ys = tile::<2, 1>(rows, x, ti);
                outs[ti * n + r] = ys[0][0];
                outs[ti * n + r + 1] = ys[1][0];
            }
            r += 2;
        }
        if r < n {
            let a = &mut dec[..groups];
            decode_row(r, a);
            let rows = [&a[..]];
            let mut ti = 0;
            while ti + 4 <= t {
                let ys = tile::<1, 4>(rows, x, ti);
                for (j, y) in ys[0].iter().enumerate() {
                    outs[(ti + j) * n + r] = *y;
                }
                ti += 4;
            }
            for ti in ti..t {
                outs[ti * n + r] = tile::<1, 1>(rows, x, ti)[0][0];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's arithmetic transcribed for one row and vector `ti`, lane by lane.
    fn reference(row: &[u8], x: &IntInputs, ti: usize) -> f32 {
        let nb = row.len() / Q5_0_BYTES;
        let mut acc = [0f32; 16];
        for g in 0..x.groups {
            for (j, a) in acc.iter_mut().enumerate() {
                let b = g * GROUP_BLOCKS + j / 2;
                let v0 = (ti * x.groups + g) * 16;
                let (mut sum, mut d) = (0i32, 0f32);
                if b < nb {
                    let blk = &row[b * Q5_0_BYTES..(b + 1) * Q5_0_BYTES];
                    d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    for step in 0..4 {
                        for byte in 0..4 {
                            let v = 16 * (j % 2) + 4 * step + byte;
                            let nib = if v < 16 { blk[6 + v] & 0xf } else { blk[6 + v - 16] >> 4 };
                            let q = (nib as i32 | (((qh >> v) & 1) << 4) as i32) - 16;
                            let at = ((ti * x.groups + g) * 4 + step) * 64 + j * 4 + byte;
                            let xq = 65536 * (x.hi[at] as i32 - 128) + 256 * x.mid[at] as i32 + x.lo[at] as i32;
                            sum += q * xq;
                        }
                    }
                }
                *a = (sum as f32).mul_add(d * x.scale[v0 + j], *a);
            }
        }
        let mut s = acc;
        for n in [8, 4, 2, 1] {
            for i in 0..n {
                s[i] += s[i + n];
            }
        }
        s[0]
    }

    fn random_rows(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut bytes: Vec<u8> = (0..rows * cols / BLOCK * Q5_0_BYTES).map(|_| next() as u8).collect();
        for blk in bytes.chunks_exact_mut(Q5_0_BYTES) {
            let d = half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5);
            blk[..2].copy_from_slice(&d.to_le_bytes());
        }
        bytes
    }

    fn dequant(row: &[u8]) -> Vec<f64> {
        let mut out = vec![0f32; row.len() / Q5_0_BYTES * BLOCK];
        crate::gguf::dequantize_row(crate::gguf::GgmlType::Q5_0, row, &mut out).unwrap();
        out.into_iter().map(f64::from).collect()
    }

    #[test]
    fn kernel_equals_its_scalar_transcription_and_the_exact_dot() {
        if !enabled() {
            eprintln!("skipping: this CPU has no AVX-512 VNNI");
            return;
        }
        // 640 values (two whole groups and a half one), 7 rows (pairs and a single), 6 vectors
        // (a tile of 4 and single columns); one vector has an outlier and a zero block.
        let (rows, cols, t) = (7, 640, 6);
        let data = random_rows(rows, cols, 7);
        let rb = cols / BLOCK * Q5_0_BYTES;
        let mut xs: Vec<f32> = (0..t * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        xs[cols + 5] = 900.0;
        xs[2 * cols..2 * cols + 32].fill(0.0);
        let x = IntInputs::quantize(&xs, cols);
        let mut outs = vec![0f32; t * rows];
        dot_rows_q5_0(&data, rb, 0, &x, &mut outs);
        for ti in 0..t {
            // One vector alone gives the same bits as in the group.
            let one = IntInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols);
            let mut single = vec![0f32; rows];
            dot_rows_q5_0(&data, rb, 0, &one, &mut single);
            let xv = &xs[ti * cols..(ti + 1) * cols];
            for r in 0..rows {
                let row = &data[r * rb..(r + 1) * rb];
                let got = outs[ti * rows + r];
                assert_eq!(got.to_bits(), reference(row, &x, ti).to_bits(), "row {r} vector {ti}: kernel vs reference");
                assert_eq!(got.to_bits(), single[r].to_bits(), "row {r} vector {ti}: in a group vs alone");
                let w = dequant(row);
                let exact: f64 = w.iter().zip(xv).map(|(w, x)| w * *x as f64).sum();
                let scale: f64 = w.iter().zip(xv).map(|(w, x)| (w * *x as f64).abs()).sum();
                assert!((got as f64 - exact).abs() <= 1e-4 * scale, "row {r} vector {ti}: {got} vs exact {exact}");
            }
        }
        // Rows taken from the middle of the matrix.
        let mut part = vec![0f32; t * 3];
        dot_rows_q5_0(&data, rb, 3, &x, &mut part);
        for ti in 0..t {
            for r in 0..3 {
                assert_eq!(part[ti * 3 + r].to_bits(), outs[ti * rows + 3 + r].to_bits());
            }
        }
    }

    #[test]
    fn non_finite_inputs_reach_the_result() {
        if !enabled() {
            return;
        }
        let data = random_rows(1, 64, 3);
        let mut xs = vec![0.5f32; 64];
        xs[40] = f32::NAN;
        let x = IntInputs::quantize(&xs, 64);
        let mut out = [0f32; 1];
        dot_rows_q5_0(&data, 2 * Q5_0_BYTES, 0, &x, &mut out);
        assert!(out[0].is_nan());
    }
}
