//! Fused dequantize-and-dot kernels: `dot(row, x)` for one quantized row against an f32 vector,
//! without materialising the dequantized row.
//!
//! Each kernel rebuilds every weight bit-exactly as [`super::dequantize_row`] does (`d·q`,
//! `d·q − m`: the products of small integers and f16-derived scales are exact in f32, so fusing
//! them changes nothing), then accumulates `w·x` into 32 independent f32 lanes summed pairwise
//! at the end. Work is phrased as fixed-size loops over 32-value groups, which LLVM turns into
//! 8-wide SIMD with short dependency chains; blocks a few hundred bytes ahead are prefetched.
//!
//! Every kernel is generic over `N`, the number of activation vectors (columns) it dots each row
//! with: a block is decoded once and multiplied into N accumulator sets, so a multi-token pass
//! (speculative verify, prefill) reads and decodes each weight once for N tokens. Column `n`'s
//! arithmetic is exactly the single-column kernel's — the same decoded weight, the same
//! multiply-adds in the same order — so every column is bit-identical to an `N = 1` call.
//!
//! Every kernel is compiled twice from the same generic source: a portable build (baseline
//! x86-64 is SSE2: no FMA, no byte→int widening) and, on x86-64, an AVX2+FMA build chosen at run
//! time (1.5–3× faster on the dev VM). The FMA build fuses `w·x + acc` (one rounding instead of
//! two), so the builds differ in the last bits of the sum; a process always uses one of them.
//! On x86-64 the block types use hand-written kernels instead, which give exactly the AVX2
//! build's bits: `dot512.rs` on CPUs with AVX-512 (the accumulators of 4 vectors held in
//! registers; an AVX-512 build of this generic source was measured slower than AVX2), else
//! `dot256.rs` (f16 scales by F16C, and a row walked in lane groups so that the accumulators of
//! 4 vectors never spill). The generic AVX2 build stays the reference both are tested against.

use super::blocks::{check_row, f16_at, k4_scales_mins, q6k_half, supported_list, GgmlType};
use crate::bail;
use crate::error::Result;

/// `a·b + c`: either two roundings (portable: `mul_add` without hardware FMA is a libm call) or
/// one fused instruction.
trait Madd {
    fn madd(a: f32, b: f32, c: f32) -> f32;
}

