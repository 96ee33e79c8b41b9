//! Fused dequantize-and-dot kernels: `dot(row, x)` for one quantized row against an f32 vector,
//! without materialising the dequantized row.
//!
//! Each kernel rebuilds every weight bit-exactly as [`super::dequantize_row`] does (`d·q`,
//! `d·q − m`: the products of small integers and f16-derived scales are exact in f32, so fusing
//! them changes nothing), then accumulates `w·x` into 32 independent f32 lanes summed pairwise
//! at the end. Work is phrased as fixed-size loops over 32-value groups, which LLVM turns into
//! 8-wide SIMD with short dependency chains; blocks a few hundred bytes ahead are prefetched.
//!
//! Every kernel is compiled twice from the same generic source: a portable build (baseline
//! x86-64 is SSE2: no FMA, no byte→int widening) and, on x86-64, an AVX2+FMA build chosen at run
//! time (1.5–3× faster on the dev VM). The FMA build fuses `w·x + acc` (one rounding instead of
//! two), so the builds differ in the last bits of the sum; a process always uses one of them.
//! (An AVX-512 build of the same source was measured slower than AVX2; hand-written AVX2
//! intrinsics for Q4_K only ~10% faster — neither is worth its code.)

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
const PREFETCH_AHEAD: usize = 1024;

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

// ---- plain float rows (block size 1: any length, so a scalar tail handles the remainder) ----

#[inline(always)]
fn dot_floats<M: Madd, const B: usize>(w: &[u8], x: &[f32], load: impl Fn(&[u8; B]) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut wc = w.chunks_exact(B * LANES);
    let mut xc = x.chunks_exact(LANES);
    for (wb, xb) in (&mut wc).zip(&mut xc) {
        prefetch_ahead(wb);
        for i in 0..LANES {
            let v = load(wb[B * i..B * (i + 1)].try_into().unwrap());
            acc[i] = M::madd(v, xb[i], acc[i]);
        }
    }
    let mut tail = 0f32;
    for (wb, &xv) in wc.remainder().chunks_exact(B).zip(xc.remainder()) {
        tail = M::madd(load(wb.try_into().unwrap()), xv, tail);
    }
    hsum(&acc) + tail
}

#[inline(always)]
fn dot_f32<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    dot_floats::<M, 4>(w, x, |b| f32::from_le_bytes(*b))
}

#[inline(always)]
fn dot_f16<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    dot_floats::<M, 2>(w, x, |b| super::blocks::f16_to_f32(u16::from_le_bytes(*b)))
}

#[inline(always)]
fn dot_bf16<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    dot_floats::<M, 2>(w, x, |b| f32::from_bits((u16::from_le_bytes(*b) as u32) << 16))
}

// ---- 32-value blocks ----

#[inline(always)]
fn dot_q8_0<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (blk, xb) in w.chunks_exact(34).zip(x.chunks_exact(32)) {
        prefetch_ahead(blk);
        let d = f16_at(blk, 0);
        let qs: &[u8; 32] = blk[2..34].try_into().unwrap();
        for j in 0..32 {
            acc[j] = M::madd((qs[j] as i8) as f32 * d, xb[j], acc[j]);
        }
    }
    hsum(&acc)
}

#[inline(always)]
fn dot_q4_0<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (blk, xb) in w.chunks_exact(18).zip(x.chunks_exact(32)) {
        prefetch_ahead(blk);
        let d = f16_at(blk, 0);
        let qs: &[u8; 16] = blk[2..18].try_into().unwrap();
        for j in 0..16 {
            acc[j] = M::madd(((qs[j] & 0xf) as i32 - 8) as f32 * d, xb[j], acc[j]);
            acc[j + 16] = M::madd(((qs[j] >> 4) as i32 - 8) as f32 * d, xb[j + 16], acc[j + 16]);
        }
    }
    hsum(&acc)
}

#[inline(always)]
fn dot_q4_1<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (blk, xb) in w.chunks_exact(20).zip(x.chunks_exact(32)) {
        prefetch_ahead(blk);
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let qs: &[u8; 16] = blk[4..20].try_into().unwrap();
        for j in 0..16 {
            acc[j] = M::madd(M::madd((qs[j] & 0xf) as f32, d, m), xb[j], acc[j]);
            acc[j + 16] = M::madd(M::madd((qs[j] >> 4) as f32, d, m), xb[j + 16], acc[j + 16]);
        }
    }
    hsum(&acc)
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
fn dot_q5_0<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (blk, xb) in w.chunks_exact(22).zip(x.chunks_exact(32)) {
        prefetch_ahead(blk);
        let d = f16_at(blk, 0);
        let q = q5_values(blk[2..6].try_into().unwrap(), blk[6..22].try_into().unwrap());
        // (q - 16)·d as q·d − 16·d: both products and their difference are exact in f32
        // (5-bit × 11-bit significands), so this equals the dequantized weight bit for bit.
        let m = -16.0 * d;
        for j in 0..32 {
            acc[j] = M::madd(M::madd(q[j] as f32, d, m), xb[j], acc[j]);
        }
    }
    hsum(&acc)
}

