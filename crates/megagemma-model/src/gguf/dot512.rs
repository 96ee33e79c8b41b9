//! Hand-written AVX-512 builds of the hot GGUF dot kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
//! Q5_K, Q6_K), for one or several activation vectors.
//!
//! They compute exactly what the generic kernels in [`super::dot`] compute with fused
//! multiply-adds: the same decoded weight per value (the same multiply or fused multiply-add of
//! the same operands), accumulated into the same 32 lanes (lane `j` takes value `j` of every
//! 32-value group; Q4_K/Q5_K/Q6_K alternate two accumulator sets the same way), then reduced in
//! the same pairwise order. So every result is bit-identical to the AVX2 build, and column `n` of
//! an N-vector call to the 1-vector call. The difference is the register file: a 32-lane
//! accumulator set is two of the 32 `zmm` registers, so 4 vectors × 2 sets (Q4_K, Q6_K) fit
//! without spilling, where the AVX2 build needs 4 `ymm` per set out of 16 and spills from
//! 2 vectors on. The weights are decoded into 16-lane integer vectors with the byte/word
//! instructions (`avx512bw`) and converted once per block for all vectors.

#![allow(clippy::missing_safety_doc)]
// Indexed loops over fixed-size register arrays unroll into straight-line code LLVM keeps in
// registers; iterator forms obscure which accumulator each line touches.
#![allow(clippy::needless_range_loop)]

use super::blocks::{f16_at, k4_scales_mins};
use super::dot::{blocks_for, PREFETCH_AHEAD};
use std::arch::x86_64::*;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn prefetch(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        _mm_prefetch(p.wrapping_add(PREFETCH_AHEAD + off) as *const i8, _MM_HINT_T0);
        off += 64;
    }
}

/// The 32 lanes `lo` (0..16) and `hi` (16..32) summed in [`super::dot`]'s pairwise order:
/// `s[i] += s[i + n]` for n = 16, 8, 4, 2, 1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn hsum(lo: __m512, hi: __m512) -> f32 {
    hsum16(_mm512_add_ps(lo, hi))
}

/// 16 lanes summed pairwise: `s[i] += s[i + n]` for n = 8, 4, 2, 1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn hsum16(s16: __m512) -> f32 {
    let s8 = _mm256_add_ps(
        _mm512_castps512_ps256(s16),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s16))),
    );
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// `hsum` of the lane-wise sum of two accumulator sets (as `hsum2` in [`super::dot`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn hsum2(a: [__m512; 2], b: [__m512; 2]) -> f32 {
    hsum(_mm512_add_ps(a[0], b[0]), _mm512_add_ps(a[1], b[1]))
}

/// 16 bytes at `p` widened to 16 × i32 (unsigned).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn u8x16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn i8x16(p: *const u8) -> __m512i {
    _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))
}

/// `acc[n] = w · x[n][at..at + 16] + acc[n]` (fused) for every vector.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn fma_cols<const N: usize>(acc: &mut [__m512; N], w: __m512, xs: &[*const f32; N], at: usize) {
    for n in 0..N {
        acc[n] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs[n].add(at)), acc[n]);
    }
}