struct Unfused;
impl Madd for Unfused {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
struct Fused;
#[cfg(target_arch = "x86_64")]
impl Madd for Fused {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

const LANES: usize = 32;

/// How far ahead of the block being decoded to prefetch. Rows are streamed once per matvec; on
/// the 2-core dev VM the hardware prefetcher alone left the Q4_K kernel at ~1/3 of its
/// cache-resident speed once the matrix exceeded L2.
pub(super) const PREFETCH_AHEAD: usize = 1024;

/// Prefetch the cache lines `PREFETCH_AHEAD` bytes past `block` (the weights decoded a few
/// blocks from now, possibly in the next row, which is contiguous).
#[inline(always)]
fn prefetch_ahead(block: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..block.len()).step_by(64) {
        let p = block.as_ptr().wrapping_add(PREFETCH_AHEAD + off) as *const i8;
        // SAFETY: a prefetch is only a hint; it never faults, even past the end of a mapping.
        unsafe { std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = block;
}

/// Checks the shapes the hand-written kernels (`dot256.rs`, `dot512.rs`) rely on: `w` holds whole
/// blocks of `bs` bytes, each encoding `vals` values, and every vector has that many values.
/// Returns the number of blocks.
#[inline(always)]
pub(super) fn blocks_for<const N: usize>(w: &[u8], xs: &[&[f32]; N], bs: usize, vals: usize) -> usize {
    let nb = w.len() / bs;
    assert!(nb * bs == w.len() && xs.iter().all(|x| x.len() == nb * vals), "dot kernel: row/vector size mismatch");
    nb
}

/// Sum of the lanes in a fixed pairwise order (reproducible results).
///
/// Kept out of line on purpose: with this reduction inlined after a kernel's loop, LLVM's SLP
/// vectorizer gives up on the loop body and emits 2-wide code (seen with rustc 1.95, ~5× slower).
#[inline(never)]
fn hsum(acc: &[f32; LANES]) -> f32 {
    let mut s = *acc;
    let mut n = LANES / 2;
    while n > 0 {
        for i in 0..n {
            s[i] += s[i + n];
        }
        n /= 2;
    }
    s[0]
}

#[inline(never)]
fn hsum2(a: &[f32; LANES], b: &[f32; LANES]) -> f32 {
    let mut s = [0f32; LANES];
    for i in 0..LANES {
        s[i] = a[i] + b[i];
    }
    hsum(&s)
}

/// `[f(0), …, f(31)]` as a plain indexed loop (LLVM vectorises it inside the kernels; the
/// `std::array::from_fn` equivalent was left out of line in some instantiations).
#[inline(always)]
fn lanes32(f: impl Fn(usize) -> f32) -> [f32; 32] {
    let mut v = [0f32; 32];
    for (j, x) in v.iter_mut().enumerate() {
        *x = f(j);
    }
    v
}

/// Per-column lane sums.
#[inline(always)]
fn hsum_cols<const N: usize>(acc: &[[f32; LANES]; N]) -> [f32; N] {
    std::array::from_fn(|n| hsum(&acc[n]))
}

#[inline(always)]
fn hsum2_cols<const N: usize>(a: &[[f32; LANES]; N], b: &[[f32; LANES]; N]) -> [f32; N] {
    std::array::from_fn(|n| hsum2(&a[n], &b[n]))
}

/// `acc[n][j] += w[j] · xs[n][at + j]` for 32 decoded weights and every column `n`.
#[inline(always)]
fn fma_cols<M: Madd, const N: usize>(acc: &mut [[f32; LANES]; N], w: &[f32; 32], xs: &[&[f32]; N], at: usize) {
    for n in 0..N {
        let x: &[f32; 32] = xs[n][at..at + 32].try_into().unwrap();
        for j in 0..32 {
            acc[n][j] = M::madd(w[j], x[j], acc[n][j]);
        }
    }
}

// ---- plain float rows (block size 1: any length, so a scalar tail handles the remainder) ----

#[inline(always)]
fn dot_floats<M: Madd, const B: usize, const N: usize>(
    w: &[u8],
    xs: [&[f32]; N],
    load: impl Fn(&[u8; B]) -> f32,
) -> [f32; N] {
    let cols = xs[0].len();
    let full = cols / LANES * LANES;
    let mut acc = [[0f32; LANES]; N];
    for (c, wb) in w[..full * B].chunks_exact(B * LANES).enumerate() {
        prefetch_ahead(wb);
        let v = lanes32(|i| load(wb[B * i..B * (i + 1)].try_into().unwrap()));
        fma_cols::<M, N>(&mut acc, &v, &xs, c * LANES);
    }
    let mut tail = [0f32; N];
    for (i, wb) in w[full * B..].chunks_exact(B).enumerate() {
        let v = load(wb.try_into().unwrap());
        for n in 0..N {
            tail[n] = M::madd(v, xs[n][full + i], tail[n]);
        }
    }
    let sums = hsum_cols(&acc);
    std::array::from_fn(|n| sums[n] + tail[n])
}

#[inline(always)]
fn dot_f32<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_floats::<M, 4, N>(w, xs, |b| f32::from_le_bytes(*b))
}

#[inline(always)]
fn dot_f16<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_floats::<M, 2, N>(w, xs, |b| super::blocks::f16_to_f32(u16::from_le_bytes(*b)))
}

#[inline(always)]
fn dot_bf16<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_floats::<M, 2, N>(w, xs, |b| f32::from_bits((u16::from_le_bytes(*b) as u32) << 16))
}

// ---- 32-value blocks ----

/// A kernel over 32-value blocks of `bs` bytes, each decoded by `decode` into 32 weights.
#[inline(always)]
fn dot_blocks32<M: Madd, const N: usize>(
    w: &[u8],
    xs: [&[f32]; N],
    bs: usize,
    decode: impl Fn(&[u8]) -> [f32; 32],
) -> [f32; N] {
    let mut acc = [[0f32; LANES]; N];
    for (b, blk) in w.chunks_exact(bs).enumerate() {
        prefetch_ahead(blk);
        fma_cols::<M, N>(&mut acc, &decode(blk), &xs, 32 * b);
    }
    hsum_cols(&acc)
}

#[inline(always)]
fn dot_q8_0<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_blocks32::<M, N>(w, xs, 34, |blk| {
        let d = f16_at(blk, 0);
        lanes32(|j| (blk[2 + j] as i8) as f32 * d)
    })
}

