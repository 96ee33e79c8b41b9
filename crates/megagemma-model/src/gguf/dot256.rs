//! Hand-written AVX2 builds of the GGUF block kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
//! Q5_K, Q6_K), for one or several activation vectors, on CPUs without AVX-512.
//!
//! They compute exactly what the generic kernels in [`super::dot`] compute with fused
//! multiply-adds — the same decoded weight per value (the same multiply or fused multiply-add of
//! the same operands), accumulated into the same 32 lanes (lane `j` takes value `j` of every
//! 32-value group; the super-block types alternate two accumulator sets the same way), reduced in
//! the same pairwise order — so every result is bit-identical to the generic AVX2 build, and
//! column `n` of an N-vector call to the 1-vector call.
//!
//! Two things make them faster than that build (measured on a 2-core AMD EPYC without AVX-512:
//! see docs/perf-notes.md). The generic source compiled for AVX2 converts f16 scales in software
//! and, with 32 lanes per set in 4 of the 16 `ymm` registers, spills its accumulators from two
//! vectors on. Here a 32-lane set is four "quarters" of 8 lanes, and a row is walked once per
//! group of quarters, choosing as many quarters per walk as keep the accumulators of all vectors
//! and sets within 8 registers: one walk for a single vector, two for four vectors over 32-value
//! blocks, four for four vectors over the two-set super-blocks. Lanes never interact before the
//! final reduction, so splitting the walk changes no bit; later walks read the row from L1.

#![allow(clippy::missing_safety_doc)]
// Indexed loops over fixed-size register arrays unroll into straight-line code LLVM keeps in
// registers; iterator forms obscure which accumulator each line touches.
#![allow(clippy::needless_range_loop)]

use super::blocks::k4_scales_mins;
use super::dot::{blocks_for, PREFETCH_AHEAD};
use std::arch::x86_64::*;

/// Accumulators of up to 4 vectors × 2 sets × 4 quarters (only those of one walk are live).
type Acc<const N: usize> = [[[__m256; 4]; 2]; N];

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn prefetch(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        _mm_prefetch(p.wrapping_add(PREFETCH_AHEAD + off) as *const i8, _MM_HINT_T0);
        off += 64;
    }
}

/// The f16 at `p + i` as f32 (`vcvtph2ps`: exact, as `f16_to_f32`; NaNs keep sign and payload,
/// quieted, in both).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_at(p: *const u8, i: usize) -> f32 {
    let h = u16::from_le_bytes(*(p.add(i) as *const [u8; 2]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// 8 bytes at `p` widened to 8 × i32, unsigned / signed.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn i8x8(p: *const u8) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

/// `v >> n` per lane (`n` is a constant once the kernels are unrolled).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn srl(v: __m256i, n: usize) -> __m256i {
    _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32))
}

/// Quarter `k` of a 32-value block's nibbles: byte `j` of the 16 code bytes holds value `j`
/// (low nibble) and value `16 + j` (high nibble), so quarter `k` is the low (k < 2) or high
/// (k ≥ 2) nibbles of bytes `8·(k mod 2) ..`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles(qs: *const u8, k: usize) -> __m256i {
    let v = u8x8(qs.add(8 * (k % 2)));
    if k < 2 {
        _mm256_and_si256(v, _mm256_set1_epi32(0xf))
    } else {
        _mm256_srli_epi32::<4>(v)
    }
}