#[inline(always)]
fn dot_q5_1<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (blk, xb) in w.chunks_exact(24).zip(x.chunks_exact(32)) {
        prefetch_ahead(blk);
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let q = q5_values(blk[4..8].try_into().unwrap(), blk[8..24].try_into().unwrap());
        for j in 0..32 {
            acc[j] = M::madd(M::madd(q[j] as f32, d, m), xb[j], acc[j]);
        }
    }
    hsum(&acc)
}

// ---- 256-value super-blocks ----

/// Q4_K and Q5_K share everything but the 5th bit (`Q5`: bit `s` of `qh[l]` belongs to value `l`
/// of sub-block `s`). Two accumulator sets (low/high nibble sub-blocks) keep FMA chains short.
#[inline(always)]
fn dot_k4<M: Madd, const Q5: bool>(w: &[u8], x: &[f32]) -> f32 {
    let (bs, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
    let (mut acc_lo, mut acc_hi) = ([0f32; LANES], [0f32; LANES]);
    for (blk, xs) in w.chunks_exact(bs).zip(x.chunks_exact(256)) {
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
            let x1: &[f32; 32] = xs[64 * c..64 * c + 32].try_into().unwrap();
            let x2: &[f32; 32] = xs[64 * c + 32..64 * c + 64].try_into().unwrap();
            for l in 0..32 {
                acc_lo[l] = M::madd(M::madd(d1, lo[l] as f32, -m1), x1[l], acc_lo[l]);
                acc_hi[l] = M::madd(M::madd(d2, hi[l] as f32, -m2), x2[l], acc_hi[l]);
            }
        }
    }
    hsum2(&acc_lo, &acc_hi)
}

#[inline(always)]
fn dot_q4_k<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    dot_k4::<M, false>(w, x)
}

#[inline(always)]
fn dot_q5_k<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    dot_k4::<M, true>(w, x)
}

/// 32 Q6_K values whose first and last 16 have scales `s0` and `s1`.
#[inline(always)]
fn q6k_pass<M: Madd>(acc: &mut [f32; LANES], q: &[i8; 32], x: &[f32; 32], s0: f32, s1: f32) {
    for j in 0..16 {
        acc[j] = M::madd(s0 * q[j] as f32, x[j], acc[j]);
    }
    for j in 16..32 {
        acc[j] = M::madd(s1 * q[j] as f32, x[j], acc[j]);
    }
}

#[inline(always)]
fn dot_q6_k<M: Madd>(w: &[u8], x: &[f32]) -> f32 {
    let (mut acc_a, mut acc_b) = ([0f32; LANES], [0f32; LANES]);
    for (blk, xs) in w.chunks_exact(210).zip(x.chunks_exact(256)) {
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
                q6k_pass::<M>(
                    &mut acc_a,
                    q[32 * p0..32 * p0 + 32].try_into().unwrap(),
                    xs[128 * h + 32 * p0..128 * h + 32 * p0 + 32].try_into().unwrap(),
                    scale(sa),
                    scale(sa + 1),
                );
                q6k_pass::<M>(
                    &mut acc_b,
                    q[32 * p1..32 * p1 + 32].try_into().unwrap(),
                    xs[128 * h + 32 * p1..128 * h + 32 * p1 + 32].try_into().unwrap(),
                    scale(sb),
                    scale(sb + 1),
                );
            }
        }
    }
    hsum2(&acc_a, &acc_b)
}

/// A dot kernel: `bytes` encodes exactly `x.len()` values (checked by the caller).
pub(super) type DotFn = fn(&[u8], &[f32]) -> f32;

macro_rules! kernels {
    ($($ty:ident => $f:ident),* $(,)?) => {
        fn portable_kernel(ty: GgmlType) -> Option<DotFn> {
            match ty {
                $(GgmlType::$ty => Some(|w, x| $f::<Unfused>(w, x)),)*
                _ => None,
            }
        }

        #[cfg(target_arch = "x86_64")]
        mod avx2 {
            use super::*;
            $(
                #[target_feature(enable = "avx2,fma")]
                pub(super) unsafe fn $f(w: &[u8], x: &[f32]) -> f32 {
                    super::$f::<Fused>(w, x)
                }
            )*
        }

        /// Only called after `is_x86_feature_detected!` confirmed AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        fn avx2_kernel(ty: GgmlType) -> Option<DotFn> {
            match ty {
                // SAFETY: the CPU supports avx2+fma (checked by the only caller).
                $(GgmlType::$ty => Some(|w, x| unsafe { avx2::$f(w, x) }),)*
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

/// The fastest dot kernel for `ty` on this CPU (AVX2+FMA unless `MEGAGEMMA_SIMD=portable` or the
/// CPU lacks it, see [`crate::simd::level`]), or `None` when the type is unsupported.
pub(super) fn dot_kernel(ty: GgmlType) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::level() != crate::simd::Level::Portable {
        return avx2_kernel(ty);
    }
    portable_kernel(ty)
}

fn checked(ty: GgmlType, bytes: &[u8], x: &[f32], k: Option<DotFn>) -> Result<f32> {
    let Some(k) = k else {
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