#[inline(always)]
fn dot_q4_0<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_blocks32::<M, N>(w, xs, 18, |blk| {
        let d = f16_at(blk, 0);
        let qs: &[u8; 16] = blk[2..18].try_into().unwrap();
        let mut v = [0f32; 32];
        for j in 0..16 {
            v[j] = ((qs[j] & 0xf) as i32 - 8) as f32 * d;
            v[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
        v
    })
}

#[inline(always)]
fn dot_q4_1<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_blocks32::<M, N>(w, xs, 20, |blk| {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let qs: &[u8; 16] = blk[4..20].try_into().unwrap();
        let mut v = [0f32; 32];
        for j in 0..16 {
            v[j] = M::madd((qs[j] & 0xf) as f32, d, m);
            v[j + 16] = M::madd((qs[j] >> 4) as f32, d, m);
        }
        v
    })
}

/// The 32 five-bit values of a Q5_0/Q5_1 block: nibbles from `qs`, 5th bit `i` from bit `i` of
/// the little-endian `qh`.
#[inline(always)]
fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    // Spread the 8 bits of each qh byte into 8 bytes of 0x00/0x10 with scalar u64 arithmetic:
    // broadcast the byte, keep bit k in byte k, turn non-zero bytes into 0x80, shift to 0x10.
    let mut hb = [0u8; 32];
    for (i, &b) in qh.iter().enumerate() {
        let v = ((b as u64).wrapping_mul(0x0101_0101_0101_0101) & 0x8040_2010_0804_0201) + 0x7f7f_7f7f_7f7f_7f7f;
        hb[8 * i..8 * i + 8].copy_from_slice(&((v & 0x8080_8080_8080_8080) >> 3).to_le_bytes());
    }
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0xf) | hb[j];
        q[j + 16] = (qs[j] >> 4) | hb[j + 16];
    }
    q
}

#[inline(always)]
fn dot_q5_0<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_blocks32::<M, N>(w, xs, 22, |blk| {
        let d = f16_at(blk, 0);
        let q = q5_values(blk[2..6].try_into().unwrap(), blk[6..22].try_into().unwrap());
        // (q - 16)·d as q·d − 16·d: both products and their difference are exact in f32
        // (5-bit × 11-bit significands), so this equals the dequantized weight bit for bit.
        let m = -16.0 * d;
        lanes32(|j| M::madd(q[j] as f32, d, m))
    })
}

#[inline(always)]
fn dot_q5_1<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_blocks32::<M, N>(w, xs, 24, |blk| {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let q = q5_values(blk[4..8].try_into().unwrap(), blk[8..24].try_into().unwrap());
        lanes32(|j| M::madd(q[j] as f32, d, m))
    })
}

// ---- 256-value super-blocks ----