/// A kernel over 32-value blocks of `bs` bytes for `R` rows (each `w[r]`) at once; `decode(block)`
/// returns a block's weights as two 16-lane vectors (values 0..16, 16..32). Each activation
/// vector is loaded once per block for all rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn blocks32<const R: usize, const N: usize>(
    w: [&[u8]; R],
    xs: [&[f32]; N],
    bs: usize,
    decode: impl Fn(*const u8) -> (__m512, __m512),
) -> [[f32; N]; R] {
    let nb = blocks_for(w[0], &xs, bs, 32);
    assert!(w.iter().all(|r| r.len() == w[0].len()), "dot kernel: rows of different sizes");
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let mut acc: Acc<R, N> = [[[_mm512_setzero_ps(); 2]; N]; R];
    for b in 0..nb {
        let mut ws = [[_mm512_setzero_ps(); 2]; R];
        for r in 0..R {
            let p = w[r].as_ptr().add(b * bs);
            prefetch(p, bs);
            let (w0, w1) = decode(p);
            ws[r] = [w0, w1];
        }
        acc_fma(&mut acc, &ws, &xp, 32 * b);
    }
    let mut out = [[0f32; N]; R];
    for r in 0..R {
        for n in 0..N {
            out[r][n] = hsum(acc[r][n][0], acc[r][n][1]);
        }
    }
    out
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn f16_ptr(p: *const u8, i: usize) -> f32 {
    f16_at(std::slice::from_raw_parts(p.add(i), 2), 0)
}

/// [`f16_ptr`] through `vcvtph2ps` (exact, as `f16_to_f32`; NaNs keep sign and payload, quieted,
/// in both). Measured faster in the super-block kernels, slower in the 32-value ones (there the
/// vector pipes are the busy ones and the scalar conversion runs beside them).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn f16_ptr_f16c(p: *const u8, i: usize) -> f32 {
    let h = u16::from_le_bytes(*(p.add(i) as *const [u8; 2]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q8_0<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    blocks32(w, xs, 34, |p| {
        let d = _mm512_set1_ps(f16_ptr(p, 0));
        let q0 = _mm512_cvtepi32_ps(i8x16(p.add(2)));
        let q1 = _mm512_cvtepi32_ps(i8x16(p.add(18)));
        (_mm512_mul_ps(q0, d), _mm512_mul_ps(q1, d))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_0<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    blocks32(w, xs, 18, |p| {
        let d = _mm512_set1_ps(f16_ptr(p, 0));
        let qs = u8x16(p.add(2));
        let eight = _mm512_set1_epi32(8);
        let q0 = _mm512_sub_epi32(_mm512_and_si512(qs, _mm512_set1_epi32(0xf)), eight);
        let q1 = _mm512_sub_epi32(_mm512_srli_epi32::<4>(qs), eight);
        (_mm512_mul_ps(_mm512_cvtepi32_ps(q0), d), _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_1<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    blocks32(w, xs, 20, |p| {
        let (d, m) = (_mm512_set1_ps(f16_ptr(p, 0)), _mm512_set1_ps(f16_ptr(p, 2)));
        let qs = u8x16(p.add(4));
        let q0 = _mm512_cvtepi32_ps(_mm512_and_si512(qs, _mm512_set1_epi32(0xf)));
        let q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(qs));
        (_mm512_fmadd_ps(q0, d, m), _mm512_fmadd_ps(q1, d, m))
    })
}

/// The two 16-lane halves of a Q5_0/Q5_1 block's five-bit values: nibbles from the 16 bytes at
/// `qs`, bit `i` of the little-endian `qh` as bit 4 of value `i`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn q5_values(qh: *const u8, qs: *const u8) -> (__m512, __m512) {
    let h = u32::from_le_bytes(*(qh as *const [u8; 4]));
    let v = u8x16(qs);
    let sixteen = _mm512_set1_epi32(16);
    let q0 = _mm512_and_si512(v, _mm512_set1_epi32(0xf));
    let q1 = _mm512_srli_epi32::<4>(v);
    let q0 = _mm512_mask_or_epi32(q0, h as u16, q0, sixteen);
    let q1 = _mm512_mask_or_epi32(q1, (h >> 16) as u16, q1, sixteen);
    (_mm512_cvtepi32_ps(q0), _mm512_cvtepi32_ps(q1))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_0<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    blocks32(w, xs, 22, |p| {
        let d = f16_ptr(p, 0);
        let (q0, q1) = q5_values(p.add(2), p.add(6));
        // As the generic kernel: q·d − 16·d in one fused step (exact).
        let (dv, m) = (_mm512_set1_ps(d), _mm512_set1_ps(-16.0 * d));
        (_mm512_fmadd_ps(q0, dv, m), _mm512_fmadd_ps(q1, dv, m))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_1<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    blocks32(w, xs, 24, |p| {
        let (d, m) = (_mm512_set1_ps(f16_ptr(p, 0)), _mm512_set1_ps(f16_ptr(p, 2)));
        let (q0, q1) = q5_values(p.add(4), p.add(8));
        (_mm512_fmadd_ps(q0, d, m), _mm512_fmadd_ps(q1, d, m))
    })
}

/// Q4_K / Q5_K: per 64-value chunk `c` the low nibbles are sub-block `2c` (accumulator set
/// `lo`), the high nibbles sub-block `2c + 1` (set `hi`), as in the generic kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn k4<const Q5: bool, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let (bs, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
    let nb = blocks_for(w, &xs, bs, 256);
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let z = _mm512_setzero_ps();
    let (mut lo0, mut lo1, mut hi0, mut hi1) = ([z; N], [z; N], [z; N], [z; N]);
    let nib = _mm512_set1_epi32(0xf);
    let sixteen = _mm512_set1_epi32(16);
    for b in 0..nb {
        let p = w.as_ptr().add(b * bs);
        prefetch(p, bs);
        let (d, dmin) = (f16_ptr_f16c(p, 0), f16_ptr_f16c(p, 2));
        let (sc, mn) = k4_scales_mins(&*(p.add(4) as *const [u8; 12]));
        for c in 0..4 {
            let qs = p.add(qs_off + 32 * c);
            let (v0, v1) = (u8x16(qs), u8x16(qs.add(16)));
            let (mut l0, mut l1) = (_mm512_and_si512(v0, nib), _mm512_and_si512(v1, nib));
            let (mut h0, mut h1) = (_mm512_srli_epi32::<4>(v0), _mm512_srli_epi32::<4>(v1));
            if Q5 {
                let (qh0, qh1) = (u8x16(p.add(16)), u8x16(p.add(32)));
                let (bl, bh) = (_mm512_set1_epi32(1 << (2 * c)), _mm512_set1_epi32(2 << (2 * c)));
                l0 = _mm512_mask_or_epi32(l0, _mm512_test_epi32_mask(qh0, bl), l0, sixteen);
                l1 = _mm512_mask_or_epi32(l1, _mm512_test_epi32_mask(qh1, bl), l1, sixteen);
                h0 = _mm512_mask_or_epi32(h0, _mm512_test_epi32_mask(qh0, bh), h0, sixteen);
                h1 = _mm512_mask_or_epi32(h1, _mm512_test_epi32_mask(qh1, bh), h1, sixteen);
            }
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
            let (d1, m1, d2, m2) = (_mm512_set1_ps(d1), _mm512_set1_ps(-m1), _mm512_set1_ps(d2), _mm512_set1_ps(-m2));
            let at = 256 * b + 64 * c;
            fma_cols(&mut lo0, _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(l0), m1), &xp, at);
            fma_cols(&mut lo1, _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(l1), m1), &xp, at + 16);
            fma_cols(&mut hi0, _mm512_fmadd_ps(d2, _mm512_cvtepi32_ps(h0), m2), &xp, at + 32);
            fma_cols(&mut hi1, _mm512_fmadd_ps(d2, _mm512_cvtepi32_ps(h1), m2), &xp, at + 48);
        }
    }
    std::array::from_fn(|n| hsum2([lo0[n], lo1[n]], [hi0[n], hi1[n]]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_k<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    k4::<false, N>(w, xs)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_k<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    k4::<true, N>(w, xs)
}

/// Q6_K: per half `h` (128 values) four 32-value parts `p`; part `p` takes nibbles from
/// `ql[32·(p & 1)..]` (low for p < 2, high otherwise) and bits `2p, 2p + 1` of `qh`, minus 32.
/// Parts 0 and 2 go to accumulator set `a`, 1 and 3 to set `b`; each 16 values share one scale
/// `d · scales[i]`, and a weight is `scale · q` (one rounding, as the generic kernel).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q6_k<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let nb = blocks_for(w, &xs, 210, 256);
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let z = _mm512_setzero_ps();
    let (mut a0, mut a1, mut b0, mut b1) = ([z; N], [z; N], [z; N], [z; N]);
    let low4 = _mm256_set1_epi8(0xf);
    let two_bits = _mm256_set1_epi8(0x30);
    let bias = _mm256_set1_epi8(32);
    for b in 0..nb {
        let p = w.as_ptr().add(b * 210);
        prefetch(p, 210);
        let d = f16_ptr_f16c(p, 208);
        let scale = |i: usize| _mm512_set1_ps(d * (*p.add(192 + i) as i8) as f32);
        for h in 0..2 {
            let ql = p.add(64 * h);
            let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
            let (ql0, ql1) =
                (_mm256_loadu_si256(ql as *const __m256i), _mm256_loadu_si256(ql.add(32) as *const __m256i));
            // 32 signed values of part `p` as bytes.
            let part = |pt: usize| -> __m256i {
                let src = if pt & 1 == 0 { ql0 } else { ql1 };
                let nibs = if pt < 2 { src } else { _mm256_srli_epi16::<4>(src) };
                let hb = match pt {
                    0 => _mm256_slli_epi16::<4>(qh),
                    1 => _mm256_slli_epi16::<2>(qh),
                    2 => qh,
                    _ => _mm256_srli_epi16::<2>(qh),
                };
                let q = _mm256_or_si256(_mm256_and_si256(nibs, low4), _mm256_and_si256(hb, two_bits));
                _mm256_sub_epi8(q, bias)
            };
            for pt in 0..4 {
                let q = part(pt);
                let g = 8 * h + 2 * pt;
                let at = 256 * b + 128 * h + 32 * pt;
                let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
                let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(q)));
                let (w0, w1) = (_mm512_mul_ps(scale(g), q0), _mm512_mul_ps(scale(g + 1), q1));
                if pt % 2 == 0 {
                    fma_cols(&mut a0, w0, &xp, at);
                    fma_cols(&mut a1, w1, &xp, at + 16);
                } else {
                    fma_cols(&mut b0, w0, &xp, at);
                    fma_cols(&mut b1, w1, &xp, at + 16);
                }
            }
        }
    }
    std::array::from_fn(|n| hsum2([a0[n], a1[n]], [b0[n], b1[n]]))
}

// ---- two rows at once for the super-block types ----
//
// Two rows × 4 vectors × two accumulator sets × 2 registers would be all 32 registers, so the
// two-row kernels make one pass per accumulator set: each pass decodes only the values that
// set takes (half of every super-block) and accumulates them in exactly the order the one-pass
// kernel does; the sets are independent, so the results are the same bits. The rows are read
// twice, the second time from L1.

/// Accumulators of `R` rows × `N` vectors, 32 lanes each.
type Acc<const R: usize, const N: usize> = [[[__m512; 2]; N]; R];

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn acc_fma<const R: usize, const N: usize>(
    acc: &mut Acc<R, N>,
    ws: &[[__m512; 2]; R],
    xp: &[*const f32; N],
    at: usize,
) {
    for n in 0..N {
        let (x0, x1) = (_mm512_loadu_ps(xp[n].add(at)), _mm512_loadu_ps(xp[n].add(at + 16)));
        for r in 0..R {
            acc[r][n][0] = _mm512_fmadd_ps(ws[r][0], x0, acc[r][n][0]);
            acc[r][n][1] = _mm512_fmadd_ps(ws[r][1], x1, acc[r][n][1]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn acc_sums<const R: usize, const N: usize>(a: &Acc<R, N>, b: &Acc<R, N>) -> [[f32; N]; R] {
    let mut out = [[0f32; N]; R];
    for r in 0..R {
        for n in 0..N {
            out[r][n] = hsum2(a[r][n], b[r][n]);
        }
    }
    out
}

/// One pass of Q4_K/Q5_K over `R` rows: `HI = false` accumulates the low-nibble sub-blocks
/// (`2c`), `HI = true` the high-nibble ones (`2c + 1`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline(never)]
unsafe fn k4_pass<const Q5: bool, const HI: bool, const R: usize, const N: usize>(
    w: &[&[u8]; R],
    xp: &[*const f32; N],
    nb: usize,
) -> Acc<R, N> {
    let (bs, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
    let mut acc = [[[_mm512_setzero_ps(); 2]; N]; R];
    let nib = _mm512_set1_epi32(0xf);
    let sixteen = _mm512_set1_epi32(16);
    for b in 0..nb {
        // The pass's sub-block scales and mins of each row: (d·sc, dmin·mn) for sub-block 2c + HI.
        let mut dm = [[(0f32, 0f32); 4]; R];
        for r in 0..R {
            let p = w[r].as_ptr().add(b * bs);
            if !HI {
                prefetch(p, bs);
            }
            let (d, dmin) = (f16_ptr_f16c(p, 0), f16_ptr_f16c(p, 2));
            let (sc, mn) = k4_scales_mins(&*(p.add(4) as *const [u8; 12]));
            for c in 0..4 {
                let s = 2 * c + HI as usize;
                dm[r][c] = (d * sc[s] as f32, dmin * mn[s] as f32);
            }
        }
        for c in 0..4 {
            let mut ws = [[_mm512_setzero_ps(); 2]; R];
            for r in 0..R {
                let p = w[r].as_ptr().add(b * bs);
                let qs = p.add(qs_off + 32 * c);
                let (v0, v1) = (u8x16(qs), u8x16(qs.add(16)));
                let (mut q0, mut q1) = if HI {
                    (_mm512_srli_epi32::<4>(v0), _mm512_srli_epi32::<4>(v1))
                } else {
                    (_mm512_and_si512(v0, nib), _mm512_and_si512(v1, nib))
                };
                if Q5 {
                    let (qh0, qh1) = (u8x16(p.add(16)), u8x16(p.add(32)));
                    let bit = _mm512_set1_epi32(1 << (2 * c + HI as usize));
                    q0 = _mm512_mask_or_epi32(q0, _mm512_test_epi32_mask(qh0, bit), q0, sixteen);
                    q1 = _mm512_mask_or_epi32(q1, _mm512_test_epi32_mask(qh1, bit), q1, sixteen);
                }
                let (dd, m) = (_mm512_set1_ps(dm[r][c].0), _mm512_set1_ps(-dm[r][c].1));
                ws[r] =
                    [_mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(q0), m), _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(q1), m)];
            }
            acc_fma(&mut acc, &ws, xp, 256 * b + 64 * c + if HI { 32 } else { 0 });
        }
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn k4_rows<const Q5: bool, const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    let bs = if Q5 { 176 } else { 144 };
    let nb = blocks_for(w[0], &xs, bs, 256);
    assert!(w.iter().all(|r| r.len() == w[0].len()), "dot kernel: rows of different sizes");
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let lo = k4_pass::<Q5, false, R, N>(&w, &xp, nb);
    let hi = k4_pass::<Q5, true, R, N>(&w, &xp, nb);
    acc_sums(&lo, &hi)
}

/// Q4_K, two rows × N vectors (one pass per accumulator set).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_k_rows<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    k4_rows::<false, R, N>(w, xs)
}

/// Q5_K, two rows × N vectors (one pass per accumulator set).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_k_rows<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    k4_rows::<true, R, N>(w, xs)
}

/// One pass of Q6_K over `R` rows: parts `P` and `P + 2` of each half (set `a` for P = 0, set
/// `b` for P = 1).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline(never)]
unsafe fn q6k_pass<const P: usize, const R: usize, const N: usize>(
    w: &[&[u8]; R],
    xp: &[*const f32; N],
    nb: usize,
) -> Acc<R, N> {
    let mut acc = [[[_mm512_setzero_ps(); 2]; N]; R];
    let low4 = _mm256_set1_epi8(0xf);
    let two_bits = _mm256_set1_epi8(0x30);
    let bias = _mm256_set1_epi8(32);
    for b in 0..nb {
        let mut d = [0f32; R];
        for r in 0..R {
            let p = w[r].as_ptr().add(b * 210);
            if P == 0 {
                prefetch(p, 210);
            }
            d[r] = f16_ptr_f16c(p, 208);
        }
        for h in 0..2 {
            for half_part in 0..2 {
                let pt = P + 2 * half_part;
                let mut ws = [[_mm512_setzero_ps(); 2]; R];
                for r in 0..R {
                    let p = w[r].as_ptr().add(b * 210);
                    let src = _mm256_loadu_si256(p.add(64 * h + 32 * P) as *const __m256i);
                    let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                    let nibs = if pt < 2 { src } else { _mm256_srli_epi16::<4>(src) };
                    let hb = match pt {
                        0 => _mm256_slli_epi16::<4>(qh),
                        1 => _mm256_slli_epi16::<2>(qh),
                        2 => qh,
                        _ => _mm256_srli_epi16::<2>(qh),
                    };
                    let q = _mm256_or_si256(_mm256_and_si256(nibs, low4), _mm256_and_si256(hb, two_bits));
                    let q = _mm256_sub_epi8(q, bias);
                    let g = 8 * h + 2 * pt;
                    let s0 = _mm512_set1_ps(d[r] * (*p.add(192 + g) as i8) as f32);
                    let s1 = _mm512_set1_ps(d[r] * (*p.add(192 + g + 1) as i8) as f32);
                    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
                    let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(q)));
                    ws[r] = [_mm512_mul_ps(s0, q0), _mm512_mul_ps(s1, q1)];
                }
                acc_fma(&mut acc, &ws, xp, 256 * b + 128 * h + 32 * pt);
            }
        }
    }
    acc
}

/// Q6_K, two rows × N vectors (one pass per accumulator set).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_q6_k_rows<const R: usize, const N: usize>(w: [&[u8]; R], xs: [&[f32]; N]) -> [[f32; N]; R] {
    let nb = blocks_for(w[0], &xs, 210, 256);
    assert!(w.iter().all(|r| r.len() == w[0].len()), "dot kernel: rows of different sizes");
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let a = q6k_pass::<0, R, N>(&w, &xp, nb);
    let b = q6k_pass::<1, R, N>(&w, &xp, nb);
    acc_sums(&a, &b)
}