/// The 32 lanes of a set (quarters 0..4) summed in [`super::dot`]'s pairwise order:
/// `s[i] += s[i + n]` for n = 16, 8, 4, 2, 1.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(q: [__m256; 4]) -> f32 {
    let s8 = _mm256_add_ps(_mm256_add_ps(q[0], q[2]), _mm256_add_ps(q[1], q[3]));
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// One walk over a row's `nb` blocks of `bs` bytes and `groups` 32-value groups each, for
/// quarters `K0 .. K0 + Q`: `scales(block)` decodes what a block's groups share, `weights(block,
/// scales, g, k)` returns weights `8k .. 8k + 8` of group `g`, which go to set `g % SETS`. The
/// set loop is the inner one, so that each accumulator's index is a constant once unrolled (with
/// `g % SETS` from a runtime loop they stayed in memory: a load and a store per FMA).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn walk<const N: usize, const K0: usize, const Q: usize, const SETS: usize, S>(
    acc: &mut Acc<N>,
    w: &[u8],
    xp: &[*const f32; N],
    (nb, bs, groups): (usize, usize, usize),
    scales: &impl Fn(*const u8) -> S,
    weights: &impl Fn(*const u8, &S, usize, usize) -> __m256,
) {
    for b in 0..nb {
        let p = w.as_ptr().add(b * bs);
        if K0 == 0 {
            prefetch(p, bs);
        }
        let s = scales(p);
        for g2 in 0..groups / SETS {
            for set in 0..SETS {
                let g = SETS * g2 + set;
                for q in 0..Q {
                    let k = K0 + q;
                    let wv = weights(p, &s, g, k);
                    let at = 32 * (groups * b + g) + 8 * k;
                    for n in 0..N {
                        let a = &mut acc[n][set][k];
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp[n].add(at)), *a);
                    }
                }
            }
        }
    }
}

/// The kernel over blocks of `bs` bytes holding `groups` 32-value groups in `SETS` alternating
/// accumulator sets: walks the row once, twice or four times (see the module documentation),
/// then reduces each vector's sets.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn blocks<const N: usize, const SETS: usize, S>(
    w: &[u8],
    xs: [&[f32]; N],
    (bs, groups): (usize, usize),
    scales: impl Fn(*const u8) -> S,
    weights: impl Fn(*const u8, &S, usize, usize) -> __m256,
) -> [f32; N] {
    let nb = blocks_for(w, &xs, bs, 32 * groups);
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let shape = (nb, bs, groups);
    let mut acc: Acc<N> = [[[_mm256_setzero_ps(); 4]; 2]; N];
    match N * SETS {
        1 | 2 => walk::<N, 0, 4, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights),
        3 | 4 => {
            walk::<N, 0, 2, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights);
            walk::<N, 2, 2, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights);
        }
        _ => {
            walk::<N, 0, 1, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights);
            walk::<N, 1, 1, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights);
            walk::<N, 2, 1, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights);
            walk::<N, 3, 1, SETS, S>(&mut acc, w, &xp, shape, &scales, &weights);
        }
    }
    std::array::from_fn(|n| {
        if SETS == 1 {
            hsum(acc[n][0])
        } else {
            // As the generic `hsum2`: the two sets added lane by lane, then reduced.
            hsum(std::array::from_fn(|k| _mm256_add_ps(acc[n][0][k], acc[n][1][k])))
        }
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q8_0<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    blocks::<N, 1, _>(
        w,
        xs,
        (34, 1),
        |p| _mm256_set1_ps(f16_at(p, 0)),
        |p, d, _, k| _mm256_mul_ps(_mm256_cvtepi32_ps(i8x8(p.add(2 + 8 * k))), *d),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_0<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    blocks::<N, 1, _>(
        w,
        xs,
        (18, 1),
        |p| _mm256_set1_ps(f16_at(p, 0)),
        |p, d, _, k| {
            let q = _mm256_sub_epi32(nibbles(p.add(2), k), _mm256_set1_epi32(8));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), *d)
        },
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_1<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    blocks::<N, 1, _>(
        w,
        xs,
        (20, 1),
        |p| (_mm256_set1_ps(f16_at(p, 0)), _mm256_set1_ps(f16_at(p, 2))),
        |p, &(d, m), _, k| _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibbles(p.add(4), k)), d, m),
    )
}