/// Q4_K and Q5_K share everything but the 5th bit (`Q5`: bit `s` of `qh[l]` belongs to value `l`
/// of sub-block `s`). Two accumulator sets (low/high nibble sub-blocks) keep FMA chains short.
#[inline(always)]
fn dot_k4<M: Madd, const Q5: bool, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let (bs, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
    let (mut acc_lo, mut acc_hi) = ([[0f32; LANES]; N], [[0f32; LANES]; N]);
    for (b, blk) in w.chunks_exact(bs).enumerate() {
        prefetch_ahead(blk);
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (sc, mn) = k4_scales_mins(blk[4..16].try_into().unwrap());
        for c in 0..4 {
            let qs: &[u8; 32] = blk[qs_off + 32 * c..qs_off + 32 * (c + 1)].try_into().unwrap();
            let mut lo = [0u8; 32];
            let mut hi = [0u8; 32];
            for l in 0..32 {
                lo[l] = qs[l] & 0xf;
                hi[l] = qs[l] >> 4;
            }
            if Q5 {
                let qh: &[u8; 32] = blk[16..48].try_into().unwrap();
                for l in 0..32 {
                    lo[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi[l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
            }
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
            let w1 = lanes32(|l| M::madd(d1, lo[l] as f32, -m1));
            let w2 = lanes32(|l| M::madd(d2, hi[l] as f32, -m2));
            fma_cols::<M, N>(&mut acc_lo, &w1, &xs, 256 * b + 64 * c);
            fma_cols::<M, N>(&mut acc_hi, &w2, &xs, 256 * b + 64 * c + 32);
        }
    }
    hsum2_cols(&acc_lo, &acc_hi)
}

#[inline(always)]
fn dot_q4_k<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_k4::<M, false, N>(w, xs)
}

#[inline(always)]
fn dot_q5_k<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_k4::<M, true, N>(w, xs)
}

/// 32 Q6_K weights whose first and last 16 have scales `s0` and `s1`.
#[inline(always)]
fn q6k_weights(q: &[i8], s0: f32, s1: f32) -> [f32; 32] {
    lanes32(|j| if j < 16 { s0 * q[j] as f32 } else { s1 * q[j] as f32 })
}

#[inline(always)]
fn dot_q6_k<M: Madd, const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let (mut acc_a, mut acc_b) = ([[0f32; LANES]; N], [[0f32; LANES]; N]);
    for (b, blk) in w.chunks_exact(210).enumerate() {
        prefetch_ahead(blk);
        let d = f16_at(blk, 208);
        let scale = |i: usize| d * (blk[192 + i] as i8) as f32;
        for h in 0..2 {
            let q = q6k_half(
                blk[64 * h..64 * h + 64].try_into().unwrap(),
                blk[128 + 32 * h..128 + 32 * h + 32].try_into().unwrap(),
            );
            // Scales change every 16 values, so one 32-lane pass uses two; passes alternate
            // between two accumulator sets (statically: a runtime choice defeats vectorization).
            for pp in 0..2 {
                let (p0, p1) = (2 * pp, 2 * pp + 1);
                let (sa, sb) = (8 * h + 2 * p0, 8 * h + 2 * p1);
                let wa = q6k_weights(&q[32 * p0..32 * p0 + 32], scale(sa), scale(sa + 1));
                let wb = q6k_weights(&q[32 * p1..32 * p1 + 32], scale(sb), scale(sb + 1));
                fma_cols::<M, N>(&mut acc_a, &wa, &xs, 256 * b + 128 * h + 32 * p0);
                fma_cols::<M, N>(&mut acc_b, &wb, &xs, 256 * b + 128 * h + 32 * p1);
            }
        }
    }
    hsum2_cols(&acc_a, &acc_b)
}

/// A dot kernel: `bytes` encodes exactly `x.len()` values (checked by the caller).
pub(super) type DotFn = fn(&[u8], &[f32]) -> f32;

/// Columns a multi-column kernel takes at once (accumulators for more would spill).
pub const MULTI: usize = 4;

/// A row against [`MULTI`] columns at once; column `n` equals the [`DotFn`] result for `xs[n]`.
pub(super) type DotMultiFn = fn(&[u8], [&[f32]; MULTI]) -> [f32; MULTI];

macro_rules! kernels {
    ($($ty:ident => $f:ident),* $(,)?) => {
        fn portable_kernel(ty: GgmlType) -> Option<(DotFn, DotMultiFn)> {
            match ty {
                $(GgmlType::$ty => Some((|w, x| $f::<Unfused, 1>(w, [x])[0], |w, xs| $f::<Unfused, MULTI>(w, xs))),)*
                _ => None,
            }
        }

        #[cfg(target_arch = "x86_64")]
        mod avx2 {
            use super::*;
            $(
                #[target_feature(enable = "avx2,fma")]
                pub(super) unsafe fn $f<const N: usize>(w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
                    super::$f::<Fused, N>(w, xs)
                }
            )*
        }

        /// Only called after `is_x86_feature_detected!` confirmed AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        fn avx2_kernel(ty: GgmlType) -> Option<(DotFn, DotMultiFn)> {
            match ty {
                // SAFETY: the CPU supports avx2+fma (checked by the only caller).
                $(GgmlType::$ty => Some((
                    |w, x| unsafe { avx2::$f::<1>(w, [x])[0] },
                    |w, xs| unsafe { avx2::$f::<MULTI>(w, xs) },
                )),)*
                _ => None,
            }
        }
    };
}

kernels! {
    F32 => dot_f32, F16 => dot_f16, BF16 => dot_bf16,
    Q8_0 => dot_q8_0, Q4_0 => dot_q4_0, Q4_1 => dot_q4_1, Q5_0 => dot_q5_0, Q5_1 => dot_q5_1,
    Q4_K => dot_q4_k, Q5_K => dot_q5_k, Q6_K => dot_q6_k,
}

/// The hand-written AVX-512 kernels (`dot512.rs`): the same bits as the AVX2 build.
/// Only called after `is_x86_feature_detected!` confirmed AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
fn avx512_kernel(ty: GgmlType) -> Option<(DotFn, DotMultiFn)> {
    use super::dot512 as k;
    macro_rules! pair {
        ($f:ident) => {
            // SAFETY: the CPU supports the kernels' features (checked by the only caller).
            Some((|w, x| unsafe { k::$f::<1>(w, [x])[0] }, |w, xs| unsafe { k::$f::<MULTI>(w, xs) }))
        };
    }
    macro_rules! rows {
        ($f:ident) => {
            // SAFETY: as above.
            Some((|w, x| unsafe { k::$f::<1, 1>([w], [x])[0][0] }, |w, xs| unsafe { k::$f::<1, MULTI>([w], xs)[0] }))
        };
    }
    match ty {
        GgmlType::Q8_0 => rows!(dot_q8_0),
        GgmlType::Q4_0 => rows!(dot_q4_0),
        GgmlType::Q4_1 => rows!(dot_q4_1),
        GgmlType::Q5_0 => rows!(dot_q5_0),
        GgmlType::Q5_1 => rows!(dot_q5_1),
        GgmlType::Q4_K => pair!(dot_q4_k),
        GgmlType::Q5_K => pair!(dot_q5_k),
        GgmlType::Q6_K => pair!(dot_q6_k),
        _ => None,
    }
}

/// The hand-written AVX2 kernels (`dot256.rs`): the same bits as the generic AVX2 build, where
/// the CPU also has F16C (every AVX2 CPU made so far).
#[cfg(target_arch = "x86_64")]
fn avx256_kernel(ty: GgmlType) -> Option<(DotFn, DotMultiFn)> {
    use super::dot256 as k;
    if !is_x86_feature_detected!("f16c") {
        return None;
    }
    macro_rules! pair {
        ($f:ident) => {
            // SAFETY: the CPU supports avx2, fma (the caller's check) and f16c (just above).
            Some((|w, x| unsafe { k::$f::<1>(w, [x])[0] }, |w, xs| unsafe { k::$f::<MULTI>(w, xs) }))
        };
    }
    match ty {
        GgmlType::Q8_0 => pair!(dot_q8_0),
        GgmlType::Q4_0 => pair!(dot_q4_0),
        GgmlType::Q4_1 => pair!(dot_q4_1),
        GgmlType::Q5_0 => pair!(dot_q5_0),
        GgmlType::Q5_1 => pair!(dot_q5_1),
        GgmlType::Q4_K => pair!(dot_q4_k),
        GgmlType::Q5_K => pair!(dot_q5_k),
        GgmlType::Q6_K => pair!(dot_q6_k),
        _ => None,
    }
}

/// Two rows against [`MULTI`] vectors at once (each vector loaded once for both rows); row `r`,
/// column `n` equals the [`DotFn`] result for `rows[r]` and `xs[n]`.
pub(super) type DotMulti2Fn = fn([&[u8]; 2], [&[f32]; MULTI]) -> [[f32; MULTI]; 2];

/// The two-row kernel for `ty` on this CPU, where there is one (AVX-512 block types: 2 rows ×
/// 4 vectors × 2 registers of accumulators; the super-block types make one pass per set).
pub(super) fn dot_kernel_2rows(ty: GgmlType) -> Option<DotMulti2Fn> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::level() == crate::simd::Level::Avx512 && avx512_supported() {
        use super::dot512 as k;
        // SAFETY: the CPU supports the kernels' features (checked just above).
        return match ty {
            GgmlType::Q8_0 => Some(|w, xs| unsafe { k::dot_q8_0::<2, MULTI>(w, xs) }),
            GgmlType::Q4_0 => Some(|w, xs| unsafe { k::dot_q4_0::<2, MULTI>(w, xs) }),
            GgmlType::Q4_1 => Some(|w, xs| unsafe { k::dot_q4_1::<2, MULTI>(w, xs) }),
            GgmlType::Q5_0 => Some(|w, xs| unsafe { k::dot_q5_0::<2, MULTI>(w, xs) }),
            GgmlType::Q5_1 => Some(|w, xs| unsafe { k::dot_q5_1::<2, MULTI>(w, xs) }),
            GgmlType::Q4_K => Some(|w, xs| unsafe { k::dot_q4_k_rows::<2, MULTI>(w, xs) }),
            GgmlType::Q5_K => Some(|w, xs| unsafe { k::dot_q5_k_rows::<2, MULTI>(w, xs) }),
            GgmlType::Q6_K => Some(|w, xs| unsafe { k::dot_q6_k_rows::<2, MULTI>(w, xs) }),
            _ => None,
        };
    }
    let _ = ty;
    None
}