/// Quarter `k` of a Q5_0/Q5_1 block's five-bit values: nibbles from the 16 bytes at `qs`, bit
/// `i` of the little-endian `qh` as bit 4 of value `i` (`(qh >> 8k) << 4 >> lane`, masked).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_quarter(qh: u32, qs: *const u8, k: usize) -> __m256 {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let h = _mm256_srlv_epi32(_mm256_set1_epi32(((qh >> (8 * k)) << 4) as i32), lanes);
    let h = _mm256_and_si256(h, _mm256_set1_epi32(16));
    _mm256_cvtepi32_ps(_mm256_or_si256(nibbles(qs, k), h))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_0<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    blocks::<N, 1, _>(
        w,
        xs,
        (22, 1),
        |p| {
            let d = f16_at(p, 0);
            // As the generic kernel: q·d − 16·d in one fused step (exact).
            (_mm256_set1_ps(d), _mm256_set1_ps(-16.0 * d), u32::from_le_bytes(*(p.add(2) as *const [u8; 4])))
        },
        |p, &(d, m, qh), _, k| _mm256_fmadd_ps(q5_quarter(qh, p.add(6), k), d, m),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_1<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    blocks::<N, 1, _>(
        w,
        xs,
        (24, 1),
        |p| {
            let (d, m) = (_mm256_set1_ps(f16_at(p, 0)), _mm256_set1_ps(f16_at(p, 2)));
            (d, m, u32::from_le_bytes(*(p.add(4) as *const [u8; 4])))
        },
        |p, &(d, m, qh), _, k| _mm256_fmadd_ps(q5_quarter(qh, p.add(8), k), d, m),
    )
}

/// Q4_K / Q5_K: group `g` of a super-block is the low (g even) or high (g odd) nibbles of the 32
/// code bytes of chunk `g / 2`, with scale `d·sc[g]` and offset `dmin·mn[g]`, as in the generic
/// kernel (`Q5`: bit `g` of `qh[l]` is bit 4 of value `l`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn k4<const Q5: bool, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let (bs, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
    blocks::<N, 2, _>(
        w,
        xs,
        (bs, 8),
        |p| {
            let (d, dmin) = (f16_at(p, 0), f16_at(p, 2));
            let (sc, mn) = k4_scales_mins(&*(p.add(4) as *const [u8; 12]));
            let ds: [f32; 8] = std::array::from_fn(|i| d * sc[i] as f32);
            let ms: [f32; 8] = std::array::from_fn(|i| -(dmin * mn[i] as f32));
            (ds, ms)
        },
        |p, (ds, ms), g, k| {
            let v = u8x8(p.add(qs_off + 32 * (g / 2) + 8 * k));
            let mut q =
                if g % 2 == 0 { _mm256_and_si256(v, _mm256_set1_epi32(0xf)) } else { _mm256_srli_epi32::<4>(v) };
            if Q5 {
                let h = srl(_mm256_slli_epi32::<4>(u8x8(p.add(16 + 8 * k))), g);
                q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi32(16)));
            }
            _mm256_fmadd_ps(_mm256_set1_ps(ds[g]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(ms[g]))
        },
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_k<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    k4::<false, N>(w, xs)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_k<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    k4::<true, N>(w, xs)
}

/// Q6_K: group `g = 4h + p` is part `p` of half `h` (128 values): nibbles from
/// `ql[64h + 32·(p & 1) ..]` (low for p < 2, high otherwise) and bits `2p, 2p + 1` of
/// `qh[128 + 32h ..]`, minus 32; each 16 values share one scale `d · scales[i]`, and a weight is
/// `scale · q` (one rounding, as the generic kernel). Even parts go to set 0, odd to set 1.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q6_k<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    blocks::<N, 2, _>(
        w,
        xs,
        (210, 8),
        |p| {
            let d = f16_at(p, 208);
            let s: [f32; 16] = std::array::from_fn(|i| d * (*p.add(192 + i) as i8) as f32);
            s
        },
        |p, s, g, k| {
            let (h, part) = (g / 4, g % 4);
            let ql = u8x8(p.add(64 * h + 32 * (part % 2) + 8 * k));
            let nib = _mm256_and_si256(srl(ql, 4 * (part / 2)), _mm256_set1_epi32(0xf));
            let hb = _mm256_and_si256(srl(u8x8(p.add(128 + 32 * h + 8 * k)), 2 * part), _mm256_set1_epi32(3));
            let q = _mm256_sub_epi32(_mm256_or_si256(nib, _mm256_slli_epi32::<4>(hb)), _mm256_set1_epi32(32));
            _mm256_mul_ps(_mm256_set1_ps(s[8 * h + 2 * part + k / 2]), _mm256_cvtepi32_ps(q))
        },
    )
}