/// AVX-512 with the byte/word and 256-bit forms (and F16C) `dot512.rs` is compiled for.
#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("f16c")
}

/// The fastest dot kernel for `ty` on this CPU (hand-written AVX-512 for the block types, else
/// AVX2+FMA, unless `MEGAGEMMA_SIMD=portable|avx2` caps it or the CPU lacks it, see
/// [`crate::simd::level`]), or `None` when the type is unsupported.
pub(super) fn dot_kernel(ty: GgmlType) -> Option<(DotFn, DotMultiFn)> {
    #[cfg(target_arch = "x86_64")]
    match crate::simd::level() {
        crate::simd::Level::Avx512 if avx512_supported() => return avx512_kernel(ty).or_else(|| avx2_kernel(ty)),
        crate::simd::Level::Avx512 | crate::simd::Level::Avx2 => return avx256_kernel(ty).or_else(|| avx2_kernel(ty)),
        crate::simd::Level::Portable => {}
    }
    portable_kernel(ty)
}

fn checked(ty: GgmlType, bytes: &[u8], x: &[f32], k: Option<(DotFn, DotMultiFn)>) -> Result<f32> {
    let Some((k, _)) = k else {
        bail!("no dot kernel for ggml type {ty}: only {} are supported", supported_list());
    };
    check_row(ty, bytes, x.len())?;
    Ok(k(bytes, x))
}

/// `dot(dequantize(bytes), x)` without materialising the row; `bytes` must encode exactly
/// `x.len()` values of `ty`. Differs from dequantize-then-dot only by f32 accumulation order
/// (well within 1e-5 relative to `Σ|w·x|`). Never allocates.
pub fn dot_row(ty: GgmlType, bytes: &[u8], x: &[f32]) -> Result<f32> {
    checked(ty, bytes, x, dot_kernel(ty))
}

/// [`dot_row`] forced onto the portable (non-SIMD-dispatched) build of the kernel; exists so
/// tests and benchmarks can check and compare both builds on any machine.
pub fn dot_row_portable(ty: GgmlType, bytes: &[u8], x: &[f32]) -> Result<f32> {
    checked(ty, bytes, x, portable_kernel(ty))
}

/// [`dot_row`] forced onto the AVX2+FMA build of the kernel, or `None` where the CPU lacks it;
/// tests check that the hand-written AVX-512 kernels give exactly its bits.
pub fn dot_row_avx2(ty: GgmlType, bytes: &[u8], x: &[f32]) -> Result<Option<f32>> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        return checked(ty, bytes, x, avx2_kernel(ty)).map(Some);
    }
    let _ = (ty, bytes, x);
    Ok(None)
}

/// [`dot_row`] for [`MULTI`] vectors at once (the row is decoded once); each result is
/// bit-identical to `dot_row(ty, bytes, xs[n])`.
pub fn dot_row_multi(ty: GgmlType, bytes: &[u8], xs: [&[f32]; MULTI]) -> Result<[f32; MULTI]> {
    let Some((_, k)) = dot_kernel(ty) else {
        bail!("no dot kernel for ggml type {ty}: only {} are supported", supported_list());
    };
    for x in xs {
        check_row(ty, bytes, x.len())?;
    }
    Ok(k(bytes, xs))
}

/// Two rows of `ty` (the same length) against [`MULTI`] vectors, through the two-row kernel
/// where this CPU has one (else one row at a time); each result is bit-identical to
/// `dot_row(ty, rows[r], xs[n])`.
pub fn dot_rows2_multi(ty: GgmlType, rows: [&[u8]; 2], xs: [&[f32]; MULTI]) -> Result<[[f32; MULTI]; 2]> {
    if rows[0].len() != rows[1].len() {
        bail!("dot_rows2_multi: rows of {} and {} bytes", rows[0].len(), rows[1].len());
    }
    match dot_kernel_2rows(ty) {
        Some(k) => {
            for x in xs {
                check_row(ty, rows[0], x.len())?;
            }
            Ok(k(rows, xs))
        }
        None => Ok([dot_row_multi(ty, rows[0], xs)?, dot_row_multi(ty, rows[1], xs)?]),
    }
}
